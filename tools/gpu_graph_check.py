"""Proof that ``torch.compile(mode="reduce-overhead")`` captures a whole MoE layer step in CUDA
graphs (issue 21): :class:`alltoall_ops.moe.MoE` with backend "symm_mem" (one rank's
``SymmBuffers`` on cuda) and "local", training steps (forward + backward) and decode forwards (no
grad), one GPU (the H200 host: torch 2.11, triton 3.6).

    python -m tools.gpu_graph_check                     # T = 128
    python -m tools.gpu_graph_check --tokens 128 4096   # and the training shape
    python -m tools.gpu_graph_check --cpu               # dry run of the code path here
    python -m pytest -m gpu tests/test_graphs_gpu.py    # the cases at T = 128 and 4096, one test each

Every step routes new tokens (a new routing). Replays are counted where they happen: each call
of ``torch._inductor.cudagraph_trees.CUDAGraphNode.run_graph`` is one replay of a recorded graph
(the run inside the recording is not counted). A case FAILS when a step after the two warm-up
steps (graph trees run the first call eagerly and record on the second) replays fewer graphs than
it needs (training: its forward and its backward; decode: its forward): torch 2.11 falls back
to running without a graph silently. It also fails on inductor's ``cudagraph_skips``, on more than
one compilation, and when outputs or gradients differ from eager by more than bf16 rounding.
One line per case, PASS or FAIL, with the time per step (CUDA events, ``triton.testing.do_bench``)
compiled and eager, and the kernel launches of a profiled step outside graphs; exit 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from typing import Iterator

import torch

import alltoall_ops as a2a
from alltoall_ops.moe import MoE
from alltoall_ops.testing import timer
from benchmarks.moe_layer import kernels_outside_graphs

SHAPE = (2048, 1408, 64, 6)  # H, F, E, K: the MoE layer of benchmarks/moe_layer.py
CPU_SHAPE, CPU_TOKENS = (32, 48, 8, 2), 8
WARMUP_STEPS = 2
REL_TOL = 2e-2  # relative Frobenius error against eager (bf16 outputs, fused differently)

REPLAYS = [0]


@contextlib.contextmanager
def counting_replays() -> Iterator[None]:
    """Inside the block, count every replay of a graph recorded by cudagraph trees into REPLAYS[0]."""
    from torch._inductor import cudagraph_trees

    run_graph = cudagraph_trees.CUDAGraphNode.run_graph

    def counted(node):
        REPLAYS[0] += 1
        return run_graph(node)

    cudagraph_trees.CUDAGraphNode.run_graph = counted
    try:
        yield
    finally:
        cudagraph_trees.CUDAGraphNode.run_graph = run_graph


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def make_layer(backend: str, T: int, shape, device: torch.device, dtype: torch.dtype) -> MoE:
    H, F, E, K = shape
    torch.manual_seed(0)  # the same parameters for every backend
    buffers = a2a.SymmBuffers(T, H, K, E, dtype=dtype, device=device) if backend == "symm_mem" else None
    return MoE(H, F, E, K, backend=backend, buffers=buffers, device=device, dtype=dtype)


def run_case(backend: str, train: bool, T: int, steps: int, shape, device: torch.device) -> tuple[bool, str]:
    """One case: ``steps`` compiled steps checked against eager; returns (passed, what was seen)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    layer = make_layer(backend, T, shape, device, dtype)
    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    params = list(layer.parameters())
    g = torch.Generator(device="cpu").manual_seed(T)

    def step(fn, x, grad_y):
        if fn is compiled:
            torch.compiler.cudagraph_mark_step_begin()
        if not train:
            with torch.no_grad():
                return [fn(x)]
        xx = x.detach().requires_grad_()
        y = fn(xx)
        return [y, *torch.autograd.grad(y, [xx, *params], grad_y)]

    errs, replays = [], []
    for _ in range(steps):
        x = torch.randn(T, shape[0], generator=g).to(device, dtype)
        grad_y = torch.randn(T, shape[0], generator=g).to(device, dtype)
        before = REPLAYS[0]
        got = [t.detach().clone() for t in step(compiled, x, grad_y)]  # replays overwrite the outputs
        replays.append(REPLAYS[0] - before)
        want = step(layer, x, grad_y)
        errs.append(max(rel_err(a, b) for a, b in zip(got, want)))

    needed = 2 if train else 1  # the forward graph, and the backward graph
    steady = replays[WARMUP_STEPS:]
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    compilations = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    problems = []
    if device.type == "cuda" and (not steady or min(steady) < needed):
        problems.append(f"replays per step {replays} (need >= {needed} after {WARMUP_STEPS} warm-up steps): "
                        "NOT CAPTURED, the graph fell back silently")
    if skips and device.type == "cuda":  # on the CPU every graph is skipped ("cpu device")
        problems.append(f"{skips} cudagraph skips (reasons: the perf_hints log above)")
    if compilations != 1:
        problems.append(f"{compilations} compilations over {steps} routings")
    if max(errs) > REL_TOL:
        problems.append(f"relative error {max(errs):.3g} against eager (tolerance {REL_TOL})")

    line = (f"replays per step {replays}, {skips} cudagraph skips, {compilations} compilation(s), "
            f"max relative error {max(errs):.2g}")
    if device.type == "cuda":
        x = torch.randn(T, shape[0], generator=g).to(device, dtype)
        grad_y = torch.randn(T, shape[0], generator=g).to(device, dtype)
        time_us = timer(device)
        compiled_us, eager_us = time_us(lambda: step(compiled, x, grad_y)), time_us(lambda: step(layer, x, grad_y))
        graph_launches, outside = kernels_outside_graphs(lambda: step(compiled, x, grad_y))
        line += (f"; compiled {compiled_us:.1f} us/step, eager {eager_us:.1f} us/step; profiled step: "
                 f"{graph_launches} graph launches, {outside} kernel launches outside graphs")
    if problems:
        line += " -- " + "; ".join(problems)
    return not problems, line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128], help="T of the cases (default 128)")
    parser.add_argument("--backends", nargs="+", default=["symm_mem", "local"], choices=["symm_mem", "local"])
    parser.add_argument("--steps", type=int, default=6, help="steps (routings) per case, warm-up included")
    parser.add_argument("--cpu", action="store_true",
                        help="dry run on the CPU, tiny shapes: no CUDA graphs there, so replays are not required")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps: more than the {WARMUP_STEPS} warm-up steps")
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_graph_check: needs CUDA (mode='reduce-overhead' records CUDA graphs); "
              "--cpu runs the same code path here without them", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu else "cuda")
    shape = CPU_SHAPE if args.cpu else SHAPE
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"(H, F, E, K) = {shape}", flush=True)
    if device.type == "cuda":
        torch._logging.set_logs(perf_hints=True)  # why a graph is not captured, where inductor says it
    failed = 0
    for T in [CPU_TOKENS] if args.cpu else args.tokens:
        for backend in args.backends:
            for train in (True, False):
                try:
                    with counting_replays():
                        ok, seen = run_case(backend, train, T, args.steps, shape, device)
                except Exception as exc:  # a case that crashes is a FAIL; the others still run
                    traceback.print_exc()
                    ok, seen = False, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
                failed += not ok
                case = f"{backend} {'train' if train else 'decode'} T={T}"
                print(f"{'PASS' if ok else 'FAIL'} {case}: {seen}", flush=True)
    dry = " (CPU dry run: nothing is captured on the CPU; run it on a GPU)" if args.cpu else ""
    print(("ALL PASS" if not failed else f"{failed} FAILED") + dry, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
