"""The fp8 dispatch's quantize (``alltoall_ops.fp8``): each token once, per 128-channel block,
before its rows are put in send order (quantizing in the row put itself, once per slot, measured
3.3x slower on an H200 at T = 4096, K = 8: docs/benchmarks.md).

Reference semantics::

    quantize_rows:    values, scales = fp8.quantize(x)               # values as uint8 bits
    quantize_block:   the same for one loaded tile of 128 channels (shared with symm_mem's post,
                      which quantizes each token once into its stage: ``row_put.post_slots``)
    e4m3_value:       the fp32 value of float8_e4m3fn bits (the symm_mem pull dequantizes with it:
                      ``row_put.pull_rows(dequantize=True)``)

``max_programs`` (None: one program per row block and channel block): at most that many programs,
each striding over row and channel blocks (``_config.program_grid``: an SM budget); same results.

Both the scale division and the fp8 rounding (nearest even, on the bits) are exact, so the
kernel equals the torch reference bit for bit, in Triton's interpreter too (whose own fp8
conversion does not round to nearest even).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..fp8 import AMAX_FLOOR, BLOCK, FP8_MAX
from ._config import HARDWARE_CASTS, LAUNCH_LOCK, launch, interpreting, program_grid, require_contiguous, upcast


@triton.jit
def e4m3_bits(v):
    """fp32 ``v`` with |v| <= 448 (or NaN) -> its float8_e4m3fn bits (uint8), rounded to nearest
    even as torch's cast; NaN -> 0x7F with v's sign bit. (A quantized block never exceeds 448:
    torch's saturating or NaN-ing of larger values is not needed.)"""
    b_raw = v.to(tl.int32, bitcast=True)
    b_sign = (b_raw >> 24) & 0x80
    b_bits = b_raw & 0x7FFFFFFF  # |v|
    # Normal range (|v| >= 2**-6): keep 3 mantissa bits, rounding half to even at bit 20; a carry
    # moves into the exponent. fp8 code = (exp - 127 + 7) << 3 | mantissa.
    b_normal = ((b_bits + 0x7FFFF + ((b_bits >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range: multiples of 2**-9, the code is the multiple (8 is 2**-6, the first normal).
    # fp32's step in [2**14, 2**15) is 2**-9, so adding 2**14 rounds |v| to a multiple, half to
    # even, and the sum's bits less 2**14's count the multiples.
    b_sub = (b_bits.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    b_code = tl.where(b_bits < 0x3C800000, b_sub, b_normal)  # 0x3C800000: 2**-6
    b_code = tl.where(b_bits > 0x7F800000, 0x7F, b_code)  # NaN stays NaN
    return (b_sign | b_code).to(tl.uint8)


@triton.jit
def quantize_block(b_x, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """A loaded fp32 tile [BR, 128] (rows, one channel block) -> its float8_e4m3fn bits [BR, 128]
    uint8 and each row's scale [BR] fp32, as ``fp8.quantize``. (The tile comes in loaded and
    the results go out as values: a helper's pointer arguments would count as written for
    inductor, ``tests/test_kernel_inputs.py``.)"""
    b_amax = tl.maximum(tl.max(tl.abs(b_x), axis=1), AMAX_FLOOR)  # [BR]
    # NB: a NaN makes its block's amax NaN, as torch's amax does (a GPU max skips NaN): the
    # whole block then dequantizes to NaN instead of a NaN turning into a finite value.
    b_amax = tl.where(tl.max((b_x != b_x).to(tl.int32), axis=1) > 0, float("nan"), b_amax)
    b_max = tl.full(b_amax.shape, FP8_MAX, tl.float32)
    return e4m3_bits(b_x * tl.math.div_rn(b_max, b_amax)[:, None]), tl.math.div_rn(b_amax, b_max)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, values_ptr, scales_ptr, T, H, B, values_stride, scales_stride,
    FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    for i_r in range(tl.program_id(0), tl.cdiv(T, BLOCK_R), tl.num_programs(0)):  # blocks of tokens
        o_r = (i_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR] tokens
        m_r = o_r < T
        for i_b in range(tl.program_id(1), B, tl.num_programs(1)):  # 128-channel blocks
            o_c = i_b * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC] channels of this block
            b_x = upcast(tl.load(x_ptr + o_r[:, None] * H + o_c[None, :], mask=m_r[:, None], other=0), tl.float32)
            b_values, b_scale = quantize_block(b_x, FP8_MAX, AMAX_FLOOR)  # [BR, BC], [BR]
            tl.store(values_ptr + o_r[:, None] * values_stride + o_c[None, :], b_values, mask=m_r[:, None])
            tl.store(scales_ptr + o_r * scales_stride + i_b, b_scale, mask=m_r)


GPU_BLOCK_R, GPU_NUM_WARPS = 8, 2
"""Tokens per program and warps on a GPU (a program: one 128-channel block of GPU_BLOCK_R tokens).
Swept on an H200 at H = 7168 (block 1..64 x warps 1..8): 38.7 us at T = 4096 (floor 21.2; 8 x 4
took 44.0, the best 37.9), 6.3 us at T = 128; torch ops (``fp8.quantize``) take 355 / 68 us. That
was before the subnormal rounding took one add: on an H100 (same run) T = 4096 went from 44.3 to
38.5 us, 73% -> 84% of a copy of the same bytes (docs/benchmarks.md, fourteenth session)."""
POST_BLOCK_R, POST_NUM_WARPS, POST_CHANNEL_PROGRAMS = 16, 4, 14
"""The same where the symm_mem post quantizes (``row_put.post_slots(quantize=True)``, a kernel of
more registers: the tags, the barrier), and programs along the channels: each strides over
every 14th block (4 of H = 7168's 56). On an H100 (T = 4096, H = 7168, K = 8; docs/benchmarks.md,
twenty-third session) the post took 46.4 us at this tile, 64.5 at quantize_rows' (8, 2, a
program a block), 48.1 at (16, 4, a program a block), 51.2 at (32, 4, 7), 59.2 at (8, 4, a
program a block); quantize_rows and the post of the tags alone took 49.9."""
BUDGET_BLOCK_R, BUDGET_NUM_WARPS = 64, 8
"""The same under an SM budget: one program per SM, so more tokens a step (as _config.BUDGET_BLOCKS)."""


class Tiles(NamedTuple):
    """How a kernel that quantizes rows is launched: ``grid`` (programs along the token blocks,
    programs along the 128-channel blocks; each strides over its blocks), ``block_r`` tokens a
    program step (of one channel block), ``num_warps``."""

    grid: tuple[int, int]
    block_r: int
    num_warps: int


def tiles(n_rows: int, hidden: int, max_programs: Optional[int] = None, post: bool = False) -> Tiles:
    """The launch of ``_quantize_rows_kernel`` (``post``: of ``row_put.post_slots`` quantizing)
    for n_rows rows of ``hidden`` channels; ``max_programs``: an SM budget."""
    channel_programs = max(hidden // BLOCK, 1)
    if interpreting():
        block_r, num_warps = triton.next_power_of_2(max(1, min(n_rows, 256))), 1
    elif max_programs is not None:
        block_r, num_warps = BUDGET_BLOCK_R, BUDGET_NUM_WARPS
    elif post:
        block_r, num_warps = POST_BLOCK_R, POST_NUM_WARPS
        channel_programs = min(channel_programs, POST_CHANNEL_PROGRAMS)
    else:
        block_r, num_warps = GPU_BLOCK_R, GPU_NUM_WARPS
    return Tiles(program_grid(triton.cdiv(max(n_rows, 1), block_r), channel_programs, max_programs),
                 block_r, num_warps)


def quantize_rows(x_TH: torch.Tensor, max_programs: Optional[int] = None,
                  out_TP: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`alltoall_ops.fp8.quantize` in one launch: x (T, H) float, H a multiple of 128 ->
    values (T, H) as uint8 (float8_e4m3fn bits) and scales (T, H / 128) fp32. ``max_programs``:
    at most that many programs (an SM budget), each striding over token blocks. ``out_TP``: (T, P
    = H + 4 H / 128) uint8 wire rows (``payload.pack``'s layout) to write into instead: the
    values and scales returned are views of it (no packing copy)."""
    T, H = x_TH.shape
    B = H // BLOCK
    if out_TP is None:
        values_TH = x_TH.new_empty(T, H, dtype=torch.uint8)
        scales_TB = x_TH.new_empty(T, B, dtype=torch.float32)
    else:
        require_contiguous("quantize_rows", out_TP=out_TP)
        values_TH, scales_TB = out_TP[:, :H], out_TP[:, H:].view(torch.float32)
    if T == 0 or H == 0:
        return values_TH, scales_TB
    x_TH = x_TH.contiguous()
    launch_tiles = tiles(T, H, max_programs)
    with LAUNCH_LOCK:
        launch(_quantize_rows_kernel, x_TH)[launch_tiles.grid](
            x_TH, values_TH, scales_TB, T, H, B, values_TH.stride(0), scales_TB.stride(0),
            FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, BLOCK_R=launch_tiles.block_r, BLOCK_C=BLOCK,
            num_warps=launch_tiles.num_warps,
        )
    return values_TH, scales_TB


@triton.jit
def e4m3_value(b_bits):
    """float8_e4m3fn bits (uint8) -> their fp32 value (exact; NaN for 0x7F / 0xFF): the GPU's
    conversion (HARDWARE_CASTS), in Triton's interpreter decoded from the bits."""
    if HARDWARE_CASTS:
        return b_bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        b_bits = b_bits.to(tl.int32)
        b_exp, b_man = (b_bits >> 3) & 0xF, b_bits & 7
        b_normal = ((b_exp + 120) << 23 | b_man << 20).to(tl.float32, bitcast=True)  # (1 + m / 8) 2^(e - 7)
        b_abs = tl.where(b_exp == 0, b_man.to(tl.float32) * 0.001953125, b_normal)  # subnormal: m 2^-9
        b_abs = tl.where((b_bits & 0x7F) == 0x7F, float("nan"), b_abs)
        return tl.where((b_bits & 0x80) != 0, -b_abs, b_abs)
