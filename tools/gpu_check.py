"""GPU check of the core ops on one GPU (run on the H200 host, torch 2.11): local backend on
cuda against fp64 CPU references, opcheck, inductor compile (one compilation across routings),
the collective backend over a one-rank NCCL group, Ulysses, and the SAC comm-op counts.

    python -m tools.gpu_check                    # prints one line per check and a final PASS / FAIL
    GPU_CHECK_DEVICE=cpu python -m tools.gpu_check   # a dry run of the code path here (gloo)
    python -m pytest -m gpu tests/test_core_gpu.py   # the same checks, one test each
"""

from __future__ import annotations

import os
import sys

import torch

import alltoall_ops as a2a
from alltoall_ops import layout
from alltoall_ops.inspect import compiled_graphs
from alltoall_ops.testing import moe_step, one_rank_group
from tools.checks import run_checks

DEVICE = torch.device(os.environ.get("GPU_CHECK_DEVICE", "cuda:0"))  # "cpu": a dry run here
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def dense_reference(x, topk_idx, weights, expert_w):
    """y[t] = sum_k w[t,k] * tanh(x[t] @ W[idx[t,k]]), plain PyTorch in the inputs' dtype."""
    y = torch.zeros_like(x)
    for k in range(topk_idx.shape[1]):
        valid = topk_idx[:, k] >= 0
        acc = torch.promote_types(x.dtype, torch.float32)
        w_k = expert_w.to(acc)[topk_idx[:, k].clamp(min=0)]
        rows = torch.tanh(torch.bmm(x.unsqueeze(1).to(acc), w_k).squeeze(1)).to(x.dtype)
        y = y + torch.where(valid[:, None], weights[:, k : k + 1] * rows, 0.0)
    return y


def inputs(T, H, K, E, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype).requires_grad_()
    topk_idx = torch.randint(-1, E, (T, K), generator=g).to(DEVICE)
    weights = torch.rand(T, K, generator=g).to(DEVICE, dtype).requires_grad_()
    expert_w = (torch.randn(E, H, H, generator=g) / H**0.5).to(DEVICE, dtype).requires_grad_()
    return x, topk_idx, weights, expert_w


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@check
def local_backend_numerics():
    worst = {}
    # Criterion: distance to the fp64 reference at most twice that of the plain-PyTorch path in
    # the same dtype (plus fp64 rounding noise).
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for T, H, K, E, align in ((257, 64, 4, 16, 1), (1000, 128, 8, 32, 16), (0, 64, 2, 8, 4)):
            x, idx, w, ew = inputs(T, H, K, E, dtype, seed=T + H)
            y = moe_step(x, idx, w, ew, E, expert_alignment=align)
            grads = torch.autograd.grad(y, (x, w, ew), torch.ones_like(y), allow_unused=True)
            xr, wr, ewr = (t.detach().double().cpu().requires_grad_() for t in (x, w, ew))
            yr = dense_reference(xr, idx.cpu(), wr, ewr)
            refs = torch.autograd.grad(yr, (xr, wr, ewr), torch.ones_like(yr), allow_unused=True)
            if T == 0:
                assert y.shape == (0, H)
                continue
            yp = dense_reference(x, idx, w, ew)
            plains = torch.autograd.grad(yp, (x, w, ew), torch.ones_like(yp))
            for name, ours, plain, ref in zip(("y", "dx", "dw", "dW"), (y, *grads), (yp, *plains), (yr, *refs)):
                err, bound = rel_err(ours, ref), 2 * rel_err(plain, ref) + 1e-14
                worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err / bound)
                assert err <= bound, (dtype, T, name, err, bound)
    return "max (err / bound) " + ", ".join(f"{k.split('.')[-1]} {v:.2f}" for k, v in worst.items())


@check
def determinism():
    x, idx, w, ew = inputs(2048, 256, 8, 64, torch.bfloat16, seed=3)
    a = moe_step(x, idx, w, ew, 64, expert_alignment=16)
    b = moe_step(x, idx, w, ew, 64, expert_alignment=16)
    assert torch.equal(a, b)
    return "bitwise equal"


@check
def opcheck_cuda():
    x = torch.randn(33, 16, device=DEVICE, requires_grad=True)
    idx = torch.randint(-1, 8, (33, 2), device=DEVICE)
    w = torch.rand(33, 2, device=DEVICE, requires_grad=True)
    plan = layout.plan_routing(idx, 8, 1)
    ops = torch.ops.alltoall_ops
    header = a2a.comm.header("exchange_counts", 8)
    recv = ops.exchange_counts(plan.send_meta, "", header)
    torch.library.opcheck(ops.exchange_counts.default, (plan.send_meta, "", header))
    torch.library.opcheck(ops.read_splits.default, (plan.send_meta, recv, 4))
    splits = ops.read_splits(plan.send_meta, recv, 4)
    args = (plan.order, plan.position, recv, splits, 4, "")
    torch.library.opcheck(ops.dispatch.default, (x, None, *args, None))
    routed, _ = ops.dispatch(x, None, *args, None)
    eo = torch.randn_like(routed, requires_grad=True)
    torch.library.opcheck(ops.combine.default, (eo, w.detach(), *args, False))
    torch.library.opcheck(ops.combine.default, (eo, w, *args, True))
    # the local backend's ops (static rows)
    torch.library.opcheck(ops.plan_rows.default, (idx, 8, 4))
    row_src, row, _ = ops.plan_rows(idx, 8, 4)
    torch.library.opcheck(ops.local_dispatch.default, (x, w, row_src, row))
    out = torch.randn(row_src.shape[0], 16, device=DEVICE, requires_grad=True)
    torch.library.opcheck(ops.local_combine.default, (out, w, row, row_src))
    torch.library.opcheck(ops.weight_grad.default, (x, out, row, w))
    return "exchange_counts, read_splits, dispatch, combine, plan_rows, local_dispatch, local_combine, weight_grad"


@check
def inductor_one_compilation():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(moe_step, backend=counter, fullgraph=True)
    for step in range(3):
        x, idx, w, ew = inputs(512, 128, 4, 32, torch.bfloat16, seed=10 + step)
        y = compiled(x, idx, w, ew, 32, expert_alignment=16)
        gy = torch.autograd.grad(y, (x, w, ew), torch.ones_like(y))
        ye = moe_step(x, idx, w, ew, 32, expert_alignment=16)
        ge = torch.autograd.grad(ye, (x, w, ew), torch.ones_like(ye))
        assert rel_err(y, ye) < 1e-2, rel_err(y, ye)
        assert all(rel_err(a, b) < 2e-2 for a, b in zip(gy, ge))
    assert counter.frame_count == 1, counter.frame_count
    graphs = compiled_graphs(moe_step, x, idx, w, ew, 32, expert_alignment=16, backend="inductor")
    assert graphs.graph_breaks == 0
    return f"frames={counter.frame_count}; " + graphs.summary().replace("\n", " | ")


@check
def collective_backend_nccl_one_rank():
    x, idx, w, ew = inputs(300, 64, 4, 16, torch.float32, seed=5)
    y_local = moe_step(x, idx, w, ew, 16, expert_alignment=4, backend="local")
    y_coll = moe_step(x, idx, w, ew, 16, expert_alignment=4, backend="collective")
    assert torch.equal(y_local, y_coll)
    g = torch.autograd.grad(y_coll, (x, w, ew), torch.ones_like(y_coll))
    gl = torch.autograd.grad(y_local, (x, w, ew), torch.ones_like(y_local))
    assert torch.equal(g[0], gl[0]) and torch.equal(g[1], gl[1])
    # NB: the expert weights' gradient sums over the routed rows, C of the local backend's and R
    # received of the collective's (zeros past the routed ones): their order of summation may
    # differ (it does on the CPU, by about 4e-6)
    torch.testing.assert_close(g[2], gl[2], rtol=1e-5, atol=1e-5)
    assert a2a.warmup() == 1
    return "collective == local bitwise (forward, the grads of x and the routing weights; the experts' to 1e-5)"


@check
def ulysses_cuda():
    q = torch.randn(2, 64, 8, 32, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn(2, 64, 8, 16, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    y = a2a.ulysses_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    assert torch.equal(y, ref)
    compiled = torch.compile(a2a.ulysses_attention, fullgraph=True)
    yc = compiled(q, k, v, is_causal=True)
    assert rel_err(yc, ref) < 1e-2
    assert torch.equal(a2a.head_to_seq(a2a.seq_to_head(q)), q)
    return "attention wrapper == sdpa, compiled ok"


def main() -> int:
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}", flush=True)
    with one_rank_group(DEVICE):  # NCCL on cuda (gloo for a dry run)
        return run_checks(CHECKS)


if __name__ == "__main__":
    sys.exit(main())
