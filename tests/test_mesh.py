"""2-D meshes: expert-tensor-parallel dispatch over mesh["ep"] of an [ep, tp] mesh, and warm-up."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import alltoall_ops as a2a

E, H, F, K = 4, 6, 8, 2


def _global_params():
    torch.manual_seed(7)
    w_in = torch.randn(E, H, F, dtype=torch.float64)
    w_out = torch.randn(E, F, H, dtype=torch.float64)
    return w_in, w_out


def _tokens(ep_rank: int):
    """Tokens of one ep rank (replicated over its tp ranks): uneven T, -1 slots."""
    torch.manual_seed(50 + ep_rank)
    T = 5 + 3 * ep_rank
    x = torch.randn(T, H, dtype=torch.float64)
    topk_idx = torch.randint(-1, E, (T, K))
    weights = torch.rand(T, K, dtype=torch.float64)
    return x, topk_idx, weights


def _dense(x, topk_idx, weights, w_in, w_out):
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(K):
            j = int(topk_idx[t, k])
            if j >= 0:
                y[t] += weights[t, k] * (torch.relu(x[t] @ w_in[j]) @ w_out[j])
    return y


def expert_tensor_parallel_moe(rank: int, world_size: int):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    assert a2a.warmup(mesh) == 2
    ep, tp = mesh["ep"].get_local_rank(), mesh["tp"].get_local_rank()
    e, f = E // 2, F // 2
    w_in, w_out = _global_params()
    # This rank's experts, and its tp shard of their hidden dimension.
    w_in_local = w_in[ep * e : (ep + 1) * e, :, tp * f : (tp + 1) * f].clone().requires_grad_()
    w_out_local = w_out[ep * e : (ep + 1) * e, tp * f : (tp + 1) * f].clone().requires_grad_()
    x, topk_idx, weights = _tokens(ep)
    x.requires_grad_()

    routed, tokens_per_expert, handle = a2a.dispatch(x, topk_idx, num_experts=E, group=mesh["ep"])
    expert_of_row = torch.repeat_interleave(torch.arange(e), tokens_per_expert)
    hidden = torch.relu(torch.bmm(routed.unsqueeze(1), w_in_local[expert_of_row]))
    partial_out = torch.bmm(hidden, w_out_local[expert_of_row]).squeeze(1)  # sums over this F shard
    partial_y = a2a.combine(partial_out, handle, weights)
    grad_y = torch.ones_like(partial_y)
    (grad_x,) = torch.autograd.grad(partial_y, x, grad_y)

    y = partial_y.detach().clone()
    dist.all_reduce(y, group=mesh["tp"].get_group())  # complete the F sum
    dist.all_reduce(grad_x, group=mesh["tp"].get_group())

    x_ref = x.detach().clone().requires_grad_()
    y_ref = _dense(x_ref, topk_idx, weights, w_in, w_out)
    (grad_x_ref,) = torch.autograd.grad(y_ref, x_ref, grad_y)
    torch.testing.assert_close(y, y_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_x, grad_x_ref, rtol=1e-12, atol=1e-12)
    return ep, tp, tokens_per_expert.tolist()


def test_expert_tensor_parallel_on_2x2_mesh(pool4):
    results = pool4.run(expert_tensor_parallel_moe)
    assert sorted((ep, tp) for ep, tp, _ in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # tp peers of one ep rank receive the same rows.
    by_ep = {}
    for ep, _, counts in results:
        by_ep.setdefault(ep, []).append(counts)
    assert all(a == b for a, b in by_ep.values())


def warm_default_and_list(rank: int, world_size: int):
    sub = dist.new_group([0, 1])
    return a2a.warmup(), a2a.warmup([dist.group.WORLD, sub])


def test_warmup_groups(pool2):
    assert pool2.run(warm_default_and_list) == [(1, 2), (1, 2)]
