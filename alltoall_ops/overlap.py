"""Async exchanges: a dispatch or combine started on a communication stream (``async_op=True``)
and the :func:`wait` that joins it, so that work which does not read the exchange (a shared
expert) runs beside it::

    y_TH = a2a.combine(out_RH, handle, topk_weights_TK, async_op=True)  # the exchange starts
    shared_TH = shared_expert(x_TH)                                     # beside it
    out_TH = a2a.wait_add(y_TH, shared_TH)                              # join, then y + shared

The start is the backend's own op (its ``async_op`` argument), the wait is PyTorch's
functional-collective wait (``torch.ops._c10d_functional.wait_tensor``), which autograd passes
through, torch.compile keeps in place and inductor knows: the start registers a
:class:`PendingExchange` under each of its outputs, a wait on any one finds it there. :func:`wait_add` ends a
combine with the sum ``y + other`` in one op, so that the work making ``other`` stays before the
wait in compiled code too (a data dependency: inductor schedules freely otherwise).

Stream and buffer rules (CUDA):
- The exchange runs on one communication stream per device (:func:`comm_stream`), after
  everything queued on the current stream before the start (it waits on it): exchanges run
  one after another in the order they were started, so a start into the same symm_mem buffers
  cannot overtake an earlier one, and a start cannot overtake the compute stream's last reads of
  the buffers either.
- The tensors the exchange reads and writes stay alive until the wait (the pending exchange
  holds them: no ``record_stream`` on the inputs); the wait makes the current stream wait for
  the communication stream and records the outputs on it (they were allocated on the
  communication stream), so the allocator reuses their memory only after the current stream's
  use of them.
- Every start needs its wait before any output of the exchange is read (a wait on any one
  output covers every output of the op).
- The backward of an async op is its adjoint exchange run in place (synchronously); it reads
  the op's saved outputs after a wait (:func:`save_for_backward`, :func:`saved_tensors`), so a
  start that recomputation ran again (checkpointing) is waited for there.
On the CPU there are no streams: the exchange runs in place and the wait only drops the record.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from ._compat import OpaqueBase, custom_op, is_compiling

Out = TypeVar("Out")

_COMM_STREAMS: dict[int, torch.cuda.Stream] = {}


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The communication stream of a CUDA device (one per device and process, made once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COMM_STREAMS:
        _COMM_STREAMS[index] = torch.cuda.Stream(device=index)
    return _COMM_STREAMS[index]


class PendingExchange(dist.Work):
    """A started exchange, registered under each of its outputs: its stream (None on the CPU),
    the tensors it reads and writes (held until the wait), and its outputs. A wait on any one
    output (:meth:`wait`) waits for the exchange, records the outputs on the current stream and
    drops the other outputs' registrations."""

    started: set[PendingExchange] = set()
    """The exchanges not waited for yet, in this process."""

    def __init__(self, stream: Optional[torch.cuda.Stream], reads: tuple, outputs: list[torch.Tensor]):
        super().__init__()
        self.stream, self.reads, self.outputs = stream, reads, outputs

    def wait(self, timeout: Any = None) -> bool:
        outputs, self.reads, self.outputs = self.outputs, (), []
        if not outputs:
            return True  # waited already, through another output
        PendingExchange.started.discard(self)
        if self.stream is not None:
            current = torch.cuda.current_stream(self.stream.device)
            current.wait_stream(self.stream)
            for t in outputs:
                t.record_stream(current)
        for t in outputs:
            torch.ops._c10d_functional.wait_tensor(t)  # NB: drops t's registration (the waited one's is gone)
        return True


def start(exchange: Callable[[], Out], *reads: Any) -> Out:
    """``exchange()``, an op's body, started on the communication stream of the device of the
    first CUDA tensor in ``reads`` (everything the body reads; in place on the CPU) and pending
    until :func:`wait` on any of its outputs."""
    cuda = next((t.device for t in reads if isinstance(t, torch.Tensor) and t.is_cuda), None)
    stream = None if cuda is None else comm_stream(cuda)
    if stream is None:
        out = exchange()
    else:
        stream.wait_stream(torch.cuda.current_stream(cuda))
        with torch.cuda.stream(stream):
            out = exchange()
    outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    pending = PendingExchange(stream, reads, outputs)
    PendingExchange.started.add(pending)
    for t in outputs:
        torch._C._distributed_c10d._register_work(t, pending)
    return out


def startable(body: Callable[..., Out]) -> Callable[..., Out]:
    """An exchange op's body with the meaning of its ``async_op`` argument (a bool, last, default
    False): with it, the body runs through :func:`start` on the communication stream, reading
    every tensor argument (and holding its opaque ones: symm_mem's buffers, :func:`pending_on`).
    The op's schema is the body's (the wrapper keeps its signature)."""
    signature = inspect.signature(body, eval_str=True)  # NB: annotations resolved in the body's module
    position = list(signature.parameters).index("async_op")

    @functools.wraps(body)
    def op_body(*args: Any, **kwargs: Any) -> Out:
        async_op = args[position] if len(args) > position else kwargs.get("async_op", False)
        if not async_op:
            return body(*args, **kwargs)
        reads = [a for a in (*args, *kwargs.values()) if isinstance(a, (torch.Tensor, OpaqueBase))]
        return start(lambda: body(*args, **kwargs), *reads)

    op_body.__signature__ = signature  # what custom_op infers the schema from
    return op_body


def wait(x: Any) -> Any:
    """The outputs of an async dispatch or combine, ready: ``x`` a tensor, or a tuple / list of
    tensors (an fp8 dispatch's (values, scales)), returned as given (anything else: TypeError). A
    tensor no exchange is pending on passes through (free). Work between the start and this wait is not bound to stay
    there under torch.compile (nothing it makes feeds the wait): end a combine with
    :func:`wait_add` instead, which is bound."""
    if isinstance(x, (tuple, list)):
        return type(x)(wait(t) for t in x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a tensor an async dispatch or combine returned, or a tuple / list of them, "
                        f"got {type(x).__name__}")
    return torch.ops._c10d_functional.wait_tensor(x)


def save_for_backward(ctx: Any, output: Any, async_op: bool, *tensors: Optional[torch.Tensor]) -> None:
    """``ctx.save_for_backward(*tensors)`` in the autograd ``setup_context`` of an exchange op that
    returned ``output``; the backward reads them with :func:`saved_tensors`. Recomputation may
    start an async exchange again and never reach its wait (checkpointing without ``sac_policy``
    stops at the last saved tensor; the compiler's recompute keeps only what the backward reads),
    so with ``async_op`` the backward waits: on the op's outputs among ``tensors``, before it reads
    them, else (eager only) on its first output, saved for that. A compiled backward reads no
    output it has not waited on and runs no start whose outputs it does not read."""
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    ctx.waits = [i for i, t in enumerate(tensors) if any(t is o for o in outputs)] if async_op else []
    ctx.wait_only = async_op and not ctx.waits
    ctx.save_for_backward(*tensors, *outputs[:ctx.wait_only])


def saved_tensors(ctx: Any) -> list[Optional[torch.Tensor]]:
    """The tensors :func:`save_for_backward` saved, in order, the async op's outputs among them
    after their wait (free when nothing is pending)."""
    *saved, first = ctx.saved_tensors if ctx.wait_only else (*ctx.saved_tensors, None)
    if type(first) is torch.Tensor and not is_compiling():  # NB: eager only: a traced tensor is a fake
        wait(first)
    return [wait(t) if i in ctx.waits else t for i, t in enumerate(saved)]


def _wait_add(pending: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``wait(pending) + other`` as one op (``pending`` (T, H) an async combine's y, ``other``
    (T, H) work done meanwhile, e.g. a shared expert's output): ``other`` is an input of the wait,
    so compilers keep the work that makes it before the wait (inductor moves work freely up to its
    first use otherwise, which would be after a plain wait). The sum as torch's ``+``."""
    return torch.ops._c10d_functional.wait_tensor(pending) + other


wait_add = custom_op("alltoall_ops::wait_add", _wait_add)


@wait_add.register_fake
def _(pending, other):
    # NB: the add's shape and dtype (broadcasting as torch's +)
    return pending + other


def _wait_add_setup_context(ctx, inputs, output):
    ctx.shapes = tuple(t.shape for t in inputs)


def _wait_add_backward(ctx, grad_TH):
    # d (a + b) = (grad, grad), summed back to a broadcast input's shape
    return tuple(grad_TH.sum_to_size(shape) for shape in ctx.shapes)


wait_add.register_autograd(_wait_add_backward, setup_context=_wait_add_setup_context)


def pending_on(obj: Any) -> bool:
    """Whether an exchange started and not waited for in this process holds ``obj`` (an opaque
    argument of its op, e.g. symm_mem's buffers) among what it reads."""
    return any(any(a is obj for a in pending.reads) for pending in PendingExchange.started)


def check_nothing_pending(buffers: Any, entry: str) -> None:
    """Raise unless every exchange started on ``buffers`` (symm_mem's, an opaque argument of their
    ops) with ``async_op=True`` was waited for, before an exchange ``entry`` on the current stream:
    it would not run after the pending one (their barriers would meet out of order, and the two
    would share the buffers' memory). Eager code only; every rank of an SPMD program raises alike,
    before any communication."""
    if not is_compiling() and pending_on(buffers):
        raise RuntimeError(
            f"alltoall_ops.{entry} (symm_mem): an exchange on these buffers was started with async_op=True and "
            "not waited for; wait for its outputs (alltoall_ops.wait or wait_add) before the next exchange on the "
            "same buffers that is not started with async_op=True (a dispatch: before any)"
        )


def pending_exchanges() -> int:
    """Started exchanges (and other functional collectives) not waited for yet, in this process:
    one each, however many outputs it is registered under."""
    registrations = torch._C._distributed_c10d._get_work_registry_size()
    return registrations - sum(len(pending.outputs) - 1 for pending in PendingExchange.started)
