"""The reduction over each token's top-k slots (the last step of every backend's combine).

Reference semantics (``ret`` holds this rank's returned rows in send order, its first
``num_valid`` rows valid; a slot whose row never left, ``slot_dst[t * K + k] < 0`` when slot_dst
is given, reads a zero row)::

    topk_reduce:  for t: acc = 0 (fp32, or fp64 for fp64 inputs)
                      for k in range(K): p = position[t, k]
                          valid = p < num_valid and slot_dst[t * K + k] >= 0
                          row = ret[p] if valid else 0
                          acc += row * weights[t, k] if valid else 0   # even a NaN weight adds 0
                          returned[p] = row                      # when asked for
                      y[t] = acc rounded once to y's dtype

    (``read_at_slot_dst``, one rank: row = ret[slot_dst[t * K + k]], valid where that is in
    [0, num_valid): the expert rows where they are; returned[p] as above.)

``max_programs`` (None: one program per token block): at most that many programs, each striding
over token blocks i, i + P, ... (``_config.program_grid``: an SM budget); same results.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ._config import (LAUNCH_LOCK, cast_rne, launch, order_after, program_grid,
                      require_contiguous, row_blocks, tl_acc_dtype, upcast)
from .barrier import Epilogue, barrier_alone, epilogue_args, last_program_arrives
from .region import Region


@triton.jit
def _topk_reduce_kernel(
    ret_ptr, ret_index, position_ptr, slot_dst_ptr, weights_ptr, y_ptr, returned_ptr, token_ptr,
    T, H, n_valid,
    pads_table_ptr, counters_ptr, barrier_call_ptr, barrier_rank, timeout_ms, barrier_op,
    RET_AT_ADDRESS: tl.constexpr, HAS_TOKEN: tl.constexpr, READ_AT_SLOT_DST: tl.constexpr,
    K: tl.constexpr, HAS_SLOT_DST: tl.constexpr, HAS_WEIGHTS: tl.constexpr, SAVE_RETURNED: tl.constexpr,
    ACC_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BARRIER: tl.constexpr,
    WORLD_SIZE: tl.constexpr,
):
    if HAS_TOKEN:
        order_after(token_ptr)
    if RET_AT_ADDRESS:  # ret_ptr: an address table (a Region, 256-byte aligned): as aligned as a
        # tensor argument, so that its rows load as vectors (an address read from memory alone is
        # known aligned to one element: 2-byte loads)
        p_ret = tl.multiple_of(tl.load(ret_ptr + ret_index).to(tl.pointer_type(y_ptr.dtype.element_ty)), 16)
    else:
        p_ret = ret_ptr
    for i_t in range(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.num_programs(0)):  # token blocks
        o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BT] tokens
        m_t = o_t < T
        for i_h in range(tl.program_id(1), tl.cdiv(H, BLOCK_H), tl.num_programs(1)):  # column blocks
            o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
            m_h = (o_h < H)[None, :]
            b_acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=ACC_DTYPE)
            for k in tl.static_range(K):  # slots in k order: deterministic
                b_pos = tl.load(position_ptr + o_t * K + k, mask=m_t, other=0)  # [BT]
                m_pos = m_t & (b_pos >= 0) & (b_pos < T * K)  # never out of bounds (of returned)
                if HAS_SLOT_DST:
                    b_dst = tl.load(slot_dst_ptr + o_t * K + k, mask=m_t, other=-1)
                if READ_AT_SLOT_DST:  # the row where it is
                    b_read = b_dst
                    m_row = m_t & (b_dst >= 0) & (b_dst < n_valid)
                else:
                    b_read = b_pos
                    m_row = m_t & (b_pos >= 0) & (b_pos < n_valid)  # n_valid <= the rows of ret (launcher)
                    if HAS_SLOT_DST:
                        m_row = m_row & (b_dst >= 0)
                p_row = p_ret + b_read[:, None] * H + o_h[None, :]
                b_row = tl.load(p_row, mask=m_row[:, None] & m_h, other=0)  # [BT, BH]
                if SAVE_RETURNED:
                    tl.store(returned_ptr + b_pos[:, None] * H + o_h[None, :], b_row, mask=m_pos[:, None] & m_h)
                if HAS_WEIGHTS:  # the row's mask: a dropped slot's product is 0 * 0, whatever its weight
                    b_w = upcast(tl.load(weights_ptr + o_t * K + k, mask=m_row, other=0), ACC_DTYPE)
                    b_acc += upcast(b_row, ACC_DTYPE) * b_w[:, None]
                else:
                    b_acc += upcast(b_row, ACC_DTYPE)
            b_y = cast_rne(b_acc, y_ptr.dtype.element_ty)  # [BT, BH]
            tl.store(y_ptr + o_t[:, None] * H + o_h[None, :], b_y, mask=m_t[:, None] & m_h)
    if BARRIER:  # every rank is done reading its returned rows before any peer puts rows again
        last_program_arrives(pads_table_ptr, counters_ptr, barrier_rank, timeout_ms, barrier_call_ptr, barrier_op,
                             WORLD_SIZE, False)


def topk_reduce(
    ret: Union[torch.Tensor, Region],
    position: torch.Tensor,
    slot_dst: Optional[torch.Tensor],
    weights: Optional[torch.Tensor],
    y: torch.Tensor,
    returned: Optional[torch.Tensor],
    acc_dtype: torch.dtype,
    num_valid: Optional[int] = None,
    max_programs: Optional[int] = None,
    token: Optional[torch.Tensor] = None,
    read_at_slot_dst: bool = False,
    epilogue: Optional[Epilogue] = None,
) -> None:
    """y (T, H) = weighted sum over k of the returned rows ``ret[position[t, k]]`` (n, H) of the
    valid slots; ``returned`` (N, H), when given, receives every slot's row in send order (zero
    for unsent slots). A slot is valid if its position is below ``num_valid`` (default: n) and,
    when slot_dst (N,) is given, it sent its row (``slot_dst[t * K + k] >= 0``); any other slot
    adds nothing, whatever its weight (T, K). ``max_programs``: at most that many programs (an SM
    budget), each striding over token blocks. ret: a tensor, or a region of y's dtype named by
    address (``_config.Region``: symm_mem's returned rows). token: as ``put_rows``'.
    ``read_at_slot_dst`` (one rank): each slot's row is ``ret[slot_dst[t * K + k]]`` instead (the
    expert rows in place), still returned at its position. ``epilogue``: the barrier after the
    reads (symm_mem's returned rows: no peer puts rows into ret before every rank is done with
    its own), run by the kernel's last program."""
    T, K = position.shape
    H = y.shape[1]
    if T == 0 or H == 0:
        if epilogue is not None:
            barrier_alone(epilogue, token)
        elif token is not None:
            token.zero_()
        return
    require_contiguous("topk_reduce", y=y, returned=returned)
    n_valid = ret.shape[0] if num_valid is None else num_valid
    if not 0 <= n_valid <= ret.shape[0]:
        raise ValueError(f"topk_reduce: num_valid = {num_valid} outside [0, {ret.shape[0]}] (rows of ret)")
    if read_at_slot_dst and slot_dst is None:
        raise ValueError("topk_reduce: read_at_slot_dst needs slot_dst")
    at_address = isinstance(ret, Region)
    if at_address and ret.dtype != y.dtype:
        raise ValueError(f"topk_reduce: the region ret holds {ret.dtype} rows, y is {y.dtype}")
    position, slot_dst, weights = (None if t is None else t.contiguous() for t in (position, slot_dst, weights))
    ret_ptr, ret_index = (ret.table, ret.index) if at_address else (ret.contiguous(), 0)
    blocks = row_blocks("topk_reduce", T, H, torch.empty((), dtype=ret.dtype).element_size(), max_programs)
    with LAUNCH_LOCK:
        launch(_topk_reduce_kernel, y)[program_grid(*blocks.grid(T, H), max_programs)](
            ret_ptr, ret_index, position, slot_dst if slot_dst is not None else position,
            weights if weights is not None else y, y,
            returned if returned is not None else y, token if token is not None else position, T, H, n_valid,
            RET_AT_ADDRESS=at_address, HAS_TOKEN=token is not None, READ_AT_SLOT_DST=read_at_slot_dst, K=K,
            HAS_SLOT_DST=slot_dst is not None,
            HAS_WEIGHTS=weights is not None,
            SAVE_RETURNED=returned is not None, ACC_DTYPE=tl_acc_dtype(acc_dtype),
            BLOCK_T=blocks.BLOCK_R, BLOCK_H=blocks.BLOCK_H, num_warps=blocks.num_warps, **epilogue_args(epilogue, y),
        )
