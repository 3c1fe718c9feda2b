"""The expert-parallel MoE block of ``alltoall_ops.moe`` against its dense single-process
reference: fp64 forward and gradients (x, router, experts) at W = 1, 2, 4, uneven token counts,
a rank with no tokens, ranks that receive no rows; then under torch.compile(fullgraph=True): one
compilation across steps with different routing, results equal to eager, and the comm ops of
the compiled graphs pinned. The block with a shared expert (plain and gated) against the dense
block's on fresh seeds: eager on 1 and 2 ranks, compiled once across routings, and under the SAC
policy.

Functions run on ranks are module-level (they travel to the pool's processes by reference).
Every rank builds the same dense block and every rank's tokens from the test's seed, so each
holds the global view the reference needs."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
import torch._dynamo.testing
import torch.distributed as dist
from expecttest import TestCase
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from alltoall_ops.checkpoint import sac_policy
from alltoall_ops.inspect import compiled_graphs
from alltoall_ops.moe import DenseMoE, MoE
from alltoall_ops import SymmBuffers

H, F, E, K = 16, 24, 8, 2
FS = 20  # the shared expert's FFN width
FP64_TOL = {"rtol": 1e-10, "atol": 1e-12}  # only summation order differs from the reference
SHARED = {None: {}, "plain": {"shared_ffn_size": FS}, "gated": {"shared_ffn_size": FS, "gated_shared_expert": True}}
"""The shared-expert variants by name: DenseMoE's keyword arguments."""


def make_dense(seed: int, activation: str = "swiglu", dtype=torch.float64, skew: bool = False,
               shared: str | None = None) -> DenseMoE:
    """The dense block every rank builds alike. skew: route every token to experts 0 and 1 only
    (rank 0's), so that the other ranks receive no rows (inputs must be positive, see make_tokens).
    shared: a key of SHARED (the router and routed experts are the same for every key)."""
    torch.manual_seed(seed)
    dense = DenseMoE(H, F, E, K, activation=activation, dtype=dtype, **SHARED[shared])
    if skew:
        with torch.no_grad():
            w = dense.router.proj.weight  # (E, H)
            w.abs_()
            w[2:] = 0.0  # experts 2.. get logit 0; experts 0, 1 positive logits for positive x
    return dense


def make_tokens(seed: int, tokens: tuple[int, ...], dtype=torch.float64, positive: bool = False):
    """All ranks' tokens x (sum(tokens), H) and an output cotangent g of the same shape."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sum(tokens), H, generator=gen, dtype=torch.float64)
    if positive:
        x = x.abs() + 0.1
    g = torch.randn(sum(tokens), H, generator=gen, dtype=torch.float64)
    return x.to(dtype), g.to(dtype)


def fresh_seed() -> int:
    """A new seed on every run (the checks name it in a failure)."""
    return random.randrange(2**31)


def check_step(fn, moe: MoE, dense: DenseMoE, rank: int, world_size: int, tokens, seed: int,
               positive: bool = False) -> torch.Tensor:
    """One step of ``fn`` (moe itself, compiled or checkpointed) on rank ``rank``'s tokens against
    the dense block on the tokens of all ranks, the loss sum over ranks of <y_r, g_r>: y, x's
    gradient and every parameter's (the replicated ones, router and shared expert, summed over
    the ranks as in data parallelism; the experts' against their slice). Returns all ranks' x."""
    x_all, g_all = make_tokens(seed, tokens, positive=positive)
    start = sum(tokens[:rank])
    rows = slice(start, start + tokens[rank])
    moe.zero_grad(set_to_none=True)
    dense.zero_grad(set_to_none=True)

    x_ref = x_all.clone().requires_grad_()
    y_ref = dense(x_ref)
    (y_ref * g_all).sum().backward()

    x = x_all[rows].clone().requires_grad_()
    y = fn(x)
    (y * g_all[rows]).sum().backward()
    for p in moe.replicated_parameters():
        if world_size > 1:
            dist.all_reduce(p.grad)

    def close(got, want, what):
        torch.testing.assert_close(got, want, **FP64_TOL, msg=lambda m: f"{what} (seed {seed}): {m}")

    close(y, y_ref[rows].detach(), "forward")
    close(x.grad, x_ref.grad[rows], "x.grad")
    dense_params = dict(dense.named_parameters())
    assert [name for name, _ in moe.named_parameters()] == list(dense_params)
    experts = {id(p) for p in moe.expert_parameters()}
    local = moe.local_expert_slice()
    for name, p in moe.named_parameters():
        want = dense_params[name].grad
        close(p.grad, want[local] if id(p) in experts else want, f"grad of {name}")
    # The gradients checked are not trivially zero: the replicated ones, and x's of a rank with tokens.
    if sum(tokens):
        for p in moe.replicated_parameters():
            assert p.grad.abs().max() > 1e-3
    if tokens[rank]:
        assert x.grad.abs().max() > 1e-3
    return x_all


def ep_vs_dense(rank, world_size, tokens, seed, activation="swiglu", alignment=1, backend="auto", skew=False,
                expert_impl="auto", shared=None):
    """Forward and gradients of rank ``rank``'s MoE block against the dense block's on the
    tokens of all ranks (:func:`check_step`). Returns (T_r, R_r)."""
    dense = make_dense(seed, activation, skew=skew, shared=shared)
    buffers = None
    if backend == "symm_mem":  # collective: every rank creates its buffers
        buffers = SymmBuffers(max(tokens), H, K, E, dtype=torch.float64, device="cpu", expert_alignment=alignment)
    moe = MoE.from_dense(dense, backend=backend, expert_alignment=alignment, buffers=buffers, expert_impl=expert_impl)
    x_all = check_step(moe, moe, dense, rank, world_size, tokens, seed, positive=skew)

    # How many rows this rank's experts received: lets the caller check the scenario happened.
    idx, _ = dense.router(x_all)
    local = moe.local_expert_slice()
    local_ids = idx[(idx >= local.start) & (idx < local.stop)]
    return tokens[rank], int(local_ids.numel())


# --------------------------------------------------------------------------------------------
# Eager, fp64, against the dense reference


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("alignment", [1, 4])
@pytest.mark.parametrize("backend", ["auto", "local"])
def test_single_process_matches_dense(activation, alignment, backend):
    assert not dist.is_initialized()
    T, R = ep_vs_dense(0, 1, (13,), seed=1, activation=activation, alignment=alignment, backend=backend)
    assert (T, R) == (13, 13 * K)


def test_single_process_zero_tokens():
    assert ep_vs_dense(0, 1, (0,), seed=2) == (0, 0)


@pytest.mark.parametrize(
    "tokens, activation, alignment",
    [((5, 11), "swiglu", 1), ((0, 9), "gelu", 3), ((12, 0), "swiglu", 4)],
)
def test_two_ranks_match_dense(pool2, tokens, activation, alignment):
    results = pool2.run(ep_vs_dense, tokens, 10, activation=activation, alignment=alignment)
    assert [t for t, _ in results] == list(tokens)
    assert sum(r for _, r in results) == sum(tokens) * K  # every slot routed somewhere


def test_two_ranks_symm_mem_match_dense(pool2):
    """The block on the device-side backend: routed has the buffers' fixed capacity, and the
    rows past tokens_per_expert.sum() belong to no expert."""
    results = pool2.run(ep_vs_dense, (6, 0), 40, alignment=2, backend="symm_mem")
    assert [t for t, _ in results] == [6, 0]
    assert sum(r for _, r in results) == 6 * K


def test_symm_mem_masked_experts_ignore_unwritten_rows(unwritten_as_nan):
    """symm_mem leaves routed's rows past tokens_per_expert.sum() unwritten (NaN here, the
    fixture), and the same rows of the experts' output gradient: the "masked" experts run on
    every row, yet neither y nor a gradient (x, router, experts' weights) may see them."""
    assert ep_vs_dense(0, 1, (13,), 3, alignment=4, backend="symm_mem", expert_impl="masked") == (13, 13 * K)
    assert min(unwritten_as_nan) > 0


@pytest.mark.parametrize(
    "tokens, activation, alignment",
    [((7, 0, 12, 3), "swiglu", 1), ((4, 9, 0, 6), "gelu", 2), ((3, 3, 3, 3), "swiglu", 4)],
)
def test_four_ranks_match_dense(pool4, tokens, activation, alignment):
    results = pool4.run(
        ep_vs_dense, tokens, 20, activation=activation, alignment=alignment, backend="collective"
    )
    assert [t for t, _ in results] == list(tokens)
    assert sum(r for _, r in results) == sum(tokens) * K


def test_four_ranks_all_rows_to_rank_zero(pool4):
    """Every token picks experts 0 and 1: ranks 1..3 receive no rows but still send theirs."""
    tokens = (5, 8, 0, 6)
    results = pool4.run(ep_vs_dense, tokens, 30, alignment=2, skew=True)
    assert [r for _, r in results] == [sum(tokens) * K, 0, 0, 0]


def test_grouped_mm_matches_masked_fp32():
    """expert_impl="grouped_mm" (torch._grouped_mm, fp32 on CPU) computes what "masked" does."""
    dense = make_dense(40, dtype=torch.float32)
    x, g = make_tokens(40, (21,), dtype=torch.float32)
    results = []
    for impl in ("masked", "grouped_mm"):
        moe = MoE.from_dense(dense, expert_impl=impl, expert_alignment=4)
        xi = x.clone().requires_grad_()
        (moe(xi) * g).sum().backward()
        results.append([xi.grad] + [p.grad for p in moe.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# The demo: single process eager, and two compiled ranks with Ulysses attention


def test_demo_single_process_passes(capsys):
    from examples import demo

    argv = ["--world-size", "1", "--steps", "2", "--compile-backend", "none", "--dtype", "float64"]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 3 and "FAIL" not in out


def test_demo_two_ranks_with_ulysses_attention(pool2):
    from examples import demo

    args = demo.parse_args(["--world-size", "2", "--steps", "2", "--ulysses", "--heads", "4"])
    assert pool2.run(demo.run_rank, args) == [True, True]


def test_demo_fails_on_a_wrong_expert(monkeypatch, capsys):
    """The demo's check can fail: an expert output off by 0.1% must be reported and exit 1."""
    from examples import demo

    experts = MoE.experts
    monkeypatch.setattr(MoE, "experts", lambda self, x, t: experts(self, x, t) * 1.001)
    assert demo.main(["--world-size", "1", "--steps", "1", "--compile-backend", "none"]) == 1
    assert "FAIL" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True)


def compiled_vs_eager(rank, world_size, tokens, seed, backend="aot_eager", alignment=1, steps=3):
    """Compile rank ``rank``'s block once with fullgraph=True and run ``steps`` steps on fresh
    tokens (so different routing); each step's output and gradients must equal eager's.
    Returns (compilations, [(R of this rank, all ranks' topk_idx)] per step)."""
    torch._dynamo.reset()
    dense = make_dense(seed)
    moe = MoE.from_dense(dense, expert_alignment=alignment)
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(moe, backend=counter, fullgraph=True)
    tol = FP64_TOL if backend == "inductor" else {"rtol": 0, "atol": 0}
    received = []
    for step in range(steps):
        x_all, g_all = make_tokens(seed + 100 * step, tokens)
        start = sum(tokens[:rank])
        x, g = x_all[start : start + tokens[rank]], g_all[start : start + tokens[rank]]
        grads = []
        for fn in (moe, compiled):
            moe.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            y = fn(xi)
            (y * g).sum().backward()
            grads.append([y.detach(), xi.grad] + [p.grad for p in moe.parameters()])
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a, **tol)
        idx, _ = moe.router(x_all)
        local = moe.local_expert_slice()
        per_expert = torch.bincount(idx.flatten(), minlength=E)[local]
        num_rows = int((-(-per_expert // alignment) * alignment).sum())  # R, padding included
        received.append((num_rows, idx.tolist()))
    return counter.frame_count, received


def assert_routing_varied(steps_per_rank):
    """The steps routed differently, and some rank's R (an unbacked size) changed."""
    routings = [str(idx) for _, idx in steps_per_rank[0]]
    assert len(set(routings)) == len(routings)
    received = {tuple(rows for rows, _ in step) for step in zip(*steps_per_rank)}
    assert len(received) > 1


def test_compiled_single_process_one_compilation():
    frames, steps = compiled_vs_eager(0, 1, (17,), seed=50, alignment=4)
    assert frames == 1
    assert_routing_varied([steps])


def test_compiled_two_ranks_one_compilation(pool2):
    results = pool2.run(compiled_vs_eager, (9, 14), 62, alignment=2)
    assert [frames for frames, _ in results] == [1, 1]
    assert_routing_varied([steps for _, steps in results])


def test_compiled_inductor_single_process():
    frames, _ = compiled_vs_eager(0, 1, (12,), seed=70, backend="inductor", alignment=2, steps=2)
    assert frames == 1


def summary_of(rank, world_size, seed=80):
    torch._dynamo.reset()
    moe = MoE.from_dense(make_dense(seed))
    x, _ = make_tokens(seed, (6,))
    return compiled_graphs(moe, x.requires_grad_()).summary()


class TestCompiledGraphs(TestCase):
    @pytest.fixture(autouse=True)
    def _pool(self, pool2):
        self.pool2 = pool2

    def test_summary_single_process(self):
        self.assertExpectedInline(summary_of(0, 1), """\
forward 0:
  alltoall_ops.local_dispatch(scale_TK=None)
  alltoall_ops.local_combine(weights_TK=<tensor>)
backward 0:
  alltoall_ops.local_dispatch(scale_TK=<tensor>)
  alltoall_ops.local_combine(weights_TK=None)""")

    def test_summary_two_ranks(self):
        summaries = self.pool2.run(summary_of)
        self.assertEqual(summaries[0], summaries[1])
        self.assertExpectedInline(summaries[0], """\
forward 0:
  alltoall_ops.exchange_routing(group_name='0', header=[0, 8, 16, 1, 1, 2, 1], expert_alignment=1)
  alltoall_ops.dispatch(scale_TK=None, expert_alignment=1, group_name='0', num_rows=None)
  alltoall_ops.combine(weights_TK=<tensor>, expert_alignment=1, group_name='0', save_returned=True)
backward 0:
  alltoall_ops.dispatch(scale_TK=<tensor>, expert_alignment=1, group_name='0', num_rows=<symbolic>)
  alltoall_ops.combine(weights_TK=None, expert_alignment=1, group_name='0', save_returned=False)""")


# --------------------------------------------------------------------------------------------
# A shared expert (plain and gated), on fresh seeds


def test_shared_expert_weights_and_contribution():
    """A seed gives the router and routed experts the same weights with a shared expert or
    without, and MoE (one rank) the same weights as DenseMoE; the shared expert changes the
    output, and so does its gate."""
    seed = fresh_seed()
    blocks = {name: make_dense(seed, shared=name) for name in SHARED}
    torch.manual_seed(seed)
    moe = MoE(H, F, E, K, dtype=torch.float64, backend="local", **SHARED["gated"])
    for name, block in [*blocks.items(), ("MoE", moe)]:
        for key, w in blocks[None].state_dict().items():
            assert torch.equal(block.state_dict()[key], w), (name, key, seed)
    for key, w in blocks["plain"].state_dict().items():  # gated adds w_output_gate only
        assert torch.equal(blocks["gated"].state_dict()[key], w), (key, seed)
    assert torch.equal(moe.shared_expert.w_output_gate, blocks["gated"].shared_expert.w_output_gate)
    assert dict(blocks["gated"].shared_expert.named_parameters()).keys() == {"w_gate", "w_up", "w_down",
                                                                              "w_output_gate"}
    x, _ = make_tokens(seed, (9,))
    with torch.no_grad():
        ys = {name: block(x) for name, block in blocks.items()}
    for a, b in [(None, "plain"), (None, "gated"), ("plain", "gated")]:
        assert (ys[a] - ys[b]).abs().max() > 1e-3, (a, b, seed)
    torch.testing.assert_close(ys["plain"] - ys[None], blocks["plain"].shared_expert(x), rtol=1e-12, atol=1e-12)


def test_shared_expert_arguments():
    with pytest.raises(ValueError, match="gated_shared_expert=True needs a shared expert"):
        DenseMoE(H, F, E, K, gated_shared_expert=True)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="shared_ffn_size: expected a positive int or None"):
            DenseMoE(H, F, E, K, shared_ffn_size=bad)
    for cls in (DenseMoE, MoE):
        for shared in ({}, {"shared_ffn_size": FS}):  # a string is no bool, with or without a shared expert
            with pytest.raises(TypeError, match="gated_shared_expert: expected a bool, got 'no'"):
                cls(H, F, E, K, gated_shared_expert="no", **shared)
    moe = MoE(H, F, E, K, backend="local")
    with pytest.raises(ValueError, match="one block has a shared expert, the other none"):
        moe.load_dense_parameters(DenseMoE(H, F, E, K, shared_ffn_size=FS))


@pytest.mark.parametrize("shared", ["plain", "gated"])
def test_shared_expert_single_process_matches_dense(shared):
    T, R = ep_vs_dense(0, 1, (13,), fresh_seed(), alignment=4, backend="local", shared=shared)
    assert (T, R) == (13, 13 * K)


@pytest.mark.parametrize("shared, tokens", [("plain", (5, 11)), ("gated", (0, 9))])
def test_shared_expert_two_ranks_match_dense(pool2, shared, tokens):
    results = pool2.run(ep_vs_dense, tokens, fresh_seed(), alignment=3, backend="collective", shared=shared)
    assert [t for t, _ in results] == list(tokens)
    assert sum(r for _, r in results) == sum(tokens) * K


def rows_per_rank(topk_idx, world_size: int, alignment: int) -> tuple[int, ...]:
    """Each rank's R (padding included) for all ranks' topk_idx."""
    per_expert_We = torch.bincount(topk_idx.flatten(), minlength=E).view(world_size, -1)
    return tuple((-(-per_expert_We // alignment) * alignment).sum(1).tolist())


def selective_checkpoint(moe: MoE, x_TH: torch.Tensor) -> torch.Tensor:
    """moe(x_TH) under the SAC policy: comm ops saved, everything else recomputed in backward."""
    context_fn = partial(create_selective_checkpoint_contexts, sac_policy())
    return checkpoint(moe, x_TH, use_reentrant=False, context_fn=context_fn)


def shared_expert_steps(rank, world_size, tokens, seed, shared, compiler="aot_eager", sac=False, alignment=2,
                        min_steps=3, max_steps=10):
    """The block with a shared expert (local backend on one rank, collective on more) compiled
    once with fullgraph=True (compiler None: eager) and, with sac, under the SAC policy (the
    checkpoint inside the compiled function), against the dense block at every step (check_step),
    each step on fresh tokens, so new routing: min_steps, and more, up to max_steps, until some
    rank's R has changed. Returns (frames compiled, [(every rank's R, all ranks' topk_idx)] per step)."""
    torch._dynamo.reset()
    dense = make_dense(seed, shared=shared)
    moe = MoE.from_dense(dense, backend="local" if world_size == 1 else "collective", expert_alignment=alignment)
    block = partial(selective_checkpoint, moe) if sac else moe
    counter = torch._dynamo.testing.CompileCounterWithBackend(compiler or "eager")
    fn = torch.compile(block, backend=counter, fullgraph=True) if compiler else block
    steps = []
    while len(steps) < min_steps or (len({rows for rows, _ in steps}) == 1 and len(steps) < max_steps):
        x_all = check_step(fn, moe, dense, rank, world_size, tokens, seed + 100 * len(steps))
        idx, _ = dense.router(x_all)
        steps.append((rows_per_rank(idx, world_size, alignment), idx.tolist()))
    return counter.frame_count, steps


def assert_one_compilation_across_routings(results, compiled=True):
    """Every rank compiled once; the steps routed differently and some rank's R changed."""
    assert [frames for frames, _ in results] == [int(compiled)] * len(results)
    steps = results[0][1]
    assert all(rank_steps == steps for _, rank_steps in results)  # the global view, the same everywhere
    assert len({str(idx) for _, idx in steps}) == len(steps)
    assert len({rows for rows, _ in steps}) > 1


@pytest.mark.parametrize("shared, compiler", [("plain", "aot_eager"), ("gated", "inductor")])
def test_shared_expert_compiled_single_process(shared, compiler):
    assert_one_compilation_across_routings([shared_expert_steps(0, 1, (17,), fresh_seed(), shared, compiler)])


def test_shared_expert_compiled_two_ranks(pool2):
    assert_one_compilation_across_routings(pool2.run(shared_expert_steps, (9, 14), fresh_seed(), "gated"))


def sac_backward_graphs(rank, world_size, seed):
    """Comm ops and sigmoid calls of the compiled backward graph of the block with a gated shared
    expert, without checkpointing (False) and under the SAC policy (True)."""
    moe = MoE.from_dense(make_dense(seed, shared="gated"), backend="local" if world_size == 1 else "collective")
    x, _ = make_tokens(seed, (5,))
    found = {}
    for sac in (False, True):
        torch._dynamo.reset()
        graphs = compiled_graphs(partial(selective_checkpoint, moe) if sac else moe, x.clone().requires_grad_())
        sigmoids = [n for gm in graphs.backward for n in gm.graph.nodes if n.target is torch.ops.aten.sigmoid.default]
        found[sac] = (graphs.comm_ops("backward"), len(sigmoids))
    return found


@pytest.mark.parametrize("world_size", [1, 2])
def test_shared_expert_selective_checkpoint_compiled(pool2, world_size):
    """Under the SAC policy, compiled: the results equal the dense block's at every step; the
    backward graph recomputes the output gate's sigmoid but runs no more comm ops than without
    checkpointing."""
    tokens, shared, seed = ((11,), "gated", fresh_seed()) if world_size == 1 else ((6, 8), "plain", fresh_seed())
    if world_size == 1:
        results = [shared_expert_steps(0, 1, tokens, seed, shared, sac=True)]
        found = [sac_backward_graphs(0, 1, seed)]
    else:
        results = pool2.run(shared_expert_steps, tokens, seed, shared, sac=True)
        found = pool2.run(sac_backward_graphs, seed)
    assert_one_compilation_across_routings(results)
    for rank_found in found:
        (plain_comm, plain_sigmoids), (sac_comm, sac_sigmoids) = rank_found[False], rank_found[True]
        assert sac_comm == plain_comm and len(plain_comm) == 2, rank_found
        assert sac_sigmoids > plain_sigmoids, rank_found
