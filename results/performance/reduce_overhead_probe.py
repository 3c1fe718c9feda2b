import logging, torch, os
import alltoall_ops as a2a
from alltoall_ops.moe import MoE
from torch.profiler import profile, ProfilerActivity
from torch._dynamo.utils import counters
torch._logging.set_logs(cudagraphs=True, perf_hints=True, cudagraph_static_inputs=True)
dev = torch.device("cuda")
T, H, F, E, K = 128, 2048, 1408, 64, 6
bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device=dev)
layer = MoE(H, F, E, K, backend="symm_mem", buffers=bufs, device=dev, dtype=torch.bfloat16)
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
idx = torch.randn(T, E, device=dev).topk(K, -1).indices
def launches(f):
    with profile(activities=[ProfilerActivity.CPU]) as p:
        f(); torch.cuda.synchronize()
    n = [e.name for e in p.events()]
    return sum(a == "cudaGraphLaunch" for a in n), sum("LaunchKernel" in a for a in n)
def dc(x_):
    r, t, h = a2a.dispatch(x_, idx, num_experts=E, buffers=bufs)
    return a2a.combine(r * 2, h)
for name, fn in (("layer", lambda x_: layer(x_)), ("dispatch+combine", dc)):
    torch._dynamo.reset(); counters.clear()
    comp = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    def step():
        torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return comp(x)
    for _ in range(3): step()
    from torch._inductor import cudagraph_trees as ct
    mgr = ct.get_container(0).tree_manager
    print("#####", name, "graph launches / kernels", launches(step), dict(counters["inductor"]),
          "tree manager:", None if mgr is None else (len(mgr.roots), mgr.current_node is not None))
