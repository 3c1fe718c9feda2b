"""The gather of one rank's expert-major rows from its tokens (the ``local`` backend's dispatch,
and its adjoint in combine's backward).

Reference semantics (``row_src[d]`` is the slot t * K + k whose token fills row d, -1: none)::

    gather_rows:  for d in range(C): s = row_src[d]
                      out[d] = src[s // K] * (scale.flat[s] if scale else 1) if s >= 0 else 0
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._config import LAUNCH_LOCK, launch, cast_rne, require_contiguous, row_blocks, tl_acc_dtype, upcast


@triton.jit
def _gather_rows_kernel(
    src_ptr, scale_ptr, row_src_ptr, out_ptr, n_rows, n_src, K, X,
    HAS_SCALE: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    o_r = (i_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR] output rows
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    m_r = o_r < n_rows
    m_h = (o_h < X)[None, :]
    b_slot = tl.load(row_src_ptr + o_r, mask=m_r, other=-1)  # [BR]
    m_src = m_r & (b_slot >= 0) & (b_slot < n_src * K)  # never out of bounds
    b_slot = tl.where(m_src, b_slot, 0)
    b_x = tl.load(src_ptr + (b_slot // K)[:, None] * X + o_h[None, :], mask=m_src[:, None] & m_h, other=0)
    if HAS_SCALE:  # fp32 (fp64) product, rounded once
        b_scale = upcast(tl.load(scale_ptr + b_slot, mask=m_src, other=0), ACC_DTYPE)
        b_x = cast_rne(upcast(b_x, ACC_DTYPE) * b_scale[:, None], out_ptr.dtype.element_ty)
    tl.store(out_ptr + o_r[:, None] * X + o_h[None, :], b_x, mask=m_r[:, None] & m_h)


def gather_rows(
    src: torch.Tensor, row_src: torch.Tensor, out: torch.Tensor, *, top_k: int,
    scale: Optional[torch.Tensor] = None, acc_dtype: torch.dtype = torch.float32,
) -> None:
    """out (C, X) = row ``row_src[d] // top_k`` of src (T, X) for every row d (times
    ``scale.flat[row_src[d]]`` when given, in ``acc_dtype``, rounded once); zero where
    ``row_src[d] < 0``. Every row of out is written: one launch, no memset."""
    C, X = out.shape
    if C == 0 or X == 0:
        return
    require_contiguous("gather_rows", out=out)
    src, row_src, scale = (None if t is None else t.contiguous() for t in (src, row_src, scale))
    blocks = row_blocks("gather_rows", C, X, out.element_size())
    with LAUNCH_LOCK:
        launch(_gather_rows_kernel, src)[blocks.grid(C, X)](
            src, scale if scale is not None else src, row_src, out, C, src.shape[0], top_k, X,
            HAS_SCALE=scale is not None, ACC_DTYPE=tl_acc_dtype(acc_dtype),
            BLOCK_R=blocks.BLOCK_R, BLOCK_H=blocks.BLOCK_H, num_warps=blocks.num_warps,
        )
