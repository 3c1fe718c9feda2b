"""Async combine on a CUDA GPU (alltoall_ops.overlap): the exchange's kernels on the communication
stream, and a MoE step with a shared expert beside it equal to the serial step bit for bit, eager
and captured in a CUDA graph, and compiled. Marked ``gpu``: skipped without CUDA (the CPU suite's
tests/test_overlap.py checks results, order and bookkeeping; a CPU has no streams). Not run on a
GPU yet: written in a session without device time."""

from __future__ import annotations

import pytest
import torch

import alltoall_ops as a2a
from alltoall_ops import overlap
from alltoall_ops.moe import MoE

pytestmark = pytest.mark.gpu

T, H, F, E, K, FS = 4096, 2048, 1408, 64, 6, 2816


def layer(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE(H, F, E, K, backend="local", shared_ffn_size=FS, device="cuda", dtype=torch.bfloat16)


def serial(moe: MoE, x_TH: torch.Tensor) -> torch.Tensor:
    topk_idx_TK, weights_TK = moe.router(x_TH)
    routed_RH, tokens_per_expert_e, handle = a2a.dispatch(x_TH, topk_idx_TK, num_experts=E)
    return a2a.combine(moe.experts(routed_RH, tokens_per_expert_e), handle, weights_TK) + moe.shared_expert(x_TH)


def test_the_exchange_runs_on_the_comm_stream():
    x = torch.randn(1024, device="cuda")
    seen = []

    def exchange():
        seen.append(torch.cuda.current_stream())
        return x * 2

    out = overlap.start(exchange, x)
    assert seen == [overlap.comm_stream(x.device)] and seen[0] != torch.cuda.current_stream()
    assert overlap.pending_exchanges() == 1
    assert torch.equal(a2a.wait(out), x * 2)
    assert overlap.pending_exchanges() == 0


@torch.no_grad()
def test_overlapped_equals_serial():
    moe = layer()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(moe(x), serial(moe, x))
    assert overlap.pending_exchanges() == 0


@torch.no_grad()
def test_overlapped_step_captures_in_a_cuda_graph():
    moe = layer(1)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    moe(x)  # warm up (Triton compiles) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x)
    for seed in range(3):  # new tokens, new routing
        g = torch.Generator("cuda").manual_seed(seed)
        x.copy_(torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, serial(moe, x))
    assert overlap.pending_exchanges() == 0


def test_compiled_overlapped_step_equals_eager():
    moe = layer(2)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(moe, fullgraph=True)
    y = compiled(x)
    torch.testing.assert_close(y, moe(x), rtol=2e-2, atol=2e-2)
    y.sum().backward()
    assert x.grad is not None and overlap.pending_exchanges() == 0
