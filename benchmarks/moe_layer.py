"""A whole MoE layer, ours against the same layer written in plain PyTorch, in one run: forward
at the decode shape, forward and forward + backward at the training shape, eager, compiled, and
compiled with ``mode="reduce-overhead"`` (CUDA graphs).

    python -m benchmarks.moe_layer --out $OUT          # on a GPU
    python -m benchmarks.moe_layer --smoke              # every path on the CPU, tiny shapes

Layers (T, H, F, E, K) = (T, 2048, 1408, 64, 6), SwiGLU, one GPU, bf16; the experts are the same
``MoE.experts`` (``torch._grouped_mm`` on sm90+) in every row, so rows differ in dispatch and
combine only:
- ``plain``: argsort of the slots + ``index_select``, experts, fp32 ``index_add_`` of the
  weighted rows: what a user writes by hand, with no host sync (the row count is T * K).
- ``local``: ``alltoall_ops.moe.MoE`` with ``backend="local"`` (no host sync; C = T * K rows).
- ``symm``: ``backend="symm_mem"`` with ``SymmBuffers`` (no host sync; capacity C = T * K).
- ``symm_peers``: the same over buffers that take the path with peers against themselves
  (``allocator="symmetric"`` in a one-rank group: barrier kernels, metadata put, tags, stage), what
  every rank of a multi-GPU run launches; on the CPU the shared-memory stand-in.

Suffixes: ``.compile`` (fullgraph), ``.compile.graph`` (``mode="reduce-overhead"``, CUDA graph
trees), ``.compile.cudagraph`` (the compiled forward captured by hand with ``torch.cuda.graph``
and replayed: inference).

Before timing, every row's outputs (and gradients) are compared with the eager ``plain`` layer,
and every ``*.graph`` row is checked for capture: inductor's cudagraph skips, and the CUDA graph
and kernel launches of a profiled step, are noted; a row that is not captured says so. Then the
rows of a shape are timed in ``--rounds`` interleaved rounds (every row once a round, a fresh
order each round: ``benchmarks._rounds``), so a slow spell of the host lands on every row alike.
Each row reports the medians over rounds of the step time (CUDA events,
``triton.testing.do_bench``) and of the host time to issue one step (perf_counter over 20 steps
before the synchronisation; equal to the step time when host-bound), and each round's step time
over that round's ``plain.compile`` row of the same op (median and range).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import alltoall_ops as a2a
from alltoall_ops.groups import NO_GROUP
from alltoall_ops.moe import MoE
from alltoall_ops.testing import host_us, one_rank_group, timer

from ._rounds import interleave, own_code, rounds_note, summarize
from .bench import Captured

MOE_SHAPES = {"decode": (128, 2048, 1408, 64, 6), "train": (4096, 2048, 1408, 64, 6),
              "train16k": (16384, 2048, 1408, 64, 6)}
SMOKE_SHAPES = {"decode": (8, 32, 48, 8, 2), "train": (64, 32, 48, 8, 2), "train16k": (128, 32, 48, 8, 2)}


def plain_forward(layer: MoE, x_TH: torch.Tensor) -> torch.Tensor:
    """The layer's function with hand-written dispatch and combine (one rank, no padding)."""
    topk_idx_TK, weights_TK = layer.router(x_TH)
    T, K = topk_idx_TK.shape
    order_N = topk_idx_TK.reshape(-1).argsort(stable=True)
    token_N = order_N // K
    tokens_per_expert_E = torch.zeros(layer.num_experts, dtype=torch.int64, device=x_TH.device)
    tokens_per_expert_E.scatter_add_(0, topk_idx_TK.reshape(-1), torch.ones_like(order_N))
    out_NH = layer.experts(x_TH.index_select(0, token_N), tokens_per_expert_E)
    weighted_NH = out_NH.float() * weights_TK.reshape(-1)[order_N].float()[:, None]
    y_TH = torch.zeros(x_TH.shape, dtype=torch.float32, device=x_TH.device).index_add_(0, token_N, weighted_NH)
    return y_TH.to(x_TH.dtype)


def _own_frame(fn: Callable, tag: str) -> Callable:
    """``fn(x)`` in a frame of its own (``own_code``): every compiled row keeps its own dynamo
    cache, so rows of layers sharing ``MoE.forward`` neither pile up to the recompile limit nor
    check each other's guards on every call."""
    def call(x_TH):
        return fn(x_TH)
    return own_code(call, tag)


def kernels_outside_graphs(step: Callable[[], object]) -> tuple[int, int]:
    """(CUDA graph launches, kernel launches outside graphs) of one profiled step."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    graphs = sum(n == "cudaGraphLaunch" for n in names)
    kernels = sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
                  for n in names)
    return graphs, kernels


LAYERS = ("plain", "local", "symm", "symm_peers")


def build_layers(shape, device: torch.device, dtype: torch.dtype,
                 wanted: tuple[str, ...]) -> dict[str, tuple[MoE, Callable]]:
    """label -> (module, forward) of each wanted layer (``LAYERS``) at ``shape`` (T, H, F, E, K),
    all with the same weights (those of the local layer, made first from torch's generator).
    ``symm_peers`` needs a process group (``one_rank_group``)."""
    T, H, F, E, K = shape
    local = MoE(H, F, E, K, backend="local", group=NO_GROUP, device=device, dtype=dtype)
    layers = {"plain": (local, lambda x_: plain_forward(local, x_)), "local": (local, local)}
    # NB: only symm_peers' buffers take the one-rank process group (the others: no group at all)
    for label, group, allocator in (("symm", NO_GROUP, "auto"), ("symm_peers", None, "symmetric")):
        if label in wanted:
            bufs = a2a.SymmBuffers(T, H, K, E, dtype=dtype, device=device, group=group, allocator=allocator)
            symm = MoE(H, F, E, K, backend="symm_mem", buffers=bufs, group=group, device=device, dtype=dtype)
            symm.load_state_dict(local.state_dict())
            layers[label] = (symm, symm)
    return {label: layer for label, layer in layers.items() if label in wanted}


def run_shape(name: str, shape, device: torch.device, backend: str, time_us, rounds: int, rows: list, notes: list,
              wanted: tuple[str, ...]) -> None:
    """Every row of one shape: built, compiled, checked against the eager plain layer and (graph
    rows) for capture, then timed in ``rounds`` interleaved rounds (``_rounds.interleave``) with
    each round's ratio to that round's ``plain.compile`` row of the same op."""
    T, H, F, E, K = shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(T + H)
    layers = build_layers(shape, device, dtype, wanted)
    x = torch.randn(T, H, device=device, dtype=dtype)
    grad_y = torch.randn(T, H, device=device, dtype=dtype)
    ops = ("fwd", "fwd+bwd") if name.startswith("train") else ("fwd",)
    reference: dict = {}  # op -> the eager plain layer's result
    steps: dict[str, Callable[[], object]] = {}  # "impl op" -> one step
    first_calls_s: dict[str, float] = {}

    def check(row: str, op: str, got: torch.Tensor) -> None:
        want = reference.setdefault(op, got.detach().clone())  # the first row is plain eager
        err = float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))
        if err > 2e-2:
            raise AssertionError(f"{name} {row}: relative error {err:.3g} against plain eager")

    for label, (module, fn) in layers.items():
        variants = [(label, fn)]
        variants.append((f"{label}.compile", torch.compile(_own_frame(fn, label), backend=backend, fullgraph=True)))
        if device.type == "cuda":
            variants.append((f"{label}.compile.graph", torch.compile(_own_frame(fn, f"{label}.graph"),
                                                                     backend=backend, fullgraph=True,
                                                                     mode="reduce-overhead")))
        for impl, f in variants:
            graphed = impl.endswith(".graph")
            for op in ops:
                xin = x.detach().clone().requires_grad_(op == "fwd+bwd")

                def step(f=f, op=op, xin=xin, graphed=graphed, module=module):
                    if graphed:
                        torch.compiler.cudagraph_mark_step_begin()
                    if op == "fwd":
                        with torch.no_grad():
                            return f(xin)
                    module.zero_grad(set_to_none=True)
                    xin.grad = None
                    f(xin).backward(grad_y)
                    return xin.grad

                row = f"{impl} {op}"
                torch._dynamo.utils.counters.clear()
                t0 = time.perf_counter()
                for _ in range(3):  # graph trees record on the second call, replay from the third
                    got = step()
                compile_s = round(time.perf_counter() - t0, 1)
                check(row, op, got)
                if graphed:
                    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
                    graphs, outside = kernels_outside_graphs(step)
                    captured = not skips and graphs > 0
                    notes.append(f"{name} {row}: {'captured' if captured else 'NOT CAPTURED'}: {skips} cudagraph "
                                 f"skips, {graphs} graph launches, {outside} kernel launches outside graphs")
                    if not captured:
                        row = f"{impl} (not captured) {op}"
                steps[row], first_calls_s[row] = step, compile_s
        if device.type == "cuda":
            # The compiled forward captured by hand (torch.cuda.graph), replayed: inference.
            compiled = torch.compile(_own_frame(fn, f"{label}.cudagraph"), backend=backend, fullgraph=True)

            def forward(stream, compiled=compiled):
                with torch.no_grad():
                    return compiled(x)

            captured = Captured(forward, cuda=True)
            row = f"{label}.compile.cudagraph fwd"
            check(row, "fwd", captured.run())
            steps[row], first_calls_s[row] = captured.replay, 0.0

    samples = interleave(steps, rounds, time_us, host_us, label=f"{name} T={T} ")
    summary = summarize(samples, lambda row: "plain.compile " + row.rsplit(" ", 1)[1])
    for row, s in summary.items():
        impl, op = row.rsplit(" ", 1)
        rows.append({"shape": name, "T": T, "impl": impl, "op": op, "us": s["step_us"], "host_us": s["host_us"],
                     "vs_plain_compile": s["ratio"], "vs_min": s["ratio_min"], "vs_max": s["ratio_max"],
                     "us_by_round": s["step_us_by_round"], "first_calls_s": first_calls_s[row]})


def markdown(rows: list, notes: list, rounds: int) -> str:
    lines = [rounds_note(rounds, "plain.compile", " of a shape"), "",
             "| shape | impl | op | time (us) | host (us) | / plain compiled | min-max |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} T={r['T']} | `{r['impl']}` | {r['op']} | {r['us']:.1f} | {r['host_us']:.1f} "
                     f"| {r['vs_plain_compile']:.2f}x | {r['vs_min']:.2f}-{r['vs_max']:.2f}x |")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for moe_layer.json / moe_layer.md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (times mean nothing)")
    parser.add_argument("--shapes", nargs="*", default=list(MOE_SHAPES), choices=list(MOE_SHAPES))
    parser.add_argument("--rounds", type=int, default=5, help="rounds of interleaved timing (every row once a round)")
    parser.add_argument("--layers", nargs="*", default=list(LAYERS), choices=LAYERS,
                        help="which layers (plain, the baseline, is the reference of every check: keep it)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    backend = "aot_eager" if device.type == "cpu" else "inductor"
    shapes = SMOKE_SHAPES if device.type == "cpu" else MOE_SHAPES
    rows: list = []
    notes: list = []
    with one_rank_group(device):  # the process group symm_peers' buffers take
        for name in args.shapes:
            run_shape(name, shapes[name], device, backend, timer(device), args.rounds, rows, notes, tuple(args.layers))
            torch._dynamo.reset()
    text = markdown(rows, notes, args.rounds)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "moe_layer.json"), "w") as f:
            json.dump({"rows": rows, "notes": notes, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}, f, indent=1)
        with open(os.path.join(args.out, "moe_layer.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
