"""symm_mem's ops inlined into compiled graphs on a CUDA GPU (docs/design.md, "symm_mem ops in
compiled graphs"): inductor launches their kernels (no ``torch.ops.alltoall_ops.symm_*`` call
left in its code), the results equal eager bit for bit, forward and backward; the row moves
run in the order written; one rank moves no rows that nothing reads; under
``a2a.sac_policy()`` the backward does not run the forward's exchange again."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import alltoall_ops as a2a

pytestmark = pytest.mark.gpu

T, H, K, E = 96, 256, 4, 16


def _buffers() -> a2a.SymmBuffers:
    """One rank's buffers in plain memory (no process group): the buffers whose ops are inlined."""
    return a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device="cuda")


def _inputs(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    scores = torch.randn(T, E, device="cuda", generator=g).softmax(-1)
    weights, idx = scores.topk(K, dim=-1)
    return x, idx, weights


def _layer(bufs):
    def step(x, idx, weights):
        routed, tokens_per_expert, handle = a2a.dispatch(x, idx, num_experts=E, buffers=bufs)
        expert_out = routed * 2  # rows past tokens_per_expert.sum() are not read by combine
        return a2a.combine(expert_out, handle, weights)

    return step


def _launches(code: str, kernel: str) -> list[int]:
    """Where ``code`` (inductor's) launches ``kernel`` (a Triton kernel's name)."""
    return [m.start() for m in re.finditer(rf"\b{kernel}_\d+\.run\(", code)]


def test_inlined_forward_equals_eager():
    bufs = _buffers()
    step = _layer(bufs)
    compiled = torch.compile(step, fullgraph=True)
    for seed in range(3):  # one compilation over routings
        x, idx, weights = _inputs(seed)
        want = step(x, idx, weights)
        if seed == 0:
            got, (code, *_) = run_and_get_code(compiled, x, idx, weights)
        else:
            got, code = compiled(x, idx, weights), ""
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        if seed == 0:  # one rank: the placement's row map, then one pull (no tags to post)
            assert "alltoall_ops.symm_" not in code, "a symm_mem op is still called, not inlined"
            (place,), (pull,) = _launches(code, "_place_slots_kernel"), _launches(code, "_pull_rows_kernel")
            assert place < pull and not _launches(code, "_post_slots_kernel")
            # T * K = 384 slots: the placement's program plans them itself (no plan kernel of its own)
            assert not _launches(code, "_plan_in_one_program_kernel") and not _launches(code, "_block_counts_kernel")


def test_inlined_backward_equals_eager():
    bufs = _buffers()
    step = _layer(bufs)
    compiled = torch.compile(step, fullgraph=True)
    for seed in range(2):
        x, idx, weights = _inputs(seed)
        grads = []
        for fn in (step, compiled):
            xr, wr = x.clone().requires_grad_(), weights.clone().requires_grad_()

            def forward_backward(fn=fn, xr=xr, idx=idx, wr=wr):
                y = fn(xr, idx, wr)
                (y.float() * torch.arange(H, device="cuda")).sum().backward()
                return y

            y, codes = run_and_get_code(forward_backward)
            grads.append((y, xr.grad, wr.grad))
        for want, got in zip(*grads):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        if seed == 0:  # the weights' gradient kernel too is launched by inductor
            backward = codes[-1]
            assert "alltoall_ops.weight_grad" not in backward and _launches(backward, "_weight_grad_kernel")


def test_unused_rows_are_not_moved():
    # Only tokens_per_expert is returned. One rank: no peer waits for the rows, so dead-code
    # elimination drops the dispatch's post and pull; the placement (which counts) stays.
    bufs = _buffers()

    def counts_only(x, idx):
        _, tokens_per_expert, _ = a2a.dispatch(x, idx, num_experts=E, buffers=bufs)
        return tokens_per_expert

    x, idx, _ = _inputs(0)
    got, (code, *_) = run_and_get_code(torch.compile(counts_only, fullgraph=True), x, idx)
    torch.testing.assert_close(got, counts_only(x, idx))
    assert _launches(code, "_place_slots_kernel")
    for kernel in ("_post_slots_kernel", "_pull_rows_kernel"):
        assert not _launches(code, kernel), f"{kernel} ran for unused rows"


def test_sac_saves_the_exchange():
    # Under selective checkpointing with the library's policy, the backward graph recomputes no
    # forward exchange: its pulls are its own (the backward of combine is one dispatch).
    bufs = _buffers()
    step = _layer(bufs)

    def checkpointed(x, idx, weights):
        context_fn = partial(create_selective_checkpoint_contexts, a2a.sac_policy())
        return checkpoint(step, x, idx, weights, use_reentrant=False, context_fn=context_fn)

    x, idx, weights = _inputs(1)
    xr = x.clone().requires_grad_()
    compiled = torch.compile(checkpointed, fullgraph=True)

    def forward_backward():
        y = compiled(xr, idx, weights)
        y.float().sum().backward()
        return y

    _, codes = run_and_get_code(forward_backward)
    forward, backward = codes[0], codes[-1]
    xe = x.clone().requires_grad_()
    step(xe, idx, weights).float().sum().backward()
    torch.testing.assert_close(xr.grad, xe.grad, rtol=0, atol=0)
    assert len(_launches(forward, "_pull_rows_kernel")) == 1
    assert len(_launches(backward, "_pull_rows_kernel")) == 1, "the backward ran the forward's dispatch again"
