"""The symm_mem placement kernel (``kernels/slot_placement.py``) against plain torch: its six
checks of the exchanged metadata and where each slot lands, on random metadata and routings
(Triton's interpreter without CUDA, compiled with it); the one-rank form that reads the routing
plan's send_meta; and the CPU path of the exchange's checks: the first failed check raises its own
error."""

from __future__ import annotations

import re
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import alltoall_ops as a2a
from alltoall_ops import layout
from alltoall_ops.backends.symm_mem import ops as symm_ops, run_simulated
from alltoall_ops.backends.symm_mem.buffers import ALIGNMENT, CALL, FAILED, META_EXTRA, N_SLOTS
from alltoall_ops.errors import CapacityError, GroupMismatchError, PeerInputError, RoutingError
from alltoall_ops.kernels import loader
from alltoall_ops.kernels.region import Region

DEVICE = "cpu" if loader.load().interpreting() else "cuda"


def _needed_W(counts_WE: torch.Tensor, alignment: int) -> torch.Tensor:
    """(W, E) slots of each source rank per expert -> (W,) rows each rank receives, padded."""
    W, E = counts_WE.shape
    return layout.round_up(counts_WE.sum(0), alignment).view(W, E // W).sum(1)


def _reference_checks(meta_WL: torch.Tensor, E: int, rank: int, alignment: int, max_slots: int, capacity: int,
                      check_overflow: bool) -> int:
    """The six checks in the kernel's order, as a bitmask."""
    checks = [
        (meta_WL[:, E + FAILED] != 0).any(),
        (meta_WL[:, E + CALL] != meta_WL[rank, E + CALL]).any(),
        (meta_WL[:, E + ALIGNMENT] != alignment).any(),
        (meta_WL[:, E] > 0).any(),  # the status' first column: bad expert ids
        (meta_WL[:, E + N_SLOTS] > max_slots).any(),
        check_overflow and (_needed_W(meta_WL[:, :E], alignment) > capacity).any(),
    ]
    return sum(int(bool(c)) << i for i, c in enumerate(checks))


def _reference_placement(counts_WE: torch.Tensor, topk_idx_TK: torch.Tensor, position_TK: torch.Tensor, rank: int,
                         alignment: int, max_slots: int, C: int) -> tuple[torch.Tensor, ...]:
    """slot_dst (N,), tokens_per_expert (e,), num_routed (1,), dropped (W,) in plain torch: the
    collective backend's expert-major, source-rank, send-order layout, cut at C."""
    W, E = counts_WE.shape
    e = E // W
    starts_WE, padded_E = layout.block_starts(counts_WE, e, alignment)
    g_N = topk_idx_TK.reshape(-1).to(torch.int64)
    expert_N = g_N.clamp(0, E - 1)
    row_N = (starts_WE[rank] - layout.exclusive_cumsum(counts_WE[rank], 0))[expert_N] + position_TK.reshape(-1)
    valid_N = (g_N >= 0) & (g_N < E) & (position_TK.reshape(-1) < max_slots)
    slot_dst_N = torch.where(valid_N & (row_N < C), (expert_N // e) * C + row_N, torch.full_like(row_N, -1))
    own_start_e = starts_WE[0].view(W, e)[rank]  # source rank 0's blocks start the expert groups
    tokens_per_expert_e = torch.minimum(padded_E.view(W, e)[rank], (C - own_start_e).clamp(min=0))
    dropped_W = torch.minimum((starts_WE + counts_WE - C).clamp(min=0), counts_WE).sum(0).view(W, e).sum(1)
    own_end_e = torch.minimum(own_start_e + tokens_per_expert_e, torch.tensor(C))
    pad_first_e = torch.minimum(own_start_e + counts_WE.sum(0).view(W, e)[rank], torch.tensor(C))
    pads = torch.cat([pad_first_e, torch.maximum(own_end_e, pad_first_e)])  # with peers: the padding rows
    return slot_dst_N, tokens_per_expert_e, tokens_per_expert_e.sum().reshape(1), dropped_W, pads


def _place(meta: Optional[torch.Tensor], topk_idx_TK: torch.Tensor, position_TK: Optional[torch.Tensor], *, W: int,
           E: int, rank: int, alignment: int, max_slots: int, capacity: int, check_overflow: bool = True,
           max_programs=None, at_address: bool = False):
    """The kernel's outputs; ``at_address``: meta read through its address (as from the buffers);
    meta and position None: the kernel plans first."""
    meta, position_TK = (None if t is None else t.to(DEVICE) for t in (meta, position_TK))
    return loader.load().place_slots(
        Region.of(meta) if at_address else meta, topk_idx_TK.to(DEVICE), position_TK, num_experts=E,
        world_size=W, rank=rank, meta_columns=E + META_EXTRA, columns=symm_ops.CHECK_COLUMNS,
        expert_alignment=alignment, max_slots=max_slots, capacity=capacity, check_overflow=check_overflow,
        max_programs=max_programs,
    )


def _routing(T: int, K: int, E: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random routing of T tokens with some -1 and some bad ids -> topk_idx (T, K), position
    (T, K) and send_meta (1, E + status) of one rank's plan."""
    g = torch.Generator().manual_seed(seed)
    topk_idx = torch.randint(-1, E + 1, (T, K), generator=g)
    plan = layout.plan_routing(topk_idx.to(DEVICE), E, 1)
    return topk_idx, plan.position.cpu(), plan.send_meta.cpu()


def _assert_placement(p, expected, one_rank: bool = False) -> None:
    """``one_rank``: the placement from a plan's send_meta, whose row_slot is each row's slot; else
    row_slot holds each local expert's padding rows [first, end)."""
    names = ("slot_dst", "tokens_per_expert", "num_routed", "dropped", "pads")
    outputs = (p.slot_dst_N, p.tokens_per_expert_e, p.num_routed_1, p.dropped_W) + (() if one_rank else (p.row_slot_C,))
    for name, got, want in zip(names, outputs, expected):
        assert torch.equal(got.cpu(), want), f"{name}: {got.tolist()} != {want.tolist()}"
    slot_dst_N, _, num_routed_1, _, _ = expected
    if one_rank:  # each routed row's slot (the inverse of slot_dst), -1 for padding
        n, sent = int(num_routed_1), slot_dst_N >= 0
        row_slot = torch.full((n,), -1)
        row_slot[slot_dst_N[sent]] = torch.arange(slot_dst_N.numel())[sent]
        assert torch.equal(p.row_slot_C[:n].cpu(), row_slot), f"row_slot: {p.row_slot_C[:n].tolist()} != {row_slot}"


@st.composite
def metadata(draw):
    """(meta_WL, topk_idx, position, rank, alignment, max_slots, capacity, check_overflow): rank's
    row counts its own random routing (some -1, some bad ids), the other rows random; each flag
    column mostly right, max_slots and the capacity on their bounds or one off."""
    W, e = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    E, rank = W * e, draw(st.integers(0, W - 1))
    alignment, call = draw(st.integers(1, 4)), draw(st.integers(1, 10**6))
    T, K = draw(st.integers(0, 6)), draw(st.integers(1, 3))
    topk_idx = torch.tensor(draw(st.lists(st.lists(st.integers(-1, E), min_size=K, max_size=K),
                                          min_size=T, max_size=T)), dtype=torch.int64).view(T, K)
    plan = layout.plan_routing(topk_idx.to(DEVICE), E, W)

    def column(good: int, bad: st.SearchStrategy) -> list[int]:
        return [draw(st.one_of(st.just(good), bad)) if draw(st.booleans()) else good for _ in range(W)]

    counts_WE = torch.tensor(draw(st.lists(st.lists(st.integers(0, 9), min_size=E, max_size=E),
                                           min_size=W, max_size=W)))
    counts_WE[rank] = plan.send_meta[:, :e].reshape(-1).cpu()
    n_slots = counts_WE.sum(1)
    n_slots[rank] = T * K
    bad_ids = column(0, st.integers(1, 3))
    status = [[bad_ids[s], draw(st.integers(-1, E)), draw(st.integers(-1, E))] for s in range(W)]
    meta_WL = torch.zeros(W, E + META_EXTRA, dtype=torch.int64)
    meta_WL[:, :E] = counts_WE
    meta_WL[:, E : E + layout.STATUS_COLUMNS] = torch.tensor(status)
    meta_WL[:, E + N_SLOTS] = n_slots
    meta_WL[:, E + FAILED] = torch.tensor(column(0, st.just(1)))
    meta_WL[:, E + CALL] = torch.tensor(column(call, st.integers(0, call + 1)))
    meta_WL[:, E + ALIGNMENT] = torch.tensor(column(alignment, st.integers(1, 4)))
    near = st.sampled_from([-1, 0, 0, 1])  # on the bound half the time: a check off by one fails
    max_slots = max(0, int(n_slots.max()) + draw(near))
    capacity = max(1, int(_needed_W(counts_WE, alignment).max()) + draw(near))
    return meta_WL, topk_idx, plan.position.cpu(), rank, alignment, max_slots, capacity, draw(st.booleans())


@settings(max_examples=60, deadline=None, derandomize=False)
@given(metadata(), st.booleans())
def test_kernel_matches_the_reference(case, at_address):
    meta_WL, topk_idx, position, rank, alignment, max_slots, capacity, check_overflow = case
    W, E = meta_WL.shape[0], meta_WL.shape[1] - META_EXTRA
    p = _place(meta_WL, topk_idx, position, W=W, E=E, rank=rank, alignment=alignment, max_slots=max_slots,
               capacity=capacity, check_overflow=check_overflow, at_address=at_address)
    assert p.failed_checks_1.shape == (1,) and p.failed_checks_1.dtype == torch.int64
    expected = _reference_checks(meta_WL, E, rank, alignment, max_slots, capacity, check_overflow)
    got = int(p.failed_checks_1)
    assert got == expected, f"{got:06b} != {expected:06b} (bits: check 0 last)"
    assert torch.equal(p.meta_WL.cpu(), meta_WL)
    _assert_placement(p, _reference_placement(meta_WL[:, :E], topk_idx, position, rank, alignment, max_slots,
                                              capacity))


@pytest.mark.parametrize("W, e, max_programs", [(48, 40, None), (3, 1500, None), (3, 1500, 2)])
def test_more_than_one_tile(W, e, max_programs):
    # Past the kernel's tile of MAX_BLOCK_E = 1024 experts, with expert groups across tiles (e =
    # 1500, not a power of two), many slots over several programs (or two striding: an SM
    # budget), many ranks. The capacity just enough, then one short (rows dropped).
    alignment, rank = 3, W - 2
    E = W * e
    topk_idx = torch.randint(-1, E, (1500, 2), generator=torch.Generator().manual_seed(e))
    position = layout.plan_routing(topk_idx.to(DEVICE), E, W).position.cpu()
    meta_WL = torch.zeros(W, E + META_EXTRA, dtype=torch.int64)
    meta_WL[:, :E] = torch.randint(0, 5, (W, E), generator=torch.Generator().manual_seed(W))
    meta_WL[rank, :E] = torch.bincount(topk_idx[topk_idx >= 0], minlength=E)
    meta_WL[:, E + CALL], meta_WL[:, E + ALIGNMENT] = 7, alignment
    most = int(_needed_W(meta_WL[:, :E], alignment).max())
    for capacity, expected in ((most, 0), (most - 1, 1 << 5)):
        p = _place(meta_WL, topk_idx, position, W=W, E=E, rank=rank, alignment=alignment, max_slots=3000,
                   capacity=capacity, max_programs=max_programs, at_address=True)
        assert int(p.failed_checks_1) == expected == _reference_checks(meta_WL, E, rank, alignment, 3000, capacity,
                                                                       True)
        _assert_placement(p, _reference_placement(meta_WL[:, :E], topk_idx, position, rank, alignment, 3000,
                                                  capacity))


@pytest.mark.parametrize("T, K, E, alignment, max_slots, capacity", [
    (40, 3, 7, 1, 120, 200),  # everything fits
    (40, 3, 7, 4, 120, 50),  # padded groups past C: dropped slots
    (40, 3, 7, 1, 119, 200),  # T * K above max_slots: bit 4
    (300, 4, 5, 8, 1200, 1240),  # many slots per expert, wide padding
    (16, 2, 1024, 9, 32, 300),  # 1024 experts: each one's 8 padding rows in two tiles (PAD_ELEMENTS)
])
def test_one_rank_reads_the_plan(T, K, E, alignment, max_slots, capacity):
    # One rank: no exchange, the kernel reads the plan's send_meta (1, E + 3) and writes the row
    # with this call's header (n_slots, alignment, no failure, call 0), and each routed row's slot.
    topk_idx, position, send_meta = _routing(T, K, E, seed=T * E + alignment)
    p = _place(send_meta, topk_idx, position, W=1, E=E, rank=0, alignment=alignment, max_slots=max_slots,
               capacity=capacity)
    row = torch.cat([send_meta[0], torch.tensor([T * K, alignment, 0, 0])]).view(1, -1)
    assert torch.equal(p.meta_WL.cpu(), row)
    expected = _reference_checks(row, E, 0, alignment, max_slots, capacity, True)
    assert int(p.failed_checks_1) == expected and (expected >> 4 & 1) == (T * K > max_slots)
    _assert_placement(p, _reference_placement(row[:, :E], topk_idx, position, 0, alignment, max_slots, capacity),
                      one_rank=True)
    if T * K > loader.load().routing_plan.ONE_PROGRAM_SLOTS:
        return
    # up to 1024 slots the kernel may plan them first itself (one rank's metadata stage in one launch)
    planned = _place(None, topk_idx, None, W=1, E=E, rank=0, alignment=alignment, max_slots=max_slots,
                     capacity=capacity)
    assert torch.equal(planned.position_TK.cpu(), position) and torch.equal(planned.meta_WL.cpu(), row)
    assert int(planned.failed_checks_1) == expected
    _assert_placement(planned, _reference_placement(row[:, :E], topk_idx, position, 0, alignment, max_slots, capacity),
                      one_rank=True)


def test_placement_plans_first_only_what_one_program_plans():
    topk_idx, position, send_meta = _routing(513, 2, 4, seed=5)
    kwargs = dict(E=4, rank=0, alignment=1, max_slots=2000, capacity=2000)
    for meta, pos, W, message in ((None, None, 1, "1026 slots"), (None, position, 1, "both None"),
                                  (None, None, 2, "world_size 2")):
        with pytest.raises(ValueError, match=message):
            _place(meta, topk_idx if W == 1 else topk_idx[:8], pos, W=W, **kwargs)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 1024), st.integers(1, 8), st.integers(1, 300), st.sampled_from([None, 1, 2, 3, 16]),
       st.integers(1, 4), st.data())
def test_the_placement_plans_its_blocks_as_plan_routing(N, K, E, max_programs, alignment, data):
    # One rank, the plan first: every program plans the blocks of slots it places
    # (routing_plan.plan_blocks_first: each slot's position counted against all N slots, a copy of
    # send_meta a program). Over the block count, several blocks a program (an SM budget) and
    # bad ids and -1: the routing plan's positions, the row with this call's header, and the
    # placement of those. A slot's key is compared with slots in other blocks, before and after it.
    T = N // K
    E_hot = data.draw(st.integers(1, E))  # few hot experts: long runs of one bucket across blocks
    ids = data.draw(st.lists(st.integers(-2, E_hot), min_size=T * K, max_size=T * K))
    topk_idx = torch.tensor(ids, dtype=torch.int64).view(T, K)
    plan = layout.plan_routing(topk_idx.to(DEVICE), E, 1)
    position, send_meta = plan.position.cpu(), plan.send_meta.cpu()
    kwargs = dict(W=1, E=E, rank=0, alignment=alignment, max_slots=T * K, capacity=T * K * alignment + 1)
    planned = _place(None, topk_idx, None, max_programs=max_programs, **kwargs)
    row = torch.cat([send_meta[0], torch.tensor([T * K, alignment, 0, 0])]).view(1, -1)
    assert torch.equal(planned.position_TK.cpu(), position) and torch.equal(planned.meta_WL.cpu(), row)
    assert int(planned.failed_checks_1) == _reference_checks(row, E, 0, alignment, T * K, kwargs["capacity"], True)
    _assert_placement(planned, _reference_placement(row[:, :E], topk_idx, position, 0, alignment, T * K,
                                                    kwargs["capacity"]), one_rank=True)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 120), st.integers(1, 8), st.integers(0, 3), st.data())
def test_the_metadata_put_plans_as_plan_routing(W, e, T, K, rank, data):
    # put_meta(topk_idx=...) plans the slots in its own program (the path with peers, up to
    # ONE_PROGRAM_SLOTS slots, one launch for both): the same positions and send_meta as the
    # routing plan, and the same row into every rank's metadata, bad ids and -1 included.
    E, rank, k = W * e, rank % W, loader.load()
    T = min(T, k.routing_plan.ONE_PROGRAM_SLOTS // K)
    ids = data.draw(st.lists(st.integers(-2, E + 1), min_size=T * K, max_size=T * K))
    topk_idx = torch.tensor(ids, dtype=torch.int64).view(T, K).to(DEVICE)
    plan = layout.plan_routing(topk_idx, E, W)
    L, header, columns = E + META_EXTRA, (T * K, 3, 0), (N_SLOTS, ALIGNMENT, FAILED, CALL)
    call = torch.tensor([5], device=DEVICE)
    metas = [torch.zeros(W, W, L, dtype=torch.int64, device=DEVICE) for _ in range(2)]
    tables = [torch.tensor([row.data_ptr() for row in m], device=DEVICE) for m in metas]  # every rank's row
    k.put_meta(plan.send_meta, header, call, tables[0], rank, E, L, columns)
    position, send_meta = k.put_meta(None, header, call, tables[1], rank, E, L, columns, topk_idx=topk_idx)
    assert torch.equal(position, plan.position) and torch.equal(send_meta, plan.send_meta)
    assert torch.equal(metas[1], metas[0]) and bool((metas[0][:, rank, E + CALL] == 5).all())


FAILURES = [  # check i of the kernel's bits: how to fail it on rank 0 of two (E = 2, call 1), the error
    (lambda m: m[0, 2 + FAILED].fill_(1), PeerInputError, "rank 0 rejected its arguments"),
    (lambda m: m[0, 2 + CALL].fill_(2), GroupMismatchError, "out of step"),
    (lambda m: m[0, 2 + ALIGNMENT].fill_(2), GroupMismatchError, "disagree on expert_alignment"),
    (lambda m: m[0, 2:5].copy_(torch.tensor([1, -1, 7])), RoutingError, "1 expert id(s) outside"),
    (lambda m: m[0, 2 + N_SLOTS].fill_(3), CapacityError, "T * K = 3 slots"),
    (lambda m: m[0, 0].fill_(4), CapacityError, "overflow: rank 0 must receive 4 rows"),
]


@pytest.mark.parametrize("first", range(len(FAILURES)))
def test_the_first_failed_check_raises(first):
    # Checks first.. all fail: the exchange raises the first one's error (CPU) on both ranks,
    # with its message.
    if DEVICE != "cpu":
        pytest.skip("CUDA: a device-side assert, no exception")
    bufs = a2a.SymmBuffers.simulated(2, 2, 1, 1, 2, dtype=torch.float32, device="cpu", capacity=3)  # N_max = 2
    meta_WL = torch.zeros(2, 2 + META_EXTRA, dtype=torch.int64)
    meta_WL[:, 2 + CALL], meta_WL[:, 2 + ALIGNMENT] = 1, 1
    no_slots = torch.empty(0, 1, dtype=torch.int64)
    errors = []

    def place(rank, b):  # the exchange op's checks, on this metadata
        p = _place(meta_WL, no_slots, no_slots, W=2, E=2, rank=rank, alignment=1, max_slots=b.max_slots,
                   capacity=b.capacity)
        try:
            symm_ops._raise_failed_checks(p.failed_checks_1, p.meta_WL, b, 1)
        except Exception as e:  # noqa: BLE001 - compared below
            errors.append(e)

    run_simulated(place, bufs)
    assert errors == []  # passes
    for fail, _, _ in FAILURES[first:]:
        fail(meta_WL)
    _, kind, message = FAILURES[first]
    run_simulated(place, bufs)
    assert len(errors) == 2 and all(type(e) is kind for e in errors), errors
    assert all(re.search(re.escape(message), str(e)) for e in errors), errors

