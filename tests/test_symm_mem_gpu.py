"""backend="symm_mem" on a CUDA GPU: the checks of tools/gpu_symm_check.py in quick mode
(simulated peers in one process, compared with the collective backend; CUDA graph capture and
replay with new routing; torch.compile). The CPU path of the same kernels: test_symm_mem.py."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and compiled Triton kernels; on the CPU the same kernels run through "
    "Triton's interpreter in test_symm_mem.py",
)


def test_gpu_checks_quick():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    import gpu_symm_check

    assert gpu_symm_check.main(["--quick"]) == 0
