"""tools/gpu_fault_check.py's checks on a CUDA GPU, one test each: the barrier kernel passes when
every rank arrives, and fails its named device-side assert at its deadline when a peer never
does, or at once when two ranks are out of step (in child processes); strided inputs and NaN
weights on dropped slots on the kernel path."""

from __future__ import annotations

import pytest

from tools import gpu_fault_check

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("check", gpu_fault_check.CHECKS, ids=lambda fn: fn.__name__)
def test_gpu_fault_check(check):
    check()
