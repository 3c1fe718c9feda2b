"""Version shims for the torch internals this package leans on (torch 2.11 through nightlies).

Opaque objects (a Python object passed into custom ops):
- torch 2.11 / 2.13: base class ``torch._opaque_base.OpaqueBase`` (2.11 requires it for value
  types too; 2.13 only for reference types), registered with
  ``torch._library.opaque_object.register_opaque_type(cls, typ="reference" | "value", members=...)``;
  both reject ``guard_fn`` for value types and require ``__eq__``, ``__hash__`` and
  ``__fx_repr__`` of them;
- newer nightlies: base class ``torch._custom_class_base.CustomClassBase`` and
  ``register_custom_class``.
Keyword arguments that a version does not know are left out rather than failing.

Custom ops: ``custom_op`` registers one and ``call`` runs it, skipping the dispatcher in plain
eager code (the eager fast path, in one place for the hot-path ops: routing plan, split read,
and every op that communicates).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, Iterable

try:  # torch 2.11 - 2.13
    from torch._opaque_base import OpaqueBase
except ImportError:  # pragma: no cover - nightlies after the rename
    from torch._custom_class_base import CustomClassBase as OpaqueBase  # type: ignore[no-redef]

__all__ = ["OpaqueBase", "is_compiling", "register_value_type"]


def _register_function() -> Callable:
    from torch._library import opaque_object

    for name in ("register_opaque_type", "register_custom_class"):
        fn = getattr(opaque_object, name, None)
        if fn is not None:
            return fn
    raise ImportError(  # pragma: no cover
        "alltoall_ops: this torch has no opaque-type registration "
        "(torch._library.opaque_object.register_opaque_type); torch >= 2.11 is required"
    )


def register_value_type(cls: type, *, constant_members: Iterable[str] = ()) -> None:
    """Register ``cls`` (a subclass of :data:`OpaqueBase`) as an opaque *value* type.

    torch.compile embeds each object in the graph as a constant, written into the generated code
    as ``cls.__fx_repr__()`` gives it, and guards on ``==`` (an object not equal to the one
    compiled recompiles); fake implementations get the real object. So a value type is never a
    graph input, which CUDA graphs (``mode="reduce-overhead"``) need on torch 2.11.

    constant_members: attributes read at trace time from the real object and baked into the
        graph as constants (``MemberType.USE_REAL``).
    """
    from torch._library.opaque_object import MemberType

    register = _register_function()
    kwargs: dict[str, Any] = {"typ": "value"}
    if constant_members and "members" in inspect.signature(register).parameters:
        kwargs["members"] = {name: MemberType.USE_REAL for name in constant_members}
    register(cls, **kwargs)


def is_compiling() -> bool:
    """True while torch.compile (dynamo) traces the caller."""
    import torch

    return bool(torch.compiler.is_compiling())


_IMPLS: dict = {}  # custom op -> its implementation (what the dispatcher calls)


def custom_op(name: str, fn: Callable, *, inline: bool | str | Callable[[dict], bool] = False, **kwargs: Any):
    """``torch.library.custom_op(name, mutates_args=())(fn)``, with ``fn`` remembered for
    :func:`call`.

    inline: compiled code gets the op's body instead of a call to it (:func:`inline_in_aot`):
    its torch ops and Triton kernels (launched through ``kernels._config.launch``, which wraps
    them for tracing) land in the graph AOTAutograd hands the compiler, so inductor fuses the ops
    and launches the kernels from its own code, with no custom-op dispatch and no Python
    launcher at run time. Unless the op's ``async_op`` argument is True (an exchange started on
    the communication stream stays one call). Dynamo's graph, autograd (the op's own
    ``register_autograd``) and selective checkpointing (whose policy sees the op before its body
    is traced) still see one op. A device type ("cuda"): inlined only where the op's first
    tensor argument is on it (elsewhere a call keeps, e.g., its typed errors). A predicate: inlined
    where it returns True for the call's arguments by name (symm_mem: buffers whose barriers are
    device work)."""
    import torch

    op = torch.library.custom_op(name, mutates_args=(), **kwargs)(fn)
    _IMPLS[op] = fn
    if inline:
        inline_in_aot(op, fn, _inline_predicate(inline))
    return op


def _inline_predicate(inline: bool | str | Callable[[dict], bool]) -> Callable[[dict], bool]:
    """``inline`` of :func:`custom_op` as a predicate on the call's arguments by name."""
    if callable(inline):
        return inline
    if inline is True:
        return lambda bound: True
    import torch

    def on_device(bound: dict) -> bool:
        first = next(v for v in bound.values() if isinstance(v, torch.Tensor))
        return first.device.type == inline

    return on_device


INLINED_CALL = "alltoall_ops_call"
"""The ``node.meta`` key of the node that makes an inlined op's (first) output: ``(serial, op
overload, arguments by name, tensors as TENSOR)``, so that :mod:`alltoall_ops.inspect` still
shows one call, in the graph where the op's work runs (the forward, or a backward recomputing it)."""


class _Tensor:
    def __repr__(self) -> str:
        return "<tensor>"


TENSOR = _Tensor()
"""Stands for a tensor argument in an :data:`INLINED_CALL` record (repr ``<tensor>``)."""

_inlined_calls = iter(range(1 << 62))


def inline_in_aot(op: Any, fn: Callable, inlined: Callable[[dict], bool]) -> None:
    """Trace ``fn`` (the body of ``op``) in place of ``op`` under AOTAutograd's functionalization
    (a ``FunctionalTensorMode`` rule, as ``torch.library.triton_op`` registers), for calls
    ``inlined`` accepts (given the arguments by name), but never with ``async_op=True``; the node
    of its output is tagged with :data:`INLINED_CALL`."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    names = None

    def rule(mode, func, types, args, kwargs):
        nonlocal names
        if any(t not in (torch.Tensor, FunctionalTensor) and not issubclass(t, FakeTensor) for t in types):
            return NotImplemented  # another tensor subclass: its own rules first
        names = names or arg_names(op)
        bound = {**dict(zip(names, args)), **kwargs}
        if bound.get("async_op", False) or not inlined(bound):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode:
            out = fn(*args, **kwargs)
        node = _output_node(out)
        if node is not None and INLINED_CALL not in node.meta:
            node.meta[INLINED_CALL] = (next(_inlined_calls), op._opoverload,
                                       {k: TENSOR if isinstance(v, torch.Tensor) else v for k, v in bound.items()})
        return out

    op.register_torch_dispatch(FunctionalTensorMode, rule)


def graph_constant(t: Any) -> Any:
    """``t``, an immutable tensor an inlined op's body reads (an address table), as a constant of
    the graph being traced (a ``get_attr`` node holding ``t``), or ``t`` itself outside tracing.
    A compile cache may store a constant by value and load a copy: only for tensors whose copy
    means the same (never memory that peers write)."""
    import torch
    from torch._guards import detect_fake_mode
    from torch._subclasses.functional_tensor import FunctionalTensor

    # NB: an inlined body is traced under functionalization (inline_in_aot) and only there; one
    # mode query, so that eager calls pay no more
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is None or type(t) is not torch.Tensor:
        return t
    fake_mode = detect_fake_mode()
    allowed = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True
    try:
        constant = torch.ops.aten.alias.default(t)  # a fake tensor, traced as a get_attr of t
    finally:
        fake_mode.allow_non_fake_inputs = allowed
    return FunctionalTensor.to_functional(constant)  # NB: the kernels' wrappers take functional tensors only


_PER_TRACE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def per_trace(key: Any, make: Callable[[], Any]) -> Any:
    """``make()``, once per ``key`` in the graph being traced (the same value for every call with
    ``key`` while one tracer records, e.g. in every inlined op body of one graph); a fresh
    ``make()`` at each call outside tracing."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    if mode is None:
        return make()
    values = _PER_TRACE.setdefault(mode.tracer, {})
    if key not in values:
        values[key] = make()
    return values[key]


def _output_node(out: Any) -> Any:
    """The graph node of the first tensor of ``out`` (functional tensors an inlined op's body
    returned), or None where nothing is traced (AOTAutograd's first, metadata-only pass)."""
    import torch
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    first = next((t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)), None)
    if mode is None or first is None:
        return None
    slot = get_proxy_slot(torch._from_functional_tensor(first.elem), mode.tracer, None)
    return None if slot is None else slot.proxy.node


def call(op: Any, *args: Any, differentiable: Iterable[Any] = (), **kwargs: Any) -> Any:
    """``op(*args, **kwargs)`` for an op made by :func:`custom_op`. In plain eager code where no
    ``differentiable`` input needs a gradient, its implementation directly: the same work
    without the dispatcher's and autograd's Python round trip (about 40 us of host time per
    call on an H200 host, docs/benchmarks.md). Plain eager: not tracing, no dispatch or
    function mode and no functorch transform active, plain tensors (no subclass such as
    FakeTensor or DTensor), so that modes (SAC, op counters) and compilers still see the op."""
    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    # NB: is_compiling first: dynamo cannot trace the mode queries.
    plain = (
        not is_compiling()
        and all(type(a) is torch.Tensor for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        and _get_current_dispatch_mode() is None
        and not torch._C._is_torch_function_mode_enabled()
        and not torch._C._are_functorch_transforms_active()
    )
    if plain and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable)):
        return _IMPLS[op](*args, **kwargs)
    return op(*args, **kwargs)


_ARG_NAMES: dict = {}  # custom op -> its argument names


def arg_names(op: Any) -> tuple[str, ...]:
    """The argument names of a custom op, in its schema's order (read once per op; a plain dict,
    not ``functools.cache``, which dynamo warns about where it traces an op's setup_context)."""
    if op not in _ARG_NAMES:
        _ARG_NAMES[op] = tuple(a.name for a in op._opoverload._schema.arguments)
    return _ARG_NAMES[op]


def named_inputs(op: Any, inputs: tuple) -> dict[str, Any]:
    """An op's ``inputs`` as its autograd ``setup_context`` gets them (schema order), by name: a
    schema edit cannot shift them silently."""
    return dict(zip(arg_names(op), inputs))


def inputs_as(cls: Any, op: Any, inputs: tuple) -> Any:
    """The NamedTuple ``cls`` (a bundle of an op's arguments, such as a route) from the op's
    autograd ``inputs``, its fields taken by argument name."""
    named = named_inputs(op, inputs)
    return cls(**{field: named[field] for field in cls._fields})


def input_grads(op: Any, **grads: Any) -> tuple:
    """What an op's autograd backward returns: one entry per argument of ``op``, in schema order,
    the gradients given by argument name and None for the rest."""
    names = arg_names(op)
    unknown = set(grads) - set(names)
    if unknown:
        raise TypeError(f"input_grads: {op._opoverload} has no argument {sorted(unknown)}; its arguments: {names}")
    return tuple(grads.get(name) for name in names)
