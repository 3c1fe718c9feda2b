"""tools/gpu_layout_check.py's cases on a CUDA GPU, one test each: the ``dispatch_layout`` kernel
equals the torch ops, eagerly and replayed from a CUDA graph on new ids."""

from __future__ import annotations

import pytest

from tools import gpu_layout_check

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T, K, E, W, nodes", gpu_layout_check.CASES)
def test_dispatch_layout_kernel(T, K, E, W, nodes):
    gpu_layout_check.check_case(T, K, E, W, nodes)
