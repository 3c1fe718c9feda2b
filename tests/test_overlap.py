"""Async dispatch and combine (``async_op=True``, ``alltoall_ops.wait``; alltoall_ops.overlap) on
the CPU, where there are no streams: results and gradients equal the synchronous calls bit for
bit (fp64, fresh routings) on every backend, every start is waited for, the MoE block with a
shared expert runs it between the combine's start and wait (in the compiled code too), and the
wait is saved by the checkpoint policy like its start. What only a GPU shows (the exchange on
its own stream beside the shared expert's GEMMs) is in tests/test_overlap_gpu.py."""

from __future__ import annotations

import random
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import alltoall_ops as a2a
from alltoall_ops import inspect, overlap
from alltoall_ops.moe import MoE
from alltoall_ops.testing import routing

T, H, E, K = 24, 16, 8, 2


def round_trip(x_TH, topk_idx_TK, weights_TK, async_op: bool, **dispatch_kwargs):
    """dispatch, a stand-in expert (rows * 2 + 1 on the rows of some expert), combine; y (T, H)."""
    routed_RH, tokens_per_expert_e, handle = a2a.dispatch(x_TH, topk_idx_TK, num_experts=E, async_op=async_op,
                                                          **dispatch_kwargs)
    routed_RH = a2a.wait(routed_RH)
    valid_R1 = (a2a.layout.expert_of_rows(tokens_per_expert_e, routed_RH.shape[0]) < E)[:, None]
    out_RH = torch.where(valid_R1, routed_RH * 2 + 1, 0)
    y_TH = a2a.combine(out_RH, handle, weights_TK, async_op=async_op)
    beside_TH = x_TH.sin()  # work that reads no output of the exchange
    return a2a.wait_add(y_TH, beside_TH)


def async_equals_sync(rank: int, world_size: int, seed: int, backend: str) -> int:
    """Forward and gradients of round_trip, async against sync, bit for bit; returns the pending
    exchanges left."""
    torch.manual_seed(seed + rank)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    topk_idx, weights = routing(T, K, E, seed=seed + rank)
    weights = weights.to(torch.float64).requires_grad_()
    kwargs = {}
    if backend == "symm_mem":
        kwargs["buffers"] = a2a.SymmBuffers(max_tokens_per_rank=T, hidden=H, top_k=K, num_experts=E,
                                            dtype=torch.float64, device="cpu")
    results = []
    for async_op in (False, True):
        y = round_trip(x, topk_idx, weights, async_op, backend=backend, **kwargs)
        results.append((y, *torch.autograd.grad(y.square().sum(), [x, weights])))
    for want, got in zip(*results):
        assert torch.equal(want, got)
    return overlap.pending_exchanges()


@pytest.mark.parametrize("backend", ["local", "symm_mem"])
def test_async_equals_sync_one_rank(pool1, backend):
    assert pool1.run(async_equals_sync, random.randrange(1 << 20), backend) == [0]


@pytest.mark.parametrize("backend", ["collective", "symm_mem"])
def test_async_equals_sync_two_ranks(pool2, backend):
    assert pool2.run(async_equals_sync, random.randrange(1 << 20), backend) == [0, 0]


def test_every_start_is_pending_until_its_wait():
    x = torch.randn(T, H)
    topk_idx, weights = routing(T, K, E, seed=random.randrange(1 << 20))
    routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, async_op=True)
    assert overlap.pending_exchanges() == 1
    routed = a2a.wait(routed)
    y = a2a.combine(routed, handle, weights, async_op=True)
    assert overlap.pending_exchanges() == 1
    assert a2a.wait(y) is y  # the wait returns what it was given
    assert overlap.pending_exchanges() == 0
    a2a.wait(y)  # waiting again (or on a synchronous call's output) is free
    assert overlap.pending_exchanges() == 0


def test_fp8_pair_waits_as_a_pair():
    x = torch.randn(T, 128, dtype=torch.bfloat16)
    topk_idx, _ = routing(T, K, E, seed=random.randrange(1 << 20))
    want = a2a.dispatch(x, topk_idx, num_experts=E, payload_dtype=torch.float8_e4m3fn)[0]
    got = a2a.wait(a2a.dispatch(x, topk_idx, num_experts=E, payload_dtype=torch.float8_e4m3fn, async_op=True)[0])
    assert isinstance(got, tuple) and overlap.pending_exchanges() == 0
    assert all(torch.equal(w.view(torch.uint8), g.view(torch.uint8)) for w, g in zip(want, got))


@pytest.mark.parametrize("bad", [None, 3, [torch.ones(2), None]])
def test_wait_takes_tensors_only(bad):
    with pytest.raises(TypeError, match="x: expected a tensor an async dispatch or combine returned, or a tuple / "
                                        "list of them, got (NoneType|int)"):
        a2a.wait(bad)


@pytest.mark.parametrize("entry", ["dispatch", "combine"])
def test_async_op_must_be_a_bool(entry):
    x = torch.randn(T, H)
    topk_idx, weights = routing(T, K, E, seed=0)
    routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E)
    with pytest.raises(TypeError, match="async_op: expected a bool, got 'yes'"):
        if entry == "dispatch":
            a2a.dispatch(x, topk_idx, num_experts=E, async_op="yes")
        else:
            a2a.combine(routed, handle, weights, async_op="yes")
    assert overlap.pending_exchanges() == 0


def moe_with_shared_expert(gated: bool, seed: int, mode: str = "combine") -> MoE:
    torch.manual_seed(seed)
    return MoE(H, 2 * H, E, K, shared_ffn_size=3 * H, gated_shared_expert=gated, shared_expert_overlap=mode,
               dtype=torch.float64)


def serial_forward(moe: MoE, x_TH: torch.Tensor) -> torch.Tensor:
    """The block's function with a synchronous combine and the shared expert after it."""
    topk_idx_TK, weights_TK = moe.router(x_TH)
    routed_RH, tokens_per_expert_e, handle = a2a.dispatch(x_TH, topk_idx_TK, num_experts=E)
    y_TH = a2a.combine(moe.experts(routed_RH, tokens_per_expert_e), handle, weights_TK)
    return y_TH + moe.shared_expert(x_TH)


@pytest.mark.parametrize("gated, mode", [(False, "combine"), (True, "combine"), (True, "none")])
def test_moe_overlapped_equals_serial(gated, mode):
    seed = random.randrange(1 << 20)
    moe = moe_with_shared_expert(gated, seed, mode)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    results = []
    for forward in (serial_forward, MoE.forward):
        y = forward(moe, x)
        results.append((y, *torch.autograd.grad(y.square().sum(), [x, *moe.parameters()])))
    assert overlap.pending_exchanges() == 0
    for want, got in zip(*results):
        assert torch.equal(want, got), f"seed {seed}"


def test_shared_expert_overlap_is_checked():
    with pytest.raises(ValueError, match="shared_expert_overlap: expected one of"):
        MoE(H, 2 * H, E, K, shared_ffn_size=H, shared_expert_overlap="dispatch")


def _call_text(code: str, start: int) -> str:
    """The call that starts at ``code[start]``, to its closing parenthesis (arguments may hold calls)."""
    depth = 0
    for end in range(code.index("(", start), len(code)):
        depth += {"(": 1, ")": -1}.get(code[end], 0)
        if depth == 0:
            return code[start : end + 1]
    raise AssertionError(f"unclosed call at {code[start:start + 80]!r}")


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_compiled_code_runs_the_shared_expert_between_start_and_wait(gated, grad):
    """Inductor's code for the forward: the combine's start, the shared expert's 3 (gated 4)
    matmuls (w_gate, w_up, w_down, w_output_gate), then the wait (wait_add: y + the shared output).
    In training too (nothing waits before wait_add)."""
    moe = moe_with_shared_expert(gated, random.randrange(1 << 20))
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=grad)
    torch._dynamo.reset()
    y, codes = run_and_get_code(torch.compile(moe, fullgraph=True), x)
    with torch.no_grad():
        want = serial_forward(moe, x)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-14)  # inductor fuses the SwiGLU: fp64 rounding
    code = codes[0]
    start = code.index("torch.ops.alltoall_ops.local_combine.default(")
    assert _call_text(code, start).endswith(", True)")  # async_op, the op's last argument
    wait = code.index("torch.ops.alltoall_ops.wait_add.default(", start)
    assert len(re.findall(r"extern_kernels\.mm\(", code[start:wait])) == (4 if gated else 3), code[start:wait]
    assert "wait_tensor" not in code[start:wait]
    assert not re.findall(r"extern_kernels\.mm\(", code[wait:])  # nothing of the shared expert after the wait
    assert overlap.pending_exchanges() == 0


def test_wait_add_gradients():
    """wait_add's backward: the gradient to both inputs, summed back over a broadcast one."""
    a = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, H, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(a2a.wait_add, (a, b))
    torch.library.opcheck(a2a.wait_add, (a, b))


def test_graph_summary_shows_the_start_and_the_wait():
    moe = moe_with_shared_expert(False, random.randrange(1 << 20))
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    assert inspect.compiled_graphs(moe, x).summary() == """\
forward 0:
  alltoall_ops.local_dispatch(scale_TK=None)
  alltoall_ops.local_combine(weights_TK=<tensor>, async_op=True)
  alltoall_ops.wait_add()
backward 0:
  alltoall_ops.local_dispatch(scale_TK=<tensor>)
  alltoall_ops.local_combine(weights_TK=None)"""


def test_symm_mem_buffers_wait_for_a_pending_exchange():
    # A synchronous exchange runs on the current stream, not after an async one on the
    # communication stream: on the same buffers it raises until the pending one was waited for.
    bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.float32, device="cpu")
    x = torch.randn(T, H)
    topk_idx, weights = routing(T, K, E, seed=random.randrange(1 << 20))
    routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)
    y = a2a.combine(routed, handle, weights, async_op=True)
    with pytest.raises(RuntimeError, match=r"alltoall_ops.dispatch \(symm_mem\): an exchange on these buffers was "
                                           "started with async_op=True and not waited for"):
        a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs, async_op=True)
    with pytest.raises(RuntimeError, match=r"alltoall_ops.combine \(symm_mem\): an exchange on these buffers"):
        a2a.combine(routed, handle, weights)
    other = a2a.SymmBuffers(T, H, K, E, dtype=torch.float32, device="cpu")  # other buffers: no wait needed
    a2a.dispatch(x, topk_idx, num_experts=E, buffers=other)
    a2a.wait(y)
    routed2, _, handle2 = a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)
    assert torch.equal(a2a.combine(routed2, handle2, weights), y)
    assert overlap.pending_exchanges() == 0
