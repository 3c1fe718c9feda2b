"""Public entry points: ``dispatch``, ``combine``, ``exchange_counts`` and the dispatch handle."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from . import comm, layout, symm_mem
from .groups import LOCAL, Group, pick_backend, resolve_group
from .ops import combine_op, dispatch_op, exchange_counts_op
from .validation import check_combine_args, check_combine_rows, check_dispatch_args


@dataclasses.dataclass(frozen=True)
class DispatchHandle(layout.SlotShape):
    """What ``combine`` needs to undo one ``dispatch``: layout tensors and ints only, so it passes
    through compiled graphs on every supported torch version.

    order: (N,), position: (T, K), send_meta / recv_meta: (W, e + STATUS_COLUMNS), int64.
    num_rows: R, rows of the routed output (padding included).
    """

    order: torch.Tensor
    position: torch.Tensor
    send_meta: torch.Tensor
    recv_meta: torch.Tensor
    num_rows: int
    expert_alignment: int
    group_name: str


def dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    *,
    num_experts: int,
    group: Any = None,
    backend: str = "auto",
    expert_alignment: int = 1,
    buffers: Optional[symm_mem.SymmBuffers] = None,
) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send each token to the ranks that own its top-k experts.

    Args:
        x: (T, H) float tokens of this rank; T may be 0.
        topk_idx: (T, K) integer global expert ids in [0, E); -1 drops the slot.
        num_experts: E, divisible by the group size W; rank r owns experts [r*e, (r+1)*e).
        group: ProcessGroup, 1-D DeviceMesh, or None (default group; no group when
            torch.distributed is not initialised).
        backend: "auto" | "local" | "collective" | "symm_mem" (device-side, no host sync; see
            :mod:`alltoall_ops.symm_mem`). "auto" picks "symm_mem" when ``buffers`` is given.
        expert_alignment: pad each local expert's row group to a multiple of this.
        buffers: a :class:`SymmBuffers` for backend "symm_mem" (required under torch.compile;
            eager calls without it create and cache buffers).

    Returns:
        routed: (R, H) received rows, grouped by local expert, then source rank, then source
            token order; padding rows are zero. With "symm_mem", R is the buffers' fixed
            capacity C and rows past ``tokens_per_expert.sum()`` are zero.
        tokens_per_expert: (e,) int64 rows of ``routed`` per local expert, padding included.
        handle: a :class:`DispatchHandle` for :func:`combine`.

    Example::

        routed, tokens_per_expert, handle = dispatch(x, topk_idx, num_experts=8)
        y = combine(experts(routed, tokens_per_expert), handle, topk_weights)
    """
    if backend == "symm_mem" or (buffers is not None and backend == "auto"):
        return symm_mem.dispatch(x, topk_idx, num_experts=num_experts, group=group,
                                 expert_alignment=expert_alignment, buffers=buffers)
    group = resolve_group(group)
    grp, num_experts = comm.checked("dispatch", group.name, _check_dispatch, x, topk_idx, num_experts, group,
                                    backend, expert_alignment, buffers)
    plan = layout.plan_routing(topk_idx, num_experts, grp.size)
    # One rank receives what it sends: no exchange (and no op call) needed.
    recv_meta = plan.send_meta if grp.name == LOCAL else exchange_counts_op(
        plan.send_meta, grp.name, comm.header("dispatch", *dispatch_fields(x, topk_idx, num_experts, expert_alignment)))
    routed = dispatch_op(
        x, None, plan.order, plan.position, plan.send_meta, recv_meta,
        expert_alignment, grp.name, None,
    )
    recv_counts, _ = layout.split_meta(recv_meta)
    tokens_per_expert = layout.padded_tokens_per_expert(recv_counts, expert_alignment)
    handle = DispatchHandle(
        plan.order, plan.position, plan.send_meta, recv_meta, routed.shape[0],
        expert_alignment, grp.name,
    )
    return routed, tokens_per_expert, handle


def _check_dispatch(
    x, topk_idx, num_experts, group: Group, backend: str, expert_alignment, buffers
) -> tuple[Group, int]:
    """The checks of a non-symm_mem dispatch; returns the backend's group and E as an int."""
    if buffers is not None:
        raise ValueError(f"buffers: only backend='symm_mem' uses buffers, got backend={backend!r}")
    grp = pick_backend(backend, group)
    return grp, check_dispatch_args(x, topk_idx, num_experts, grp.size, expert_alignment)


def dispatch_fields(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, expert_alignment: int) -> list[int]:
    """What the ranks of a dispatch agree on (``comm.FIELDS["dispatch"]``): E, H, dtype, K, alignment."""
    return [num_experts, x.shape[1], comm.dtype_code(x.dtype), topk_idx.shape[1], expert_alignment]


def combine(
    expert_out: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Bring expert outputs back and reduce each token's top-k slots.

    Args:
        expert_out: (R, H) rows in the order ``dispatch`` returned them.
        handle: the :class:`DispatchHandle` of that dispatch.
        topk_weights: (T, K) float router weights, or None for weight 1.

    Returns:
        y: (T, H) in expert_out's dtype, y[t] = sum_k w[t, k] * expert_out[row of (t, k)],
        accumulated in fp32 (fp64 for fp64 inputs) and rounded once; padding rows and -1
        slots contribute nothing.
    """
    if isinstance(handle, symm_mem.SymmDispatchHandle):
        return symm_mem.combine(expert_out, handle, topk_weights)
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle: expected the DispatchHandle returned by dispatch, got {type(handle).__name__}")
    comm.checked("combine", handle.group_name, check_combine_args, expert_out, handle, topk_weights)
    if handle.group_name == LOCAL:  # peers check it inside the op, all agreeing on the verdict
        check_combine_rows(expert_out, handle.num_rows)
    save_returned = topk_weights is not None and topk_weights.requires_grad and torch.is_grad_enabled()
    y, _ = combine_op(
        expert_out, topk_weights, handle.order, handle.position, handle.send_meta,
        handle.recv_meta, handle.expert_alignment, handle.group_name, save_returned,
    )
    return y


def exchange_counts(
    tokens_per_expert_global: torch.Tensor, group: Any = None, backend: str = "auto"
) -> torch.Tensor:
    """(E,) counts this rank sends to each global expert -> (W, e) counts it receives:
    ``out[s, j]`` is what rank s sends to this rank's local expert j."""
    group = resolve_group(group)
    grp = comm.checked("exchange_counts", group.name, _check_counts, tokens_per_expert_global, group, backend)
    E = tokens_per_expert_global.shape[0]
    send = tokens_per_expert_global.to(torch.int64).view(grp.size, -1)
    return exchange_counts_op(send, grp.name, comm.header("exchange_counts", E))


def _check_counts(counts: torch.Tensor, group: Group, backend: str) -> Group:
    grp = pick_backend(backend, group)
    if not isinstance(counts, torch.Tensor) or counts.ndim != 1 or counts.dtype.is_floating_point \
            or counts.dtype == torch.bool:
        got = f"{counts.dtype} of shape {tuple(counts.shape)}" if isinstance(counts, torch.Tensor) else type(counts)
        raise TypeError(f"tokens_per_expert_global: expected a 1-D integer tensor of shape (E,), got {got}")
    if counts.shape[0] % grp.size != 0:
        raise ValueError(
            f"tokens_per_expert_global: E = {counts.shape[0]} is not divisible by the group size {grp.size}"
        )
    return grp
