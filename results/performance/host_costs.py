"""Host cost of the pieces of one dispatch on the GPU."""
import time, warnings, torch
import alltoall_ops as a2a
from alltoall_ops import layout
from alltoall_ops.kernels import loader
from alltoall_ops.testing import HostTraffic
from alltoall_ops.moe import MoE
dev = torch.device("cuda")
def host(fn, n=200):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us
H, K, E = 7168, 8, 256
k = loader.load()
for T in (128, 4096):
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w, idx = torch.randn(T, E, device=dev).softmax(-1).topk(K, dim=-1)
    plan = layout.plan_routing(idx, E, 1)
    nv = T * K
    out = x.new_empty(nv, H)
    r = {}
    r["torch.empty"] = host(lambda: torch.empty(nv, H, device=dev, dtype=torch.bfloat16))
    r["torch.zeros(small)"] = host(lambda: torch.zeros(300, device=dev, dtype=torch.int64))
    r["x.add_(0) tiny"] = host(lambda: plan.send_meta.add(0))
    r["plan_slots (launcher)"] = host(lambda: k.plan_slots(idx, E, 1))
    r["plan_routing op"] = host(lambda: layout.plan_routing_op(idx, E, 1))
    r["put_rows launcher"] = host(lambda: k.put_rows(x, plan.position.reshape(-1), nv, out=out, top_k=K, scale=None, acc_dtype=torch.float32))
    r["read_splits op (sync)"] = host(lambda: layout.read_splits_op(plan.send_meta, plan.send_meta, 1))
    r["meta.tolist (sync)"] = host(lambda: plan.send_meta.tolist())
    r["local dispatch"] = host(lambda: a2a.dispatch(x, idx, num_experts=E, backend="local"))
    routed, tpe, h = a2a.dispatch(x, idx, num_experts=E, backend="local")
    r["local combine"] = host(lambda: a2a.combine(routed, h, w))
    def plain():
        o = idx.reshape(-1).argsort(stable=True)
        return x.index_select(0, o // K)
    r["plain dispatch"] = host(plain)
    for name, us in r.items():
        print(f"T={T:5d} {name:>24}: {us:8.1f} us host")
# device syncs of one local MoE layer step (fwd+bwd), counted by CUDA's sync debug mode
layer = MoE(2048, 1408, 64, 6, backend="local", device=dev, dtype=torch.bfloat16)
xx = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
layer(xx).sum().backward(); torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as caught, HostTraffic() as traffic:
    warnings.simplefilter("always")
    layer(xx).sum().backward()
torch.cuda.set_sync_debug_mode(0)
print("local MoE step: CUDA sync warnings", len(caught), [str(c.message)[:80] for c in caught], "HostTraffic reads", traffic.reads)
