"""Ulysses sequence parallelism: trade a sequence shard for a head shard and back.

Each of the W ranks of a group holds a contiguous chunk of the sequence (rank 0's first) and all
Hh heads. ``seq_to_head`` gives every rank the full sequence for its share of the heads;
``head_to_seq`` undoes it. Attention, which mixes positions but not heads, runs in between::

    q, k, v = (seq_to_head(t, group) for t in (q, k, v))   # (B, S/W, Hh, D) -> (B, S, h_r, D)
    o = attention(q, k, v)                                   # full sequence, local heads
    o = head_to_seq(o, group, num_heads=Hh)                  # (B, S, h_r, Dv) -> (B, S/W, Hh, Dv)

The head split (DeepSpeed's, also when W does not divide Hh): rank r gets the contiguous heads
[start_r, start_r + h_r) with h_r = Hh // W + (1 if r < Hh % W else 0) and start_r the sum of
the h of the ranks before it; so the first Hh % W ranks get one head more, and with Hh < W the
last W - Hh ranks get none (they still take part in the exchange). E.g. Hh = 5 over W = 2:
heads [0, 3) and [3, 5); Hh = 2 over W = 3: [0, 1), [1, 2) and none. With W dividing Hh every
rank gets Hh / W. The sequence is always split evenly: S divisible by W, S/W positions a rank.

Each is one all-to-all (unequal splits when W does not divide Hh). A rank's head count alone does
not tell Hh when the split is uneven, so ``head_to_seq`` takes ``num_heads=Hh`` (needed then; by
default W * its head count). Tensors may have any number of dims; every dim other than
``seq_dim`` and ``head_dim`` is carried along (so q/k and v may have different head sizes).

Checks with no collective of their own: every piece starts with this rank's header
(:data:`FIELDS`, 64 bytes), and each rank compares the W headers it received with its own. The
sizes every rank posts must agree first (gloo terminates a process that receives more bytes than
it posted), so an exchange whose sizes the caller chose posts the sizes of the group's last
agreed exchange (the same on every rank): the exchange itself when its shapes are those, else
this rank's header in pieces of those sizes (headers alone the first time), then the exchange
once every header matched. Sizes that follow from an agreed exchange (``ulysses_attention``'s o,
every backward) are posted as they are. On CPU tensors a host compare (no device to wait for): a
GroupMismatchError on every rank alike, naming the field and each rank's value, for every
disagreement, those on a size too (shard shapes, head counts, dtypes of other sizes,
``ulysses_attention``'s q / k / v shapes as passed, is_causal, scale, ops out of step), before
a piece of other sizes moves. On CUDA a ``torch._assert_async``: no host read and no collective
but the all-to-alls (a disagreement is a device-side assert, queued before any exchange of the
new sizes). The payload moves in x's dtype, no packing. With ``ALLTOALL_OPS_DEBUG=1`` the
library's agreement (``comm.agree``) runs before every exchange: it names every disagreement on
CUDA too, and carries a rank's own failed check to its peers (``PeerInputError``; by default that
rank raises at once, its peers at the deadline). See docs/design.md, "Errors and faults".
"""

from __future__ import annotations

import collections
import math
import struct
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from . import comm
from ._compat import call, input_grads, is_compiling
from .errors import GroupMismatchError
from .groups import LOCAL, communication_group, process_group, resolve_group
from .comm import comm_op
from .validation import as_int

FIELDS = ("op", "exchange", "ulysses_attention arguments", "dtype", "ndim", "seq_dim", "head_dim", "shape")
"""The header each rank sends before every exchange's payload, one int64 each (``shape``: a
fingerprint of the shape every rank shares; ``ulysses_attention arguments``: a fingerprint of
:func:`attention_args`, 0 for a plain seq_to_head / head_to_seq)."""
HEADER_LEN = len(FIELDS)
PREFIX_BYTES = 8 * HEADER_LEN
"""Bytes of the header at the start of every piece of an exchange."""
_MAGIC = 0x554C5953 << 8  # "ULYS": a piece of this module's exchanges (op code in the low bits)
_OPS = ("seq_to_head", "head_to_seq")
_exchanges: collections.Counter = collections.Counter()  # group name -> exchanges so far


def _group_size(group_name: str) -> int:
    return 1 if group_name == LOCAL else process_group(group_name).size()


def _group_rank(group_name: str) -> int:
    return 0 if group_name == LOCAL else process_group(group_name).rank()


def head_counts(num_heads: int, world_size: int) -> list[int]:
    """Heads per rank of the split of ``num_heads`` over ``world_size`` ranks (rank r's are
    [sum(counts[:r]), sum(counts[:r + 1]))): ``num_heads // world_size`` each, one more on the
    first ``num_heads % world_size`` ranks, as DeepSpeed's Ulysses splits them."""
    base, extra = num_heads // world_size, num_heads % world_size  # (no divmod for a SymInt)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def _normalize_dim(name: str, dim: Any, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name}: expected an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{name}: expected a dim in [{-ndim}, {ndim}) for a {ndim}-D tensor, got {dim}"
        )
    return dim % ndim


def _num_heads(fn: str, num_heads: Any) -> Any:
    """``num_heads`` as an int (integer-likes accepted; a SymInt under torch.compile as it is)."""
    if isinstance(num_heads, torch.SymInt):
        return num_heads
    number = as_int(num_heads)
    if number is None:
        raise TypeError(f"{fn}: num_heads: expected an int (the total head count), got {type(num_heads).__name__}")
    if number < 0:
        raise ValueError(f"{fn}: num_heads: expected a non-negative int (the total head count), got {number}")
    return number


def _check_args(
    fn: str, x: Any, world_size: int, rank: int, seq_dim: Any, head_dim: Any, num_heads: Any = None
) -> tuple[int, int, Any]:
    """Shape checks shared by the public functions and the ops; returns the normalised dims and
    (``head_to_seq``) the total head count (``num_heads``, by default W times x's heads).

    Only shapes, ints and the rank are read: every rank raises alike on what SPMD programs share;
    ``head_to_seq``'s check of x's heads against this rank's share may fail on some ranks only
    (see :func:`_checked`)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x: expected a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(
            f"{fn}: x: expected a tensor with a sequence and a head dim (at least 2-D), got "
            f"shape {tuple(x.shape)}"
        )
    seq_dim = _normalize_dim("seq_dim", seq_dim, x.ndim)
    head_dim = _normalize_dim("head_dim", head_dim, x.ndim)
    if seq_dim == head_dim:
        raise ValueError(
            f"{fn}: seq_dim and head_dim: expected two different dims, both are dim {seq_dim}"
        )
    if fn == "seq_to_head":  # any head count: split as head_counts says
        return seq_dim, head_dim, x.shape[head_dim]
    if x.shape[seq_dim] % world_size != 0:
        raise ValueError(
            f"{fn}: x: expected sequence length (dim {seq_dim}) divisible by the group size {world_size}, "
            f"got {x.shape[seq_dim]} (shape {tuple(x.shape)})"
        )
    if num_heads is None:
        return seq_dim, head_dim, x.shape[head_dim] * world_size
    num_heads = _num_heads(fn, num_heads)
    counts = head_counts(num_heads, world_size)
    if x.shape[head_dim] != counts[rank]:
        raise ValueError(
            f"{fn}: x: expected rank {rank}'s share of the num_heads={num_heads} heads at dim {head_dim}, "
            f"{counts[rank]} (heads per rank {counts} over the group of {world_size}), got {x.shape[head_dim]} "
            f"(shape {tuple(x.shape)})"
        )
    return seq_dim, head_dim, num_heads


def _checked(op: str, group_name: str, check: Callable, *args):
    """``check(*args)``. In debug mode, on a group, through ``comm.checked``: a rank whose checks
    fail takes its error into the op's agreement, where its peers wait, so they raise too. By
    default no agreement runs: such a rank raises at once, its peers at the library's deadline."""
    if group_name == LOCAL or is_compiling() or not comm.debug():
        return check(*args)
    return comm.checked(op, group_name, check, *args)


def attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, is_causal: bool,
                   scale: Optional[float], attn_fn: Optional[Callable]) -> list:
    """What every rank of a ``ulysses_attention`` must pass alike, as ints: layout, is_causal,
    attn_fn given, scale's bits (-1: None), and q, k, v's shapes as passed (before GQA repetition)."""
    bits = -1 if scale is None else struct.unpack("<q", struct.pack("<d", float(scale)))[0]
    return [list(LAYOUTS).index(layout), int(is_causal), int(attn_fn is not None), bits, *q.shape, *k.shape,
            *v.shape]


def _attention_text(args: Sequence[int]) -> str:
    """:func:`attention_args` for a message."""
    if not args:
        return "none (a plain call, not ulysses_attention)"
    layout, is_causal, given, bits = args[:4]
    q, k, v = (tuple(args[4 + 4 * i: 8 + 4 * i]) for i in range(3))
    scale = None if bits == -1 else struct.unpack("<d", struct.pack("<q", bits))[0]
    return (f"q {q}, k {k}, v {v} (layout {list(LAYOUTS)[layout]!r}, is_causal={bool(is_causal)}, scale={scale}, "
            f"attn_fn {'given' if given else 'None'})")


class _Pieces(NamedTuple):
    """An exchange's key (its header without the exchange count) and this rank's piece sizes in
    bytes, headers included: what it sends to and receives from each rank."""
    key: tuple
    send: tuple
    recv: tuple


_agreed: dict[str, _Pieces] = {}
"""Group name -> its last agreed exchange (of those whose sizes the caller chose): the sizes every
rank of the group posts for the next such exchange. The same on every rank: it changes only after
an exchange whose W headers every rank compared and found equal."""


_held: dict[tuple[str, str], torch.Tensor] = {}
"""(group name, "send" | "recv") -> the CPU bytes the group's exchanges reuse, as large as its
largest exchange: a fresh CPU buffer of a few hundred KB costs more in page faults than gloo takes
to move it. Only on the CPU, where an exchange has ended when it returns (gloo waits); CUDA's
caching allocator reuses memory in stream order already."""


def _buffer(nbytes: Sequence[int], device: torch.device, header: Optional[torch.Tensor] = None,
            held: Optional[tuple[str, str]] = None) -> torch.Tensor:
    """An exchange's buffer of pieces of ``nbytes[r]`` bytes, ``header`` (PREFIX_BYTES uint8) at
    the start of each when given: (W, bytes) when the pieces are equal (gloo then runs its
    alltoall, not the slower alltoallv), else 1-D. The rest is not written. On the CPU, the
    bytes held for ``held`` (see :data:`_held`)."""
    W, total = len(nbytes), sum(nbytes)
    if device.type == "cpu" and held is not None:
        memory = _held.get(held)
        if memory is None or memory.numel() < total:
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
    received_headers: torch.Tensor  # (W, PREFIX_BYTES) uint8
    send_pieces: list  # [i]: (W, *piece of xs[i]) in xs's dtype: where xs[i]'s pieces go
    received_pieces: list  # [i]: output i's pieces, in the output's order with W before cat_dim (.., W, s, ..)
    outputs: list  # [i]: output i's shape


def _views(send: torch.Tensor, received: torch.Tensor, plan: "_Plan") -> _Views:
    W = len(plan.send_bytes)
    send_body, received_body = send[:, PREFIX_BYTES:].view(plan.dtype), received[:, PREFIX_BYTES:].view(plan.dtype)
    send_pieces, received_pieces, outputs, col, row = [], [], [], 0, 0
    for piece, shapes in zip(plan.send_pieces, plan.recv_shapes):
        n = math.prod(piece)
        send_pieces.append(send_body[:, col : col + n].view(W, *piece))
        m = math.prod(shapes[0])
        received_pieces.append(received_body[:, row : row + m].view(W, *shapes[0]).movedim(0, plan.cat_dim))
        output = [*shapes[0]]
        output[plan.cat_dim] *= W
        outputs.append(output)
        col, row = col + n, row + m
    return _Views(send, received, send[:, :PREFIX_BYTES], received[:, :PREFIX_BYTES], send_pieces, received_pieces,
                  outputs)


def _held_views(group_name: str, plan: "_Plan") -> _Views:
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


def _unpack(received: torch.Tensor, nbytes: Sequence[int], dtype: torch.dtype,
            recv_shapes: list[list[list[int]]], cat_dim: int) -> list[torch.Tensor]:
    """The outputs: for each i, the pieces of shape ``recv_shapes[i][r]`` from ranks r = 0..W-1
    (after each piece's header in ``received``) concatenated along ``cat_dim``: new tensors, one
    copy each (the permute)."""
    numel = [[math.prod(s) for s in shapes] for shapes in recv_shapes]  # [i][r]
    if received.ndim == 2 and all(s == shapes[0] for shapes in recv_shapes for s in shapes):
        body, col, outs = received[:, PREFIX_BYTES:].view(dtype), 0, []  # (W, sum over i of numel[i][0])
        for n, shapes in zip(numel, recv_shapes):
            piece = body[:, col : col + n[0]].view(len(shapes), *shapes[0]).movedim(0, cat_dim)  # (.., W, s, ..)
            shape = list(shapes[0])
            shape[cat_dim] *= len(shapes)
            out = piece.new_empty(shape)
            out.view(piece.shape).copy_(piece)
            outs.append(out)
            col += n[0]
        return outs
    bodies = _bodies(received, nbytes, dtype)
    rows = [body.split([n[r] for n in numel]) for r, body in enumerate(bodies)]  # [r][i]
    return [torch.cat([rows[r][i].view(shapes[r]) for r in range(len(shapes))], dim=cat_dim)
            for i, shapes in enumerate(recv_shapes)]


def _exchange(op: str, xs: Sequence[torch.Tensor], group_name: str, plan: "_Plan", attention: Sequence[int],
              agreed_sizes: bool) -> list[torch.Tensor]:
    """Piece r of each ``xs[i]`` (``plan.send_sizes[i][r]`` long along the dim ``op`` splits:
    heads for seq_to_head, sequence for head_to_seq) to rank r, and for each i what arrives from
    ranks 0..W-1 (of ``plan.recv_shapes[i]``) concatenated along the other dim, all in one
    all-to-all in xs's dtype, this rank's header at the start of every piece, checked by
    :func:`_check_headers` on arrival.

    The sizes of an exchange must agree between ranks before it is posted (gloo terminates a
    process that receives more bytes than it posted, and leaves the rest of a shorter piece
    unwritten). ``agreed_sizes``: they follow from shapes an earlier exchange of the group agreed
    on (ulysses_attention's o after q, k, v; every backward after its forward). Else they are the
    caller's: posted as they are when they are the group's last agreed exchange's (``_agreed``,
    the same on every rank); otherwise this rank's header first travels in pieces of the last
    agreed sizes (headers alone before the group's first exchange), and the exchange follows with
    its own sizes once every rank found every header equal to its own. Returns new contiguous
    tensors."""
    W = len(plan.send_bytes)
    if W == 1:
        return [x.clone(memory_format=torch.contiguous_format) for x in xs]  # op outputs must not alias inputs
    x = xs[0]
    key = plan.key
    fields = [key[0], _exchanges[group_name], *key[1:]]
    _exchanges[group_name] += 1
    # NB: pinned on CUDA, so that the copy to the device does not sync (a CUDA graph would replay
    # the copy from that host memory: not capture-safe yet)
    header = torch.tensor(fields, dtype=torch.int64, pin_memory=x.is_cuda).to(x.device, non_blocking=True)
    header = header.view(torch.uint8)

    def described() -> dict:
        return {"ulysses_attention arguments": _attention_text(attention), "dtype": x.dtype, "ndim": x.ndim,
                "seq_dim": plan.seq_dim, "head_dim": plan.head_dim, "shape": _shapes_text(plan.shapes)}

    last = _agreed.get(group_name)
    agreed = agreed_sizes or (last is not None and last.key == key)
    if not agreed:  # the headers first, in pieces of the sizes every rank posts
        if last is None:
            last = _Pieces((), (PREFIX_BYTES,) * W, (PREFIX_BYTES,) * W)
        received = _buffer(last.recv, x.device, held=(group_name, "recv"))
        send = _buffer(last.send, x.device, header, held=(group_name, "send"))
        _all_to_all(op, group_name, received, send, last.recv, last.send)
        _check_headers(op, group_name, _headers(received, last.recv), header, described)
        _agreed[group_name] = _Pieces(key, plan.send_bytes, plan.recv_bytes)
    if plan.regular:  # (W, bytes) buffers: views made once per plan (and held memory)
        if x.device.type == "cpu":
            views = _held_views(group_name, plan)
        else:
            views = _views(*(torch.empty(W, n[0], dtype=torch.uint8, device=x.device)
                             for n in (plan.send_bytes, plan.recv_bytes)), plan)
        views.send_headers.copy_(header)
        for t, piece, size in zip(xs, views.send_pieces, plan.send_sizes):
            piece.copy_(t.unflatten(plan.split_dim, (W, size[0])).movedim(plan.split_dim, 0))  # the permute
        _all_to_all(op, group_name, views.received, views.send, plan.recv_bytes, plan.send_bytes)
        if agreed:  # (else every header was just compared)
            _check_headers(op, group_name, views.received_headers, header, described)
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
    return _unpack(received, plan.recv_bytes, x.dtype, plan.recv_shapes, plan.cat_dim)


def _all_to_all(op: str, group_name: str, received: torch.Tensor, send: torch.Tensor, recv_bytes: Sequence[int],
                send_bytes: Sequence[int]) -> None:
    """One all-to-all of :func:`_buffer`'s buffers: split sizes in bytes for 1-D ones, none for
    (W, bytes). If it fails, the group's held bytes are let go (gloo may still write into them)."""
    try:
        comm.all_to_all(op, group_name, received, send, None if received.ndim == 2 else list(recv_bytes),
                        None if send.ndim == 2 else list(send_bytes))
    except BaseException:
        _held.pop((group_name, "send"), None)
        _held.pop((group_name, "recv"), None)
        raise


def _shapes_text(shapes: list) -> tuple:
    """The shapes every rank shares, for a message: one shape as it is, several as a tuple of them."""
    return tuple(shapes[0]) if len(shapes) == 1 else tuple(tuple(s) for s in shapes)


def _check_headers(op: str, group_name: str, headers: torch.Tensor, header: torch.Tensor,
                   described: Callable[[], dict]) -> None:
    """``headers`` (W, PREFIX_BYTES) uint8: the header that came with each rank's piece; ``header``
    this rank's. On CPU tensors (or in debug mode) a host compare, and a difference raises
    GroupMismatchError on every rank alike (all hold the same W headers, and each sees one unlike
    its own); on CUDA ``torch._assert_async``, no host sync. ``described()``: this rank's value of
    each field, for the message."""
    if headers.is_cuda and not comm.debug():
        torch._assert_async(torch.all(headers == header),
                            f"alltoall_ops.{op}: the ranks disagree on x's dtype, dims or shape, on ulysses_attention's"
                            " arguments, or are out of step; run with ALLTOALL_OPS_DEBUG=1 for the error by name")
        return
    if torch.equal(headers, header.expand_as(headers)):
        return
    rows = headers.contiguous().view(torch.int64).tolist()  # (the failure path only)
    where = comm.where(op, process_group(group_name))
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
    values = comm.gather_objects(op, group_name, mine[field])
    listed = ", ".join(f"rank {r} has {value}" for r, value in enumerate(values))
    hint = _shape_hint(mine["head_dim"]) if op == "head_to_seq" and field == "shape" else ""
    raise GroupMismatchError(f"{where}: the ranks disagree on {field}: {listed}; every rank must pass the same{hint}")


def _shape_hint(head_dim: int) -> str:
    return (f" (head_to_seq compares x's shapes with all num_heads heads at dim {head_dim}; a rank without "
            "num_heads takes W times its own heads, so with heads split unevenly every rank must pass num_heads=, "
            "the total head count)")


def _full_shape(x: torch.Tensor, head_dim: int, num_heads: int) -> list:
    """The shape of x with all ``num_heads`` heads: the same on every rank of a head_to_seq."""
    shape = list(x.shape)
    shape[head_dim] = num_heads
    return shape


class _Plan(NamedTuple):
    """What an exchange of given arguments does on this rank (see :func:`_plan`)."""
    seq_dim: int
    head_dim: int
    split_dim: int  # the dim whose pieces go to the ranks
    cat_dim: int  # the dim along which the received pieces are joined
    shapes: list  # the shapes every rank shares (head_to_seq: with all num_heads heads)
    send_sizes: list  # [i][r]: positions of xs[i] along split_dim for rank r
    recv_shapes: list  # [i][r]: the shape of the piece of xs[i] from rank r
    key: tuple  # the header but the exchange count
    send_bytes: tuple  # [r]: bytes to rank r, header included
    recv_bytes: tuple  # [r]: bytes from rank r, header included
    regular: bool  # every piece of each tensor has one shape, both ways: (W, bytes) buffers
    send_pieces: list  # [i]: the shape of xs[i]'s piece for each rank, when regular
    dtype: torch.dtype
    held_views: dict  # on the CPU: "memory" -> the held buffers, "views" -> their _Views


_plans: dict = {}  # the arguments of an exchange -> its _Plan
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
        _held.pop((group_name, "send"), None)
        _held.pop((group_name, "recv"), None)
        for args in [args for args in _plans if args[1] == group_name]:
            del _plans[args]


def _plan(op: str, xs: Sequence[torch.Tensor], group_name: str, seq_dim: int, head_dim: int,
          num_heads: Optional[Sequence[int]], attention: Sequence[int]) -> _Plan:
    """The checks of ``op`` on each of ``xs`` (see :func:`_check_args`; one dtype and ndim for
    all) and what its exchange does: computed once per distinct arguments (the same arguments
    pass the same checks), so that an exchange's host work is a lookup."""
    _same_group(group_name)
    args = (op, group_name, seq_dim, head_dim, tuple((x.shape, x.dtype) for x in xs),
            None if num_heads is None else tuple(num_heads), tuple(attention))
    plan = _plans.get(args)
    if plan is None:
        plan = _make_plan(op, xs, group_name, seq_dim, head_dim, num_heads, attention)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[args] = plan
    return plan


def _make_plan(op: str, xs: Sequence[torch.Tensor], group_name: str, seq_dim: int, head_dim: int,
               num_heads: Optional[Sequence[int]], attention: Sequence[int]) -> _Plan:
    W, rank = _group_size(group_name), _group_rank(group_name)
    for i, x in enumerate(xs):
        seq_dim, head_dim, _ = _checked(op, group_name, _check_args, op, x, W, rank, seq_dim, head_dim,
                                        None if num_heads is None else num_heads[i])
    if any(x.dtype != xs[0].dtype or x.ndim != xs[0].ndim for x in xs):
        raise ValueError(f"{op}: xs: expected one dtype and ndim, got {[(x.dtype, x.ndim) for x in xs]}")
    shapes = [list(x.shape) if num_heads is None else _full_shape(x, head_dim, n) for x, n in
              zip(xs, num_heads or xs)]
    if op == "seq_to_head":
        (sizes, recv_shapes), split_dim, cat_dim = _seq_to_head_shapes(xs, W, rank, head_dim), head_dim, seq_dim
    else:
        (sizes, recv_shapes), split_dim, cat_dim = _head_to_seq_shapes(xs, W, seq_dim, head_dim, num_heads), seq_dim, \
            head_dim
    x = xs[0]
    key = (_MAGIC + _OPS.index(op), comm.shape_code(attention), comm.dtype_code(x.dtype), x.ndim, seq_dim, head_dim,
           comm.shape_code([n for shape in shapes for n in shape]))
    size = x.element_size()
    rest = [math.prod(n for d, n in enumerate(t.shape) if d != split_dim) for t in xs]  # elements per position
    send_bytes = tuple(PREFIX_BYTES + size * sum(n * s[r] for n, s in zip(rest, sizes)) for r in range(W))
    recv_bytes = tuple(PREFIX_BYTES + size * sum(math.prod(s[r]) for s in recv_shapes) for r in range(W))
    regular = (len(set(send_bytes)) == 1 and len(set(recv_bytes)) == 1 and all(len(set(s)) == 1 for s in sizes)
               and all(r == shapes_i[0] for shapes_i in recv_shapes for r in shapes_i))
    send_pieces = [[*t.shape[:split_dim], s[0], *t.shape[split_dim + 1:]] for t, s in zip(xs, sizes)]
    return _Plan(seq_dim, head_dim, split_dim, cat_dim, shapes, sizes, recv_shapes, key, send_bytes, recv_bytes,
                 regular, send_pieces, x.dtype, {})


def _debug_agreement(op: str, xs: Sequence[torch.Tensor], group_name: str, plan: _Plan) -> None:
    """In debug mode, on a group, the ranks' agreement on their dtype, dims and the first one's
    shape (for head_to_seq with all ``num_heads`` heads, since the ranks' head shares may differ;
    ulysses_attention: q's, the header that follows names the caller's arguments), so a rank
    whose own check failed is an error on every rank (``PeerInputError``)."""
    if group_name == LOCAL or not comm.debug():
        return
    fields = [comm.dtype_code(xs[0].dtype), xs[0].ndim, plan.seq_dim, plan.head_dim, comm.shape_code(plan.shapes[0])]
    try:
        comm.agree(op, group_name, fields, shapes=plan.shapes[0])
    except GroupMismatchError as exc:
        if op == "head_to_seq" and "disagree on shape" in str(exc):
            raise GroupMismatchError(f"{exc}{_shape_hint(plan.head_dim)}") from exc
        raise


def _seq_to_head_shapes(xs: Sequence[torch.Tensor], W: int, rank: int, head_dim: int):
    """For each x: (heads sent to each rank, shape received from each rank): rank r's heads of
    each sequence chunk."""
    sizes, recv_shapes = [], []
    for x in xs:
        counts = head_counts(x.shape[head_dim], W)
        piece = list(x.shape)
        piece[head_dim] = counts[rank]
        sizes.append(counts)
        recv_shapes.append([piece] * W)
    return sizes, recv_shapes


def _head_to_seq_shapes(xs: Sequence[torch.Tensor], W: int, seq_dim: int, head_dim: int, num_heads: Sequence[int]):
    """For each x: (sequence positions sent to each rank, shape received from each rank): this
    rank's heads of rank r's sequence chunk, and rank r's heads of this rank's chunk."""
    sizes, recv_shapes = [], []
    for x, n in zip(xs, num_heads):
        chunk = x.shape[seq_dim] // W
        pieces = []
        for heads in head_counts(n, W):
            piece = list(x.shape)
            piece[seq_dim], piece[head_dim] = chunk, heads
            pieces.append(piece)
        sizes.append([chunk] * W)
        recv_shapes.append(pieces)
    return sizes, recv_shapes


# --------------------------------------------------------------------------------------------
# Ops. Dims are plain ints in the schema (not SymInt): they pick a dim, so they are never symbolic.
# Output shapes depend on the rank where W does not divide the heads: the fake impls read it from
# the group (SPMD: every rank traces its own graph). The backward of each is the other: the
# exchange is a permutation, so its adjoint is its inverse.


@comm_op("seq_to_head", schema="(Tensor[] xs, str group_name, int seq_dim, int head_dim, SymInt[] attention, "
                               "bool agreed_sizes) -> Tensor[]")
def seq_to_head_op(xs: list[torch.Tensor], group_name: str, seq_dim: int, head_dim: int, attention: list[int],
                   agreed_sizes: bool) -> list[torch.Tensor]:
    """Each (.., S/W at seq_dim, .., Hh_i at head_dim, ..) -> (.., S, .., h_r of Hh_i, ..), all in
    one exchange (one dtype and ndim); dims >= 0. attention: :func:`attention_args` of a
    ulysses_attention, [] otherwise (checked in the header). agreed_sizes: the sizes follow from
    an exchange the group agreed on (see :func:`_exchange`)."""
    plan = _plan("seq_to_head", xs, group_name, seq_dim, head_dim, None, attention)
    _debug_agreement("seq_to_head", xs, group_name, plan)
    return _exchange("seq_to_head", xs, group_name, plan, attention, agreed_sizes)


@seq_to_head_op.register_fake
def _(xs, group_name, seq_dim, head_dim, attention, agreed_sizes):
    W, rank = _group_size(group_name), _group_rank(group_name)
    outs = []
    for x in xs:
        seq_dim, head_dim, _ = _check_args("seq_to_head", x, W, rank, seq_dim, head_dim)
        shape = list(x.shape)
        shape[seq_dim], shape[head_dim] = shape[seq_dim] * W, head_counts(shape[head_dim], W)[rank]
        outs.append(x.new_empty(shape))
    return outs


@comm_op("head_to_seq", schema="(Tensor[] xs, str group_name, int seq_dim, int head_dim, SymInt[] num_heads, "
                               "SymInt[] attention, bool agreed_sizes) -> Tensor[]")
def head_to_seq_op(xs: list[torch.Tensor], group_name: str, seq_dim: int, head_dim: int, num_heads: list[int],
                   attention: list[int], agreed_sizes: bool) -> list[torch.Tensor]:
    """Each (.., S at seq_dim, .., h_r at head_dim, ..) -> (.., S/W, .., num_heads[i], ..), all in
    one exchange; dims >= 0."""
    plan = _plan("head_to_seq", xs, group_name, seq_dim, head_dim, num_heads, attention)
    _debug_agreement("head_to_seq", xs, group_name, plan)
    return _exchange("head_to_seq", xs, group_name, plan, attention, agreed_sizes)


@head_to_seq_op.register_fake
def _(xs, group_name, seq_dim, head_dim, num_heads, attention, agreed_sizes):
    W, rank = _group_size(group_name), _group_rank(group_name)
    outs = []
    for x, n in zip(xs, num_heads):
        seq_dim, head_dim, n = _check_args("head_to_seq", x, W, rank, seq_dim, head_dim, n)
        shape = _full_shape(x, head_dim, n)
        shape[seq_dim] //= W
        outs.append(x.new_empty(shape))
    return outs


def _no_grad(ints: Sequence[int]) -> Optional[list]:
    """The gradient of an int-list argument: None, but [] for an empty list (torch's tensor-list
    autograd takes an empty list for a list of tensors, and wants one back)."""
    return None if len(ints) else []


def _seq_to_head_setup(ctx, inputs, output):
    xs, ctx.group_name, ctx.seq_dim, ctx.head_dim, ctx.attention, _ = inputs
    attention = ctx.attention
    ctx.num_heads = [x.shape[ctx.head_dim] for x in xs]
    ctx.no_grads = {"attention": _no_grad(attention)}


def _head_to_seq_setup(ctx, inputs, output):
    _, ctx.group_name, ctx.seq_dim, ctx.head_dim, num_heads, attention, _ = inputs
    ctx.no_grads = {"num_heads": _no_grad(num_heads), "attention": _no_grad(attention)}


# NB: the backward of an all-to-all is the all-to-all back: one exchange for every gradient. The
# gradients have the shapes of the outputs (autograd holds them to it), whose sizes the forward
# agreed on: agreed_sizes, no exchange of headers first (the header in the pieces still checks them).
def _seq_to_head_backward(ctx, grads):
    grad_xs = head_to_seq_op(list(grads), ctx.group_name, ctx.seq_dim, ctx.head_dim, ctx.num_heads, ctx.attention,
                             True)
    return input_grads(seq_to_head_op, xs=grad_xs, **ctx.no_grads)


def _head_to_seq_backward(ctx, grads):
    grad_xs = seq_to_head_op(list(grads), ctx.group_name, ctx.seq_dim, ctx.head_dim, [], True)
    return input_grads(head_to_seq_op, xs=grad_xs, **ctx.no_grads)


seq_to_head_op.register_autograd(_seq_to_head_backward, setup_context=_seq_to_head_setup)
head_to_seq_op.register_autograd(_head_to_seq_backward, setup_context=_head_to_seq_setup)


# --------------------------------------------------------------------------------------------
# Public API


def seq_to_head(x: torch.Tensor, group: Any = None, seq_dim: int = 1, head_dim: int = 2) -> torch.Tensor:
    """Sequence shard -> head shard: (B, S/W, Hh, D) -> (B, S, h_r, D) with the default dims.

    Rank r's output holds the full sequence (rank 0's chunk first) for its heads
    [start_r, start_r + h_r): h_r = Hh // W, plus one on the first Hh % W ranks (so Hh / W each
    when W divides Hh; none on the last ranks when Hh < W; see the module docstring and
    :func:`head_counts`). Any number of dims; negative dims count from the end.

    Args:
        x: this rank's sequence chunk, any number of heads Hh (the same on every rank).
        group: ProcessGroup, 1-D DeviceMesh, or None (default group; no group when
            torch.distributed is not initialised). A group of one rank does not communicate.
        seq_dim, head_dim: the sequence and head dims of ``x`` (different).

    Returns a new tensor; :func:`head_to_seq` with the same dims (and ``num_heads=Hh`` when W
    does not divide Hh) is its inverse."""
    grp = communication_group(resolve_group(group))
    seq_dim, head_dim, _ = _checked("seq_to_head", grp.name, _check_args, "seq_to_head", x, grp.size, grp.rank,
                                    seq_dim, head_dim)
    return call(seq_to_head_op, [x], grp.name, seq_dim, head_dim, [], False, differentiable=(x,))[0]


def head_to_seq(x: torch.Tensor, group: Any = None, seq_dim: int = 1, head_dim: int = 2, *,
                num_heads: Optional[int] = None) -> torch.Tensor:
    """Head shard -> sequence shard: (B, S, h_r, D) -> (B, S/W, Hh, D); the inverse of
    :func:`seq_to_head`. S must be divisible by W; other arguments as for :func:`seq_to_head`.

    num_heads: the total head count Hh, of which ``x`` holds this rank's share h_r (as
    :func:`seq_to_head` splits them). Default: W times x's heads, right only when W divides Hh;
    with an uneven split pass it on every rank (a rank whose x does not hold its share raises; ranks
    that take different totals send pieces of other sizes: see the module docstring)."""
    grp = communication_group(resolve_group(group))
    seq_dim, head_dim, num_heads = _checked("head_to_seq", grp.name, _check_args, "head_to_seq", x, grp.size,
                                            grp.rank, seq_dim, head_dim, num_heads)
    return call(head_to_seq_op, [x], grp.name, seq_dim, head_dim, [num_heads], [], False, differentiable=(x,))[0]


LAYOUTS = {"bshd": 1, "sbhd": 0}
"""Layouts of ``ulysses_attention``'s tensors -> their sequence dim (heads are dim 2 in both):
batch-first (B, S, H, D), and seq-first (S, B, H, D) as DeepSpeed's DistributedAttention takes."""


def _check_qkv(q, k, v, world_size: int, layout: str, attn_fn, is_causal: bool, scale) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"ulysses_attention: layout: expected one of {tuple(LAYOUTS)}, got {layout!r}")
    shape_doc = "(B, S/W, Hh, D)" if layout == "bshd" else "(S/W, B, Hh, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"ulysses_attention: {name}: expected a 4-D tensor {shape_doc}, got {got}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"ulysses_attention: q, k, v: expected one dtype (they move in one exchange), got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"ulysses_attention: k, v: expected the batch and sequence dims of q and one head count for k and "
            f"v, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} ({layout})"
        )
    heads_q, heads_kv = q.shape[2], k.shape[2]
    if heads_kv != heads_q and heads_q % world_size:
        raise ValueError(
            f"ulysses_attention: q: expected heads divisible by the group size {world_size} with GQA / MQA k, v "
            f"(heads are split unevenly across ranks only when k and v have q's {heads_q} heads), got {heads_q}"
        )
    if heads_kv != heads_q and (heads_kv == 0 or heads_q % heads_kv
                                or not (heads_kv % world_size == 0 or world_size % heads_kv == 0)):
        raise ValueError(
            f"ulysses_attention: k, v: expected kv heads dividing the {heads_q} q heads, and either divisible "
            f"by the group size {world_size} (kv heads are split) or dividing it (kv heads are replicated), "
            f"got {heads_kv}"
        )
    if attn_fn is not None and (is_causal or scale is not None):
        raise ValueError("ulysses_attention: is_causal and scale apply to the default attention; with attn_fn, "
                         "give them to your attn_fn")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, is_causal: bool,
          scale: Optional[float]) -> torch.Tensor:
    """``scaled_dot_product_attention`` on tensors in ``layout``; with fewer k, v heads than q's,
    each serves q.heads / k.heads consecutive q heads (GQA / MQA, no copies of k and v)."""
    to_bhsd = (0, 2, 1, 3) if layout == "bshd" else (1, 2, 0, 3)
    back = (0, 2, 1, 3) if layout == "bshd" else (2, 0, 1, 3)
    q, k, v = (t.permute(to_bhsd) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.permute(back)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    *,
    layout: str = "bshd",
    attn_fn: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """Attention over the whole sequence from sequence shards.

    q: (B, S/W, Hq, Dqk) (``layout="bshd"``) or (S/W, B, Hq, Dqk) (``"sbhd"``); k: Dqk and v: Dv
    with Hkv heads: Hkv == Hq, any number (W need not divide it: the heads are split as DeepSpeed
    splits them, Hq // W a rank and one more on the first Hq % W ranks, none on the last ranks when
    Hq < W; see :func:`head_counts`; nothing is padded), or GQA / MQA with Hq divisible by Hkv and
    by W, and Hkv either divisible by W (kv heads split across ranks like q's) or dividing W (each
    kv head replicated to the W / Hkv ranks whose q heads use it); other GQA / MQA head counts
    raise a ValueError on every rank. Sequence shards of one length on every rank (else a
    GroupMismatchError on every rank, naming each rank's shape). Returns (B, S/W, Hq, Dv) in
    ``layout``: this rank's chunk of attention over the gathered sequence (causal masking is by
    global position, since the sequence is gathered in rank order).

    attn_fn: the local attention, like DeepSpeed's ``local_attention``: called as
    ``attn_fn(q, k, v)`` on the full sequence and this rank's heads, in ``layout`` (q with this
    rank's share h_r of the Hq heads, possibly 0; k and v with as many, or max(Hkv/W, 1) for GQA /
    MQA), returning the output in ``layout`` with q's h_r heads. Default:
    ``scaled_dot_product_attention`` with ``is_causal`` and ``scale`` (``enable_gqa`` for GQA)."""
    grp = communication_group(resolve_group(group))
    _checked("seq_to_head", grp.name, _check_qkv, q, k, v, grp.size, layout, attn_fn, is_causal, scale)
    seq_dim, head_dim = LAYOUTS[layout], 2
    heads, kv_heads = q.shape[head_dim], k.shape[head_dim]
    attention = attention_args(q, k, v, layout, is_causal, scale, attn_fn) if grp.name != LOCAL else []
    if kv_heads != heads and kv_heads < grp.size:  # GQA, fewer kv heads than ranks:
        # every rank gets the kv head of its q heads
        k, v = (t.repeat_interleave(grp.size // kv_heads, dim=head_dim) for t in (k, v))
    # Hq not divisible by W (then kv heads == q heads): q, k and v split alike, unevenly
    q, k, v = call(seq_to_head_op, [q, k, v], grp.name, seq_dim, head_dim, attention, False,  # one exchange
                   differentiable=(q, k, v))
    out = attn_fn(q, k, v) if attn_fn is not None else _sdpa(q, k, v, layout, is_causal, scale)
    _checked("head_to_seq", grp.name, _check_attn_out, out, q, v, layout)
    # NB: o's sizes follow from q, k, v's, which their exchange agreed on
    return call(head_to_seq_op, [out], grp.name, seq_dim, head_dim, [heads], attention, True, differentiable=(out,))[0]


def _check_attn_out(out: Any, q: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    """attn_fn's output: in ``layout``, the full sequence, this rank's q heads, v's head size."""
    expected = (*q.shape[:3], v.shape[3])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        names = "(B, S, h_r, Dv)" if layout == "bshd" else "(S, B, h_r, Dv)"
        raise ValueError(
            f"ulysses_attention: attn_fn: expected an output {names} = {expected} ({layout}: the full sequence "
            f"S = {q.shape[LAYOUTS[layout]]}, this rank's h_r = {q.shape[2]} q heads, v's head size Dv = "
            f"{v.shape[3]}), got {got}"
        )
