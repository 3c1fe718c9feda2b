"""The expert-parallel MoE block of ``alltoall_ops.moe`` against its dense single-process
reference: fp64 forward and gradients (x, router, experts) at W = 1, 2, 4, uneven token counts,
a rank with no tokens, ranks that receive no rows; then under torch.compile(fullgraph=True): one
compilation across steps with different routing, results equal to eager, and the comm ops of
the compiled graphs pinned.

Functions run on ranks are module-level (they travel to the pool's processes by reference).
Every rank builds the same dense block and every rank's tokens from the test's seed, so each
holds the global view the reference needs."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
import torch.distributed as dist
from expecttest import TestCase

from alltoall_ops.inspect import compiled_graphs
from alltoall_ops.moe import DenseMoE, MoE
from alltoall_ops import SymmBuffers

H, F, E, K = 16, 24, 8, 2
FP64_TOL = {"rtol": 1e-10, "atol": 1e-12}  # only summation order differs from the reference


def make_dense(seed: int, activation: str = "swiglu", dtype=torch.float64, skew: bool = False) -> DenseMoE:
    """The dense block every rank builds alike. skew: route every token to experts 0 and 1 only
    (rank 0's), so that the other ranks receive no rows (inputs must be positive, see make_tokens)."""
    torch.manual_seed(seed)
    dense = DenseMoE(H, F, E, K, activation=activation, dtype=dtype)
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


def ep_vs_dense(rank, world_size, tokens, seed, activation="swiglu", alignment=1, backend="auto", skew=False,
                expert_impl="auto"):
    """Forward and gradients of rank ``rank``'s MoE block against the dense block's on the
    tokens of all ranks; the loss is sum over ranks of <y_r, g_r>. Returns (T_r, R_r)."""
    dense = make_dense(seed, activation, skew=skew)
    buffers = None
    if backend == "symm_mem":  # collective: every rank creates its buffers
        buffers = SymmBuffers(max(tokens), H, K, E, dtype=torch.float64, device="cpu", expert_alignment=alignment)
    moe = MoE.from_dense(dense, backend=backend, expert_alignment=alignment, buffers=buffers, expert_impl=expert_impl)
    x_all, g_all = make_tokens(seed, tokens, positive=skew)
    start = sum(tokens[:rank])
    rows = slice(start, start + tokens[rank])

    x_ref = x_all.clone().requires_grad_()
    y_ref = dense(x_ref)
    (y_ref * g_all).sum().backward()

    x = x_all[rows].clone().requires_grad_()
    y = moe(x)
    (y * g_all[rows]).sum().backward()
    for p in moe.replicated_parameters():  # the router: data-parallel, sum over ranks
        if world_size > 1:
            dist.all_reduce(p.grad)

    torch.testing.assert_close(y, y_ref[rows].detach(), **FP64_TOL)
    torch.testing.assert_close(x.grad, x_ref.grad[rows], **FP64_TOL)
    torch.testing.assert_close(moe.router.proj.weight.grad, dense.router.proj.weight.grad, **FP64_TOL)
    local = moe.local_expert_slice()
    for mine, full in zip(moe.expert_parameters(), dense.expert_parameters()):
        torch.testing.assert_close(mine.grad, full.grad[local], **FP64_TOL)
    # The gradients checked are not trivially zero: the router's, and x's of a rank with tokens.
    if sum(tokens):
        assert moe.router.proj.weight.grad.abs().max() > 1e-3
    if tokens[rank]:
        assert x.grad.abs().max() > 1e-3

    # How many rows this rank's experts received: lets the caller check the scenario happened.
    idx, _ = dense.router(x_all)
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
