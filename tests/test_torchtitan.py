"""``alltoall_ops.torchtitan.TokenDispatcher`` in a layer shaped like torchtitan's MoE (router,
``num_tokens_per_expert`` by histc, dispatch, grouped experts, combine with the scores), against
the dense single-process reference: forward and gradients in fp64 on 1, 2 and 4 gloo ranks,
eager and compiled (aot_eager; inductor on two ranks; one compilation across routings).

torchtitan itself is not installed here: its 0.3.0 wheel imports tyro, datasets, wandb,
tensorboard and spmd_types at module level, so the layer below follows its documented
signatures (``torchtitan/models/common/token_dispatcher.py``) instead."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.device_mesh import init_device_mesh

from alltoall_ops.groups import NO_GROUP
from alltoall_ops.moe import DenseMoE, MoE
from alltoall_ops.torchtitan import TokenDispatcher

H, F, K, T = 6, 5, 2, 5


class TitanStyleMoE(torch.nn.Module):
    """torchtitan's MoE.forward around its token dispatcher; router and experts from ``local``."""

    def __init__(self, local: MoE, dispatcher: TokenDispatcher):
        super().__init__()
        self.local, self.dispatcher = local, dispatcher

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        topk_expert_ids_TK, topk_scores_TK = self.local.router(x_TD)
        E = self.dispatcher.config.num_experts
        num_tokens_per_expert_E = torch.histc(topk_expert_ids_TK.reshape(-1).to(torch.float64), bins=E, min=0, max=E)
        routed_RD, tokens_per_local_expert_e, metadata = self.dispatcher.dispatch(
            x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E)
        routed_output_RD = self.local.experts(routed_RD, tokens_per_local_expert_e)
        return self.dispatcher.combine(routed_output_RD, metadata, x_TD)


def run_titan_layer(rank: int, world_size: int, alignment: int, compiled: bool, use_mesh: bool,
                    compiler: str = "aot_eager") -> int:
    """Two steps (two routings) of the layer against the dense reference; returns the frames
    compiled. use_mesh False: expert parallelism off (``ep_mesh=None``), each rank on its own
    tokens with all experts, also inside a multi-rank job."""
    W = world_size if use_mesh else 1
    E = 2 * W
    torch.manual_seed(0)
    dense = DenseMoE(H, F, E, K, dtype=torch.float64)
    ep_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))["ep"] if use_mesh else None
    local = MoE.from_dense(dense, group=dist.group.WORLD if use_mesh else NO_GROUP, expert_impl="masked")
    dispatcher = TokenDispatcher(TokenDispatcher.Config(num_experts=E, top_k=K, expert_alignment=alignment))
    dispatcher.wire_meshes(ep_mesh=ep_mesh)
    layer = TitanStyleMoE(local, dispatcher)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(compiler)
    step = torch.compile(layer, backend=counter, fullgraph=True) if compiled else layer
    r = rank if use_mesh else 0
    for seed in (1, 2):  # fresh tokens, so the routing changes between steps
        g = torch.Generator().manual_seed(100 * seed + (0 if use_mesh else rank))
        x_all = torch.randn(W * T, H, generator=g, dtype=torch.float64)
        upstream_all = torch.randn(W * T, H, generator=g, dtype=torch.float64)
        full = x_all.clone().requires_grad_()
        dense.zero_grad()
        want = dense(full)
        want.backward(upstream_all)
        x = x_all[r * T : (r + 1) * T].clone().requires_grad_()
        local.zero_grad()
        got = step(x)
        got.backward(upstream_all[r * T : (r + 1) * T])
        torch.testing.assert_close(got, want[r * T : (r + 1) * T], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad, full.grad[r * T : (r + 1) * T], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(local.w_up.grad, dense.w_up.grad[local.local_expert_slice()], rtol=1e-12,
                                   atol=1e-12)
    return counter.frame_count


@pytest.mark.parametrize("compiled", [False, True])
def test_one_process_without_a_mesh(compiled):
    frames = run_titan_layer(0, 1, 1, compiled, False)
    assert frames == (1 if compiled else 0)


@pytest.mark.parametrize("pool", [2, 4], indirect=True)
@pytest.mark.parametrize("alignment, compiled", [(1, False), (3, False), (1, True)])
def test_expert_parallel_ranks(pool, alignment, compiled):
    frames = pool.run(run_titan_layer, alignment, compiled, True)
    assert frames == [1 if compiled else 0] * pool.world_size


def test_inductor_two_ranks(pool2):
    assert pool2.run(run_titan_layer, 2, True, True, "inductor") == [1, 1]


def test_no_expert_parallelism_inside_a_multi_rank_job(pool2):
    assert pool2.run(run_titan_layer, 1, False, False) == [0, 0]


def test_config_errors():
    with pytest.raises(ValueError, match="Config.top_k: expected 1 <= top_k <= num_experts = 4, got 5"):
        TokenDispatcher(TokenDispatcher.Config(num_experts=4, top_k=5))
    with pytest.raises(ValueError, match="Config.backend: expected one of"):
        TokenDispatcher(TokenDispatcher.Config(num_experts=4, top_k=2, backend="nccl"))
    with pytest.raises(TypeError):
        TokenDispatcher.Config(4, 2)  # keyword-only, as torchtitan's
