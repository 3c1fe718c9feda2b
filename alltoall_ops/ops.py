"""The library's custom ops: metadata exchange, dispatch and combine, with fakes and autograd.

Every op that communicates is created through :func:`comm_op`, which records it in the one
registry that the selective-checkpointing policy and the graph summaries read.

Ops take the group as its registered name; ``groups.LOCAL`` ("") selects the local backend (one
rank, no communication). Tensors of a call's routing layout (see ``layout.py``):
    order (N,), position (T, K), send_meta / recv_meta (W, e + STATUS_COLUMNS), all int64.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from . import comm, layout
from .errors import RoutingError
from .groups import LOCAL

_COMM_OPS: list = []


def comm_op(name: str, **kwargs) -> Callable:
    """``torch.library.custom_op("alltoall_ops::<name>")`` for an op that communicates."""

    def register(fn: Callable):
        op = torch.library.custom_op(f"alltoall_ops::{name}", mutates_args=(), **kwargs)(fn)
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


# --------------------------------------------------------------------------------------------
# Host-side helpers (run inside op implementations only)


@dataclasses.dataclass(frozen=True)
class _HostSplits:
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    num_valid: int  # valid slots of this rank (= sum(send_splits))
    num_rows: int  # rows of the expert-major output, padding included


def _read_splits(send_meta: torch.Tensor, recv_meta: torch.Tensor, expert_alignment: int) -> _HostSplits:
    """Host sync: read both metadata matrices, derive the split sizes on the host, and check
    every rank's routing status.

    Raises :class:`RoutingError` (on every rank alike, since all see the same statuses) if any
    rank's ``topk_idx`` held expert ids outside [-1, E)."""
    W = send_meta.shape[0]
    S = layout.STATUS_COLUMNS
    # NB: one small copy and plain Python sums: on a slow host each extra tensor op costs more
    # than the arithmetic on W * (e + S) ints.
    host = torch.cat([send_meta, recv_meta]).tolist()  # (2W, e + S)
    send_counts, recv_counts = [row[:-S] for row in host[:W]], [row[:-S] for row in host[W:]]
    num_experts = W * len(send_counts[0])
    A = expert_alignment
    num_rows = sum((sum(col) + A - 1) // A * A for col in zip(*recv_counts))
    for src, row in enumerate(host[W:]):
        num_bad, lo, hi = row[-S:]
        if num_bad:
            raise RoutingError(
                f"topk_idx on rank {src} of the group holds {num_bad} expert id(s) outside "
                f"[-1, {num_experts}) (min {lo}, max {hi}); expected -1 or a global expert id"
            )
    send_splits = [sum(c) for c in send_counts]
    return _HostSplits(send_splits, [sum(c) for c in recv_counts], sum(send_splits), num_rows)


def combine_fields(expert_out: torch.Tensor, position: torch.Tensor) -> list[int]:
    """What the ranks of a combine agree on (``comm.FIELDS["combine"]``): H, dtype, K."""
    return [expert_out.shape[1], comm.dtype_code(expert_out.dtype), position.shape[1]]


def _rows_are_send_order(group_name: str, expert_alignment: int) -> bool:
    """One rank (local backend) without padding: the routed rows are the valid slots in send
    order, and their number R is all the layout a call needs."""
    return group_name == LOCAL and expert_alignment == 1


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """fp64 if any input is fp64, else fp32: the dtype combine accumulates top-k slots in."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _rows_in_send_order(
    x: torch.Tensor, scale: Optional[torch.Tensor], order: torch.Tensor, position: torch.Tensor, num_valid: int
) -> torch.Tensor:
    """(num_valid, H): row i is ``x[order[i] // K]``, times ``scale.flat[order[i]]`` in fp32
    (fp64) rounded once; the valid slots' rows in send order.

    x: (T, H); scale: (T, K) | None; order: (N,); position: (T, K), its inverse."""
    from .symm_mem import loader

    K = position.shape[1]
    acc_dtype = accumulation_dtype(x.dtype, *(() if scale is None else (scale.dtype,)))
    if loader.use_kernels(x):
        # Token-major: the program of slot (t, k) reads x[t] once for all its K slots and stores
        # it at row position[t, k]; dropped slots (positions >= num_valid) store nothing.
        send = x.new_empty(num_valid, x.shape[1])
        loader.kernels().put_rows(
            x.contiguous(), position.reshape(-1), num_valid, out=send, top_k=K,
            scale=None if scale is None else scale.contiguous(), acc_dtype=acc_dtype,
        )
        return send
    sorted_slots = order[:num_valid]
    send = x.index_select(0, sorted_slots // K)
    if scale is not None:
        slot_scale = scale.reshape(-1).index_select(0, sorted_slots)
        send = (send.to(acc_dtype) * slot_scale.to(acc_dtype)[:, None]).to(x.dtype)
    return send


def _weighted_slot_sum(
    returned: torch.Tensor, position: torch.Tensor, weights: Optional[torch.Tensor], num_valid: int
) -> torch.Tensor:
    """y[t] = sum_k w[t, k] * returned[position[t, k]] over the valid slots (position < num_valid),
    accumulated in fp32 (fp64), rounded once.

    returned: (n, H) rows in send order, num_valid <= n <= N, the rows after the valid ones
    unread. A dropped slot (position >= num_valid) adds nothing, even with a NaN / inf weight.
    position: (T, K); weights: (T, K) | None. Returns (T, H) in returned's dtype. Slots are added
    in k order: deterministic."""
    T, K = position.shape
    H = returned.shape[1]
    acc_dtype = accumulation_dtype(returned.dtype, *(() if weights is None else (weights.dtype,)))
    from .symm_mem import loader

    if loader.use_kernels(returned):
        # One pass: each returned row read once, y written once (the symm_mem reduction kernel).
        y = returned.new_empty(T, H)
        loader.kernels().combine_reduce(returned, position, None, weights, y, None, acc_dtype, num_valid)
        return y
    acc = torch.zeros(T, H, dtype=acc_dtype, device=returned.device)
    for k in range(K if num_valid > 0 else 0):
        slot = position[:, k]
        rows = returned.index_select(0, slot.clamp(max=num_valid - 1)).to(acc_dtype)  # (T, H)
        if weights is not None:
            rows = rows * weights[:, k : k + 1].to(acc_dtype)
        acc += torch.where((slot < num_valid)[:, None], rows, 0)  # masks the product, NaN weights too
    return acc.to(returned.dtype)


def _slot_dot(
    returned: torch.Tensor, position: torch.Tensor, v: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(T, K): out[t, k] = <v[t], returned[position[t, k]]>, in fp32 (fp64) then ``out_dtype``.

    returned: (N, H) rows in send order; position: (T, K); v: (T, H). The gradient of a slot's
    scale (weight) is this dot product with the rows the slot sent or received."""
    acc_dtype = accumulation_dtype(returned.dtype, v.dtype, out_dtype)
    v = v.to(acc_dtype)
    dots = [
        (v * returned.index_select(0, position[:, k]).to(acc_dtype)).sum(-1)
        for k in range(position.shape[1])
    ]
    return torch.stack(dots, dim=1).to(out_dtype)


# --------------------------------------------------------------------------------------------
# exchange_counts


@comm_op("exchange_counts")
def exchange_counts_op(send: torch.Tensor, group_name: str, header: list[int]) -> torch.Tensor:
    """(W, c) int64, row r sent to rank r -> (W, c), row s received from rank s.

    header: ``[op code, *fields]`` (``comm.FIELDS``) that every rank must agree on; the ranks
    check it (:func:`comm.agree`) before the counts move, so a disagreement on c is an error
    on every rank, never a mismatched exchange."""
    out = torch.empty_like(send)
    if group_name == LOCAL:
        out.copy_(send)
    else:
        comm.agree(comm.op_name(header[0]), group_name, header[1:])
        comm.all_to_all("exchange_counts", group_name, out, send)
    return out


@exchange_counts_op.register_fake
def _(send, group_name, header):
    # NB: every rank sends one equal-sized row to every rank, so the shape is the input's.
    return torch.empty_like(send)


# --------------------------------------------------------------------------------------------
# dispatch


@comm_op("dispatch")
def dispatch_op(
    x: torch.Tensor,
    scale: Optional[torch.Tensor],
    order: torch.Tensor,
    position: torch.Tensor,
    send_meta: torch.Tensor,
    recv_meta: torch.Tensor,
    expert_alignment: int,
    group_name: str,
    num_rows: Optional[int],
) -> torch.Tensor:
    """(T, H) tokens -> (R, H) rows grouped by local expert, then source rank, then token.

    scale: (T, K) | None, multiplies each slot's row (in fp32, rounded once) before sending.
    num_rows: R when already known (it is in backward), else None. Padding rows are zero."""
    if num_rows is not None and _rows_are_send_order(group_name, expert_alignment):
        # One rank, no padding, R known: the valid slots' rows in send order, no host sync.
        return _rows_in_send_order(x, scale, order, position, num_rows)
    splits = _read_splits(send_meta, recv_meta, expert_alignment)
    if num_rows is not None and num_rows != splits.num_rows:
        raise ValueError(f"dispatch: expected {num_rows} routed rows, the layout gives {splits.num_rows}")
    send = _rows_in_send_order(x, scale, order, position, splits.num_valid)
    recv_counts, _ = layout.split_meta(recv_meta)
    if group_name == LOCAL:
        received = send  # one rank: what it sends is what it receives
    else:
        received = x.new_empty(sum(splits.recv_splits), x.shape[1])  # rank-major
        comm.all_to_all("dispatch", group_name, received, send, splits.recv_splits, splits.send_splits)
    if splits.num_rows == received.shape[0] and recv_counts.shape[0] == 1:
        return received  # one rank, no padding: rank-major is expert-major
    routed = x.new_zeros(splits.num_rows, x.shape[1])
    routed.index_copy_(0, layout.expert_major_rows(recv_counts, expert_alignment), received)
    return routed


@dispatch_op.register_fake
def _(x, scale, order, position, send_meta, recv_meta, expert_alignment, group_name, num_rows):
    # NB: R depends on what the peers send, known only once the metadata is read on the host.
    if num_rows is None:
        num_rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(num_rows, x.shape[1])


def _dispatch_setup_context(ctx, inputs, output):
    x, scale, ctx.order, ctx.position, ctx.send_meta, ctx.recv_meta, ctx.alignment, ctx.group_name, _ = inputs
    ctx.save_for_backward(scale, x if scale is not None and scale.requires_grad else None)


def _dispatch_backward(ctx, grad_routed):
    scale, x = ctx.saved_tensors
    # The adjoint of dispatch is combine, weighted by the same per-slot scale.
    grad_x, returned = combine_op(
        grad_routed, scale, ctx.order, ctx.position, ctx.send_meta, ctx.recv_meta,
        ctx.alignment, ctx.group_name, x is not None,
    )
    grad_scale = None if x is None else _slot_dot(returned, ctx.position, x, scale.dtype)
    return grad_x, grad_scale, None, None, None, None, None, None, None


dispatch_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup_context)


# --------------------------------------------------------------------------------------------
# combine


@comm_op("combine")
def combine_op(
    expert_out: torch.Tensor,
    weights: Optional[torch.Tensor],
    order: torch.Tensor,
    position: torch.Tensor,
    send_meta: torch.Tensor,
    recv_meta: torch.Tensor,
    expert_alignment: int,
    group_name: str,
    save_returned: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, H) expert outputs in dispatch order -> y (T, H) and the returned rows.

    y[t] = sum_k weights[t, k] * expert_out[row of slot (t, k)] (fp32 accumulation).
    returned: with ``save_returned``, (N, H), each valid slot's row in send order and zero rows
    after them (for the weights' gradient); else (0, H).

    One rank without padding (local backend, expert_alignment 1): expert_out's rows are the
    valid slots in send order, and ``alltoall_ops.combine`` has checked their number against
    the dispatch handle, so nothing is read on the host (no sync)."""
    nothing_returned = expert_out.new_empty(0, expert_out.shape[1])
    expert_major = None  # one rank, no padding: expert-major is rank-major
    if _rows_are_send_order(group_name, expert_alignment):
        num_valid = expert_out.shape[0]
    else:
        splits = _read_splits(send_meta, recv_meta, expert_alignment)
        problem = None
        if expert_out.shape[0] != splits.num_rows:
            problem = ValueError(
                f"combine: expert_out has {expert_out.shape[0]} rows but its handle's dispatch "
                f"returned {splits.num_rows}; pass the expert outputs of that same dispatch"
            )
        if group_name == LOCAL:
            if problem is not None:
                raise problem
        else:
            comm.agree("combine", group_name, combine_fields(expert_out, position), problem)
        recv_counts, _ = layout.split_meta(recv_meta)
        if splits.num_rows != sum(splits.recv_splits) or recv_counts.shape[0] != 1:
            expert_major = layout.expert_major_rows(recv_counts, expert_alignment)
        num_valid = splits.num_valid
    if group_name == LOCAL and expert_major is None and not save_returned:
        # The expert outputs already are the valid slots' rows in send order: nothing moves.
        return _weighted_slot_sum(expert_out, position, weights, num_valid), nothing_returned
    returned = expert_out.new_empty(order.shape[0], expert_out.shape[1])
    returned[num_valid:].zero_()  # dropped slots read zero rows
    received = returned[:num_valid]
    if group_name == LOCAL:  # gather straight into the returned rows
        if expert_major is None:
            received.copy_(expert_out)
        else:
            torch.index_select(expert_out, 0, expert_major, out=received)
    else:
        rank_major = expert_out if expert_major is None else expert_out.index_select(0, expert_major)
        comm.all_to_all("combine", group_name, received, rank_major, splits.send_splits, splits.recv_splits)
    return _weighted_slot_sum(returned, position, weights, num_valid), returned if save_returned else nothing_returned


@combine_op.register_fake
def _(expert_out, weights, order, position, send_meta, recv_meta, expert_alignment, group_name, save_returned):
    # NB: both shapes are static: T from position, N from order (0 rows when not saved).
    H = expert_out.shape[1]
    returned_rows = order.shape[0] if save_returned else 0
    return expert_out.new_empty(position.shape[0], H), expert_out.new_empty(returned_rows, H)


def _combine_setup_context(ctx, inputs, output):
    (_, weights, ctx.order, ctx.position, ctx.send_meta, ctx.recv_meta, ctx.alignment, ctx.group_name,
     ctx.save_returned) = inputs
    ctx.num_rows = inputs[0].shape[0]
    ctx.set_materialize_grads(False)  # `returned` gets a gradient only in double backward
    ctx.save_for_backward(weights, output[1] if ctx.save_returned else None)


def _combine_backward(ctx, grad_y, grad_returned):
    weights, returned = ctx.saved_tensors
    plan = (ctx.send_meta, ctx.recv_meta, ctx.alignment, ctx.group_name, ctx.num_rows)
    grads_expert_out = []
    if ctx.needs_input_grad[0] and grad_y is not None:
        # The adjoint of combine is dispatch with each slot's row scaled by its weight.
        grads_expert_out.append(dispatch_op(grad_y, weights, ctx.order, ctx.position, *plan))
    if ctx.needs_input_grad[0] and grad_returned is not None and ctx.save_returned:
        # `returned` holds rows already in send order: dispatch them as K = 1 "tokens".
        in_send_order = torch.arange(ctx.order.shape[0], device=ctx.order.device)
        grads_expert_out.append(
            dispatch_op(grad_returned, None, in_send_order, in_send_order[:, None], *plan)
        )
    grad_expert_out = sum(grads_expert_out[1:], grads_expert_out[0]) if grads_expert_out else None
    grad_weights = None
    if ctx.needs_input_grad[1] and grad_y is not None:
        if returned is None:
            raise RuntimeError("combine: the weights need a gradient, but the forward ran with save_returned=False")
        grad_weights = _slot_dot(returned, ctx.position, grad_y, weights.dtype)
    return grad_expert_out, grad_weights, None, None, None, None, None, None, None


combine_op.register_autograd(_combine_backward, setup_context=_combine_setup_context)
