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
(``ulysses_exchange.FIELDS``, 64 bytes), and each rank compares the W headers it received with its own. The
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

import struct
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import _cache_key, comm, overlap, ulysses_exchange as exchange
from ._compat import call, input_grads, is_compiling
from .backends.symm_mem.ulysses_buffers import UlyssesBuffers
from .errors import GroupMismatchError
from .groups import LOCAL, Group, communication_group, process_group, resolve_group
from .comm import comm_op
from .validation import as_int, check_bool

def _group_size(group_name: str) -> int:
    return 1 if group_name == LOCAL else process_group(group_name).size()


def _group_rank(group_name: str) -> int:
    return 0 if group_name == LOCAL else process_group(group_name).rank()


def _traced_rank(group_name: str) -> int:
    """:func:`_group_rank` for a fake impl, whose output shapes then depend on it: the disk caches
    of compiled graphs are keyed on the rank from now on (``_cache_key.key_on_rank``)."""
    rank = _group_rank(group_name)
    if group_name != LOCAL:
        _cache_key.key_on_rank(dist.get_rank())
    return rank


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


def _checked(op: str, group_name: str, check: Callable, *args, buffers: Optional[UlyssesBuffers] = None,
             pending: Optional[torch.Tensor] = None):
    """``check(*args)``, the checks of the exchange ``op``. With ``buffers`` (of several ranks), a
    TypeError / ValueError it raises is told to the peers first, through the buffers
    (``exchange.symm_tell_peers``; after a wait on ``pending``, an output of an exchange started on
    them): their exchange raises PeerInputError at once. On a group, in
    debug mode, through ``comm.checked``: a rank whose checks fail takes its error into the op's
    agreement, where its peers wait, so they raise too; by default no agreement runs there: such a
    rank raises at once, its peers at the library's deadline. Under torch.compile the checks run at
    trace time, where nothing is told."""
    if is_compiling():
        return check(*args)
    if buffers is not None:
        try:
            return check(*args)
        except (TypeError, ValueError) as exc:
            if pending is not None:
                overlap.wait(pending)
            exchange.symm_tell_peers(op, buffers, exc)
            raise
    if group_name == LOCAL or not comm.debug():
        return check(*args)
    return comm.checked(op, group_name, check, *args)


def attention_args(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], layout: str,
                   is_causal: bool, scale: Optional[float], attn_fn: Optional[Callable]) -> list:
    """What every rank of a ``ulysses_attention`` must pass alike, as ints: layout, is_causal,
    attn_fn given, scale's bits (-1: None), and q, k, v's shapes as passed (before GQA repetition;
    q's alone, k and v None, for q's exchange when it starts before the projections of k and v)."""
    bits = -1 if scale is None else struct.unpack("<q", struct.pack("<d", float(scale)))[0]
    shapes = [n for t in (q, k, v) if t is not None for n in t.shape]
    return [list(LAYOUTS).index(layout), int(is_causal), int(attn_fn is not None), bits, *shapes]


def _attention_text(args: Sequence[int]) -> str:
    """:func:`attention_args` for a message."""
    if not args:
        return "none (a plain call, not ulysses_attention)"
    layout, is_causal, given, bits = args[:4]
    shapes = [f"{name} {tuple(args[4 + 4 * i: 8 + 4 * i])}" for i, name in enumerate("qkv") if len(args) >= 8 + 4 * i]
    if len(shapes) == 1:
        shapes.append("k, v projected after q's exchange started")
    scale = None if bits == -1 else struct.unpack("<d", struct.pack("<q", bits))[0]
    return (f"{', '.join(shapes)} (layout {list(LAYOUTS)[layout]!r}, is_causal={bool(is_causal)}, scale={scale}, "
            f"attn_fn {'given' if given else 'None'})")


def _full_shape(x: torch.Tensor, head_dim: int, num_heads: int) -> list:
    """The shape of x with all ``num_heads`` heads: the same on every rank of a head_to_seq."""
    shape = list(x.shape)
    shape[head_dim] = num_heads
    return shape


def _plan(op: str, xs: Sequence[torch.Tensor], group_name: str, seq_dim: int, head_dim: int,
          num_heads: Optional[Sequence[int]], attention: Sequence[int], buffers: Any = None) -> exchange.Plan:
    """The checks of ``op`` on each of ``xs`` (see :func:`_check_args`; one dtype and ndim for
    all) and what its exchange does: computed once per distinct arguments (the same arguments
    pass the same checks), so that an exchange's host work is a lookup. With ``buffers``
    (UlyssesBuffers) the group is theirs, and so are the plans."""
    shapes = (xs[0].shape, xs[0].dtype) if len(xs) == 1 else tuple((x.shape, x.dtype) for x in xs)
    args = (op, seq_dim, head_dim, shapes, None if num_heads is None else tuple(num_heads), tuple(attention))
    if buffers is not None:
        return exchange.cached_plan(group_name, args, _make_plan, op, xs, LOCAL, seq_dim, head_dim, num_heads,
                                    attention, (buffers.world_size, buffers.rank), plans=buffers.plans)
    return exchange.cached_plan(group_name, args, _make_plan, op, xs, group_name, seq_dim, head_dim, num_heads,
                                attention)


def _make_plan(op: str, xs: Sequence[torch.Tensor], group_name: str, seq_dim: int, head_dim: int,
               num_heads: Optional[Sequence[int]], attention: Sequence[int],
               world: Optional[tuple[int, int]] = None) -> exchange.Plan:
    """See :func:`_plan`; world: (W, rank), by default the group's."""
    W, rank = world or (_group_size(group_name), _group_rank(group_name))
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
    return exchange.plan(op, xs, W, seq_dim, head_dim, split_dim, cat_dim, shapes, sizes, recv_shapes, attention)


def _described(xs: Sequence[torch.Tensor], plan: exchange.Plan, attention: Sequence[int]) -> Callable[[], dict]:
    """This rank's value of each header field, for a message (made only on the failure path)."""
    return lambda: {"ulysses_attention arguments": _attention_text(attention), "dtype": xs[0].dtype,
                    "ndim": xs[0].ndim, "seq_dim": plan.seq_dim, "head_dim": plan.head_dim,
                    "shape": _shapes_text(plan.shapes)}


def _shapes_text(shapes: list) -> tuple:
    """The shapes every rank shares, for a message: one shape as it is, several as a tuple of them."""
    return tuple(shapes[0]) if len(shapes) == 1 else tuple(tuple(s) for s in shapes)


def _debug_agreement(op: str, xs: Sequence[torch.Tensor], group_name: str, plan: exchange.Plan) -> None:
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
            raise GroupMismatchError(f"{exc}{exchange.shape_hint(plan.head_dim)}") from exc
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
                               "int sizes, bool async_op) -> Tensor[]")
@overlap.startable
def seq_to_head_op(xs: list[torch.Tensor], group_name: str, seq_dim: int, head_dim: int, attention: list[int],
                   sizes: int, async_op: bool) -> list[torch.Tensor]:
    """Each (.., S/W at seq_dim, .., Hh_i at head_dim, ..) -> (.., S, .., h_r of Hh_i, ..), all in
    one exchange (one dtype and ndim); dims >= 0. attention: :func:`attention_args` of a
    ulysses_attention, [] otherwise (checked in the header). sizes: where the exchange's sizes
    come from (``ulysses_exchange.CALLERS`` / ``AGREED`` / ``AFTER_PREVIOUS``, see
    ``ulysses_exchange.exchange``). async_op: started on the
    communication stream, pending until ``overlap.wait`` (``overlap.startable``)."""
    plan = _plan("seq_to_head", xs, group_name, seq_dim, head_dim, None, attention)
    _debug_agreement("seq_to_head", xs, group_name, plan)
    return exchange.exchange("seq_to_head", xs, group_name, plan, sizes, _described(xs, plan, attention))


def _seq_to_head_outputs(xs: Sequence[torch.Tensor], W: int, rank: int, seq_dim: int, head_dim: int) -> list[list]:
    """The output shapes of a seq_to_head of ``xs`` on rank ``rank`` of W (checked)."""
    shapes = []
    for x in xs:
        seq_dim, head_dim, _ = _check_args("seq_to_head", x, W, rank, seq_dim, head_dim)
        shape = list(x.shape)
        shape[seq_dim], shape[head_dim] = shape[seq_dim] * W, head_counts(shape[head_dim], W)[rank]
        shapes.append(shape)
    return shapes


def _head_to_seq_outputs(xs: Sequence[torch.Tensor], W: int, rank: int, seq_dim: int, head_dim: int,
                         num_heads: Sequence[int]) -> list[list]:
    """The output shapes of a head_to_seq of ``xs`` on rank ``rank`` of W (checked)."""
    shapes = []
    for x, n in zip(xs, num_heads):
        seq_dim, head_dim, n = _check_args("head_to_seq", x, W, rank, seq_dim, head_dim, n)
        shape = _full_shape(x, head_dim, n)
        shape[seq_dim] //= W
        shapes.append(shape)
    return shapes


@seq_to_head_op.register_fake
def _(xs, group_name, seq_dim, head_dim, attention, sizes, async_op):
    shapes = _seq_to_head_outputs(xs, _group_size(group_name), _traced_rank(group_name), seq_dim, head_dim)
    return [x.new_empty(shape) for x, shape in zip(xs, shapes)]


@comm_op("head_to_seq", schema="(Tensor[] xs, str group_name, int seq_dim, int head_dim, SymInt[] num_heads, "
                               "SymInt[] attention, int sizes, bool async_op) -> Tensor[]")
@overlap.startable
def head_to_seq_op(xs: list[torch.Tensor], group_name: str, seq_dim: int, head_dim: int, num_heads: list[int],
                   attention: list[int], sizes: int, async_op: bool) -> list[torch.Tensor]:
    """Each (.., S at seq_dim, .., h_r at head_dim, ..) -> (.., S/W, .., num_heads[i], ..), all in
    one exchange; dims >= 0. async_op: as :func:`seq_to_head_op`'s."""
    plan = _plan("head_to_seq", xs, group_name, seq_dim, head_dim, num_heads, attention)
    _debug_agreement("head_to_seq", xs, group_name, plan)
    return exchange.exchange("head_to_seq", xs, group_name, plan, sizes, _described(xs, plan, attention))


@head_to_seq_op.register_fake
def _(xs, group_name, seq_dim, head_dim, num_heads, attention, sizes, async_op):
    shapes = _head_to_seq_outputs(xs, _group_size(group_name), _traced_rank(group_name), seq_dim, head_dim,
                                  num_heads)
    return [x.new_empty(shape) for x, shape in zip(xs, shapes)]


def _no_grad(ints: Sequence[int]) -> Optional[list]:
    """The gradient of an int-list argument: None, but [] for an empty list (torch's tensor-list
    autograd takes an empty list for a list of tensors, and wants one back)."""
    return None if len(ints) else []


def _seq_to_head_setup(ctx, inputs, output):
    xs, ctx.group_name, ctx.seq_dim, ctx.head_dim, ctx.attention, _, async_op = inputs
    attention = ctx.attention
    ctx.num_heads = [x.shape[ctx.head_dim] for x in xs]
    ctx.no_grads = {"attention": _no_grad(attention)}
    overlap.save_for_backward(ctx, output, async_op)  # NB: an async start is waited for in the backward


def _head_to_seq_setup(ctx, inputs, output):
    _, ctx.group_name, ctx.seq_dim, ctx.head_dim, num_heads, attention, _, async_op = inputs
    ctx.no_grads = {"num_heads": _no_grad(num_heads), "attention": _no_grad(attention)}
    overlap.save_for_backward(ctx, output, async_op)


# NB: the backward of an all-to-all is the all-to-all back: one exchange for every gradient. The
# gradients have the shapes of the outputs (autograd holds them to it), whose sizes the forward
# agreed on: AGREED, no exchange of headers first (the header in the pieces still checks them).
def _seq_to_head_backward(ctx, grads):
    overlap.saved_tensors(ctx)  # the forward's exchange, if started, is done
    grad_xs = head_to_seq_op(list(grads), ctx.group_name, ctx.seq_dim, ctx.head_dim, ctx.num_heads, ctx.attention,
                             exchange.AGREED, False)
    return input_grads(seq_to_head_op, xs=grad_xs, **ctx.no_grads)


def _head_to_seq_backward(ctx, grads):
    overlap.saved_tensors(ctx)
    grad_xs = seq_to_head_op(list(grads), ctx.group_name, ctx.seq_dim, ctx.head_dim, [], exchange.AGREED, False)
    return input_grads(head_to_seq_op, xs=grad_xs, **ctx.no_grads)


seq_to_head_op.register_autograd(_seq_to_head_backward, setup_context=_seq_to_head_setup)
head_to_seq_op.register_autograd(_head_to_seq_backward, setup_context=_head_to_seq_setup)


# The same exchanges through UlyssesBuffers (``buffers=``; ulysses_exchange.symm_exchange): the
# group is the buffers', the headers travel in the stage and are compared on the device, so no
# size agreement is needed (every rank's stage holds its largest exchange).


@comm_op("symm_seq_to_head")
@overlap.startable
def symm_seq_to_head_op(xs: list[torch.Tensor], buffers: UlyssesBuffers, seq_dim: int, head_dim: int,
                        attention: list[int], async_op: bool) -> list[torch.Tensor]:
    """:func:`seq_to_head_op` through ``buffers`` (async_op: their exchanges then run one after
    another on the communication stream)."""
    plan = _plan("seq_to_head", xs, buffers.group_name, seq_dim, head_dim, None, attention, buffers)
    cat_counts = [(x.shape[plan.seq_dim], 0) for x in xs]  # every rank's chunk of the sequence
    return exchange.symm_exchange("seq_to_head", xs, buffers, plan, cat_counts, _described(xs, plan, attention))


@symm_seq_to_head_op.register_fake
def _(xs, buffers, seq_dim, head_dim, attention, async_op):
    shapes = _seq_to_head_outputs(xs, buffers.world_size, buffers.rank, seq_dim, head_dim)
    return [x.new_empty(shape) for x, shape in zip(xs, shapes)]


@comm_op("symm_head_to_seq")
@overlap.startable
def symm_head_to_seq_op(xs: list[torch.Tensor], buffers: UlyssesBuffers, seq_dim: int, head_dim: int,
                        num_heads: list[int], attention: list[int], async_op: bool) -> list[torch.Tensor]:
    """:func:`head_to_seq_op` through ``buffers``."""
    plan = _plan("head_to_seq", xs, buffers.group_name, seq_dim, head_dim, num_heads, attention, buffers)
    W = buffers.world_size
    cat_counts = [(n // W, n % W) for n in num_heads]  # every rank's heads (head_counts)
    return exchange.symm_exchange("head_to_seq", xs, buffers, plan, cat_counts, _described(xs, plan, attention))


@symm_head_to_seq_op.register_fake
def _(xs, buffers, seq_dim, head_dim, num_heads, attention, async_op):
    shapes = _head_to_seq_outputs(xs, buffers.world_size, buffers.rank, seq_dim, head_dim, num_heads)
    return [x.new_empty(shape) for x, shape in zip(xs, shapes)]


def _symm_seq_to_head_setup(ctx, inputs, output):
    xs, ctx.buffers, ctx.seq_dim, ctx.head_dim, ctx.attention, async_op = inputs
    ctx.num_heads = [x.shape[ctx.head_dim] for x in xs]
    overlap.save_for_backward(ctx, output, async_op)


def _symm_head_to_seq_setup(ctx, inputs, output):
    _, ctx.buffers, ctx.seq_dim, ctx.head_dim, ctx.num_heads, ctx.attention, async_op = inputs
    overlap.save_for_backward(ctx, output, async_op)


def _symm_seq_to_head_backward(ctx, grads):
    overlap.saved_tensors(ctx)
    grad_xs = symm_head_to_seq_op(list(grads), ctx.buffers, ctx.seq_dim, ctx.head_dim, ctx.num_heads, ctx.attention,
                                  False)
    return input_grads(symm_seq_to_head_op, xs=grad_xs, attention=_no_grad(ctx.attention))


def _symm_head_to_seq_backward(ctx, grads):
    overlap.saved_tensors(ctx)
    grad_xs = symm_seq_to_head_op(list(grads), ctx.buffers, ctx.seq_dim, ctx.head_dim, ctx.attention, False)
    return input_grads(symm_head_to_seq_op, xs=grad_xs, num_heads=_no_grad(ctx.num_heads),
                       attention=_no_grad(ctx.attention))


symm_seq_to_head_op.register_autograd(_symm_seq_to_head_backward, setup_context=_symm_seq_to_head_setup)
symm_head_to_seq_op.register_autograd(_symm_head_to_seq_backward, setup_context=_symm_head_to_seq_setup)


def _group_or_buffers(fn: str, group: Any, buffers: Any, x: torch.Tensor, starts: bool = False) -> tuple[Group, str]:
    """The group of a call: ``group``'s, or with ``buffers`` (UlyssesBuffers) theirs (``group``
    then None or theirs, x on their device, and no exchange started on them pending unless this
    call ``starts`` one too: ``overlap.check_nothing_pending``); and the group name its checks
    run on (debug mode's agreement: process groups only, LOCAL with buffers)."""
    if buffers is None:
        grp = communication_group(resolve_group(group))
        return grp, grp.name
    if not isinstance(buffers, UlyssesBuffers):
        raise TypeError(f"{fn}: buffers: expected alltoall_ops.UlyssesBuffers, got {type(buffers).__name__}")
    if group is not None and resolve_group(group).name != buffers.group_name:
        raise ValueError(f"{fn}: group: the buffers were created for group {buffers.group_name!r}, got group "
                         f"{resolve_group(group).name!r}; pass group=None or the buffers' group")
    if isinstance(x, torch.Tensor) and x.device != buffers.device:
        raise ValueError(f"{fn}: x: the buffers are on {buffers.device}, got a tensor on {x.device}")
    if not starts:
        overlap.check_nothing_pending(buffers, fn)
    return Group(buffers.group_name, buffers.rank, buffers.world_size), LOCAL


# --------------------------------------------------------------------------------------------
# Public API


def seq_to_head(x: torch.Tensor, group: Any = None, seq_dim: int = 1, head_dim: int = 2, *,
                buffers: Optional[UlyssesBuffers] = None, async_op: bool = False) -> torch.Tensor:
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
        buffers: :class:`UlyssesBuffers` (backend symm_mem): the exchange runs as kernels over
            them, in their group (``group``: None or theirs), with no host sync.
        async_op: start the exchange on a communication stream and return at once: the output
            is ready after :func:`alltoall_ops.wait` on it, and work queued meanwhile (k and v's
            projections while q moves) runs beside it (CUDA; in place on the CPU). Exchanges on
            the same ``buffers`` run in the order they start; one not started with async_op
            first needs the wait (RuntimeError otherwise). The backward runs at once.

    Returns a new tensor; :func:`head_to_seq` with the same dims (and ``num_heads=Hh`` when W
    does not divide Hh) is its inverse."""
    return _exchange_one("seq_to_head", x, group, buffers, async_op, seq_dim, head_dim)


def _exchange_one(op: str, x: torch.Tensor, group: Any, buffers: Optional[UlyssesBuffers], async_op: bool,
                  seq_dim: int, head_dim: int, num_heads: Optional[int] = None) -> torch.Tensor:
    """The public seq_to_head / head_to_seq of one tensor: checks, then the op of the group or of
    the buffers, sync or started (``async_op``)."""
    async_op = check_bool("async_op", async_op)
    grp, checks = _group_or_buffers(op, group, buffers, x, starts=async_op)
    seq_dim, head_dim, num_heads = _checked(op, checks, _check_args, op, x, grp.size, grp.rank, seq_dim, head_dim,
                                            num_heads, buffers=buffers)
    heads = [] if op == "seq_to_head" else [[num_heads]]  # head_to_seq's num_heads argument
    if buffers is not None:
        fn = symm_seq_to_head_op if op == "seq_to_head" else symm_head_to_seq_op
        return call(fn, [x], buffers, seq_dim, head_dim, *heads, [], async_op=async_op, differentiable=(x,))[0]
    fn = seq_to_head_op if op == "seq_to_head" else head_to_seq_op  # the caller's sizes
    return call(fn, [x], grp.name, seq_dim, head_dim, *heads, [], exchange.CALLERS, async_op=async_op,
                differentiable=(x,))[0]


def head_to_seq(x: torch.Tensor, group: Any = None, seq_dim: int = 1, head_dim: int = 2, *,
                num_heads: Optional[int] = None, buffers: Optional[UlyssesBuffers] = None,
                async_op: bool = False) -> torch.Tensor:
    """Head shard -> sequence shard: (B, S, h_r, D) -> (B, S/W, Hh, D); the inverse of
    :func:`seq_to_head`. S must be divisible by W; other arguments as for :func:`seq_to_head`.

    num_heads: the total head count Hh, of which ``x`` holds this rank's share h_r (as
    :func:`seq_to_head` splits them). Default: W times x's heads, right only when W divides Hh;
    with an uneven split pass it on every rank (a rank whose x does not hold its share raises; ranks
    that take different totals send pieces of other sizes: see the module docstring)."""
    return _exchange_one("head_to_seq", x, group, buffers, async_op, seq_dim, head_dim, num_heads)


LAYOUTS = {"bshd": 1, "sbhd": 0}
"""Layouts of ``ulysses_attention``'s tensors -> their sequence dim (heads are dim 2 in both):
batch-first (B, S, H, D), and seq-first (S, B, H, D) as DeepSpeed's DistributedAttention takes."""


def _check_qkv(q, k, v, world_size: int, layout: str, attn_fn, is_causal: bool, scale) -> None:
    """ulysses_attention's arguments (``k`` and ``v`` None: q and the rest alone, before the
    projections of k and v run)."""
    if layout not in LAYOUTS:
        raise ValueError(f"ulysses_attention: layout: expected one of {tuple(LAYOUTS)}, got {layout!r}")
    if attn_fn is not None and (is_causal or scale is not None):
        raise ValueError("ulysses_attention: is_causal and scale apply to the default attention; with attn_fn, "
                         "give them to your attn_fn")
    shape_doc = "(B, S/W, Hh, D)" if layout == "bshd" else "(S/W, B, Hh, D)"
    q_alone = k is None and v is None
    for name, t in (("q", q),) if q_alone else (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"ulysses_attention: {name}: expected a 4-D tensor {shape_doc}, got {got}")
    if q_alone:
        return
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
    k: Union[torch.Tensor, Callable[[], torch.Tensor]],
    v: Union[torch.Tensor, Callable[[], torch.Tensor]],
    group: Any = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    *,
    layout: str = "bshd",
    attn_fn: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    buffers: Optional[UlyssesBuffers] = None,
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

    k, v: the tensors, or zero-argument callables that return them (their projections, e.g.
    ``lambda: k_proj(x)``). With a callable (and several ranks), q's exchange starts first
    (``async_op``) and the callables run beside it on the current stream; then k and v move in one
    exchange: two exchanges forward and two backward instead of one each, for q's exchange hidden
    behind the projections (on a GPU: on the CPU a start runs in place, so pass tensors there).

    attn_fn: the local attention, like DeepSpeed's ``local_attention``: called as
    ``attn_fn(q, k, v)`` on the full sequence and this rank's heads, in ``layout`` (q with this
    rank's share h_r of the Hq heads, possibly 0; k and v with as many, or max(Hkv/W, 1) for GQA /
    MQA), returning the output in ``layout`` with q's h_r heads. Default:
    ``scaled_dot_product_attention`` with ``is_causal`` and ``scale`` (``enable_gqa`` for GQA).

    buffers: :class:`UlyssesBuffers` (backend symm_mem): both exchanges run as kernels over them
    (q, k, v in one), in their group, with no host sync; size them with
    ``UlyssesBuffers.bytes_for([q.shape, k.shape, v.shape], q.dtype, W)`` (GQA with fewer kv heads
    than ranks: k and v with W heads, as they move)."""
    grp, checks = _group_or_buffers("ulysses_attention", group, buffers, q)
    started = None  # q's exchange, when it starts before the projections
    if grp.size > 1 and (callable(k) or callable(v)):
        _checked("seq_to_head", checks, _check_qkv, q, None, None, grp.size, layout, attn_fn, is_causal, scale,
                 buffers=buffers)
        q_args = attention_args(q, None, None, layout, is_causal, scale, attn_fn)
        started = _qkv_exchange([q], grp, buffers, LAYOUTS[layout], q_args, exchange.CALLERS, True)[0]
    try:
        (q, k, v), attention, heads = _gathered_qkv(q, k, v, grp, checks, layout, is_causal, scale, attn_fn, buffers,
                                                    started)
    except BaseException:
        if started is not None:  # nothing left pending on the buffers (a second wait is free)
            overlap.wait(started)
        raise
    seq_dim, head_dim = LAYOUTS[layout], 2
    out = attn_fn(q, k, v) if attn_fn is not None else _sdpa(q, k, v, layout, is_causal, scale)
    _checked("head_to_seq", checks, _check_attn_out, out, q, v, layout, buffers=buffers)
    if buffers is not None:
        return call(symm_head_to_seq_op, [out], buffers, seq_dim, head_dim, [heads], attention, False,
                    differentiable=(out,))[0]
    # NB: o's sizes follow from q, k, v's, which their exchange agreed on
    return call(head_to_seq_op, [out], grp.name, seq_dim, head_dim, [heads], attention, exchange.AGREED, False,
                differentiable=(out,))[0]


def _gathered_qkv(q, k, v, grp: Group, checks: str, layout: str, is_causal: bool, scale, attn_fn,
                  buffers: Optional[UlyssesBuffers], started: Optional[torch.Tensor]) -> tuple[list, list, int]:
    """ulysses_attention's forward exchange: k and v projected where given as callables, checked
    with q, and the three (or k and v, after q's exchange ``started``) moved to head shards.
    Returns the gathered (q, k, v), the header's :func:`attention_args` and q's head count Hq."""
    k, v = (t() if callable(t) else t for t in (k, v))
    _checked("seq_to_head", checks, _check_qkv, q, k, v, grp.size, layout, attn_fn, is_causal, scale,
             buffers=buffers, pending=started)
    seq_dim, head_dim = LAYOUTS[layout], 2
    heads, kv_heads = q.shape[head_dim], k.shape[head_dim]
    attention = attention_args(q, k, v, layout, is_causal, scale, attn_fn) if grp.name != LOCAL else []
    if kv_heads != heads and kv_heads < grp.size:  # GQA, fewer kv heads than ranks:
        # every rank gets the kv head of its q heads
        k, v = (t.repeat_interleave(grp.size // kv_heads, dim=head_dim) for t in (k, v))
    # Hq not divisible by W (then kv heads == q heads): q, k and v split alike, unevenly
    if started is None:  # one exchange
        return _qkv_exchange([q, k, v], grp, buffers, seq_dim, attention, exchange.CALLERS, False), attention, heads
    # k and v's exchange queued after q's (started too: the order of the starts), its sizes agreed
    # through the last one after a q exchange of this key
    k, v = _qkv_exchange([k, v], grp, buffers, seq_dim, attention, exchange.AFTER_PREVIOUS, True)
    return overlap.wait([started, k, v]), attention, heads


def _qkv_exchange(xs: list, grp: Group, buffers: Optional[UlyssesBuffers], seq_dim: int, attention: list,
                  sizes: int, async_op: bool) -> list:
    """ulysses_attention's seq_to_head of ``xs`` (q, k, v or some of them) over the group or the
    buffers; sizes: the process group's ``ulysses_exchange`` mode (the buffers need none)."""
    if buffers is not None:
        return call(symm_seq_to_head_op, xs, buffers, seq_dim, 2, attention, async_op=async_op, differentiable=xs)
    return call(seq_to_head_op, xs, grp.name, seq_dim, 2, attention, sizes, async_op=async_op, differentiable=xs)


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
