"""tools/gpu_fp8_check.py's checks on a CUDA GPU, one test each: the quantize kernel against
torch's float8_e4m3fn cast and ``fp8.quantize`` bit for bit (every code, non-finite tokens, five
shapes), dispatch's three fp8 modes and the straight-through gradient, one inductor compilation
across routings, the kernel replayed from a CUDA graph."""

from __future__ import annotations

import pytest

from tools import gpu_fp8_check

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name, check", gpu_fp8_check.CHECKS, ids=[name for name, _ in gpu_fp8_check.CHECKS])
def test_gpu_fp8_check(name, check):
    check()
