"""Kernel of the symm_mem backend's checks of the exchanged metadata: one launch, no host sync.

Legend: ``W`` ranks, ``E`` experts, ``e = E / W`` local experts per rank, ``L`` metadata columns.
Row s of ``meta`` (W, L) is rank s's: ``counts[s, g]`` (columns [0, E): slots rank s sends to
expert g, >= 0), then further columns at the given offsets past E. Reference semantics::

    col(name) = meta[:, E + name]                                            # (W,)
    needed[r] = sum(round_up(counts[:, r*e + j].sum(), alignment) for j in range(e))
    failed_checks = (any(col(failed) != 0)                    << 0           # a rank's own error
                   | any(col(call) != call_1[0])              << 1           # out of step
                   | any(col(alignment) != alignment)         << 2           # alignments differ
                   | any(col(bad_ids) > 0)                    << 3           # bad expert ids
                   | any(col(n_slots) > max_slots)            << 4           # T * K too large
                   | (any(needed > capacity) if check_overflow else 0) << 5)  # overflow

One program. The flags are (BLOCK_W,) loads. ``needed`` is built in (BLOCK_R, BLOCK_E) tiles of
(receiving rank r, its local expert j), summed over the source ranks by an unrolled loop (W is a
compile-time constant), so that every source's load is in flight at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._config import LAUNCH_LOCK, launch


TILE = 1024
"""Most (rank, expert) entries per tile of the overflow check."""
LOADS_IN_FLIGHT = 16384
"""Most counts loaded at once (W sources times the tile); more spill registers. On the H200, the
kernel alone in a CUDA graph, 8 warps: W, E = 2, 256: 1.8 us; 8, 256: 1.9 us; 8, 4096: 8.2 us;
64, 256: 4.1 us; 64, 4096: 24 us, where tiles of 1024 at W = 64 took 54 us (E = 1024) and
215 us (E = 4096), and 4 warps up to 10 times as long. A loop over the sources that is not
unrolled, or (W, expert-block) tiles reduced across the sources, were slower at every size."""
GPU_NUM_WARPS = 8


@triton.jit
def _any(b_fail, m):
    """[B] bool, mask [B] -> int64 scalar, 1 where a masked-in entry fails."""
    return tl.max((b_fail & m).to(tl.int64), axis=0)


# NB: the call number is read on the device (call_ptr): a CUDA graph's replays check their own.
@triton.jit
def _check_meta_kernel(
    meta_ptr, failed_checks_ptr, call_ptr, E, e, L,
    col_failed, col_call, col_alignment, col_bad_ids, col_n_slots,
    alignment, max_slots, capacity,
    WORLD_SIZE: tl.constexpr, CHECK_OVERFLOW: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
):
    o_w = tl.arange(0, BLOCK_W).to(tl.int64)  # [BW] ranks
    m_w = o_w < WORLD_SIZE
    p_row = meta_ptr + o_w * L + E  # [BW] each rank's first column past the counts
    b_failed = _any(tl.load(p_row + col_failed, mask=m_w, other=0) != 0, m_w)
    b_failed |= _any(tl.load(p_row + col_call, mask=m_w, other=0) != tl.load(call_ptr), m_w) << 1
    b_failed |= _any(tl.load(p_row + col_alignment, mask=m_w, other=0) != alignment, m_w) << 2
    b_failed |= _any(tl.load(p_row + col_bad_ids, mask=m_w, other=0) > 0, m_w) << 3
    b_failed |= _any(tl.load(p_row + col_n_slots, mask=m_w, other=0) > max_slots, m_w) << 4
    if CHECK_OVERFLOW:
        for i_r in range(0, WORLD_SIZE, BLOCK_R):
            o_r = i_r + tl.arange(0, BLOCK_R)  # [BR] receiving ranks
            m_r = o_r < WORLD_SIZE
            b_needed = tl.zeros([BLOCK_R], dtype=tl.int64)  # rows each receives, padded
            for i_j in range(0, e, BLOCK_E):
                o_j = i_j + tl.arange(0, BLOCK_E)  # [BE] local experts
                m = m_r[:, None] & (o_j < e)[None, :]
                p_counts = meta_ptr + o_r[:, None] * e + o_j[None, :]  # [BR, BE] source 0's count of r * e + j
                b_total = tl.zeros([BLOCK_R, BLOCK_E], dtype=tl.int64)
                for s in tl.static_range(WORLD_SIZE):
                    b_total += tl.load(p_counts + s * L, mask=m, other=0)
                b_needed += tl.sum((b_total + alignment - 1) // alignment * alignment, axis=1)
            b_failed |= _any(b_needed > capacity, m_r) << 5
    tl.store(failed_checks_ptr, b_failed)


def check_meta(
    meta_WL: torch.Tensor,
    num_experts: int,
    columns: tuple[int, int, int, int, int],
    call_1: torch.Tensor,
    expert_alignment: int,
    max_slots: int,
    capacity: int,
    check_overflow: bool,
) -> torch.Tensor:
    """meta_WL (W, L) int64 -> failed_checks (1,) int64 on its device, bit i set where check i
    of the module docstring's reference fails; one launch, no host sync.

    columns: offsets past the E counts of (failed, call, alignment, bad ids, n_slots). call_1:
    (1,) int64 on meta's device, the call number every row must carry."""
    W, L = meta_WL.shape
    e = num_experts // W
    meta_WL = meta_WL.contiguous()
    failed_checks_1 = torch.empty(1, dtype=torch.int64, device=meta_WL.device)
    tile = max(1, min(TILE, LOADS_IN_FLIGHT // W))
    tile = 1 << (tile.bit_length() - 1)  # a power of two, at most the bounds above
    block_e = min(triton.next_power_of_2(e), tile)
    with LAUNCH_LOCK:
        launch(_check_meta_kernel, meta_WL)[(1,)](
            meta_WL, failed_checks_1, call_1, num_experts, e, L, *columns, expert_alignment, max_slots, capacity,
            WORLD_SIZE=W, CHECK_OVERFLOW=check_overflow, BLOCK_W=triton.next_power_of_2(W),
            BLOCK_R=min(triton.next_power_of_2(W), tile // block_e), BLOCK_E=block_e,
            num_warps=GPU_NUM_WARPS,
        )
    return failed_checks_1
