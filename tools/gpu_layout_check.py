"""GPU check of the ``dispatch_layout`` Triton kernel (run on the H200 host, torch 2.11, triton
3.6): the kernel against the torch ops (``layout._dispatch_layout_torch``) exactly, both timed
(CUDA events, ``triton.testing.do_bench`` medians), and the kernel captured in a CUDA graph, replayed on
new ids in the same input buffer and checked again.

    python -m tools.gpu_layout_check                   # a table (T, K, E, W, nodes, torch / kernel / graph us)
    python -m pytest -m gpu tests/test_layout_gpu.py   # the same cases, one test each
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from alltoall_ops import layout
from alltoall_ops.kernels import loader
from alltoall_ops.testing import routing, timer

CASES = [(4096, 8, 256, 8, 2), (128, 8, 256, 8, 1), (8192, 8, 256, 64, 8), (0, 8, 256, 8, 1)]  # T, K, E, W, nodes


def same(got, want) -> bool:
    return all(g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))


def ids(T: int, K: int, E: int, seed: int) -> torch.Tensor:
    """(T, K) int64 distinct experts per token, about 10% of the slots -1."""
    return routing(T, K, E, seed=seed, device="cuda", dropped=0.1)[0]


def check_case(T: int, K: int, E: int, W: int, nodes: int) -> tuple[float, float, float]:
    """Assert the kernel equals the torch ops, eagerly and replayed from a CUDA graph on new ids;
    return the median microseconds of the torch ops, the kernel and its graph replay."""
    kernel = loader.load().dispatch_layout
    time_us = timer(torch.device("cuda"))
    args = (E, W, nodes)
    idx = ids(T, K, E, seed=T + W)
    assert same(kernel(idx, *args), layout._dispatch_layout_torch(idx, *args)), "kernel != torch"
    t_torch = time_us(partial(layout._dispatch_layout_torch, idx, *args))
    t_kernel = time_us(partial(kernel, idx, *args))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = kernel(idx, *args)
    idx.copy_(ids(T, K, E, seed=T + W + 1))  # new ids, same buffer
    graph.replay()
    torch.cuda.synchronize()
    assert same(static_out, layout._dispatch_layout_torch(idx, *args)), "graph replay on new ids != torch"
    return t_torch, t_kernel, time_us(graph.replay)


def main() -> int:
    ok = True
    print(f"{'T, K, E, W, nodes':>24} {'torch us':>9} {'kernel us':>10} {'graph us':>9}  result")
    for case in CASES:
        try:
            times, result = check_case(*case), "ok"
        except AssertionError as exc:
            times, result, ok = (float("nan"),) * 3, f"MISMATCH ({exc})", False
        print(f"{str(case):>24} {times[0]:9.1f} {times[1]:10.1f} {times[2]:9.1f}  {result}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("gpu_layout_check: needs CUDA")
    sys.exit(main())
