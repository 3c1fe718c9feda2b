"""What ``torch.compile(mode="reduce-overhead")`` needs of a compiled MoE layer step
(:class:`alltoall_ops.moe.MoE`, forward + backward and a no-grad decode forward), checked on the
graphs that inductor compiles, on the CPU.

torch 2.11's inductor records a CUDA graph only when every input of the graph it compiles is a
Tensor, SymInt or Generator (``CompiledFxGraph.__init__``, reason "non-Tensor inputs"), and it
falls back to running without one silently. So each case asserts: fullgraph (no graph break),
one compilation across routings, results and gradients equal to eager, every graph input a
tensor (no opaque object: the symm_mem buffers are a constant of the graph), and static shapes
(no SymInt anywhere, so no unbacked data-dependent size). The GPU counterpart, which counts real
CUDA-graph replays: ``tools/gpu_graph_check.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import free_symbols

import alltoall_ops as a2a
from alltoall_ops.inspect import CompiledGraphs, capturing_backend
from alltoall_ops.kernels import loader
from alltoall_ops.moe import MoE

H, F, E, K, T, ALIGNMENT = 8, 16, 4, 2, 6, 2
ROUTINGS = 3

CUDA_GRAPH_INPUT_TYPES = (torch.Tensor, torch.SymInt, torch.Generator)
"""The inputs torch 2.11's inductor lets a CUDA graph have."""

BACKENDS = [
    pytest.param("symm_mem", marks=pytest.mark.skipif(
        not loader.load().interpreting(), reason="symm_mem on the CPU runs Triton's interpreter")),
    "local",
]


def _layer(backend: str) -> MoE:
    torch.manual_seed(0)
    buffers = None
    if backend == "symm_mem":
        buffers = a2a.SymmBuffers(T, H, K, E, dtype=torch.float32, device="cpu", expert_alignment=ALIGNMENT)
    return MoE(H, F, E, K, backend=backend, buffers=buffers, expert_alignment=ALIGNMENT, expert_impl="masked")


def _inductor_config() -> dict:
    # NB: every op falls back to aten (skips the C++ compile) where this torch has the option;
    # the graphs inductor is handed are the same.
    config = {"fx_graph_cache": False}
    if hasattr(torch._inductor.config, "fallback_by_default"):
        config["fallback_by_default"] = True
    return config


def _graph_problems(gm: torch.fx.GraphModule) -> dict[str, list[str]]:
    """What keeps a graph from a CUDA graph with static shapes: inputs torch 2.11 rejects, and
    nodes with symbolic sizes or values."""
    rejected, symbolic = [], []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and not isinstance(val, CUDA_GRAPH_INPUT_TYPES):
            rejected.append(f"{node.name}: {type(val).__name__}")
        vals = val if isinstance(val, (list, tuple)) else [val]
        if any(isinstance(v, (torch.Tensor, torch.SymInt)) and free_symbols(v) for v in vals):
            symbolic.append(f"{node.name}: {val}")
    return {"rejected inputs": rejected, "symbolic": symbolic}


def _op_nodes(gms: list[torch.fx.GraphModule]) -> list[torch.fx.Node]:
    """The nodes of this library's ops."""
    return [n for gm in gms for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "alltoall_ops"]


def _buffers_args(nodes: list[torch.fx.Node]) -> list:
    """The ``buffers`` argument of every node that has one."""
    out = []
    for node in nodes:
        names = [a.name for a in node.target._schema.arguments]
        if "buffers" in names:
            out.append(node.args[names.index("buffers")])
    return out


def layer_step_graphs(rank: int, world_size: int, backend: str, train: bool) -> dict:
    """Compile one layer step (``train``: forward + backward; else a no-grad decode forward) over
    ROUTINGS routings and compare with eager; returns what the test asserts (picklable)."""
    torch._dynamo.reset()
    moe = _layer(backend)
    graphs = CompiledGraphs()
    compiled = torch.compile(moe, backend=capturing_backend(graphs, "inductor"), fullgraph=True)
    params = list(moe.parameters())
    equal, routings = [], set()
    with torch._inductor.config.patch(_inductor_config()), torch.set_grad_enabled(train):
        for seed in range(ROUTINGS):
            g = torch.Generator().manual_seed(100 * seed + rank)
            x = torch.randn(T, H, generator=g)
            routings.add(tuple(moe.router(x)[0].flatten().tolist()))
            results = []
            for fn in (compiled, moe):
                xx = x.clone().requires_grad_(train)
                y = fn(xx)
                grads = torch.autograd.grad(y, [xx, *params], torch.ones_like(y)) if train else ()
                results.append([y.detach(), *grads])
            equal.append(all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*results)))
    nodes = _op_nodes(graphs.forward + graphs.backward)
    return {
        "graphs": (len(graphs.forward), len(graphs.backward)),
        "routings": len(routings),
        "equal to eager": equal,
        "problems": [_graph_problems(gm) for gm in graphs.forward + graphs.backward],
        "ops": sorted({name.split(".")[1] for name in graphs.comm_ops("forward") + graphs.comm_ops("backward")}),
        "buffers are the layer's, as constants": [b is moe.buffers for b in _buffers_args(nodes)],
    }


def _check(result: dict, backend: str, train: bool) -> None:
    assert result["routings"] == ROUTINGS  # the routings differ: one compilation serves them all
    assert result["graphs"] == ((1, 1) if train else (1, 0))
    assert result["equal to eager"] == [True] * ROUTINGS
    assert result["problems"] == [{"rejected inputs": [], "symbolic": []}] * sum(result["graphs"])
    assert any("dispatch" in op for op in result["ops"]) and any("combine" in op for op in result["ops"]), result["ops"]
    if backend == "symm_mem":
        # forward: exchange_meta, dispatch, combine; backward: dispatch, combine
        assert result["buffers are the layer's, as constants"] == [True] * (5 if train else 3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "decode"])
def test_layer_step_graphs_one_rank(backend, train):
    _check(layer_step_graphs(0, 1, backend, train), backend, train)


@pytest.mark.skipif(not loader.load().interpreting(), reason="symm_mem on the CPU runs Triton's interpreter")
def test_layer_step_graphs_symm_mem_two_ranks(pool2):
    for result in pool2.run(layer_step_graphs, "symm_mem", True):
        _check(result, "symm_mem", True)
