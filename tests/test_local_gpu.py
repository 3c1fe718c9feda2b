"""backend="local" on a CUDA GPU: the routing-plan kernels in padded-rows mode and the gather
kernel against their torch references, a whole step with no synchronising CUDA call, and CUDA
graph capture (by hand and under ``mode="reduce-overhead"``) replayed on new routings. Marked
``gpu``: skipped without CUDA; the same kernels run in Triton's interpreter in the CPU suite."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import alltoall_ops as a2a
from alltoall_ops import layout, validation
from alltoall_ops.moe import MoE
from alltoall_ops.testing import HostTraffic, routing

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T, K, E, alignment", [(0, 2, 8, 4), (1, 1, 4, 1), (128, 8, 256, 1), (4096, 6, 64, 16),
                                                (5000, 8, 256, 128)])
def test_plan_rows_kernels_equal_the_torch_reference(T, K, E, alignment):
    idx, _ = routing(T, K, E, seed=T + K, device="cuda", dropped=0.1)
    C = layout.local_capacity(T * K, E, alignment)
    got = layout._plan_rows(idx, E, alignment)
    want = layout._plan_rows_torch(idx, E, alignment, C)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T, how", [(16, "eager"), (16, "compiled"), (1024, "eager")])  # 1024: the two kernels
def test_a_bad_id_is_the_plan_kernels_own_device_assert(T, how):
    """No assert launch of its own: the plan kernel asserts that no id is bad (a subprocess: the
    CUDA context dies with it)."""
    rows = "lambda x, idx: a2a.dispatch(x, idx, num_experts=4, backend='local')[0]"
    call = f"({rows})" if how == "eager" else f"torch.compile({rows}, fullgraph=True)"
    code = (
        "import torch, alltoall_ops as a2a\n"
        f"x = torch.randn({T}, 8, device='cuda'); idx = torch.zeros({T}, 2, dtype=torch.int64, device='cuda')\n"
        "idx[1, 0] = 7\n"
        f"{call}(x, idx)\n"
        "torch.cuda.synchronize()\n"
        "print('NO ERROR')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert "NO ERROR" not in out.stdout and out.returncode != 0, (out.stdout, out.stderr[-800:])
    assert "device-side assert" in out.stderr and validation.BAD_IDS in out.stderr, out.stderr[-1500:]


def _layer_step(layer, x, grad_y):
    layer.zero_grad(set_to_none=True)
    x.grad = None
    layer(x).backward(grad_y)
    return x.grad


def test_a_step_makes_no_synchronising_call():
    torch.manual_seed(0)
    layer = MoE(256, 384, 16, 4, backend="local", expert_alignment=8, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_y = torch.randn_like(x)
    _layer_step(layer, x, grad_y)  # warm-up: kernels compiled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with HostTraffic() as traffic:
            _layer_step(layer, x, grad_y)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert traffic.reads == 0 and not traffic.collectives


def _reference_step(layer, x, grad_y):
    """The same layer with routed rows computed by plain torch (argsort + gather)."""
    topk_idx, weights = layer.router(x)
    T, K = topk_idx.shape
    order = topk_idx.reshape(-1).argsort(stable=True)
    counts = torch.bincount(topk_idx.reshape(-1), minlength=layer.num_experts)
    out = layer.experts(x.index_select(0, order // K), counts)
    rows = out.float() * weights.reshape(-1)[order].float()[:, None]
    return torch.zeros(x.shape, device=x.device).index_add_(0, order // K, rows).to(x.dtype)


@pytest.mark.parametrize("mode", ["by_hand", "reduce-overhead"])
def test_cuda_graph_replays_new_routings(mode):
    torch.manual_seed(1)
    H = 256
    layer = MoE(H, 384, 16, 4, backend="local", device="cuda", dtype=torch.bfloat16)
    x_static = torch.randn(256, H, device="cuda", dtype=torch.bfloat16)
    if mode == "by_hand":
        compiled = torch.compile(layer, fullgraph=True)
        with torch.no_grad():
            for _ in range(2):
                compiled(x_static)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y_static = compiled(x_static)
        for seed in range(3):  # fresh tokens, so fresh routings, into the captured addresses
            x_static.copy_(torch.randn(x_static.shape, generator=torch.Generator().manual_seed(seed)).cuda())
            graph.replay()
            torch.testing.assert_close(y_static, _reference_step(layer, x_static, None), rtol=2e-2, atol=2e-2)
        return
    from torch._inductor import cudagraph_trees

    replays = []
    run_graph = cudagraph_trees.CUDAGraphNode.run_graph
    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    try:
        cudagraph_trees.CUDAGraphNode.run_graph = lambda node: (replays.append(1), run_graph(node))[1]
        for seed in range(5):
            torch.compiler.cudagraph_mark_step_begin()
            x = torch.randn(x_static.shape, generator=torch.Generator().manual_seed(seed)).cuda().to(torch.bfloat16)
            with torch.no_grad():
                y = compiled(x)
                torch.testing.assert_close(y, _reference_step(layer, x, None), rtol=2e-2, atol=2e-2)
    finally:
        cudagraph_trees.CUDAGraphNode.run_graph = run_graph
    assert len(replays) >= 3, f"{len(replays)} cudagraph replays in 5 calls: the graph was not captured"


def test_dispatch_tail_is_zero_and_combine_ignores_it():
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(300, 128, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.rand(300, 32, device="cuda", generator=g).topk(4).indices
    idx[::7, 1] = -1
    routed, tpe, handle = a2a.dispatch(x, idx, num_experts=32, expert_alignment=16)
    R = int(tpe.sum())
    assert routed.shape[0] == layout.local_capacity(idx.numel(), 32, 16) and not routed[R:].any()
    poisoned = routed.clone()
    poisoned[R:] = float("nan")
    y = a2a.combine(poisoned, handle)
    want = (x.float() * (idx >= 0).sum(1, keepdim=True)).to(torch.bfloat16)
    torch.testing.assert_close(y, want, rtol=2e-2, atol=2e-2)
