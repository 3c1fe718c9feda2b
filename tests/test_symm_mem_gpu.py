"""backend="symm_mem" on a CUDA GPU: tools/gpu_symm_check.py's correctness checks, one test each
(simulated peers in one process compared with the collective backend on gloo ranks, CUDA graph
capture replayed with new routings, overflow="drop", fp8, bf16 rounding, torch.compile, torch
symmetric memory on one rank, the overflow device-side assert, the barrier across two streams).
Its timing row is the tool's alone. The CPU path of the same kernels: test_symm_mem.py."""

from __future__ import annotations

import pytest
import torch

from tools import gpu_symm_check as symm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("spec", [symm._spec(1), symm._spec(2, dtype=torch.float32)], ids=["bf16", "fp32"])
def test_simulated_w2(pool2, spec):
    symm.check_simulated(pool2, spec)


def test_simulated_w4(pool4):
    symm.check_simulated(pool4, symm._spec(3, A=3))


@pytest.mark.parametrize("pool", [2, 4], indirect=True)
def test_cuda_graph(pool):
    symm.check_cuda_graph(pool)


def test_overflow_drop(pool2):
    symm.check_drop(pool2)


@pytest.mark.parametrize("check", [symm.check_bf16_rounding, symm.check_fp8, symm.check_compile,
                                   symm.check_symmetric_memory_one_rank, symm.check_overflow_assert,
                                   symm.check_barrier_streams], ids=lambda fn: fn.__name__)
def test_one_process(check):
    check()
