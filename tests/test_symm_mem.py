"""backend="symm_mem": the CUDA kernels and op code, run on the CPU through Triton's interpreter
over the shared-memory stand-in for symmetric memory (W = 1, 2, 4 processes) and over simulated
peers (threads), compared exactly with the collective backend.

Exactness: dispatch only moves rows and combine adds the same fp32 (fp64) terms in the same k
order as the collective backend, rounded once (bf16 rounded to nearest even, as torch does), so
routed rows, y and the gradients of x / expert outputs are compared bit for bit. The routing
weights' gradient is a dot product over H that the kernel sums in another order than torch:
compared to a few ulps of the accumulation dtype.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from functools import partial

import pytest
import torch
from expecttest import TestCase
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import alltoall_ops as a2a
from alltoall_ops import fp8
from alltoall_ops.errors import GroupMismatchError
from alltoall_ops.testing import CommOpCounter, DistributedPool, RankFailures, nan_unwritten_rows
from alltoall_ops.backends import symm_mem
from alltoall_ops.backends.symm_mem import backend as symm_backend
from alltoall_ops.backends.symm_mem import ops as symm_ops
from alltoall_ops.kernels import loader, row_put
from alltoall_ops.kernels.region import Region
from alltoall_ops.inspect import CompiledGraphs, capturing_backend
from alltoall_ops.layout import expert_of_rows
from alltoall_ops.rows import weight_grad_op

# Triton decides at import whether kernels run compiled or in its interpreter, for the whole
# process: without CUDA this package sets TRITON_INTERPRET=1. (The GPU path: test_symm_mem_gpu.py.)
pytestmark = pytest.mark.skipif(
    not loader.load().interpreting(),
    reason="the CPU path runs Triton's interpreter: set TRITON_INTERPRET=1 (automatic without CUDA)",
)

E, H, K = 8, 6, 2
SYMM_OPS = ("alltoall_ops::symm_exchange_meta", "alltoall_ops::symm_dispatch", "alltoall_ops::symm_combine")


def _inputs(seed: int, rank: int, T: int, dtype: torch.dtype, w_dtype: torch.dtype, num_experts: int = E):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(T, H, generator=g).to(dtype)
    topk_idx = torch.randint(-1, num_experts, (T, K), generator=g)
    weights = torch.rand(T, K, generator=g).to(w_dtype)
    grad_y = torch.randn(T, H, generator=g).to(dtype)
    return x, topk_idx, weights, grad_y


def _expert(routed: torch.Tensor) -> torch.Tensor:
    # Row-wise, so a row's output depends on that row only; padding rows become 0.5, and rows
    # past tokens_per_expert.sum() (unspecified with symm_mem) anything: combine must ignore both.
    return torch.tanh(routed) + 0.5


def _scaled_tanh(routed: torch.Tensor, tokens_per_expert: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """tanh(row * scale[expert of the row]) on the rows of a local expert, zero on the rest; scale:
    (e, H). Masked on both sides, as an expert step must be: symm_mem's rows past
    tokens_per_expert.sum() (routed's, and those of combine's backward) are unspecified, and
    reach neither the output nor scale's gradient."""
    e = scale.shape[0]
    expert_R = expert_of_rows(tokens_per_expert, routed.shape[0])  # e past the groups
    mine_R1 = (expert_R < e)[:, None]
    rows_RH = torch.where(mine_R1, routed, 0)
    return torch.where(mine_R1, torch.tanh(rows_RH * scale[expert_R.clamp(max=e - 1)]), 0)


def _step(x, topk_idx, weights, grad_y, *, backend, expert_alignment=1, buffers=None, num_experts=E):
    """dispatch -> expert -> combine -> backward; returns every output and gradient."""
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    routed, tokens_per_expert, handle = a2a.dispatch(
        x, topk_idx, num_experts=num_experts, backend=backend, expert_alignment=expert_alignment, buffers=buffers
    )
    y = a2a.combine(_expert(routed), handle, weights)
    grad_x, grad_w = torch.autograd.grad(y, (x, weights), grad_y)
    return dict(routed=routed.detach(), tokens_per_expert=tokens_per_expert, y=y.detach(),
                grad_x=grad_x, grad_w=grad_w, handle=handle)


def _assert_same_as_collective(symm: dict, coll: dict, capacity: int) -> None:
    assert torch.equal(symm["tokens_per_expert"], coll["tokens_per_expert"])
    R = int(coll["tokens_per_expert"].sum())
    assert symm["routed"].shape[0] == capacity >= R
    # Rows [0, R), padding (zero) included, are the collective backend's; the rest unspecified.
    assert torch.equal(symm["routed"][:R], coll["routed"][:R]), "routed rows differ from the collective backend"
    assert symm["handle"].num_routed_1.tolist() == [R]
    assert torch.equal(symm["y"], coll["y"])
    assert torch.equal(symm["grad_x"], coll["grad_x"])
    _assert_weight_grad_close(symm["grad_w"], coll["grad_w"])


def _assert_weight_grad_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # A sum of H = 6 products in another order: a few ulps of the accumulation dtype.
    eps = torch.finfo(torch.float64 if expected.dtype == torch.float64 else torch.float32).eps
    torch.testing.assert_close(actual, expected, rtol=16 * eps, atol=16 * eps)


# --------------------------------------------------------------------------------------------
# One rank (no process group): hypothesis over shapes, against the local backend


@given(
    T=st.integers(0, 6), k=st.integers(1, 3), num_experts=st.sampled_from([1, 2, 5]),
    alignment=st.integers(1, 3), bf16=st.booleans(), seed=st.integers(0, 2**16),
)
def test_one_rank_matches_local(T, k, num_experts, alignment, bf16, seed):
    dtype, w_dtype = (torch.bfloat16, torch.float32) if bf16 else (torch.float64, torch.float64)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    topk_idx = torch.randint(-1, num_experts, (T, k), generator=g)
    weights = torch.rand(T, k, generator=g).to(w_dtype)
    grad_y = torch.randn(T, H, generator=g).to(dtype)
    bufs = a2a.SymmBuffers(max(T, 1), H, k, num_experts, dtype=dtype, device="cpu", expert_alignment=alignment)
    run = partial(_step, x, topk_idx, weights, grad_y, expert_alignment=alignment, num_experts=num_experts)
    symm = run(backend="symm_mem", buffers=bufs)
    _assert_same_as_collective(symm, run(backend="local"), bufs.capacity)


@given(
    W=st.integers(2, 4), tokens=st.lists(st.integers(0, 5), min_size=4, max_size=4), k=st.integers(1, 3),
    e=st.integers(1, 2), alignment=st.integers(1, 3), bf16=st.booleans(), seed=st.integers(0, 2**16),
)
def test_simulated_peers_match_one_process_reference(W, tokens, k, e, alignment, bf16, seed):
    # W ranks simulated in one process (each row pulled from its sender's stage), uneven T (zero
    # too), against the local backend on every rank's tokens concatenated in rank order: its
    # expert-major rows are every destination's rows in rank order, its y and gradients every
    # rank's, in slices.
    dtype, w_dtype = (torch.bfloat16, torch.float32) if bf16 else (torch.float64, torch.float64)
    T, E = tokens[:W], W * e
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, H, generator=g).to(dtype) for t in T]
    idxs = [torch.randint(-1, E, (t, k), generator=g) for t in T]
    ws = [torch.rand(t, k, generator=g).to(w_dtype) for t in T]
    grads = [torch.randn(t, H, generator=g).to(dtype) for t in T]
    ref = _step(torch.cat(xs), torch.cat(idxs), torch.cat(ws), torch.cat(grads), backend="local",
                expert_alignment=alignment, num_experts=E)
    bufs = a2a.SymmBuffers.simulated(W, max(max(T), 1), H, k, E, dtype=dtype, device="cpu",
                                     expert_alignment=alignment)
    got = symm_mem.run_simulated(lambda r, b: _step(xs[r], idxs[r], ws[r], grads[r], backend="symm_mem",
                                                    expert_alignment=alignment, buffers=b, num_experts=E), bufs)
    row, token = 0, 0
    for r, symm in enumerate(got):
        tpe = ref["tokens_per_expert"][r * e : (r + 1) * e]
        R, tokens_r = int(tpe.sum()), slice(token, token + T[r])
        want = dict(tokens_per_expert=tpe, routed=ref["routed"][row : row + R], y=ref["y"][tokens_r],
                    grad_x=ref["grad_x"][tokens_r], grad_w=ref["grad_w"][tokens_r])
        _assert_same_as_collective(symm, want, bufs[r].capacity)
        row, token = row + R, token + T[r]


def test_bf16_products_round_like_torch():
    # Scaled rows (combine's backward) are fp32 products rounded once to bf16, on the bits.
    T, k = 64, 2
    g = torch.Generator().manual_seed(5)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.0e38, 1e-40, -1e-39])
    x = torch.randn(T, H, generator=g)
    x[: len(special), 0] = special
    x = x.to(torch.bfloat16)
    scale = torch.rand(T, k, generator=g) * 4 - 2
    scale[:4] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 2.0, -1.5])[:, None]  # ties, exact
    bufs = a2a.SymmBuffers(T, H, k, 1, dtype=torch.bfloat16, device="cpu")
    topk_idx = torch.zeros(T, k, dtype=torch.int64)
    _, _, h = a2a.dispatch(x, topk_idx, num_experts=1, buffers=bufs)
    routed, _, _ = symm_ops.symm_dispatch_op(x, scale, *h.slots)
    slots = torch.argsort(h.position_TK.reshape(-1))  # one rank, no padding: row i carries send position i
    expected = (x.float()[slots // k] * scale.reshape(-1)[slots, None]).to(torch.bfloat16)
    torch.testing.assert_close(routed, expected, rtol=0, atol=0, equal_nan=True)


def test_capacity_rule():
    bufs = a2a.SymmBuffers(5, H, 3, 4, dtype=torch.float32, device="cpu", expert_alignment=4)
    assert bufs.capacity == 1 * 5 * 3 + 4 * (4 - 1)  # W * T_max * K + e * (alignment - 1)
    assert a2a.SymmBuffers(5, H, 3, 4, dtype=torch.float32, device="cpu", capacity=7).capacity == 7


# --------------------------------------------------------------------------------------------
# W = 2, 4 processes: the shared-memory stand-in, against the collective backend

CASES = (  # (seed, dtype, weights dtype, expert_alignment, T of rank r)
    (1, torch.float64, torch.float64, 1, lambda r: 5 + r),
    (2, torch.float64, torch.float64, 3, lambda r: 0 if r == 1 else 4),  # a rank with no tokens
    (3, torch.bfloat16, torch.float32, 2, lambda r: 6),
)


def run_against_collective(rank: int, world_size: int, allocator: str = "auto") -> list[int]:
    bufs = {
        dtype: a2a.SymmBuffers(8, H, K, E, dtype=dtype, device="cpu", expert_alignment=3, allocator=allocator)
        for dtype in (torch.float64, torch.bfloat16)
    }
    assert all(b.peer_path for b in bufs.values()), "the path with peers"
    capacities = []
    for seed, dtype, w_dtype, alignment, tokens in CASES:
        args = _inputs(seed, rank, tokens(rank), dtype, w_dtype)
        symm = _step(*args, backend="symm_mem", expert_alignment=alignment, buffers=bufs[dtype])
        coll = _step(*args, backend="collective", expert_alignment=alignment)
        _assert_same_as_collective(symm, coll, bufs[dtype].capacity)
        again = _step(*args, backend="symm_mem", expert_alignment=alignment, buffers=bufs[dtype])
        R = int(symm["tokens_per_expert"].sum())
        assert torch.equal(again["routed"][:R], symm["routed"][:R])  # deterministic: bit for bit
        for name in ("y", "grad_x", "grad_w"):
            assert torch.equal(again[name], symm[name]), name
        assert not symm["handle"].dropped_W.any()
        capacities.append(bufs[dtype].capacity)
    return capacities


@pytest.mark.parametrize("pool", [2, 4], indirect=True)
def test_matches_collective(pool):
    W = pool.world_size
    results = pool.run(run_against_collective)
    assert results == [[W * 8 * K + (E // W) * 2] * len(CASES)] * W  # the capacity rule


def test_one_rank_takes_the_path_with_peers_on_request(pool1):
    # allocator='symmetric': one rank runs what ranks with peers run (barriers, the metadata put,
    # tags, its stage; on the CPU the shared-memory stand-in), so that one GPU or CPU process
    # checks that path (a GPU with its barrier kernels, inlined unless ALLTOALL_OPS_INLINE_SYMMETRIC=0).
    assert pool1.run(run_against_collective, "symmetric") == [[8 * K + E * 2] * len(CASES)]
    with pytest.raises(ValueError, match="allocator='symmetric'.*process group"):
        a2a.SymmBuffers(8, H, K, E, dtype=torch.float32, device="cpu", allocator="symmetric")


# --------------------------------------------------------------------------------------------
# Errors and overflow (W = 2): every rank raises alike, nobody is left waiting, buffers stay usable


def run_errors(rank: int, world_size: int) -> list[str]:
    bufs = a2a.SymmBuffers(4, H, K, E, dtype=torch.float32, device="cpu", capacity=5)
    x, topk_idx, weights, _ = _inputs(7, rank, 4, torch.float32, torch.float32)
    messages = []
    everything_to_rank_0 = torch.zeros_like(topk_idx)  # 2 ranks * 8 slots > C = 5 rows on rank 0
    with pytest.raises(ValueError, match="overflow") as err:
        a2a.dispatch(x, everything_to_rank_0, num_experts=E, buffers=bufs)
    messages.append(str(err.value))
    bad = topk_idx.clone()
    if rank == 1:
        bad[0, 0] = E + 3
    with pytest.raises(ValueError, match="outside") as err:
        a2a.dispatch(x, bad, num_experts=E, buffers=bufs)
    messages.append(str(err.value))
    T = 5 if rank == 0 else 4  # rank 0 exceeds max_tokens_per_rank = 4
    with pytest.raises(ValueError, match="max_tokens_per_rank") as err:
        a2a.dispatch(torch.randn(T, H), torch.full((T, K), -1), num_experts=E, buffers=bufs)
    messages.append(str(err.value))
    one_slot = torch.full_like(topk_idx, -1)
    one_slot[0, 0] = rank * (E // world_size)  # fits: the buffers still work after the errors
    routed, tokens_per_expert, handle = a2a.dispatch(x, one_slot, num_experts=E, buffers=bufs)
    assert torch.equal(routed[0], x[0]) and int(tokens_per_expert.sum()) == 1
    assert torch.equal(a2a.combine(routed, handle)[0], x[0])
    return messages


def test_errors_agree_on_every_rank(pool2):
    messages = pool2.run(run_errors)
    assert messages[0] == messages[1]
    overflow, bad_ids, too_many = messages[0]
    assert "rank 0 must receive 16 rows" in overflow and "capacity is C = 5" in overflow
    assert "overflow='drop'" in overflow
    assert "topk_idx on rank 1" in bad_ids and "max 11" in bad_ids
    assert "rank 0 dispatched T * K = 10 slots" in too_many


# --------------------------------------------------------------------------------------------
# Ranks out of step (W = 2): every barrier carries its op and the call number of its dispatch,
# so no exchange pairs with another one on any rank


def run_out_of_step(rank: int, world_size: int, case: str) -> str:
    """Rank 1 skips one exchange that rank 0 makes: it caught its own combine's error
    ("next_dispatch", "other_layer": its first layer's combine next) or skipped its backward
    ("backward"), and went on. Returns what the rank raised there, or "returned"."""
    bufs = a2a.SymmBuffers(4, H, K, E, dtype=torch.float32, device="cpu", timeout=10.0)
    x, topk_idx, weights, grad_y = _inputs(9, rank, 4, torch.float32, torch.float32)
    x = x.requires_grad_()
    layers = [a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs) for _ in range(2 if case == "other_layer" else 1)]
    routed, _, handle = layers[-1]
    try:
        if rank == 0:
            y = a2a.combine(routed, handle, weights)
            if case == "backward":
                torch.autograd.grad(y, x, grad_y)
        elif case == "backward":  # its combine pairs with rank 0's; it skips its backward
            a2a.combine(routed, handle, weights)
            a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)
        else:
            with pytest.raises(ValueError, match="expert_out"):  # raised before any exchange: rank 0 is not told
                a2a.combine(routed[:, :1], handle, weights)
            if case == "other_layer":
                a2a.combine(layers[0][0], layers[0][2], weights)
            else:
                a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)
    except GroupMismatchError as exc:
        return f"GroupMismatchError: {exc}"
    return "returned"


OUT_OF_STEP = {  # case -> where each rank is, in every rank's message
    "next_dispatch": "rank 0 is in a combine (or a dispatch's backward) of call 1, rank 1 is in a dispatch's "
                     "metadata exchange of call 2",
    "other_layer": "rank 0 is in a combine (or a dispatch's backward) of call 2, rank 1 is in a combine (or a "
                   "dispatch's backward) of call 1",
    "backward": "rank 0 is in a dispatch's rows (or a combine's backward) of call 1, rank 1 is in a dispatch's "
                "metadata exchange of call 2",
}


@pytest.mark.parametrize("case", list(OUT_OF_STEP))
def test_out_of_step_raises_on_every_rank(pool2, case):
    # Before the stamps: rank 0's combine paired with rank 1's dispatch (or other combine) and
    # returned a wrong y (the backward: a wrong gradient, then a timeout).
    for rank, message in enumerate(pool2.run(run_out_of_step, case)):
        assert message.startswith("GroupMismatchError: alltoall_ops.symm_mem on group"), message
        assert f"(rank {rank} of 2): the ranks are out of step" in message and OUT_OF_STEP[case] in message, message


def run_peer_exits_while_creating(rank: int, world_size: int, where: str) -> None:
    if rank == 1 and where == "before":
        os._exit(3)
    if rank == 1:  # inside the allocator, after the ranks agreed on the configuration
        symm_mem.segments._SharedMemorySegments.__init__ = lambda *args: os._exit(3)
    a2a.SymmBuffers(4, H, K, E, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("where", ["before", "during"])
def test_peer_exit_while_creating_buffers_is_named(where):
    with DistributedPool(2) as pool:
        with pytest.raises(RankFailures) as info:
            pool.run(run_peer_exits_while_creating, where, timeout=60)
    assert set(info.value.errors) == {0}, str(info.value)  # rank 1 died
    err = info.value.errors[0]
    assert err.type_name == "CollectiveError", err
    assert err.message.startswith("alltoall_ops.SymmBuffers on group") and "(rank 0 of 2): failed" in err.message, err


def _dropped_slots(topk_idxs: list[torch.Tensor], capacity: int, world_size: int) -> list[set]:
    """From the layout contract: the (t, k) slots of each source rank whose row would land at or
    past ``capacity`` on its destination (expert-major, then source rank, then send order)."""
    e = E // world_size
    dropped: list[set] = [set() for _ in range(world_size)]
    for d in range(world_size):
        rows = [
            (s, t, k)
            for j in range(d * e, (d + 1) * e)
            for s in range(world_size)
            for t in range(topk_idxs[s].shape[0])
            for k in range(K)
            if int(topk_idxs[s][t, k]) == j
        ]
        for s, t, k in rows[capacity:]:
            dropped[s].add((t, k))
    return dropped


def run_drop(rank: int, world_size: int, capacity: int) -> list[int]:
    bufs = a2a.SymmBuffers(6, H, K, E, dtype=torch.float64, device="cpu", capacity=capacity, overflow="drop")
    args = list(_inputs(11, rank, 6, torch.float64, torch.float64))
    args[1] = args[1].clamp(max=E // world_size - 1 + 2)  # crowd the low experts (rank 0)
    symm = _step(*args, backend="symm_mem", buffers=bufs)
    gathered = [torch.empty_like(args[1]) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, args[1])
    dropped = _dropped_slots(gathered, capacity, world_size)
    masked = args[1].clone()
    for t, k in dropped[rank]:
        masked[t, k] = -1
    coll = _step(args[0], masked, *args[2:], backend="collective")
    # Dropping the rows past C changes no earlier row, so the result is the collective backend's
    # with those slots routed nowhere.
    _assert_same_as_collective(symm, coll, capacity)
    per_rank = [
        len([1 for s in range(world_size) for (t, k) in dropped[s] if int(gathered[s][t, k]) // (E // world_size) == d])
        for d in range(world_size)
    ]
    assert symm["handle"].dropped_W.tolist() == per_rank
    return per_rank


def test_overflow_drop_counts_and_keeps_the_rest(pool2):
    per_rank = pool2.run(run_drop, 7)
    assert per_rank[0] == per_rank[1] and per_rank[0][0] > 0, per_rank  # rows were dropped, on rank 0


# --------------------------------------------------------------------------------------------
# Buffer lifetime: two layers share one SymmBuffers; forward both, then backward




def _moe_layer(x, topk_idx, weights, scale, backend, bufs):
    """dispatch -> a per-expert elementwise map -> combine. scale: (e, H), one row per local expert."""
    routed, tokens_per_expert, handle = a2a.dispatch(
        x, topk_idx, num_experts=E, backend=backend, buffers=bufs if backend == "symm_mem" else None
    )
    return a2a.combine(_scaled_tanh(routed, tokens_per_expert, scale), handle, weights)


def _two_layers(x, idx1, w1, s1, idx2, w2, s2, backend, bufs):
    return _moe_layer(_moe_layer(x, idx1, w1, s1, backend, bufs), idx2, w2, s2, backend, bufs)


def _sac(fn):
    def wrapped(*args):
        context_fn = partial(create_selective_checkpoint_contexts, a2a.sac_policy())
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)
    return wrapped


def _full_recompute(fn):
    return lambda *args: checkpoint(fn, *args, use_reentrant=False)


def run_two_layers(rank: int, world_size: int) -> dict:
    torch.manual_seed(50 + rank)
    T, e = 5, E // world_size
    x = torch.randn(T, H, dtype=torch.float64)
    idx1, idx2 = torch.randint(-1, E, (T, K)), torch.randint(-1, E, (T, K))
    w1, w2 = torch.rand(T, K, dtype=torch.float64), torch.rand(T, K, dtype=torch.float64)
    s1, s2 = torch.randn(e, H, dtype=torch.float64), torch.randn(e, H, dtype=torch.float64)
    leaves = [x, w1, s1, w2, s2]
    bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.float64, device="cpu")

    def grads(fn, backend):
        params = [t.clone().requires_grad_() for t in leaves]
        px, pw1, ps1, pw2, ps2 = params
        y = fn(px, idx1, pw1, ps1, idx2, pw2, ps2, backend, bufs)
        counter = CommOpCounter()
        with counter:
            g = torch.autograd.grad(y, params, torch.ones_like(y))
        return y.detach(), g, [op for op in counter.ops if op in SYMM_OPS]

    torch._dynamo.reset()
    ref_y, ref_g, _ = grads(_two_layers, "collective")
    counts = {}
    variants = {"plain": _two_layers, "sac": _sac(_two_layers), "recompute": _full_recompute(_two_layers)}
    graphs = {name: CompiledGraphs() for name in ("plain", "sac")}
    compiled = {
        f"compiled {name}": torch.compile(variants[name], backend=capturing_backend(graphs[name]), fullgraph=True)
        for name in graphs
    }
    for name, fn in [*variants.items(), *compiled.items()]:
        with nan_unwritten_rows() as unwritten:  # NaN rows past n: the expert step must mask them (_scaled_tanh)
            y, g, backward_ops = grads(fn, "symm_mem")
        assert min(unwritten) > 0, name
        assert torch.equal(y, ref_y), name
        for i, (a, b) in enumerate(zip(g, ref_g)):
            if i in (1, 3):  # routing weights
                _assert_weight_grad_close(a, b)
            else:
                assert torch.equal(a, b), (name, i)
        counts[name] = len(backward_ops)
    for name, gs in graphs.items():  # ops of the compiled backward graph
        counts[f"compiled {name}"] = len([op for op in gs.comm_ops("backward") if op.startswith("alltoall_ops.symm")])
    return counts


def test_two_layers_share_buffers(pool2):
    for counts in pool2.run(run_two_layers):
        # Backward of each layer: one dispatch (combine's adjoint) and one combine (dispatch's).
        # The SAC policy saves every symm op; full recompute re-runs the 3 forward ops per layer.
        assert counts == {"plain": 4, "sac": 4, "recompute": 10, "compiled plain": 4, "compiled sac": 4}, counts


# --------------------------------------------------------------------------------------------
# torch.compile: fullgraph, one compilation across routings, the buffers as a graph input


def run_compiled(rank: int, world_size: int) -> tuple[str, list[bool], int, int]:
    torch._dynamo.reset()
    T = 5
    bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.float32, device="cpu", expert_alignment=2)

    def step(x, topk_idx, weights):
        routed, tokens_per_expert, handle = a2a.dispatch(
            x, topk_idx, num_experts=E, expert_alignment=2, backend="symm_mem", buffers=bufs
        )
        return a2a.combine(_expert(routed), handle, weights), tokens_per_expert

    graphs = CompiledGraphs()
    compiled = torch.compile(step, backend=capturing_backend(graphs), fullgraph=True)
    for seed in range(3):  # three routings, one compilation
        x, topk_idx, weights, grad_y = _inputs(20 + seed, rank, T, torch.float32, torch.float32)
        results = []
        for fn in (compiled, step):
            xx, ww = x.clone().requires_grad_(), weights.clone().requires_grad_()
            y, tpe = fn(xx, topk_idx, ww)
            results.append((y, tpe, *torch.autograd.grad(y, (xx, ww), grad_y)))
        for a, b in zip(*results):
            assert torch.equal(a, b)
    constant = [b is bufs for gm in graphs.forward + graphs.backward for b in _buffers_arguments(gm)]
    return graphs.summary(), constant, len(graphs.forward), len(graphs.backward)


class TestCompiled(TestCase):
    @pytest.fixture(autouse=True)
    def _session_pool(self, pool2):
        self.pool2 = pool2

    def test_compiled_two_ranks(self):
        results = self.pool2.run(run_compiled)
        assert results[0] == results[1]
        summary, constant, num_forward, num_backward = results[0]
        assert (num_forward, num_backward) == (1, 1)  # no graph break, no recompilation
        assert constant == [True] * 5  # every symm op names the buffers themselves, a constant of the graph
        self.assertExpectedInline(summary, """\
forward 0:
  alltoall_ops.symm_exchange_meta(buffers=<constant SymmBuffers>, expert_alignment=2)
  alltoall_ops.symm_dispatch(scale_TK=None, buffers=<constant SymmBuffers>)
  alltoall_ops.symm_combine(weights_TK=<tensor>, buffers=<constant SymmBuffers>, save_returned=True)
backward 0:
  alltoall_ops.symm_dispatch(scale_TK=<tensor>, buffers=<constant SymmBuffers>)
  alltoall_ops.symm_combine(weights_TK=None, buffers=<constant SymmBuffers>, save_returned=False)""")

    def test_each_buffers_object_compiles_once(self):
        torch._dynamo.reset()
        x, topk_idx, _, _ = _inputs(70, 0, 5, torch.float32, torch.float32)
        first, bigger, same_size = (a2a.SymmBuffers(t, H, K, E, dtype=torch.float32, device="cpu") for t in (5, 7, 5))

        def step(x, topk_idx, bufs):
            routed, tokens_per_expert, handle = a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)
            return routed, tokens_per_expert, a2a.combine(routed * 2, handle)

        graphs = CompiledGraphs()
        compiled = torch.compile(step, backend=capturing_backend(graphs), fullgraph=True)
        compilations = []
        for bufs in (first, bigger, same_size, first):
            (routed, tpe, y), (ref_routed, ref_tpe, ref_y) = compiled(x, topk_idx, bufs), step(x, topk_idx, bufs)
            R = int(ref_tpe.sum())
            assert torch.equal(tpe, ref_tpe) and torch.equal(routed[:R], ref_routed[:R]) and torch.equal(y, ref_y)
            compilations.append(len(graphs.forward))
        # The buffers are a constant of the graph, equal only to themselves: other buffers, even of
        # the same sizes, never reuse a graph compiled for these (nor its recorded CUDA graph).
        assert compilations == [1, 2, 3, 3]
        assert [_buffers_arguments(gm) for gm in graphs.forward] == [[b] * 3 for b in (first, bigger, same_size)]

    def test_compile_without_buffers_says_what_to_do(self):
        x, topk_idx, _, _ = _inputs(0, 0, 3, torch.float32, torch.float32)
        fn = torch.compile(lambda x, i: a2a.dispatch(x, i, num_experts=E, backend="symm_mem")[0],
                           backend="aot_eager", fullgraph=True)
        with pytest.raises(Exception, match="create alltoall_ops.SymmBuffers"):
            fn(x, topk_idx)


def _buffers_arguments(gm: torch.fx.GraphModule) -> list:
    """The buffers argument of every symm op of ``gm``."""
    return [
        node.args[[a.name for a in node.target._schema.arguments].index("buffers")]
        for node in gm.graph.nodes
        if node.op == "call_function" and getattr(node.target, "name", lambda: "")() in SYMM_OPS
    ]


def test_dispatch_and_combine_compiled_apart_never_copy_the_buffers(monkeypatch):
    # Regression (GPU bench, torch 2.11, 1 GB of buffers): dispatch compiled alone (its handle,
    # which holds the buffers, leaves the graph) and combine compiled alone took 327 s, warned
    # "FX graph cache copying of a large constant", then inductor's module failed to import. torch
    # pickles an opaque graph input: its compile caches turned every tensor of the buffers into a
    # list, and 2.11 wrote pickle.loads(<the buffers' bytes>) into the generated code. Nothing
    # of the buffers' memory may be pickled, listed or baked into a graph, and the compiled code
    # must read the live buffers: rank 0 runs compiled, rank 1 (simulated peer) eager, and the
    # second step's rows written by the peer must arrive.
    torch._dynamo.reset()
    W, T = 2, 6
    bufs = a2a.SymmBuffers.simulated(W, T, H, K, E, dtype=torch.float32, device="cpu", timeout=60)
    segments = {b._segments.local.untyped_storage().data_ptr() for b in bufs}
    copied = []

    def spy(what, original):
        def wrapper(t, *args, **kwargs):
            try:
                if t.untyped_storage().data_ptr() in segments:
                    copied.append((what, tuple(t.shape)))
            except Exception:  # fake tensors have no data
                pass
            return original(t, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(torch.Tensor, "tolist", spy("tolist", torch.Tensor.tolist))
    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", spy("pickle", torch.Tensor.__reduce_ex__))

    graphs_d, graphs_c = CompiledGraphs(), CompiledGraphs()
    dispatch_c = torch.compile(lambda x, i: a2a.dispatch(x, i, num_experts=E, buffers=bufs[0]),
                               backend=capturing_backend(graphs_d, "inductor"), fullgraph=True)
    combine_c = torch.compile(lambda out, h, w: a2a.combine(out, h, w),
                              backend=capturing_backend(graphs_c, "inductor"), fullgraph=True)

    # The FX graph cache computes its key (where the buffers were pickled) on a hit as well;
    # falling back to aten for every op skips the C++ compile (cold cache: about 15 s here).
    config = {"fx_graph_cache": True}
    if hasattr(torch._inductor.config, "fallback_by_default"):
        config["fallback_by_default"] = True

    def step(rank, b, seed, compiled_ranks):
        x, topk_idx, weights, _ = _inputs(seed, rank, T, torch.float32, torch.float32)
        if rank in compiled_ranks:
            with torch._inductor.config.patch(config):  # NB: per thread
                routed, tpe, handle = dispatch_c(x, topk_idx)
                assert handle.buffers is b
                y = combine_c(_expert(routed), handle, weights)
        else:
            routed, tpe, handle = a2a.dispatch(x, topk_idx, num_experts=E, buffers=b)
            y = a2a.combine(_expert(routed), handle, weights)
        return routed[: int(tpe.sum())], tpe, y  # rows past tokens_per_expert.sum() are unspecified

    outs = []
    for seed in (80, 81):
        expected = symm_mem.run_simulated(partial(step, seed=seed, compiled_ranks=()), bufs)
        got = symm_mem.run_simulated(partial(step, seed=seed, compiled_ranks=(0,)), bufs)
        for want, have in zip(expected, got):
            for a, b in zip(want, have):
                assert torch.equal(a, b), f"seed {seed}: compiled rank 0 differs from eager"
        outs.append(got[0])
    assert not torch.equal(outs[0][0], outs[1][0])  # the second step brought other rows

    assert copied == [], f"buffer memory copied while compiling or running: {copied}"
    assert (len(graphs_d.forward), len(graphs_c.forward)) == (1, 1)  # no recompilation
    for gm in graphs_d.forward + graphs_c.forward:
        constants = [n.target for n in gm.graph.nodes
                     if n.op == "get_attr" and isinstance(getattr(gm, n.target), torch.Tensor)]
        assert constants == [], f"tensor constants in a compiled graph: {constants}"
        assert not list(gm.buffers()) and not list(gm.parameters())
        assert _buffers_arguments(gm) in ([bufs[0]], [bufs[0]] * 2)  # a constant of the graph, not an input

    # What torch pickles of them: the configuration, never the memory; a copy cannot be loaded.
    data = pickle.dumps(bufs[0])
    assert len(data) < 1000, len(data)
    with pytest.raises(RuntimeError, match="SymmBuffers cannot be unpickled"):
        pickle.loads(data)


# --------------------------------------------------------------------------------------------
# Eager calls without buffers=: cached, re-created larger when a rank needs more


def run_cached(rank: int, world_size: int) -> list[tuple[int, int]]:
    symm_backend._AUTO_BUFFERS.clear()
    seen = []
    for seed, T in ((30, 3 + rank), (31, 3), (32, 9 if rank == 1 else 2)):
        args = _inputs(seed, rank, T, torch.float32, torch.float32)
        symm = _step(*args, backend="symm_mem")
        _assert_same_as_collective(symm, _step(*args, backend="collective"), symm["routed"].shape[0])
        bufs = symm["handle"].buffers
        seen.append((id(bufs), bufs.max_tokens_per_rank))
    return seen


def test_cached_buffers(pool2):
    for seen in pool2.run(run_cached):
        (id0, t0), (id1, t1), (id2, t2) = seen
        assert (t0, t1, t2) == (4, 4, 9)  # the largest T over the ranks
        assert id0 == id1 != id2  # reused, then re-created on every rank


# --------------------------------------------------------------------------------------------
# Simulated peers (the one-GPU path): threads in one process, same results as real processes


def run_collective(rank: int, world_size: int, T: int) -> dict:
    args = _inputs(40, rank, T, torch.bfloat16, torch.float32)
    out = _step(*args, backend="collective", expert_alignment=2)
    out.pop("handle")
    return out


@pytest.mark.parametrize("pool", [2, 4], indirect=True)
def test_simulated_peers_match_processes(pool):
    W, T = pool.world_size, 5
    expected = pool.run(run_collective, T)
    buffers = a2a.SymmBuffers.simulated(W, T, H, K, E, dtype=torch.bfloat16, device="cpu", expert_alignment=2)

    def rank_fn(rank, bufs):
        return _step(*_inputs(40, rank, T, torch.bfloat16, torch.float32), backend="symm_mem",
                     expert_alignment=2, buffers=bufs)

    for symm, coll in zip(symm_mem.run_simulated(rank_fn, buffers), expected):
        _assert_same_as_collective(symm, coll, buffers[0].capacity)


# --------------------------------------------------------------------------------------------
# Rows past n = tokens_per_expert.sum(): the pull does not write them, nothing reads them


@pytest.fixture(params=[None, 1], ids=["a program a block", "one program"])
def pull_programs(request, monkeypatch):
    """pull_rows with a program per row block, or one program striding over all of them (its
    grid capped as a large capacity's is: ``MAX_COUNTED_PROGRAMS``)."""
    if request.param is not None:
        monkeypatch.setattr(row_put, "MAX_COUNTED_PROGRAMS", request.param)


def _senders_tags(T_W, K_W, C, stride, me, pads, g):
    """Each sender's tags (header (T_s, K_s), then a tag a slot: destination code, source code,
    scale bits) with random destinations: half of the slots to rows of rank ``me`` (distinct, none
    in the padding spans ``pads`` (2, e)), the rest to another rank or nowhere (-1)."""
    padding = torch.zeros(C, dtype=torch.bool)
    for first, end in pads.view(2, -1).t().tolist():
        padding[first:end] = True
    free = torch.arange(C)[~padding][torch.randperm(int((~padding).sum()), generator=g)].tolist()
    tags = []
    for T_s, K_s in zip(T_W, K_W):
        kind = torch.randint(0, 4, (T_s * K_s,), generator=g)
        mine = kind < 2
        mine &= torch.cumsum(mine.to(torch.int64), 0) <= len(free)
        dst = torch.where(kind == 2, (me + 1) * stride + torch.randint(0, C, (T_s * K_s,), generator=g), -1)
        dst[mine] = me * stride + torch.tensor(free[:int(mine.sum())], dtype=torch.int64)
        free = free[int(mine.sum()):]
        code = torch.randint(0, 10**6, (T_s * K_s,), generator=g)
        scale = torch.randn(T_s * K_s, generator=g, dtype=torch.float64).view(torch.int64)
        header = torch.tensor([[T_s, K_s, 0]])
        tags.append(torch.cat([header, torch.stack([dst, code, scale], 1)]))
    return tags


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_pull_rows_from_the_senders_tags(seed, staged, pull_programs):
    # Three senders of different T and K (rank 1 receives), each row loaded once and stored into
    # every row of this rank that one of its slots names, times that slot's scale; rows no slot
    # names are not written, except the local experts' padding rows: zero, row_src -1.
    C, H_, stride, me = 300, 5, 1000, 1
    g = torch.Generator().manual_seed(seed)
    T_W, K_W = [int(t) for t in torch.randint(0, 40, (3,), generator=g)], [3, 1, 4]
    pads = torch.tensor([10, 200, 250, 13, 200, 254])  # 3 experts: [10, 13), none, [250, 254)
    tags = _senders_tags(T_W, K_W, C, stride, me, pads, g)
    sources = [torch.randn(T_s, H_, generator=g, dtype=torch.float64) for T_s in T_W]
    if not staged:  # every sender's rows are `rows`
        sources = [torch.randn(max(T_W), H_, generator=g, dtype=torch.float64)] * 3
    out = torch.full((C, H_), float("nan"), dtype=torch.float64)
    row_src = torch.full((C,), 12345)
    where = ({"stage_table": torch.tensor([s.data_ptr() for s in sources])} if staged else {"rows": sources[0]})
    table = torch.tensor([t.data_ptr() for t in tags])
    loader.load().pull_rows(Region(table, me, (1, 3), torch.int64), torch.tensor([C]), out, row_src,
                            dst_stride=stride, scaled=True, pads=pads, top_k=4, tokens=5, acc_dtype=torch.float64,
                            **where)
    expected, expected_src = torch.full_like(out, float("nan")), torch.full_like(row_src, 12345)
    for s, (t_s, (T_s, K_s)) in enumerate(zip(tags, zip(T_W, K_W))):
        dst, code, scale = t_s[1:, 0], t_s[1:, 1], t_s[1:, 2].view(torch.float64)
        mine = (dst >= me * stride) & (dst < (me + 1) * stride)
        rows = dst[mine] - me * stride
        expected[rows] = sources[s][torch.arange(T_s * K_s)[mine] // K_s] * scale[mine, None]
        expected_src[rows] = code[mine]
    for first, end in pads.view(2, -1).t().tolist():
        expected[first:end], expected_src[first:end] = 0, -1
    assert torch.equal(out.isnan(), expected.isnan()), "rows written where no slot names them, or not written"
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(expected)) and torch.equal(row_src, expected_src)


@pytest.mark.parametrize("n", [0, 1, 255, 300, 600])
def test_pull_rows_by_a_row_map(n, pull_programs):
    # One rank, no tags: row d < n is slot i = row_map[d]'s (the placement's row_slot): token row
    # i // K times scale.flat[i], its code position.flat[i]; -1 (padding): zero, code -1. The
    # map's rows past n are not written by the placement: garbage there must not be read.
    C, H_, T_, K_ = 600, 5, 150, 4
    g = torch.Generator().manual_seed(n)
    rows = torch.randn(T_, H_, generator=g, dtype=torch.float64)
    scale = torch.randn(T_, K_, generator=g, dtype=torch.float64)
    position = torch.randperm(T_ * K_, generator=g).view(T_, K_)
    slot = torch.randint(0, T_ * K_, (C,), generator=g)
    row_map = torch.where(torch.rand(C, generator=g) < 0.8, slot, -1)
    row_map[n:] = 10**9  # garbage
    out = torch.full((C, H_), float("nan"), dtype=torch.float64)
    row_src = torch.full((C,), 12345)
    loader.load().pull_rows(None, torch.tensor([n]), out, row_src, rows=rows, row_map=row_map, position=position,
                            scale=scale, top_k=K_, acc_dtype=torch.float64)
    has = row_map[:n] >= 0
    i = row_map[:n].clamp(min=0)
    expected = rows[i // K_] * scale.reshape(-1)[i, None]
    assert torch.equal(out[:n], torch.where(has[:, None], expected, 0))
    assert torch.isnan(out[n:]).all(), "rows past n must not be written"
    assert torch.equal(row_src[:n], torch.where(has, position.reshape(-1)[i], -1))
    assert (row_src[n:] == 12345).all(), "row_src past n must not be written"


def test_one_rank_reduction_reads_the_rows_in_place():
    # One rank's combine moves nothing: slot (t, k)'s row is expert_out[slot_dst[t * K + k]]
    # (-1: a dropped slot adds nothing, whatever its weight), returned in send order (position).
    C, H_, T_, K_ = 50, 3, 12, 3
    g = torch.Generator().manual_seed(3)
    expert_out = torch.randn(C, H_, generator=g, dtype=torch.float64)
    slot_dst = torch.randint(-1, C, (T_ * K_,), generator=g)
    position = torch.randperm(T_ * K_, generator=g).view(T_, K_)
    weights = torch.randn(T_, K_, generator=g, dtype=torch.float64)
    weights.view(-1)[slot_dst < 0] = float("nan")
    y, returned = torch.empty(T_, H_, dtype=torch.float64), torch.full((T_ * K_, H_), 7.0, dtype=torch.float64)
    loader.load().topk_reduce(expert_out, position, slot_dst, weights, y, returned, torch.float64,
                              read_at_slot_dst=True)
    rows = torch.where((slot_dst >= 0)[:, None], expert_out[slot_dst.clamp(min=0)], 0).view(T_, K_, H_)
    torch.testing.assert_close(y, (rows * torch.nan_to_num(weights)[..., None]).sum(1), rtol=1e-12, atol=1e-12)
    assert torch.equal(returned[position.reshape(-1)], rows.reshape(-1, H_))


def test_rows_past_n_are_not_written_and_never_read(pool2, unwritten_as_nan):
    # The copy-out's outputs start as NaN (the fixture): routed's rows past n, and the same rows
    # of combine's backward (a dispatch of grad_y), stay NaN. The expert makes them NaN in
    # expert_out and in the gradient dispatch's backward gets; a second combine gets NaN and inf
    # there. y and every gradient must still be the collective backend's, bit for bit.
    W, T = pool2.world_size, 5
    expected = pool2.run(run_collective, T)
    buffers = a2a.SymmBuffers.simulated(W, T, H, K, E, dtype=torch.bfloat16, device="cpu", expert_alignment=2)

    def rank_fn(rank, bufs):
        x, topk_idx, weights, grad_y = _inputs(40, rank, T, torch.bfloat16, torch.float32)
        out = _step(x, topk_idx, weights, grad_y, backend="symm_mem", expert_alignment=2, buffers=bufs)
        R = int(out["tokens_per_expert"].sum())
        expert_out = _expert(out["routed"])
        expert_out[R:] = float("inf")
        expert_out[R::2] = float("nan")
        out["y_nan_inf"] = a2a.combine(expert_out, out["handle"], weights)
        return out

    for symm, coll in zip(symm_mem.run_simulated(rank_fn, buffers), expected):
        _assert_same_as_collective(symm, coll, buffers[0].capacity)
        R = int(coll["tokens_per_expert"].sum())
        assert torch.isnan(symm["routed"][R:]).all(), "the copy-out wrote rows past tokens_per_expert.sum()"
        assert torch.equal(symm["y_nan_inf"], coll["y"])
    assert min(unwritten_as_nan) > 0  # every copy-out, forward and backward, left rows unwritten


def test_barriers_of_a_step(monkeypatch):
    # The barriers a training step meets, in order, as (op, advancing the call number), on two
    # simulated ranks: the metadata exchange's before and after its put; each exchange's after
    # its writes and after its reads, and none before (tests/test_kernel_races.py shows that
    # each is needed). CUDA symmetric memory runs the same sequence, each barrier the epilogue
    # of the kernel before it.
    from alltoall_ops.backends.symm_mem.segments import COMBINE_OP, DISPATCH_OP, META_OP, _SimulatedSegments

    met = {0: [], 1: []}
    barrier = _SimulatedSegments.barrier

    def recording(self, op, call_1, advance=False, token=None):
        met[self._rank].append((op, advance))
        barrier(self, op, call_1, advance, token)

    monkeypatch.setattr(_SimulatedSegments, "barrier", recording)
    buffers = a2a.SymmBuffers.simulated(2, 5, H, K, E, dtype=torch.float64, device="cpu")

    def rank_fn(rank, bufs):
        x, topk_idx, weights, grad_y = _inputs(3, rank, 5, torch.float64, torch.float64)
        routed, _, handle = a2a.dispatch(x.requires_grad_(), topk_idx, num_experts=E, buffers=bufs)
        y = a2a.combine(_expert(routed), handle, weights)
        forward = list(met[rank])
        torch.autograd.grad(y, x, grad_y)
        return forward, met[rank][len(forward):]

    exchange = [(META_OP, True), (META_OP, False)]
    forward = [*exchange, (DISPATCH_OP, False), (DISPATCH_OP, False), (COMBINE_OP, False), (COMBINE_OP, False)]
    backward = [(DISPATCH_OP, False)] * 2 + [(COMBINE_OP, False)] * 2  # the combine's adjoint, then the dispatch's
    assert symm_mem.run_simulated(rank_fn, buffers) == [(forward, backward)] * 2


def test_simulated_rank_error_breaks_the_others_barriers():
    buffers = a2a.SymmBuffers.simulated(2, 3, H, K, E, dtype=torch.float32, device="cpu", timeout=30)

    def rank_fn(rank, bufs):
        if rank == 1:
            raise KeyError("rank 1 fails before the exchange")
        x, topk_idx, _, _ = _inputs(0, rank, 3, torch.float32, torch.float32)
        return a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)

    with pytest.raises(RuntimeError, match="simulated rank 1 raised KeyError"):
        symm_mem.run_simulated(rank_fn, buffers)


# --------------------------------------------------------------------------------------------
# Registrations and argument checks (one rank)


def _one_rank_call():
    bufs = a2a.SymmBuffers(5, H, K, E, dtype=torch.float64, device="cpu")
    x, topk_idx, weights, grad_y = _inputs(60, 0, 5, torch.float64, torch.float64)
    routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)
    return bufs, x, weights, grad_y, routed, handle, topk_idx


def test_opcheck():
    # test_schema is left out: it fails for any op with an opaque argument on torch 2.13.
    tests = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    bufs, x, weights, grad_y, routed, h, topk_idx = _one_rank_call()
    x, w = x.requires_grad_(), weights.requires_grad_()
    ops = symm_ops
    cases = [
        (ops.symm_exchange_meta_op, (topk_idx, bufs, 1)),
        (ops.symm_dispatch_op, (x, None, *h.slots)),
        (ops.symm_dispatch_op, (x, w.detach(), *h.slots)),
        (ops.symm_combine_op,
         (routed.requires_grad_(), w, *h.slots[:3], h.row_src_C, *h.slots[3:], True)),
        (ops.symm_combine_op,
         (routed, None, *h.slots[:3], h.row_src_C, *h.slots[3:], False)),
        (weight_grad_op,
         (grad_y, torch.randn(routed.shape[0], H, dtype=torch.float64), h.position_TK, w.detach())),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=tests)
    names = {op.name() for op in a2a.communication_ops()}
    assert set(SYMM_OPS) <= names  # the SAC policy and graph summaries see them


def test_weights_gradient_needs_save_returned():
    bufs, _, weights, grad_y, routed, h, _ = _one_rank_call()
    w = weights.requires_grad_()
    y, _ = symm_ops.symm_combine_op(routed, w, row_src_C=h.row_src_C, **h.slots.kwargs(), save_returned=False)
    with pytest.raises(RuntimeError, match="save_returned=False"):
        torch.autograd.grad(y, w, grad_y)


def test_argument_errors():
    bufs, x, weights, _, routed, handle, _ = _one_rank_call()
    topk_idx = torch.zeros(5, K, dtype=torch.int64)
    with pytest.raises(ValueError, match="x: the buffers hold torch.float64 rows of H = 6"):
        a2a.dispatch(x.float(), topk_idx, num_experts=E, buffers=bufs)
    with pytest.raises(ValueError, match="top_k = 2, got K = 3"):
        a2a.dispatch(x, torch.zeros(5, 3, dtype=torch.int64), num_experts=E, buffers=bufs)
    with pytest.raises(ValueError, match="created for E = 8, got 16"):
        a2a.dispatch(x, topk_idx, num_experts=16, buffers=bufs)
    with pytest.raises(ValueError, match="only backend='symm_mem' uses buffers"):
        a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs, backend="collective")
    with pytest.raises(TypeError, match="buffers: expected alltoall_ops.SymmBuffers"):
        a2a.dispatch(x, topk_idx, num_experts=E, buffers="bufs", backend="symm_mem")
    with pytest.raises(ValueError, match=r"expert_out: expected the torch.float64 shape \(C, H\) = \(10, 6\)"):
        a2a.combine(routed[:4], handle, weights)
    with pytest.raises(ValueError, match="overflow: expected one of"):
        a2a.SymmBuffers(5, H, K, E, dtype=torch.float64, device="cpu", overflow="wrap")
    with pytest.raises(ValueError, match="num_experts: expected a multiple"):
        a2a.SymmBuffers.simulated(3, 5, H, K, E, dtype=torch.float64, device="cpu")
    with pytest.raises(ValueError, match="capacity: expected a positive int"):
        a2a.SymmBuffers(5, H, K, E, dtype=torch.float64, device="cpu", capacity=0)


def test_import_without_triton():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # as if Triton were not installed
        import torch
        import alltoall_ops as a2a
        x = torch.randn(3, 4)
        a2a.combine(*a2a.dispatch(x, torch.zeros(3, 1, dtype=torch.int64), num_experts=2)[::2])
        try:
            a2a.SymmBuffers(3, 4, 1, 2, dtype=torch.float32, device="cpu")
        except ImportError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "backend='symm_mem' needs Triton: pip install 'alltoall_ops[triton]'" in out.stdout


# --------------------------------------------------------------------------------------------
# Second order: double backward through symm_mem is exact, like the local backend


def _second_order_layer(x, weights, topk_idx, bufs, scale):
    """dispatch -> tanh(routed * scale[expert of the row]) -> combine; scale: (e, H), fixed."""
    routed, tokens_per_expert, handle = a2a.dispatch(x, topk_idx, num_experts=E, expert_alignment=2, buffers=bufs)
    return a2a.combine(_scaled_tanh(routed, tokens_per_expert, scale), handle, weights)


def test_second_order_gradients_one_rank(unwritten_as_nan):
    # Double backward reaches dispatch's scale (combine's backward dispatches grad_y scaled by the
    # weights), combine's returned rows and the weights' gradient op. Rows past
    # tokens_per_expert.sum() hold NaN (the fixture): no gradient of any order may read them.
    T = 4
    bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.float64, device="cpu", expert_alignment=2)
    x, topk_idx, weights, _ = _inputs(90, 0, T, torch.float64, torch.float64)
    scale = torch.randn(E, H, dtype=torch.float64, generator=torch.Generator().manual_seed(90))

    def layer(x, weights):
        return _second_order_layer(x, weights, topk_idx, bufs, scale)

    inputs = (x.requires_grad_(), weights.requires_grad_())
    assert torch.autograd.gradcheck(layer, inputs)
    assert torch.autograd.gradgradcheck(layer, inputs)


def test_second_order_gradients_simulated_two_ranks(unwritten_as_nan):
    # gradgradcheck perturbs one input element at a time on one rank, which its peer cannot
    # follow. Instead every rank moves its inputs (x, weights, grad_y) along its own direction v
    # at once: the central difference of the first-order gradients of L = sum_r <y_r, grad_y_r>
    # is the Hessian-vector product H v, which double backward gives exactly (H is symmetric).
    # Rows past tokens_per_expert.sum() hold NaN (the fixture), as in the one-rank test.
    W, T, eps = 2, 4, 1e-6
    bufs = a2a.SymmBuffers.simulated(W, T, H, K, E, dtype=torch.float64, device="cpu",
                                     expert_alignment=2, timeout=60)
    scale = torch.randn(E // W, H, dtype=torch.float64, generator=torch.Generator().manual_seed(91))

    def point(rank):
        x, topk_idx, weights, grad_y = _inputs(91, rank, T, torch.float64, torch.float64)
        g = torch.Generator().manual_seed(92 + rank)
        v = [torch.randn(t.shape, dtype=t.dtype, generator=g) for t in (x, weights, grad_y)]
        return topk_idx, [x, weights, grad_y], v

    def gradients(rank, b, step=0.0, hessian_vector=False):
        topk_idx, theta, v = point(rank)
        theta = [(t + step * d).requires_grad_() for t, d in zip(theta, v)]
        y = _second_order_layer(theta[0], theta[1], topk_idx, b, scale)
        g = torch.autograd.grad((y * theta[2]).sum(), theta, create_graph=hessian_vector)
        return torch.autograd.grad(g, theta, v) if hessian_vector else g

    analytic = symm_mem.run_simulated(partial(gradients, hessian_vector=True), bufs)
    plus = symm_mem.run_simulated(partial(gradients, step=eps), bufs)
    minus = symm_mem.run_simulated(partial(gradients, step=-eps), bufs)
    for rank in range(W):
        for i, name in enumerate(("x", "weights", "grad_y")):
            numeric = (plus[rank][i] - minus[rank][i]) / (2 * eps)
            torch.testing.assert_close(analytic[rank][i], numeric, rtol=1e-6, atol=1e-7,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank}, H v for {name}: {m}")


def test_opcheck_second_order_paths():
    # The autograd paths that only double backward takes: dispatch's scale, weight_grad's inputs.
    tests = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    bufs, x, weights, grad_y, routed, h, _ = _one_rank_call()
    returned = torch.randn(h.position_TK.numel(), H, dtype=torch.float64)
    cases = [
        (symm_ops.symm_dispatch_op,
         (x.requires_grad_(), weights.requires_grad_(), *h.slots)),
        (weight_grad_op,
         (grad_y.requires_grad_(), returned.requires_grad_(), h.position_TK, weights.detach())),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=tests)


def test_compiled_code_names_buffers_with_their_addresses():
    # Compiled code with the symm_mem ops inlined (CUDA) holds the buffers' address tables as
    # constants, and AOTAutograd's disk cache keys a graph on the buffers' repr: two allocations of
    # one configuration must never share a key, or a cache hit in another process would run on
    # the first process's addresses.
    a, b = (a2a.SymmBuffers(4, 8, 2, 4, dtype=torch.float32, device="cpu") for _ in range(2))
    (repr_a, _), (repr_b, _) = a.__fx_repr__(), b.__fx_repr__()
    assert repr_a.split(",", 1)[1] != repr_b.split(",", 1)[1], "one key for two allocations"
    assert str(a._segments.bases[0]) in repr_a
    assert a2a.SymmBuffers._compiled(a._key, a._config_key) is a


def test_compiled_code_names_whether_the_ops_were_inlined(monkeypatch):
    # ALLTOALL_OPS_INLINE_SYMMETRIC is read while AOTAutograd traces, after the compile caches
    # computed their key from the graph dynamo made (where the buffers are their repr): on the
    # H200 a graph traced with the ops opaque was served from the cache to a trace that asked
    # for them inlined. The switch is part of the buffers' repr and pickle.
    import pickle

    from alltoall_ops.backends.symm_mem.segments import _CudaSymmetricSegments

    bufs = a2a.SymmBuffers(4, 8, 2, 4, dtype=torch.float32, device="cpu")
    reprs, pickles = [], []
    for inline in (False, True):
        monkeypatch.setattr(type(bufs._segments), "device_ordered", inline, raising=False)
        with a2a.testing.inline_symmetric(inline):
            assert object.__new__(_CudaSymmetricSegments).device_ordered is inline
        reprs.append(bufs.__fx_repr__()[0])
        pickles.append(pickle.dumps(bufs))
        assert reprs[-1].endswith(f"inlined={inline})")
        assert a2a.SymmBuffers._compiled(bufs._key, bufs._config_key, inlined=inline) is bufs
    assert reprs[0] != reprs[1] and pickles[0] != pickles[1]


def test_which_calls_are_inlined(monkeypatch):
    # Compiled code inlines a symm_mem op's body only on CUDA, where the barriers are device work
    # (one rank's plain memory; CUDA symmetric memory unless ALLTOALL_OPS_INLINE_SYMMETRIC=0), and
    # never an fp8 dispatch with peers (it encodes into a tensor of the buffers, not an address).
    from types import SimpleNamespace

    from alltoall_ops.backends.symm_mem.segments import _CudaSymmetricSegments

    symmetric = object.__new__(_CudaSymmetricSegments)  # its device_ordered only: no GPU here

    def inlined(device, segments, peer_path, **call):
        bufs = SimpleNamespace(device=torch.device(device), _segments=segments, peer_path=peer_path)
        return symm_ops._inlined({"buffers": bufs, **call})

    one_rank = SimpleNamespace(device_ordered=True)
    assert inlined("cuda", one_rank, False) and inlined("cuda", one_rank, False, payload="fp8")
    assert not inlined("cpu", one_rank, False)
    monkeypatch.setenv("ALLTOALL_OPS_INLINE_SYMMETRIC", "0")
    assert not inlined("cuda", symmetric, True)
    monkeypatch.delenv("ALLTOALL_OPS_INLINE_SYMMETRIC")  # the default
    assert inlined("cuda", symmetric, True) and inlined("cuda", symmetric, True, payload="plain")
    assert not inlined("cuda", symmetric, True, payload="fp8")
    monkeypatch.setenv("ALLTOALL_OPS_INLINE_SYMMETRIC", "1")
    assert inlined("cuda", symmetric, True)
    simulated = a2a.SymmBuffers.simulated(2, 4, 8, 2, 4, dtype=torch.float32, device="cpu")[0]
    assert not simulated._segments.device_ordered  # a thread barrier: Python between the kernels


def test_ops_on_one_buffers_share_their_token_while_traced():
    # Inlined, every kernel of every op on one buffers object sets one token in the graph, so
    # inductor keeps them in program order (two independent exchanges on one buffers object must
    # not interleave); eager ops take fresh ones (the stream orders them). Each trace its own.
    from torch.fx.experimental.proxy_tensor import make_fx

    bufs, other = (a2a.SymmBuffers(4, 8, 2, 4, dtype=torch.float32, device="cpu") for _ in range(2))
    seen = []

    def traced(x):
        first, again, others = (symm_ops._token(b, x.device) for b in (bufs, bufs, other))
        seen.append((first, first is again, first is others))
        return x + 1

    for _ in range(2):
        make_fx(traced)(torch.zeros(1))
    assert [shared for _, shared, _ in seen] == [True, True] and not any(o for _, _, o in seen)
    assert seen[0][0] is not seen[1][0], "a token outlived its trace"
    cpu = torch.device("cpu")
    assert symm_ops._token(bufs, cpu) is not symm_ops._token(bufs, cpu)


# --------------------------------------------------------------------------------------------
# Bytes a dispatch writes (issue 38): each routed row once, and with peers each token once more


@pytest.mark.parametrize("W", [1, 2])
@pytest.mark.parametrize("payload_dtype", [None, fp8.FP8])
def test_a_dispatch_writes_each_row_once(W, payload_dtype):
    # Every kernel's stores and every torch op's outputs, over the payload (each valid slot's row
    # once). The pull writes each routed row once into routed; with peers each token's row goes
    # once more into its sender's stage (1/K of the payload); an fp8 token's wire row is written
    # once (1/K): by the quantize on one rank, with peers by the post, which quantizes it straight
    # into the stage (no quantize beside it, no copy after it). Left: the tags and row_src (32
    # bytes a row of 2048 here) and the CPU plan's torch ops. Writing each row twice (a put into
    # the receiver's buffer, then a copy-out) is 2x and more.
    from tools.bytes_written import dispatch_bytes

    K = 8
    written, payload = dispatch_bytes(W, K, payload_dtype)
    rows_once = 1 + (1 / K if W > 1 or payload_dtype is not None else 0)
    slack = 0.08 if payload_dtype is None else 0.12  # fp8 rows are about half as wide: the per-row rest weighs 2x
    assert sum(written.values()) / payload < rows_once + slack, written.most_common(5)
    assert written["_pull_rows_kernel"] / payload < 1.03, "a routed row written more than once"
    if payload_dtype is not None:
        wire = written["_post_slots_kernel" if W > 1 else "_quantize_rows_kernel"]  # the post: the tags too
        assert wire / payload < 1 / K + 0.03, written.most_common(5)
        assert W == 1 or not written["_quantize_rows_kernel"], "wire rows quantized apart from the post"
