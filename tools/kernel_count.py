"""GPU activities of one dispatch + combine step at the decode shape, by backend (the kernels a
CUDA graph of the step replays): their count, names and device time, and the host time to issue
a step. Compiled: symm_mem on one rank (its ops inlined), the same rank on the path with peers
(``allocator="symmetric"`` in a one-rank NCCL group: barrier kernels, metadata put, tags, stage)
with its ops opaque (``ALLTOALL_OPS_INLINE_SYMMETRIC=0``) and inlined (the default), and local; eager:
symm_mem with W = 2, 4, 8 simulated peers (ops not inlined: the simulated barrier is a thread
barrier), per rank.

    PYTHONPATH=. python3 tools/kernel_count.py          # (T, H, K, E) = (128, 7168, 8, 256)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import alltoall_ops as a2a
from alltoall_ops.backends.symm_mem import run_simulated
from alltoall_ops.groups import NO_GROUP
from alltoall_ops.testing import inline_symmetric, one_rank_group
from benchmarks._rounds import own_code
from tools.before_after import timed

T, H, K, E = 128, 7168, 8, 256
HOST_STEPS = 50


def main() -> None:
    with one_rank_group(torch.device("cuda", 0)):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        weights, topk_idx = torch.randn(T, E, device="cuda").softmax(-1).topk(K, dim=-1)
        one_rank = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device="cuda", group=NO_GROUP)
        peer_path = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device="cuda", allocator="symmetric")

        def step(buffers):
            routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, buffers=buffers,  # group: the buffers'
                                             backend="local" if buffers is None else "symm_mem")
            return a2a.combine(routed, handle, weights)

        def compiled(name: str, buffers, inline: bool = False) -> Callable[[], object]:
            fn = torch.compile(own_code(lambda: step(buffers), name), fullgraph=True)
            with inline_symmetric(inline):  # read while the graph is traced: here, at its first call
                fn()
            return fn

        rows: list[tuple[str, int, Callable[[], object]]] = [
            ("compiled symm_mem W=1", 1, compiled("one_rank", one_rank)),
            ("compiled symm_mem W=1, path with peers, ops opaque", 1, compiled("peer_opaque", peer_path)),
            ("compiled symm_mem W=1, path with peers, ops inlined", 1,
             compiled("peer_inlined", peer_path, inline=True)),
            ("compiled local", 1, compiled("local", None)),
        ]
        for W in (2, 4, 8):
            peers = a2a.SymmBuffers.simulated(W, T, H, K, E, dtype=torch.bfloat16, device="cuda")
            rows.append((f"eager symm_mem W={W} simulated, per rank", W,
                         lambda p=peers: run_simulated(lambda rank, b: step(b), p)))
        for name, ranks, run in rows:
            _, host_us = timed(run, HOST_STEPS)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            print(f"{name}: {len(kernels) / ranks:g} GPU activities per dispatch+combine (T={T}), "
                  f"{sum(e.device_time for e in kernels) / ranks:.1f} us of kernel time, {host_us:.1f} us of host "
                  f"time to issue a step (all ranks):")
            print("   " + ", ".join(f"{e.name[:40]} {e.device_time:.1f}" for e in kernels[: len(kernels) // ranks]))


if __name__ == "__main__":
    main()
