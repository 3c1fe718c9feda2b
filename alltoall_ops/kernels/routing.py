"""Kernels of the routing layout: the send order of every slot, without a sort.

Legend: ``N = T * K`` slots, ``E`` experts, ``W`` ranks, ``e = E / W``; a slot's *bucket* is its
expert id, or E when it goes nowhere (-1, or an id outside [0, E)). Slots are cut into B blocks
of ``BLOCK_S``. Reference semantics::

    block_counts:  for b, g: hist[g, b] = #{s in block b: bucket[s] == g}
                   status[b] = (#{s in b: id not -1 and not in [0, E)}, min(ids of b, -1), max(ids of b, -1))
    (torch)        inclusive[g, b] = sum(hist[g, b' <= b])          # one cumsum along blocks
    slot_positions: position[s] = sum(inclusive[g' < bucket[s], B-1])    # slots of lower buckets
                                + inclusive[bucket[s], b-1]              # same bucket, earlier blocks
                                + #{s' < s in block b: bucket[s'] == bucket[s]}
                    order[position[s]] = s
                    send_meta[g // e, g % e] = inclusive[B-1, g] for g < E; send_meta[:, e:] = status

which is the stable sort of the slots by bucket (``layout.plan_routing``'s contract). Within a
block, a (BLOCK_S, BLOCK_S) comparison gives every slot's rank among the block's slots of its
bucket, and a one-hot (BLOCK_S, NB) tile picks each slot's bucket base (reductions, no scan over
the tile), so BLOCK_S * NB bounds a program's registers. The counts are stored bucket-major, so
that torch's cumsum runs along the contiguous dimension.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._config import LAUNCH_LOCK, interpreting

_ONE_HOT_ELEMENTS = 16384
"""BLOCK_S * NB of a program's one-hot tile on a GPU (registers: 64 int32 per thread at 8 warps)."""
_NUM_WARPS = 8


@triton.jit
def _block_counts_kernel(
    idx_ptr, hist_ptr, status_ptr, N, E, num_blocks,
    NB: tl.constexpr, BLOCK_S: tl.constexpr,
):
    i_b = tl.program_id(0)
    o_s = i_b * BLOCK_S + tl.arange(0, BLOCK_S)  # [BS] slots
    m_s = o_s < N
    b_idx = tl.load(idx_ptr + o_s, mask=m_s, other=-1).to(tl.int64)
    b_valid = (b_idx >= 0) & (b_idx < E)
    b_bucket = tl.where(b_valid, b_idx, E)
    b_bucket = tl.where(m_s, b_bucket, NB - 1)  # past N: a bin no bucket uses (NB > E + 1)
    o_g = tl.arange(0, NB)
    b_hot = (b_bucket[:, None] == o_g[None, :]).to(tl.int32)  # [BS, NB]
    tl.store(hist_ptr + o_g * num_blocks + i_b, tl.sum(b_hot, axis=0))  # (NB, B), bucket-major
    b_bad = (m_s & ~b_valid & (b_idx != -1)).to(tl.int64)
    tl.store(status_ptr + i_b * 3, tl.sum(b_bad, axis=0))
    tl.store(status_ptr + i_b * 3 + 1, tl.min(b_idx, axis=0))  # masked lanes hold -1
    tl.store(status_ptr + i_b * 3 + 2, tl.max(b_idx, axis=0))


@triton.jit
def _slot_positions_kernel(
    idx_ptr, inclusive_ptr, status_ptr, position_ptr, order_ptr, send_meta_ptr,
    N, E, e, W, num_blocks,
    NB: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_B: tl.constexpr,
):
    i_b = tl.program_id(0)
    o_s = i_b * BLOCK_S + tl.arange(0, BLOCK_S)  # [BS] slots
    m_s = o_s < N
    b_idx = tl.load(idx_ptr + o_s, mask=m_s, other=-1).to(tl.int64)
    b_bucket = tl.where((b_idx >= 0) & (b_idx < E), b_idx, E)
    b_bucket = tl.where(m_s, b_bucket, NB - 1)
    o_g = tl.arange(0, NB)
    # NB: int32 positions (N < 2**31): half the registers of the tiles in int64.
    p_row = inclusive_ptr + o_g * num_blocks  # [NB] row of each bucket in (NB, B)
    b_total = tl.load(p_row + num_blocks - 1)  # [NB] slots per bucket
    m_before = (o_g * 0 + i_b) > 0  # [NB] all False in block 0
    b_before = tl.load(p_row + i_b - 1, mask=m_before, other=0)
    b_base = tl.cumsum(b_total, axis=0) - b_total + b_before  # [NB] first position of bucket g here
    b_hot = (b_bucket[:, None] == o_g[None, :]).to(tl.int32)  # [BS, NB]
    b_first = tl.sum(b_hot * b_base[None, :], axis=1)  # [BS] base of each slot's bucket
    o_j = tl.arange(0, BLOCK_S)
    b_earlier = (b_bucket[:, None] == b_bucket[None, :]) & (o_j[None, :] < o_j[:, None])  # [BS, BS]
    b_pos = b_first + tl.sum(b_earlier.to(tl.int32), axis=1)  # [BS]
    tl.store(position_ptr + o_s, b_pos.to(tl.int64), mask=m_s)
    tl.store(order_ptr + b_pos, o_s.to(tl.int64), mask=m_s)
    if i_b == 0:  # counts of every local expert of every rank, and the status columns
        m_g = o_g < E
        tl.store(send_meta_ptr + (o_g // e) * (e + 3) + o_g % e, b_total.to(tl.int64), mask=m_g)
        b_bad = tl.zeros([BLOCK_B], dtype=tl.int64)
        b_lo = tl.full([BLOCK_B], -1, dtype=tl.int64)
        b_hi = tl.full([BLOCK_B], -1, dtype=tl.int64)
        for i_c in range(tl.cdiv(num_blocks, BLOCK_B)):
            o_c = i_c * BLOCK_B + tl.arange(0, BLOCK_B)
            m_c = o_c < num_blocks
            b_bad += tl.load(status_ptr + o_c * 3, mask=m_c, other=0)
            b_lo = tl.minimum(b_lo, tl.load(status_ptr + o_c * 3 + 1, mask=m_c, other=-1))
            b_hi = tl.maximum(b_hi, tl.load(status_ptr + o_c * 3 + 2, mask=m_c, other=-1))
        o_w = tl.arange(0, BLOCK_W)
        m_w = o_w < W
        p_status = send_meta_ptr + o_w * (e + 3) + e
        tl.store(p_status, tl.zeros([BLOCK_W], dtype=tl.int64) + tl.sum(b_bad, axis=0), mask=m_w)
        tl.store(p_status + 1, tl.zeros([BLOCK_W], dtype=tl.int64) + tl.min(b_lo, axis=0), mask=m_w)
        tl.store(p_status + 2, tl.zeros([BLOCK_W], dtype=tl.int64) + tl.max(b_hi, axis=0), mask=m_w)


def plan_slots(
    topk_idx: torch.Tensor, num_experts: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_idx (T, K) integer expert ids -> order (N,), position (T, K), send_meta
    (W, e + 3), all int64, as ``layout.plan_routing`` defines them: two kernel launches and one
    cumulative sum, no sort and no host sync."""
    T, K = topk_idx.shape
    N, E, W = T * K, num_experts, world_size
    e = E // W
    dev = topk_idx.device
    idx = topk_idx.reshape(N).contiguous()
    NB = triton.next_power_of_2(E + 2)
    if interpreting():
        block_s = triton.next_power_of_2(max(1, min(N, 256)))
    else:
        block_s = max(16, min(128, _ONE_HOT_ELEMENTS // NB))
    B = max(1, triton.cdiv(N, block_s))
    hist = torch.empty(NB, B, dtype=torch.int32, device=dev)
    status = torch.empty(B, 3, dtype=torch.int64, device=dev)
    order = torch.empty(N, dtype=torch.int64, device=dev)
    position = torch.empty(N, dtype=torch.int64, device=dev)
    send_meta = torch.empty(W, e + 3, dtype=torch.int64, device=dev)
    num_warps = 1 if interpreting() else _NUM_WARPS
    with LAUNCH_LOCK:
        _block_counts_kernel[(B,)](idx, hist, status, N, E, B, NB=NB, BLOCK_S=block_s, num_warps=num_warps)
        inclusive = torch.cumsum(hist, 1, dtype=torch.int32)  # (NB, B)
        _slot_positions_kernel[(B,)](
            idx, inclusive, status, position, order, send_meta, N, E, e, W, B,
            NB=NB, BLOCK_S=block_s, BLOCK_W=triton.next_power_of_2(W),
            BLOCK_B=triton.next_power_of_2(min(B, 1024)), num_warps=num_warps,
        )
    return order, position.view(T, K), send_meta
