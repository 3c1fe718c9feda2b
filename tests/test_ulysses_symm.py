"""Ulysses through UlyssesBuffers (``buffers=``, backend symm_mem): the kernels in Triton's
interpreter over the CPU shared-memory stand-in (gloo processes) and over simulated peers (one
process, one thread per rank), against the process-group exchange and gathered references (exact,
fp64, forward and gradients); errors on every rank; torch.compile; opcheck."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._inductor.utils import run_and_get_code

import alltoall_ops as a2a
from alltoall_ops import overlap
from alltoall_ops.backends.symm_mem import run_simulated
from alltoall_ops.groups import NO_GROUP
from alltoall_ops.kernels import seq_exchange
from alltoall_ops.kernels._config import RowBlocks
from alltoall_ops.inspect import compiled_graphs
from alltoall_ops.testing import HostTraffic, bytes_written, raised, simulated_errors, simulated_ulysses_attention
from alltoall_ops.ulysses import head_counts, symm_head_to_seq_op, symm_seq_to_head_op


from .test_ulysses import _attention_inputs, _dense_gqa, _full, _shard

OPS = torch.ops.alltoall_ops
MAX_BYTES = 1 << 16

_BUFFERS: dict = {}


def _buffers(world_size: int) -> a2a.UlyssesBuffers:
    """This rank's buffers of the pool's group (created collectively on first use, then reused:
    every test leaves them in step)."""
    if world_size not in _BUFFERS:
        _BUFFERS[world_size] = a2a.UlyssesBuffers(MAX_BYTES)
    return _BUFFERS[world_size]


# --------------------------------------------------------------------------------------------
# Rank functions (module level: they travel to the spawned ranks by reference)


def run_exchange(rank, world_size, full_shape, seq_dim, head_dim, seed):
    """seq_to_head and head_to_seq through the buffers against the process-group exchange:
    outputs and gradients equal bit for bit. Returns seq_to_head's output shape."""
    bufs, W = _buffers(world_size), world_size
    full = _full(seed, full_shape)
    heads = full_shape[head_dim]
    x = _shard(full, seq_dim, rank, W).clone()
    results = []
    for buffers in (bufs, None):
        x_in = x.clone().requires_grad_()
        y = a2a.seq_to_head(x_in, seq_dim=seq_dim, head_dim=head_dim, buffers=buffers)
        weights = _full(seed + 1 + rank, y.shape)  # so that the gradient is not x's own layout
        z = a2a.head_to_seq(y * weights, seq_dim=seq_dim, head_dim=head_dim, num_heads=heads, buffers=buffers)
        (grad,) = torch.autograd.grad(z, x_in, x)
        results.append((y.detach(), z.detach(), grad))
    (y, z, grad), (y_ref, z_ref, grad_ref) = results
    assert torch.equal(y, y_ref) and torch.equal(z, z_ref) and torch.equal(grad, grad_ref)
    assert torch.equal(y, _shard(full, head_dim, rank, W))  # every rank's chunk, this rank's heads
    return tuple(y.shape)


def run_exchange_cases(rank, world_size):
    W = world_size
    cases = [((2, 2 * W, 2 * W, 3), 1, 2), ((2, 3 * W, 5, 4), 1, 2), ((3, 2 * W + 1, W, 2), 2, 1),
             ((2, W, 2, 4, 3), 1, 3), ((1, 2 * W, 1, 4), -3, -2), ((2, 3, W, 2 * W), 3, 2)]
    return [run_exchange(rank, W, shape, s, h, 10 + i) for i, (shape, s, h) in enumerate(cases)]


def run_attention(rank, world_size, heads_q, heads_kv, layout, is_causal):
    """ulysses_attention with the buffers against the dense computation and against the call
    without them: forward and gradients, fp64."""
    W, bufs = world_size, _buffers(world_size)
    seq = 1 if layout == "bshd" else 0
    q, k, v = (_full(60 + i, (2, 2 * W, h, 3)) for i, h in enumerate((heads_q, heads_kv, heads_kv)))
    upstream = _full(63, (2, 2 * W, heads_q, 3))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _dense_gqa(*full, causal_window=2 * W if is_causal else None)
    ref_grads = torch.autograd.grad(ref, full, upstream)

    def to_layout(t):
        return t if layout == "bshd" else t.transpose(0, 1).contiguous()

    outs = []
    for buffers in (bufs, None):
        local = [_shard(to_layout(t), seq, rank, W).clone().requires_grad_() for t in (q, k, v)]
        out = a2a.ulysses_attention(*local, is_causal=is_causal, layout=layout, buffers=buffers)
        grads = torch.autograd.grad(out, local, _shard(to_layout(upstream), seq, rank, W))
        outs.append((out.detach(), grads))
    (out, grads), (out_ref, grads_ref) = outs
    assert torch.equal(out, out_ref) and all(torch.equal(g, r) for g, r in zip(grads, grads_ref))
    torch.testing.assert_close(out, _shard(to_layout(ref), seq, rank, W), rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, _shard(to_layout(r), seq, rank, W), rtol=1e-12, atol=1e-12)


def run_errors(rank, world_size):
    """What each rank raises when the ranks' pieces differ, or the stage is too small; then an
    exchange in step still works (the buffers stay usable)."""
    W, bufs = world_size, _buffers(world_size)
    x = _full(80, (2, 2, 2 * W, 4))
    longer = _full(81, (2, 3 if rank == W - 1 else 2, 2 * W, 4))
    big = _full(82, (2, MAX_BYTES // 8, W, 2))  # 2 * MAX_BYTES / 8 * W * 2 elements of 8 bytes: too many
    one_big = _full(83, (2, 2 if rank else MAX_BYTES // 8, W, 2))
    outcomes = {
        "shape": raised(lambda: a2a.seq_to_head(longer, buffers=bufs)),
        "dtype": raised(lambda: a2a.seq_to_head(x.float() if rank == 0 else x, buffers=bufs)),
        "capacity": raised(lambda: a2a.seq_to_head(big, buffers=bufs)),
        "one too big": raised(lambda: a2a.seq_to_head(one_big, buffers=bufs)),
        "out of step": raised(lambda: a2a.seq_to_head(x, buffers=bufs) if rank == 0 else
                                a2a.head_to_seq(_full(84, (2, 2 * W, 2, 4)), buffers=bufs)),
        "type": raised(lambda: a2a.seq_to_head(x, buffers="bufs")),
        "group": raised(lambda: a2a.seq_to_head(x, group=NO_GROUP, buffers=bufs)),
        # the last rank's own check fails before its post: it tells its peers through the buffers
        "rejected": raised(lambda: a2a.seq_to_head(x, seq_dim=2 if rank == W - 1 else 1, buffers=bufs)),
        "attn_fn": raised(lambda: a2a.ulysses_attention(
            x, x, x, attn_fn=lambda q, k, v: q[:, :1] if rank == W - 1 else q, buffers=bufs)),
    }
    after = a2a.seq_to_head(x, buffers=bufs)
    assert torch.equal(after, a2a.seq_to_head(x))
    return outcomes


def run_async(rank, world_size):
    """async_op=True, through the buffers and the process group, eager and compiled (fullgraph):
    the started exchange and its wait give the sync results and gradients; through the buffers a
    sync exchange while a start is pending raises on every rank, before any communication."""
    W, bufs = world_size, _buffers(world_size)
    x = _full(140 + rank, (2, 3, 2 * W + 1, 4))

    def step(x, buffers, async_op):
        y = a2a.seq_to_head(x, buffers=buffers, async_op=async_op)
        other = x.amax()  # work queued between the start and the wait (exact, compiled too)
        y = a2a.wait(y) * 2
        z = a2a.wait(a2a.head_to_seq(y, num_heads=x.shape[2], buffers=buffers, async_op=async_op))
        return z + other

    compiled = torch.compile(step, fullgraph=True)
    for buffers in (bufs, None):
        results = []
        for fn, async_op in ((step, False), (step, True), (compiled, True)):
            x_in = x.clone().requires_grad_()
            z = fn(x_in, buffers, async_op)
            (grad,) = torch.autograd.grad(z, x_in, torch.ones_like(z))
            results.append((z.detach(), grad))
        for z, grad in results[1:]:
            assert torch.equal(z, results[0][0]) and torch.equal(grad, results[0][1])
        assert torch.equal(results[0][0], 2 * x + x.amax())
    pending = a2a.seq_to_head(x, buffers=bufs, async_op=True)
    refused = [raised(lambda: a2a.seq_to_head(x, buffers=bufs)),
               raised(lambda: a2a.ulysses_attention(x, x, x, buffers=bufs))]
    assert torch.equal(a2a.wait(pending), a2a.seq_to_head(x, buffers=bufs)) and not overlap.pending_exchanges()
    return refused


def _calls(bufs: a2a.UlyssesBuffers) -> int:
    """The exchanges (barriers) run on ``bufs`` so far: the device call counter of its segments."""
    return int(bufs._segments.calls_1)


def run_projections(rank, world_size):
    """k and v given as callables (their projections of x): q's exchange starts first and k, v
    move in an exchange of their own, through the buffers and through the process group: 3
    exchanges forward + 3 backward instead of 2 + 2 (counted on the buffers' call counter, or as
    all-to-alls: once agreed, no exchange of headers alone, though q's and k / v's alternate).
    Results and gradients equal the call with tensors bit for bit, eager and compiled (fullgraph,
    the start of q's exchange before the projections in the graph, no recompile for new values);
    nothing pending after."""
    W, bufs = world_size, _buffers(world_size)
    q_full, _, _, upstream = _attention_inputs(W, 170, heads=2 * W + 1, Dqk=3, Dv=3)
    x_full = _full(174, (2, 3 * W, 4))
    wk, wv = _full(175, (4, 2 * W + 1, 3)), _full(176, (4, 2 * W + 1, 3))

    def step(q, x, buffers, projected):
        kx, vx = (lambda: torch.einsum("bsc,chd->bshd", x, wk)), (lambda: torch.einsum("bsc,chd->bshd", x, wv))
        k, v = (kx, vx) if projected else (kx(), vx())
        return a2a.ulysses_attention(q, k, v, is_causal=True, buffers=buffers)

    compiled = torch.compile(step, fullgraph=True)
    grad = _shard(upstream, 1, rank, W)
    for buffers in (bufs, None):
        results = []
        for fn, projected in ((step, False), (step, True), (compiled, True)):
            for _ in range(2):  # the second call counted (the first may agree on new sizes)
                q, x = (_shard(t, 1, rank, W).clone().requires_grad_() for t in (q_full, x_full))
                before = _calls(bufs)
                with HostTraffic() as traffic:
                    out = fn(q, x, buffers, projected)
                    grads = torch.autograd.grad(out, (q, x), grad)
            exchanges = _calls(bufs) - before if buffers is not None else traffic.collectives["all_to_all_single"]
            results.append((out.detach(), grads, exchanges))
        assert [r[2] for r in results] == [4, 6, 6], (buffers is None, results)
        (out, grads, _), *rest = results
        for got, got_grads, _ in rest:
            torch.testing.assert_close(got, out, rtol=1e-13, atol=1e-13)
            for g, ref in zip(got_grads, grads):
                torch.testing.assert_close(g, ref, rtol=1e-13, atol=1e-13)
        assert not overlap.pending_exchanges()
    q, x = (_shard(t, 1, rank, W).clone().requires_grad_() for t in (q_full, x_full))
    for buffers in (bufs, None):  # inductor's code: q's start, the projections, k / v's start, the waits
        torch._dynamo.reset()
        _, (code, *_) = run_and_get_code(torch.compile(step, fullgraph=True), q, x, buffers, True)
        calls = [line for line in code.splitlines() if "seq_to_head.default(" in line or "mm(" in line
                 or "wait_tensor" in line and "#" not in line]
        kinds = ["start" if "seq_to_head" in line else "mm" if "mm(" in line else "wait" for line in calls]
        assert kinds == ["start", "mm", "mm", "start", "wait", "wait", "wait"], calls
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(q, x, bufs, True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        fresh = [_shard(_full(177 + i, t.shape[:1] + (t.shape[1] * W,) + t.shape[2:]), 1, rank, W).clone()
                 .requires_grad_() for i, t in enumerate((q, x))]
        torch.testing.assert_close(compiled(*fresh, bufs, True), step(*fresh, bufs, True), rtol=1e-13, atol=1e-13)


def run_projection_errors(rank, world_size):
    """With q's exchange started: the last rank's k projection of another shape is a ValueError there
    and a PeerInputError on its peers (told after q's exchange is waited for); a projection that
    raises on every rank leaves nothing pending; the buffers stay in step."""
    W, bufs = world_size, _buffers(world_size)
    q = _full(180 + rank, (2, 3, 2 * W, 4))
    short = q[:, :2] if rank == W - 1 else q

    def broken():
        raise RuntimeError("projection failed")

    outcomes = {"shape": raised(lambda: a2a.ulysses_attention(q, lambda: short, q, buffers=bufs)),
                "raises": raised(lambda: a2a.ulysses_attention(q, broken, broken, buffers=bufs))}
    assert not overlap.pending_exchanges()
    assert torch.equal(a2a.ulysses_attention(q, lambda: q, lambda: q, buffers=bufs), a2a.ulysses_attention(q, q, q))
    return outcomes


def run_projections_checkpointed(rank, world_size):
    """q first inside activation checkpointing, over the process group and the buffers: with
    ``sac_policy`` the backward re-runs no exchange (3 forward + 3 backward, as without
    checkpointing); with full recompute (early stop on) it re-runs the forward's, every start
    waited for; gradients equal the run without checkpointing bit for bit, nothing pending after."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    W, bufs = world_size, _buffers(world_size)
    q_full, _, _, upstream = _attention_inputs(W, 178, heads=2 * W, Dqk=3, Dv=3)
    x_full, wk = _full(179, (2, 3 * W, 4)), _full(180, (4, 2 * W, 3))

    def block(q, x, buffers):
        kv = lambda: torch.einsum("bsc,chd->bshd", x, wk)  # noqa: E731 (k and v alike here)
        return a2a.ulysses_attention(q.sin(), kv, kv, is_causal=True, buffers=buffers)

    sac = partial(create_selective_checkpoint_contexts, a2a.sac_policy())
    counts = {}
    for buffers in (bufs, None):
        block(*(_shard(t, 1, rank, W) for t in (q_full, x_full)), buffers)  # the sizes agreed (process group)
        results = []
        for name, run in (("plain", block),
                          ("sac", lambda *a: checkpoint(block, *a, use_reentrant=False, context_fn=sac)),
                          ("full", lambda *a: checkpoint(block, *a, use_reentrant=False))):
            q, x = (_shard(t, 1, rank, W).clone().requires_grad_() for t in (q_full, x_full))
            before = _calls(bufs)
            with HostTraffic() as traffic:
                out = run(q, x, buffers)
                grads = torch.autograd.grad(out, (q, x), _shard(upstream, 1, rank, W))
            assert not overlap.pending_exchanges(), name
            counts[(buffers is None, name)] = (_calls(bufs) - before if buffers is not None
                                               else traffic.collectives["all_to_all_single"])
            results.append((out.detach(), grads))
        for out, grads in results[1:]:
            assert torch.equal(out, results[0][0]) and all(torch.equal(g, r) for g, r in zip(grads, results[0][1]))
    return counts


def run_projection_change(rank, world_size):
    """Through the process group, k and v as callables: after agreed calls, the last rank's v of
    another head size is a GroupMismatchError on every rank naming the attention arguments, raised
    in k and v's exchange (that rank's header in pieces of the sizes agreed after q's exchange: no
    rank receives a byte more or less than it posted), with nothing left pending; then the group
    is still in step."""
    W = world_size
    q = _full(185 + rank, (1, 2, 2 * W, 3))
    v = _full(186, (1, 2, 2 * W, 5)) if rank == W - 1 else q
    for _ in range(2):
        a2a.ulysses_attention(q, lambda: q, lambda: q)
    with HostTraffic() as traffic:
        got = raised(lambda: a2a.ulysses_attention(q, lambda: q, lambda: v))
    assert not overlap.pending_exchanges()
    assert torch.equal(a2a.ulysses_attention(q, lambda: q, lambda: q), a2a.ulysses_attention(q, q, q))
    return got, dict(traffic.collectives)


def run_compiled(rank, world_size):
    """Two exchanges and attention through the buffers under torch.compile(fullgraph=True): no graph
    break, one node per exchange, the eager results and gradients; then other values, no recompile."""
    W, bufs = world_size, _buffers(world_size)
    torch._dynamo.reset()

    def fn(x, q, k, v):
        y = a2a.seq_to_head(x, buffers=bufs).sin()
        o = a2a.ulysses_attention(q, k, v, is_causal=True, buffers=bufs)
        return a2a.head_to_seq(y, num_heads=x.shape[2], buffers=bufs).sum() + o.square().sum()

    def inputs(seed):
        q, k, v, _ = _attention_inputs(W, seed, heads=3)
        return [_shard(t, 1, rank, W).clone().requires_grad_() for t in (_full(seed + 9, (2, 2 * W, 3, 4)), q, k, v)]

    eager_in = inputs(90)
    eager_grads = torch.autograd.grad(fn(*eager_in), eager_in)
    compiled_in = inputs(90)
    graphs = compiled_graphs(fn, *compiled_in, loss=lambda out: out)
    assert graphs.graph_breaks == 0
    for g, ref in zip((t.grad for t in compiled_in), eager_grads):
        torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12)
    counts = [graphs.comm_ops(which).count(f"alltoall_ops.{op}") for which in ("forward", "backward")
              for op in ("symm_seq_to_head", "symm_head_to_seq")]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    compiled(*inputs(92))
    fresh = inputs(91)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = compiled(*fresh)
    torch.testing.assert_close(got, fn(*fresh), rtol=1e-12, atol=1e-12)
    return counts


def run_opcheck(rank, world_size):
    bufs = _buffers(world_size)
    x = _full(100 + rank, (2, 3, 2 * world_size + 1, 4)).requires_grad_()
    torch.library.opcheck(OPS.symm_seq_to_head.default, ([x, x.detach()[..., :2].clone().requires_grad_()], bufs,
                                                         1, 2, [], False))
    n = 2 * world_size + 1
    h = _shard(_full(110, (2, 2 * world_size, n, 4)), 2, rank, world_size).clone().requires_grad_()
    torch.library.opcheck(OPS.symm_head_to_seq.default, ([h], bufs, 1, 2, [n], [], False))


# --------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("pool", [2, 4], indirect=True)
def test_exchange_matches_process_group_exchange(pool):
    W = pool.world_size
    shapes = pool.run(run_exchange_cases)
    assert shapes[0][0] == (2, 2 * W, 2, 3)  # even heads: 2 a rank
    assert [s[1][2] for s in shapes] == head_counts(5, W)  # uneven: the first 5 % W ranks one more
    assert [s[3][3] for s in shapes] == head_counts(4, W)  # 5-D, seq and head dims apart


@given(B=st.integers(1, 2), s=st.integers(1, 3), heads=st.integers(1, 7), D=st.integers(1, 5),
       head_first=st.booleans())
def test_exchange_property(pool2, B, s, heads, D, head_first):
    shape, seq_dim, head_dim = ((B, heads, 2 * s, D), 2, 1) if head_first else ((B, 2 * s, heads, D), 1, 2)
    pool2.run(run_exchange, shape, seq_dim, head_dim, s * 31 + heads)


@pytest.mark.parametrize("heads_q, heads_kv, layout, is_causal",
                         [(4, 4, "bshd", True), (5, 5, "sbhd", False), (4, 2, "bshd", False), (4, 1, "sbhd", True)])
def test_attention_matches_dense_and_process_group(pool2, heads_q, heads_kv, layout, is_causal):
    pool2.run(run_attention, heads_q, heads_kv, layout, is_causal)


def test_attention_on_four_ranks(pool4):
    pool4.run(run_attention, 4, 2, "bshd", True)
    pool4.run(run_attention, 6, 6, "bshd", False)  # 6 heads over 4 ranks: 2, 2, 1, 1


def test_errors_on_every_rank(pool2):
    outcomes = pool2.run(run_errors)
    for o in outcomes:
        assert o["shape"][0] == "GroupMismatchError" and "disagree on shape" in o["shape"][1], o["shape"]
        assert o["dtype"][0] == "GroupMismatchError" and "disagree on dtype" in o["dtype"][1], o["dtype"]
        assert o["capacity"][0] == "CapacityError" and "UlyssesBuffers hold 65536" in o["capacity"][1]
        assert o["one too big"][0] == "GroupMismatchError", o["one too big"]
        assert o["out of step"][0] == "GroupMismatchError" and "out of step" in o["out of step"][1], o["out of step"]
        assert o["type"][0] == "TypeError" and "UlyssesBuffers" in o["type"][1]
        assert o["group"][0] == "ValueError" and "group" in o["group"][1]
    *peers, last = outcomes
    assert last["rejected"][0] == "ValueError" and last["attn_fn"][0] == "ValueError", last
    for o in peers:  # at once (a wait for the last rank until the deadline: CollectiveTimeout)
        assert o["rejected"][0] == "PeerInputError" and f"rank {len(peers)} rejected its arguments: " \
            f"{last['rejected'][0]}: {last['rejected'][1]}" in o["rejected"][1], o["rejected"]
        assert o["attn_fn"][0] == "PeerInputError" and "attn_fn: expected an output" in o["attn_fn"][1], o["attn_fn"]
    # every rank names the same disagreement (after where it is: "... (rank r of W): ...")
    assert len({o["shape"][1].split("): ", 1)[1] for o in outcomes}) == 1


def test_async_equals_sync(pool2):
    for refused in pool2.run(run_async):  # seq_to_head, ulysses_attention
        assert all(r[0] == "RuntimeError" and "started with async_op=True and not waited for" in r[1] for r in refused)


def test_projections_start_q_first(pool2):
    pool2.run(run_projections)


def test_projection_errors_on_every_rank(pool2):
    *peers, last = pool2.run(run_projection_errors)
    assert last["shape"][0] == "ValueError" and "k, v: expected the batch and sequence dims" in last["shape"][1]
    for o in peers:
        assert o["shape"][0] == "PeerInputError" and f"rank {len(peers)} rejected its arguments" in o["shape"][1], o
    for o in (*peers, last):
        assert o["raises"] == ("RuntimeError", "projection failed"), o


@pytest.mark.parametrize("world_size, heads_q, heads_kv, layout", [(2, 4, 1, "sbhd"), (3, 3, 3, "bshd"),
                                                                   (4, 8, 2, "bshd")])
def test_simulated_projections_equal_tensors(world_size, heads_q, heads_kv, layout):
    """Simulated ranks, k and v as callables (q's exchange first) against k and v as tensors, GQA
    (kv heads replicated or split) and both layouts: forward and gradients bit for bit."""
    W = world_size
    bufs = a2a.UlyssesBuffers.simulated(W, MAX_BYTES, device="cpu")
    full = [_full(190 + i, (4 * W, 2, h, 3)) for i, h in enumerate((heads_q, heads_kv, heads_kv))]
    seq = 0 if layout == "sbhd" else 1

    def body(rank, b, projected):
        q, k, v = (_shard(t if seq == 0 else t.transpose(0, 1), seq, rank, W).clone().requires_grad_() for t in full)
        kv = (lambda: k * 1, lambda: v * 1) if projected else (k, v)
        out = a2a.ulysses_attention(q, *kv, layout=layout, is_causal=True, buffers=b)
        return out.detach(), torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    for (out, grads), (ref, ref_grads) in zip(run_simulated(lambda r, b: body(r, b, True), bufs),
                                              run_simulated(lambda r, b: body(r, b, False), bufs)):
        assert torch.equal(out, ref) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


def test_projections_checkpointed(pool2):
    for counts in pool2.run(run_projections_checkpointed):
        for pg in (False, True):
            assert counts[(pg, "sac")] == counts[(pg, "plain")] == 6, counts
            assert counts[(pg, "full")] == 8, counts  # the recompute re-ran the forward's q and k / v exchanges


def test_projection_change_on_one_rank_raises_on_every_rank(pool2):
    for (kind, message), collectives in pool2.run(run_projection_change):
        assert kind == "GroupMismatchError" and "disagree on ulysses_attention arguments" in message, message
        assert "v (1, 2, 4, 5)" in message and "v (1, 2, 4, 3)" in message, message
        assert collectives == {"all_to_all_single": 2, "all_gather_object": 1}, collectives


def test_compiled_one_node_per_exchange(pool2):
    counts = pool2.run(run_compiled)
    # forward: q/k/v + x seq_to_head (2), o + y head_to_seq (2); backward: each the other
    assert counts[0] == [2, 2, 2, 2]


def test_opcheck(pool2):
    pool2.run(run_opcheck)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_simulated_peers_match_reference(world_size):
    """Simulated ranks (threads, one process): seq_to_head against the gathered reference, its
    round trip and gradient, on uneven heads."""
    W, heads = world_size, 2 * world_size - 1
    bufs = a2a.UlyssesBuffers.simulated(W, MAX_BYTES, device="cpu")
    full = _full(120, (2, 2 * W, heads, 3))

    def body(rank, b):
        x = _shard(full, 1, rank, W).clone().requires_grad_()
        y = a2a.seq_to_head(x, buffers=b)
        z = a2a.head_to_seq(y * 3, num_heads=heads, buffers=b)
        (grad,) = torch.autograd.grad(z, x, torch.ones_like(z))
        return y.detach(), z.detach(), grad

    for rank, (y, z, grad) in enumerate(run_simulated(body, bufs)):
        assert torch.equal(y, _shard(full, 2, rank, W))
        assert torch.equal(z, 3 * _shard(full, 1, rank, W))
        assert torch.equal(grad, torch.full_like(grad, 3.0))


@settings(max_examples=40, deadline=None)
@given(W=st.integers(2, 3), B=st.integers(1, 2), s=st.integers(1, 3), heads=st.integers(1, 7), D=st.integers(1, 5),
       head_first=st.booleans(), block_r=st.sampled_from([1, 2, 4]), block_q=st.sampled_from([2, 4, 16]),
       num_sms=st.sampled_from([None, 1, 2, 5]))
def test_tiles_smaller_than_a_piece(W, B, s, heads, D, head_first, block_r, block_q, num_sms):
    """Simulated ranks with tiles that split rows and pieces (the post's programs skip this rank's
    piece; programs under an SM budget stride over several tiles), both dim orders (the split dim
    before or after the cat dim), uneven heads: both directions against the shards."""
    shape, seq_dim, head_dim = ((B, heads, s * W, D), 2, 1) if head_first else ((B, s * W, heads, D), 1, 2)
    full = _full(B * 100 + heads * 10 + D, shape)
    bufs = a2a.UlyssesBuffers.simulated(W, MAX_BYTES, device="cpu", num_sms=num_sms)

    def body(rank, b):
        x = _shard(full, seq_dim, rank, W).contiguous()
        y = a2a.seq_to_head(x, seq_dim=seq_dim, head_dim=head_dim, buffers=b)
        return y, a2a.head_to_seq(y, seq_dim=seq_dim, head_dim=head_dim, num_heads=heads, buffers=b)

    tiles = RowBlocks(block_r, block_q, 1)
    with mock.patch.object(seq_exchange, "row_blocks", lambda *args: tiles):
        results = run_simulated(body, bufs)
    for rank, (y, z) in enumerate(results):
        assert torch.equal(y, _shard(full, head_dim, rank, W))
        assert torch.equal(z, _shard(full, seq_dim, rank, W))


def test_more_rows_than_the_kernels_count_raise_on_every_rank():
    """The kernels count rows in int32 (``seq_exchange._MAX_ROWS``, here lowered to 3): a tensor
    with more is a ValueError on every rank before any launch, and the buffers stay in step."""
    W = 2
    bufs = a2a.UlyssesBuffers.simulated(W, MAX_BYTES, device="cpu")
    x = _full(130, (1, 4, 2, 2))  # 4 rows (B * s) before the heads dim
    errors = []

    def body(rank, b):
        try:
            a2a.seq_to_head(x, buffers=b)
        except ValueError as exc:
            errors.append(str(exc))

    with mock.patch.object(seq_exchange, "_MAX_ROWS", 3):
        run_simulated(body, bufs)
    assert len(errors) == W and all("has 4 rows" in e and "at most 3" in e for e in errors), errors
    y = run_simulated(lambda r, b: a2a.seq_to_head(x, buffers=b), bufs)  # in step
    assert all(torch.equal(y[r], torch.cat([x, x], 1).narrow(2, r, 1)) for r in range(W))


def test_more_tensors_than_a_launch_takes():
    """Five tensors of other shapes in one exchange (launches of kernels.seq_exchange.MAX_TENSORS
    and the rest) against each one's own exchange, both directions, uneven heads."""
    W = 2
    bufs = a2a.UlyssesBuffers.simulated(W, MAX_BYTES, device="cpu")
    fulls = [_full(160 + i, (2, 2 * W, 2 * W + i, 2 + i)) for i in range(5)]

    def body(rank, b):
        xs = [_shard(t, 1, rank, W).contiguous() for t in fulls]
        together = symm_seq_to_head_op(xs, b, 1, 2, [], False)
        alone = [symm_seq_to_head_op([x], b, 1, 2, [], False)[0] for x in xs]
        back = symm_head_to_seq_op(together, b, 1, 2, [t.shape[2] for t in fulls], [], False)
        return together, alone, back, xs

    for rank, (together, alone, back, xs) in enumerate(run_simulated(body, bufs)):
        for t, a, full, z, x in zip(together, alone, fulls, back, xs):
            assert torch.equal(t, a) and torch.equal(t, _shard(full, 2, rank, W)) and torch.equal(z, x)


def test_simulated_ranks_name_a_disagreement():
    """Simulated ranks have no process group: the headers' difference is named through the
    buffers' own host channel, on every rank."""
    bufs = a2a.UlyssesBuffers.simulated(2, MAX_BYTES, device="cpu")
    xs = [_full(121 + r, (1, 2 + 2 * r, 4, 3)) for r in range(2)]
    errors = simulated_errors(lambda r, b: a2a.seq_to_head(xs[r], buffers=b), bufs)
    assert [e[0] for e in errors] == ["GroupMismatchError"] * 2, errors
    assert all("(symm_mem, rank" in e[1] and "disagree on shape: rank 0 has (1, 2, 4, 3), rank 1 has (1, 4, 4, 3)"
               in e[1] for e in errors), errors


def test_simulated_rank_that_never_arrives_is_a_timeout():
    """A simulated rank that skips an exchange: its peers' barrier runs out and the rank whose wait
    ran out raises CollectiveTimeout naming it, as a real rank's would (not the thread barrier's
    BrokenBarrierError, which the ranks waiting with it see), and run_simulated reports that one."""
    x = _full(124, (1, 2, 2, 2))
    bufs = a2a.UlyssesBuffers.simulated(2, MAX_BYTES, device="cpu", timeout=0.5)
    errors = simulated_errors(lambda r, b: a2a.seq_to_head(x, buffers=b) if r == 0 else None, bufs)
    assert errors[1] is None and errors[0][0] == "CollectiveTimeout", errors
    assert "simulated rank 0 of 2): timed out after" in errors[0][1] and "timeout (0.5 s)" in errors[0][1], errors
    bufs = a2a.UlyssesBuffers.simulated(3, MAX_BYTES, device="cpu", timeout=0.5)
    with pytest.raises(RuntimeError, match=r"simulated rank \d raised CollectiveTimeout: .* timed out after"):
        run_simulated(lambda r, b: a2a.seq_to_head(x, buffers=b) if r != 2 else None, bufs)


def test_simulated_rank_that_rejects_its_arguments_tells_its_peers():
    """A rank whose own check fails posts a header that says so: its peers raise PeerInputError
    with its message at once (a wait until the 30 s deadline would be a CollectiveTimeout); the
    buffers stay in step."""
    bufs = a2a.UlyssesBuffers.simulated(3, MAX_BYTES, device="cpu", timeout=30.0)
    x, wide = _full(122, (1, 3, 1, 2)), _full(123, (1, 3, 2, 2))
    errors = simulated_errors(lambda r, b: a2a.head_to_seq(wide if r == 1 else x, num_heads=3, buffers=b), bufs)
    assert errors[1][0] == "ValueError" and "x: expected rank 1's share" in errors[1][1], errors
    for r in (0, 2):
        assert errors[r][0] == "PeerInputError" and f"rank 1 rejected its arguments: ValueError: {errors[1][1]}" \
            in errors[r][1], errors[r]
    outs = run_simulated(lambda r, b: a2a.head_to_seq(x, num_heads=3, buffers=b), bufs)
    for r, out in enumerate(outs):  # rank r: position r of every rank's one head
        assert torch.equal(out, x[:, r:r + 1].expand(1, 1, 3, 2)), r


def test_bytes_for_fits_attention():
    need = a2a.UlyssesBuffers.bytes_for([(2, 8, 5, 64)] * 3, torch.bfloat16, 2)
    assert need == 3 * 2 * 8 * 6 * 64 * 2  # 5 heads padded to 6 (the backward's 3 heads a rank, twice)
    with pytest.raises(ValueError, match="max_bytes"):
        a2a.UlyssesBuffers(0)


def test_one_rank_is_a_copy():
    bufs = a2a.UlyssesBuffers(MAX_BYTES, group=NO_GROUP, device="cpu")
    x = _full(130, (2, 4, 3, 2))
    y = a2a.seq_to_head(x, buffers=bufs)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    with pytest.raises(ValueError, match="x: the buffers are on cpu"):
        a2a.seq_to_head(x.to("meta"), buffers=bufs)


def test_simulated_attention_phase_by_phase():
    """testing.simulated_ulysses_attention (what the GPU tests and benchmark run on simulated ranks)
    against dense attention, GQA."""
    W, B, S, D = 2, 2, 8, 3
    q, k, v = (_full(140 + i, (B, S, h, D)) for i, h in enumerate((4, 2, 2)))
    upstream = _full(143, (B, S, 4, D))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _dense_gqa(*full, causal_window=S)
    ref_grads = torch.autograd.grad(ref, full, upstream)
    bufs = a2a.UlyssesBuffers.simulated(W, MAX_BYTES, device="cpu")
    local = [[_shard(t, 1, r, W).contiguous() for t in (q, k, v)] for r in range(W)]
    results = simulated_ulysses_attention(bufs, local, [_shard(upstream, 1, r, W).contiguous() for r in range(W)])
    for rank, (out, grads) in enumerate(results):
        torch.testing.assert_close(out, _shard(ref, 1, rank, W), rtol=1e-12, atol=1e-12)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, _shard(r, 1, rank, W), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_written_are_the_design_floor(world_size):
    """A q/k/v exchange writes (W - 1) / W of every rank's bytes into its stage (all but its own
    piece) and each output once: 1.5x the payload at W = 2, 1.75x at W = 4 (kernels counted in
    Triton's interpreter), plus the headers: one written per rank (with the gather's flag), W read
    back per gather (q, k and v in one post and one gather launch)."""
    W = world_size
    bufs = a2a.UlyssesBuffers.simulated(W, MAX_BYTES, device="cpu")
    xs = [[_full(150 + 3 * r + i, (2, 3, 2 * W, 4)) for i in range(3)] for r in range(W)]
    payload = sum(t.numel() * t.element_size() for ts in xs for t in ts)
    with bytes_written() as written:
        run_simulated(lambda r, b: symm_seq_to_head_op(xs[r], b, 1, 2, [], False), bufs)
    header = 64
    assert written["_post_kernel"] == payload * (W - 1) // W + W * (header + 4)  # (and the gather's int32 flag)
    assert written["_gather_kernel"] == payload + W * W * header
