"""The fp8 dispatch's quantize (``alltoall_ops.fp8``): each token once, per 128-channel block,
before its rows are put in send order (quantizing in the row put itself, once per slot, measured
3.3x slower on an H200 at T = 4096, K = 8: docs/benchmarks.md).

Reference semantics::

    quantize_rows:  values, scales = fp8.quantize(x)       # values as uint8 bits

Both the scale division and the fp8 rounding (nearest even, on the bits) are exact, so the
kernel equals the torch reference bit for bit, in Triton's interpreter too (whose own fp8
conversion does not round to nearest even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8 import AMAX_FLOOR, BLOCK, FP8_MAX
from ._config import LAUNCH_LOCK, interpreting, upcast


@triton.jit
def e4m3_bits(v):
    """fp32 ``v`` with |v| <= 448 -> its float8_e4m3fn bits (uint8), rounded to nearest even."""
    b_sign = ((v.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.int32)
    b_abs = tl.abs(v)
    # Normal range (|v| >= 2**-6): keep 3 mantissa bits, rounding half to even at bit 20; a carry
    # moves into the exponent. fp8 code = (exp - 127 + 7) << 3 | mantissa.
    b_bits = b_abs.to(tl.int32, bitcast=True)
    b_bits = b_bits + 0x7FFFF + ((b_bits >> 20) & 1)
    b_normal = (b_bits >> 20) - (120 << 3)
    # Subnormal range: multiples of 2**-9, the code is the multiple (8 is 2**-6, the first normal).
    b_steps = b_abs * 512.0  # exact
    b_floor = b_steps.to(tl.int32)  # non-negative: truncation is floor
    b_frac = b_steps - b_floor.to(tl.float32)
    b_up = (b_frac > 0.5) | ((b_frac == 0.5) & ((b_floor & 1) == 1))
    b_sub = b_floor + b_up.to(tl.int32)
    return (b_sign | tl.where(b_abs < 0.015625, b_sub, b_normal)).to(tl.uint8)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, values_ptr, scales_ptr, T, H, B,
    FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    i_r, i_b = tl.program_id(0), tl.program_id(1)  # a block of tokens, one 128-channel block
    o_r = (i_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR] tokens
    o_c = i_b * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC] channels of this block
    m_r = o_r < T
    o_x = o_r[:, None] * H + o_c[None, :]  # [BR, BC]
    b_x = upcast(tl.load(x_ptr + o_x, mask=m_r[:, None], other=0), tl.float32)
    b_amax = tl.maximum(tl.max(tl.abs(b_x), axis=1), AMAX_FLOOR)  # [BR]
    b_max = tl.full([BLOCK_R], FP8_MAX, tl.float32)
    tl.store(values_ptr + o_x, e4m3_bits(b_x * tl.math.div_rn(b_max, b_amax)[:, None]), mask=m_r[:, None])
    tl.store(scales_ptr + o_r * B + i_b, tl.math.div_rn(b_amax, b_max), mask=m_r)


GPU_BLOCK_R, GPU_NUM_WARPS = 8, 4
"""Tokens per program and warps on a GPU (a program: one 128-channel block of GPU_BLOCK_R tokens)."""


def quantize_rows(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`alltoall_ops.fp8.quantize` in one launch: x (T, H) float, H a multiple of 128 ->
    values (T, H) as uint8 (float8_e4m3fn bits) and scales (T, H / 128) fp32."""
    T, H = x_TH.shape
    values_TH = x_TH.new_empty(T, H, dtype=torch.uint8)
    scales_TB = x_TH.new_empty(T, H // BLOCK, dtype=torch.float32)
    if T == 0 or H == 0:
        return values_TH, scales_TB
    x_TH = x_TH.contiguous()
    block_r, num_warps = (triton.next_power_of_2(max(1, min(T, 256))), 1) if interpreting() else \
        (GPU_BLOCK_R, GPU_NUM_WARPS)
    with LAUNCH_LOCK:
        _quantize_rows_kernel[(triton.cdiv(T, block_r), H // BLOCK)](
            x_TH, values_TH, scales_TB, T, H, H // BLOCK,
            FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, BLOCK_R=block_r, BLOCK_C=BLOCK, num_warps=num_warps,
        )
    return values_TH, scales_TB
