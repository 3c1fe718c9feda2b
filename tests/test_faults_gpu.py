"""tools/gpu_fault_check.py's checks on a CUDA GPU, one test each: the barrier kernel passes when
every rank arrives and traps at its deadline when a peer never does (in a child process); strided
inputs and NaN weights on dropped slots on the kernel path."""

from __future__ import annotations

import pytest

from tools import gpu_fault_check

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("check", gpu_fault_check.CHECKS, ids=lambda fn: fn.__name__)
def test_gpu_fault_check(check):
    check()
