"""Ulysses through UlyssesBuffers on a CUDA GPU (compiled kernels; simulated peers: W ranks on one
device, one thread each): seq_to_head / head_to_seq against gathered references bit for bit
(even and uneven heads, bf16 and fp32, SM budgets), ulysses_attention forward, and forward and
backward with GQA phase by phase (``testing.simulated_ulysses_attention``: the autograd engine runs
CUDA backwards on one device thread, so rank threads cannot each run theirs), against dense
attention; replay from a CUDA graph with new inputs; q's exchange first (k and v as callables),
eager and replayed, equal to the one exchange; ranks whose pieces differ: the gather
kernel's device-side assert, naming the field (a subprocess: the context dies with it). The gradients through
autograd are the CPU suite's (tests/test_ulysses_symm.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import alltoall_ops as a2a
from alltoall_ops.backends.symm_mem import run_simulated
from alltoall_ops.testing import debug_mode, simulated_errors, simulated_ulysses_attention

pytestmark = pytest.mark.gpu


def _chunk(t: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    """Rank ``rank``'s share of ``t`` along ``dim`` (DeepSpeed's split: the first size % parts one more)."""
    base, extra = divmod(t.shape[dim], parts)
    return t.narrow(dim, rank * base + min(rank, extra), base + (rank < extra))


@pytest.mark.parametrize("W, heads, dtype, num_sms", [(2, 8, torch.bfloat16, None), (4, 6, torch.bfloat16, None),
                                                      (2, 5, torch.float32, 3), (4, 32, torch.bfloat16, 16)])
def test_exchange_matches_reference(W, heads, dtype, num_sms):
    B, S, D = 2, 256 * W, 128
    full = torch.randn(B, S, heads, D, device="cuda").to(dtype)
    weights = torch.randn(B, S, heads, D, device="cuda").to(dtype)
    bufs = a2a.UlyssesBuffers.simulated(W, a2a.UlyssesBuffers.bytes_for([(B, S // W, heads, D)], dtype, W),
                                        num_sms=num_sms)

    def body(rank, b):
        y = a2a.seq_to_head(_chunk(full, 1, rank, W), buffers=b)
        return y, a2a.head_to_seq(y * _chunk(weights, 2, rank, W), num_heads=heads, buffers=b)

    outs = run_simulated(body, bufs)
    torch.cuda.synchronize()
    for rank, (y, z) in enumerate(outs):
        assert torch.equal(y, _chunk(full, 2, rank, W))
        assert torch.equal(z, _chunk(full * weights, 1, rank, W))


@pytest.mark.parametrize("W, heads_q, heads_kv", [(2, 8, 8), (2, 8, 2), (4, 8, 4), (4, 6, 6)])
def test_attention_forward_backward(W, heads_q, heads_kv):
    B, S, D = 1, 128 * W, 64
    q = torch.randn(B, S, heads_q, D, device="cuda")
    k, v = (torch.randn(B, S, heads_kv, D, device="cuda") for _ in range(2))
    upstream = torch.randn(B, S, heads_q, D, device="cuda")
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in full), is_causal=True, enable_gqa=heads_kv != heads_q).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, full, upstream)
    bufs = a2a.UlyssesBuffers.simulated(W, a2a.UlyssesBuffers.bytes_for(
        [(B, S // W, heads_q, D), (B, S // W, heads_kv, D), (B, S // W, heads_kv, D)], q.dtype, W))
    local = [[_chunk(t, 1, rank, W) for t in (q, k, v)] for rank in range(W)]
    with torch.no_grad():
        forward = run_simulated(lambda r, b: a2a.ulysses_attention(*local[r], is_causal=True, buffers=b), bufs)
    phased = simulated_ulysses_attention(bufs, local, [_chunk(upstream, 1, r, W) for r in range(W)])
    for rank, (out, grads) in enumerate(phased):
        torch.testing.assert_close(forward[rank], _chunk(ref, 1, rank, W), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out, _chunk(ref, 1, rank, W), rtol=1e-4, atol=1e-4)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, _chunk(r, 1, rank, W), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("W", [2, 4])
def test_cuda_graph_replay_with_new_inputs(W):
    B, S, H, D = 1, 512 * W, 8 * W, 128
    bufs = a2a.UlyssesBuffers.simulated(W, a2a.UlyssesBuffers.bytes_for([(B, S // W, H, D)], torch.bfloat16, W))
    static = [torch.zeros(B, S // W, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(W)]

    def step(rank, b):
        y = a2a.seq_to_head(static[rank], buffers=b)
        return y, a2a.head_to_seq(y * 2, buffers=b)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    run_simulated(step, bufs, stream=stream)  # warm-up (Triton compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="relaxed"):
        outs = run_simulated(step, bufs, stream=stream)
    for seed in range(3):  # the slot alternates with the call number the graph's barriers carry
        full = torch.randn(B, S, H, D, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        full = full.to(torch.bfloat16)
        for rank in range(W):
            static[rank].copy_(_chunk(full, 1, rank, W))
        graph.replay()
        torch.cuda.synchronize()
        for rank, (y, z) in enumerate(outs):
            assert torch.equal(y, _chunk(full, 2, rank, W)), (seed, rank)
            assert torch.equal(z, 2 * _chunk(full, 1, rank, W)), (seed, rank)


def _elementwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A stand-in for attention, (B, S, h, D) -> (B, S, h, D), one elementwise kernel: bit for bit
    the same from the same inputs."""
    return (q.float() * k.float() + v.float()).to(q.dtype)


@pytest.mark.parametrize("W", [2, 4])
def test_q_first_forward_equals_one_exchange(W):
    """ulysses_attention given k and v's projections as callables (q's exchange started on the
    communication stream first, k / v's after the projections) equals the one exchange of q, k, v
    bit for bit, eager and replayed from a CUDA graph (forward: see the module docstring): the
    gathered q, k, v every rank's attention gets, and the output after o's exchange.

    The projections are elementwise (several kernels, so a k / v exchange that did not wait for
    them would read stale rows) and so is the attention (``_elementwise_attention``): on one H100
    (2026-12-05, docs/gpu.md) SDPA returned outputs 1 bf16 ulp apart on one rank from gathered
    q, k, v equal bit for bit, strides and alignment alike; cuBLAS matmuls beside another stream
    give no such promise either."""
    B, S, H, D = 1, 256 * W, 4 * W, 64
    x = torch.randn(B, S, H * D, device="cuda", dtype=torch.bfloat16)
    shifts = [torch.randn(H * D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    bufs = a2a.UlyssesBuffers.simulated(W, a2a.UlyssesBuffers.bytes_for([(B, S // W, H, D)] * 3, torch.bfloat16, W))
    static = [_chunk(x, 1, rank, W).clone() for rank in range(W)]
    gathered = {}  # (q_first, rank) -> the q, k, v its attention got

    def step(rank, b, q_first):
        def attention(q, k, v):
            gathered[(q_first, rank)] = [t.clone() for t in (q, k, v)]
            return _elementwise_attention(q, k, v)

        q, k, v = ((lambda s=s: (static[rank].float().sin() + s).to(torch.bfloat16).view(B, S // W, H, D))
                   for s in shifts)
        with torch.no_grad():
            return a2a.ulysses_attention(q(), *((k, v) if q_first else (k(), v())), buffers=b, attn_fn=attention)

    one = run_simulated(lambda r, b: step(r, b, False), bufs)
    first = run_simulated(lambda r, b: step(r, b, True), bufs)
    torch.cuda.synchronize()
    for rank in range(W):
        assert all(torch.equal(a, b) for a, b in zip(gathered[(True, rank)], gathered[(False, rank)])), rank
    assert all(torch.equal(a, b) for a, b in zip(first, one)), [(a - b).abs().max().item() for a, b in zip(first, one)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="relaxed"):
        outs = run_simulated(lambda r, b: step(r, b, True), bufs, stream=stream)
    for seed in range(2):
        torch.manual_seed(seed)
        full = torch.randn_like(x)
        for rank in range(W):
            static[rank].copy_(_chunk(full, 1, rank, W))
        graph.replay()
        torch.cuda.synchronize()
        ref = run_simulated(lambda r, b: step(r, b, False), bufs)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, ref)), seed


def test_ranks_that_disagree_trap():
    code = (
        "import torch, alltoall_ops as a2a\n"
        "from alltoall_ops.backends.symm_mem import run_simulated\n"
        "bufs = a2a.UlyssesBuffers.simulated(2, 1 << 20)\n"
        "xs = [torch.randn(1, 8 + 8 * r, 4, 16, device='cuda') for r in range(2)]\n"
        "run_simulated(lambda r, b: a2a.seq_to_head(xs[r], buffers=b), bufs)\n"
        "print('queued without a host sync', flush=True)\n"
        "torch.cuda.synchronize()\n"
        "print('NO ERROR')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert "NO ERROR" not in out.stdout and out.returncode != 0, (out.stdout, out.stderr[-800:])
    assert "queued without a host sync" in out.stdout, out.stderr[-800:]
    assert "the ranks disagree on the exchange: shape" in out.stderr, out.stderr[-1500:]  # the field named


def test_debug_mode_names_the_disagreement_on_every_rank():
    """ALLTOALL_OPS_DEBUG=1: the gather asserts nothing; the headers are compared on the host and
    every rank raises the named error (the CUDA context lives on), a rank's rejection of its
    arguments included."""
    bufs = a2a.UlyssesBuffers.simulated(2, 1 << 20)
    xs = [torch.randn(1, 8 + 8 * r, 4, 16, device="cuda") for r in range(2)]
    with debug_mode():
        errors = simulated_errors(lambda r, b: a2a.seq_to_head(xs[r], buffers=b), bufs)
    assert [e[0] for e in errors] == ["GroupMismatchError"] * 2, errors
    assert all("disagree on shape: rank 0 has (1, 8, 4, 16), rank 1 has (1, 16, 4, 16)" in e[1] for e in errors)
    with debug_mode():  # a rank that rejects its arguments before its post: its peer is told
        errors = simulated_errors(lambda r, b: a2a.seq_to_head(xs[0], seq_dim=2 if r else 1, buffers=b), bufs)
    assert [e[0] for e in errors] == ["PeerInputError", "ValueError"], errors
    outs = run_simulated(lambda r, b: a2a.seq_to_head(xs[0], buffers=b), bufs)  # still in step
    assert all(torch.equal(o, _chunk(torch.cat([xs[0]] * 2, 1), 2, r, 2)) for r, o in enumerate(outs))
