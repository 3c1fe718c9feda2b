"""``dispatch_layout`` (DeepEP's dispatch layout) against a plain Python count of the same
quantities, on random routings; its API checks; compiled with one compilation across routings;
consistency with the counts ``dispatch`` sends; and its Triton kernel (Triton's interpreter
without CUDA) against the torch ops."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

import alltoall_ops as a2a
from alltoall_ops import layout
from alltoall_ops.kernels import loader

OPS = torch.ops.alltoall_ops


@st.composite
def routings(draw):
    """(topk_idx (T, K), E, W, num_nodes): ids in [-1, E), sometimes out of range."""
    W = draw(st.integers(1, 8))
    e = draw(st.integers(1, 5))
    E = W * e
    nodes = draw(st.sampled_from([n for n in range(1, W + 1) if W % n == 0]))
    T = draw(st.integers(0, 12))
    K = draw(st.integers(1, min(E, 4)))
    ids = draw(st.lists(st.integers(-3, E + 2), min_size=T * K, max_size=T * K))
    return torch.tensor(ids, dtype=torch.int64).view(T, K), E, W, nodes


def reference(topk_idx: torch.Tensor, E: int, W: int, nodes: int):
    e, per_node = E // W, W // nodes
    T = topk_idx.shape[0]
    per_rank, per_expert, per_node_count = [0] * W, [0] * E, [0] * nodes
    in_rank = [[False] * W for _ in range(T)]
    for t, row in enumerate(topk_idx.tolist()):
        ranks = set()
        for g in row:
            if 0 <= g < E:
                per_expert[g] += 1
                ranks.add(g // e)
        for r in ranks:
            per_rank[r] += 1
            in_rank[t][r] = True
        for n in {r // per_node for r in ranks}:
            per_node_count[n] += 1
    return per_rank, per_expert, per_node_count, in_rank


@settings(max_examples=150, deadline=None)
@given(routings())
def test_equals_a_plain_count(case):
    topk_idx, E, W, nodes = case
    got = layout.DispatchLayout(*OPS.dispatch_layout(topk_idx, E, W, nodes))
    per_rank, per_expert, per_node, in_rank = reference(topk_idx, E, W, nodes)
    assert got.tokens_per_rank.tolist() == per_rank
    assert got.tokens_per_expert.tolist() == per_expert
    assert got.tokens_per_node.tolist() == per_node
    assert got.is_token_in_rank.tolist() == in_rank
    assert got.is_token_in_rank.dtype == torch.bool and got.tokens_per_rank.dtype == torch.int64


@settings(max_examples=50, deadline=None)
@given(routings())
def test_expert_counts_are_what_dispatch_sends(case):
    topk_idx, E, W, _ = case
    plan = layout.plan_routing(topk_idx, E, W)
    counts_We, _ = layout.split_meta(plan.send_meta)
    got = OPS.dispatch_layout(topk_idx, E, W, 1)[1]
    assert torch.equal(got.view(W, E // W), counts_We)


def test_public_api_on_one_rank():
    topk_idx = torch.tensor([[0, 3], [2, -1], [1, 1]], dtype=torch.int32)
    out = a2a.dispatch_layout(topk_idx, num_experts=4)
    assert out.tokens_per_rank.tolist() == [3] and out.tokens_per_node.tolist() == [3]
    assert out.tokens_per_expert.tolist() == [1, 2, 1, 1]
    assert out.is_token_in_rank.tolist() == [[True], [True], [True]]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(topk_idx=torch.zeros(2, 2), num_experts=4), TypeError, "topk_idx: expected a 2-D integer tensor"),
    (dict(topk_idx=torch.zeros(4, dtype=torch.int64), num_experts=4), TypeError, "topk_idx"),
    (dict(topk_idx=torch.zeros(2, 2, dtype=torch.int64), num_experts=0), ValueError, "num_experts"),
    (dict(topk_idx=torch.zeros(2, 2, dtype=torch.int64), num_experts=4, num_nodes=2), ValueError,
     "num_nodes: expected a divisor of the group size 1, got 2"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    with pytest.raises(error, match=match):
        a2a.dispatch_layout(**kwargs)


def test_compiles_once_across_routings():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    fn = torch.compile(lambda idx: OPS.dispatch_layout(idx, 8, 4, 2), backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        idx = torch.randint(-1, 8, (6, 2), generator=g)
        for got, want in zip(fn(idx), OPS.dispatch_layout(idx, 8, 4, 2)):
            assert torch.equal(got, want)
    assert counter.frame_count == 1


def test_opcheck():
    g = torch.Generator().manual_seed(1)
    for T in (0, 5):
        torch.library.opcheck(OPS.dispatch_layout.default, (torch.randint(-1, 8, (T, 3), generator=g), 8, 4, 2))


# The Triton kernel (``kernels/dispatch_layout.py``): in Triton's interpreter on CPU tensors here,
# compiled on CUDA; exactly the torch reference.
KERNEL_DEVICE = "cpu" if loader.load().interpreting() else "cuda"


def _kernel_equals_torch(topk_idx: torch.Tensor, E: int, W: int, nodes: int) -> None:
    got = loader.load().dispatch_layout(topk_idx.to(KERNEL_DEVICE), E, W, nodes)
    want = layout._dispatch_layout_torch(topk_idx, E, W, nodes)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.cpu(), w)


@settings(max_examples=30, deadline=None, derandomize=False)
@given(routings())
def test_kernel_equals_the_torch_ops(case):
    _kernel_equals_torch(*case)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_kernel_over_several_programs(dtype):
    g = torch.Generator().manual_seed(2)
    T, K, E, W, nodes = 700, 4, 24, 6, 3  # 3 programs of 256 tokens in the interpreter
    topk_idx = torch.randint(-2, E + 2, (T, K), generator=g).to(dtype)
    topk_idx[::7] = -1  # tokens that go nowhere
    _kernel_equals_torch(topk_idx, E, W, nodes)
    _kernel_equals_torch(topk_idx.t().contiguous().t(), E, W, nodes)  # strided ids


def test_kernel_without_tokens():
    _kernel_equals_torch(torch.empty(0, 3, dtype=torch.int64), 8, 4, 2)


def test_op_takes_the_kernel_where_kernels_are_used():
    g = torch.Generator().manual_seed(3)
    topk_idx = torch.randint(-1, 8, (9, 2), generator=g)
    with mock.patch.object(loader, "use_kernels", lambda t: True):
        got = OPS.dispatch_layout(topk_idx.to(KERNEL_DEVICE), 8, 4, 2)
    for g_, w in zip(got, layout._dispatch_layout_torch(topk_idx, 8, 4, 2)):
        assert torch.equal(g_.cpu(), w)
