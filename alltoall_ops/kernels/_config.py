"""Launch configuration shared by the kernels."""

from __future__ import annotations

import dataclasses
import os
import threading

import torch
import triton
import triton.language as tl

try:  # read once: triton.jit reads it at decoration
    _INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # Triton without knobs
    _INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when this package's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when
    they were imported): on CPU tensors, one program after another."""
    return _INTERPRETED


LAUNCH_LOCK = threading.RLock()
"""Held by every launcher: Triton's interpreter patches ``triton.language`` for the duration of a
launch, so launches from several threads (simulated ranks) must not overlap."""


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """Rows per program (``BLOCK_R``), columns per inner step (``BLOCK_H``), warps, grid."""

    BLOCK_R: int
    BLOCK_H: int
    num_warps: int
    grid: tuple[int]


def row_blocks(n_rows: int, H: int) -> RowBlocks:
    """Programs over rows, each looping over H in ``BLOCK_H`` steps.

    The interpreter runs programs one after another in Python, so there few large programs are
    fastest; on a GPU a few rows per program keep every SM busy."""
    if interpreting():
        block_r = triton.next_power_of_2(max(1, min(n_rows, 256)))
        block_h = triton.next_power_of_2(max(1, min(H, 4096)))
        num_warps = 1
    else:
        block_r = 2
        block_h = triton.next_power_of_2(max(16, min(H, 2048)))
        num_warps = 8 if block_h >= 2048 else 4
    return RowBlocks(block_r, block_h, num_warps, (triton.cdiv(max(n_rows, 0), block_r),))


_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


def tl_acc_dtype(dtype: torch.dtype):
    """The Triton dtype of an accumulation dtype (fp32 or fp64)."""
    return _TL_DTYPES[dtype]


@triton.jit
def upcast(x, DTYPE: tl.constexpr):
    """``x.to(DTYPE)`` for a float DTYPE at least as wide, exact on every backend.

    NB: bf16 widens by shifting its bits (exact), because Triton's interpreter emulates the
    conversion in numpy and gets subnormals wrong."""
    if x.dtype == tl.bfloat16:
        b_bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return b_bits.to(tl.float32, bitcast=True).to(DTYPE)
    else:
        return x.to(DTYPE)


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr):
    """``x.to(DTYPE)`` rounding to nearest even on every backend.

    NB: Triton's interpreter converts fp32 to bf16 by truncation (numpy has no bf16), while
    torch and GPUs round to nearest even; doing the bf16 rounding on the bits makes the
    interpreter and the GPU agree with torch bit for bit."""
    if DTYPE == tl.bfloat16:
        b_bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        b_bits = b_bits + 0x7FFF + ((b_bits >> 16) & 1)  # round half to even at bit 16
        b_out = (b_bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x == x, b_out, float("nan")).to(tl.bfloat16)  # noqa: PLR0124 - NaN stays NaN
    else:
        return x.to(DTYPE)
