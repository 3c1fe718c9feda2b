"""A plain row scatter in Triton, the reference of bandwidth per SM for ``benchmarks.overlap``:
``out[perm[i]] = src[i]`` for N rows of H elements, on a persistent grid of P programs, each
striding over blocks of 8 rows (16 warps: the best tile of a sweep on an H200 at H = 2048,
16 / 24 / 32 / 132 programs: tools/sm_budget_diag.py)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_R, BLOCK_H, NUM_WARPS = 8, 2048, 16


@triton.jit
def _scatter_rows_kernel(src_ptr, perm_ptr, out_ptr, n, H, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    for i_r in range(tl.program_id(0), tl.cdiv(n, BLOCK_R), tl.num_programs(0)):
        o_r = (i_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR]
        m_r = o_r < n
        b_dst = tl.load(perm_ptr + o_r, mask=m_r, other=0)  # [BR]
        for i_h in range(0, H, BLOCK_H):
            o_h = i_h + tl.arange(0, BLOCK_H)  # [BH]
            m = m_r[:, None] & (o_h < H)[None, :]
            b_x = tl.load(src_ptr + o_r[:, None] * H + o_h[None, :], mask=m)
            tl.store(out_ptr + b_dst[:, None] * H + o_h[None, :], b_x, mask=m)


def scatter_rows(src: torch.Tensor, perm: torch.Tensor, out: torch.Tensor, programs: Optional[int] = None) -> None:
    """out[perm[i]] = src[i]; src, out (N, H) contiguous, perm (N,) int64; ``programs`` persistent
    programs (None: one per block of rows)."""
    n, H = src.shape
    blocks = triton.cdiv(n, BLOCK_R)
    grid = (blocks if programs is None else min(blocks, programs),)
    _scatter_rows_kernel[grid](src, perm, out, n, H, BLOCK_R=BLOCK_R, BLOCK_H=min(BLOCK_H, triton.next_power_of_2(H)),
                               num_warps=NUM_WARPS)
