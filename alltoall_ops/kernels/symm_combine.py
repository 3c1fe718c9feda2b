"""Kernels of the combine reduction over top-k slots and of the routing-weight gradient.

Reference semantics (``ret`` is this rank's buffer of returned rows in send order, its first
``num_valid`` rows valid; a slot whose row never left, ``slot_dst[t * K + k] < 0`` when slot_dst
is given, reads a zero row)::

    combine_reduce:  for t: acc = 0 (fp32, or fp64 for fp64 inputs)
                         for k in range(K): p = position[t, k]
                             valid = p < num_valid and slot_dst[t * K + k] >= 0
                             row = ret[p] if valid else 0
                             acc += row * weights[t, k] if valid else 0   # even a NaN weight adds 0
                             returned[p] = row                      # when asked for
                         y[t] = acc rounded once to y's dtype
    combine_weight_grad:  grad_w[t, k] = sum_h grad_y[t, h] * returned[position[t, k], h]  (acc dtype)
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._config import LAUNCH_LOCK, cast_rne, require_contiguous, row_blocks, tl_acc_dtype, upcast


@triton.jit
def _combine_reduce_kernel(
    ret_ptr, position_ptr, slot_dst_ptr, weights_ptr, y_ptr, returned_ptr,
    T, H, n_valid,
    K: tl.constexpr, HAS_SLOT_DST: tl.constexpr, HAS_WEIGHTS: tl.constexpr, SAVE_RETURNED: tl.constexpr,
    ACC_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BT] tokens
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    m_t = o_t < T
    m_h = (o_h < H)[None, :]
    b_acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=ACC_DTYPE)
    for k in tl.static_range(K):  # slots in k order: deterministic
        b_pos = tl.load(position_ptr + o_t * K + k, mask=m_t, other=0)  # [BT]
        m_pos = m_t & (b_pos >= 0) & (b_pos < T * K)  # never out of bounds
        m_row = m_pos & (b_pos < n_valid)
        if HAS_SLOT_DST:
            m_row = m_row & (tl.load(slot_dst_ptr + o_t * K + k, mask=m_t, other=-1) >= 0)
        p_row = ret_ptr + b_pos[:, None] * H + o_h[None, :]
        b_row = tl.load(p_row, mask=m_row[:, None] & m_h, other=0)  # [BT, BH]
        if SAVE_RETURNED:
            tl.store(returned_ptr + b_pos[:, None] * H + o_h[None, :], b_row, mask=m_pos[:, None] & m_h)
        if HAS_WEIGHTS:  # the row's mask: a dropped slot's product is 0 * 0, whatever its weight
            b_w = upcast(tl.load(weights_ptr + o_t * K + k, mask=m_row, other=0), ACC_DTYPE)
            b_acc += upcast(b_row, ACC_DTYPE) * b_w[:, None]
        else:
            b_acc += upcast(b_row, ACC_DTYPE)
    b_y = cast_rne(b_acc, y_ptr.dtype.element_ty)
    tl.store(y_ptr + o_t[:, None] * H + o_h[None, :], b_y, mask=m_t[:, None] & m_h)


def combine_reduce(
    ret: torch.Tensor,
    position: torch.Tensor,
    slot_dst: Optional[torch.Tensor],
    weights: Optional[torch.Tensor],
    y: torch.Tensor,
    returned: Optional[torch.Tensor],
    acc_dtype: torch.dtype,
    num_valid: Optional[int] = None,
) -> None:
    """y (T, H) = weighted sum over k of the returned rows ``ret[position[t, k]]`` (n, H) of the
    valid slots; ``returned`` (N, H), when given, receives every slot's row in send order (zero
    for unsent slots). A slot is valid if its position is below ``num_valid`` (default: n) and,
    when slot_dst (N,) is given, it sent its row (``slot_dst[t * K + k] >= 0``); any other slot
    adds nothing, whatever its weight (T, K)."""
    T, K = position.shape
    H = y.shape[1]
    if T == 0 or H == 0:
        return
    require_contiguous("combine_reduce", y=y, returned=returned)
    n_valid = ret.shape[0] if num_valid is None else num_valid
    if not 0 <= n_valid <= ret.shape[0]:
        raise ValueError(f"combine_reduce: num_valid = {num_valid} outside [0, {ret.shape[0]}] (rows of ret)")
    ret, position, slot_dst, weights = (
        None if t is None else t.contiguous() for t in (ret, position, slot_dst, weights)
    )
    blocks = row_blocks("combine_reduce", T, H, ret.element_size())
    with LAUNCH_LOCK:
        _combine_reduce_kernel[blocks.grid(T, H)](
            ret, position, slot_dst if slot_dst is not None else position,
            weights if weights is not None else y, y,
            returned if returned is not None else y, T, H, n_valid,
            K=K, HAS_SLOT_DST=slot_dst is not None, HAS_WEIGHTS=weights is not None,
            SAVE_RETURNED=returned is not None, ACC_DTYPE=tl_acc_dtype(acc_dtype),
            BLOCK_T=blocks.BLOCK_R, BLOCK_H=blocks.BLOCK_H, num_warps=blocks.num_warps,
        )


@triton.jit
def _combine_weight_grad_kernel(
    grad_y_ptr, returned_ptr, position_ptr, grad_w_ptr, T, H,
    K: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    m_t = o_t < T
    for k in tl.static_range(K):
        b_pos = tl.load(position_ptr + o_t * K + k, mask=m_t, other=0)  # [BT]
        m_pos = m_t & (b_pos >= 0) & (b_pos < T * K)
        b_acc = tl.zeros([BLOCK_T], dtype=ACC_DTYPE)
        for i_h in range(tl.cdiv(H, BLOCK_H)):
            o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
            m = m_t[:, None] & (o_h < H)[None, :]
            b_g = upcast(tl.load(grad_y_ptr + o_t[:, None] * H + o_h[None, :], mask=m, other=0), ACC_DTYPE)
            p_r = returned_ptr + b_pos[:, None] * H + o_h[None, :]
            b_r = upcast(tl.load(p_r, mask=m & m_pos[:, None], other=0), ACC_DTYPE)
            b_acc += tl.sum(b_g * b_r, axis=1)  # [BT, BH] -> [BT]
        tl.store(grad_w_ptr + o_t * K + k, cast_rne(b_acc, grad_w_ptr.dtype.element_ty), mask=m_t)


def combine_weight_grad(
    grad_y: torch.Tensor, returned: torch.Tensor, position: torch.Tensor, grad_w: torch.Tensor,
    acc_dtype: torch.dtype,
) -> None:
    """grad_w (T, K) = <grad_y[t], returned[position[t, k]]>, accumulated in ``acc_dtype``."""
    T, K = position.shape
    H = grad_y.shape[1]
    if T == 0:
        return
    require_contiguous("combine_weight_grad", grad_w=grad_w)
    grad_y, returned, position = grad_y.contiguous(), returned.contiguous(), position.contiguous()
    blocks = row_blocks("combine_weight_grad", T, max(H, 1), grad_y.element_size())
    with LAUNCH_LOCK:  # NB: one program per token block across all of H: it sums over H
        _combine_weight_grad_kernel[blocks.grid(T, H)[:1]](
            grad_y, returned, position, grad_w, T, H,
            K=K, ACC_DTYPE=tl_acc_dtype(acc_dtype), BLOCK_T=blocks.BLOCK_R, BLOCK_H=blocks.BLOCK_H,
            num_warps=blocks.num_warps,
        )
