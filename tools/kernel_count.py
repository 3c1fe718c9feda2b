"""GPU activities of one dispatch + combine step at the decode shape, by backend (the kernels a
CUDA graph of the step replays): their count, names and device time. Compiled: symm_mem on one
rank (its ops inlined) and local; eager: symm_mem with W = 2, 4, 8 simulated peers (ops not
inlined: the simulated barrier is a thread barrier), per rank.

    PYTHONPATH=. python3 tools/kernel_count.py          # (T, H, K, E) = (128, 7168, 8, 256)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import alltoall_ops as a2a
from alltoall_ops.backends.symm_mem import run_simulated

T, H, K, E = 128, 7168, 8, 256


def main() -> None:
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    weights, topk_idx = torch.randn(T, E, device="cuda").softmax(-1).topk(K, dim=-1)
    bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device="cuda")

    def step(buffers):
        routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, buffers=buffers)
        return a2a.combine(routed, handle, weights)

    rows: list[tuple[str, int, Callable[[], object]]] = [
        (f"compiled {name}", 1, torch.compile(lambda b=buffers: step(b), fullgraph=True))
        for name, buffers in (("symm_mem W=1", bufs), ("local", None))
    ]
    for W in (2, 4, 8):
        peers = a2a.SymmBuffers.simulated(W, T, H, K, E, dtype=torch.bfloat16, device="cuda")
        rows.append((f"eager symm_mem W={W} simulated, per rank", W,
                     lambda p=peers: run_simulated(lambda rank, b: step(b), p)))
    for name, ranks, run in rows:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"{name}: {len(kernels) / ranks:g} GPU activities per dispatch+combine (T={T}), "
              f"{sum(e.device_time for e in kernels) / ranks:.1f} us of kernel time:")
        print("   " + ", ".join(f"{e.name[:40]} {e.device_time:.1f}" for e in kernels[: len(kernels) // ranks]))


if __name__ == "__main__":
    main()
