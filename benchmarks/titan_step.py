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

Suffix ``.compile``: ``torch.compile(moe, fullgraph=True)`` (default mode), from a reset
dynamo. Before timing each row's output and gradients are compared with ``titan``'s. Reported: the median step time
(``alltoall_ops.testing.timer``) and the host time to issue a step (``host_us``).
"""

from __future__ import annotations

import argparse
import functools

import torch

from alltoall_ops import SymmBuffers  # first: without CUDA it sets TRITON_INTERPRET before triton loads
from alltoall_ops.testing import host_us, timer
from alltoall_ops.torchtitan import TokenDispatcher
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.titan_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--out", default=None, help="folder for titan_step.json / titan_step.md")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="T of each run (default: the shape's)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    shape = SHAPES["gpu" if cuda else "smoke"]
    time_us = timer(device)
    rows = []
    for T in args.tokens or shape["T"]:
        torch.manual_seed(T)
        reference = build("titan", shape, T, device, dtype)
        with torch.no_grad():
            for w in reference.parameters():
                w.normal_(0, 0.02)
        x = torch.randn(1, T, shape["D"], device=device, dtype=dtype)
        grad = torch.randn_like(x)
        want = None
        for name in DISPATCHERS:
            for compiled in (False, True):
                moe = build(name, shape, T, device, dtype)
                moe.load_state_dict(reference.state_dict())  # copies the values in
                torch._dynamo.reset()  # a fresh dynamo per row: the rows share MoE's code
                step = torch.compile(moe, fullgraph=True) if compiled else moe
                out = train_step(moe, step, x, grad)
                grads = [w.grad for w in moe.parameters()]
                if want is None:
                    want = out, grads
                for got, ref in zip([out, *grads], [want[0], *want[1]]):  # bf16: sums in other orders
                    error = float((got.float() - ref.float()).norm() / ref.float().norm())
                    assert error < 1e-2, f"{name}: relative error {error:.2e} against titan's output or a gradient"
                row = f"{name}.compile" if compiled else name
                one_step = functools.partial(train_step, moe, step, x, grad)
                us, host = time_us(one_step), host_us(one_step, n=10)
                rows.append(dict(T=T, row=row, step_us=us, host_us=host))
                print(f"T={T:6d} {row:20s} {us:10.1f} us/step   host {host:10.1f} us", flush=True)
    titan = {(r["T"], r["row"].removeprefix("titan")): r["step_us"] for r in rows if r["row"].startswith("titan")}
    device_name = torch.cuda.get_device_name() if cuda else "CPU"
    what = (f"torchtitan MoE, D={shape['D']}, FF={shape['F']}, E={shape['E']}, top-{shape['K']}, fwd+bwd, "
            f"{dtype}, {device_name}, torch {torch.__version__}")
    lines = [f"# One step of torchtitan's MoE by token dispatcher, EP = 1 ({what})", "",
             "| T | row | step (us) | host (us) | vs titan |", "|---|---|---|---|---|"]
    for r in rows:
        suffix = ".compile" if r["row"].endswith(".compile") else ""
        ratio = r["step_us"] / titan[r["T"], suffix]
        lines.append(f"| {r['T']} | {r['row']} | {r['step_us']:.1f} | {r['host_us']:.1f} | {ratio:.2f}x |")
    save_step_table(args.out, "titan_step", what, rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
