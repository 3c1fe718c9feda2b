"""``alltoall_ops.torchtitan.TokenDispatcher`` inside torchtitan's own MoE (torchtitan 0.3.0:
``torchtitan.models.common.moe.MoE`` with its ``TokenChoiceTopKRouter``, ``RoutedExperts``,
``GroupedExperts`` and shared experts: ``FeedForward``, ``SigmoidGatedFeedForward`` (Qwen3-Next's
gated shared expert) or none), on 1, 2 and 4 gloo ranks, against the same MoE in one process
(torchtitan's ``LocalTokenDispatcher``, all experts, every rank's tokens) and against
torchtitan's own ``AllToAllTokenDispatcher`` on the same ranks: forward and every gradient in
fp64, eager and compiled (aot_eager; inductor on two ranks), one compilation across routings.
Our dispatcher runs over the local / collective backends and, on 1 and 2 ranks, over symm_mem
(``SymmBuffers`` made on every rank before compiling; its routed rows past
``tokens_per_expert.sum()`` NaN under ``nan_unwritten_rows()``, and checked present). Then
``alltoall_ops.moe``'s own block (and its dense reference) with a shared expert, plain and
gated, against torchtitan's MoE holding the same weights.

Expert parallelism is set up as torchtitan's ``RoutedExperts.parallelize`` leaves it: each rank
holds the experts' dim-0 shard ``[r*e, (r+1)*e)`` (its ``expert_param_placement_sparse``: S(0) on
the EP axis), router and shared experts replicated, its own tokens, and the dispatcher wired with
``wire_meshes(ep_mesh=...)``. The dispatcher is built from its config by ``RoutedExperts`` itself
(``config.token_dispatcher.build()``), as in a torchtitan model config.

Precision: torchtitan's ``GroupedExperts.forward`` casts to bf16 (and CPU ``torch._grouped_mm``
takes no fp64), so the fp64 tests give it the same SwiGLU in the input dtype
(``Float64GroupedExperts``, which only overrides ``forward``); :func:`test_bf16_grouped_experts`
runs the unmodified class. torchtitan's combine rounds each expert row to fp32 before weighting it
(``routed_output_RD.to(torch.float32) * scores``), ours weights in the rows' dtype, so with fp64
experts ours and torchtitan agree to fp32's rounding (``TITAN_TOL``) while torchtitan's two
dispatchers agree to fp64's; with bf16 experts (exact in fp32) all three agree to fp64's. Seeds
are fresh on every run and named in a failure.

The torchtitan-shaped layer this file used to test (before torchtitan was installed) is gone:
every case it covered (1, 2 and 4 ranks, alignment, EP off in a multi-rank job, compiled) runs
here in the real module."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
pytest.importorskip("torchtitan", reason="torchtitan is not installed (make install pins it; the GPU image lacks it)")

from torchtitan.distributed import utils as titan_dist_utils  # noqa: E402
from torchtitan.models.common.feed_forward import FeedForward, SigmoidGatedFeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import MoE, RoutedExperts, GroupedExperts, TokenChoiceTopKRouter
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

from alltoall_ops import SymmBuffers
from alltoall_ops import moe as a2a_moe
from alltoall_ops.groups import NO_GROUP
from alltoall_ops.testing import nan_unwritten_rows
from alltoall_ops.torchtitan import TokenDispatcher

B, L, K = 2, 3, 2  # per rank: B sequences of L tokens, top-K routing
FP64_TOL = dict(rtol=1e-12, atol=1e-12)
TITAN_TOL = dict(rtol=1e-6, atol=1e-6)  # torchtitan's fp32 rounding of expert rows (2^-24 relative)


class Float64GroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` (same parameters, same SwiGLU ``w2(silu(w1 x) * w3 x)`` per
    expert group of rows) in the input dtype instead of bf16: each row finds its expert from the
    offsets, no host sync, so it compiles with the dispatcher's data-dependent row count. Rows
    past the last offset (alignment padding's, symm_mem's capacity) belong to no expert: as in
    ``torch._grouped_mm``, none of them reaches an output row or a weight gradient (both masked:
    a weight gradient would turn the 0 * NaN of symm_mem's unwritten rows into NaN)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1_EFD, w2_EDF, w3_EFD = (w.to_local() if isinstance(w, DTensor) else w
                                  for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0)
        rows_R = torch.arange(x_RD.shape[0], device=x_RD.device)
        expert_R = torch.searchsorted(offsets_E, rows_R, right=True)
        expert_R = expert_R.clamp_max(w1_EFD.shape[0] - 1)  # rows past the last offset: any weights, masked
        grouped_R1 = (rows_R < offsets_E[-1])[:, None]
        x_RD = torch.where(grouped_R1, x_RD, 0)
        h_RF = F.silu(torch.einsum("rd,rfd->rf", x_RD, w1_EFD[expert_R]))
        h_RF = h_RF * torch.einsum("rd,rfd->rf", x_RD, w3_EFD[expert_R])
        return torch.where(grouped_R1, torch.einsum("rf,rdf->rd", h_RF, w2_EDF[expert_R]), 0)


def shared_experts_config(shared: str | None, D: int, Fh: int):
    """torchtitan's shared experts: "plain" FeedForward (w2(silu(w1 x) * w3 x)), "gated"
    SigmoidGatedFeedForward (times sigmoid(gate x), gate D -> 1), None: no shared experts."""
    linear = lambda i, o: Linear.Config(in_features=i, out_features=o)  # noqa: E731
    if shared is None:
        return None
    if shared == "gated":
        return SigmoidGatedFeedForward.Config(w1=linear(D, Fh), w2=linear(Fh, D), w3=linear(D, Fh), gate=linear(D, 1))
    assert shared == "plain", shared
    return FeedForward.Config(w1=linear(D, Fh), w2=linear(Fh, D), w3=linear(D, Fh))


def titan_moe(dispatcher_config, E: int, D: int, Fh: int, experts=Float64GroupedExperts,
              shared: str | None = "plain") -> MoE:
    """torchtitan's MoE with shared experts (``shared_experts_config``), built from its config
    tree, fp64, random weights (the same on every rank: the caller seeds)."""
    linear = lambda i, o: Linear.Config(in_features=i, out_features=o)  # noqa: E731
    config = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=experts.Config(dim=D, hidden_dim=Fh, num_experts=E),
            token_dispatcher=dispatcher_config),
        router=TokenChoiceTopKRouter.Config(num_experts=E, gate=linear(D, E), top_k=K, score_func="softmax",
                                            route_norm=True),
        shared_experts=shared_experts_config(shared, D, Fh),
    )
    moe = config.build().to(torch.float64)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


def shard_experts(moe: MoE, reference: MoE, rank: int, W: int) -> None:
    """reference's weights into moe, the routed experts' dim-0 shard of rank only (EP)."""
    moe.load_state_dict(reference.state_dict())
    inner = moe.routed_experts.inner_experts
    e = inner.num_experts // W
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        setattr(inner, name, torch.nn.Parameter(getattr(inner, name).detach()[rank * e:(rank + 1) * e].clone()))


def grads(moe: MoE, W: int, ep: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient; replicated ones summed over the ranks (data parallel)."""
    out = {}
    for name, p in moe.named_parameters():
        g = p.grad.clone()
        if W > 1 and not (ep and name.startswith("routed_experts.inner_experts.")):
            dist.all_reduce(g)
        out[name] = g
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: dict, what: str) -> None:
    try:
        torch.testing.assert_close(got, want, **tol)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


def fresh_seed() -> int:
    return random.randrange(2**31)


def run_in_titan_moe(rank: int, world_size: int, alignment: int, compiler: str | None, use_mesh: bool = True,
                     E_per_rank: int = 2, D: int = 6, Fh: int = 5, experts=Float64GroupedExperts,
                     tols: tuple[dict, dict] = (FP64_TOL, TITAN_TOL), seed: int = 0,
                     shared: str | None = "plain", backend: str = "auto") -> int:
    """Two steps (fresh tokens, so new routings) of torchtitan's MoE with our dispatcher, with
    torchtitan's AllToAll dispatcher and in one process; asserts they agree; returns the frames
    compiled. use_mesh False: EP off (``ep_mesh=None``), every rank alone with all experts.
    seed: the weights' and tokens' (the same on every rank; the tests draw a fresh one).
    shared: the MoE's shared experts, as in :func:`shared_experts_config`. backend: our
    dispatcher's; "symm_mem" gets ``SymmBuffers`` made here on every rank of the EP group (one
    token more than a rank sends, so routed always has rows past ``tokens_per_expert.sum()``),
    and the steps run under ``nan_unwritten_rows()``: those rows, and the same rows of combine's
    backward, are NaN, and must reach no output or gradient."""
    W = world_size if use_mesh else 1
    E = E_per_rank * W
    r = rank if use_mesh else 0
    saved_backend = titan_dist_utils.get_spmd_backend()
    titan_dist_utils.set_spmd_backend("partial_dtensor")  # eager AllToAll over ep_mesh's group
    try:
        torch.manual_seed(seed)
        reference = titan_moe(LocalTokenDispatcher.Config(num_experts=E, top_k=K), E, D, Fh, experts, shared)
        ep_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))["ep"] if use_mesh else None
        buffers = None
        if backend == "symm_mem":  # collective: every rank of the EP group, before any compilation
            buffers = SymmBuffers(B * L + 1, D, K, E, dtype=torch.float64, device="cpu",
                                  group=ep_mesh if use_mesh else NO_GROUP, expert_alignment=alignment)
        ours = titan_moe(TokenDispatcher.Config(num_experts=E, top_k=K, expert_alignment=alignment, backend=backend,
                                                buffers=buffers), E, D, Fh, experts, shared)
        titan = titan_moe(AllToAllTokenDispatcher.Config(num_experts=E, top_k=K), E, D, Fh, experts, shared)
        assert type(ours.routed_experts.token_dispatcher) is TokenDispatcher
        for moe in (ours, titan):
            shard_experts(moe, reference, r, W)
            moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)  # RoutedExperts.parallelize's call
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(compiler or "eager")
        step = torch.compile(ours, backend=counter, fullgraph=True) if compiler else ours
        with nan_unwritten_rows() as unwritten:  # symm_mem's unwritten rows: NaN
            for step_seed in (1, 2):  # two routings, one compilation
                g = torch.Generator().manual_seed(seed + step_seed + (0 if use_mesh else 7 * rank + 1))
                x_all = torch.randn(W * B, L, D, generator=g, dtype=torch.float64)
                upstream_all = torch.randn(W * B, L, D, generator=g, dtype=torch.float64)
                mine = slice(r * B, (r + 1) * B)
                results = {}
                for name, moe, fn, tokens, upstream in (
                    ("reference", reference, reference, x_all, upstream_all),
                    ("titan", titan, titan, x_all[mine], upstream_all[mine]),
                    ("ours", ours, step, x_all[mine], upstream_all[mine]),
                ):
                    x = tokens.clone().requires_grad_()
                    moe.zero_grad()
                    y = fn(x)
                    y.backward(upstream)
                    ep = name != "reference" and W > 1
                    results[name] = (y.detach(), x.grad, grads(moe, W if name != "reference" else 1, ep))
                want_y, want_dx, want_grads = results["reference"]
                shared_grads = [g for p, g in want_grads.items() if p.startswith("shared_experts.")]
                assert len(shared_grads) == {None: 0, "plain": 3, "gated": 4}[shared]  # configured as asked
                assert all(g.abs().max() > 1e-3 for g in shared_grads)  # and in the loss
                e = E // W
                experts_shard = slice(r * e, (r + 1) * e)
                for name, tol in zip(("titan", "ours"), tols):
                    y, dx, got_grads = results[name]
                    assert_close(y, want_y[mine], tol, f"{name} forward (seed {seed})")
                    assert_close(dx, want_dx[mine], tol, f"{name} x.grad (seed {seed})")
                    assert got_grads.keys() == want_grads.keys()
                    for p, got in got_grads.items():
                        want = want_grads[p]
                        if p.startswith("routed_experts.inner_experts."):
                            want = want[experts_shard]
                        assert_close(got, want, tol, f"{name} grad of {p} (seed {seed})")
                # ours against torchtitan's EP dispatcher: the same but for torchtitan's fp32 rounding
                assert_close(results["ours"][0], results["titan"][0], tols[1], f"ours vs titan (seed {seed})")
        if backend == "symm_mem":
            assert len(unwritten) == 2 * 2  # each step: dispatch's copy-out and combine's backward's
            assert min(unwritten) > 0  # the rows were there
        else:
            assert unwritten == []
    finally:
        titan_dist_utils.set_spmd_backend(saved_backend)
    return counter.frame_count


CASES = [(3, None, "plain"), (1, "aot_eager", "gated")]
"""(alignment, compiler, shared experts): eager with torchtitan's FeedForward, compiled with its
SigmoidGatedFeedForward."""


@pytest.mark.parametrize("alignment, compiler, shared", CASES)
def test_one_process_without_a_mesh(alignment, compiler, shared):
    frames = run_in_titan_moe(0, 1, alignment, compiler, use_mesh=False, seed=fresh_seed(), shared=shared)
    assert frames == (1 if compiler else 0)


@pytest.mark.parametrize("pool", [2, 4], indirect=True)
@pytest.mark.parametrize("alignment, compiler, shared", CASES)
def test_expert_parallel_ranks(pool, alignment, compiler, shared):
    frames = pool.run(run_in_titan_moe, alignment, compiler, seed=fresh_seed(), shared=shared)
    assert frames == [1 if compiler else 0] * pool.world_size


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("alignment, compiler, shared", CASES)
def test_symm_mem_backend(request, world_size, alignment, compiler, shared):
    """``TokenDispatcher.Config(backend="symm_mem", buffers=SymmBuffers(...))`` in torchtitan's MoE:
    one process (EP off, the buffers' one-rank allocator) and 2 ranks (the CPU shared-memory
    stand-in), the C-row routed tensor straight into GroupedExperts, its rows past
    ``tokens_per_expert.sum()`` NaN; the same checks as the other backends'."""
    seed = fresh_seed()
    if world_size == 1:
        frames = [run_in_titan_moe(0, 1, alignment, compiler, use_mesh=False, seed=seed, shared=shared,
                                   backend="symm_mem")]
    else:
        frames = request.getfixturevalue(f"pool{world_size}").run(
            run_in_titan_moe, alignment, compiler, seed=seed, shared=shared, backend="symm_mem")
    assert frames == [1 if compiler else 0] * world_size


def test_inductor_two_ranks(pool2):
    assert pool2.run(run_in_titan_moe, 2, "inductor", seed=fresh_seed(), shared="gated") == [1, 1]


def test_no_expert_parallelism_inside_a_multi_rank_job(pool2):
    """EP off, and an MoE without shared experts."""
    assert pool2.run(run_in_titan_moe, 1, None, False, seed=fresh_seed(), shared=None) == [0, 0]


def test_bf16_grouped_experts(pool2):
    """torchtitan's GroupedExperts unmodified (bf16 torch._grouped_mm; its strides need D and F
    multiples of 8): ours, torchtitan's AllToAll and the one-process MoE give the same rows."""
    assert pool2.run(run_in_titan_moe, 2, None, D=8, Fh=16, experts=GroupedExperts, tols=(FP64_TOL, FP64_TOL),
                      seed=fresh_seed()) == [0, 0]


OUR_NAMES = {  # alltoall_ops.moe's parameter -> torchtitan MoE's; ours are (in, out), torchtitan's (out, in)
    "w_gate": "routed_experts.inner_experts.w1_EFD", "w_up": "routed_experts.inner_experts.w3_EFD",
    "w_down": "routed_experts.inner_experts.w2_EDF", "router.proj.weight": "router.gate.weight",
    "shared_expert.w_gate": "shared_experts.w1.weight", "shared_expert.w_up": "shared_experts.w3.weight",
    "shared_expert.w_down": "shared_experts.w2.weight", "shared_expert.w_output_gate": "shared_experts.gate.weight",
}


def as_titan(name: str, w: torch.Tensor) -> torch.Tensor:
    """One of our parameters (or its gradient) in torchtitan's layout."""
    return w if name == "router.proj.weight" else w.transpose(-2, -1)


@pytest.mark.parametrize("shared", ["plain", "gated"])
def test_our_moe_with_a_shared_expert_is_torchtitans(shared):
    """``alltoall_ops.moe``'s MoE (one rank) and DenseMoE with a shared expert, holding the weights
    of torchtitan's MoE with FeedForward / SigmoidGatedFeedForward shared experts, compute its
    function: forward and every gradient in fp64 (TITAN_TOL: its combine rounds expert rows to
    fp32), and the shared expert alone to fp64's rounding. The shared expert and its gate are
    code MoE and DenseMoE share: this is their independent check."""
    seed, E, D, Fh = fresh_seed(), 4, 6, 5
    torch.manual_seed(seed)
    titan = titan_moe(LocalTokenDispatcher.Config(num_experts=E, top_k=K), E, D, Fh, shared=shared)
    dense = a2a_moe.DenseMoE(D, Fh, E, K, shared_ffn_size=Fh, gated_shared_expert=shared == "gated",
                             dtype=torch.float64)
    titan_params = dict(titan.named_parameters())
    assert sorted(OUR_NAMES[name] for name, _ in dense.named_parameters()) == sorted(titan_params)
    with torch.no_grad():
        for name, w in dense.named_parameters():
            w.copy_(as_titan(name, titan_params[OUR_NAMES[name]]))
    ours = a2a_moe.MoE.from_dense(dense, backend="local", expert_alignment=2)
    g = torch.Generator().manual_seed(seed + 1)
    x_BLD = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    upstream_BLD = torch.randn(B, L, D, generator=g, dtype=torch.float64)

    def run(module, x, shape):
        x = x.clone().requires_grad_()
        module.zero_grad()
        y = module(x.view(shape))
        y.backward(upstream_BLD.view(y.shape))
        return y.detach().view(B, L, D), x.grad, {name: p.grad for name, p in module.named_parameters()}

    want_y, want_dx, want_grads = run(titan, x_BLD, (B, L, D))
    for label, module in (("DenseMoE", dense), ("MoE", ours)):
        y, dx, got_grads = run(module, x_BLD, (B * L, D))
        assert_close(y, want_y, TITAN_TOL, f"{label} forward (seed {seed})")
        assert_close(dx, want_dx, TITAN_TOL, f"{label} x.grad (seed {seed})")
        for name, got in got_grads.items():
            want = want_grads[OUR_NAMES[name]]
            assert_close(as_titan(name, got), want, TITAN_TOL, f"{label} grad of {name} (seed {seed})")
    with torch.no_grad():
        x_TD = x_BLD.view(B * L, D)
        assert_close(ours.shared_expert(x_TD), titan.shared_experts(x_TD), FP64_TOL, f"shared expert (seed {seed})")
        assert ours.shared_expert(x_TD).abs().max() > 1e-2


def test_config_builds_and_errors():
    config = TokenDispatcher.Config(num_experts=4, top_k=2, backend="collective")
    assert isinstance(config.build(), TokenDispatcher) and config.build().config == config
    assert config.to_dict() == {"num_experts": 4, "top_k": 2, "backend": "collective", "expert_alignment": 1,
                                "buffers": None}
    with pytest.raises(ValueError, match="Config.top_k: expected 1 <= top_k <= num_experts = 4, got 5"):
        TokenDispatcher.Config(num_experts=4, top_k=5).build()
    with pytest.raises(ValueError, match="Config.backend: expected one of"):
        TokenDispatcher(TokenDispatcher.Config(num_experts=4, top_k=2, backend="nccl"))
    with pytest.raises(TypeError):
        TokenDispatcher.Config(4, 2)  # keyword-only, as torchtitan's
