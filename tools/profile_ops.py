"""Where the time of one dispatch / combine goes on one GPU: torch.profiler tables (top kernels
and host-side ops) for the local and symm_mem backends at (T, H, K, E) = (T, 7168, 8, 256).

    python tools/profile_ops.py [T ...]      # default T = 4096; 128 is the decode shape
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import alltoall_ops as a2a

H, K, E = 7168, 8, 256


def main(T: int) -> None:
    dev = torch.device("cuda")
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    weights, topk_idx = torch.randn(T, E, device=dev).softmax(-1).topk(K, dim=-1)
    bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device=dev)
    cases = {
        "local": lambda: a2a.combine(*a2a.dispatch(x, topk_idx, num_experts=E, backend="local")[::2], weights),
        "symm_mem": lambda: a2a.combine(*a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)[::2], weights),
    }
    for name, step in cases.items():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        cuda = torch.autograd.DeviceType.CUDA
        kernels = sum(e.count for e in prof.key_averages() if getattr(e, "device_type", None) == cuda)
        print(f"===== {name}, T = {T}: dispatch + combine, 5 steps, {kernels / 5:.0f} GPU activities per step")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    for T in [int(a) for a in sys.argv[1:]] or [4096]:
        main(T)
