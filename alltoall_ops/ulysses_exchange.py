"""The Ulysses exchange over a process group: pieces of several tensors in one
``all_to_all_single``, this rank's header at the start of every piece (no collective of its own).

Legend: W ranks; piece r of an exchange goes to rank r; every piece is ``PREFIX_BYTES`` of header
(:data:`FIELDS`, one int64 each) and then the payload in the tensors' dtype. A :class:`Plan` says
what an exchange of given arguments sends and receives on this rank (``ulysses`` makes it after
its checks, once per distinct arguments); :func:`exchange` moves the bytes.

Why the header needs no exchange of its own: the sizes every rank posts must agree before an
all-to-all is issued (gloo terminates a process that receives more bytes than it posted, and
leaves the rest of a shorter piece unwritten: torch 2.13), and the header is what makes them
agree. So an exchange whose sizes the caller chose posts the sizes of the group's last agreed
exchange (:data:`_agreed`, the same on every rank): the exchange itself when its sizes are those,
else this rank's header in pieces of those sizes (headers alone the first time), and its own once
every rank found every header equal to its own. Exchanges whose sizes follow from an agreed one
(``ulysses_attention``'s o, every backward) post their own. An exchange that always follows
another one (k and v's after q's, in ``ulysses_attention`` given projections) is agreed through
the last exchange that followed an exchange of the same key (:data:`AFTER_PREVIOUS`), so that
two exchanges that alternate each find their own sizes.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from . import comm
from .backends.symm_mem.ulysses_buffers import PIECE_ALIGN
from .errors import CapacityError, CollectiveError, GroupMismatchError, PeerInputError
from .groups import LOCAL, process_group
from .kernels import loader
from .kernels.region import SEQ_HEADER_FIELDS, SEQ_REJECTED_DTYPE
from .layout import round_up

FIELDS = SEQ_HEADER_FIELDS
"""The header at the start of every piece of an exchange (``kernels.region.SEQ_HEADER_FIELDS``)."""
HEADER_LEN = len(FIELDS)
PREFIX_BYTES = 8 * HEADER_LEN
"""Bytes of the header at the start of every piece of an exchange."""
_MAGIC = 0x554C5953 << 8  # "ULYS": a piece of this module's exchanges (op code in the low bits)
_OPS = ("seq_to_head", "head_to_seq")
_exchanges: collections.Counter = collections.Counter()  # group name -> exchanges so far


class Plan(NamedTuple):
    """What an exchange of given arguments does on this rank (``ulysses._plan`` makes it)."""
    seq_dim: int
    head_dim: int
    split_dim: int  # the dim whose pieces go to the ranks
    cat_dim: int  # the dim along which the received pieces are joined
    shapes: list  # the shapes every rank shares (head_to_seq: with all num_heads heads)
    send_sizes: list  # [i][r]: positions of xs[i] along split_dim for rank r
    recv_shapes: list  # [i][r]: the shape of the piece of xs[i] from rank r
    out_shapes: list  # [i]: the shape of output i, the pieces from every rank joined along cat_dim
    key: tuple  # the header but the exchange count
    send_bytes: tuple  # [r]: bytes to rank r, header included, a multiple of 8 (padded)
    recv_bytes: tuple  # [r]: bytes from rank r, header included, a multiple of 8 (padded)
    regular: bool  # every piece of each tensor has one shape, both ways: (W, bytes) buffers
    send_pieces: list  # [i]: the shape of xs[i]'s piece for each rank, when regular
    dtype: torch.dtype
    held_views: dict  # on the CPU: "memory" -> the held buffers, "views" -> their _Views


_plans: dict = {}  # (group name, the arguments of an exchange) -> its Plan
_MAX_PLANS = 256


_groups: dict[str, Any] = {}  # group name -> the ProcessGroup the state above is about


def _same_group(group_name: str) -> None:
    """Forget the exchange count, the agreed sizes, the held bytes and the plans of a group name
    that now names another ProcessGroup (destroyed and made again, perhaps with other ranks, in
    other processes): every rank makes the new group, so every rank starts it afresh."""
    if group_name == LOCAL:
        return
    pg = process_group(group_name)
    if _groups.get(group_name) is not pg:
        _groups[group_name] = pg
        _exchanges.pop(group_name, None)
        _agreed.pop(group_name, None)
        _agreed_after.pop(group_name, None)
        _previous.pop(group_name, None)
        _held.pop((group_name, "send"), None)
        _held.pop((group_name, "recv"), None)
        _headers_of.pop(group_name, None)
        for args in [args for args in _plans if args[0] == group_name]:
            del _plans[args]


def cached_plan(group_name: str, args: tuple, make: Callable[..., "Plan"], *make_args: Any,
                plans: Optional[dict] = None) -> "Plan":
    """The plan of ``args`` on ``group_name``: ``make(*make_args)`` once per distinct arguments
    (the same arguments pass the same checks and move the same sizes), so an exchange's host work
    is a lookup. plans: the cache of a UlyssesBuffers (its own group; by default the process
    groups' cache, forgotten when a group name names another group)."""
    if plans is None:
        _same_group(group_name)
        plans = _plans
    plan = plans.get((group_name, args))
    if plan is None:
        plan = make(*make_args)
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plans[(group_name, args)] = plan
    return plan


def plan(op: str, xs: Sequence[torch.Tensor], W: int, seq_dim: int, head_dim: int, split_dim: int, cat_dim: int,
         shapes: list, sizes: list, recv_shapes: list, attention: Sequence[int]) -> Plan:
    """The :class:`Plan` of ``op`` on ``xs`` (checked, one dtype and ndim), given its shapes
    (see :class:`Plan`'s fields)."""
    x = xs[0]
    key = (_MAGIC + _OPS.index(op), comm.shape_code(attention), comm.dtype_code(x.dtype), x.ndim, seq_dim, head_dim,
           comm.shape_code([n for shape in shapes for n in shape]))
    size = x.element_size()
    align = max(8, size)  # every piece a whole number of int64s (its header as (8,) int64) and of elements

    def piece_bytes(elements: int) -> int:
        return PREFIX_BYTES + -(-size * elements // align) * align

    rest = [math.prod(n for d, n in enumerate(t.shape) if d != split_dim) for t in xs]  # elements per position
    send_bytes = tuple(piece_bytes(sum(n * s[r] for n, s in zip(rest, sizes))) for r in range(W))
    recv_bytes = tuple(piece_bytes(sum(math.prod(s[r]) for s in recv_shapes)) for r in range(W))
    regular = (len(set(send_bytes)) == 1 and len(set(recv_bytes)) == 1 and all(len(set(s)) == 1 for s in sizes)
               and all(r == shapes_i[0] for shapes_i in recv_shapes for r in shapes_i))
    send_pieces = [[*t.shape[:split_dim], s[0], *t.shape[split_dim + 1:]] for t, s in zip(xs, sizes)]
    out_shapes = [[*pieces[0][:cat_dim], sum(p[cat_dim] for p in pieces), *pieces[0][cat_dim + 1:]]
                  for pieces in recv_shapes]
    return Plan(seq_dim, head_dim, split_dim, cat_dim, shapes, sizes, recv_shapes, out_shapes, key, send_bytes,
                recv_bytes, regular, send_pieces, x.dtype, {})


class _Pieces(NamedTuple):
    """An exchange's key (its header without the exchange count) and this rank's piece sizes in
    bytes, headers included: what it sends to and receives from each rank."""
    key: tuple
    send: tuple
    recv: tuple


CALLERS, AGREED, AFTER_PREVIOUS = 0, 1, 2
"""Where an exchange's sizes come from (the ops' ``sizes`` argument): the caller (agreed through
the group's last agreed exchange of caller-chosen sizes, :data:`_agreed`); an exchange the group
agreed on (posted as they are: ``ulysses_attention``'s o, every backward); the caller, in an
exchange that always follows an exchange of one key (k and v's after q's): agreed through the
last exchange that followed an exchange of the previous one's key (:data:`_agreed_after`)."""

_agreed: dict[str, _Pieces] = {}
"""Group name -> its last agreed exchange (of those whose sizes the caller chose, CALLERS): the
sizes every rank of the group posts for the next such exchange. The same on every rank: it changes
only after an exchange whose W headers every rank compared and found equal."""

_agreed_after: dict[str, dict[tuple, _Pieces]] = {}
"""Group name -> {the key of an exchange -> the last agreed AFTER_PREVIOUS exchange that followed
one of that key}. The same on every rank: every rank's previous exchange had one key (a rank in
another one raised at its header compare, or trapped on CUDA, where the compare is queued before
this exchange), and an entry changes only after an exchange whose headers every rank found equal."""

_previous: dict[str, tuple] = {}
"""Group name -> the key of the group's last exchange (of any sizes)."""


_held: dict[tuple[str, str], torch.Tensor] = {}
"""(group name, "send" | "recv") -> the CPU bytes the group's exchanges reuse, as large as its
largest exchange: a fresh CPU buffer of a few hundred KB costs more in page faults than gloo takes
to move it. Only on the CPU, where an exchange has ended when it returns (gloo waits); CUDA's
caching allocator reuses memory in stream order already."""


_headers_of: dict[str, Plan] = {}
"""Group name -> the plan whose headers the held send bytes hold (but the exchange count), while
no other exchange wrote into them."""


def _buffer(nbytes: Sequence[int], device: torch.device, header: Optional[torch.Tensor] = None,
            held: Optional[tuple[str, str]] = None) -> torch.Tensor:
    """An exchange's buffer of pieces of ``nbytes[r]`` bytes, ``header`` (PREFIX_BYTES uint8) at
    the start of each when given: (W, bytes) when the pieces are equal (gloo then runs its
    alltoall, not the slower alltoallv), else 1-D. The rest is not written. On the CPU, the
    bytes held for ``held`` (see :data:`_held`)."""
    W, total = len(nbytes), sum(nbytes)
    if device.type == "cpu" and held is not None:
        if held[1] == "send":
            _headers_of.pop(held[0], None)
        memory = _held.get(held)
        if memory is None or memory.numel() < total:
            _let_go(held[0])
            memory = _held[held] = torch.empty(total, dtype=torch.uint8)
        buffer = memory[:total]
    else:
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
    if len(set(nbytes)) == 1:
        buffer = buffer.view(W, nbytes[0])
        if header is not None:
            buffer[:, :PREFIX_BYTES] = header
        return buffer
    for start in _starts(nbytes) if header is not None else ():
        buffer[start : start + PREFIX_BYTES] = header
    return buffer


def _let_go(group_name: str) -> None:
    """Drop the plans' views of the group's held bytes (about to be replaced), so that the old bytes
    are freed."""
    for (name, _), plan in _plans.items():
        if name == group_name:
            plan.held_views.clear()


def _starts(nbytes: Sequence[int]) -> list[int]:
    return [sum(nbytes[:r]) for r in range(len(nbytes))]


def _bodies(buffer: torch.Tensor, nbytes: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each piece of ``buffer`` (see :func:`_buffer`) past its header, as 1-D ``dtype`` views."""
    if buffer.ndim == 2:
        return list(buffer[:, PREFIX_BYTES:].view(dtype).unbind(0))
    return [buffer[start + PREFIX_BYTES : start + n].view(dtype) for start, n in zip(_starts(nbytes), nbytes)]


def _headers(buffer: torch.Tensor, nbytes: Sequence[int]) -> torch.Tensor:
    """(W, PREFIX_BYTES) uint8: the header at the start of each piece of ``buffer``."""
    if buffer.ndim == 2:
        return buffer[:, :PREFIX_BYTES]
    return torch.stack([buffer[start : start + PREFIX_BYTES] for start in _starts(nbytes)])


class _Views(NamedTuple):
    """Views of the (W, bytes) buffers of an exchange whose pieces of each tensor have one shape."""
    send: torch.Tensor  # (W, send bytes) uint8
    received: torch.Tensor  # (W, recv bytes) uint8
    send_headers: torch.Tensor  # (W, PREFIX_BYTES) uint8
    send_counts: torch.Tensor  # (W,) int64: the exchange count of each send header
    received_headers: torch.Tensor  # (W, PREFIX_BYTES) uint8
    send_pieces: list  # [i]: (W, *piece of xs[i]) in xs's dtype: where xs[i]'s pieces go
    received_pieces: list  # [i]: output i's pieces, in the output's order with W before cat_dim (.., W, s, ..)
    outputs: list  # [i]: output i's shape


def _views(send: torch.Tensor, received: torch.Tensor, plan: Plan) -> _Views:
    W = len(plan.send_bytes)
    send_body, received_body = send[:, PREFIX_BYTES:].view(plan.dtype), received[:, PREFIX_BYTES:].view(plan.dtype)
    send_pieces, received_pieces, col, row = [], [], 0, 0
    for piece, shapes in zip(plan.send_pieces, plan.recv_shapes):
        n = math.prod(piece)
        send_pieces.append(send_body[:, col : col + n].view(W, *piece))
        m = math.prod(shapes[0])
        received_pieces.append(received_body[:, row : row + m].view(W, *shapes[0]).movedim(0, plan.cat_dim))
        col, row = col + n, row + m
    send_headers = send[:, :PREFIX_BYTES]
    return _Views(send, received, send_headers, send_headers.view(torch.int64)[:, 1], received[:, :PREFIX_BYTES],
                  send_pieces, received_pieces, plan.out_shapes)


def _held_views(group_name: str, plan: Plan) -> _Views:
    """:func:`_views` of the group's held CPU bytes for ``plan``, made once while they are held."""
    cached = plan.held_views
    memory = cached.get("memory")
    if memory is None or memory[0] is not _held.get((group_name, "send")) or \
            memory[1] is not _held.get((group_name, "recv")):
        send = _buffer(plan.send_bytes, torch.device("cpu"), held=(group_name, "send"))
        received = _buffer(plan.recv_bytes, torch.device("cpu"), held=(group_name, "recv"))
        cached["memory"] = (_held[(group_name, "send")], _held[(group_name, "recv")])
        cached["views"] = _views(send, received, plan)
    return cached["views"]


def _pack(send: torch.Tensor, xs: Sequence[torch.Tensor], split_dim: int, sizes: list[list[int]],
          nbytes: Sequence[int]) -> None:
    """Piece r of every ``xs[i]`` along ``split_dim`` (``sizes[i][r]`` long) after the header of
    ``send``'s piece r, in xs's dtype: the one copy of the send side (the permute)."""
    W = len(nbytes)
    if send.ndim == 2 and all(len(set(s)) == 1 for s in sizes):
        body, col = send[:, PREFIX_BYTES:].view(xs[0].dtype), 0  # (W, sum of piece elements)
        for x, s in zip(xs, sizes):
            piece = x.unflatten(split_dim, (W, s[0])).movedim(split_dim, 0)  # (W, *piece)
            n = math.prod(piece.shape[1:])
            body[:, col : col + n].view(piece.shape).copy_(piece)
            col += n
        return
    bodies = _bodies(send, nbytes, xs[0].dtype)
    pieces = [x.split(s, dim=split_dim) for x, s in zip(xs, sizes)]  # [i][r]
    for r, body in enumerate(bodies):
        col = 0
        for p in pieces:
            n = p[r].numel()
            body[col : col + n].view(p[r].shape).copy_(p[r])
            col += n


def _unpack(received: torch.Tensor, plan: Plan) -> list[torch.Tensor]:
    """The outputs of ``plan`` (``plan.out_shapes``): for each i, the pieces of shape
    ``plan.recv_shapes[i][r]`` from ranks r = 0..W-1 (after each piece's header in ``received``)
    concatenated along the cat dim: new tensors, one copy each (the permute)."""
    recv_shapes, cat_dim = plan.recv_shapes, plan.cat_dim
    numel = [[math.prod(s) for s in shapes] for shapes in recv_shapes]  # [i][r]
    if received.ndim == 2 and all(s == shapes[0] for shapes in recv_shapes for s in shapes):
        body, col, outs = received[:, PREFIX_BYTES:].view(plan.dtype), 0, []  # (W, sum over i of numel[i][0])
        for n, shapes, shape in zip(numel, recv_shapes, plan.out_shapes):
            piece = body[:, col : col + n[0]].view(len(shapes), *shapes[0]).movedim(0, cat_dim)  # (.., W, s, ..)
            out = piece.new_empty(shape)
            out.view(piece.shape).copy_(piece)
            outs.append(out)
            col += n[0]
        return outs
    bodies = _bodies(received, plan.recv_bytes, plan.dtype)
    rows = [body[: sum(n[r] for n in numel)].split([n[r] for n in numel]) for r, body in enumerate(bodies)]  # [r][i]
    return [torch.cat([rows[r][i].view(shapes[r]) for r in range(len(shapes))], dim=cat_dim)
            for i, shapes in enumerate(recv_shapes)]


def exchange(op: str, xs: Sequence[torch.Tensor], group_name: str, plan: Plan, sizes: int,
             described: Callable[[], dict]) -> list[torch.Tensor]:
    """Piece r of each ``xs[i]`` (``plan.send_sizes[i][r]`` long along the dim ``op`` splits:
    heads for seq_to_head, sequence for head_to_seq) to rank r, and for each i what arrives from
    ranks 0..W-1 (of ``plan.recv_shapes[i]``) concatenated along the other dim, all in one
    all-to-all in xs's dtype, this rank's header at the start of every piece, checked by
    :func:`_check_headers` on arrival (``described()``: this rank's value of each of
    :data:`FIELDS`, for a message).

    The sizes of an exchange must agree between ranks before it is posted (gloo terminates a
    process that receives more bytes than it posted, and leaves the rest of a shorter piece
    unwritten). ``sizes`` (:data:`CALLERS`, :data:`AGREED`, :data:`AFTER_PREVIOUS`): AGREED, they
    follow from shapes an earlier exchange of the group agreed on (ulysses_attention's o after q,
    k, v; every backward after its forward). Else they are the caller's: posted as they are when
    they are the last agreed exchange's (``_agreed``, the group's; AFTER_PREVIOUS:
    ``_agreed_after``, the last that followed an exchange of the previous one's key; the same on
    every rank); otherwise this rank's header first travels in pieces of the last agreed sizes
    (headers alone the first time), and the exchange follows with its own sizes once every rank
    found every header equal to its own. Returns new contiguous tensors."""
    W = len(plan.send_bytes)
    if W == 1:
        return [x.clone(memory_format=torch.contiguous_format) for x in xs]  # op outputs must not alias inputs
    x = xs[0]
    key, count = plan.key, _exchanges[group_name]
    _exchanges[group_name] += 1
    cpu = x.device.type == "cpu"
    slots, slot = (_agreed, group_name) if sizes != AFTER_PREVIOUS else \
        (_agreed_after.setdefault(group_name, {}), _previous.get(group_name, ()))
    last = slots.get(slot)
    agreed = sizes == AGREED or (last is not None and last.key == key)
    header = None if cpu and plan.regular and agreed else _header(key, count, x.device)
    if not agreed:  # the headers first, in pieces of the sizes every rank posts
        if last is None:
            last = _Pieces((), (PREFIX_BYTES,) * W, (PREFIX_BYTES,) * W)
        received = _buffer(last.recv, x.device, held=(group_name, "recv"))
        send = _buffer(last.send, x.device, header, held=(group_name, "send"))
        _all_to_all(op, group_name, received, send, last.recv, last.send)
        _check_headers(op, group_name, _headers(received, last.recv), header, described)
        if sizes == AFTER_PREVIOUS and len(slots) >= _MAX_PLANS:
            slots.clear()  # (every rank of the group alike)
        slots[slot] = _Pieces(key, plan.send_bytes, plan.recv_bytes)
    outs = _exchange_pieces(op, xs, group_name, plan, header, agreed, count, described)
    _previous[group_name] = key
    return outs


def _exchange_pieces(op: str, xs: Sequence[torch.Tensor], group_name: str, plan: Plan,
                     header: Optional[torch.Tensor], agreed: bool, count: int,
                     described: Callable[[], dict]) -> list[torch.Tensor]:
    """:func:`exchange`'s exchange of the pieces, in the sizes of ``plan`` that every rank posts
    now: ``header`` (None: the held CPU send bytes hold it but for the count), checked on arrival
    unless the headers were just compared (not ``agreed``)."""
    W, x, key = len(plan.send_bytes), xs[0], plan.key
    cpu = x.device.type == "cpu"
    if plan.regular:  # (W, bytes) buffers: views made once per plan (and held memory)
        if cpu:
            views = _held_views(group_name, plan)
        else:
            views = _views(*(torch.empty(W, n[0], dtype=torch.uint8, device=x.device)
                             for n in (plan.send_bytes, plan.recv_bytes)), plan)
        if cpu and _headers_of.get(group_name) is plan:  # the held send headers are this plan's, but for the count
            views.send_counts.fill_(count)
        else:
            views.send_headers.copy_(_header(key, count, x.device) if header is None else header)
            _headers_of[group_name] = plan
        for t, piece, size in zip(xs, views.send_pieces, plan.send_sizes):
            piece.copy_(t.unflatten(plan.split_dim, (W, size[0])).movedim(plan.split_dim, 0))  # the permute
        _all_to_all(op, group_name, views.received, views.send, plan.recv_bytes, plan.send_bytes)
        if agreed:  # (else every header was just compared)
            _check_headers(op, group_name, views.received_headers, views.send_headers, described)
        outs = []
        for piece, shape in zip(views.received_pieces, views.outputs):  # the permute back
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
            out.view(piece.shape).copy_(piece)
            outs.append(out)
        return outs
    send = _buffer(plan.send_bytes, x.device, header, held=(group_name, "send"))
    received = _buffer(plan.recv_bytes, x.device, held=(group_name, "recv"))
    _pack(send, xs, plan.split_dim, plan.send_sizes, plan.send_bytes)
    _all_to_all(op, group_name, received, send, plan.recv_bytes, plan.send_bytes)
    if agreed:  # (else every header was just compared)
        _check_headers(op, group_name, _headers(received, plan.recv_bytes), header, described)
    return _unpack(received, plan)


def _header(key: tuple, count: int, device: torch.device) -> torch.Tensor:
    """(PREFIX_BYTES,) uint8 on ``device``: the header of an exchange of ``key``, the ``count``-th."""
    # NB: pinned on CUDA, so that the copy to the device does not sync (a CUDA graph would replay
    # the copy from that host memory: not capture-safe yet)
    header = torch.tensor([key[0], count, *key[1:]], dtype=torch.int64, pin_memory=device.type == "cuda")
    return (header if device.type == "cpu" else header.to(device, non_blocking=True)).view(torch.uint8)


def _all_to_all(op: str, group_name: str, received: torch.Tensor, send: torch.Tensor, recv_bytes: Sequence[int],
                send_bytes: Sequence[int]) -> None:
    """One all-to-all of :func:`_buffer`'s buffers: split sizes in bytes for 1-D ones, none for
    (W, bytes). If it fails, the group's held bytes are let go (gloo may still write into them)."""
    try:
        comm.all_to_all(op, group_name, received, send, None if received.ndim == 2 else list(recv_bytes),
                        None if send.ndim == 2 else list(send_bytes))
    except BaseException:
        _let_go(group_name)
        _held.pop((group_name, "send"), None)
        _held.pop((group_name, "recv"), None)
        _headers_of.pop(group_name, None)
        raise


def _check_headers(op: str, group_name: str, headers: torch.Tensor, header: torch.Tensor,
                   described: Callable[[], dict], bufs: Any = None) -> None:
    """``headers`` (W, PREFIX_BYTES) uint8: the header that came with each rank's piece; ``header``
    this rank's ((PREFIX_BYTES,), or (W, PREFIX_BYTES) of it). On CPU tensors (or in debug mode) a
    host compare, and a difference raises GroupMismatchError on every rank alike (all hold the same
    W headers, and each sees one unlike its own); on CUDA ``torch._assert_async``, no host sync.
    ``described()``: this rank's value of each field, for the message, which the ranks exchange
    through their process group, or with ``bufs`` (UlyssesBuffers) through the buffers' own host
    channel (simulated ranks have no process group)."""
    if headers.is_cuda and not comm.debug():
        torch._assert_async(torch.all(headers == header),
                            f"alltoall_ops.{op}: the ranks disagree on x's dtype, dims or shape, on ulysses_attention's"
                            " arguments, or are out of step; run with ALLTOALL_OPS_DEBUG=1 for the error by name")
        return
    if torch.equal(headers, header if header.ndim == 2 else header.expand_as(headers)):
        return
    rows = headers.contiguous().view(torch.int64).tolist()  # (the failure path only)
    if bufs is None:
        where, gather = comm.where(op, process_group(group_name)), lambda obj: comm.gather_objects(op, group_name, obj)
    else:
        where = f"alltoall_ops.{op} (symm_mem, rank {bufs.rank} of {bufs.world_size})"
        gather = bufs._segments.gather_objects
    rejected = [r for r, row in enumerate(rows) if row[FIELDS.index("dtype")] == SEQ_REJECTED_DTYPE]
    if rejected:  # those ranks posted no pieces: their own checks failed (symm_tell_peers)
        messages = gather(None)  # every rank takes this path, the rejecting ones in symm_tell_peers
        raise PeerInputError(f"{where}: rank {rejected[0]} rejected its arguments: "
                             f"{messages[rejected[0]] or 'see its error'}")
    strangers = [r for r, row in enumerate(rows) if not 0 <= row[0] - _MAGIC < len(_OPS)]
    if strangers:
        raise GroupMismatchError(f"{where}: ranks {strangers} sent no seq_to_head / head_to_seq piece: the ranks are "
                                 "out of step (this exchange met another collective); every rank must call the "
                                 "library's ops in the same order")
    if len({(row[0], row[1]) for row in rows}) > 1:
        per_rank = ", ".join(f"rank {r} is in {_OPS[row[0] - _MAGIC]} (exchange {row[1]})"
                             for r, row in enumerate(rows))
        raise GroupMismatchError(f"{where}: the ranks are out of step: {per_rank}; every rank must call the library's "
                                 "ops in the same order")
    field = next(FIELDS[i] for i in range(2, HEADER_LEN) if len({row[i] for row in rows}) > 1)
    mine = described()
    values = gather(mine[field])
    listed = ", ".join(f"rank {r} has {value}" for r, value in enumerate(values))
    hint = shape_hint(mine["head_dim"]) if op == "head_to_seq" and field == "shape" else ""
    raise GroupMismatchError(f"{where}: the ranks disagree on {field}: {listed}; every rank must pass the same{hint}")


def shape_hint(head_dim: int) -> str:
    return (f" (head_to_seq compares x's shapes with all num_heads heads at dim {head_dim}; a rank without "
            "num_heads takes W times its own heads, so with heads split unevenly every rank must pass num_heads=, "
            "the total head count)")


# --------------------------------------------------------------------------------------------
# The exchange over peer-addressable buffers (UlyssesBuffers; kernels/seq_exchange.py)

_SYMM_OPS = {"seq_to_head": 1, "head_to_seq": 2}
"""Barrier op codes of the exchanges on UlyssesBuffers (a barrier's stamp: call * 4 + op)."""


def _posted_bytes(plan: Plan, W: int, itemsize: int) -> tuple[list[int], int]:
    """Each tensor's byte offset in a stage slot, and the bytes of the slot used: tensor i takes
    its bytes on the rank that posts the most of it (head_to_seq: the rank with the most heads),
    rounded up to ``PIECE_ALIGN``, so that every rank computes the same offsets."""
    offsets, total = [], 0
    for shape in plan.shapes:
        full = list(shape)
        if plan.split_dim == plan.seq_dim:  # head_to_seq: x holds this rank's heads of the full shape
            full[plan.head_dim] = -(-shape[plan.head_dim] // W)
        offsets.append(total)
        total += round_up(math.prod(full) * itemsize, PIECE_ALIGN)
    return offsets, total


def symm_exchange(op: str, xs: Sequence[torch.Tensor], bufs: Any, plan: Plan, cat_counts: list[tuple[int, int]],
                  described: Callable[[], dict]) -> list[torch.Tensor]:
    """:func:`exchange` through ``bufs`` (UlyssesBuffers): ``post`` each x into this rank's stage,
    one barrier (stamped with the op and the buffers' call number), ``gather`` this rank's piece of
    every rank's x into fresh outputs (``plan.out_shapes``). cat_counts[i]: (base, extra) of tensor i's
    positions along the cat dim per rank (``kernels.seq_exchange``). The headers are compared on the
    device: on CPU tensors (and on CUDA in debug mode, ``ALLTOALL_OPS_DEBUG=1``, outside a CUDA
    graph capture: a host read) a difference raises GroupMismatchError on every rank (as
    :func:`_check_headers` names it); else on CUDA a device-side assert. A stage too small for the
    exchange: CapacityError on every rank, after the headers (so that ranks whose shapes differ
    raise the mismatch instead)."""
    W, rank = bufs.world_size, bufs.rank
    if W == 1:
        return [x.clone(memory_format=torch.contiguous_format) for x in xs]
    k, segments = loader.load(), bufs._segments
    xs = [x.contiguous() for x in xs]
    offsets, needed = _posted_bytes(plan, W, xs[0].element_size())
    fits = needed <= bufs.slot_bytes
    common = dict(rank=rank, slot_bytes=bufs.slot_bytes, split_dim=plan.split_dim, cat_dim=plan.cat_dim)
    own = [(sum(plan.send_sizes[i][:rank]), plan.send_sizes[i][rank] if fits else 0) for i in range(len(xs))]
    sent = xs if fits else [x.narrow(0, 0, 0) for x in xs]
    failed_1 = torch.empty(1, dtype=torch.int32, device=xs[0].device)  # (zeroed by the post)
    call_1 = torch.empty(1, dtype=torch.int64, device=xs[0].device)  # set by the barrier after the post
    with segments.barrier_after(_SYMM_OPS[op], call_1, advance_after=True) as epilogue:
        k.post_pieces(sent, bufs.table, segments.calls_1, failed_1, offsets_bytes=offsets, owns=own, header=plan.key,
                      max_programs=bufs.num_sms, epilogue=epilogue, **common)
    headers_W8 = torch.empty(W, HEADER_LEN, dtype=torch.int64, device=xs[0].device)
    named = _named_on_host(xs[0].device)
    outs = [torch.empty(shape, dtype=x.dtype, device=x.device) for x, shape in zip(xs, plan.out_shapes)] if fits \
        else sent  # (too small: the headers only, then CapacityError)
    k.gather_pieces(xs, outs, bufs.table, call_1, failed_1, headers_W8, offsets_bytes=offsets,
                    owns=own, source_splits=[x.shape[plan.split_dim] for x in xs], cat_counts=cat_counts,
                    max_programs=bufs.num_sms, assert_checks=not named, **common)
    if named and int(failed_1):
        headers = headers_W8.view(torch.uint8).view(W, PREFIX_BYTES)
        _check_headers(op, bufs.group_name, headers, headers[rank], described, bufs)
    if not fits:
        raise CapacityError(f"alltoall_ops.{op} (symm_mem): the exchange posts {needed} bytes per rank, but the "
                            f"UlyssesBuffers hold {bufs.max_bytes}; create them with max_bytes >= {needed} "
                            "(UlyssesBuffers.bytes_for)")
    return outs


def _named_on_host(device: torch.device) -> bool:
    """Whether a symm exchange's headers are compared on the host, to name a difference: on the
    CPU, and on CUDA in debug mode outside a CUDA graph capture (a host read); else the gather's
    device-side assert. The same on every rank."""
    return device.type != "cuda" or (comm.debug() and not torch.cuda.is_current_stream_capturing())


def symm_tell_peers(op: str, bufs: Any, error: BaseException) -> None:
    """The failure channel of UlyssesBuffers: this rank's own checks of ``op`` failed before its
    post, so it posts a header that says so (no pieces) and passes the exchange's barrier; its
    peers' exchange, which compares that header, then raises PeerInputError with ``error``'s
    message (where headers are compared on the host: the message through the buffers' host
    channel) or traps (CUDA: the gather's device-side assert), instead of waiting for this rank
    until the deadline. Returns; the caller raises ``error``."""
    if bufs.world_size == 1:
        return
    k, segments, dev = loader.load(), bufs._segments, bufs.device
    header = (_MAGIC + _OPS.index(op), 0, SEQ_REJECTED_DTYPE, 0, 0, 0, 0)
    try:
        with segments.barrier_after(_SYMM_OPS[op], torch.empty(1, dtype=torch.int64, device=dev),
                                    advance_after=True) as epilogue:
            k.post_pieces([torch.empty(0, 1, device=dev)], bufs.table, segments.calls_1,
                          torch.empty(1, dtype=torch.int32, device=dev), rank=bufs.rank,
                          slot_bytes=bufs.slot_bytes, offsets_bytes=[0], split_dim=1, cat_dim=0, owns=[(0, 0)],
                          header=header, max_programs=bufs.num_sms, epilogue=epilogue)
        if _named_on_host(dev):  # the peers' _check_headers gathers every rank's message
            segments.gather_objects(f"{type(error).__name__}: {error}")
    except CollectiveError:
        pass  # peers later than the deadline (not told); this rank raises its own error
