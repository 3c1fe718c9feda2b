"""Ulysses sequence parallelism: trade a sequence shard for a head shard and back.

Each of the W ranks of a group holds a contiguous chunk of the sequence (rank 0's first) and all
Hh heads. ``seq_to_head`` gives every rank the full sequence for its Hh/W heads; ``head_to_seq``
undoes it. Attention, which mixes positions but not heads, runs in between::

    q, k, v = (seq_to_head(t, group) for t in (q, k, v))   # (B, S/W, Hh, D) -> (B, S, Hh/W, D)
    o = attention(q, k, v)                                   # full sequence, local heads
    o = head_to_seq(o, group)                                # (B, S, Hh/W, Dv) -> (B, S/W, Hh, Dv)

Both are one all-to-all with equal splits. Tensors may have any number of dims; every dim other
than ``seq_dim`` and ``head_dim`` is carried along (so q/k and v may have different head sizes).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import comm
from .groups import LOCAL, communication_group, process_group, resolve_group
from .comm import comm_op


def _group_size(group_name: str) -> int:
    return 1 if group_name == LOCAL else process_group(group_name).size()


def _normalize_dim(name: str, dim: Any, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name}: expected an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{name}: expected a dim in [{-ndim}, {ndim}) for a {ndim}-D tensor, got {dim}"
        )
    return dim % ndim


def _check_args(
    fn: str, x: Any, world_size: int, seq_dim: Any, head_dim: Any
) -> tuple[int, int]:
    """Shape checks shared by the public functions and the ops; returns the normalised dims.

    Only shapes and ints are read, which SPMD programs share across ranks, so every rank raises
    alike and none is left waiting in the all-to-all."""
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
    split_dim, what = (head_dim, "heads") if fn == "seq_to_head" else (seq_dim, "sequence length")
    if x.shape[split_dim] % world_size != 0:
        raise ValueError(
            f"{fn}: x: expected {what} (dim {split_dim}) divisible by the group size {world_size}, "
            f"got {x.shape[split_dim]} (shape {tuple(x.shape)})"
        )
    return seq_dim, head_dim


def _all_to_all(op: str, x: torch.Tensor, split_dim: int, cat_dim: int, group_name: str) -> torch.Tensor:
    """Chunk ``x`` into W along ``split_dim`` (chunk r to rank r) and concatenate what arrives
    from ranks 0..W-1 along ``cat_dim``. Returns a new contiguous tensor."""
    W = _group_size(group_name)
    if W == 1:
        return x.clone(memory_format=torch.contiguous_format)  # op outputs must not alias inputs
    send = torch.stack(x.chunk(W, dim=split_dim)).contiguous()  # (W, ..., n/W at split_dim, ...)
    received = torch.empty_like(send)
    if send.numel() > 0:  # equal splits: every rank's send is empty alike (the shapes agree)
        comm.all_to_all(op, group_name, received, send)
    return torch.cat(received.unbind(0), dim=cat_dim)


def _agreed_dims(op: str, x: torch.Tensor, group_name: str, seq_dim: int, head_dim: int) -> tuple[int, int]:
    """The checks of ``op`` (see :func:`_check_args`), then, on a group, the ranks' agreement on
    x's dtype, dims and shape (a fingerprint), so a rank with another shard shape is an error
    on every rank instead of a mismatched exchange."""
    seq_dim, head_dim = comm.checked(op, group_name, _check_args, op, x, _group_size(group_name), seq_dim, head_dim)
    if group_name != LOCAL:
        fields = [comm.dtype_code(x.dtype), x.ndim, seq_dim, head_dim, comm.shape_code(x.shape)]
        comm.agree(op, group_name, fields, shapes=x.shape)
    return seq_dim, head_dim


def _exchanged_shape(x: torch.Tensor, group_name: str, grow: int, shrink: int) -> list:
    W = _group_size(group_name)
    shape = list(x.shape)
    shape[grow] = shape[grow] * W
    shape[shrink] = shape[shrink] // W
    return shape


# --------------------------------------------------------------------------------------------
# Ops. Dims are plain ints in the schema (not SymInt): they pick a dim, so they are never symbolic.
# The backward of each is the other: the exchange is a permutation, so its adjoint is its
# inverse.

_SCHEMA = "(Tensor x, str group_name, int seq_dim, int head_dim) -> Tensor"


@comm_op("seq_to_head", schema=_SCHEMA)
def seq_to_head_op(x: torch.Tensor, group_name: str, seq_dim: int, head_dim: int) -> torch.Tensor:
    """(.., S/W at seq_dim, .., Hh at head_dim, ..) -> (.., S, .., Hh/W, ..); dims >= 0."""
    seq_dim, head_dim = _agreed_dims("seq_to_head", x, group_name, seq_dim, head_dim)
    return _all_to_all("seq_to_head", x, head_dim, seq_dim, group_name)


@seq_to_head_op.register_fake
def _(x, group_name, seq_dim, head_dim):
    seq_dim, head_dim = _check_args("seq_to_head", x, _group_size(group_name), seq_dim, head_dim)
    return x.new_empty(_exchanged_shape(x, group_name, grow=seq_dim, shrink=head_dim))


@comm_op("head_to_seq", schema=_SCHEMA)
def head_to_seq_op(x: torch.Tensor, group_name: str, seq_dim: int, head_dim: int) -> torch.Tensor:
    """(.., S at seq_dim, .., Hh/W at head_dim, ..) -> (.., S/W, .., Hh, ..); dims >= 0."""
    seq_dim, head_dim = _agreed_dims("head_to_seq", x, group_name, seq_dim, head_dim)
    return _all_to_all("head_to_seq", x, seq_dim, head_dim, group_name)


@head_to_seq_op.register_fake
def _(x, group_name, seq_dim, head_dim):
    seq_dim, head_dim = _check_args("head_to_seq", x, _group_size(group_name), seq_dim, head_dim)
    return x.new_empty(_exchanged_shape(x, group_name, grow=head_dim, shrink=seq_dim))


def _setup_context(ctx, inputs, output):
    _, ctx.group_name, ctx.seq_dim, ctx.head_dim = inputs


def _seq_to_head_backward(ctx, grad):
    return head_to_seq_op(grad, ctx.group_name, ctx.seq_dim, ctx.head_dim), None, None, None


def _head_to_seq_backward(ctx, grad):
    return seq_to_head_op(grad, ctx.group_name, ctx.seq_dim, ctx.head_dim), None, None, None


seq_to_head_op.register_autograd(_seq_to_head_backward, setup_context=_setup_context)
head_to_seq_op.register_autograd(_head_to_seq_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Public API


def seq_to_head(x: torch.Tensor, group: Any = None, seq_dim: int = 1, head_dim: int = 2) -> torch.Tensor:
    """Sequence shard -> head shard: (B, S/W, Hh, D) -> (B, S, Hh/W, D) with the default dims.

    Rank r's output holds the full sequence (rank 0's chunk first) for heads
    [r*Hh/W, (r+1)*Hh/W). Any number of dims; negative dims count from the end.

    Args:
        x: this rank's sequence chunk, Hh divisible by W.
        group: ProcessGroup, 1-D DeviceMesh, or None (default group; no group when
            torch.distributed is not initialised). A group of one rank does not communicate.
        seq_dim, head_dim: the sequence and head dims of ``x`` (different).

    Returns a new tensor; :func:`head_to_seq` with the same dims is its inverse."""
    grp = communication_group(resolve_group(group))
    seq_dim, head_dim = comm.checked("seq_to_head", grp.name, _check_args, "seq_to_head", x, grp.size, seq_dim,
                                     head_dim)
    return seq_to_head_op(x, grp.name, seq_dim, head_dim)


def head_to_seq(x: torch.Tensor, group: Any = None, seq_dim: int = 1, head_dim: int = 2) -> torch.Tensor:
    """Head shard -> sequence shard: (B, S, Hh/W, D) -> (B, S/W, Hh, D); the inverse of
    :func:`seq_to_head`. S must be divisible by W; arguments as for :func:`seq_to_head`."""
    grp = communication_group(resolve_group(group))
    seq_dim, head_dim = comm.checked("head_to_seq", grp.name, _check_args, "head_to_seq", x, grp.size, seq_dim,
                                     head_dim)
    return head_to_seq_op(x, grp.name, seq_dim, head_dim)


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
            f"(uneven heads are padded only when k and v have q's {heads_q} heads), got {heads_q}"
        )
    if heads_kv != heads_q and (heads_q % heads_kv or not (heads_kv % world_size == 0 or world_size % heads_kv == 0)):
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
    with Hkv heads: Hkv == Hq, or GQA / MQA with Hq divisible by Hkv and by W, and Hkv either
    divisible by W (kv heads split across ranks like q's) or dividing W (each kv head replicated to
    the W / Hkv ranks whose q heads use it). Hkv == Hq not divisible by W: zero heads pad q, k, v
    up to a multiple of W (the last ranks attend over them; they are dropped from the output).
    Sequence shards of one length on every rank (else a GroupMismatchError on every rank, naming
    each rank's shape). Returns (B, S/W, Hq, Dv) in ``layout``: this rank's chunk of attention
    over the gathered sequence (causal masking is by global position, since the sequence is
    gathered in rank order).

    attn_fn: the local attention, like DeepSpeed's ``local_attention``: called as
    ``attn_fn(q, k, v)`` on the full sequence and this rank's heads, in ``layout`` (q with Hq/W
    heads, k and v with max(Hkv/W, 1)), returning the output in ``layout``. Default:
    ``scaled_dot_product_attention`` with ``is_causal`` and ``scale`` (``enable_gqa`` for GQA)."""
    grp = communication_group(resolve_group(group))
    comm.checked("seq_to_head", grp.name, _check_qkv, q, k, v, grp.size, layout, attn_fn, is_causal, scale)
    seq_dim, head_dim = LAYOUTS[layout], 2
    heads = q.shape[head_dim]
    if k.shape[head_dim] != heads and k.shape[head_dim] < grp.size:  # GQA, fewer kv heads than ranks:
        # every rank gets the kv head of its q heads
        k, v = (t.repeat_interleave(grp.size // k.shape[head_dim], dim=head_dim) for t in (k, v))
    pad = -heads % grp.size  # uneven heads (kv heads == q heads): zero heads up to a multiple of W
    if pad:
        q, k, v = (torch.cat([t, t.new_zeros(*t.shape[:2], pad, t.shape[3])], dim=head_dim) for t in (q, k, v))
    q, k, v = (seq_to_head(t, group, seq_dim=seq_dim, head_dim=head_dim) for t in (q, k, v))
    out = attn_fn(q, k, v) if attn_fn is not None else _sdpa(q, k, v, layout, is_causal, scale)
    out = head_to_seq(out, group, seq_dim=seq_dim, head_dim=head_dim)
    return out.narrow(head_dim, 0, heads) if pad else out
