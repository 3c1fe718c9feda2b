"""Kernel profile of one replay: simulated W=8 dispatch / combine graphs (T=4096) and the
compiled W=1 decode step (T=128)."""
import torch
from torch.profiler import profile, ProfilerActivity
import alltoall_ops as a2a
from alltoall_ops import SymmBuffers
from alltoall_ops.backends.symm_mem import run_simulated
from benchmarks.bench import Captured, routing, tokens

dev = torch.device("cuda")
H, K, E = 7168, 8, 256

def table(name, fn):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn(); torch.cuda.synchronize()
    rows = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, t = rows.get(e.name, (0, 0.0))
            rows[e.name] = (n + 1, t + e.device_time)
    total = sum(t for _, t in rows.values())
    print(f"##### {name}: {sum(n for n, _ in rows.values())} kernels, {total:.1f} us")
    for k, (n, t) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"  {t:9.1f} us  x{n:3d}  {k[:90]}")

for W, T in ((8, 4096), (2, 4096)):
    xs = [tokens(T, H, dev, seed=r + 1) for r in range(W)]
    rs = [routing(T, K, E, dev, seed=100 + r) for r in range(W)]
    bufs = SymmBuffers.simulated(W, T, H, K, E, dtype=torch.bfloat16, device=dev, overflow="error")
    disp = lambda r, bb: a2a.dispatch(xs[r], rs[r][0], num_experts=E, buffers=bb)
    gd = Captured(lambda s: run_simulated(disp, bufs, stream=s), True, relaxed=True)
    outs = gd.run()
    gc = Captured(lambda s: run_simulated(lambda r, bb: a2a.combine(outs[r][0], outs[r][2], rs[r][1]), bufs, stream=s), True, relaxed=True)
    gc.run()
    table(f"W={W} T={T} dispatch graph", gd.replay)
    table(f"W={W} T={T} combine graph", gc.replay)
    del bufs, gd, gc, outs; torch.cuda.empty_cache()

T = 128
x = tokens(T, H, dev, seed=5); idx, w = routing(T, K, E, dev, seed=6)
bufs = SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device=dev)
def step(x_, idx_, w_):
    r, t, h = a2a.dispatch(x_, idx_, num_experts=E, buffers=bufs)
    return a2a.combine(r, h, w_)
comp = torch.compile(step, fullgraph=True)
g = Captured(lambda s: comp(x, idx, w), True)
table("W=1 T=128 compiled decode step graph", g.replay)
g2 = Captured(lambda s: step(x, idx, w), True)
table("W=1 T=128 eager decode step graph", g2.replay)
