"""Races in the Triton kernels, found on the CPU (``kernels/races.py`` over Triton's interpreter):
within a launch, and between the launches of simulated ranks.

The interpreter runs programs one after another, so a kernel that races on a GPU still computes
the right result here; the race check records every launch's loads and stores instead. First
the check itself can fail (a tag read and reset without a barrier, the copy-out bug that dropped
rows on the H200 under an SM budget; programs overlapping); then a whole simulated symm_mem step
(W = 2, plain and fp8, budgets 1, 3 and none, overflow='drop', forward and backward), the
local backend and the Ulysses exchange over UlyssesBuffers (W = 2 and 3, uneven heads, budgets)
launch no kernel with a race. Between ranks (``testing.races_between_ranks``): no rank writes
memory that a peer reads or writes between the same two barriers, in the steps whose order of
exchanges differs (layers interleaved, a combine's backward skipped) and with both exchanges
started asynchronously; without the barrier after the pull or the reduction, the check finds
the race.
"""

from __future__ import annotations

import threading

import pytest
import torch

import alltoall_ops as a2a
from alltoall_ops import fp8
from alltoall_ops.backends.symm_mem import run_simulated
from alltoall_ops.kernels import loader
from alltoall_ops.testing import races_between_ranks, routing

pytestmark = pytest.mark.skipif(not loader.load().interpreting(), reason="the check runs Triton's interpreter")

if loader.load().interpreting():
    import triton
    import triton.language as tl

    from alltoall_ops.kernels.races import record_races

    @triton.jit
    def _read_then_reset(tags_ptr, out_ptr, n, BARRIER: tl.constexpr, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        b_tag = tl.load(tags_ptr + o, mask=m, other=-1)
        if BARRIER:
            tl.debug_barrier()
        tl.store(tags_ptr + o, tl.full([BLOCK], -1, tl.int64), mask=m)
        tl.store(out_ptr + o, b_tag, mask=m)

    @triton.jit
    def _shift_left(x_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        b_x = tl.load(x_ptr + o + 1, mask=o + 1 < n)  # the next program's first element too
        tl.debug_barrier()
        tl.store(x_ptr + o, b_x, mask=o < n)


@pytest.mark.parametrize("barrier", [False, True])
def test_read_then_reset_needs_a_barrier(barrier):
    tags, out = torch.arange(10), torch.empty(10, dtype=torch.int64)
    with record_races() as races:
        _read_then_reset[(3,)](tags, out, 10, BARRIER=barrier, BLOCK=4)
    assert torch.equal(out, torch.arange(10)) and bool((tags == -1).all())  # right here either way
    if barrier:
        assert races == []
    else:
        assert [r.programs for r in races] == [((0, 0, 0),), ((1, 0, 0),), ((2, 0, 0),)]
        assert all("within a program" in r.kind and r.kernel == "_read_then_reset" for r in races)


def test_programs_that_overlap_race():
    with record_races() as races:
        _shift_left[(3,)](torch.arange(10), 10, BLOCK=4)
    assert races and all("between programs" in r.kind for r in races)
    assert {frozenset(r.programs) for r in races} == {frozenset({(0, 0, 0), (1, 0, 0)}),
                                                      frozenset({(1, 0, 0), (2, 0, 0)})}


W, T, H, K, E = 2, 9, 256, 2, 8  # H: two fp8 scale blocks


def _buffers(payload_dtype=None, num_sms=None, capacity=None, world_size=W):
    """Simulated buffers of ``world_size`` ranks, E / W = 4 experts each."""
    return a2a.SymmBuffers.simulated(world_size, T, H, K, E // W * world_size, dtype=torch.bfloat16, device="cpu",
                                     num_sms=num_sms, capacity=capacity, overflow="drop" if capacity else "error",
                                     payload_dtype=payload_dtype)


def _step(bufs, payload_dtype=None, layers="one"):
    """A training step of every simulated rank on ``bufs``. layers: "one" (dispatch, combine,
    backward); "interleaved" (two dispatches, then their combines; a combine follows a combine);
    "aux" (the loss also reads the routed rows and not the combine's input: the dispatch's
    backward, a combine, follows the forward combine with no exchange between); "async" (both
    exchanges started on the communication stream, ``async_op=True``, then waited for)."""
    world_size, num_experts = len(bufs), bufs[0].num_experts
    xs = [torch.randn(T, H, generator=torch.Generator().manual_seed(r)).bfloat16().requires_grad_()
          for r in range(world_size)]
    routes = [routing(T, K, num_experts, seed=10 + r, dropped=0.2) for r in range(world_size)]

    def dispatch(b, x, idx):
        return a2a.dispatch(x, idx, num_experts=num_experts, buffers=b, payload_dtype=payload_dtype,
                            dequantize=payload_dtype is not None, async_op=layers == "async")

    def rank(r, b):
        idx, w = routes[r]
        w = w.requires_grad_()
        routed, tpe, handle = dispatch(b, xs[r], idx)
        if layers == "async":
            y = a2a.wait(a2a.combine(a2a.wait(routed) * 2, handle, w, async_op=True))
        elif layers == "interleaved":
            routed_2, _, handle_2 = dispatch(b, xs[r] * 3, idx.flip(1))
            y = a2a.combine(routed * 2, handle, w) + a2a.combine(routed_2 * 2, handle_2, w)
        elif layers == "aux":
            y = a2a.combine((routed * 2).detach(), handle, w)
            (routed.float().square().sum() * 1e-3).backward(retain_graph=True)
        else:
            y = a2a.combine(routed * 2, handle, w)
        y.float().square().sum().backward()
        return y

    return run_simulated(rank, bufs)


@pytest.mark.parametrize("payload_dtype", [None, fp8.FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_sms", [1, 3, None])
def test_symm_mem_step_has_no_race(payload_dtype, num_sms):
    with record_races() as races:
        _step(_buffers(payload_dtype, num_sms), payload_dtype)
    assert races == [], "\n".join(map(str, races))


def test_symm_mem_drop_and_local_have_no_race():
    with record_races() as races:
        _step(_buffers(None, 2, capacity=5))
        x = torch.randn(T, H)
        idx, w = routing(T, K, E, seed=3, dropped=0.2)
        routed, _, handle = a2a.dispatch(x, idx, num_experts=E, backend="local", expert_alignment=4,
                                         payload_dtype=fp8.FP8)
    assert races == [], "\n".join(map(str, races))


if loader.load().interpreting():

    @triton.jit
    def _store_twice_across_a_barrier(x_ptr, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + o, o)
        tl.debug_barrier()
        tl.store(x_ptr + o, o + 1)  # the same program's addresses again, ordered by its barrier


def test_a_program_may_rewrite_its_own_addresses_after_a_barrier():
    x = torch.zeros(8, dtype=torch.int32)
    with record_races() as races:
        _store_twice_across_a_barrier[(2,)](x, BLOCK=4)
    assert races == [] and torch.equal(x, torch.arange(1, 9, dtype=torch.int32))


@pytest.mark.parametrize("num_sms", [1, 3, None])
@pytest.mark.parametrize("world_size", [2, 3])
def test_ulysses_exchange_has_no_race(world_size, num_sms):
    """seq_to_head of q, k, v (uneven heads, head dim before the sequence too) and head_to_seq back
    over simulated UlyssesBuffers: no race in the post or gather kernels, under SM budgets."""
    from alltoall_ops.ulysses import symm_head_to_seq_op, symm_seq_to_head_op

    bufs = a2a.UlyssesBuffers.simulated(world_size, 1 << 16, device="cpu", num_sms=num_sms)
    heads = 2 * world_size + 1
    xs = [[torch.randn(2, 3, heads, 4, generator=torch.Generator().manual_seed(10 * r + i)) for i in range(3)]
          for r in range(world_size)]

    def rank(r, b):
        ys = symm_seq_to_head_op(xs[r], b, 1, 2, [], False)
        back = symm_head_to_seq_op(ys, b, 1, 2, [heads] * 3, [], False)
        t = symm_seq_to_head_op([xs[r][0].transpose(1, 2).contiguous()], b, 2, 1, [], False)[0]
        return back, t

    with record_races() as races:
        results = run_simulated(rank, bufs)
    assert races == [], "\n".join(map(str, races))
    assert all(torch.equal(a, x) for r, (back, _) in enumerate(results) for a, x in zip(back, xs[r]))


# --------------------------------------------------------------------------------------------
# Between ranks: an op writes peers' memory only after every peer is done with it


@pytest.mark.parametrize("layers", ["one", "interleaved", "aux", "async"])
@pytest.mark.parametrize("payload_dtype, world_size", [(None, 2), (fp8.FP8, 2), (None, 3)],
                         ids=["bf16-W2", "fp8-W2", "bf16-W3"])
def test_symm_mem_ranks_never_race(layers, payload_dtype, world_size):
    bufs = _buffers(payload_dtype, num_sms=3, world_size=world_size)
    with races_between_ranks(bufs) as races:
        _step(bufs, payload_dtype, layers)
        _step(bufs, payload_dtype, layers)  # and the next step's exchanges after this one's
    assert races == [], "\n".join(map(str, races))


@pytest.mark.parametrize("kernel, layers, writer, reader", [
    ("pull_rows", "one", "_put_rows_kernel", "_pull_rows_kernel"),  # the combine's put into the stage pulled from
    ("topk_reduce", "interleaved", "_put_rows_kernel", "_topk_reduce_kernel"),  # a combine's put, the last reduction
    ("topk_reduce", "aux", "_put_rows_kernel", "_topk_reduce_kernel"),  # the dispatch's backward after the combine
])
def test_without_the_barrier_after_the_reads_ranks_race(monkeypatch, kernel, layers, writer, reader):
    """Each barrier after a kernel that reads what peers write next is needed: dropped (the
    barrier that follows ``kernel`` skipped), the check names the writer and the reader."""
    from alltoall_ops.backends.symm_mem.segments import _SimulatedSegments

    launched = threading.local()
    launcher, barrier = getattr(loader.load(), kernel), _SimulatedSegments.barrier

    def launch(*args, **kwargs):
        launched.it = True
        return launcher(*args, **kwargs)

    def barrier_unless_after_it(self, *args, **kwargs):
        if getattr(launched, "it", False):
            launched.it = False
            return None
        return barrier(self, *args, **kwargs)

    monkeypatch.setattr(loader.load(), kernel, launch)
    monkeypatch.setattr(_SimulatedSegments, "barrier", barrier_unless_after_it)
    bufs = _buffers()
    with races_between_ranks(bufs) as races:
        _step(bufs, layers=layers)
    assert races and all(r.kernel.startswith(writer) and f"/ {reader}" in r.kernel for r in races), races
    assert all("between ranks" in r.kind for r in races)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ulysses_ranks_never_race(world_size):
    """Ulysses attention with q's exchange started before k and v's (two exchanges in a row on
    the two stage slots), forward and backward, twice: no rank writes a slot a peer still reads."""
    bufs = a2a.UlyssesBuffers.simulated(world_size, 1 << 16, device="cpu")
    heads = 2 * world_size
    qkv = [[torch.randn(1, 4, heads, 4, generator=torch.Generator().manual_seed(10 * r + i)).requires_grad_()
            for i in range(3)] for r in range(world_size)]

    def rank(r, b):
        q, k, v = qkv[r]
        out = a2a.ulysses_attention(q, lambda: k * 1, lambda: v * 1, is_causal=True, buffers=b)
        return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    with races_between_ranks(bufs) as races:
        run_simulated(rank, bufs)
        run_simulated(rank, bufs)
    assert races == [], "\n".join(map(str, races))
