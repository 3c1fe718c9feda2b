"""Entry points of the symm_mem backend (called by alltoall_ops.dispatch / combine): the
routing on the device, ``SymmDispatchHandle``, cached buffers for eager calls."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import layout
from .._compat import is_compiling
from ..groups import LOCAL, Group, process_group, resolve_group
from ..validation import check_combine_args, check_dispatch_args
from .buffers import SymmBuffers
from .ops import symm_combine_op, symm_dispatch_op, symm_exchange_meta_op


# --------------------------------------------------------------------------------------------
# Routing on the device (plain tensor maths, traced by torch.compile)


@dataclasses.dataclass(frozen=True)
class SymmRoute:
    """slot_dst: (N,) int64, destination code ``rank * C + row`` of each slot t * K + k, -1 where
    nothing is sent (a dropped slot, or a row past capacity); tokens_per_expert: (e,) rows of
    ``routed`` per local expert (padding included, cut at C); dropped: (W,) valid slots that
    did not fit in each rank's capacity."""

    slot_dst: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor


def route(meta: torch.Tensor, topk_idx: torch.Tensor, position: torch.Tensor, bufs: SymmBuffers,
          expert_alignment: int) -> SymmRoute:
    """Where every slot of this rank lands, from the exchanged metadata (W, L).

    Destination row of the slot at send position i for global expert g (owned by rank r = g // e):
    ``expert_start_r[g] + rows of g from lower source ranks + (i - first position of g here)``,
    which is the collective backend's expert-major, source-rank, send-order layout."""
    W, E, e, C = bufs.world_size, bufs.num_experts, bufs.num_local_experts, bufs.capacity
    A = expert_alignment
    counts = meta[:, :E]  # (W, E) counts[s, g]: slots rank s sends to expert g
    padded = ((counts.sum(0) + A - 1) // A * A).view(W, e)  # (W, e) group sizes on each owner
    expert_start = (padded.cumsum(1) - padded).view(E)  # (E,) first row of g's group on its owner
    earlier = counts.cumsum(0) - counts  # (W, E) rows of g from lower source ranks
    block_start = expert_start + earlier  # (W, E) first row of block (s, g) on g's owner
    mine = counts[bufs.rank]
    first_pos = mine.cumsum(0) - mine  # (E,) first send position of expert g on this rank
    i = position.reshape(-1)  # (N,) send position of each slot
    g = topk_idx.reshape(-1).to(torch.int64)  # (N,) expert of each slot
    valid = (g >= 0) & (g < E) & (i < bufs.max_slots)
    g = g.clamp(0, E - 1)
    row = block_start[bufs.rank].index_select(0, g) + i - first_pos.index_select(0, g)
    slot_dst = torch.where(valid & (row < C), (g // e) * C + row, torch.full_like(row, -1))
    own_start = expert_start.view(W, e)[bufs.rank]
    tokens_per_expert = torch.minimum(padded[bufs.rank], (C - own_start).clamp(min=0))  # (e,)
    past = (block_start + counts - C).clamp(min=0)  # (W, E) rows of block (s, g) past C
    dropped = torch.minimum(past, counts).sum(0).view(W, e).sum(1)  # (W,)
    return SymmRoute(slot_dst, tokens_per_expert, dropped)


# --------------------------------------------------------------------------------------------
# Public entry points (called by alltoall_ops.dispatch / combine)


@dataclasses.dataclass(frozen=True)
class SymmDispatchHandle(layout.SlotShape):
    """What ``combine`` needs to undo one symm_mem ``dispatch``; tensors, ints and the buffers.

    position (T, K): each slot's send position; meta (W, L): every rank's counts;
    slot_dst (N,): destination of each slot; row_src (C,): source of each routed row;
    dropped (W,): slots past each rank's capacity (overflow='drop'); num_rows: C."""

    position: torch.Tensor
    meta: torch.Tensor
    slot_dst: torch.Tensor
    row_src: torch.Tensor
    dropped: torch.Tensor
    buffers: SymmBuffers
    num_rows: int
    expert_alignment: int


_AUTO_BUFFERS: dict[tuple, SymmBuffers] = {}


def _max_over_ranks(value: int, grp: Group, device: torch.device) -> int:
    """Host sync: the largest ``value`` over the group (one small all-reduce)."""
    if grp.size == 1:
        return value
    pg = process_group(grp.name)
    on = device if dist.get_backend(pg) != "gloo" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    return int(t)


def cached_buffers(x: torch.Tensor, top_k: int, num_experts: int, grp: Group, expert_alignment: int) -> SymmBuffers:
    """Eager convenience: buffers cached per (group, H, dtype, device), created sized from the
    largest T over the ranks and re-created larger when a call needs more. Collective; costs one
    small all-reduce per call (a host sync), which is why compiled code must pass ``buffers=``."""
    if is_compiling():
        raise RuntimeError(
            "dispatch(backend='symm_mem') under torch.compile needs buffers=: create "
            "alltoall_ops.SymmBuffers(max_tokens_per_rank=..., hidden=..., top_k=..., num_experts=..., "
            "dtype=..., device=..., group=...) once, outside the compiled region, and pass it in"
        )
    T, H = x.shape
    t_max = _max_over_ranks(T, grp, x.device)
    key = (grp.name, H, x.dtype, x.device)
    bufs = _AUTO_BUFFERS.get(key)
    if (bufs is None or bufs.max_tokens_per_rank < t_max or bufs.top_k < top_k
            or bufs.num_experts != num_experts or bufs.expert_alignment < expert_alignment):
        t_max = max(t_max, 1, bufs.max_tokens_per_rank if bufs is not None else 1)
        group = None if grp.name == LOCAL else process_group(grp.name)
        bufs = SymmBuffers(t_max, H, top_k, num_experts, x.dtype, x.device, group,
                           expert_alignment=expert_alignment)
        _AUTO_BUFFERS[key] = bufs
    return bufs


def _check_buffers_fit(
    bufs: SymmBuffers, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, group: Any
) -> None:
    """Static checks (shapes, dtypes: the same on every rank of an SPMD program)."""
    if group is not None and resolve_group(group).name != bufs.group_name:
        raise ValueError(
            f"group: the buffers were created for group {bufs.group_name!r}, got group "
            f"{resolve_group(group).name!r}; pass group=None or the buffers' group"
        )
    if x.dtype != bufs.dtype or x.shape[1] != bufs.hidden or x.device != bufs.device:
        raise ValueError(
            f"x: the buffers hold {bufs.dtype} rows of H = {bufs.hidden} on {bufs.device}, got "
            f"{x.dtype} of shape {tuple(x.shape)} on {x.device}"
        )
    if topk_idx.shape[1] > bufs.top_k:
        raise ValueError(f"topk_idx: the buffers were sized for top_k = {bufs.top_k}, got K = {topk_idx.shape[1]}")
    if num_experts != bufs.num_experts:
        raise ValueError(f"num_experts: the buffers were created for E = {bufs.num_experts}, got {num_experts}")


def dispatch(
    x: torch.Tensor, topk_idx: torch.Tensor, *, num_experts: int, group: Any, expert_alignment: int,
    buffers: Optional[SymmBuffers],
) -> tuple[torch.Tensor, torch.Tensor, SymmDispatchHandle]:
    """``alltoall_ops.dispatch(..., backend="symm_mem")``: routed (C, H), tokens_per_expert (e,),
    handle. The first ``tokens_per_expert.sum()`` rows of routed are the collective backend's
    routed rows; the rest are zero."""
    if buffers is not None and not isinstance(buffers, SymmBuffers):
        raise TypeError(f"buffers: expected alltoall_ops.SymmBuffers, got {type(buffers).__name__}")
    if buffers is None:
        grp = resolve_group(group)
        check_dispatch_args(x, topk_idx, num_experts, grp.size, expert_alignment)
        buffers = cached_buffers(x, topk_idx.shape[1], num_experts, grp, expert_alignment)
    else:
        check_dispatch_args(x, topk_idx, num_experts, buffers.world_size, expert_alignment)
    _check_buffers_fit(buffers, x, topk_idx, num_experts, group)
    W, e = buffers.world_size, buffers.num_local_experts
    plan = layout.plan_routing(topk_idx, num_experts, W)
    n_slots = torch.full((1,), topk_idx.numel(), dtype=torch.int64, device=x.device)
    send_row = torch.cat([plan.send_meta[:, :e].reshape(-1), plan.send_meta[0, e:], n_slots])  # (L,)
    meta = symm_exchange_meta_op(send_row, buffers, expert_alignment)
    r = route(meta, topk_idx, plan.position, buffers, expert_alignment)
    routed, row_src = symm_dispatch_op(x, None, plan.position, r.slot_dst, buffers)
    handle = SymmDispatchHandle(plan.position, meta, r.slot_dst, row_src, r.dropped,
                                buffers, buffers.capacity, expert_alignment)
    return routed, r.tokens_per_expert, handle


def combine(expert_out: torch.Tensor, handle: SymmDispatchHandle, topk_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``alltoall_ops.combine`` for a symm_mem handle: y (T, H); rows of expert_out that
    dispatch did not fill are ignored."""
    check_combine_args(expert_out, handle, topk_weights)
    bufs = handle.buffers
    if tuple(expert_out.shape) != (bufs.capacity, bufs.hidden) or expert_out.dtype != bufs.dtype:
        raise ValueError(
            f"expert_out: expected the {bufs.dtype} shape (C, H) = ({bufs.capacity}, {bufs.hidden}) of "
            f"routed, got {expert_out.dtype} of shape {tuple(expert_out.shape)}"
        )
    save_returned = topk_weights is not None and topk_weights.requires_grad and torch.is_grad_enabled()
    y, _ = symm_combine_op(expert_out, topk_weights, handle.position, handle.slot_dst, handle.row_src,
                           bufs, save_returned)
    return y
