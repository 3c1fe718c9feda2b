"""Kernels of the routing layout: the send order of every slot, without a sort.

Legend: ``N = T * K`` slots, ``E`` experts, ``W`` ranks, ``e = E / W``; a slot's *bucket* is its
expert id, or E when it goes nowhere (-1, or an id outside [0, E)). Slots are cut into B blocks
of ``BLOCK_S``. Three launches, no atomics, nothing to zero first; reference semantics::

    block_counts:   counts[b, g] = #{s in block b: bucket[s] == g}           (a histogram)
                    status[b] = (#{s in b: id not -1 and not in [0, E)}, min(ids, -1), max(ids, -1))
    bucket_offsets: offsets[b, g] = sum(counts[b' < b, g]); totals[g] = offsets[B, g]
                    status[B] = the blocks' status reduced (sum, min, max)
    slot_positions: position[s] = sum(totals[g' < bucket[s]])                # lower buckets
                                + offsets[block(s), bucket[s]]               # earlier blocks
                                + #{s' < s in block(s): bucket[s'] == bucket[s]}
                    order[position[s]] = s
                    send_meta[g // e, g % e] = totals[g] for g < E; send_meta[:, e:] = status[B]

which is the stable sort of the slots by bucket (``layout.plan_routing``'s contract). ``plan_rows``
(one rank, ``ROWS``): the same with each expert's total padded to the alignment in the sums,
``order`` (C,) holding the slot of each row (-1 where none, set by ``block_counts``), ``position``
C for a dropped slot and ``send_meta`` the padded totals, the status and a flag that no id is
bad (``layout.plan_rows``'s contract). The work is linear in N: ``bucket_offsets``' programs
each scan ``SCAN_BUCKETS`` columns of the (B, E + 1) counts down the blocks. Each program of
``slot_positions`` writes the buckets' first positions to a scratch row and reads them back per
slot (a gather), and ranks its slots with (BLOCK_S, BLOCK_J) comparisons. The counts, offsets
and scratch rows are one int32 tensor (``_launch``; separate views of one allocation as kernel
arguments gave illegal memory accesses in compiled graphs on the GPU). Up to
``ONE_PROGRAM_SLOTS`` slots, one program does it all in one launch: a histogram of the buckets,
then one sort of the keys (bucket, slot); the symm_mem metadata put runs that program first
(``row_put.put_meta(topk_idx=...)``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..validation import BAD_IDS
from ._config import LAUNCH_LOCK, assert_options, launch, interpreting, program_grid

GPU_BLOCK_S = 64
"""Slots per program of the three kernels on a GPU (past ``ONE_PROGRAM_SLOTS``), below
``LARGE_PLAN_SLOTS`` slots; from there ``GPU_BLOCK_S_LARGE``, both at ``GPU_BLOCK_NUM_WARPS``.
Swept with ``tools/tune_kernels.py --layout-only`` on the H200 (E = 256, CUDA graphs;
docs/benchmarks.md, seventeenth session): N = 2048 / 4096 / 8192 took 12.9 / 12.7 / 14.3 us at 64
slots and 2 warps (13.4 / 13.6 / 15.0 at 8 warps; 128 slots 14.4-18.0), N = 32768 18.8 us at 128
slots and 4 warps (64 and 8: 26.6; 256 and 8: 26.9), N = 131072 42.8 at 128 and 2 warps (46.9 at
4; 64 and 8: 76.5); 256 slots at 2 or 4 warps spill (137-470 us)."""
GPU_BLOCK_S_LARGE = 128
LARGE_PLAN_SLOTS = 32768
GPU_BLOCK_NUM_WARPS = 4
"""Warps of the three kernels (the one-program plan: ``GPU_NUM_WARPS``)."""
BUDGET_BLOCK_S, BUDGET_BLOCK_NUM_WARPS = 128, 4
"""Slots per program and warps of the three kernels under an SM budget (``max_programs``), at
every N: one program per SM strides over many blocks, each a chain of dependent loads and stores,
so the plan takes several times as long as without the budget whatever the block. On one H100
(E = 256, CUDA graphs; ``tools/tune_kernels.py --layout-only --layout-tokens 3072 4096
--layout-sms 8 16 32``; docs/benchmarks.md, nineteenth session) 128 slots at 4 warps was the best
at every budget: N = 24576 on 8 / 32 programs 123.6 / 39.1 us (64 slots: 166.4 / 51.0), N = 32768
on 8 / 16 / 32 programs 159.4 / 86.2 / 48.4 us (8 warps 173.0 / 92.9 / 51.6; 256 slots at 16 warps
265.4 / 139.9 / 74.1), against 19.1 us without a budget."""
GPU_NUM_WARPS = 8
ONE_PROGRAM_SLOTS = 1024
"""Most slots N planned by one program in one launch (``_plan_in_one_program_kernel``: a
histogram and one sort in registers), eager or compiled, in a CUDA graph or not. On the H200
(E = 256, 8 warps, in CUDA graphs; ``tools/tune_kernels.py --layout-only``) it takes 4.1 / 9.7 us
at N = 256 / 1024 against 8.8 / 9.1 us for the memset and two kernels that the three kernels
replaced, and saves launches and allocations; at N = 2048 / 4096 it takes 21 / 60 us against
11 / 19."""
SCAN_BUCKETS = 16
"""Buckets per program of ``_bucket_offsets_kernel``. On the H200 and the H100 (CUDA graphs, E = 256;
docs/benchmarks.md, fourteenth session; ``tools/tune_kernels.py --layout-only`` sweeps it) 16 was
best or tied at every N: the plan of N = 32768 / 131072 took 21.7 / 68.2 us (32: 22.2 / 69.7;
64: 25.4 / 81.5)."""
SCAN_BLOCKS, SCAN_NUM_WARPS = 128, 4
"""Blocks' counts per tile of ``_bucket_offsets_kernel``, and its warps."""
_BAD_IDS = tl.constexpr(BAD_IDS)
MAX_SLOTS = 262144
"""Most slots N that ``plan_routing`` gives these kernels; above it, the sort path. On the H200
in a CUDA graph (E = 256) the kernels take 37.1 / 68.2 / 129.8 us at N = 65536 / 131072 /
262144 against the sort path's 98.7 / 106.8 / 134.5 (the largest N measured)."""


@triton.jit
def _buckets(b_idx, m_s, E, NB: tl.constexpr):
    """Slots' ids [S] and mask [S] (the slot < N) -> their buckets [S] int32: the id where in
    [0, E), else E (goes nowhere); NB - 1 (> E, sorts last) past N. The ids come in loaded: an
    address computed from a helper's result marks the helper's pointer arguments as written
    for inductor (``tests/test_kernel_inputs.py``)."""
    return tl.where(m_s, tl.where((b_idx >= 0) & (b_idx < E), b_idx, E), NB - 1).to(tl.int32)


@triton.jit
def _status(b_idx, b_bucket, E):
    """The status of slots [S] (their ids, -1 past N, and ``_buckets``): (bad ids: not -1 and not in [0, E),
    min(ids, -1), max(ids, -1)), int64 scalars."""
    n_bad = tl.sum(((b_bucket == E) & (b_idx != -1)).to(tl.int64), axis=0)
    lowest = tl.minimum(tl.min(b_idx, axis=0), -1)  # lanes past N hold -1
    highest = tl.maximum(tl.max(b_idx, axis=0), -1)
    return n_bad, lowest, highest


@triton.jit
def _store_send_meta(send_meta_ptr, b_total, n_bad, lowest, highest, E, e, W, NB: tl.constexpr,
                     BLOCK_W: tl.constexpr, ROWS: tl.constexpr, ASSERT_VALID: tl.constexpr):
    """send_meta (W, e + 3) from the buckets' totals b_total [NB] (bucket g < E: expert g) and the
    status (n_bad, lowest, highest): expert g's count at row g // e, column g % e, the status
    in the last three columns of every row. ROWS (one rank, (1, E + 4)): 1 in the last column
    where no id is bad (ASSERT_VALID: else a device-side assert)."""
    o_g = tl.arange(0, NB)
    tl.store(send_meta_ptr + (o_g // e) * (e + 3) + o_g % e, b_total.to(tl.int64), mask=o_g < E)
    o_w = tl.arange(0, BLOCK_W)
    m_w = o_w < W
    b_zero = tl.zeros([BLOCK_W], dtype=tl.int64)
    p_row = send_meta_ptr + o_w * (e + 3) + e
    tl.store(p_row, b_zero + n_bad, mask=m_w)
    tl.store(p_row + 1, b_zero + lowest, mask=m_w)
    tl.store(p_row + 2, b_zero + highest, mask=m_w)
    if ROWS:
        tl.store(send_meta_ptr + e + 3, (n_bad == 0).to(tl.int64))
        if ASSERT_VALID:
            tl.device_assert(n_bad == 0, _BAD_IDS)


@triton.jit
def _block_counts_kernel(
    idx_ptr, table_ptr, status_ptr, fill_ptr, N, E, num_blocks, n_fill,
    NB: tl.constexpr, BLOCK_S: tl.constexpr,
):
    for i_b in range(tl.program_id(0), num_blocks, tl.num_programs(0)):  # blocks of slots (an SM budget: several)
        # plan_rows: rows no slot fills read -1; each program sets its share of them before any slot
        # is placed (a later launch)
        fill_chunk = tl.cdiv(n_fill, num_blocks)
        fill_end = tl.minimum((i_b + 1) * fill_chunk, n_fill)
        for i_f in range(i_b * fill_chunk, fill_end, BLOCK_S):
            o_f = i_f + tl.arange(0, BLOCK_S)
            tl.store(fill_ptr + o_f, tl.full([BLOCK_S], -1, tl.int64), mask=o_f < fill_end)
        o_s = i_b * BLOCK_S + tl.arange(0, BLOCK_S)  # [BS] slots
        b_idx = tl.load(idx_ptr + o_s, mask=o_s < N, other=-1).to(tl.int64)
        b_bucket = _buckets(b_idx, o_s < N, E, NB)
        tl.store(table_ptr + i_b * NB + tl.arange(0, NB), tl.histogram(b_bucket, NB))  # the block's counts
        n_bad, lowest, highest = _status(b_idx, b_bucket, E)
        p_status = status_ptr + i_b * 3
        tl.store(p_status, n_bad)
        tl.store(p_status + 1, lowest)
        tl.store(p_status + 2, highest)


@triton.jit
def _bucket_offsets_kernel(
    table_ptr, status_ptr, E, num_blocks,
    NB: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr,
):
    offsets_ptr = table_ptr + num_blocks * NB
    # Each program scans the counts of BLOCK_G buckets down the blocks, in (BLOCK_P, BLOCK_G) tiles.
    for i_g in range(tl.program_id(0) * BLOCK_G, E + 1, tl.num_programs(0) * BLOCK_G):
        o_g = i_g + tl.arange(0, BLOCK_G)
        m_g = o_g < E + 1
        b_carry = tl.zeros([BLOCK_G], dtype=tl.int32)  # [BG] slots of each bucket in the blocks so far
        for i_p in range(0, num_blocks, BLOCK_P):
            o_p = i_p + tl.arange(0, BLOCK_P)
            m_pg = (o_p < num_blocks)[:, None] & m_g[None, :]
            o_pg = o_p[:, None] * NB + o_g[None, :]
            b_rows = tl.load(table_ptr + o_pg, mask=m_pg, other=0)
            tl.store(offsets_ptr + o_pg, tl.cumsum(b_rows, axis=0) - b_rows + b_carry[None, :], mask=m_pg)
            b_carry += tl.sum(b_rows, axis=0)
        tl.store(offsets_ptr + num_blocks * NB + o_g, b_carry, mask=m_g)  # the totals
    if tl.program_id(0) == 0:  # the blocks' status, reduced
        b_bad = tl.zeros([BLOCK_P], dtype=tl.int64)
        b_low = tl.full([BLOCK_P], -1, tl.int64)
        b_high = tl.full([BLOCK_P], -1, tl.int64)
        for i_p in range(0, num_blocks, BLOCK_P):
            o_p = i_p + tl.arange(0, BLOCK_P)
            m_p = o_p < num_blocks
            b_bad += tl.load(status_ptr + o_p * 3, mask=m_p, other=0)
            b_low = tl.minimum(b_low, tl.load(status_ptr + o_p * 3 + 1, mask=m_p, other=-1))
            b_high = tl.maximum(b_high, tl.load(status_ptr + o_p * 3 + 2, mask=m_p, other=-1))
        p_status = status_ptr + num_blocks * 3
        tl.store(p_status, tl.sum(b_bad, axis=0))
        tl.store(p_status + 1, tl.min(b_low, axis=0))
        tl.store(p_status + 2, tl.max(b_high, axis=0))


@triton.jit
def _slot_positions_kernel(
    idx_ptr, table_ptr, status_ptr, position_ptr, order_ptr, send_meta_ptr,
    N, E, e, W, num_blocks, alignment, C,
    NB: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_W: tl.constexpr, ROWS: tl.constexpr, ASSERT_VALID: tl.constexpr,
):
    offsets_ptr = table_ptr + num_blocks * NB
    o_g = tl.arange(0, NB)
    m_g = o_g < E + 1
    b_total = tl.load(offsets_ptr + num_blocks * NB + o_g, mask=m_g, other=0)
    if ROWS:  # expert groups padded to the alignment (the "goes nowhere" bucket E is not)
        b_total = tl.where(o_g < E, (b_total + alignment - 1) // alignment * alignment, b_total)
    # NB: the first position of each bucket through memory, since a register tensor cannot be
    # indexed by another: a scratch row of this program, and a barrier so that every thread sees it.
    p_base = table_ptr + (2 * num_blocks + 1 + tl.program_id(0)) * NB
    tl.store(p_base + o_g, tl.cumsum(b_total, axis=0) - b_total)
    tl.debug_barrier()
    for i_b in range(tl.program_id(0), num_blocks, tl.num_programs(0)):  # blocks of slots (an SM budget: several)
        o_s = i_b * BLOCK_S + tl.arange(0, BLOCK_S)  # [BS] slots
        m_s = o_s < N
        b_bucket = _buckets(tl.load(idx_ptr + o_s, mask=m_s, other=-1), m_s, E, NB)
        b_pos = tl.load(p_base + b_bucket, mask=m_s, other=0)  # [BS] lower buckets
        b_pos += tl.load(offsets_ptr + i_b * NB + b_bucket, mask=m_s, other=0)  # earlier blocks
        for j in tl.static_range(0, BLOCK_S, BLOCK_J):  # earlier slots of this block, same bucket
            o_j = i_b * BLOCK_S + j + tl.arange(0, BLOCK_J)
            b_jbucket = _buckets(tl.load(idx_ptr + o_j, mask=o_j < N, other=-1), o_j < N, E, NB)
            b_same = (b_bucket[:, None] == b_jbucket[None, :]) & (o_j[None, :] < o_s[:, None])  # [BS, BJ]
            b_pos += tl.sum(b_same.to(tl.int32), axis=1)
        if ROWS:  # a dropped slot has no row (C); rows no slot fills keep their -1
            m_row = m_s & (b_bucket < E)
            tl.store(position_ptr + o_s, tl.where(m_row, b_pos.to(tl.int64), C), mask=m_s)
            tl.store(order_ptr + b_pos, o_s.to(tl.int64), mask=m_row)
        else:
            tl.store(position_ptr + o_s, b_pos.to(tl.int64), mask=m_s)
            tl.store(order_ptr + b_pos, o_s.to(tl.int64), mask=m_s)
    if tl.program_id(0) == 0:
        p_status = status_ptr + num_blocks * 3
        _store_send_meta(send_meta_ptr, b_total, tl.load(p_status), tl.load(p_status + 1), tl.load(p_status + 2),
                         E, e, W, NB, BLOCK_W, ROWS, ASSERT_VALID)


def one_program_sizes(num_slots: int, num_experts: int) -> Optional[tuple[int, int]]:
    """(NP, NB) of ``_plan_in_one_program_kernel`` for N = num_slots and E = num_experts: the
    slots and the buckets (E, none, past N) padded to powers of 2; None where one program does
    not plan them (more than ``ONE_PROGRAM_SLOTS`` slots, or keys past int32)."""
    NP, NB = triton.next_power_of_2(max(num_slots, 16)), triton.next_power_of_2(num_experts + 2)
    return (NP, NB) if num_slots <= ONE_PROGRAM_SLOTS and NP * NB < 2**31 else None


@triton.jit
def _plan_in_one_program_kernel(
    idx_ptr, scratch_ptr, position_ptr, order_ptr, send_meta_ptr,
    N, E, e, W, alignment, C, n_fill,
    NP: tl.constexpr, NB: tl.constexpr, BLOCK_W: tl.constexpr, ROWS: tl.constexpr, ASSERT_VALID: tl.constexpr,
    ORDER: tl.constexpr,
):
    """Both kernels' work in one program, for few slots (``ONE_PROGRAM_SLOTS``, NP >= N a power
    of 2): the totals by a histogram, the send order by one sort of the keys (bucket, slot) in
    registers, so no counts to zero first and no slot compared with another. Bin NB - 1 (> E)
    holds the lanes past N, which sort last. ROWS: each slot's row is its place in the sort
    shifted by the padding of the groups before its own. ORDER False (not with ROWS): order is
    not written (the symm_mem metadata put, which calls this as its first step)."""
    o_s = tl.arange(0, NP)  # the slots; after the sort, the places in send order
    m_s = o_s < N
    b_idx = tl.load(idx_ptr + o_s, mask=m_s, other=-1).to(tl.int64)
    b_bucket = _buckets(b_idx, m_s, E, NB)
    o_g = tl.arange(0, NB)
    b_total = tl.histogram(b_bucket, NB)  # [NB]
    n_bad, lowest, highest = _status(b_idx, b_bucket, E)
    b_key = tl.sort(b_bucket * NP + o_s)  # [NP] stable by slot: the slot is the key's low part
    b_slot = (b_key % NP).to(tl.int64)
    b_sorted_bucket = b_key // NP
    b_place = o_s.to(tl.int64)
    if ROWS:  # expert groups padded to the alignment; rows no slot fills read -1
        b_padded = tl.where(o_g < E, (b_total + alignment - 1) // alignment * alignment, b_total)
        # NB: through memory, since a register tensor cannot be indexed by another; the fill and
        # the shifts land before any thread places a slot (the barrier)
        tl.store(scratch_ptr + o_g, tl.cumsum(b_padded, axis=0) - b_padded - (tl.cumsum(b_total, axis=0) - b_total))
        for i_f in range(0, n_fill, NP):
            o_f = i_f + o_s
            tl.store(order_ptr + o_f, tl.full([NP], -1, tl.int64), mask=o_f < n_fill)
        tl.debug_barrier()
        b_row = b_place + tl.load(scratch_ptr + b_sorted_bucket, mask=m_s, other=0)
        m_row = m_s & (b_sorted_bucket < E)
        tl.store(position_ptr + b_slot, tl.where(m_row, b_row, C), mask=m_s)  # a dropped slot has no row (C)
        tl.store(order_ptr + b_row, b_slot, mask=m_row)
        b_total = b_padded
    else:
        tl.store(position_ptr + b_slot, b_place, mask=m_s)
        if ORDER:
            tl.store(order_ptr + o_s, b_slot, mask=m_s)
    _store_send_meta(send_meta_ptr, b_total, n_bad, lowest, highest, E, e, W, NB, BLOCK_W, ROWS, ASSERT_VALID)


@triton.jit
def plan_first(idx_ptr, position_ptr, send_meta_ptr, N, E, e, W, NP: tl.constexpr, NB: tl.constexpr,
               BLOCK_W: tl.constexpr):
    """A one-program kernel's first step: the plan of its N slots as ``plan_slots``' (no order):
    each slot's position and send_meta (W, e + 3), then a thread barrier, after which the
    program reads them back (``PlannedFirst``)."""
    _plan_in_one_program_kernel(idx_ptr, idx_ptr, position_ptr, position_ptr, send_meta_ptr, N, E, e, W, 1, 0, 0,
                                NP, NB, BLOCK_W, False, False, False)
    tl.debug_barrier()


@triton.jit
def _keys(idx_ptr, o_s, N, E, NP: tl.constexpr, NB: tl.constexpr):
    """Slots o_s [S] -> their keys (bucket, slot) as bucket * NP + slot [S] int32, in send order."""
    return _buckets(tl.load(idx_ptr + o_s, mask=o_s < N, other=-1), o_s < N, E, NB) * NP + o_s


@triton.jit
def plan_blocks_first(idx_ptr, position_ptr, send_meta_ptr, N, E, NP: tl.constexpr, NB: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr):
    """One rank, the first step of every program of a kernel that strides over blocks of BLOCK_S
    of the N <= NP slots: the positions of its own blocks' slots, as ``plan_slots``' (a slot's
    position is the number of slots whose key (bucket, slot) is smaller: (BLOCK_S, BLOCK_J)
    comparisons with all NP, no sort, nothing shared between programs), and send_meta (1, E + 3)
    of all N slots, each program its own copy; then a thread barrier, after which the program
    reads both back. NB: the comparisons are unrolled (NP is a compile-time constant), so their
    loads are all in flight at once: a loop over N waited for each in turn (5.4 against 6.7 us
    of a program's 8.8 at N = 1024 on an H100, clock marks in the kernel)."""
    o_a = tl.arange(0, NP)  # [NP] all slots
    b_idx = tl.load(idx_ptr + o_a, mask=o_a < N, other=-1).to(tl.int64)
    b_bucket = _buckets(b_idx, o_a < N, E, NB)
    n_bad, lowest, highest = _status(b_idx, b_bucket, E)
    _store_send_meta(send_meta_ptr, tl.histogram(b_bucket, NB), n_bad, lowest, highest, E, E, 1, NB, 1, False, False)
    for i_s in range(tl.program_id(0) * BLOCK_S, N, tl.num_programs(0) * BLOCK_S):
        o_s = i_s + tl.arange(0, BLOCK_S)  # [BS] slots
        b_key = _keys(idx_ptr, o_s, N, E, NP, NB)
        b_smaller = tl.zeros([BLOCK_S, BLOCK_J], dtype=tl.int32)
        for j in tl.static_range(0, NP, BLOCK_J):
            o_j = j + tl.arange(0, BLOCK_J)  # [BJ] slots to compare with; past N: larger than every key
            b_smaller += (_keys(idx_ptr, o_j, N, E, NP, NB)[None, :] < b_key[:, None]).to(tl.int32)
        tl.store(position_ptr + o_s, tl.sum(b_smaller, axis=1).to(tl.int64), mask=o_s < N)
    tl.debug_barrier()


class PlannedFirst(NamedTuple):
    """What a launcher gives a kernel that runs :func:`plan_first` or :func:`plan_blocks_first`:
    idx (N,), the fresh position (T, K) and send_meta it writes, and its constexprs (PLAN, NP, NB)."""

    idx: torch.Tensor
    position: torch.Tensor
    send_meta: torch.Tensor
    constexprs: dict

    @classmethod
    def of(cls, topk_idx: torch.Tensor, num_experts: int, world_size: int, caller: str, copies: int = 1,
           ) -> "PlannedFirst":
        """For ``topk_idx`` (T, K), send_meta (copies * W, e + 3) (``plan_blocks_first``: a copy
        a program); ValueError naming ``caller`` where one program does not plan them
        (``one_program_sizes``)."""
        sizes = one_program_sizes(topk_idx.numel(), num_experts)
        if sizes is None:
            raise ValueError(f"{caller}: {topk_idx.numel()} slots of {num_experts} experts are not planned by one "
                             f"program (at most ONE_PROGRAM_SLOTS = {ONE_PROGRAM_SLOTS})")
        new = dict(dtype=torch.int64, device=topk_idx.device)
        return cls(topk_idx.reshape(-1).contiguous(), torch.empty(topk_idx.shape, **new),
                   torch.empty(copies * world_size, num_experts // world_size + 3, **new),
                   dict(PLAN=True, NP=sizes[0], NB=sizes[1]))


NOT_PLANNED_FIRST = dict(PLAN=False, NP=1, NB=1)
"""The constexprs of a kernel that can run :func:`plan_first` and does not."""


def plan_slots(
    topk_idx: torch.Tensor, num_experts: int, world_size: int, max_programs: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_idx (T, K) integer expert ids -> order (N,), position (T, K), send_meta
    (W, e + 3), all int64, as ``layout.plan_routing`` defines them: one launch up to
    ``ONE_PROGRAM_SLOTS`` slots, else three; no host sync. ``max_programs``: at most
    that many programs a launch, each striding over blocks of slots (an SM budget)."""
    T, K = topk_idx.shape
    order = torch.empty(T * K, dtype=torch.int64, device=topk_idx.device)
    position, send_meta = _launch(topk_idx, num_experts, world_size, order, 1, False, max_programs)
    return order, position, send_meta


def plan_rows(
    topk_idx: torch.Tensor, num_experts: int, expert_alignment: int, num_rows: int, assert_valid: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's expert-major rows, as ``layout.plan_rows`` defines them: topk_idx (T, K) ->
    row_src (C = num_rows,) slot of each row (-1: none), row (T, K) row of each slot (C: none),
    meta (1, E + 4) padded rows per expert, the status and 1 where no id is bad. Launches as
    ``plan_slots``'. assert_valid (CUDA): a bad id is also a device-side assert
    (``validation.BAD_IDS``) of the kernel itself."""
    row_src = torch.empty(num_rows, dtype=torch.int64, device=topk_idx.device)
    row, meta = _launch(topk_idx, num_experts, 1, row_src, expert_alignment, True, assert_valid=assert_valid)
    return row_src, row, meta


def _launch(topk_idx: torch.Tensor, num_experts: int, world_size: int, order: torch.Tensor, alignment: int,
            rows: bool, max_programs: Optional[int] = None, assert_valid: bool = False,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's kernels: position (T, K) and send_meta (W, e + 3; rows: (1, E + 4)), ``order``
    written in place (rows: -1 first)."""
    T, K = topk_idx.shape
    N, E, W = T * K, num_experts, world_size
    e = E // W
    dev = topk_idx.device
    idx = topk_idx.reshape(N).contiguous()
    position = torch.empty(N, dtype=torch.int64, device=dev)
    send_meta = torch.empty(W, e + 3 + rows, dtype=torch.int64, device=dev)
    num_warps = 1 if interpreting() else GPU_NUM_WARPS
    assert_valid = assert_valid and rows and dev.type == "cuda"
    checks = dict(ASSERT_VALID=assert_valid, **(assert_options(idx) if assert_valid else {}))
    sizes = one_program_sizes(N, E)
    if sizes is not None:
        NP, NB = sizes
        scratch = torch.empty(NB if rows else 0, dtype=torch.int64, device=dev)
        with LAUNCH_LOCK:
            launch(_plan_in_one_program_kernel, idx)[(1,)](
                idx, scratch, position, order, send_meta, N, E, e, W, alignment, order.numel(),
                order.numel() if rows else 0, NP=NP, NB=NB, BLOCK_W=triton.next_power_of_2(W), ROWS=rows,
                ORDER=True, num_warps=num_warps, **checks,
            )
        return position.view(T, K), send_meta
    if interpreting():
        block_s = triton.next_power_of_2(max(1, min(N, 256)))
    elif max_programs is not None:
        block_s, num_warps = BUDGET_BLOCK_S, BUDGET_BLOCK_NUM_WARPS
    else:
        block_s = GPU_BLOCK_S if N < LARGE_PLAN_SLOTS else GPU_BLOCK_S_LARGE
        num_warps = GPU_BLOCK_NUM_WARPS
    B = max(1, triton.cdiv(N, block_s))
    NB = triton.next_power_of_2(E + 2)  # the buckets, and a bin past them for the lanes past N
    grid = program_grid(B, 1, max_programs)[:1]
    # the interpreter (CPU tests): small scan tiles, so that every loop of the scan takes turns
    scan_rows, scan_buckets, scan_warps = (4, 16, 1) if interpreting() else (
        min(SCAN_BLOCKS, triton.next_power_of_2(B)), SCAN_BUCKETS, SCAN_NUM_WARPS)
    scan_grid = program_grid(triton.cdiv(E + 1, scan_buckets), 1, max_programs)[:1]
    # one tensor (one allocation): rows [0, B) the blocks' counts, [B, 2B] the offsets and the totals, then a
    # scratch row for each program of the last kernel
    table = torch.empty(2 * B + 1 + grid[0], NB, dtype=torch.int32, device=dev)
    status = torch.empty(B + 1, 3, dtype=torch.int64, device=dev)  # by block, and all
    with LAUNCH_LOCK:
        launch(_block_counts_kernel, idx)[grid](idx, table, status, order, N, E, B, order.numel() if rows else 0,
                                                NB=NB, BLOCK_S=block_s, num_warps=num_warps)
        launch(_bucket_offsets_kernel, idx)[scan_grid](
            table, status, E, B, NB=NB, BLOCK_P=scan_rows, BLOCK_G=scan_buckets, num_warps=scan_warps,
        )
        launch(_slot_positions_kernel, idx)[grid](
            idx, table, status, position, order, send_meta, N, E, e, W, B, alignment, order.numel(),
            NB=NB, BLOCK_S=block_s, BLOCK_J=min(block_s, 64), BLOCK_W=triton.next_power_of_2(W), ROWS=rows,
            num_warps=num_warps, **checks,
        )
    return position.view(T, K), send_meta
