"""Every host-issued collective of the library goes through here:

- ``run``: one collective, waited for within the library's deadline (:func:`set_timeout`), its
  errors re-raised as ``alltoall_ops.<op> on group <name> (rank r of W): ...`` with the original
  as ``__cause__`` (:class:`CollectiveError`, :class:`CollectiveTimeout`);
- ``agree``: the *header agreement* that starts each op on a process group: one all-gather of a
  fixed-size int64 message per rank (op, call number, failure flag, the op's shared fields,
  and room for a small payload: a dispatch's counts, ``agree_and_gather``, or a failed rank's
  message), so that every rank raises the same error, before any payload moves, when a rank
  rejected its own arguments (:class:`PeerInputError` on its peers), the ranks are out of step, or they
  disagree on a field (:class:`GroupMismatchError`); ``forward`` passes such an error from one
  group on to another (a two-stage op's), whose ranks raise it too;
- ``comm_op``: the one registry of the library's custom ops that communicate (every backend's),
  which the selective-checkpointing policy and the graph summaries read.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from datetime import timedelta
from typing import Callable, Optional, Sequence, TypeVar, Union

import torch
import torch.distributed as dist

# NB: imported before any process group exists. Its collectives default to ``group=group.WORLD``,
# evaluated at its first import, which torch._dynamo's import makes (:func:`import_dynamo`, at a
# rank's first collective, after init_process_group): ten defaults then held the default group,
# so destroy_process_group left it alive, gloo's threads running, until interpreter exit, where
# its teardown aborted now and then ("terminate called without an active exception"). Imported
# here, before the user's init_process_group, its defaults are None.
import torch.distributed.nn.functional  # noqa: F401  (isort: skip)

from .errors import CollectiveError, CollectiveTimeout, GroupMismatchError, PeerInputError, RoutingError
from ._compat import custom_op, is_compiling
from .groups import LOCAL, process_group

T = TypeVar("T")

_COMM_OPS: list = []


def comm_op(name: str, **kwargs) -> Callable:
    """``_compat.custom_op("alltoall_ops::<name>")`` for an op that communicates, recorded in
    the registry :func:`communication_ops` reads."""

    def register(fn: Callable):
        op = custom_op(f"alltoall_ops::{name}", fn, **kwargs)
        # NB: with mutates_args=() the op is pure to dead-code elimination (FX's and inductor's):
        # on a rank with no tokens, where its outputs feed only zero-element work, the call was
        # dropped and the peers waited forever. Both the overload and its packet are marked, as
        # graphs may hold either.
        torch.fx.node.has_side_effect(op._opoverload)
        torch.fx.node.has_side_effect(getattr(torch.ops.alltoall_ops, name))
        _COMM_OPS.append(op)
        return op

    return register


def communication_ops() -> tuple[torch._ops.OpOverload, ...]:
    """Every op of this library that communicates (all backends)."""
    return tuple(op._opoverload for op in _COMM_OPS)

MAX_TIMEOUT_S = 1e9
"""The longest deadline :func:`set_timeout` takes (about 31 years; gloo's wait counts in ns)."""


def _seconds(name: str, value) -> float:
    """``value`` as a deadline in seconds, in (0, MAX_TIMEOUT_S] (so finite: not inf, not nan);
    ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"{name}: expected a finite positive number of seconds, at most {MAX_TIMEOUT_S:g}, "
                         f"got {value!r}")
    return float(value)


def _environment_timeout() -> float:
    raw = os.environ.get("ALLTOALL_OPS_TIMEOUT", "600")
    try:
        value = float(raw)
    except ValueError:
        value = raw  # not a number: _seconds names it
    return _seconds("ALLTOALL_OPS_TIMEOUT", value)


_timeout_s = _environment_timeout()


def set_timeout(seconds: float) -> None:
    """The library's deadline for one collective or barrier (default 600 s, or the environment
    variable ``ALLTOALL_OPS_TIMEOUT``): finite, positive, at most ``MAX_TIMEOUT_S``. Past it the
    op raises :class:`CollectiveTimeout`; the group is then unusable (peers may be inside the
    collective) and must be re-created."""
    global _timeout_s
    _timeout_s = _seconds("seconds", seconds)


def get_timeout() -> float:
    """The library's deadline in seconds (see :func:`set_timeout`)."""
    return _timeout_s


def where(op: str, pg: dist.ProcessGroup) -> str:
    """``alltoall_ops.<op> on group <name> (rank r of W)``: the prefix of every fault message."""
    return f"alltoall_ops.{op} on group {pg.group_name!r} (rank {pg.rank()} of {pg.size()})"


def debug() -> bool:
    """``ALLTOALL_OPS_DEBUG=1``: ops that exchange nothing before their payload (``combine`` on
    every backend) also start with an agreement, so a rank's bad arguments raise on every rank."""
    return os.environ.get("ALLTOALL_OPS_DEBUG", "0") == "1"


def import_dynamo() -> None:
    """Import ``torch._dynamo`` (1-2 s) if nothing has yet, before a deadline starts.

    torch imports it at the first call of any custom op through the dispatcher. A rank whose
    checks fail joins the agreement at once, without such a call, while its peers' first exchange
    op imports it: they came seconds late, past a short deadline, and every rank timed out
    instead of raising (issue 31). The package does not import it (``import alltoall_ops`` stays
    light, issue 40): every rank imports it here, at the start of each checked op and collective,
    so none starts waiting before it has."""
    if "torch._dynamo" not in sys.modules:
        import torch._dynamo  # noqa: F401


def run(op: str, group_name: str, start: Callable[[dist.ProcessGroup], Optional[dist.Work]],
        timeout: Optional[float] = None) -> None:
    """Run ``start(pg)`` (a collective issued with ``async_op=True``) for ``op`` and wait for it.

    On the CPU (gloo) the wait is bounded by ``timeout`` (default: the library's deadline).
    NCCL collectives are stream-ordered: the host does not wait here, and a stalled peer
    surfaces through the process group's own timeout (its watchdog)."""
    import_dynamo()
    pg = process_group(group_name)
    deadline_s = _timeout_s if timeout is None else timeout
    gloo = dist.get_backend(pg) == "gloo"
    started = time.monotonic()
    try:
        work = start(pg)
        if work is not None:
            if gloo:
                work.wait(timeout=timedelta(seconds=deadline_s))
            else:
                work.wait()
    except RuntimeError as exc:  # gloo and NCCL errors (DistBackendError included)
        if isinstance(exc, CollectiveError):
            raise
        if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            raise CollectiveError(f"{where(op, pg)}: failed: {exc}") from exc
        raise CollectiveTimeout(f"{where(op, pg)}: {_timed_out(time.monotonic() - started, deadline_s, gloo)}: "
                                f"{exc}") from exc


def _timed_out(waited_s: float, deadline_s: float, gloo: bool) -> str:
    """Which timer ended a wait of ``waited_s``: the library's deadline (gloo waits bound by it)
    or the process group's own timeout (shorter than it, or NCCL's, which the library leaves)."""
    if gloo and waited_s >= deadline_s:
        return f"timed out after {waited_s:.3g} s: the library's deadline ({deadline_s:g} s, a2a.set_timeout)"
    bound = f"before the library's deadline ({deadline_s:g} s)" if gloo else "the library's deadline bounds gloo only"
    return f"timed out after {waited_s:.3g} s: the process group's own timeout ({bound})"


def all_to_all(op: str, group_name: str, out: torch.Tensor, send: torch.Tensor,
               out_splits: Optional[list[int]] = None, in_splits: Optional[list[int]] = None) -> None:
    """``dist.all_to_all_single`` of ``send`` into ``out`` (rows split by the given sizes, equal
    splits when None) under :func:`run`."""
    run(op, group_name, lambda pg: dist.all_to_all_single(
        out, send.contiguous(), out_splits, in_splits, group=pg, async_op=True))


def device_of(pg: dist.ProcessGroup) -> torch.device:
    """Where the group's collectives take small tensors: the CPU for gloo, else this rank's GPU."""
    if dist.get_backend(pg) == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


# --------------------------------------------------------------------------------------------
# The header agreement

FIELDS: dict[str, tuple[str, ...]] = {
    "dispatch": ("num_experts", "hidden size", "dtype", "payload dtype", "top_k", "expert_alignment"),
    "hierarchical_dispatch": ("num_experts", "hidden size", "dtype", "payload dtype", "top_k", "expert_alignment",
                              "number of nodes", "ranks per node"),
    "combine": ("hidden size", "dtype", "top_k"),
    "exchange_counts": ("length of tokens_per_expert_global",),
    "symm_buffers": ("num_experts", "hidden size", "dtype", "payload dtype", "tokens", "top_k", "expert_alignment"),
    "seq_to_head": ("dtype", "ndim", "seq_dim", "head_dim", "shape"),
    "head_to_seq": ("dtype", "ndim", "seq_dim", "head_dim", "shape"),
}
"""The fields every rank of the group must agree on, per op that starts with an agreement."""

_OPS = tuple(FIELDS)
_FIXED = 4  # op code, call number, failure flag, number of fields
_MAX_FIELDS = 8
HEADER_LEN = _FIXED + _MAX_FIELDS
PAYLOAD_LEN = 1024
"""int64s of payload every agreement message has room for (e.g. a dispatch's counts, W * L of
them): messages have one fixed size, so ranks in different ops or calls still pair up."""
MESSAGE_LEN = HEADER_LEN + PAYLOAD_LEN

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
           torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)

_calls: collections.Counter = collections.Counter()  # group name -> agreements so far

_OWN, _FORWARDED = 1, 2  # an agreement's failure flag: the rank's own arguments failed; it passes on an error
FORWARDABLE = (GroupMismatchError, PeerInputError, RoutingError, CollectiveError)
"""Errors every rank of one group raises alike, which :func:`forward` passes on to another group."""
_FORWARDABLE_BY_NAME = {cls.__name__: cls for cls in (*FORWARDABLE, CollectiveTimeout)}


def dispatch_fields(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, expert_alignment: int,
                    dtype: torch.dtype, payload_dtype: torch.dtype) -> list[int]:
    """What the ranks of a dispatch agree on (``FIELDS["dispatch"]``): E, H, the dtype combine
    takes back, the dtype rows travel in, K, alignment."""
    return [num_experts, x.shape[1], dtype_code(dtype), dtype_code(payload_dtype), topk_idx.shape[1],
            expert_alignment]


def combine_fields(expert_out: torch.Tensor, top_k: int) -> list[int]:
    """What the ranks of a combine agree on (``FIELDS["combine"]``): H, dtype, K."""
    return [expert_out.shape[1], dtype_code(expert_out.dtype), top_k]


def header(op: str, *fields: int) -> list[int]:
    """``[op code, *fields]``: an agreement's header as an op argument (see ``exchange_counts``)."""
    return [_OPS.index(op), *fields]


def op_name(code: int) -> str:
    return _OPS[code]


def dtype_code(dtype: torch.dtype) -> int:
    """A small int naming ``dtype`` in a header (the same on every rank and torch version)."""
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 100 + torch.empty((), dtype=dtype).element_size()


def shape_code(shape: Sequence[int]) -> int:
    """One int64 fingerprint of a shape (equal shapes, equal codes)."""
    code = len(shape)
    for size in shape:
        code = (code * 1_000_003 + int(size)) % (1 << 62)
    return code


def _describe(field: str, value: int) -> str:
    if field in ("dtype", "payload dtype"):
        return str(_DTYPES[value - 1]) if 0 < value <= len(_DTYPES) else f"a dtype of {value - 100} bytes"
    if field == "shape":
        return f"shape fingerprint {value}"
    return str(value)


def agree(op: str, group_name: str, fields: Sequence[int], shapes: Optional[Sequence[int]] = None,
          equal: Optional[int] = None) -> list[list[int]]:
    """Collective: check that every rank of the group starts ``op`` with the same ``fields`` (in
    the order of ``FIELDS[op]``; only the first ``equal`` of them when given) and that none
    failed (:func:`tell`, :func:`forward`). Returns every rank's fields, by rank.

    Raises on every rank alike: a failed rank's error itself on that rank, else
    :class:`PeerInputError` with the first failed rank's error (the error's own type where that
    rank forwards it); :class:`GroupMismatchError` when ranks are in different ops or calls, or
    disagree on a field. ``shapes``: this rank's shape behind a ``shape`` field, for the message
    (exchanged only when the fingerprints differ)."""
    rows = _agree(op, group_name, fields, None, shapes, equal, None, _OWN)
    return [row[_FIXED : _FIXED + len(FIELDS[op])] for row in rows]


def agree_and_gather(op: str, group_name: str, fields: Sequence[int], payload: torch.Tensor) -> list[list[int]]:
    """:func:`agree`, carrying ``payload`` (at most ``PAYLOAD_LEN`` int64s, on any device: copied
    into the message on the device, not read first) in the same all-gather. Returns every
    rank's payload, by rank, read on the host with the agreement: one exchange, one read."""
    rows = _agree(op, group_name, fields, None, None, None, payload, _OWN)
    return [row[HEADER_LEN : HEADER_LEN + payload.numel()] for row in rows]


def tell(op: str, group_name: str, error: BaseException) -> None:
    """Collective: take part in ``op``'s agreement on ``group_name`` with ``error``, this rank's
    own (a rejected argument), so that its peers there raise a :class:`PeerInputError` naming
    it. Returns once the messages are exchanged; the caller then raises ``error`` itself."""
    if group_name != LOCAL:
        _join(op, group_name, error, _OWN)


def forward(op: str, group_name: str, error: BaseException) -> None:
    """Collective: pass ``error`` (one of ``FORWARDABLE``, raised on this rank by a group it
    shares with the others, e.g. a two-stage op's first stage) on to ``group_name``'s ranks,
    which are in ``op``'s agreement there: they raise the same type, naming this rank. Returns
    once the messages are exchanged; the caller then raises ``error`` itself."""
    if group_name != LOCAL:
        _join(op, group_name, error, _FORWARDED)


def _join(op: str, group_name: str, problem: BaseException, kind: int) -> None:
    """Take part in ``op``'s agreement with ``problem`` (so the peers raise), without raising it,
    nor the :class:`CollectiveError` of an agreement that fails (peers later than the deadline,
    or gone, are not told and raise their own): the caller raises ``problem`` either way, and a
    two-stage op still tells its other group."""
    try:
        _agree(op, group_name, (), problem, None, None, None, kind)
    except BaseException as exc:
        if exc is not problem and not isinstance(exc, CollectiveError):
            raise


def _agree(op: str, group_name: str, fields: Sequence[int], problem: Optional[BaseException],
           shapes: Optional[Sequence[int]], equal: Optional[int], payload: Optional[torch.Tensor],
           kind: int) -> list[list[int]]:
    """The agreement's exchange and checks; returns every rank's header and the payload this
    rank sent a part of (HEADER_LEN + payload.numel() ints of each message).
    ``kind``: how the peers read ``problem`` (``_OWN``: a PeerInputError; ``_FORWARDED``: its type)."""
    pg = process_group(group_name)
    names = FIELDS[op]
    values = [0] * len(names) if problem is not None else [int(v) for v in fields]
    call = _calls[group_name]
    _calls[group_name] += 1
    header = [_OPS.index(op), call, 0 if problem is None else kind, len(names)] + values
    header += [0] * (HEADER_LEN - len(header))
    send = torch.zeros(MESSAGE_LEN, dtype=torch.int64, device=device_of(pg))
    send[:HEADER_LEN] = torch.tensor(header, dtype=torch.int64)
    if problem is not None:
        send[HEADER_LEN:] = _encode_error(problem)
    elif payload is not None:
        if payload.numel() > PAYLOAD_LEN:
            raise ValueError(f"agree: a payload of at most {PAYLOAD_LEN} ints, got {payload.numel()}")
        send[HEADER_LEN : HEADER_LEN + payload.numel()] = payload.reshape(-1)
    gathered = torch.empty(pg.size(), MESSAGE_LEN, dtype=torch.int64, device=send.device)
    run(op, group_name, lambda g: dist.all_gather(list(gathered.unbind(0)), send, group=g, async_op=True))
    # Host sync: (W, HEADER_LEN + payload); a failed rank's message is decoded from the tensor
    rows = gathered[:, : HEADER_LEN + (0 if payload is None else payload.numel())].tolist()
    failed = [r for r, row in enumerate(rows) if row[2]]
    if failed:
        if problem is not None:
            raise problem
        first = failed[0]
        type_name, message = _decode_error(gathered[first, HEADER_LEN:])
        if rows[first][2] == _FORWARDED:
            raise _FORWARDABLE_BY_NAME[type_name](f"{where(op, pg)}: from rank {first} of this group: {message}")
        others = f" (ranks {failed} all failed)" if len(failed) > 1 else ""
        raise PeerInputError(f"{where(op, pg)}: rank {first} rejected its arguments{others}: {type_name}: {message}")
    steps = {(row[0], row[1]) for row in rows}
    if len(steps) > 1:
        per_rank = ", ".join(f"rank {r} is in {_OPS[row[0]]} (call {row[1]})" for r, row in enumerate(rows))
        raise GroupMismatchError(f"{where(op, pg)}: the ranks are out of step: {per_rank}; every rank "
                                 "must call the library's ops in the same order")
    for i, name in enumerate(names[:equal]):
        seen = [row[_FIXED + i] for row in rows]
        if len(set(seen)) > 1:
            if name == "shape" and shapes is not None:
                per_rank = gather_objects(op, group_name, tuple(int(s) for s in shapes))
            else:
                per_rank = [_describe(name, v) for v in seen]
            listed = ", ".join(f"rank {r} has {v}" for r, v in enumerate(per_rank))
            raise GroupMismatchError(f"{where(op, pg)}: the ranks disagree on {name}: {listed}; every rank "
                                     "must pass the same")
    return rows


def _encode_error(problem: BaseException) -> torch.Tensor:
    """``"<type name>: <message>"`` as (PAYLOAD_LEN,) int64 of UTF-8 bytes (cut to fit, zero
    padded): a failed rank's message travels in its agreement message itself, so a peer reads it
    from the one all-gather, even one that arrives after this rank has stopped waiting."""
    data = f"{type(problem).__name__}: {problem}".encode()[: PAYLOAD_LEN * 8]
    return torch.frombuffer(bytearray(data.ljust(PAYLOAD_LEN * 8, b"\0")), dtype=torch.int64)


def _decode_error(payload: torch.Tensor) -> tuple[str, str]:
    """:func:`_encode_error`'s (PAYLOAD_LEN,) int64 -> (type name, message)."""
    data = bytes(payload.cpu().view(torch.uint8).tolist()).rstrip(b"\0")
    type_name, _, message = data.decode(errors="ignore").partition(": ")
    return type_name, message


def checked(op: str, group_name: Union[str, Sequence[str]], check: Callable[..., T], *args) -> T:
    """``check(*args)``: the argument checks of ``op``. On a group, a rank whose checks raise
    takes part in ``op``'s agreement with its error, so its peers (waiting there) raise too.
    ``group_name``: the op's group, or its groups in the order the op communicates over them (a
    two-stage op): the failing rank joins ``op``'s agreement on each, then raises.

    Under torch.compile the checks run at trace time, where no collective can: they raise on
    this rank only, and its peers' next collective ends at the library's deadline."""
    names = [name for name in ((group_name,) if isinstance(group_name, str) else group_name) if name != LOCAL]
    if not names or is_compiling():
        return check(*args)
    import_dynamo()  # NB: before the checks, on every rank alike (a failing rank agrees at once)
    try:
        return check(*args)
    except (TypeError, ValueError) as exc:
        for name in names:
            tell(op, name, exc)
        raise


def gather_objects(op: str, group_name: str, obj) -> list:
    """Every rank's ``obj``, by rank: a second exchange, bounded by the process group's timeout
    (not the library's deadline), so only where every rank takes it right after an exchange they
    all passed (every rank's shape on a disagreement; symm_mem's failure messages)."""
    pg = process_group(group_name)
    out: list = [None] * pg.size()
    try:
        dist.all_gather_object(out, obj, group=pg)
    except RuntimeError as exc:
        raise CollectiveError(f"{where(op, pg)}: failed while gathering the ranks' errors: {exc}") from exc
    return out
