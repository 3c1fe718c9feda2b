"""tools/gpu_check.py's checks on a CUDA GPU, one test each, in a one-rank NCCL group: the local
backend against fp64 references, determinism, opcheck, one inductor compilation across routings,
the collective backend equal to the local one, Ulysses. ``python -m pytest -m gpu tests/``."""

from __future__ import annotations

import pytest

from alltoall_ops import testing
from tools import gpu_check

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def one_rank_group():
    with testing.one_rank_group(gpu_check.DEVICE):
        yield


@pytest.mark.parametrize("check", gpu_check.CHECKS, ids=lambda fn: fn.__name__)
def test_gpu_check(check, one_rank_group):
    check()
