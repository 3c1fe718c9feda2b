"""Host time of one compiled dispatch + combine step at the decode shape, by backend, and where
it goes: torch.profiler (CPU and CUDA activities, sorted by self CPU time) and cProfile. Rows:
symm_mem on one rank, the same rank on the path with peers (``allocator="symmetric"`` in a
one-rank NCCL group: barrier kernels, metadata put, tags, stage) with its ops inlined
(``ALLTOALL_OPS_INLINE_SYMMETRIC=1``), and local.

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
from alltoall_ops.groups import NO_GROUP
from alltoall_ops.testing import inline_symmetric, one_rank_group

T, H, K, E = 128, 7168, 8, 256


def main() -> None:
    with one_rank_group(torch.device("cuda", 0)):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        weights, topk_idx = torch.randn(T, E, device="cuda").softmax(-1).topk(K, dim=-1)
        one_rank = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device="cuda", group=NO_GROUP)
        peer_path = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device="cuda", allocator="symmetric")

        def step(buffers, backend):
            routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, buffers=buffers, backend=backend)
            return a2a.combine(routed, handle, weights)

        rows = (("symm_mem", one_rank, "symm_mem"), ("symm_mem, path with peers, inlined", peer_path, "symm_mem"),
                ("local", None, "local"))
        with inline_symmetric():  # read while each row's graph is traced
            for name, buffers, backend in rows:
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
