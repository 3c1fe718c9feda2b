"""Host time of one compiled dispatch + combine step at the decode shape, by backend, and where
it goes: torch.profiler (CPU and CUDA activities, sorted by self CPU time) and cProfile.

    PYTHONPATH=. python3 tools/compiled_profile.py     # (T, H, K, E) = (128, 7168, 8, 256), one GPU

NB: under a compiled region cProfile records no callee of a custom op's ``backend_impl``: the
op's whole body shows as that function's own time; torch.profiler's self CPU time per op is the
reading to trust."""

from __future__ import annotations

import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import alltoall_ops as a2a

T, H, K, E = 128, 7168, 8, 256


def main() -> None:
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    weights, topk_idx = torch.randn(T, E, device="cuda").softmax(-1).topk(K, dim=-1)
    bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device="cuda")

    def step(buffers, backend):
        routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, buffers=buffers, backend=backend)
        return a2a.combine(routed, handle, weights)

    for name, buffers, backend in (("symm_mem", bufs, "symm_mem"), ("local", None, "local")):
        torch._dynamo.reset()
        compiled = torch.compile(lambda b=buffers, be=backend: step(b, be), fullgraph=True)
        for _ in range(5):
            compiled()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            compiled()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        print(f"== {name}: host {host / 200 * 1e6:.1f} us, wall {wall / 200 * 1e6:.1f} us per step")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                compiled()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(50):
            compiled()
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
