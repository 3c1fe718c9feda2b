"""Kernel of the symm_mem backend's slot placement: the checks of the exchanged metadata and
where every slot of this rank lands, in one launch, no host sync.

Legend: ``W`` ranks, ``E`` experts, ``e = E / W`` local experts per rank, ``C`` rows of capacity,
``N`` slots of this rank (``rank``). Row s of ``meta`` (W, L) is rank s's: ``counts[s, g]``
(columns [0, E): slots rank s sends to expert g), then the status and the header at the given
offsets past E. Reference semantics (``a`` the alignment; ``SymmMemBackend``'s layout: expert
groups on their owner, within a group the source ranks in order, each source's slots in send
order)::

    padded[g]       = round_up(counts[:, g].sum(), a)
    expert_start[g] = sum(padded[g'] for g' of g's owner with g' < g)
    start[s, g]     = expert_start[g] + counts[:s, g].sum()                 # block (s, g)'s first row
    row(slot)       = start[rank, g] - counts[rank, :g].sum() + position    # g = the slot's expert
    slot_dst(slot)  = (g // e) * C + row  if 0 <= g < E, position < max_slots and row < C  else -1
    tokens_per_expert[j] = min(padded[rank*e + j], max(C - expert_start[rank*e + j], 0))
    num_routed      = tokens_per_expert.sum()
    dropped[r]      = sum over s and g of r of min(max(start[s, g] + counts[s, g] - C, 0), counts[s, g])
    row_slot[row(slot)] = slot, row_slot[padding row] = -1      # one rank, rows < num_routed
    row_slot[j], row_slot[e + j] = each local expert j's padding rows [first, end) below C   # with peers
    failed_checks   = (any(col(failed) != 0)                         << 0    # a rank's own error
                     | any(col(call) != meta[rank, E + call])        << 1    # ranks out of step
                     | any(col(alignment) != a)                      << 2    # alignments differ
                     | any(col(bad_ids) > 0)                         << 3    # bad expert ids
                     | any(col(n_slots) > max_slots)                 << 4    # T * K too large
                     | any(expert_start + padded > C) if check_overflow  << 5)  # a rank's rows past C

with ``col(name) = meta[:, E + name]``. One rank (``ONE_RANK``): ``meta`` is the routing plan's
``send_meta`` (1, E + status), the header is this call's (n_slots = N, the alignment, no failure,
call 0) and the kernel writes the full row into ``meta_out``, so no exchange and no row assembly
run; it also writes ``row_slot``, the slot of each routed row (the rows between an expert's
slots and its padded end: -1), from which the dispatch reads its rows (no tags). Otherwise
``meta_out`` gets a copy of ``meta``, which may be read by address (``META_AT_ADDRESS``: the
symm_mem buffers' metadata region, where the peers put their rows).

One rank with ``topk_idx`` alone (``place_slots(None, topk_idx, None, ...)``, at most
``routing_plan.ONE_PROGRAM_SLOTS`` slots): every program plans the slots it places first, as
``routing_plan.plan_slots`` does (``routing_plan.plan_blocks_first``: position, and its own copy
of send_meta), and reads that plan: the plan and the placement in one launch, over
``PLAN_BLOCK_S``-slot blocks.

Every program computes each expert's ``start[rank, g] - counts[rank, :g].sum()`` (tiles of
BLOCK_E experts; ``expert_start`` as a cumulative sum over all experts minus that of the
group's first expert, read back from a scratch row) into its scratch row, then places its
blocks of slots with a gather from that row. Program 0 alone writes the per-expert outputs,
the checks and ``meta_out``; the padding rows of one rank's ``row_slot`` are dealt out over the
programs by expert.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._config import LAUNCH_LOCK, assert_options, launch, order_after, program_grid
from .region import Region, or_new_token
from .routing_plan import NOT_PLANNED_FIRST, PlannedFirst, plan_blocks_first

GPU_BLOCK_S = 1024
"""Slots a program places per step."""
PLAN_BLOCK_S, PLAN_NUM_WARPS = 32, 4
"""Slots a program plans and places per step where it plans first (one rank), and its warps: each
compares its slots with all N, so small blocks spread that work over more programs
(``PLAN_MAX_PROGRAMS``). On an H100 (E = 256, K = 8, CUDA graphs; docs/benchmarks.md,
twenty-second session) the placement of T = 8 / 32 / 128 tokens took 8.7 / 9.5 / 11.2 us at
alignment 1 (11.8 / 12.3 / 15.0 at alignment 16) against 10.0 / 10.2 / 13.0 (12.0 / 12.3 / 15.0)
at the previous 64 slots, 8 warps and 16 programs; 8 warps here gave 9.3 / 10.0 / 12.0 (10.6 /
11.1 / 13.0), better with padding, worse without (the default alignment is 1)."""
MAX_PROGRAMS, PLAN_MAX_PROGRAMS = 16, 32
"""Most programs, without and with the plan first: each recomputes the (W, E) tables (and plans
all N slots), so more only pay for many slots."""
GPU_NUM_WARPS = 8
MAX_BLOCK_E = 1024
"""Most experts per tile."""
PAD_ELEMENTS = 4096
"""Most elements of a tile of padding rows ([BLOCK_E, BLOCK_PAD]; one rank, alignment > 1)."""


@triton.jit
def _any(b_fail, m):
    """[B] bool, mask [B] -> int64 scalar, 1 where a masked-in entry fails."""
    return tl.max((b_fail & m).to(tl.int64), axis=0)


@triton.jit
def _place_slots_kernel(
    meta_ptr, meta_table_ptr, meta_index, L_in, idx_ptr, position_ptr,
    meta_out_ptr, failed_checks_ptr, slot_dst_ptr, row_slot_ptr, tokens_ptr, num_routed_ptr, dropped_ptr, scratch_ptr,
    token_ptr,
    N, E, e, rank, L_out, alignment, max_slots, capacity,
    col_failed, col_call, col_alignment, col_bad_ids, col_n_slots,
    WORLD_SIZE: tl.constexpr, ONE_RANK: tl.constexpr, META_AT_ADDRESS: tl.constexpr, CHECK_OVERFLOW: tl.constexpr,
    ASSERT_CHECKS: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_PAD: tl.constexpr, PLAN: tl.constexpr, NP: tl.constexpr, NB: tl.constexpr,
):
    order_after(token_ptr)
    pid = tl.program_id(0)
    if PLAN:  # one rank: the plan of this program's slots first (position; meta: a row per program), read below
        meta_ptr += pid * L_in
        plan_blocks_first(idx_ptr, position_ptr, meta_ptr, N, E, NP, NB, BLOCK_S, BLOCK_S)
    if META_AT_ADDRESS:  # NB: in the body, not a helper (see row_put's pull_rows)
        meta_ptr = tl.load(meta_table_ptr + meta_index).to(tl.pointer_type(tl.int64))
    first = pid == 0
    o_w = tl.arange(0, BLOCK_W)
    m_w = o_w < WORLD_SIZE
    if first:  # dropped rows are summed into (W,) below
        tl.store(dropped_ptr + o_w, tl.zeros([BLOCK_W], dtype=tl.int64), mask=m_w)
        tl.debug_barrier()
    p_starts = scratch_ptr + pid * 2 * E  # each expert's first row counted over all owners, then
    p_offset = p_starts + E  # of each expert, row of a slot - its send position (see below)
    padded_carry = tl.zeros([], dtype=tl.int64)  # padded rows of the experts before this tile
    sent_carry = tl.zeros([], dtype=tl.int64)  # this rank's slots to the experts before this tile
    overflow = tl.zeros([], dtype=tl.int64)
    num_routed = tl.zeros([], dtype=tl.int64)
    for i_g in range(0, E, BLOCK_E):
        o_g = i_g + tl.arange(0, BLOCK_E)  # [BE] experts
        m_g = o_g < E
        b_total = tl.zeros([BLOCK_E], dtype=tl.int64)
        b_before = tl.zeros([BLOCK_E], dtype=tl.int64)  # from the ranks below this one
        for s in range(WORLD_SIZE):
            b_counts = tl.load(meta_ptr + s * L_in + o_g, mask=m_g, other=0)
            b_total += b_counts
            b_before += tl.where(s < rank, b_counts, 0)
        b_own = tl.load(meta_ptr + rank * L_in + o_g, mask=m_g, other=0)
        b_padded = (b_total + alignment - 1) // alignment * alignment
        b_starts = tl.cumsum(b_padded, axis=0) - b_padded + padded_carry
        tl.store(p_starts + o_g, b_starts, mask=m_g)
        # NB: the group's first expert may lie in an earlier tile: its start is read back from
        # memory, once every thread's store of this tile has landed.
        tl.debug_barrier()
        b_expert_start = b_starts - tl.load(p_starts + o_g // e * e, mask=m_g, other=0)
        b_sent_incl = tl.cumsum(b_own, axis=0) + sent_carry
        tl.store(p_offset + o_g, b_expert_start + b_before - (b_sent_incl - b_own), mask=m_g)
        padded_carry += tl.sum(b_padded, axis=0)
        sent_carry += tl.sum(b_own, axis=0)
        if ONE_RANK:  # the padding rows of each expert (alignment - 1 at most): no slot; the experts
            # dealt out over the programs, in [BE, BP] tiles along each expert's padding rows
            # (contiguous), so that a warp's stores share cache lines
            m_mine = m_g & (o_g % tl.num_programs(0) == pid)
            for i_p in range(0, alignment - 1, BLOCK_PAD):
                o_p = i_p + tl.arange(0, BLOCK_PAD)  # [BP] padding rows of an expert
                o_pad = (b_expert_start + b_total)[:, None] + o_p[None, :]  # [BE, BP] rows
                m_pad = m_mine[:, None] & (b_total[:, None] + o_p[None, :] < b_padded[:, None]) & (o_pad < capacity)
                tl.store(row_slot_ptr + o_pad, tl.full([BLOCK_E, BLOCK_PAD], -1, tl.int64), mask=m_pad)
        if first:
            overflow |= _any(b_expert_start + b_padded > capacity, m_g)
            m_own = m_g & (o_g // e == rank)
            b_tokens = tl.minimum(b_padded, tl.maximum(capacity - b_expert_start, 0))
            tl.store(tokens_ptr + o_g - rank * e, b_tokens, mask=m_own)
            if not ONE_RANK:  # each local expert's padding rows [first, end) below C, which the pull zeroes
                b_pad_first = tl.minimum(b_expert_start + b_total, capacity)
                tl.store(row_slot_ptr + o_g - rank * e, b_pad_first, mask=m_own)
                b_pad_end = tl.maximum(tl.minimum(b_expert_start + b_tokens, capacity), b_pad_first)
                tl.store(row_slot_ptr + e + o_g - rank * e, b_pad_end, mask=m_own)
            num_routed += tl.sum(tl.where(m_own, b_tokens, 0), axis=0)
            b_start = b_expert_start
            b_dropped = tl.zeros([BLOCK_E], dtype=tl.int64)
            for s in range(WORLD_SIZE):
                b_counts = tl.load(meta_ptr + s * L_in + o_g, mask=m_g, other=0)
                b_dropped += tl.minimum(tl.maximum(b_start + b_counts - capacity, 0), b_counts)
                b_start += b_counts
            tl.atomic_add(dropped_ptr + o_g // e, b_dropped, mask=m_g & (b_dropped > 0), sem="relaxed")
    if first:
        p_row = meta_ptr + o_w * L_in + E  # [BW] each rank's first column past the counts
        failed = _any(tl.load(p_row + col_bad_ids, mask=m_w, other=0) > 0, m_w) << 3
        if ONE_RANK:
            # NB: as a tensor, since N and max_slots may both be compile-time ints (inductor's
            # analysis of the kernel specializes them), whose comparison is a Python bool.
            failed |= (tl.full([], N, tl.int64) > max_slots).to(tl.int64) << 4
        else:
            own_call = tl.load(meta_ptr + rank * L_in + E + col_call)
            failed |= _any(tl.load(p_row + col_failed, mask=m_w, other=0) != 0, m_w)
            failed |= _any(tl.load(p_row + col_call, mask=m_w, other=0) != own_call, m_w) << 1
            failed |= _any(tl.load(p_row + col_alignment, mask=m_w, other=0) != alignment, m_w) << 2
            failed |= _any(tl.load(p_row + col_n_slots, mask=m_w, other=0) > max_slots, m_w) << 4
        if CHECK_OVERFLOW:
            failed |= overflow << 5
        tl.store(failed_checks_ptr, failed)
        if ASSERT_CHECKS:  # one assert per check, so that the CUDA error names it (every rank fails alike)
            tl.device_assert((failed & 1) == 0, "alltoall_ops symm_mem dispatch: a metadata check failed: a rank "
                             "rejected its arguments (its own error says why)")
            tl.device_assert((failed & 2) == 0, "alltoall_ops symm_mem dispatch: a metadata check failed: the ranks "
                             "are out of step (their numbers of dispatches on these buffers differ)")
            tl.device_assert((failed & 4) == 0, "alltoall_ops symm_mem dispatch: a metadata check failed: the ranks "
                             "disagree on expert_alignment")
            tl.device_assert((failed & 8) == 0, "alltoall_ops symm_mem dispatch: a metadata check failed: bad "
                             "expert ids (outside [0, num_experts) and not -1) on some rank")
            tl.device_assert((failed & 16) == 0, "alltoall_ops symm_mem dispatch: a metadata check failed: T * K "
                             "above the buffers' max_tokens_per_rank * top_k on some rank")
            tl.device_assert((failed & 32) == 0, "alltoall_ops symm_mem dispatch: a metadata check failed: overflow, "
                             "a rank must receive more rows than the buffers' capacity C (create SymmBuffers with a "
                             "larger capacity, or with overflow='drop')")
        tl.store(num_routed_ptr, num_routed)
        for s in range(WORLD_SIZE):
            for i_l in range(0, L_out, BLOCK_L):
                o_l = i_l + tl.arange(0, BLOCK_L)
                b_row = tl.load(meta_ptr + s * L_in + o_l, mask=o_l < L_in, other=0)
                if ONE_RANK:  # this call's header
                    b_row = tl.where(o_l == E + col_n_slots, N, b_row)
                    b_row = tl.where(o_l == E + col_alignment, alignment, b_row)
                tl.store(meta_out_ptr + s * L_out + o_l, b_row, mask=o_l < L_out)
    tl.debug_barrier()  # the scratch row is whole before any thread gathers from it
    for i_s in range(pid * BLOCK_S, N, tl.num_programs(0) * BLOCK_S):
        o_s = i_s + tl.arange(0, BLOCK_S)  # [BS] slots
        m_s = o_s < N
        b_g = tl.load(idx_ptr + o_s, mask=m_s, other=-1).to(tl.int64)
        b_position = tl.load(position_ptr + o_s, mask=m_s, other=0)
        b_valid = (b_g >= 0) & (b_g < E) & (b_position < max_slots)
        b_g = tl.minimum(tl.maximum(b_g, 0), E - 1)
        b_row = tl.load(p_offset + b_g, mask=m_s, other=0) + b_position
        b_dst = tl.where(b_valid & (b_row < capacity), (b_g // e) * capacity + b_row, -1)
        tl.store(slot_dst_ptr + o_s, b_dst, mask=m_s)
        if ONE_RANK:  # b_dst is the row
            tl.store(row_slot_ptr + b_dst, o_s.to(tl.int64), mask=m_s & (b_dst >= 0))


class Placement(NamedTuple):
    """:func:`place_slots`' outputs, int64 on meta's device."""

    meta_WL: torch.Tensor
    failed_checks_1: torch.Tensor
    slot_dst_N: torch.Tensor
    row_slot_C: torch.Tensor
    tokens_per_expert_e: torch.Tensor
    num_routed_1: torch.Tensor
    dropped_W: torch.Tensor
    position_TK: torch.Tensor


def place_slots(
    meta: Optional[torch.Tensor | Region],
    topk_idx: torch.Tensor,
    position: Optional[torch.Tensor],
    *,
    num_experts: int,
    world_size: int,
    rank: int,
    meta_columns: int,
    columns: tuple[int, int, int, int, int],
    expert_alignment: int,
    max_slots: int,
    capacity: int,
    check_overflow: bool,
    assert_checks: bool = False,
    token: Optional[torch.Tensor] = None,
    max_programs: Optional[int] = None,
) -> Placement:
    """The module docstring's outputs, one launch. meta: every rank's exchanged row (W, L =
    meta_columns), a tensor or a region (the symm_mem buffers' metadata), or with world_size 1
    the routing plan's send_meta (1, E + status columns);
    topk_idx, position: (T, K) of this rank; columns: offsets past E of (failed, call, alignment,
    bad ids, n_slots). Returns meta_WL (W, L) (one rank: the row with this call's header),
    failed_checks (1,) (bit i: check i failed), slot_dst (N,), row_slot (one rank: (C,), rows
    past num_routed not written; else (2 e,): the local experts' padding rows, the pull's
    ``pads``), tokens_per_expert (e,),
    num_routed (1,), dropped (W,), position (T, K). assert_checks (CUDA): a failed check is also a
    device-side assert of the kernel (no host sync, no launch of its own; the CUDA context is
    unusable after it). token: as ``row_put.put_rows``'; ``max_programs``: an SM budget.

    meta and position None (world_size 1, at most ``routing_plan.ONE_PROGRAM_SLOTS`` slots,
    ``routing_plan.PlannedFirst``): the kernel plans topk_idx first, as ``plan_slots`` does, into
    a fresh position (returned) and send_meta (one copy a program): one launch for both."""
    W, E = world_size, num_experts
    e, N, dev = E // W, topk_idx.numel(), topk_idx.device
    plan_first = meta is None or position is None
    if plan_first and (meta is not None or position is not None or W != 1):
        raise ValueError(f"place_slots: to plan first, pass meta and position both None, with world_size 1 (got "
                         f"world_size {W})")
    block_s, most, num_warps = ((PLAN_BLOCK_S, PLAN_MAX_PROGRAMS, PLAN_NUM_WARPS) if plan_first
                                else (GPU_BLOCK_S, MAX_PROGRAMS, GPU_NUM_WARPS))
    programs = program_grid(min(most, max(1, triton.cdiv(N, block_s))), 1, max_programs)[0]
    plan = NOT_PLANNED_FIRST
    if plan_first:  # meta: each program's copy of the plan's send_meta
        _, position, meta, plan = PlannedFirst.of(topk_idx, E, W, "place_slots", copies=programs)
    at_address = isinstance(meta, Region)
    meta_columns_in = meta.shape[1]
    if at_address:
        meta_tensor, meta_table, meta_index = meta.table, meta.table, meta.index  # NB: meta_ptr unread
    else:
        meta_tensor = meta = meta.contiguous()
        meta_table, meta_index = meta, 0  # unread
    one_rank = meta_columns_in < meta_columns
    if one_rank and (W != 1 or at_address):
        raise ValueError(f"place_slots: meta of {meta_columns_in} < {meta_columns} columns (a plan's send_meta) "
                         f"needs world_size 1 and a tensor, got world_size {W}")
    meta_WL = torch.empty(W, meta_columns, dtype=torch.int64, device=dev)
    failed_checks_1 = torch.empty(1, dtype=torch.int64, device=dev)
    slot_dst_N = torch.empty(N, dtype=torch.int64, device=dev)
    row_slot_C = torch.empty(capacity if one_rank else 2 * e, dtype=torch.int64, device=dev)
    tokens_per_expert_e = torch.empty(e, dtype=torch.int64, device=dev)
    num_routed_1 = torch.empty(1, dtype=torch.int64, device=dev)
    dropped_W = torch.empty(W, dtype=torch.int64, device=dev)
    scratch = torch.empty(programs, 2, E, dtype=torch.int64, device=dev)
    block_e = min(MAX_BLOCK_E, triton.next_power_of_2(E))
    with LAUNCH_LOCK:
        launch(_place_slots_kernel, topk_idx)[(programs,)](
            meta_tensor, meta_table, meta_index, meta_columns_in, topk_idx.reshape(N).contiguous(),
            position.reshape(N).contiguous(), meta_WL, failed_checks_1, slot_dst_N,
            row_slot_C, tokens_per_expert_e, num_routed_1, dropped_W, scratch,
            or_new_token(token, dev), N, E, e, rank, meta_columns, expert_alignment, max_slots, capacity, *columns,
            WORLD_SIZE=W, ONE_RANK=one_rank, META_AT_ADDRESS=at_address, CHECK_OVERFLOW=check_overflow,
            ASSERT_CHECKS=assert_checks and dev.type == "cuda",
            BLOCK_W=triton.next_power_of_2(W), BLOCK_E=block_e,
            BLOCK_S=block_s, BLOCK_L=triton.next_power_of_2(min(meta_columns, 1024)),
            BLOCK_PAD=min(triton.next_power_of_2(max(expert_alignment - 1, 1)), max(1, PAD_ELEMENTS // block_e)),
            num_warps=num_warps,
            **assert_options(topk_idx), **plan,
        )
    return Placement(meta_WL, failed_checks_1, slot_dst_N, row_slot_C, tokens_per_expert_e, num_routed_1, dropped_W,
                     position)
