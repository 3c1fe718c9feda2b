"""fp8 payloads with block scales (DeepEP's format): the quantize / dequantize reference, the
width of a wire row, and the format's own checks (a dispatch's fp8 arguments:
``validation.check_payload_args``). How the rows travel: ``payload.FP8Format``.

Format: ``torch.float8_e4m3fn`` values with one fp32 scale per token per ``BLOCK`` = 128
channels; ``H`` must be a multiple of 128, ``B = H / 128`` scales per row. A block's scale is
``amax / 448`` (amax clamped to at least 1e-4) and its values are ``x * (448 / amax)`` rounded
to nearest even, so ``dequantize(*quantize(x))`` is within half an fp8 step (2**-4 relative,
plus the subnormal floor) of ``x``.

On the wire a row is ``P = H + 4 * B`` bytes: its H fp8 values, then its B fp32 scales
(``payload.pack``: uint8 rows, so every backend moves them as it moves any rows): 0.52 of a
bf16 row's bytes.
"""

from __future__ import annotations

from typing import Optional

import torch

BLOCK = 128
"""Channels per scale."""
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""The largest finite float8_e4m3fn value: a block's amax maps to it."""
AMAX_FLOOR = 1e-4
"""A block's amax is clamped to at least this (all-zero blocks get scale AMAX_FLOOR / 448)."""


def num_blocks(hidden: int) -> int:
    """B = H / 128 scales per row."""
    return hidden // BLOCK


def packed_width(hidden: int) -> int:
    """P = H + 4 * B bytes of one wire row."""
    return hidden + 4 * num_blocks(hidden)


def quantize(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H) float -> values (T, H) float8_e4m3fn and scales (T, H / 128) fp32, DeepEP's
    per-token cast: ``x ~= values.float() * scales`` block by block. The reference the
    dispatch's kernel (``kernels/quantize.py``) equals bit for bit."""
    T, H = x_TH.shape
    x_TBC = x_TH.float().view(T, num_blocks(H), BLOCK)  # (T, B, 128)
    amax_TB = x_TBC.abs().amax(dim=2).clamp(min=AMAX_FLOOR)
    # NB: elementwise divisions by a same-shaped tensor, correctly rounded on every device (a
    # Python scalar divided by a tensor is a reciprocal and a product: two roundings).
    fp8_max_TB = torch.full_like(amax_TB, FP8_MAX)
    values_TH = (x_TBC * (fp8_max_TB / amax_TB)[..., None]).to(FP8).view(T, H)
    return values_TH, amax_TB / fp8_max_TB


def dequantize(values_TH: torch.Tensor, scales_TB: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(T, H) float8_e4m3fn values and (T, H / 128) fp32 scales -> (T, H) ``dtype``: each value
    times its block's scale in fp32, rounded once."""
    T, H = values_TH.shape
    x_TBC = values_TH.float().view(T, num_blocks(H), BLOCK) * scales_TB.float()[..., None]
    return x_TBC.view(T, H).to(dtype)


def check_payload_dtype(payload_dtype: Optional[torch.dtype]) -> None:
    """Raise unless ``payload_dtype`` is None or float8_e4m3fn."""
    if payload_dtype not in (None, FP8):
        raise ValueError(f"payload_dtype: expected None or {FP8}, got {payload_dtype}")


def check_hidden(name: str, hidden: int) -> None:
    """Raise unless ``hidden`` (argument ``name``'s H) is a multiple of 128."""
    if hidden % BLOCK != 0:
        raise ValueError(f"{name}: an fp8 payload needs H divisible by {BLOCK} (one scale per {BLOCK} channels), "
                         f"got H = {hidden}")
