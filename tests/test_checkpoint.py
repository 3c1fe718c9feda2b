"""The SAC policy saves every comm op: backward with it runs exactly the comm ops of backward
without checkpointing, full recompute runs more; results and gradients are unchanged."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import alltoall_ops as a2a
from alltoall_ops.testing import CommOpCounter, moe_step
from alltoall_ops.inspect import compiled_graphs

E, T, H, K = 4, 6, 5, 2




def moe(x, topk_idx, weights, expert_w):
    """A small MoE layer: one (H, H) matrix per expert and a tanh."""
    return moe_step(x, topk_idx, weights, expert_w, E, expert_alignment=2)


def no_checkpoint(*args):
    return moe(*args)


def policy_checkpoint(*args):
    context_fn = partial(create_selective_checkpoint_contexts, a2a.sac_policy())
    return checkpoint(moe, *args, use_reentrant=False, context_fn=context_fn)


def full_recompute(*args):
    return checkpoint(moe, *args, use_reentrant=False)


VARIANTS = (no_checkpoint, policy_checkpoint, full_recompute)


def _inputs(rank: int, world_size: int):
    torch.manual_seed(100 + rank)
    x = torch.randn(T + rank, H, dtype=torch.float64, requires_grad=True)
    topk_idx = torch.randint(-1, E, (T + rank, K))
    weights = torch.rand(T + rank, K, dtype=torch.float64, requires_grad=True)
    expert_w = torch.randn(E // world_size, H, H, dtype=torch.float64, requires_grad=True)
    return x, topk_idx, weights, expert_w


def _grads(y, x, weights, expert_w):
    return torch.autograd.grad(y, (x, weights, expert_w), torch.ones_like(y))


def count_backward_comm_ops(rank: int, world_size: int):
    """Per variant: comm ops run in eager backward, comm ops in the compiled backward graph;
    and checks that outputs and gradients equal the uncheckpointed run."""
    x, topk_idx, weights, expert_w = _inputs(rank, world_size)
    ref_y = no_checkpoint(x, topk_idx, weights, expert_w)
    ref_grads = _grads(ref_y, x, weights, expert_w)
    counts = {}
    for variant in VARIANTS:
        y = variant(x, topk_idx, weights, expert_w)
        counter = CommOpCounter()
        with counter:
            grads = _grads(y, x, weights, expert_w)
        torch.testing.assert_close(y, ref_y, rtol=0, atol=1e-12)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=0, atol=1e-12)
        graphs = compiled_graphs(variant, x, topk_idx, weights, expert_w)
        assert graphs.graph_breaks == 0
        counts[variant.__name__] = (counter.ops, graphs.comm_ops("backward"))
    return counts


@pytest.mark.parametrize("pool", [1, 2], indirect=True)
def test_policy_saves_every_comm_op(pool):
    results = pool.run(count_backward_comm_ops)
    # Full recompute reruns the forward's comm ops: dispatch, combine and, between ranks, the
    # count exchange (one rank has none). Compiled, only those backward needs. On one rank the
    # local ops are inlined (their bodies are traced into the graph): the backward recomputes
    # dispatch, and may recompute pieces of combine's index maths that the backward's own
    # combine shares (the graph keeps one copy of equal nodes).
    group = len(results) > 1
    for counts in results:
        eager = {name: len(ops) for name, (ops, _) in counts.items()}
        compiled = {name: len(ops) for name, (_, ops) in counts.items()}
        assert eager == {"no_checkpoint": 2, "policy_checkpoint": 2, "full_recompute": 2 + (3 if group else 2)}, counts
        assert compiled["no_checkpoint"] == compiled["policy_checkpoint"] == 2, counts
        if group:
            assert compiled["full_recompute"] == 2 + 3, counts
        else:
            assert compiled["full_recompute"] in (2 + 1, 2 + 2), counts
            assert counts["full_recompute"][1].count("alltoall_ops.local_dispatch") == 2, counts
        assert counts["policy_checkpoint"] == counts["no_checkpoint"]


def test_policy_marks():
    policy = a2a.sac_policy(save=[torch.ops.aten.mm.default], recompute=[torch.ops.aten.tanh.default])
    for op in a2a.communication_ops():
        assert policy(None, op) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops._c10d_functional.all_to_all_single.default) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops._c10d_functional.wait_tensor.default) == CheckpointPolicy.MUST_SAVE  # async waits
    assert policy(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.tanh.default) == CheckpointPolicy.MUST_RECOMPUTE
    assert policy(None, torch.ops.aten.add.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE
    meta_src = torch.empty(3, device="meta")
    to_cpu = (torch.ops.aten._to_copy.default, (meta_src,), {"device": torch.device("cpu")})
    assert policy(None, to_cpu[0], *to_cpu[1], **to_cpu[2]) == CheckpointPolicy.MUST_SAVE
    cpu_src = torch.empty(3)
    assert policy(None, to_cpu[0], cpu_src, device="cpu") == CheckpointPolicy.PREFER_RECOMPUTE
    with pytest.raises(ValueError, match="recompute"):
        a2a.sac_policy(save=[torch.ops.aten.mm.default], recompute=[torch.ops.aten.mm.default])


def test_registry_lists_every_comm_op():
    names = {op.name() for op in a2a.communication_ops()}
    assert {"alltoall_ops::exchange_counts", "alltoall_ops::exchange_routing", "alltoall_ops::dispatch",
            "alltoall_ops::combine"} <= names
    # Every op of the namespace that takes a group communicates, so it must be in the registry.
    for name in dir(torch.ops.alltoall_ops):
        packet = getattr(torch.ops.alltoall_ops, name)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            schema = packet.default._schema
            if any(a.name == "group_name" for a in schema.arguments):
                assert packet.default in a2a.communication_ops(), name
