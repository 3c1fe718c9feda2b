"""tools/gpu_graph_check.py's cases on a CUDA GPU, one test each: ``mode="reduce-overhead"``
replays every training step (forward and backward graphs) and decode step of a MoE layer, local
and symm_mem, at T = 128 and 4096, with one compilation over the routings and outputs equal to
eager."""

from __future__ import annotations

import pytest
import torch

from tools import gpu_graph_check

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T", [128, 4096])
@pytest.mark.parametrize("train", [True, False], ids=["train", "decode"])
@pytest.mark.parametrize("backend", ["symm_mem", "local"])
def test_reduce_overhead_replays_a_layer_step(backend, train, T):
    with gpu_graph_check.counting_replays():
        ok, seen = gpu_graph_check.run_case(backend, train, T, 6, gpu_graph_check.SHAPE, torch.device("cuda"))
    assert ok, seen
