"""The gradient of the routing weights (of combine) and of dispatch's per-slot scale.

Reference semantics::

    weight_grad:  grad_w[t, k] = sum_h grad_y[t, h] * returned[position[t, k], h]  (acc dtype)
                  (0 where position[t, k] is not a row of returned)

``max_programs`` (None: one program per token block): at most that many programs, each striding
over token blocks (``_config.program_grid``: an SM budget); same results.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._config import LAUNCH_LOCK, launch, cast_rne, program_grid, require_contiguous, row_blocks, tl_acc_dtype, upcast


@triton.jit
def _weight_grad_kernel(
    grad_y_ptr, returned_ptr, position_ptr, grad_w_ptr, T, H, n_returned,
    K: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    for i_t in range(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.num_programs(0)):  # token blocks
        o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BT]
        m_t = o_t < T
        for k in tl.static_range(K):
            b_pos = tl.load(position_ptr + o_t * K + k, mask=m_t, other=0)  # [BT]
            m_pos = m_t & (b_pos >= 0) & (b_pos < n_returned)  # outside: no row, a zero gradient
            b_acc = tl.zeros([BLOCK_T], dtype=ACC_DTYPE)
            for i_h in range(tl.cdiv(H, BLOCK_H)):
                o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
                m = m_t[:, None] & (o_h < H)[None, :]
                b_g = upcast(tl.load(grad_y_ptr + o_t[:, None] * H + o_h[None, :], mask=m, other=0), ACC_DTYPE)
                p_r = returned_ptr + b_pos[:, None] * H + o_h[None, :]
                b_r = upcast(tl.load(p_r, mask=m & m_pos[:, None], other=0), ACC_DTYPE)
                b_acc += tl.sum(b_g * b_r, axis=1)  # [BT, BH] -> [BT]
            tl.store(grad_w_ptr + o_t * K + k, cast_rne(b_acc, grad_w_ptr.dtype.element_ty), mask=m_t)


def weight_grad(
    grad_y: torch.Tensor, returned: torch.Tensor, position: torch.Tensor, grad_w: torch.Tensor,
    acc_dtype: torch.dtype,
    max_programs: Optional[int] = None,
) -> None:
    """grad_w (T, K) = <grad_y[t], returned[position[t, k]]>, accumulated in ``acc_dtype``;
    ``max_programs``: at most that many programs (an SM budget), each striding over token blocks."""
    T, K = position.shape
    H = grad_y.shape[1]
    if T == 0:
        return
    require_contiguous("weight_grad", grad_w=grad_w)
    grad_y, returned, position = grad_y.contiguous(), returned.contiguous(), position.contiguous()
    blocks = row_blocks("weight_grad", T, max(H, 1), grad_y.element_size(), max_programs)
    with LAUNCH_LOCK:  # NB: one program per token block across all of H: it sums over H
        launch(_weight_grad_kernel, grad_w)[program_grid(blocks.grid(T, H)[0], 1, max_programs)[:1]](
            grad_y, returned, position, grad_w, T, H, returned.shape[0],
            K=K, ACC_DTYPE=tl_acc_dtype(acc_dtype), BLOCK_T=blocks.BLOCK_R, BLOCK_H=blocks.BLOCK_H,
            num_warps=blocks.num_warps,
        )
