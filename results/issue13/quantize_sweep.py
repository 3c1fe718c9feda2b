import sys, torch, triton
sys.path.insert(0, ".")  # run from the repo root
import alltoall_ops
from alltoall_ops import fp8
from alltoall_ops.kernels import loader, quantize as qmod
k = loader.load()
for T in (4096, 128):
    x = torch.randn(T, 7168, device="cuda").to(torch.bfloat16)
    ref_v, ref_s = fp8.quantize(x)
    t_torch = triton.testing.do_bench(lambda: fp8.quantize(x), warmup=25, rep=200)
    print(f"T={T} torch fp8.quantize {t_torch*1e3:.1f} us; floor {(T*7168*2 + T*7168 + T*56*4)/4.2e12*1e6:.1f} us")
    for br in (1, 2, 4, 8, 16, 32, 64):
        row = []
        for nw in (1, 2, 4, 8):
            qmod.GPU_BLOCK_R, qmod.GPU_NUM_WARPS = br, nw
            v, s = k.quantize_rows(x)
            assert torch.equal(v, ref_v.view(torch.uint8)) and torch.equal(s, ref_s)
            row.append(triton.testing.do_bench(lambda: k.quantize_rows(x), warmup=25, rep=200) * 1e3)
        print(f"  block_r={br:3d}  warps 1/2/4/8: " + " ".join(f"{t:7.1f}" for t in row))
