"""Entry points of the symm_mem backend (called by alltoall_ops.dispatch / combine): the
routing on the device, ``SymmDispatchHandle``, cached buffers for eager calls."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .. import comm, layout
from .._compat import is_compiling
from ..errors import CapacityError, PeerInputError
from ..groups import LOCAL, Group, process_group, resolve_group
from ..ops import combine_fields
from ..validation import check_combine_args, check_dispatch_args
from .buffers import FAILED, META_EXTRA, SymmBuffers
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


def cached_buffers(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, grp: Group,
                   expert_alignment: int) -> SymmBuffers:
    """Eager convenience: buffers cached per (group, H, dtype, device), created sized from the
    largest T, K and expert_alignment over the ranks and re-created larger when a call needs
    more, on every rank alike. Collective: the arguments' checks and the sizes go through one
    agreement per call (a host sync), which is why compiled code must pass ``buffers=``."""
    if is_compiling():
        raise RuntimeError(
            "dispatch(backend='symm_mem') under torch.compile needs buffers=: create "
            "alltoall_ops.SymmBuffers(max_tokens_per_rank=..., hidden=..., top_k=..., num_experts=..., "
            "dtype=..., device=..., group=...) once, outside the compiled region, and pass it in"
        )
    num_experts = comm.checked("symm_buffers", grp.name, check_dispatch_args, x, topk_idx, num_experts, grp.size,
                               expert_alignment)
    (T, H), K = x.shape, topk_idx.shape[1]
    sizes = [T, K, expert_alignment]
    if grp.name != LOCAL:  # equal E, H and dtype; the largest T, K and alignment
        fields = comm.agree("symm_buffers", grp.name, [num_experts, H, comm.dtype_code(x.dtype), *sizes], equal=3)
        sizes = [max(row[3 + i] for row in fields) for i in range(3)]
    t_max, k_max, a_max = sizes
    key = (grp.name, H, x.dtype, x.device)
    bufs = _AUTO_BUFFERS.get(key)
    if (bufs is None or bufs.max_tokens_per_rank < t_max or bufs.top_k < k_max
            or bufs.num_experts != num_experts or bufs.expert_alignment < a_max):
        if bufs is not None:
            t_max, k_max, a_max = (max(t_max, bufs.max_tokens_per_rank), max(k_max, bufs.top_k),
                                   max(a_max, bufs.expert_alignment))
        group = None if grp.name == LOCAL else process_group(grp.name)
        bufs = SymmBuffers(max(t_max, 1), H, k_max, num_experts, x.dtype, x.device, group, expert_alignment=a_max)
        _AUTO_BUFFERS[key] = bufs
    return bufs


def _check_buffers_fit(
    bufs: SymmBuffers, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, group: Any, expert_alignment: int
) -> int:
    """The dispatch's checks against its buffers; returns E as an int."""
    num_experts = check_dispatch_args(x, topk_idx, num_experts, bufs.world_size, expert_alignment)
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
        raise CapacityError(f"topk_idx: the buffers were sized for top_k = {bufs.top_k}, got K = {topk_idx.shape[1]}")
    if num_experts != bufs.num_experts:
        raise ValueError(f"num_experts: the buffers were created for E = {bufs.num_experts}, got {num_experts}")
    if expert_alignment > bufs.expert_alignment:
        raise CapacityError(
            f"expert_alignment: the buffers were sized for expert_alignment <= {bufs.expert_alignment}, got "
            f"{expert_alignment}; create SymmBuffers with expert_alignment={expert_alignment}"
        )
    return num_experts


def _checked(bufs: SymmBuffers, check, *args):
    """``check(*args)``; on a group, a rank whose checks raise sends a failure row through the
    metadata exchange its peers wait in, so every rank raises (its peers a PeerInputError)."""
    if bufs.world_size == 1 or is_compiling():
        return check(*args)
    try:
        return check(*args)
    except (TypeError, ValueError) as exc:
        failure = torch.zeros(bufs.meta_columns, dtype=torch.int64, device=bufs.device)
        failure[bufs.num_experts + FAILED] = 1
        bufs._own_error = f"{type(exc).__name__}: {exc}"
        try:
            symm_exchange_meta_op(failure, bufs, 0)
        except PeerInputError:
            pass  # what the peers raise; this rank raises its own error
        finally:
            bufs._own_error = None
        raise


def dispatch(
    x: torch.Tensor, topk_idx: torch.Tensor, *, num_experts: int, group: Any, expert_alignment: int,
    buffers: Optional[SymmBuffers],
) -> tuple[torch.Tensor, torch.Tensor, SymmDispatchHandle]:
    """``alltoall_ops.dispatch(..., backend="symm_mem")``: routed (C, H), tokens_per_expert (e,),
    handle. The first ``tokens_per_expert.sum()`` rows of routed are the collective backend's
    routed rows; the rest are zero."""
    if buffers is None:
        buffers = cached_buffers(x, topk_idx, num_experts, resolve_group(group), expert_alignment)
    elif not isinstance(buffers, SymmBuffers):
        raise TypeError(f"buffers: expected alltoall_ops.SymmBuffers, got {type(buffers).__name__}")
    num_experts = _checked(buffers, _check_buffers_fit, buffers, x, topk_idx, num_experts, group, expert_alignment)
    W, e = buffers.world_size, buffers.num_local_experts
    plan = layout.plan_routing(topk_idx, num_experts, W)
    # (L,): counts, routing status, then N_SLOTS, ALIGNMENT, FAILED (0) and CALL (set by the op).
    # NB: filled on the device, not copied from the host: eager calls stay CUDA-graph capturable.
    header = torch.zeros(META_EXTRA - layout.STATUS_COLUMNS, dtype=torch.int64, device=x.device)
    header[0].fill_(topk_idx.numel())
    header[1].fill_(expert_alignment)
    send_row = torch.cat([plan.send_meta[:, :e].reshape(-1), plan.send_meta[0, e:], header])
    meta = symm_exchange_meta_op(send_row, buffers, expert_alignment)
    r = route(meta, topk_idx, plan.position, buffers, expert_alignment)
    routed, row_src = symm_dispatch_op(x, None, plan.position, r.slot_dst, buffers)
    handle = SymmDispatchHandle(plan.position, meta, r.slot_dst, row_src, r.dropped,
                                buffers, buffers.capacity, expert_alignment)
    return routed, r.tokens_per_expert, handle


def _check_combine(expert_out: torch.Tensor, handle: SymmDispatchHandle, topk_weights: Optional[torch.Tensor]) -> None:
    check_combine_args(expert_out, handle, topk_weights)
    bufs = handle.buffers
    if tuple(expert_out.shape) != (bufs.capacity, bufs.hidden) or expert_out.dtype != bufs.dtype:
        raise ValueError(
            f"expert_out: expected the {bufs.dtype} shape (C, H) = ({bufs.capacity}, {bufs.hidden}) of "
            f"routed, got {expert_out.dtype} of shape {tuple(expert_out.shape)}"
        )


def combine(expert_out: torch.Tensor, handle: SymmDispatchHandle, topk_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``alltoall_ops.combine`` for a symm_mem handle: y (T, H); rows of expert_out that
    dispatch did not fill are ignored."""
    bufs = handle.buffers
    if comm.debug() and bufs.world_size > 1 and not is_compiling():
        # Debug mode: the ranks agree on every check (a host exchange) before the payload moves.
        comm.checked("combine", bufs.group_name, _check_combine, expert_out, handle, topk_weights)
        comm.agree("combine", bufs.group_name, combine_fields(expert_out, handle.position))
    else:  # a rank that raises here leaves its peers in the op's barrier until the deadline
        _check_combine(expert_out, handle, topk_weights)
    save_returned = topk_weights is not None and topk_weights.requires_grad and torch.is_grad_enabled()
    y, _ = symm_combine_op(expert_out, topk_weights, handle.position, handle.slot_dst, handle.row_src,
                           bufs, save_returned)
    return y
