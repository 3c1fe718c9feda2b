"""One training step (forward, backward) of torchtitan's own MoE (0.3.0: ``TokenChoiceTopKRouter``,
``GroupedExperts`` on ``torch._grouped_mm``, no shared experts) on one device, with each token
dispatcher in its config, in one run:

    python -m benchmarks.titan_step --out $OUT     # one GPU: bf16, D 2048, FF 1408, E 64, K 6
    python -m benchmarks.titan_step --smoke        # every row on the CPU, tiny shapes

Rows (the same weights and tokens in each, T tokens a step):
- ``titan``: torchtitan's ``LocalTokenDispatcher`` (argsort, gather, scatter_add): what an EP = 1
  torchtitan run uses.
- ``local``: ``alltoall_ops.torchtitan.TokenDispatcher`` with the local backend.
- ``symm_mem``: the same over ``SymmBuffers`` for the step's tokens (W = 1).

Suffix ``.compile``: ``torch.compile(lambda x: moe(x), fullgraph=True)`` (default mode) through a
code object of its own per row (``benchmarks._rounds.own_code``: the rows share MoE's code, and
dynamo keeps compiled code on code objects). Before timing each row's output and gradients are
compared with ``titan``'s. Then, per T, ``--rounds`` rounds (default 5) each time every row once
(``alltoall_ops.testing.timer``, then the host time to issue a step, ``host_us``), in a fresh
order each round, with no recompilation allowed. Reported per row: the medians over rounds, and
each round's step time over that round's ``titan`` row (eager or compiled): the median and the
range over rounds. ``--profile ROW`` prints a ``torch.profiler`` table of a few steps of ROW.
"""

from __future__ import annotations

import argparse
import functools

import torch

from alltoall_ops import SymmBuffers  # first: without CUDA it sets TRITON_INTERPRET before triton loads
from alltoall_ops.testing import host_us, timer
from alltoall_ops.torchtitan import TokenDispatcher
from benchmarks._rounds import interleave, own_code, profile, ratio_cells, rounds_note, summarize
from benchmarks._table import save_step_table
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import MoE, RoutedExperts, GroupedExperts, TokenChoiceTopKRouter
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

SHAPES = {"gpu": dict(D=2048, F=1408, E=64, K=6, T=(512, 4096, 16384)),
          "smoke": dict(D=64, F=96, E=8, K=2, T=(32,))}
DISPATCHERS = ("titan", "local", "symm_mem")


def build(dispatcher: str, shape: dict, T: int, device: torch.device, dtype: torch.dtype) -> MoE:
    """torchtitan's MoE with ``dispatcher``'s config (random weights: the caller seeds)."""
    D, E, K = shape["D"], shape["E"], shape["K"]
    if dispatcher == "titan":
        config = LocalTokenDispatcher.Config(num_experts=E, top_k=K)
    else:
        buffers = SymmBuffers(T, D, K, E, dtype=dtype, device=device) if dispatcher == "symm_mem" else None
        config = TokenDispatcher.Config(num_experts=E, top_k=K, backend=dispatcher, buffers=buffers)
    moe = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=shape["F"], num_experts=E),
            token_dispatcher=config),
        router=TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=D, out_features=E),
                                            top_k=K, score_func="softmax", route_norm=True),
    ).build()
    return moe.to(device, dtype)


def train_step(moe: MoE, step, x_BLD: torch.Tensor, grad_BLD: torch.Tensor) -> torch.Tensor:
    """Forward and backward (gradients set to None first); returns the output."""
    moe.zero_grad(set_to_none=True)
    out = step(x_BLD)
    out.backward(grad_BLD)
    return out.detach()


def forward_of(moe: MoE):
    def forward(x_BLD: torch.Tensor) -> torch.Tensor:
        return moe(x_BLD)

    return forward


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.titan_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--out", default=None, help="folder for titan_step.json / titan_step.md")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="T of each run (default: the shape's)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of interleaved timing (every row once a round)")
    p.add_argument("--profile", nargs="+", default=[], metavar="ROW",
                   help="after timing each T, a torch.profiler table of a few steps of each ROW (e.g. local.compile)")
    args = p.parse_args(argv)
    names = [f"{n}{s}" for n in DISPATCHERS for s in ("", ".compile")]
    if set(args.profile) - set(names):
        raise SystemExit(f"unknown rows {sorted(set(args.profile) - set(names))}: rows are {names}")
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    shape = SHAPES["gpu" if cuda else "smoke"]
    time_us = timer(device)
    rows = []
    torch._dynamo.reset()
    for T in args.tokens or shape["T"]:
        torch.manual_seed(T)
        reference = build("titan", shape, T, device, dtype)
        with torch.no_grad():
            for w in reference.parameters():
                w.normal_(0, 0.02)
        x = torch.randn(1, T, shape["D"], device=device, dtype=dtype)
        grad = torch.randn_like(x)
        want, steps = None, {}
        for name in DISPATCHERS:
            moe = build(name, shape, T, device, dtype)  # one layer for the eager and the compiled row
            moe.load_state_dict(reference.state_dict())  # copies the values in
            for compiled in (False, True):
                row = f"{name}.compile" if compiled else name
                # each compiled row through a code object of its own (the rows share MoE's code):
                # no dynamo reset between rows, which would throw the rows compiled before away
                step = torch.compile(own_code(forward_of(moe), f"T{T}_{row}"), fullgraph=True) if compiled else moe
                out = train_step(moe, step, x, grad)
                grads = [w.grad for w in moe.parameters()]
                if want is None:
                    want = out, grads
                for got, ref in zip([out, *grads], [want[0], *want[1]]):  # bf16: sums in other orders
                    error = float((got.float() - ref.float()).norm() / ref.float().norm())
                    assert error < 1e-2, f"{name}: relative error {error:.2e} against titan's output or a gradient"
                steps[row] = functools.partial(train_step, moe, step, x, grad)
        del reference
        samples = interleave(steps, args.rounds, time_us, functools.partial(host_us, n=10), label=f"T={T} ")
        stats = summarize(samples, lambda row: "titan.compile" if row.endswith(".compile") else "titan")
        rows += [dict(T=T, row=row, **stats[row]) for row in steps]
        for row in args.profile:
            profile(f"T={T} {row}", steps[row])
        del steps, samples
    device_name = torch.cuda.get_device_name() if cuda else "CPU"
    what = (f"torchtitan MoE, D={shape['D']}, FF={shape['F']}, E={shape['E']}, top-{shape['K']}, fwd+bwd, "
            f"{dtype}, {device_name}, torch {torch.__version__}")
    lines = [f"# One step of torchtitan's MoE by token dispatcher, EP = 1 ({what})", "",
             rounds_note(args.rounds, "titan", " of a T"), "",
             "| T | row | step (us) | host (us) | vs titan | vs titan, min-max |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['T']} | {r['row']} | {r['step_us']:.1f} | {r['host_us']:.1f} | {ratio_cells(r)} |")
    save_step_table(args.out, "titan_step", what, rows, lines, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
