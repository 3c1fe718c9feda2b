"""Ulysses sequence parallelism: seq_to_head / head_to_seq against a gathered reference (exact,
fp64, forward and gradients), ulysses_attention against full attention, errors, torch.compile;
heads split evenly and unevenly (W not dividing them; W = 3 on a sub-group of the 4-rank pool).

Every rank builds the same full tensors from one seed and checks its own shard; the ops only
move elements, so their results and gradients must match bit for bit."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expecttest import TestCase
from hypothesis import given, settings
from hypothesis import strategies as st

import alltoall_ops as a2a
from alltoall_ops.groups import LOCAL
from alltoall_ops.inspect import compiled_graphs
from alltoall_ops.testing import HostTraffic, debug_mode
from alltoall_ops.ulysses import attention_args

OPS = torch.ops.alltoall_ops


def _full(seed: int, shape, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def _shard(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s chunk of ``t`` along ``dim``: equal chunks when world_size divides the size,
    else DeepSpeed's uneven split (one more on each of the first size % world_size ranks)."""
    base, extra = divmod(t.shape[dim], world_size)
    return t.narrow(dim, rank * base + min(rank, extra), base + (rank < extra))


_SUBGROUPS: dict = {}


def run_on_three_of_four(rank, world_size, fn, *args):
    """``fn(group rank, 3, *args, group=)`` on the sub-group of global ranks 1, 2, 3 of a pool of 4
    (W = 3, group ranks not the global ones; every rank creates it, once); None on rank 0."""
    if "three" not in _SUBGROUPS:
        _SUBGROUPS["three"] = dist.new_group([1, 2, 3])
    pg = _SUBGROUPS["three"]
    return None if rank == 0 else fn(pg.rank(), pg.size(), *args, group=pg)


# --------------------------------------------------------------------------------------------
# Rank functions (module level: they travel to the spawned ranks by reference)


def _check_exchange(rank, world_size, full_shape, seq_dim, head_dim, seed, group=None, transpose=False):
    """seq_to_head and head_to_seq of shards of one full tensor, forward and gradient, exact.

    full_shape: the gathered (full sequence, all heads) shape; heads not divisible by W are split
    unevenly (``_shard``), and then head_to_seq takes ``num_heads``. group: None or a ProcessGroup /
    1-D DeviceMesh; its own rank and size are used to pick shards. transpose: feed a
    non-contiguous input (same values)."""
    if group is not None:
        pg = group.get_group() if hasattr(group, "get_group") else group
        rank, world_size = pg.rank(), pg.size()
    full = _full(seed, full_shape)
    upstream = _full(seed + 1, full_shape)
    heads = full_shape[head_dim]
    num_heads = dict(num_heads=heads) if heads % world_size else {}  # needed when uneven only

    def leaf(t):
        if transpose:  # same values, transposed storage
            t = t.transpose(0, -1).contiguous().transpose(0, -1)
        return t.clone().requires_grad_()

    # seq_to_head: this rank's sequence chunk -> full sequence, this rank's heads.
    x = leaf(_shard(full, seq_dim, rank, world_size))
    y = a2a.seq_to_head(x, group, seq_dim=seq_dim, head_dim=head_dim)
    assert torch.equal(y, _shard(full, head_dim, rank, world_size)), "seq_to_head forward"
    (grad_x,) = torch.autograd.grad(y, x, _shard(upstream, head_dim, rank, world_size))
    assert torch.equal(grad_x, _shard(upstream, seq_dim, rank, world_size)), "seq_to_head grad"

    # head_to_seq: this rank's heads of the full sequence -> this rank's chunk, all heads.
    y = leaf(_shard(full, head_dim, rank, world_size))
    x = a2a.head_to_seq(y, group, seq_dim=seq_dim, head_dim=head_dim, **num_heads)
    assert torch.equal(x, _shard(full, seq_dim, rank, world_size)), "head_to_seq forward"
    (grad_y,) = torch.autograd.grad(x, y, _shard(upstream, seq_dim, rank, world_size))
    assert torch.equal(grad_y, _shard(upstream, head_dim, rank, world_size)), "head_to_seq grad"
    return tuple(x.shape)


def run_exchange_cases(rank, world_size):
    W = world_size
    shapes = []
    # (B, S, Hh, D) default layout, then other layouts, ranks and trailing dims.
    shapes.append(_check_exchange(rank, W, (2, 3 * W, 2 * W, 5), 1, 2, seed=1))
    shapes.append(_check_exchange(rank, W, (2, 3 * W, 2 * W, 5), 1, 2, seed=2, transpose=True))
    shapes.append(_check_exchange(rank, W, (3 * W, 2, W, 4, 3), -3, 0, seed=3))  # heads first
    shapes.append(_check_exchange(rank, W, (2 * W, W, 6), 0, 1, seed=4))  # (S, Hh, D)
    shapes.append(_check_exchange(rank, W, (W, 2 * W), 1, 0, seed=5))  # 2-D (Hh, S)
    # Different trailing dims in one model (MLA: q/k head dim != v head dim).
    shapes.append(_check_exchange(rank, W, (1, 2 * W, W, 3), 1, 2, seed=6))
    shapes.append(_check_exchange(rank, W, (1, 2 * W, W, 7), 1, 2, seed=7))
    # Heads not divisible by W (split unevenly), also heads first, and fewer heads than ranks.
    shapes.append(_check_exchange(rank, W, (2, 3 * W, 2 * W + 1, 5), 1, 2, seed=8, transpose=True))
    shapes.append(_check_exchange(rank, W, (2 * W - 1, 2, W, 3), -2, 0, seed=9))
    shapes.append(_check_exchange(rank, W, (1, 2 * W, max(W - 1, 1), 2), 1, 2, seed=10))
    return shapes


def run_exchange_on_groups(rank, world_size):
    """Explicit ProcessGroup, and a 1-D slice of a 2-D DeviceMesh (a sub-group whose ranks are
    not the global ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    _check_exchange(rank, world_size, (2, 2 * world_size, world_size, 3), 1, 2, 10, group=dist.group.WORLD)
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "cp"))
    return _check_exchange(rank, world_size, (2, 3 * world_size, world_size, 3), 1, 2, 11, group=mesh["cp"])


def run_round_trip(rank, world_size, shape, seq_dim, head_dim, seed, group=None):
    """seq -> head -> seq and head -> seq -> head are identities: a sequence chunk of ``shape``
    (any head count Hh), and a head shard of the same Hh (this rank's share, full sequence)."""
    heads, dims = shape[head_dim], dict(seq_dim=seq_dim, head_dim=head_dim)
    num_heads = dict(num_heads=heads) if heads % world_size else {}
    x = _full(seed + rank, shape)
    y = a2a.seq_to_head(x, group, **dims)
    assert torch.equal(a2a.head_to_seq(y, group, **dims, **num_heads), x)
    h = _full(seed + world_size + rank, y.shape)
    z = a2a.head_to_seq(h, group, **dims, **num_heads)
    assert torch.equal(a2a.seq_to_head(z, group, **dims), h)
    # The output is a new tensor, never a view of the input (also at one rank).
    assert all(out.numel() == 0 or out.data_ptr() != inp.data_ptr() for out, inp in ((y, x), (z, h)))
    return tuple(y.shape), tuple(z.shape)


def run_exchange_shape(rank, world_size, full_shape, seq_dim, head_dim, seed):
    return _check_exchange(rank, world_size, full_shape, seq_dim, head_dim, seed)


def _attention_inputs(W, seed, B=2, S_per_rank=3, heads=None, Dqk=4, Dv=3):
    S, H = S_per_rank * W, 2 * W if heads is None else heads
    q, k = _full(seed, (B, S, H, Dqk)), _full(seed + 1, (B, S, H, Dqk))
    v, upstream = _full(seed + 2, (B, S, H, Dv)), _full(seed + 3, (B, S, H, Dv))
    return q, k, v, upstream


def _full_attention(q, k, v, is_causal, scale):
    """Attention on the gathered (B, S, H, D) tensors."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=is_causal, scale=scale
    )
    return out.transpose(1, 2)


def run_attention(rank, world_size, is_causal, scale, seed, heads=None):
    """heads: q, k and v's (default 2 W; not divisible by W: split unevenly)."""
    W = world_size
    q, k, v, upstream = _attention_inputs(W, seed, heads=heads)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _full_attention(*full, is_causal, scale)
    ref_grads = torch.autograd.grad(ref, full, upstream)

    local = [_shard(t, 1, rank, W).clone().requires_grad_() for t in (q, k, v)]
    out = a2a.ulysses_attention(*local, is_causal=is_causal, scale=scale)
    assert out.shape == (2, 3, q.shape[2], 3)
    torch.testing.assert_close(out, _shard(ref, 1, rank, W), rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out, local, _shard(upstream, 1, rank, W))
    for name, g, ref_g in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, _shard(ref_g, 1, rank, W), rtol=1e-12, atol=1e-12, msg=name)
    # Causality is by global position: rank r's first row sees exactly r * S/W + 1 keys, so the
    # masked result differs from the unmasked one whenever the masks differ.
    if is_causal:
        unmasked = _shard(_full_attention(q, k, v, False, scale), 1, rank, W)
        assert not torch.allclose(out.detach(), unmasked)
    return tuple(out.shape)


def _dense_gqa(q, k, v, causal_window=None):
    """Attention over (B, S, Hq, D) with k, v of Hkv heads (each serving Hq / Hkv q heads), in
    fp64; causal_window: None (no mask) or w (key j visible from query i iff i - w < j <= i)."""
    g = q.shape[2] // max(k.shape[2], 1)  # (a rank may hold no heads at all)
    k, v = (t.repeat_interleave(g, dim=2) for t in (k, v))
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / q.shape[-1] ** 0.5
    if causal_window is not None:
        i, j = torch.arange(q.shape[1])[:, None], torch.arange(q.shape[1])[None, :]
        scores = scores.masked_fill(~((j <= i) & (j > i - causal_window)), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v)


def run_attention_variants(rank, world_size, heads_q, heads_kv, layout, windowed, seed, group=None):
    """ulysses_attention with GQA / MQA or uneven heads, a layout, and (windowed) a user attn_fn
    with a sliding-window mask, against the dense computation: forward and gradients, fp64."""
    W, B, S, D = world_size, 2, 2 * world_size, 3
    q, k, v = (_full(seed + i, (B, S, h, D)) for i, h in enumerate((heads_q, heads_kv, heads_kv)))
    upstream = _full(seed + 3, (B, S, heads_q, D))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _dense_gqa(*full, causal_window=2 if windowed else None)
    ref_grads = torch.autograd.grad(ref, full, upstream)
    seen = []

    def windowed_attention(q_, k_, v_):  # called on the full sequence and this rank's heads
        seen.append((tuple(q_.shape), tuple(k_.shape)))
        if layout == "sbhd":
            q_, k_, v_ = (t.transpose(0, 1) for t in (q_, k_, v_))
        out = _dense_gqa(q_, k_, v_, causal_window=2)
        return out.transpose(0, 1) if layout == "sbhd" else out

    to_layout = (lambda t: t.transpose(0, 1)) if layout == "sbhd" else (lambda t: t)
    local = [to_layout(_shard(t, 1, rank, W)).clone().requires_grad_() for t in (q, k, v)]
    out = a2a.ulysses_attention(*local, group=group, layout=layout, attn_fn=windowed_attention if windowed else None)
    torch.testing.assert_close(out, to_layout(_shard(ref, 1, rank, W)), rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out, local, to_layout(_shard(upstream, 1, rank, W)))
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, to_layout(_shard(want, 1, rank, W)), rtol=1e-12, atol=1e-12, msg=name)
    if windowed:  # the user's function saw the full sequence, this rank's q heads and its kv heads
        q_local = _shard(q, 2, rank, W).shape[2]  # this rank's share, uneven when W does not divide Hq
        kv_local = q_local if heads_kv == heads_q else max(heads_kv // W, 1)
        full_seq = (B, S, q_local, D) if layout == "bshd" else (S, B, q_local, D)
        assert seen[0][0] == full_seq and seen[0][1][2] == kv_local, seen
    return tuple(out.shape)


# (Hq, Hkv) per group size: kv heads split (Hkv divisible by W) and replicated (Hkv divides W)
# and uneven heads (Hq == Hkv not divisible by W: split unevenly, with Hq < W some ranks get none)
GQA_HEADS = {1: [(2, 1)], 2: [(4, 2), (4, 1), (2, 2), (3, 3), (1, 1)], 4: [(8, 4), (8, 2), (4, 1), (5, 5), (2, 2)]}


@pytest.mark.parametrize("pool", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("layout, windowed", [("bshd", False), ("sbhd", False), ("bshd", True), ("sbhd", True)])
def test_attention_gqa_layouts_and_attn_fn_match_dense(pool, layout, windowed):
    W = pool.world_size
    for heads_q, heads_kv in GQA_HEADS[W]:
        shapes = pool.run(run_attention_variants, heads_q, heads_kv, layout, windowed, 7 * heads_q + heads_kv)
        assert shapes == [(2, 2, heads_q, 3)] * W  # B = S/W = 2 in both layouts


def attention_errors(rank, world_size):
    W = world_size
    q = torch.zeros(1, 2, 2 * W, 3)
    calls = [
        (a2a.ulysses_attention, (q, torch.zeros(1, 2, 3, 3), torch.zeros(1, 2, 3, 3)), {}),
        (a2a.ulysses_attention, (q, q, q), dict(layout="bhsd")),
        (a2a.ulysses_attention, (q, q[:, :1], q[:, :1]), {}),
        (a2a.ulysses_attention, (q, q, q), dict(is_causal=True, attn_fn=lambda *t: t[0])),
        (a2a.ulysses_attention, (q[:, :, :W + 1], q[:, :, :1], q[:, :, :1]), {}),
    ]
    errors = _errors(calls)
    _check_exchange(rank, W, (1, 2 * W, 2 * W, 2), 1, 2, seed=21)  # nothing was sent: still in step
    return errors


@pytest.mark.parametrize("pool", [2, 4], indirect=True)
def test_attention_errors_on_every_rank(pool):
    W = pool.world_size
    errors = pool.run(attention_errors)
    assert errors[0] == errors[-1]
    messages = [m for _, m in errors[0]]
    assert f"expected kv heads dividing the {2 * W} q heads" in messages[0] and "got 3" in messages[0]
    assert "layout: expected one of ('bshd', 'sbhd'), got 'bhsd'" in messages[1]
    assert "k, v: expected the batch and sequence dims of q" in messages[2]
    assert "with attn_fn, give them to your attn_fn" in messages[3]
    assert f"q: expected heads divisible by the group size {W} with GQA / MQA k, v" in messages[4]


def _errors(fn_args) -> list:
    """(exception type name, message) of each call, which must all raise."""
    got = []
    for fn, args, kwargs in fn_args:
        try:
            fn(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            got.append((type(exc).__name__, str(exc)))
        else:
            got.append(("no error", ""))
    return got


def bad_calls(world_size: int, group_name: str):
    x = torch.zeros(2, 3, 4, 5)
    head_shard = torch.zeros(2, 2 * world_size, 2, 5)
    all_heads = torch.zeros(2, world_size, 2 * world_size + 1, 5)  # every rank's x: all heads, not its share
    odd_seq = torch.zeros(2, 2 * world_size + 1, 2, 5)
    calls = [
        (a2a.seq_to_head, (x,), dict(seq_dim=2, head_dim=2)),
        (a2a.head_to_seq, (x,), dict(seq_dim=1, head_dim=-3)),  # -3 is dim 1
        (a2a.seq_to_head, (x,), dict(seq_dim=4, head_dim=2)),
        (a2a.head_to_seq, (x,), dict(seq_dim=1, head_dim=-5)),
        (a2a.seq_to_head, ([[1.0]],), {}),
        (a2a.seq_to_head, (torch.zeros(5),), dict(seq_dim=0, head_dim=-1)),
        (a2a.ulysses_attention, (x[0], x[0], x[0]), {}),
        (a2a.ulysses_attention, (x, x, x.double()), {}),  # q, k, v move in one exchange: one dtype
        (OPS.seq_to_head, ([x], group_name, 1, 1, [], 0, False), {}),
        (a2a.head_to_seq, (head_shard,), dict(num_heads=2.0)),
        (a2a.head_to_seq, (head_shard,), dict(num_heads=-1)),
    ]
    if world_size > 1:
        n = 2 * world_size + 1
        calls += [
            (a2a.head_to_seq, (all_heads,), dict(num_heads=n)),
            (a2a.head_to_seq, (odd_seq,), {}),
            (OPS.head_to_seq, ([all_heads], group_name, 1, 2, [n], [], 0, False), {}),
            (OPS.head_to_seq, ([odd_seq], group_name, 1, 2, [2 * world_size], [], 0, False), {}),
        ]
    return calls


EXPECTED_ERRORS = [
    ("ValueError", "seq_to_head: seq_dim and head_dim: expected two different dims, both are dim 2"),
    ("ValueError", "head_to_seq: seq_dim and head_dim: expected two different dims, both are dim 1"),
    ("ValueError", "seq_dim: expected a dim in [-4, 4) for a 4-D tensor, got 4"),
    ("ValueError", "head_dim: expected a dim in [-4, 4) for a 4-D tensor, got -5"),
    ("TypeError", "seq_to_head: x: expected a torch.Tensor, got list"),
    ("ValueError", "seq_to_head: x: expected a tensor with a sequence and a head dim (at least 2-D), got shape (5,)"),
    ("ValueError", "ulysses_attention: q: expected a 4-D tensor (B, S/W, Hh, D), got shape (3, 4, 5)"),
    ("ValueError", "ulysses_attention: q, k, v: expected one dtype (they move in one exchange), got torch.float32, "
                   "torch.float32, torch.float64"),
    ("ValueError", "seq_to_head: seq_dim and head_dim: expected two different dims, both are dim 1"),
    ("TypeError", "head_to_seq: num_heads: expected an int (the total head count), got float"),
    ("ValueError", "head_to_seq: num_heads: expected a non-negative int (the total head count), got -1"),
]


def expected_errors(world_size: int, rank: int) -> list:
    if world_size == 1:
        return EXPECTED_ERRORS
    W, n = world_size, 2 * world_size + 1
    counts = [3] + [2] * (W - 1)  # n = 2 W + 1 heads: one more on rank 0
    heads = (
        f"head_to_seq: x: expected rank {rank}'s share of the num_heads={n} heads at dim 2, {counts[rank]} "
        f"(heads per rank {counts} over the group of {W}), got {n} (shape (2, {W}, {n}, 5))"
    )
    seq = (
        f"head_to_seq: x: expected sequence length (dim 1) divisible by the group size {W}, "
        f"got {n} (shape (2, {n}, 2, 5))"
    )
    return EXPECTED_ERRORS + [("ValueError", m) for m in (heads, seq, heads, seq)]


def run_bad_inputs(rank, world_size):
    errors = _errors(bad_calls(world_size, dist.group.WORLD.group_name))
    # Nothing was sent: the group is still in step and the next exchange is right.
    _check_exchange(rank, world_size, (1, 2 * world_size, 2 * world_size, 2), 1, 2, seed=20)
    return errors


def run_uneven_head_errors(rank, world_size):
    """head_to_seq with heads split unevenly (2 W + 1: one more on rank 0) and a rank's x that is
    not its share, or without num_heads: in debug mode every rank raises before anything is sent
    (by default the first raises on the bad rank only, and the second sends pieces of other sizes)."""
    W, n = world_size, 2 * world_size + 1
    share = _shard(torch.zeros(1, 2 * W, n, 2), 2, rank, W)
    with debug_mode():
        errors = _errors([
            (a2a.head_to_seq, (torch.zeros(1, 2 * W, 3, 2),), dict(num_heads=n)),  # rank 0's share: wrong elsewhere
            (a2a.head_to_seq, (share,), {}),  # no num_heads: each rank takes W times its own heads
        ])
    _check_exchange(rank, W, (1, 2 * W, n, 2), 1, 2, seed=22)  # nothing was sent: still in step
    return errors


def run_uneven_on_three_ranks(rank, world_size, group):
    """Heads split unevenly over W = 3 (5, 7; 2 and 1: ranks with no heads): exchange against the
    gathered reference, round trips, and ulysses_attention against dense attention."""
    shapes = []
    for i, heads in enumerate((5, 7, 2, 1)):
        shapes.append(_check_exchange(rank, world_size, (2, 2 * world_size, heads, 3), 1, 2, 200 + i, group=group))
        run_round_trip(rank, world_size, (2, 2, heads, 3), 1, 2, 210 + i, group=group)
    for heads, layout, windowed in ((5, "bshd", False), (7, "sbhd", True), (2, "bshd", True)):
        run_attention_variants(rank, world_size, heads, heads, layout, windowed, 220 + heads, group=group)
    return shapes


def run_opcheck_uneven(rank, world_size):
    """opcheck of both ops on a group with heads split unevenly (fake impls with rank-dependent
    output shapes, autograd, aot_dispatch)."""
    group_name, n = dist.group.WORLD.group_name, 2 * world_size + 1
    x = _full(140 + rank, (2, 3, n, 4)).requires_grad_()
    torch.library.opcheck(OPS.seq_to_head.default, ([x, x.detach()[..., :2].clone().requires_grad_()], group_name,
                                                    1, 2, [], 0, False))
    h = _shard(_full(150, (2, 2 * world_size, n, 4)), 2, rank, world_size).clone().requires_grad_()
    torch.library.opcheck(OPS.head_to_seq.default, ([h, h.detach()[..., :2].clone().requires_grad_()], group_name,
                                                    1, 2, [n, n], [], 0, False))


def _op_pipeline(x, v):
    """Two round trips through both ops, with compute in between."""
    y = a2a.seq_to_head(x) * 2.0
    w = a2a.seq_to_head(v, seq_dim=-3, head_dim=-2)
    return a2a.head_to_seq(y.sin() + w.sum(-1, keepdim=True), num_heads=x.shape[2])


def _attention(q, k, v):
    return a2a.ulysses_attention(q, k, v, is_causal=True)


def _compile_and_compare(fn, inputs, upstream, exact):
    eager_in = [t.clone().requires_grad_() for t in inputs]
    eager_out = fn(*eager_in)
    eager_grads = torch.autograd.grad(eager_out, eager_in, upstream)

    compiled_in = [t.clone().requires_grad_() for t in inputs]
    box = {}

    def capture(*args):
        box["out"] = fn(*args)
        return box["out"]

    graphs = compiled_graphs(capture, *compiled_in, loss=lambda out: (out * upstream).sum())
    assert graphs.graph_breaks == 0
    compiled_grads = [t.grad for t in compiled_in]
    check = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-12, atol=1e-12))
    assert check(box["out"].detach(), eager_out.detach()), "compiled forward != eager"
    for g, ref in zip(compiled_grads, eager_grads):
        assert check(g, ref), "compiled gradient != eager"
    return graphs.summary()


def run_compiled(rank, world_size, heads=None):
    """heads: of every tensor (default 2 W; not divisible by W: split unevenly, so each rank's
    graphs have their own shapes)."""
    W, H = world_size, 2 * world_size if heads is None else heads
    torch._dynamo.reset()
    x = _full(30 + rank, (2, 3, H, 4))
    v = _full(40 + rank, (2, 3, H, 5))
    upstream = _full(50 + rank, (2, 3, H, 4))
    ops_summary = _compile_and_compare(_op_pipeline, [x, v], upstream, exact=True)
    q, k, v, _ = _attention_inputs(W, seed=60 + rank, heads=H)
    qkv = [_shard(t, 1, rank, W) for t in (q, k, v)]
    upstream = _full(70 + rank, (2, 3, H, 3))
    attention_summary = _compile_and_compare(_attention, qkv, upstream, exact=False)
    # on a group the forward exchanges carry ulysses_attention's arguments (is_causal=True, shapes as passed)
    args = f"attention={attention_args(*qkv, 'bshd', True, None, None)}"
    return ops_summary, attention_summary.replace(args, "attention=<args>") if W > 1 else attention_summary


def run_cache_key_ranks(rank, world_size):
    """The rank parts of this process's compile-cache tag (``_cache_key.key_on_rank``)."""
    import torch.compiler.config as cconfig

    return [p for p in cconfig.cache_key_tag.split("|") if p.startswith("rank=")]


# --------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("pool", [1, 2, 4], indirect=True)
def test_exchange_matches_gathered_reference(pool):
    W = pool.world_size
    shapes = pool.run(run_exchange_cases)
    # head_to_seq of the first case returns this rank's (B, S/W, Hh, D) chunk on every rank.
    assert [s[0] for s in shapes] == [(2, 3, 2 * W, 5)] * W


def test_exchange_on_explicit_group_and_mesh(pool4):
    # mesh["cp"] has 2 ranks: head_to_seq returns (B, S/2, Hh, D) with S = 12.
    assert pool4.run(run_exchange_on_groups) == [(2, 6, 4, 3)] * 4


@pytest.mark.parametrize("pool", [1, 2, 4], indirect=True)
def test_round_trip_is_identity(pool):
    W = pool.world_size
    shapes = pool.run(run_round_trip, (2, 2 * W, 3 * W, 3), 1, 2, 80)
    assert shapes == [((2, 2 * W * W, 3, 3), (2, 2 * W, 3 * W, 3))] * W
    # 2 W + 1 heads: split unevenly (one more on rank 0) when W > 1.
    shares = [3] if W == 1 else [3] + [2] * (W - 1)
    shapes = pool.run(run_round_trip, (2, 2, 2 * W + 1, 3), 1, 2, 85)
    assert shapes == [((2, 2 * W, shares[r], 3), (2, 2, 2 * W + 1, 3)) for r in range(W)]


def test_uneven_heads_on_three_ranks(pool4):
    results = pool4.run(run_on_three_of_four, run_uneven_on_three_ranks)
    assert results[0] is None  # not in the group
    assert results[1:] == [[(2, 2, heads, 3) for heads in (5, 7, 2, 1)]] * 3


def test_uneven_head_errors_on_every_rank(pool2):
    (wrong_share, rank0_missing), (rank1_error, rank1_missing) = pool2.run(run_uneven_head_errors)
    message = ("head_to_seq: x: expected rank 1's share of the num_heads=5 heads at dim 2, 2 (heads per rank "
               "[3, 2] over the group of 2), got 3 (shape (1, 4, 3, 2))")
    assert rank1_error == ("ValueError", message)
    assert wrong_share[0] == "PeerInputError" and "rank 1 rejected its arguments" in wrong_share[1]
    assert message in wrong_share[1]
    for kind, text in (rank0_missing, rank1_missing):
        assert kind == "GroupMismatchError", text
        assert "disagree on shape: rank 0 has (1, 4, 6, 2), rank 1 has (1, 4, 4, 2)" in text, text
        assert "every rank must pass num_heads=" in text, text


# --------------------------------------------------------------------------------------------
# The checks without a host sync: the header in every piece, on real ranks


def run_traffic(rank, world_size, backend, debug):
    """Host reads and collectives of one ulysses_attention forward + backward, eager (backend
    None) or compiled (fullgraph), after a warm-up call, and its all-to-alls by the dtype of their
    buffers (uint8: pieces of headers and payload); the result checked against dense attention."""
    W = world_size
    torch._dynamo.reset()
    q, k, v, upstream = _attention_inputs(W, seed=300)
    ref = _shard(_full_attention(q, k, v, True, None), 1, rank, W)
    local = [_shard(t, 1, rank, W).clone().requires_grad_() for t in (q, k, v)]
    fn = _attention if backend is None else torch.compile(_attention, backend=backend, fullgraph=True)
    carried = collections.Counter()
    all_to_all_single = dist.all_to_all_single

    def counted(out, *args, **kwargs):
        carried[str(out.dtype)] += 1
        return all_to_all_single(out, *args, **kwargs)

    with debug_mode(debug):
        fn(*local).sum().backward()  # warm-up (compilation)
        dist.all_to_all_single = counted
        try:
            with HostTraffic() as traffic:
                out = fn(*local)
                out.backward(_shard(upstream, 1, rank, W))
        finally:
            dist.all_to_all_single = all_to_all_single
    torch.testing.assert_close(out.detach(), ref, rtol=1e-12, atol=1e-12)
    return traffic.reads, dict(traffic.collectives), dict(carried)


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_attention_reads_nothing_and_moves_only_its_all_to_alls(pool2, backend):
    # q, k, v in one seq_to_head and o in one head_to_seq forward, their adjoints backward: 4
    # all-to-alls (DeepSpeed's DistributedAttention makes 8), each with the headers in its pieces;
    # no exchange of headers alone once the warm-up call agreed on q, k, v's sizes
    assert pool2.run(run_traffic, backend, False) == [(0, {"all_to_all_single": 4}, {"torch.uint8": 4})] * 2


def test_debug_mode_adds_an_agreement_per_exchange(pool2):
    assert pool2.run(run_traffic, None, True) == [
        (4, {"all_gather": 4, "all_to_all_single": 4}, {"torch.uint8": 4})] * 2


def _gqa_qkv(rank, heads_q, heads_kv, S_per_rank=2, D=3):
    return [_full(400 + rank + i, (1, S_per_rank, h, D)) for i, h in enumerate((heads_q, heads_kv, heads_kv))]


def _disagreement(case: str, rank: int, world_size: int):
    """Ranks whose own arguments are right, but not alike (the bytes they send have the sizes their
    peers expect, except where noted)."""
    last = rank == world_size - 1
    if case == "mqa_vs_mha":  # k, v: 1 head (repeated to W = 2 for the exchange) on rank 0, 2 on rank 1
        a2a.ulysses_attention(*_gqa_qkv(rank, 2, 1 if rank == 0 else 2))
    elif case == "gqa_2_vs_4":  # W = 4: 2 kv heads (repeated to 4) on ranks 0-2, 4 on rank 3
        a2a.ulysses_attention(*_gqa_qkv(rank, 8, 4 if rank == 3 else 2))
    elif case == "mqa_vs_mha_sizes":  # 1 kv head (repeated to 2) vs 4: k's pieces differ in size, q's do not
        a2a.ulysses_attention(*_gqa_qkv(rank, 4, 1 if rank == 0 else 4))
    elif case == "is_causal":
        a2a.ulysses_attention(*_gqa_qkv(rank, 2, 2), is_causal=rank == 1)
    elif case == "scale":
        a2a.ulysses_attention(*_gqa_qkv(rank, 2, 2), scale=0.5 if rank == 1 else None)
    elif case == "dtype":  # the same bytes, another meaning
        a2a.seq_to_head(torch.zeros(1, 2, 2, 2, dtype=torch.float16 if rank == 0 else torch.bfloat16))
    elif case == "shape":  # the same number of elements
        a2a.seq_to_head(torch.zeros((2, 2, 2, 3) if rank == 0 else (3, 2, 2, 2)))
    elif case == "sequence":  # pieces of other sizes from here on (the last rank's differ)
        a2a.seq_to_head(torch.zeros(1, 3 if last else 2, 4, 2))
    elif case == "heads":
        a2a.seq_to_head(torch.zeros(1, 2, 8 if last else 4, 2))
    elif case == "head_size":
        a2a.seq_to_head(torch.zeros(1, 2, 4, 3 if last else 2))
    elif case == "dtype_size":
        a2a.seq_to_head(torch.zeros(1, 2, 4, 2, dtype=torch.float64 if last else torch.float32))
    elif case == "num_heads":  # 5 heads over W = 2 (3 and 2) without num_heads: each takes W times its own
        a2a.head_to_seq(torch.zeros(1, 4, 3 - rank, 2))
    elif case == "v_head_size":
        q, k, v = _gqa_qkv(rank, 4, 4)
        a2a.ulysses_attention(q, k, torch.zeros(1, 2, 4, 5 if last else 3, dtype=q.dtype))
    elif case == "out_of_step":  # pieces of 4 elements both ways
        if rank == 0:
            a2a.seq_to_head(torch.zeros(1, 2, 2, 2))
        else:
            a2a.head_to_seq(torch.zeros(1, 4, 1, 2))


def _outcome(call, *args) -> tuple[str, str]:
    """("returned", "") or the ValueError's (type name, message) of ``call(*args)`` on this rank."""
    try:
        call(*args)
    except ValueError as exc:
        return type(exc).__name__, str(exc)
    return "returned", ""


def run_disagreement(rank, world_size, case, debug):
    with debug_mode(debug):
        got = _outcome(_disagreement, case, rank, world_size)
    _check_exchange(rank, world_size, (1, 2 * world_size, 2 * world_size, 2), 1, 2, seed=23)  # still in step
    return got


def _ulysses_args(q, k, v, is_causal=False, scale=None):
    return (f"q {q}, k {k}, v {v} (layout 'bshd', is_causal={is_causal}, scale={scale}, attn_fn None)")


@pytest.mark.parametrize("debug", [False, True])
def test_disagreements_raise_on_every_rank(pool2, pool4, debug):
    """Every rank raises the same GroupMismatchError, naming the field and every rank's value; on
    main the first two (k, v heads compared after the GQA repetition) and is_causal / scale
    returned outputs of the right shape."""
    q = (1, 2, 2, 3)
    cases = {
        "mqa_vs_mha": ("ulysses_attention arguments", [_ulysses_args(q, (1, 2, h, 3), (1, 2, h, 3)) for h in (1, 2)]),
        "mqa_vs_mha_sizes": ("ulysses_attention arguments",
                             [_ulysses_args((1, 2, 4, 3), (1, 2, h, 3), (1, 2, h, 3)) for h in (1, 4)]),
        "is_causal": ("ulysses_attention arguments", [_ulysses_args(q, q, q, is_causal=c) for c in (False, True)]),
        "scale": ("ulysses_attention arguments", [_ulysses_args(q, q, q, scale=s) for s in (None, 0.5)]),
        "dtype": ("dtype", ["torch.float16", "torch.bfloat16"]),
        "shape": ("shape", ["(2, 2, 2, 3)", "(3, 2, 2, 2)"]),
    }
    for case, (field, values) in cases.items():
        errors = pool2.run(run_disagreement, case, debug)
        listed = ", ".join(f"rank {r} has {value}" for r, value in enumerate(values))
        for kind, message in errors:
            assert kind == "GroupMismatchError", (case, kind, message)
            assert f"the ranks disagree on {field}: {listed}; every rank must pass the same" in message, (case, message)
        assert errors[0][1].replace("rank 0 of", "rank 1 of") == errors[1][1], case  # the same text on each rank
    errors = pool4.run(run_disagreement, "gqa_2_vs_4", debug)
    kv = [(1, 2, 4 if r == 3 else 2, 3) for r in range(4)]
    listed = ", ".join(f"rank {r} has {_ulysses_args((1, 2, 8, 3), h, h)}" for r, h in enumerate(kv))
    assert all(kind == "GroupMismatchError" and listed in message for kind, message in errors), errors


def test_pieces_of_other_sizes_raise_on_every_rank(pool2, pool4):
    """The headers travel first, in pieces of the group's last agreed sizes: ranks whose pieces
    differ in size raise on every rank, by default (before headers, gloo aborted the receiving
    process)."""
    def shapes(small, large, world_size):
        return [large if r == world_size - 1 else small for r in range(world_size)]

    for pool, W in ((pool2, 2), (pool4, 4)):
        cases = {
            "sequence": ("shape", shapes("(1, 2, 4, 2)", "(1, 3, 4, 2)", W)),
            "heads": ("shape", shapes("(1, 2, 4, 2)", "(1, 2, 8, 2)", W)),
            "head_size": ("shape", shapes("(1, 2, 4, 2)", "(1, 2, 4, 3)", W)),
            "dtype_size": ("dtype", shapes("torch.float32", "torch.float64", W)),
            "v_head_size": ("ulysses_attention arguments",
                            [_ulysses_args((1, 2, 4, 3), (1, 2, 4, 3), v)
                             for v in shapes((1, 2, 4, 3), (1, 2, 4, 5), W)]),
        }
        if W == 2:
            cases["num_heads"] = ("shape", ["(1, 4, 6, 2)", "(1, 4, 4, 2)"])
        for case, (field, values) in cases.items():
            errors = pool.run(run_disagreement, case, False)
            listed = ", ".join(f"rank {r} has {value}" for r, value in enumerate(values))
            for kind, message in errors:
                assert kind == "GroupMismatchError", (case, kind, message)
                assert f"the ranks disagree on {field}: {listed}; every rank must pass the same" in message, message


def test_out_of_step_raises_on_every_rank(pool2):
    (kind0, message0), (kind1, message1) = pool2.run(run_disagreement, "out_of_step", False)
    assert kind0 == kind1 == "GroupMismatchError"
    for message in (message0, message1):
        assert "the ranks are out of step: rank 0 is in seq_to_head (exchange " in message, message
        assert "rank 1 is in head_to_seq (exchange " in message, message


def _later_call(case: str, rank: int, world_size: int) -> None:
    """After an exchange every rank agreed on (``_agreed`` holds its sizes), a call whose pieces
    have other sizes or meaning on the last rank, or on every rank alike (``"all"``)."""
    W, last = world_size, rank == world_size - 1
    shape, dtype = [1, 2, 2 * W, 2], torch.float32
    if case == "all":
        shape[1] = 4
    elif case == "longer":  # its pieces are larger than its peers post (gloo would terminate them)
        shape[1] = 3 if last else 2
    elif case == "shorter":  # its pieces are shorter (gloo would leave the rest of theirs unwritten)
        shape[1] = 1 if last else 2
    elif case == "heads":
        shape[2] = 4 * W if last else 2 * W
    elif case == "dtype":
        dtype = torch.float64 if last else torch.float32
    elif case == "same_bytes":  # another shape of the same size
        shape = [2, 1, 2 * W, 2] if last else shape
    elif case == "attention":
        q = torch.zeros(1, 3 if last else 2, 2 * W, 3)
        a2a.ulysses_attention(q, q, q)
        return
    a2a.seq_to_head(torch.zeros(shape, dtype=dtype))


def run_later_change(rank, world_size, case):
    """``case`` after an agreed exchange (or attention): (error type, message) and the
    collectives of the call; then still in step."""
    agreed = torch.zeros(1, 2, 2 * world_size, 2 if case != "attention" else 3)
    if case == "attention":
        a2a.ulysses_attention(agreed, agreed, agreed)
    else:
        a2a.seq_to_head(agreed)
    with HostTraffic() as traffic:
        got = _outcome(_later_call, case, rank, world_size)
    _check_exchange(rank, world_size, (1, 2 * world_size, 2 * world_size, 2), 1, 2, seed=26)  # still in step
    return got, dict(traffic.collectives)


def test_a_later_change_on_one_rank_raises_on_every_rank(pool2, pool4):
    """No exchange of headers alone once the sizes were agreed: every rank posts the agreed sizes,
    the header in each piece. A rank whose call has other sizes or meaning sends its header in
    pieces of those sizes: GroupMismatchError on every rank, by name, after one all-to-all (and
    the gather of every rank's value for the message); the group stays in step."""
    for pool in (pool2, pool4):
        W = pool.world_size

        def values(agreed, changed, W=W):
            return ", ".join(f"rank {r} has {changed if r == W - 1 else agreed}" for r in range(W))

        cases = {
            "longer": ("shape", values(f"(1, 2, {2 * W}, 2)", f"(1, 3, {2 * W}, 2)")),
            "shorter": ("shape", values(f"(1, 2, {2 * W}, 2)", f"(1, 1, {2 * W}, 2)")),
            "heads": ("shape", values(f"(1, 2, {2 * W}, 2)", f"(1, 2, {4 * W}, 2)")),
            "dtype": ("dtype", values("torch.float32", "torch.float64")),
            "same_bytes": ("shape", values(f"(1, 2, {2 * W}, 2)", f"(2, 1, {2 * W}, 2)")),
            "attention": ("ulysses_attention arguments",
                          values(*(_ulysses_args(*[(1, s, 2 * W, 3)] * 3) for s in (2, 3)))),
        }
        for case, (field, listed) in cases.items():
            for (kind, message), collectives in pool.run(run_later_change, case):
                assert kind == "GroupMismatchError", (case, kind, message)
                assert f"the ranks disagree on {field}: {listed}; every rank must pass the same" in message, message
                assert collectives == {"all_to_all_single": 1, "all_gather_object": 1}, (case, collectives)


def run_change_together(rank, world_size):
    """Every rank changes its shape alike: the headers travel once in pieces of the agreed sizes,
    then the exchange; the next call of that shape is one all-to-all. Each result exact."""
    W, counts = world_size, []
    for seq in (2, 4, 4, 2, 2):
        full = _full(27 + seq, (1, seq * W, 2 * W, 3))
        with HostTraffic() as traffic:
            out = a2a.seq_to_head(_shard(full, 1, rank, W))
        assert torch.equal(out, _shard(full, 2, rank, W))
        counts.append(traffic.collectives["all_to_all_single"])
    return counts[1:]  # (the first: after whatever the pool ran before)


def test_every_rank_changing_alike_costs_one_exchange_of_headers(pool2, pool4):
    assert pool2.run(run_change_together) == [[2, 1, 2, 1]] * 2
    assert pool4.run(run_change_together) == [[2, 1, 2, 1]] * 4


def run_repeated_counts(rank, world_size):
    """The same exchange again and again: the held send headers are rewritten only in their
    exchange count; every received header carries the count of this exchange."""
    from alltoall_ops import ulysses_exchange

    group_name, counts = dist.group.WORLD.group_name, []
    for _ in range(3):
        a2a.seq_to_head(torch.zeros(1, 2, 2 * world_size, 3))
        plan = ulysses_exchange._headers_of[group_name]
        views = plan.held_views["views"]
        sent, received = (h.contiguous().view(torch.int64)[:, 1].tolist()
                          for h in (views.send_headers, views.received_headers))
        counts.append((ulysses_exchange._exchanges[group_name] - 1, sent, received))
    return [(count, sent == [count] * world_size, received == [count] * world_size) for count, sent, received in counts]


def test_repeated_exchanges_carry_their_count(pool2):
    for ranks in zip(*pool2.run(run_repeated_counts)):
        assert ranks[0] == ranks[1] and ranks[0][1:] == (True, True), ranks


def run_growing_exchanges(rank, world_size):
    """A larger exchange replaces the group's held bytes: the smaller plans' views of the old ones
    go with them (nothing keeps the old bytes alive), and the smaller exchange still works."""
    from alltoall_ops import ulysses_exchange

    group_name = dist.group.WORLD.group_name
    small = torch.zeros(1, 2, 2 * world_size, 3)
    a2a.seq_to_head(small)
    plan = ulysses_exchange._headers_of[group_name]
    held = torch.tensor([ulysses_exchange._held[(group_name, "send")].numel()])
    dist.all_reduce(held, op=dist.ReduceOp.MAX)  # (the ranks' held bytes differ after exchanges of other sizes)
    a2a.seq_to_head(torch.zeros(1, 2, 2 * world_size, int(held)))  # more bytes than any rank holds
    dropped = plan.held_views == {}
    _check_exchange(rank, world_size, (1, 2 * world_size, 2 * world_size, 3), 1, 2, seed=31)
    return dropped


def test_growing_exchanges_let_old_buffers_go(pool2):
    assert pool2.run(run_growing_exchanges) == [True, True]


def run_attn_fn_errors(rank, world_size):
    """attn_fn outputs of the wrong shape, on every rank alike: each raises at once, naming attn_fn."""
    W = world_size
    q, k, v = _gqa_qkv(rank, 2 * W, 2 * W)
    as_sbhd = [t.transpose(0, 1) for t in (q, k, v)]
    errors = _errors([
        (a2a.ulysses_attention, (q, k, v), dict(attn_fn=lambda q, k, v: q[:, : q.shape[1] // W])),  # S/W positions
        (a2a.ulysses_attention, as_sbhd, dict(layout="sbhd", attn_fn=lambda q, k, v: q[: q.shape[0] // W])),
        (a2a.ulysses_attention, (q, k, v), dict(attn_fn=lambda q, k, v: torch.cat([q, q], dim=2))),  # heads
        (a2a.ulysses_attention, (q, k, v), dict(attn_fn=lambda q, k, v: (q,))),
    ])
    _check_exchange(rank, W, (1, 2 * W, 2 * W, 2), 1, 2, seed=24)  # nothing was sent: still in step
    return errors


def test_attn_fn_output_is_checked_by_name(pool2):
    def expected(layout, shape, got):
        doc = "(B, S, h_r, Dv)" if layout == "bshd" else "(S, B, h_r, Dv)"
        return (f"ulysses_attention: attn_fn: expected an output {doc} = {shape} ({layout}: the full sequence S = 4, "
                f"this rank's h_r = 2 q heads, v's head size Dv = 3), got {got}")

    assert pool2.run(run_attn_fn_errors) == [[
        ("ValueError", expected("bshd", (1, 4, 2, 3), "shape (1, 2, 2, 3)")),
        ("ValueError", expected("sbhd", (4, 1, 2, 3), "shape (2, 1, 2, 3)")),
        ("ValueError", expected("bshd", (1, 4, 2, 3), "shape (1, 4, 4, 3)")),
        ("ValueError", expected("bshd", (1, 4, 2, 3), "tuple")),
    ]] * 2


def run_attn_fn_wrong_on_one_rank(rank, world_size):
    """3 heads over 2 ranks (2 on rank 0, 1 on rank 1), an attn_fn that keeps one head: wrong on
    rank 0 only. Debug mode: rank 0 raises its error, rank 1 a PeerInputError quoting it."""
    q, k, v = _gqa_qkv(rank, 3, 3)
    with debug_mode():
        errors = _errors([(a2a.ulysses_attention, (q, k, v), dict(attn_fn=lambda q, k, v: q[:, :, :1]))])
    _check_exchange(rank, world_size, (1, 4, 4, 2), 1, 2, seed=25)
    return errors[0]


def test_attn_fn_wrong_on_one_rank_in_debug_mode(pool2):
    (kind0, message0), (kind1, message1) = pool2.run(run_attn_fn_wrong_on_one_rank)
    assert (kind0, kind1) == ("ValueError", "PeerInputError")
    assert message0.startswith("ulysses_attention: attn_fn: expected an output (B, S, h_r, Dv) = (1, 4, 2, 3)")
    assert "rank 0 rejected its arguments" in message1 and message0 in message1, message1


def test_opcheck_uneven_heads(pool2):
    pool2.run(run_opcheck_uneven)


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_exchange_any_shape(pool2, pool4, data):
    """Any dims and sizes; any head count (not divisible by W: split unevenly; fewer than W too)."""
    pool = data.draw(st.sampled_from([pool2, pool4]), label="pool")
    W = pool.world_size
    ndim = data.draw(st.integers(2, 5), label="ndim")
    seq_dim, head_dim = data.draw(st.permutations(range(ndim)), label="dims")[:2]
    shape = [data.draw(st.integers(0, 3), label=f"size{i}") for i in range(ndim)]
    shape[seq_dim] = W * data.draw(st.integers(0, 3), label="seq per rank")
    shape[head_dim] = data.draw(st.integers(1, 3 * W), label="heads")
    if data.draw(st.booleans(), label="negative dims"):
        seq_dim, head_dim = seq_dim - ndim, head_dim - ndim
    expected = list(shape)
    expected[seq_dim] //= W
    assert pool.run(run_exchange_shape, tuple(shape), seq_dim, head_dim, 90) == [tuple(expected)] * W


@pytest.mark.parametrize("pool", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("is_causal, scale", [(False, None), (True, None), (True, 0.3)])
def test_attention_matches_full_attention(pool, is_causal, scale):
    W = pool.world_size
    for heads in (2 * W, 2 * W + 1):  # split evenly, and unevenly (not at one rank)
        assert pool.run(run_attention, is_causal, scale, 100, heads) == [(2, 3, heads, 3)] * W


@pytest.mark.parametrize("pool", [2, 4], indirect=True)
def test_bad_inputs_raise_on_every_rank(pool):
    W = pool.world_size
    assert pool.run(run_bad_inputs) == [expected_errors(W, r) for r in range(W)]


def test_bad_inputs_raise_without_a_group():
    assert _errors(bad_calls(1, LOCAL)) == expected_errors(1, 0)


def test_exchange_without_a_group():
    assert not dist.is_initialized()
    assert _check_exchange(0, 1, (2, 3, 4, 5), 1, 2, seed=110, transpose=True) == (2, 3, 4, 5)
    run_round_trip(0, 1, (2, 3, 4, 5), -3, -2, 120)


@pytest.mark.parametrize("op", [OPS.seq_to_head.default, OPS.head_to_seq.default])
@pytest.mark.parametrize(
    "shape, seq_dim, head_dim, transpose",
    [((2, 3, 4, 5), 1, 2, False), ((2, 3, 4, 5), 1, 2, True), ((4, 3, 2), 1, 0, False)],
)
def test_opcheck_local(op, shape, seq_dim, head_dim, transpose):
    x = _full(130, shape)
    if transpose:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    num_heads = ([shape[head_dim]],) if op == OPS.head_to_seq.default else ()
    torch.library.opcheck(op, ([x.requires_grad_()], LOCAL, seq_dim, head_dim, *num_heads, [], 0, False))


class TestCompiled(TestCase):
    """fullgraph compile (aot_eager): no graph breaks, eager results, and the comm ops pinned."""

    @pytest.fixture(autouse=True)
    def _session_pool(self, pool2):
        self.pool2 = pool2  # the session's pool: pytest fixtures reach unittest classes this way

    def test_compiled_local(self):
        ops_summary, attention_summary = run_compiled(0, 1)
        self.assertExpectedInline(ops_summary, """\
forward 0:
  alltoall_ops.seq_to_head(xs=[<tensor>], group_name='', seq_dim=1, head_dim=2, attention=[], sizes=0, async_op=False)
  alltoall_ops.seq_to_head(xs=[<tensor>], group_name='', seq_dim=1, head_dim=2, attention=[], sizes=0, async_op=False)
  alltoall_ops.head_to_seq(xs=[<tensor>], group_name='', seq_dim=1, head_dim=2, num_heads=[2], attention=[], sizes=0, async_op=False)
backward 0:
  alltoall_ops.seq_to_head(xs=[<tensor>], group_name='', seq_dim=1, head_dim=2, attention=[], sizes=1, async_op=False)
  alltoall_ops.head_to_seq(xs=[<tensor>], group_name='', seq_dim=1, head_dim=2, num_heads=[2], attention=[], sizes=1, async_op=False)
  alltoall_ops.head_to_seq(xs=[<tensor>], group_name='', seq_dim=1, head_dim=2, num_heads=[2], attention=[], sizes=1, async_op=False)""")  # noqa: E501 (the graph's line)
        self.assertExpectedInline(attention_summary, """\
forward 0:
  alltoall_ops.seq_to_head(xs=[<tensor>, <tensor>, <tensor>], group_name='', seq_dim=1, head_dim=2, attention=[], sizes=0, async_op=False)
  alltoall_ops.head_to_seq(xs=[<tensor>], group_name='', seq_dim=1, head_dim=2, num_heads=[2], attention=[], sizes=1, async_op=False)
backward 0:
  alltoall_ops.seq_to_head(xs=[<tensor>], group_name='', seq_dim=1, head_dim=2, attention=[], sizes=1, async_op=False)
  alltoall_ops.head_to_seq(xs=[<tensor>, <tensor>, <tensor>], group_name='', seq_dim=1, head_dim=2, num_heads=[2, 2, 2], attention=[], sizes=1, async_op=False)""")  # noqa: E501 (the graph's line)

    def test_compiled_two_ranks_uneven_heads(self):
        results = self.pool2.run(run_compiled, 5)  # 5 heads: 3 on rank 0, 2 on rank 1
        assert results[0] == results[1]
        # each rank's graphs have their own shapes: the disk caches, which the ranks of a node
        # share, are keyed on the rank (rank 1 was served rank 0's graph before)
        assert self.pool2.run(run_cache_key_ranks) == [["rank=0"], ["rank=1"]]
        ops_summary, attention_summary = results[0]
        self.assertExpectedInline(ops_summary, """\
forward 0:
  alltoall_ops.seq_to_head(xs=[<tensor>], group_name='0', seq_dim=1, head_dim=2, attention=[], sizes=0, async_op=False)
  alltoall_ops.seq_to_head(xs=[<tensor>], group_name='0', seq_dim=1, head_dim=2, attention=[], sizes=0, async_op=False)
  alltoall_ops.head_to_seq(xs=[<tensor>], group_name='0', seq_dim=1, head_dim=2, num_heads=[5], attention=[], sizes=0, async_op=False)
backward 0:
  alltoall_ops.seq_to_head(xs=[<tensor>], group_name='0', seq_dim=1, head_dim=2, attention=[], sizes=1, async_op=False)
  alltoall_ops.head_to_seq(xs=[<tensor>], group_name='0', seq_dim=1, head_dim=2, num_heads=[5], attention=[], sizes=1, async_op=False)
  alltoall_ops.head_to_seq(xs=[<tensor>], group_name='0', seq_dim=1, head_dim=2, num_heads=[5], attention=[], sizes=1, async_op=False)""")  # noqa: E501 (the graph's line)
        self.assertExpectedInline(attention_summary, """\
forward 0:
  alltoall_ops.seq_to_head(xs=[<tensor>, <tensor>, <tensor>], group_name='0', seq_dim=1, head_dim=2, attention=<args>, sizes=0, async_op=False)
  alltoall_ops.head_to_seq(xs=[<tensor>], group_name='0', seq_dim=1, head_dim=2, num_heads=[5], attention=<args>, sizes=1, async_op=False)
backward 0:
  alltoall_ops.seq_to_head(xs=[<tensor>], group_name='0', seq_dim=1, head_dim=2, attention=[], sizes=1, async_op=False)
  alltoall_ops.head_to_seq(xs=[<tensor>, <tensor>, <tensor>], group_name='0', seq_dim=1, head_dim=2, num_heads=[5, 5, 5], attention=<args>, sizes=1, async_op=False)""")  # noqa: E501 (the graph's line)

