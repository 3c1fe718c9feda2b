import sys, time, torch
import alltoall_ops as a2a
from torch._dynamo.utils import counters
import triton.testing
torch.manual_seed(0)
print(a2a.__file__)
for (T, H, K, E) in [(16384, 4096, 8, 128), (4096, 7168, 8, 256)]:
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    def disp(x, idx):
        return a2a.dispatch(x, idx, num_experts=E, backend="local")
    cd = torch.compile(disp, backend="inductor", dynamic=False, fullgraph=True)
    for _ in range(3): cd(x, idx)
    torch.cuda.synchronize()
    dev = 1e3 * triton.testing.do_bench(lambda: cd(x, idx), warmup=50, rep=200, return_mode="median")
    eag = 1e3 * triton.testing.do_bench(lambda: disp(x, idx), warmup=50, rep=200, return_mode="median")
    hs = []
    for _ in range(50):
        torch.cuda.synchronize(); t = time.perf_counter(); cd(x, idx); hs.append(time.perf_counter() - t)
    hs.sort()
    print(f"T={T} compiled {dev:.1f} us  eager {eag:.1f} us  host-incl-sync median {1e6*hs[25]:.1f} us", dict(counters["stats"]), dict(counters["recompiles"]) if "recompiles" in counters else "")
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5): cd(x, idx)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=60))
