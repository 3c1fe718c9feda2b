"""Async starts under recomputation (issue 31, case 4): a checkpointed MoE block whose shared
expert runs beside an async combine leaves no exchange pending after its step, with
``torch.utils.checkpoint`` (early stop on and off: the recompute may stop after the start and
never reach the wait), ``sac_policy()`` and full recompute compiled, and its results and
gradients equal the run without checkpointing. The backward of an async op waits on the outputs
it saved, so a start that recomputation runs again is waited for there: in compiled graphs every
async start has a wait on one of its outputs, and every output the backward reads is read after
a wait on it."""

from __future__ import annotations

import operator
from functools import partial

import pytest
import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, set_checkpoint_early_stop

import alltoall_ops as a2a
from alltoall_ops import overlap
from alltoall_ops.inspect import CompiledGraphs, capturing_backend
from alltoall_ops.moe import MoE

T, H, F, E, K, FS = 6, 8, 6, 4, 2, 10
STEPS = 2
INDUCTOR_CONFIG = {"fx_graph_cache": False, "fallback_by_default": True}  # NB: no C++ compile: the same graphs


def _block(world_size: int, backend: str) -> MoE:
    torch.manual_seed(0)  # the same router and shared expert on every rank
    buffers = None
    if backend == "symm_mem":
        buffers = a2a.SymmBuffers(T, H, K, E, dtype=torch.float64, device="cpu")
    return MoE(H, F, E, K, shared_ffn_size=FS, backend=backend, buffers=buffers, dtype=torch.float64)


def _checkpointed(moe: MoE, how: str):
    if how == "none":
        return moe
    context_fn = {"sac": partial(create_selective_checkpoint_contexts, a2a.sac_policy())}.get(how)
    kwargs = {"context_fn": context_fn} if context_fn else {}
    return partial(checkpoint, moe, use_reentrant=False, **kwargs)


def _steps(moe: MoE, fn, rank: int) -> list[torch.Tensor]:
    """STEPS forward + backward steps of fn on fresh tokens: each step's y and every gradient."""
    results = []
    for step in range(STEPS):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
        y = fn(x)
        results += [y.detach(), *torch.autograd.grad(y.square().sum(), [x, *moe.parameters()])]
    return results


def eager_recompute(rank: int, world_size: int, backend: str) -> dict[str, int]:
    """Each way of checkpointing against none, bit for bit; the exchanges left pending by each."""
    moe = _block(world_size, backend)
    want = _steps(moe, moe, rank)
    pending = {}
    for how, early_stop in (("full", True), ("full", False), ("sac", True)):
        with set_checkpoint_early_stop(early_stop):
            got = _steps(moe, _checkpointed(moe, how), rank)
        for w, g in zip(want, got):
            assert torch.equal(w, g), (how, early_stop)
        pending[f"{how}, early stop {early_stop}"] = overlap.pending_exchanges()
    return pending


@pytest.mark.parametrize("backend", ["auto", "symm_mem"])
@pytest.mark.parametrize("pool", [1, 2], indirect=True)
def test_checkpointed_async_combine_leaves_nothing_pending(pool, backend):
    for pending in pool.run(eager_recompute, backend):
        assert set(pending.values()) == {0}, pending


def _readers(values: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The nodes reading ``values``, through detaches (the same tensor)."""
    users = [u for v in values for u in v.users]
    detached = [u for u in users if u.target is torch.ops.aten.detach.default]
    return [u for u in users if u not in detached] + (_readers(detached) if detached else [])


def _async_starts(gm: torch.fx.GraphModule) -> int:
    """The async starts in a graph; asserts that a wait reads each one's outputs and nothing else
    does (the functional collectives' rule: every read of an exchange's output after its wait),
    and that the first of them is its wait_add where it has one."""
    waits = (torch.ops._c10d_functional.wait_tensor.default, a2a.wait_add._opoverload)
    starts = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in a2a.communication_ops():
            continue
        bound = dict(zip((a.name for a in node.target._schema.arguments), node.args)) | node.kwargs
        if not bound.get("async_op"):
            continue
        starts += 1
        readers = _readers([u for u in node.users if u.target is operator.getitem] or [node])
        assert readers and all(r.target in waits for r in readers), (node, readers, gm.code)
        adds = [r for r in readers if r.target is waits[1]]
        first = min(readers, key=list(gm.graph.nodes).index)
        assert not adds or first in adds, (node, first)  # no wait before wait_add: the overlap stays
    return starts


def compiled_recompute(rank: int, world_size: int, backend: str) -> tuple[int, int]:
    """Full recompute compiled: results and gradients against eager without checkpointing; the
    async starts in the graphs (each checked by _async_starts); the exchanges left pending."""
    moe = _block(world_size, "auto")
    want = _steps(moe, moe, rank)
    graphs = CompiledGraphs()
    torch._dynamo.reset()
    with torch._inductor.config.patch(INDUCTOR_CONFIG):
        compiled = torch.compile(_checkpointed(moe, "full"), backend=capturing_backend(graphs, backend), fullgraph=True)
        got = _steps(moe, compiled, rank)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    return sum(_async_starts(gm) for gm in graphs.forward + graphs.backward), overlap.pending_exchanges()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("pool", [1, 2], indirect=True)
def test_compiled_full_recompute_waits_for_every_start(pool, backend):
    for starts, pending in pool.run(compiled_recompute, backend):
        assert starts >= 1 and pending == 0, (starts, pending)
