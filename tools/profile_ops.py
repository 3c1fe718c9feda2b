"""Where the time of one dispatch / combine goes on one GPU: torch.profiler tables (top kernels
and host-side ops) for the local and symm_mem backends at (T, H, K, E) = (4096, 7168, 8, 256).

    python tools/profile_ops.py
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import alltoall_ops as a2a

T, H, K, E = 4096, 7168, 8, 256


def main() -> None:
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
        print(f"===== {name}: dispatch + combine, 5 steps")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
