"""Property tests of the routing-layout functions in ``alltoall_ops.layout``, and of the Triton
kernels that compute ``plan_routing`` on CUDA (here in Triton's interpreter) against its torch
implementation."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alltoall_ops import layout
from alltoall_ops.kernels import loader

LAYOUT_EXAMPLES = settings(max_examples=40)  # pure, millisecond-cheap functions


@st.composite
def routings(draw, allow_bad: bool = True):
    """(topk_idx (T, K), num_experts, world_size); ids mostly valid, some -1, some out of range."""
    W = draw(st.integers(1, 4))
    E = W * draw(st.integers(1, 3))
    T = draw(st.integers(0, 10))
    K = draw(st.integers(1, 4))
    lo, hi = (-3, E + 2) if allow_bad else (-1, E - 1)
    ids = draw(st.lists(st.integers(lo, hi), min_size=T * K, max_size=T * K))
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    return torch.tensor(ids, dtype=dtype).view(T, K), E, W


@st.composite
def recv_count_matrices(draw):
    """((W, e) int64 counts, expert_alignment)."""
    W, e = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    counts = draw(st.lists(st.integers(0, 6), min_size=W * e, max_size=W * e))
    return torch.tensor(counts, dtype=torch.int64).view(W, e), draw(st.integers(1, 5))


@LAYOUT_EXAMPLES
@given(routings())
def test_plan_routing_order_and_position(case):
    topk_idx, E, W = case
    T, K = topk_idx.shape
    N = T * K
    plan = layout.plan_routing(topk_idx, E, W)
    ids = topk_idx.reshape(-1).tolist()
    order, position = plan.order.tolist(), plan.position.reshape(-1).tolist()

    assert plan.order.dtype == plan.position.dtype == torch.int64
    assert tuple(plan.position.shape) == (T, K)
    assert sorted(order) == list(range(N))  # a permutation of the slots
    assert [position[slot] for slot in order] == list(range(N))  # position inverts order

    valid = [n for n in range(N) if 0 <= ids[n] < E]
    dropped = [n for n in range(N) if not 0 <= ids[n] < E]
    # Valid slots first, sorted by (expert, slot index); then the rest in slot order.
    assert order == sorted(valid, key=lambda n: (ids[n], n)) + dropped
    assert all(position[n] >= len(valid) for n in dropped)


@LAYOUT_EXAMPLES
@given(routings())
def test_plan_routing_send_meta(case):
    topk_idx, E, W = case
    e = E // W
    plan = layout.plan_routing(topk_idx, E, W)
    ids = topk_idx.reshape(-1).tolist()
    counts, status = layout.split_meta(plan.send_meta)

    assert plan.send_meta.dtype == torch.int64
    assert tuple(plan.send_meta.shape) == (W, e + layout.STATUS_COLUMNS)
    # counts[r, j]: slots sent to local expert j of rank r, i.e. global expert r * e + j.
    assert counts.reshape(-1).tolist() == [ids.count(g) for g in range(E)]
    assert int(counts.sum()) == sum(0 <= i < E for i in ids)
    # Status: every row repeats (number of bad ids, min id, max id), -1 standing in for none.
    num_bad = sum(i < -1 or i >= E for i in ids)
    expected = [num_bad, min(ids + [-1]), max(ids + [-1])]
    assert status.tolist() == [expected] * W


@LAYOUT_EXAMPLES
@given(routings(allow_bad=False))
def test_plan_routing_status_clean_for_valid_ids(case):
    topk_idx, E, W = case
    _, status = layout.split_meta(layout.plan_routing(topk_idx, E, W).send_meta)
    assert (status[:, 0] == 0).all()
    assert (status[:, 1] >= -1).all() and (status[:, 2] < E).all()


needs_interpreter = pytest.mark.skipif(
    not loader.load().interpreting(), reason="the kernels run on CPU tensors only in Triton's interpreter"
)


@contextlib.contextmanager
def one_program_slots(n: int):
    """Plans of at most ``n`` slots in one program (``routing_plan.ONE_PROGRAM_SLOTS``), more in three
    kernels: 0 takes the three kernels for every plan."""
    routing_plan = loader.load().routing_plan
    before, routing_plan.ONE_PROGRAM_SLOTS = routing_plan.ONE_PROGRAM_SLOTS, n
    try:
        yield
    finally:
        routing_plan.ONE_PROGRAM_SLOTS = before


PLAN_KERNELS = (0, 1 << 20)
"""``one_program_slots`` values that take each of the plan's kernel paths: three kernels, one program."""


def _assert_kernels_match_torch(topk_idx: torch.Tensor, E: int, W: int, max_programs=None) -> None:
    want = layout._plan_routing_torch(topk_idx, E, W)
    for slots in PLAN_KERNELS:
        with one_program_slots(slots):
            got = loader.load().plan_slots(topk_idx, E, W, max_programs)
        for name, g, w in zip(("order", "position", "send_meta"), got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert torch.equal(g, w), (slots, name, g, w)


@needs_interpreter
@LAYOUT_EXAMPLES
@given(routings())
def test_plan_routing_kernels_match_torch(case):
    _assert_kernels_match_torch(*case)


@needs_interpreter
@pytest.mark.parametrize("E, W", [(8, 2), (14, 7), (255, 5), (256, 8)])  # E + 1 a power of 2 too
def test_plan_routing_kernels_many_blocks(E, W):
    """Thousands of slots: many blocks, each slot's position built from the blocks before it."""
    g = torch.Generator().manual_seed(E)
    topk_idx = torch.randint(-1, E, (700, 4), generator=g)
    topk_idx[::97, 1] = E + 3  # out of range: counted in the status, sent nowhere
    _assert_kernels_match_torch(topk_idx, E, W)


@needs_interpreter
@pytest.mark.parametrize("max_programs", [1, 3])
def test_plan_routing_kernels_under_a_budget(max_programs):
    """At most ``max_programs`` programs a launch: each program of the counts and the positions
    strides over blocks of slots, and each of the scan over blocks of buckets (256 buckets here,
    16 a program in the interpreter); the plan is the same."""
    g = torch.Generator().manual_seed(max_programs)
    topk_idx = torch.randint(-1, 255, (700, 4), generator=g)
    topk_idx[::89, 2] = -5  # bad: counted in the status
    _assert_kernels_match_torch(topk_idx, 255, 5, max_programs)


@LAYOUT_EXAMPLES
@given(routings(), st.integers(1, 5))
def test_plan_rows_is_the_padded_expert_major_layout(case, alignment):
    """The local backend's rows against a plain Python walk: experts in order, each group's slots
    in slot order, groups padded to the alignment; row_src and row inverse on the valid slots."""
    topk_idx, E, _ = case
    T, K = topk_idx.shape
    C = layout.local_capacity(T * K, E, alignment)
    row_src, row, meta = layout._plan_rows_torch(topk_idx, E, alignment, C)
    ids = topk_idx.reshape(-1).tolist()
    want_src, want_row = [], [C] * (T * K)
    for g in range(E):
        slots = [s for s, i in enumerate(ids) if i == g]
        for s in slots:
            want_row[s] = len(want_src)
            want_src.append(s)
        want_src += [-1] * (-len(slots) % alignment)  # the group's padding
    want_src += [-1] * (C - len(want_src))  # the tail
    counts = [ids.count(g) for g in range(E)]
    assert row_src.tolist() == want_src and row.reshape(-1).tolist() == want_row
    assert meta[0, :E].tolist() == [layout.round_up(c, alignment) for c in counts]
    bad = sum(not -1 <= i < E for i in ids)
    assert meta[0, E].item() == bad and meta[0, E + 3].item() == int(bad == 0)


@LAYOUT_EXAMPLES
@given(routings(), st.integers(1, 5))
def test_plan_rows_kernels_match_torch(case, alignment):
    topk_idx, E, _ = case
    C = layout.local_capacity(topk_idx.numel(), E, alignment)
    want = layout._plan_rows_torch(topk_idx, E, alignment, C)
    for slots in PLAN_KERNELS:
        with one_program_slots(slots):
            got = loader.load().plan_rows(topk_idx, E, alignment, C)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), slots


@LAYOUT_EXAMPLES
@given(recv_count_matrices())
def test_padded_tokens_per_expert(case):
    counts, align = case
    padded = layout.padded_tokens_per_expert(counts, align)
    per_expert = counts.sum(0)
    assert padded.dtype == torch.int64 and tuple(padded.shape) == (counts.shape[1],)
    assert (padded % align == 0).all()
    assert (padded >= per_expert).all() and (padded < per_expert + align).all()


@LAYOUT_EXAMPLES
@given(recv_count_matrices())
def test_expert_major_rows(case):
    counts, align = case
    W, e = counts.shape
    rows = layout.expert_major_rows(counts, align, int(counts.sum())).tolist()
    padded = layout.padded_tokens_per_expert(counts, align).tolist()
    total = sum(padded)

    assert len(rows) == int(counts.sum())
    assert len(set(rows)) == len(rows)  # an injection ...
    assert all(0 <= r < total for r in rows)  # ... into [0, padded total)
    # Expert j's group starts at the sum of the earlier padded groups; inside it, rows come by
    # source rank then arrival order, and whatever follows them up to the group's end is padding.
    starts = [sum(padded[:j]) for j in range(e)]
    expected = []
    for s in range(W):  # received rows are rank-major: source rank, local expert, row
        for j in range(e):
            first = starts[j] + int(counts[:s, j].sum())
            expected += range(first, first + int(counts[s, j]))
    assert rows == expected
    padding = set(range(total)) - set(rows)
    for j in range(e):
        group_end = starts[j] + padded[j]
        real_end = starts[j] + int(counts[:, j].sum())
        assert set(range(real_end, group_end)) <= padding
        assert padded[j] - (real_end - starts[j]) < align  # never a whole spare block


def test_expert_major_rows_example():
    # 2 source ranks, 2 local experts, alignment 4: expert 0 gets 1 + 2 rows -> 4, expert 1
    # gets 3 + 0 rows -> 4.  Rank-major arrivals: (s0,e0) (s0,e1)x3 (s1,e0)x2.
    counts = torch.tensor([[1, 3], [2, 0]])
    assert layout.padded_tokens_per_expert(counts, 4).tolist() == [4, 4]
    assert layout.expert_major_rows(counts, 4, 6).tolist() == [0, 4, 5, 6, 1, 2]


@needs_interpreter
def test_plan_routing_uses_the_kernels_up_to_max_slots(monkeypatch):
    """The op picks the kernels for tensors that use them (CUDA; here patched) up to MAX_SLOTS
    slots and the sort path above; both give the same plan."""
    kernels = loader.load()
    calls = []
    plan_slots = kernels.plan_slots
    monkeypatch.setattr(loader, "use_kernels", lambda t: True)
    monkeypatch.setattr(kernels.routing_plan, "MAX_SLOTS", 40)
    monkeypatch.setattr(kernels, "plan_slots", lambda *args: calls.append(args[0].numel()) or plan_slots(*args))
    for T in (20, 21):  # K = 2: 40 slots, then 42
        topk_idx = torch.randint(-1, 8, (T, 2), generator=torch.Generator().manual_seed(T))
        got = layout.plan_routing(topk_idx, 8, 2)
        want = layout._plan_routing_torch(topk_idx, 8, 2)
        assert all(torch.equal(g, w) for g, w in zip((got.order, got.position, got.send_meta), want))
    assert calls == [40]


def test_plain_eager_calls_skip_the_dispatcher_but_a_mode_sees_the_ops():
    """In plain eager code plan_rows / local_dispatch / local_combine run their bodies
    directly (host time); under a dispatch mode (SAC, op counters) they are ops, with equal results."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import alltoall_ops

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(5)
    x, idx = torch.randn(6, 3, generator=g), torch.randint(-1, 4, (6, 2), generator=g)

    def step():
        routed, tpe, handle = alltoall_ops.dispatch(x, idx, num_experts=4, expert_alignment=2)
        return routed, tpe, alltoall_ops.combine(routed * 3, handle)

    direct = step()
    with Ops() as seen:
        watched = step()
    ours = {n for n in seen.names if n.startswith("alltoall_ops::")}
    assert ours == {f"alltoall_ops::{n}" for n in ("plan_rows", "local_dispatch", "local_combine")}
    for a, b in zip(direct, watched):
        assert torch.equal(a, b)
