"""One training step (forward, loss, backward) of a small Hugging Face transformers MoE model on
one device, with each expert-parallel implementation installed on every experts module at
EP = 1, in one run:

    python -m benchmarks.hf_step --out $OUT      # one GPU: bf16, grouped_mm experts
    python -m benchmarks.hf_step --smoke         # every row on the CPU, tiny shapes, fp32
    python -m benchmarks.hf_step --out $OUT --rounds 5 --profile alltoall_ops.compile plain.compile

Rows (the same weights and tokens in each):
- ``plain``: the model with no expert parallelism (the experts' own forward on the router's ids):
  what a single-GPU user runs.
- ``all_to_all``: transformers' built-in ``ep_implementation="all_to_all"`` (sorts the slots,
  reads the split sizes on the host, ``all_to_all_single`` on a group of one).
- ``alltoall_ops``: ours (the local backend on a group of one: no host sync, static rows).
- ``alltoall_ops_symm_mem``: ours over ``SymmBuffers`` for the step's tokens (W = 1).

Each implementation is installed as transformers installs it (``EpDispatchExpertsParallel``
with ``ep_size = 1`` meshes; ``ep_size=1`` in a ``DistributedConfig`` installs nothing).
Suffix ``.compile``: ``torch.compile`` (default mode; the built-in one breaks the graph at its
host read) of the model's forward, after one eager step, through a function with a code object
of its own per row (``benchmarks._rounds.own_code``: the rows share the model's code, and
dynamo keeps compiled code on code objects, so without it a row would run on, or check the guards
of, an earlier row's cache entries); the graphs and graph breaks that its first compiled step made
are reported. Before timing, each row's loss and gradients are compared with ``plain``'s.

Every row is compiled and checked first; then ``--rounds`` rounds (default 5) each time every
row once (``alltoall_ops.testing.timer``, then the host time to issue a step), in a fresh order
each round, with no recompilation allowed (``error_on_recompile``). Reported per row: the
medians over rounds of the step time and of the host time to issue a step (``host_us``; equal
to the step time when host-bound), and each round's step time over that round's ``plain`` row
(eager or compiled): the median and the range over rounds. ``--rows`` times a subset (the plain
rows always); ``--profile ROW`` prints a ``torch.profiler`` table (CPU, and CUDA on a GPU) of a
few steps of ROW after the timing.
"""

from __future__ import annotations

import argparse
import copy
import functools

import torch

from alltoall_ops.testing import host_us, one_rank_group, timer
from benchmarks._rounds import interleave, own_code, profile, ratio_cells, rounds_note, summarize
from benchmarks._table import save_step_table
from examples.train_hf_moe import build_config, next_token_loss, tokens

IMPLEMENTATIONS = ("plain", "all_to_all", "alltoall_ops", "alltoall_ops_symm_mem")
SHAPES = {"gpu": dict(hidden=1024, ffn=1408, head_dim=64, vocab=4096, batch=8, seq=512),
          "smoke": dict(hidden=64, ffn=96, head_dim=16, vocab=128, batch=2, seq=16)}


def install(model: torch.nn.Module, name: str, mesh) -> torch.nn.Module:
    """``model`` with ``ep_implementation=name`` on every experts module, EP = 1 (``plain``: as is)."""
    from transformers.distributed.expert_parallel import EpDispatchExpertsParallel

    if name != "plain":
        style = EpDispatchExpertsParallel()
        for layer in model.model.layers:
            layer.mlp.experts._is_expert_parallel = True  # as transformers' expert sharding marks them
            style.install_forward(layer.mlp.experts, mesh, tp_mesh=mesh, ep_implementation=name)
    return model


def train_step(model, forward, ids_BS: torch.Tensor) -> torch.Tensor:
    """Forward (``forward(ids) -> logits``: the model's, or its compiled copy), next-token loss,
    backward (gradients set to None first); returns the loss."""
    model.zero_grad(set_to_none=True)
    loss = next_token_loss(forward(ids_BS), ids_BS)
    loss.backward()
    return loss.detach()


def forward_of(model):
    def forward(ids_BS: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids_BS).logits

    return forward


def grads(model) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("mixtral", "qwen3_moe"), default="mixtral")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--out", default=None, help="folder for hf_step.json / hf_step.md")
    p.add_argument("--rounds", type=int, default=5, help="rounds of interleaved timing (every row once a round)")
    p.add_argument("--rows", nargs="+", default=None, help="rows to time (default all; plain rows always)")
    p.add_argument("--profile", nargs="+", default=[], metavar="ROW",
                   help="after timing, a torch.profiler table of a few steps of each ROW (e.g. alltoall_ops.compile)")
    args = p.parse_args(argv)
    from alltoall_ops.integrations import transformers as a2a_hf
    from torch._dynamo.utils import counters  # after alltoall_ops: it imports triton
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SHAPES["gpu" if cuda else "smoke"]
    names = [f"{n}{s}" for n in IMPLEMENTATIONS for s in ("", ".compile")]
    wanted = set(names if args.rows is None else [*args.rows, "plain", "plain.compile"]) | set(args.profile)
    unknown = wanted - set(names)
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}: rows are {names}")
    with one_rank_group(device):
        mesh = init_device_mesh(device.type, (1,))
        B, S = shape["batch"], shape["seq"]
        a2a_hf.register(max_tokens_per_rank=B * S)
        config, cls = build_config(args.model, vocab=shape["vocab"], hidden=shape["hidden"], ffn=shape["ffn"],
                                   head_dim=shape["head_dim"])
        config._experts_implementation = "grouped_mm" if cuda else "batched_mm"
        torch.manual_seed(0)
        base = cls(config).to(device, dtype)
        ids = tokens(0, B, S, config.vocab_size).to(device)
        time_us = timer(device)
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
        steps, info, want = {}, {}, None
        torch._dynamo.reset()
        for name in IMPLEMENTATIONS:
            if not wanted & {name, f"{name}.compile"}:
                continue
            model = install(copy.deepcopy(base), name, mesh)  # one model for the eager and the compiled row
            train_step(model, forward_of(model), ids)  # eager first: symm_mem makes its buffers here
            for compiled in (False, True):
                row = f"{name}.compile" if compiled else name
                if row not in wanted:
                    continue
                # each compiled row through a code object of its own: no row runs on (or checks the
                # guards of) another row's cache entries, and no dynamo reset is needed between rows
                counters.clear()
                forward = torch.compile(own_code(forward_of(model), row)) if compiled else forward_of(model)
                loss = train_step(model, forward, ids)  # compiles
                graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
                if want is None:
                    want = loss, grads(model)
                torch.testing.assert_close(loss, want[0], **tol)
                for g, w in zip(grads(model), want[1]):
                    torch.testing.assert_close(g, w, **tol)
                steps[row] = functools.partial(train_step, model, forward, ids)
                info[row] = dict(graphs=graphs, graph_breaks=breaks)
                print(f"{row:30s} checked against plain: {graphs} graphs, {breaks} graph breaks", flush=True)
        samples = interleave(steps, args.rounds, time_us, functools.partial(host_us, n=10))
        stats = summarize(samples, lambda row: "plain.compile" if row.endswith(".compile") else "plain")
        rows = [dict(row=row, **info[row], **stats[row]) for row in steps]
        device_name = torch.cuda.get_device_name() if cuda else "CPU"
        what = (f"{args.model}, 2 layers, H={shape['hidden']}, F={shape['ffn']}, 8 experts, top-2, "
                f"T={B * S} tokens a step, {dtype}, {device_name}, torch {torch.__version__}")
        lines = [f"# One training step of a transformers model, EP = 1 ({what})", "",
                 rounds_note(args.rounds, "plain"),
                 "", "| row | step (us) | host (us) | vs plain | vs plain, min-max | graphs | graph breaks |",
                 "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['row']} | {r['step_us']:.1f} | {r['host_us']:.1f} | {ratio_cells(r)} "
                         f"| {r['graphs']} | {r['graph_breaks']} |")
        save_step_table(args.out, "hf_step", what, rows, lines, rounds=args.rounds)
        for row in args.profile:
            profile(row, steps[row])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
