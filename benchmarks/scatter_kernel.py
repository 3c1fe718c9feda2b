"""A plain row scatter and a plain row gather in Triton, the references of bandwidth per SM for
``benchmarks.overlap`` (the exchange) and ``tools/sm_budget_diag.py s`` (the pull): ``out[perm[i]]
= src[i]`` or ``out[i] = src[perm[i]]`` for N rows of H elements, on a persistent grid of P
programs, each striding over blocks of rows. The scatter takes blocks of 8 rows at 16 warps (the
best tile of a sweep on an H200 at H = 2048, 16 / 24 / 32 / 132 programs: tools/sm_budget_diag.py);
the gather 32 rows at 32 warps (the best tile of a minimal pull, tags -> rows, in a scratch sweep
on an H100 at 8 and 32 programs: docs/benchmarks.md, nineteenth session; the gather itself has
not been swept)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_H = 2048
TILES = {False: (8, 16), True: (32, 32)}
"""GATHER -> (rows a block, warps)."""


@triton.jit
def _move_rows_kernel(src_ptr, perm_ptr, out_ptr, n, H, GATHER: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    for i_r in range(tl.program_id(0), tl.cdiv(n, BLOCK_R), tl.num_programs(0)):
        o_r = (i_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR]
        m_r = o_r < n
        b_perm = tl.load(perm_ptr + o_r, mask=m_r, other=0)  # [BR]
        if GATHER:
            o_src, o_out = b_perm, o_r
        else:
            o_src, o_out = o_r, b_perm
        for i_h in range(0, H, BLOCK_H):
            o_h = i_h + tl.arange(0, BLOCK_H)  # [BH]
            m = m_r[:, None] & (o_h < H)[None, :]
            b_x = tl.load(src_ptr + o_src[:, None] * H + o_h[None, :], mask=m)
            tl.store(out_ptr + o_out[:, None] * H + o_h[None, :], b_x, mask=m)


def _move_rows(src: torch.Tensor, perm: torch.Tensor, out: torch.Tensor, programs: Optional[int], gather: bool) -> None:
    n, H = out.shape if gather else src.shape
    block_r, num_warps = TILES[gather]
    blocks = triton.cdiv(n, block_r)
    grid = (blocks if programs is None else min(blocks, programs),)
    _move_rows_kernel[grid](src, perm, out, n, H, GATHER=gather, BLOCK_R=block_r,
                            BLOCK_H=min(BLOCK_H, triton.next_power_of_2(H)), num_warps=num_warps)


def scatter_rows(src: torch.Tensor, perm: torch.Tensor, out: torch.Tensor, programs: Optional[int] = None) -> None:
    """out[perm[i]] = src[i]; src (N, H), out (>= N, H) contiguous, perm (N,) int64; ``programs``
    persistent programs (None: one per block of rows)."""
    _move_rows(src, perm, out, programs, gather=False)


def gather_rows(src: torch.Tensor, perm: torch.Tensor, out: torch.Tensor, programs: Optional[int] = None) -> None:
    """out[i] = src[perm[i]]; src (>= N, H), out (N, H) contiguous, perm (N,) int64; ``programs``
    as scatter_rows'."""
    _move_rows(src, perm, out, programs, gather=True)
