"""See what torch.compile made of a callable: its forward / backward graphs and a compact,
version-stable summary of the communication ops in them (and the waits of async ones).

Example::

    graphs = alltoall_ops.inspect.compiled_graphs(moe_layer, x, topk_idx, weights)
    print(graphs.summary())
    # forward 0:
    #   alltoall_ops.exchange_routing(group_name='0', header=[0, 8, 16, 1, 1, 2, 1], expert_alignment=1)
    #   alltoall_ops.dispatch(scale_TK=None, expert_alignment=1, group_name='0', num_rows=None)
    #   ...
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx

from ._compat import INLINED_CALL, OpaqueBase
from .comm import communication_ops
from .overlap import wait_add


@dataclasses.dataclass
class CompiledGraphs:
    """forward / backward: the graphs handed to the compiler, in compilation order (inductor:
    after its post-grad passes). ``len(forward) - 1`` is the number of graph breaks."""

    forward: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    backward: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)

    @property
    def graph_breaks(self) -> int:
        return max(len(self.forward) - 1, 0)

    def comm_ops(self, which: str = "backward") -> list[str]:
        """Names (``namespace.op``) of the comm ops in the ``forward`` or ``backward`` graphs."""
        return [_op_name(target) for gm in getattr(self, which) for target, _ in _comm_calls(gm)]

    def summary(self) -> str:
        """The comm ops of every graph, in order, with their non-tensor arguments (but those at
        their schema's default)."""
        lines = []
        for which in ("forward", "backward"):
            for i, gm in enumerate(getattr(self, which)):
                lines.append(f"{which} {i}:")
                lines += [f"  {_describe_call(*call)}" for call in _comm_calls(gm)] or ["  (no comm ops)"]
        return "\n".join(lines)


def _is_comm(target: Any) -> bool:
    """A comm op of this library, a functional collective (``wait_tensor`` too) or ``wait_add``:
    an async exchange's start and its wait both show."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return target in communication_ops() or target.namespace == "_c10d_functional" or target == wait_add._opoverload


def _comm_calls(gm: torch.fx.GraphModule) -> list[tuple[torch._ops.OpOverload, dict[str, Any]]]:
    """(op, arguments by name) of each comm op call in ``gm``, in graph order: a call node, or
    the node that makes an inlined op's output (``_compat.INLINED_CALL``)."""
    calls, inlined = [], set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue  # NB: a saved output, a placeholder of the backward, keeps its node's meta
        tag = n.meta.get(INLINED_CALL)
        if tag is not None:
            serial, target, bound = tag
            if serial not in inlined and _is_comm(target):
                inlined.add(serial)
                calls.append((target, bound))
        elif _is_comm(n.target):
            bound = dict(zip((a.name for a in n.target._schema.arguments), n.args))
            calls.append((n.target, {**bound, **n.kwargs}))
    return calls


def _op_name(target: torch._ops.OpOverload) -> str:
    return f"{target.namespace}.{target._schema.name.split('::')[1]}"


def _describe_arg(value: Any) -> str:
    if isinstance(value, torch.fx.Node):
        meta = value.meta.get("val")
        if isinstance(meta, torch.Tensor):
            return "<tensor>"
        real = getattr(meta, "real_obj", None)  # an opaque object's fake stands in for it
        return f"<opaque {type(real).__name__}>" if real is not None else "<symbolic>"
    if isinstance(value, OpaqueBase):  # an opaque value type: a constant of the graph
        return f"<constant {type(value).__name__}>"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe_arg(v) for v in value) + "]"
    return repr(value)


def _describe_call(target: torch._ops.OpOverload, bound: dict[str, Any]) -> str:
    schema = target._schema
    shown = []
    for arg in schema.arguments:
        value = bound.get(arg.name, arg.default_value if arg.has_default_value() else None)
        if isinstance(arg.type, torch.TensorType):
            continue  # required tensors: always there, shapes are version-dependent
        if arg.has_default_value() and value == arg.default_value:
            continue  # e.g. the plain payload format of a dispatch
        shown.append(f"{arg.name}={_describe_arg(value)}")
    return f"{_op_name(target)}({', '.join(shown)})"


def capturing_backend(graphs: CompiledGraphs, backend: str = "aot_eager") -> Callable:
    """A torch.compile backend that records forward / backward graphs into ``graphs``.

    backend: "aot_eager" (graphs run eagerly) or "inductor" (graphs recorded after inductor's
    post-grad passes, then compiled by inductor)."""

    def record(into: list, gm: torch.fx.GraphModule) -> None:
        into.append(gm)

    if backend == "aot_eager":
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        def compiler(into):
            def compile_graph(gm, example_inputs):
                record(into, gm)
                return make_boxed_func(gm.forward)

            return compile_graph

        return aot_autograd(
            fw_compiler=compiler(graphs.forward),
            bw_compiler=compiler(graphs.backward),
            partition_fn=min_cut_rematerialization_partition,
        )
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(gm, example_inputs, **kwargs):
            record(graphs.backward if kwargs.get("is_backward") else graphs.forward, gm)
            return compile_fx_inner(gm, example_inputs, **kwargs)

        def compile_recording(gm, example_inputs):
            # NB: a cache hit of AOTAutograd's cache skips inner_compile, and nothing would be
            # recorded: compile this graph afresh.
            with torch._functorch.config.patch(enable_autograd_cache=False):
                return compile_fx(gm, example_inputs, inner_compile=inner)

        return compile_recording
    raise ValueError(f"backend: expected 'aot_eager' or 'inductor', got {backend!r}")


def compiled_graphs(
    fn: Callable,
    *args: Any,
    backend: str = "aot_eager",
    loss: Callable[[Any], torch.Tensor] | None = None,
    **kwargs: Any,
) -> CompiledGraphs:
    """Compile ``fn`` with ``fullgraph=True``, run it on ``args`` and, when its output needs a
    gradient, run backward on ``loss(output)`` (default: the sum of the output) so the backward
    graph gets compiled too. Returns the recorded graphs."""
    graphs = CompiledGraphs()
    compiled = torch.compile(fn, backend=capturing_backend(graphs, backend), fullgraph=True)
    out = compiled(*args, **kwargs)
    value = loss(out) if loss is not None else out.sum()
    if value.requires_grad:
        value.backward()
    return graphs
