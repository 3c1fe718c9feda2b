"""GPU activities of one compiled dispatch + combine step at the decode shape, by backend (the
kernels a CUDA graph of the step replays): their count, names and device time.

    PYTHONPATH=. python3 tools/kernel_count.py          # (T, H, K, E) = (128, 7168, 8, 256)
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import alltoall_ops as a2a

T, H, K, E = 128, 7168, 8, 256


def main() -> None:
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    weights, topk_idx = torch.randn(T, E, device="cuda").softmax(-1).topk(K, dim=-1)
    bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device="cuda")

    def step(buffers):
        routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, buffers=buffers)
        return a2a.combine(routed, handle, weights)

    for name, buffers in (("symm_mem W=1", bufs), ("local", None)):
        compiled = torch.compile(lambda b=buffers: step(b), fullgraph=True)
        for _ in range(3):
            compiled()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            compiled()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"{name}: {len(kernels)} GPU activities per compiled dispatch+combine (T={T}), "
              f"{sum(e.device_time for e in kernels):.1f} us of kernel time:")
        print("   " + ", ".join(f"{e.name[:40]} {e.device_time:.1f}" for e in kernels))


if __name__ == "__main__":
    main()
