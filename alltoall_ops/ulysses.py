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

Each is one all-to-all (unequal splits when W does not divide Hh). A rank's head count alone
does not tell Hh when the split is uneven, so ``head_to_seq`` takes ``num_heads=Hh`` (needed
then; by default W * its head count). Tensors may have any number of dims; every dim other than
``seq_dim`` and ``head_dim`` is carried along (so q/k and v may have different head sizes).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from . import comm
from .errors import GroupMismatchError
from .groups import LOCAL, communication_group, process_group, resolve_group
from .comm import comm_op
from .validation import as_int


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

    Only shapes, ints and the rank are read: every rank raises alike on what SPMD programs share,
    and ``head_to_seq``'s check of x's heads against this rank's share may fail on some ranks
    only (``comm.checked`` then raises on the others too), before the all-to-all."""
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


def _exchange(op: str, x: torch.Tensor, group_name: str, split_dim: int, send_sizes: list[int], cat_dim: int,
              recv_shapes: list[list[int]], everything_empty: bool) -> torch.Tensor:
    """Piece r of ``x`` along ``split_dim`` (``send_sizes[r]`` long) to rank r, and what arrives
    from ranks 0..W-1 (of ``recv_shapes``) concatenated along ``cat_dim``. One all-to-all, with
    unequal splits where the sizes differ; skipped when ``everything_empty`` (the same on every
    rank: no rank sends anything). Returns a new contiguous tensor."""
    if _group_size(group_name) == 1:
        return x.clone(memory_format=torch.contiguous_format)  # op outputs must not alias inputs
    pieces = x.split(send_sizes, dim=split_dim)
    in_splits = [p.numel() for p in pieces]
    out_splits = [math.prod(shape) for shape in recv_shapes]
    if len(set(send_sizes)) == 1:  # equal pieces: one copy kernel
        send = torch.stack(pieces).reshape(-1)  # (stack may keep a permuted layout)
    else:  # each piece contiguous, in rank order
        send = x.new_empty(sum(in_splits))
        for piece, chunk in zip(pieces, send.split(in_splits)):
            chunk.view(piece.shape).copy_(piece)
    received = x.new_empty(sum(out_splits))
    if not everything_empty:
        comm.all_to_all(op, group_name, received, send, out_splits, in_splits)
    return torch.cat([chunk.view(shape) for chunk, shape in zip(received.split(out_splits), recv_shapes)],
                     dim=cat_dim)


def _full_shape(x: torch.Tensor, head_dim: int, num_heads: int) -> list:
    """The shape of x with all ``num_heads`` heads: the same on every rank of a head_to_seq."""
    shape = list(x.shape)
    shape[head_dim] = num_heads
    return shape


def _agreed_dims(op: str, x: torch.Tensor, group_name: str, seq_dim: int, head_dim: int,
                 num_heads: Optional[int] = None) -> tuple[int, int, int]:
    """The checks of ``op`` (see :func:`_check_args`), then, on a group, the ranks' agreement on
    x's dtype, dims and shape (a fingerprint; for head_to_seq the shape with all ``num_heads``
    heads, since the ranks' head shares may differ), so a rank with another shard shape is an
    error on every rank instead of a mismatched exchange."""
    seq_dim, head_dim, num_heads = comm.checked(
        op, group_name, _check_args, op, x, _group_size(group_name), _group_rank(group_name), seq_dim, head_dim,
        num_heads)
    if group_name != LOCAL:
        shape = x.shape if op == "seq_to_head" else _full_shape(x, head_dim, num_heads)
        fields = [comm.dtype_code(x.dtype), x.ndim, seq_dim, head_dim, comm.shape_code(shape)]
        try:
            comm.agree(op, group_name, fields, shapes=shape)
        except GroupMismatchError as exc:
            if op == "head_to_seq" and "disagree on shape" in str(exc):
                raise GroupMismatchError(
                    f"{exc} (head_to_seq compares x's shapes with all num_heads heads at dim {head_dim}; a rank "
                    "without num_heads takes W times its own heads, so with heads split unevenly every rank "
                    "must pass num_heads=, the total head count)") from exc
            raise
    return seq_dim, head_dim, num_heads


def _seq_to_head_shapes(x: torch.Tensor, group_name: str, seq_dim: int, head_dim: int):
    """(heads sent to each rank, shape received from each rank): rank r's heads of each
    sequence chunk."""
    W = _group_size(group_name)
    counts = head_counts(x.shape[head_dim], W)
    piece = list(x.shape)
    piece[head_dim] = counts[_group_rank(group_name)]
    return counts, [piece] * W


def _head_to_seq_shapes(x: torch.Tensor, group_name: str, seq_dim: int, head_dim: int, num_heads: int):
    """(sequence positions sent to each rank, shape received from each rank): this rank's
    heads of rank r's sequence chunk, and rank r's heads of this rank's chunk."""
    W = _group_size(group_name)
    chunk = x.shape[seq_dim] // W
    pieces = []
    for heads in head_counts(num_heads, W):
        piece = list(x.shape)
        piece[seq_dim], piece[head_dim] = chunk, heads
        pieces.append(piece)
    return [chunk] * W, pieces


# --------------------------------------------------------------------------------------------
# Ops. Dims are plain ints in the schema (not SymInt): they pick a dim, so they are never symbolic.
# Output shapes depend on the rank where W does not divide the heads: the fake impls read it from
# the group (SPMD: every rank traces its own graph). The backward of each is the other: the
# exchange is a permutation, so its adjoint is its inverse.


@comm_op("seq_to_head", schema="(Tensor x, str group_name, int seq_dim, int head_dim) -> Tensor")
def seq_to_head_op(x: torch.Tensor, group_name: str, seq_dim: int, head_dim: int) -> torch.Tensor:
    """(.., S/W at seq_dim, .., Hh at head_dim, ..) -> (.., S, .., h_r, ..); dims >= 0."""
    seq_dim, head_dim, _ = _agreed_dims("seq_to_head", x, group_name, seq_dim, head_dim)
    counts, recv_shapes = _seq_to_head_shapes(x, group_name, seq_dim, head_dim)
    return _exchange("seq_to_head", x, group_name, head_dim, counts, seq_dim, recv_shapes, x.numel() == 0)


@seq_to_head_op.register_fake
def _(x, group_name, seq_dim, head_dim):
    seq_dim, head_dim, _ = _check_args("seq_to_head", x, _group_size(group_name), _group_rank(group_name),
                                       seq_dim, head_dim)
    _, recv_shapes = _seq_to_head_shapes(x, group_name, seq_dim, head_dim)
    shape = list(recv_shapes[0])
    shape[seq_dim] *= len(recv_shapes)
    return x.new_empty(shape)


@comm_op("head_to_seq", schema="(Tensor x, str group_name, int seq_dim, int head_dim, SymInt num_heads) -> Tensor")
def head_to_seq_op(x: torch.Tensor, group_name: str, seq_dim: int, head_dim: int, num_heads: int) -> torch.Tensor:
    """(.., S at seq_dim, .., h_r at head_dim, ..) -> (.., S/W, .., num_heads, ..); dims >= 0."""
    seq_dim, head_dim, num_heads = _agreed_dims("head_to_seq", x, group_name, seq_dim, head_dim, num_heads)
    sizes, recv_shapes = _head_to_seq_shapes(x, group_name, seq_dim, head_dim, num_heads)
    empty = math.prod(_full_shape(x, head_dim, num_heads)) == 0
    return _exchange("head_to_seq", x, group_name, seq_dim, sizes, head_dim, recv_shapes, empty)


@head_to_seq_op.register_fake
def _(x, group_name, seq_dim, head_dim, num_heads):
    seq_dim, head_dim, num_heads = _check_args("head_to_seq", x, _group_size(group_name), _group_rank(group_name),
                                               seq_dim, head_dim, num_heads)
    shape = _full_shape(x, head_dim, num_heads)
    shape[seq_dim] //= _group_size(group_name)
    return x.new_empty(shape)


def _seq_to_head_setup(ctx, inputs, output):
    x, ctx.group_name, ctx.seq_dim, ctx.head_dim = inputs
    ctx.num_heads = x.shape[ctx.head_dim]


def _head_to_seq_setup(ctx, inputs, output):
    _, ctx.group_name, ctx.seq_dim, ctx.head_dim, _ = inputs


def _seq_to_head_backward(ctx, grad):
    return head_to_seq_op(grad, ctx.group_name, ctx.seq_dim, ctx.head_dim, ctx.num_heads), None, None, None


def _head_to_seq_backward(ctx, grad):
    return seq_to_head_op(grad, ctx.group_name, ctx.seq_dim, ctx.head_dim), None, None, None, None


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
    seq_dim, head_dim, _ = comm.checked("seq_to_head", grp.name, _check_args, "seq_to_head", x, grp.size, grp.rank,
                                        seq_dim, head_dim)
    return seq_to_head_op(x, grp.name, seq_dim, head_dim)


def head_to_seq(x: torch.Tensor, group: Any = None, seq_dim: int = 1, head_dim: int = 2, *,
                num_heads: Optional[int] = None) -> torch.Tensor:
    """Head shard -> sequence shard: (B, S, h_r, D) -> (B, S/W, Hh, D); the inverse of
    :func:`seq_to_head`. S must be divisible by W; other arguments as for :func:`seq_to_head`.

    num_heads: the total head count Hh, of which ``x`` holds this rank's share h_r (as
    :func:`seq_to_head` splits them). Default: W times x's heads, right only when W divides Hh;
    with an uneven split pass it on every rank (a rank whose x does not hold its share raises, and
    so does every other rank; ranks that take different totals raise a GroupMismatchError)."""
    grp = communication_group(resolve_group(group))
    seq_dim, head_dim, num_heads = comm.checked("head_to_seq", grp.name, _check_args, "head_to_seq", x, grp.size,
                                                grp.rank, seq_dim, head_dim, num_heads)
    return head_to_seq_op(x, grp.name, seq_dim, head_dim, num_heads)


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
    comm.checked("seq_to_head", grp.name, _check_qkv, q, k, v, grp.size, layout, attn_fn, is_causal, scale)
    seq_dim, head_dim = LAYOUTS[layout], 2
    heads = q.shape[head_dim]
    if k.shape[head_dim] != heads and k.shape[head_dim] < grp.size:  # GQA, fewer kv heads than ranks:
        # every rank gets the kv head of its q heads
        k, v = (t.repeat_interleave(grp.size // k.shape[head_dim], dim=head_dim) for t in (k, v))
    # Hq not divisible by W (then kv heads == q heads): q, k and v split alike, unevenly
    q, k, v = (seq_to_head(t, grp, seq_dim=seq_dim, head_dim=head_dim) for t in (q, k, v))
    out = attn_fn(q, k, v) if attn_fn is not None else _sdpa(q, k, v, layout, is_causal, scale)
    return head_to_seq(out, grp, seq_dim=seq_dim, head_dim=head_dim, num_heads=heads)
