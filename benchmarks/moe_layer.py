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
and kernel launches of a profiled step, are noted; a row that is not captured says so. Each row reports the median time
of a step (CUDA events, ``triton.testing.do_bench``) and the host time to issue one step
(perf_counter over 20 steps before the synchronisation; equal to the step time when host-bound).
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

from ._rounds import own_code
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


def run_shape(name: str, shape, device: torch.device, backend: str, time_us, rows: list, notes: list,
              wanted: tuple = LAYERS) -> None:
    T, H, F, E, K = shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(T + H)
    local = MoE(H, F, E, K, backend="local", group=NO_GROUP, device=device, dtype=dtype)
    layers = {"plain": (local, lambda x_: plain_forward(local, x_)), "local": (local, local)}
    # NB: only symm_peers' buffers take the one-rank process group (the others: no group at all)
    for label, group, allocator in (("symm", NO_GROUP, "auto"), ("symm_peers", None, "symmetric")):
        if label in wanted:
            bufs = a2a.SymmBuffers(T, H, K, E, dtype=dtype, device=device, group=group, allocator=allocator)
            symm = MoE(H, F, E, K, backend="symm_mem", buffers=bufs, group=group, device=device, dtype=dtype)
            symm.load_state_dict(local.state_dict())
            layers[label] = (symm, symm)
    layers = {label: layer for label, layer in layers.items() if label in wanted}
    x = torch.randn(T, H, device=device, dtype=dtype)
    grad_y = torch.randn(T, H, device=device, dtype=dtype)
    training = name.startswith("train")
    reference: dict = {}  # op -> the eager plain layer's result

    for label, (module, fn) in layers.items():
        variants = [(label, fn)]
        variants.append((f"{label}.compile", torch.compile(_own_frame(fn, label), backend=backend, fullgraph=True)))
        if device.type == "cuda":
            variants.append((f"{label}.compile.graph", torch.compile(_own_frame(fn, f"{label}.graph"),
                                                                     backend=backend, fullgraph=True,
                                                                     mode="reduce-overhead")))
        for impl, f in variants:
            graphed = impl.endswith(".graph")
            for op in (("fwd", "fwd+bwd") if training else ("fwd",)):
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

                torch._dynamo.utils.counters.clear()
                row_impl = impl
                t0 = time.perf_counter()
                got = step()
                for _ in range(2):  # graph trees record on the second call, replay from the third
                    got = step()
                compile_s = time.perf_counter() - t0
                got = reference.setdefault(op, got.detach().clone())  # the first row is plain eager
                want = reference[op]
                err = float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))
                if err > 2e-2:
                    raise AssertionError(f"{name} {impl} {op}: relative error {err:.3g} against plain eager")
                if graphed:
                    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
                    graphs, outside = kernels_outside_graphs(step)
                    captured = not skips and graphs > 0
                    notes.append(f"{name} {impl} {op}: {'captured' if captured else 'NOT CAPTURED'}: {skips} "
                                 f"cudagraph skips, {graphs} graph launches, {outside} kernel launches outside "
                                 "graphs")
                    row_impl = impl if captured else f"{impl} (not captured)"
                us, host = time_us(step), host_us(step)
                rows.append({"shape": name, "T": T, "impl": row_impl, "op": op, "us": round(us, 1),
                             "host_us": round(host, 1), "first_calls_s": round(compile_s, 1)})
                print(f"{name:>6} T={T:5d} {row_impl:>20} {op:>8}: {us:9.1f} us  host {host:9.1f} us", flush=True)
        if device.type == "cuda":
            # The compiled forward captured by hand (torch.cuda.graph), replayed: inference.
            compiled = torch.compile(_own_frame(fn, f"{label}.cudagraph"), backend=backend, fullgraph=True)

            def forward(stream, compiled=compiled):
                with torch.no_grad():
                    return compiled(x)

            captured = Captured(forward, cuda=True)
            got = captured.run()
            err = float((got.float() - reference["fwd"].float()).norm() / reference["fwd"].float().norm())
            if err > 2e-2:
                raise AssertionError(f"{name} {label}.compile.cudagraph: relative error {err:.3g} against plain eager")
            us, host = time_us(captured.replay), host_us(captured.replay)
            rows.append({"shape": name, "T": T, "impl": f"{label}.compile.cudagraph", "op": "fwd",
                         "us": round(us, 1), "host_us": round(host, 1), "first_calls_s": 0.0})
            print(f"{name:>6} T={T:5d} {label + '.compile.cudagraph':>20} fwd: {us:9.1f} us  host {host:9.1f} us",
                  flush=True)


def markdown(rows: list, notes: list) -> str:
    lines = ["| shape | impl | op | time (us) | host (us) | / plain compiled |", "|---|---|---|---|---|---|"]
    base = {(r["shape"], r["op"]): r["us"] for r in rows if r["impl"] == "plain.compile"}
    for r in rows:
        ratio = r["us"] / base[(r["shape"], r["op"])] if (r["shape"], r["op"]) in base else float("nan")
        lines.append(f"| {r['shape']} T={r['T']} | `{r['impl']}` | {r['op']} | {r['us']:.1f} | {r['host_us']:.1f} "
                     f"| {ratio:.2f} |")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for moe_layer.json / moe_layer.md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (times mean nothing)")
    parser.add_argument("--shapes", nargs="*", default=list(MOE_SHAPES), choices=list(MOE_SHAPES))
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
            run_shape(name, shapes[name], device, backend, timer(device), rows, notes, tuple(args.layers))
            torch._dynamo.reset()
    text = markdown(rows, notes)
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
