"""GPU check of the ``dispatch_layout`` Triton kernel (run on the H200 host, torch 2.11, triton
3.6): the kernel against the torch ops (``layout._dispatch_layout_torch``) exactly, both timed
(CUDA events, ``triton.testing.do_bench`` medians), and the kernel captured in a CUDA graph, replayed on
new ids in the same input buffer and checked again.

    python tools/gpu_layout_check.py     # a table (T, K, E, W, nodes, torch / kernel / graph us), PASS / FAIL
"""

from __future__ import annotations

import sys
from functools import partial

import torch
import triton

from alltoall_ops import layout
from alltoall_ops.kernels import loader

CASES = [(4096, 8, 256, 8, 2), (128, 8, 256, 8, 1), (8192, 8, 256, 64, 8), (0, 8, 256, 8, 1)]  # T, K, E, W, nodes


def routing(T: int, K: int, E: int, seed: int) -> torch.Tensor:
    """(T, K) int64 distinct experts per token, about 10% of the slots -1."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.rand(T, E, generator=g, device="cuda").topk(K, dim=1).indices
    return idx.masked_fill(torch.rand(T, K, generator=g, device="cuda") < 0.1, -1)


def same(got, want) -> bool:
    return all(g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))


def median_us(fn) -> float:
    """Median GPU time (CUDA events, ``triton.testing.do_bench``) in microseconds."""
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def main() -> int:
    kernel = loader.load().dispatch_layout
    ok = True
    print(f"{'T, K, E, W, nodes':>24} {'torch us':>9} {'kernel us':>10} {'graph us':>9}  result")
    for T, K, E, W, nodes in CASES:
        args = (E, W, nodes)
        idx = routing(T, K, E, seed=T + W)
        good = same(kernel(idx, *args), layout._dispatch_layout_torch(idx, *args))
        t_torch = median_us(partial(layout._dispatch_layout_torch, idx, *args))
        t_kernel = median_us(partial(kernel, idx, *args))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = kernel(idx, *args)
        idx.copy_(routing(T, K, E, seed=T + W + 1))  # new ids, same buffer
        graph.replay()
        torch.cuda.synchronize()
        good &= same(static_out, layout._dispatch_layout_torch(idx, *args))
        t_graph = median_us(graph.replay)
        ok &= good
        print(f"{str((T, K, E, W, nodes)):>24} {t_torch:9.1f} {t_kernel:10.1f} {t_graph:9.1f}  "
              f"{'ok' if good else 'MISMATCH'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("gpu_layout_check: needs CUDA")
    sys.exit(main())
