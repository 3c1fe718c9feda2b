"""The ``collective`` backend: dispatch / combine over a process group with functional-collective
style all-to-alls (NCCL on GPUs, gloo on CPUs), and its custom ops, which the ``local`` backend
runs on a group of one rank (no exchange).

A dispatch reads its split sizes on the host once per op (``layout.read_splits``). Its routing
layout travels as a :class:`Route` (the ops' arguments after the payload):
    order_N (N,), position_TK (T, K), send_meta_WL / recv_meta_WL (W, e + STATUS_COLUMNS), all
    int64, expert_alignment, group_name. W = send_meta_WL.shape[0]; W == 1 exchanges nothing.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch

from .. import comm, layout
from ..groups import LOCAL, Group
from ..rows import rows_in_send_order, slot_dot, weighted_slot_sum
from ..validation import check_combine_args, check_combine_rows, check_dispatch_args
from .base import Backend, DispatchHandle, save_returned


class Route(NamedTuple):
    """One dispatch's routing layout on this rank, in the ops' argument order."""

    order_N: torch.Tensor
    position_TK: torch.Tensor
    send_meta_WL: torch.Tensor
    recv_meta_WL: torch.Tensor
    expert_alignment: int
    group_name: str


def _rows_are_send_order(send_meta_WL: torch.Tensor, expert_alignment: int) -> bool:
    """One rank without padding: the routed rows are the valid slots in send order, and their
    number R is all the layout a call needs."""
    return send_meta_WL.shape[0] == 1 and expert_alignment == 1


# --------------------------------------------------------------------------------------------
# exchange_counts


@comm.comm_op("exchange_counts")
def exchange_counts_op(send_Wc: torch.Tensor, group_name: str, header: list[int]) -> torch.Tensor:
    """(W, c) int64, row r sent to rank r -> (W, c), row s received from rank s.

    header: ``[op code, *fields]`` (``comm.FIELDS``) that every rank must agree on; the ranks
    check it (:func:`comm.agree`) before the counts move, so a disagreement on c is an error
    on every rank, never a mismatched exchange."""
    recv_Wc = torch.empty_like(send_Wc)
    if send_Wc.shape[0] == 1:
        recv_Wc.copy_(send_Wc)
    else:
        comm.agree(comm.op_name(header[0]), group_name, header[1:])
        comm.all_to_all("exchange_counts", group_name, recv_Wc, send_Wc)
    return recv_Wc


@exchange_counts_op.register_fake
def _(send_Wc, group_name, header):
    # NB: every rank sends one equal-sized row to every rank, so the shape is the input's.
    return torch.empty_like(send_Wc)


# --------------------------------------------------------------------------------------------
# dispatch


@comm.comm_op("dispatch")
def dispatch_op(
    x_TH: torch.Tensor,
    scale_TK: Optional[torch.Tensor],
    order_N: torch.Tensor,
    position_TK: torch.Tensor,
    send_meta_WL: torch.Tensor,
    recv_meta_WL: torch.Tensor,
    expert_alignment: int,
    group_name: str,
    num_rows: Optional[int],
) -> torch.Tensor:
    """(T, H) tokens -> (R, H) rows grouped by local expert, then source rank, then token.

    scale_TK: multiplies each slot's row (in fp32, rounded once) before sending.
    num_rows: R when already known (it is in backward), else None. Padding rows are zero."""
    if num_rows is not None and _rows_are_send_order(send_meta_WL, expert_alignment):
        # One rank, no padding, R known: the valid slots' rows in send order, no host sync.
        return rows_in_send_order(x_TH, scale_TK, order_N, position_TK, num_rows)
    splits = layout.read_splits(send_meta_WL, recv_meta_WL, expert_alignment)
    if num_rows is not None and num_rows != splits.num_rows:
        raise ValueError(f"dispatch: expected {num_rows} routed rows, the layout gives {splits.num_rows}")
    send_VH = rows_in_send_order(x_TH, scale_TK, order_N, position_TK, splits.num_valid)
    recv_counts_We, _ = layout.split_meta(recv_meta_WL)
    if recv_counts_We.shape[0] == 1:
        received_H = send_VH  # one rank: what it sends is what it receives
    else:
        received_H = x_TH.new_empty(sum(splits.recv_splits), x_TH.shape[1])  # rank-major
        comm.all_to_all("dispatch", group_name, received_H, send_VH, splits.recv_splits, splits.send_splits)
    if splits.num_rows == received_H.shape[0] and recv_counts_We.shape[0] == 1:
        return received_H  # one rank, no padding: rank-major is expert-major
    routed_RH = x_TH.new_zeros(splits.num_rows, x_TH.shape[1])
    routed_RH.index_copy_(0, layout.expert_major_rows(recv_counts_We, expert_alignment), received_H)
    return routed_RH


@dispatch_op.register_fake
def _(x_TH, scale_TK, order_N, position_TK, send_meta_WL, recv_meta_WL, expert_alignment, group_name, num_rows):
    # NB: R depends on what the peers send, known only once the metadata is read on the host.
    if num_rows is None:
        num_rows = torch.library.get_ctx().new_dynamic_size()
    return x_TH.new_empty(num_rows, x_TH.shape[1])


def _dispatch_setup_context(ctx, inputs, output):
    x_TH, scale_TK = inputs[:2]
    ctx.route = Route(*inputs[2:8])
    ctx.save_for_backward(scale_TK, x_TH if scale_TK is not None and scale_TK.requires_grad else None)


def _dispatch_backward(ctx, grad_routed_RH):
    scale_TK, x_TH = ctx.saved_tensors
    # The adjoint of dispatch is combine, weighted by the same per-slot scale.
    grad_x_TH, returned_NH = combine_op(grad_routed_RH, scale_TK, *ctx.route, x_TH is not None)
    grad_scale_TK = None if x_TH is None else slot_dot(returned_NH, ctx.route.position_TK, x_TH, scale_TK.dtype)
    return grad_x_TH, grad_scale_TK, None, None, None, None, None, None, None


dispatch_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup_context)


# --------------------------------------------------------------------------------------------
# combine


@comm.comm_op("combine")
def combine_op(
    expert_out_RH: torch.Tensor,
    weights_TK: Optional[torch.Tensor],
    order_N: torch.Tensor,
    position_TK: torch.Tensor,
    send_meta_WL: torch.Tensor,
    recv_meta_WL: torch.Tensor,
    expert_alignment: int,
    group_name: str,
    save_returned: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, H) expert outputs in dispatch order -> y (T, H) and the returned rows.

    y[t] = sum_k weights[t, k] * expert_out[row of slot (t, k)] (fp32 accumulation).
    returned: with ``save_returned``, (N, H), each valid slot's row in send order and zero rows
    after them (for the weights' gradient); else (0, H).

    One rank without padding (local backend, expert_alignment 1): expert_out's rows are the
    valid slots in send order, and the handle has checked their number, so nothing is read on
    the host (no sync)."""
    H = expert_out_RH.shape[1]
    nothing_returned = expert_out_RH.new_empty(0, H)
    one_rank = send_meta_WL.shape[0] == 1
    expert_major_R = None  # one rank, no padding: expert-major is rank-major
    if _rows_are_send_order(send_meta_WL, expert_alignment):
        num_valid = expert_out_RH.shape[0]
    else:
        splits = layout.read_splits(send_meta_WL, recv_meta_WL, expert_alignment)
        problem = None
        if expert_out_RH.shape[0] != splits.num_rows:
            problem = ValueError(
                f"combine: expert_out has {expert_out_RH.shape[0]} rows but its handle's dispatch "
                f"returned {splits.num_rows}; pass the expert outputs of that same dispatch"
            )
        if one_rank:
            if problem is not None:
                raise problem
        else:
            comm.agree("combine", group_name, comm.combine_fields(expert_out_RH, position_TK.shape[1]), problem)
        recv_counts_We, _ = layout.split_meta(recv_meta_WL)
        if splits.num_rows != sum(splits.recv_splits) or not one_rank:
            expert_major_R = layout.expert_major_rows(recv_counts_We, expert_alignment)
        num_valid = splits.num_valid
    if one_rank and expert_major_R is None and not save_returned:
        # The expert outputs already are the valid slots' rows in send order: nothing moves.
        return weighted_slot_sum(expert_out_RH, position_TK, weights_TK, num_valid), nothing_returned
    returned_NH = expert_out_RH.new_empty(order_N.shape[0], H)
    returned_NH[num_valid:].zero_()  # dropped slots read zero rows
    received_VH = returned_NH[:num_valid]
    if one_rank:  # gather straight into the returned rows
        if expert_major_R is None:
            received_VH.copy_(expert_out_RH)
        else:
            torch.index_select(expert_out_RH, 0, expert_major_R, out=received_VH)
    else:
        rank_major = expert_out_RH if expert_major_R is None else expert_out_RH.index_select(0, expert_major_R)
        comm.all_to_all("combine", group_name, received_VH, rank_major, splits.send_splits, splits.recv_splits)
    y_TH = weighted_slot_sum(returned_NH, position_TK, weights_TK, num_valid)
    return y_TH, returned_NH if save_returned else nothing_returned


@combine_op.register_fake
def _(expert_out_RH, weights_TK, order_N, position_TK, send_meta_WL, recv_meta_WL, expert_alignment, group_name,
      save_returned):
    # NB: both shapes are static: T from position, N from order (0 rows when not saved).
    H = expert_out_RH.shape[1]
    returned_rows = order_N.shape[0] if save_returned else 0
    return expert_out_RH.new_empty(position_TK.shape[0], H), expert_out_RH.new_empty(returned_rows, H)


def _combine_setup_context(ctx, inputs, output):
    expert_out_RH, weights_TK = inputs[:2]
    ctx.route, ctx.save_returned = Route(*inputs[2:8]), inputs[8]
    ctx.num_rows = expert_out_RH.shape[0]
    ctx.set_materialize_grads(False)  # `returned` gets a gradient only in double backward
    ctx.save_for_backward(weights_TK, output[1] if ctx.save_returned else None)


def _combine_backward(ctx, grad_y_TH, grad_returned_NH):
    weights_TK, returned_NH = ctx.saved_tensors
    route = ctx.route
    grads_expert_out = []
    if ctx.needs_input_grad[0] and grad_y_TH is not None:
        # The adjoint of combine is dispatch with each slot's row scaled by its weight.
        grads_expert_out.append(dispatch_op(grad_y_TH, weights_TK, *route, ctx.num_rows))
    if ctx.needs_input_grad[0] and grad_returned_NH is not None and ctx.save_returned:
        # `returned` holds rows already in send order: dispatch them as K = 1 "tokens".
        in_send_order = torch.arange(route.order_N.shape[0], device=route.order_N.device)
        as_tokens = route._replace(order_N=in_send_order, position_TK=in_send_order[:, None])
        grads_expert_out.append(dispatch_op(grad_returned_NH, None, *as_tokens, ctx.num_rows))
    grad_expert_out = sum(grads_expert_out[1:], grads_expert_out[0]) if grads_expert_out else None
    grad_weights_TK = None
    if ctx.needs_input_grad[1] and grad_y_TH is not None:
        if returned_NH is None:
            raise RuntimeError("combine: the weights need a gradient, but the forward ran with save_returned=False")
        grad_weights_TK = slot_dot(returned_NH, route.position_TK, grad_y_TH, weights_TK.dtype)
    return grad_expert_out, grad_weights_TK, None, None, None, None, None, None, None


combine_op.register_autograd(_combine_backward, setup_context=_combine_setup_context)


# --------------------------------------------------------------------------------------------
# The backend


@dataclasses.dataclass(frozen=True)
class RouteHandle(DispatchHandle):
    """The handle of the ``local`` and ``collective`` backends: the dispatch's :class:`Route` and R."""

    route: Route
    num_rows: int

    @property
    def position_TK(self) -> torch.Tensor:
        return self.route.position_TK

    @property
    def expert_alignment(self) -> int:
        return self.route.expert_alignment

    @property
    def group_name(self) -> str:
        return self.route.group_name

    def combine(self, expert_out_RH: torch.Tensor, topk_weights_TK: Optional[torch.Tensor]) -> torch.Tensor:
        comm.checked("combine", self.group_name, check_combine_args, expert_out_RH, self, topk_weights_TK)
        if self.route.send_meta_WL.shape[0] == 1:  # peers check the rows inside the op, agreeing on the verdict
            check_combine_rows(expert_out_RH, self.num_rows)
        y_TH, _ = combine_op(expert_out_RH, topk_weights_TK, *self.route, save_returned(topk_weights_TK))
        return y_TH


def dispatch_route(x_TH: torch.Tensor, route: Route) -> tuple[torch.Tensor, torch.Tensor, RouteHandle]:
    """Dispatch ``x_TH`` along ``route`` (its recv_meta exchanged): routed (R, H),
    tokens_per_expert (e,), handle."""
    routed_RH = dispatch_op(x_TH, None, *route, None)
    recv_counts_We, _ = layout.split_meta(route.recv_meta_WL)
    tokens_per_expert_e = layout.padded_tokens_per_expert(recv_counts_We, route.expert_alignment)
    return routed_RH, tokens_per_expert_e, RouteHandle(route, routed_RH.shape[0])


class CollectiveBackend(Backend):
    """All-to-alls over a process group: one host read of the split sizes per op."""

    name = "collective"

    def check_group(self, group: Group, buffers) -> None:
        super().check_group(group, buffers)
        if group.name == LOCAL:
            raise ValueError(
                "backend='collective' needs an initialised process group (torch.distributed is not "
                "initialised and no group was given)"
            )

    def dispatch(self, x_TH, topk_idx_TK, num_experts, group, expert_alignment, buffers):
        E = comm.checked("dispatch", group.name, check_dispatch_args, x_TH, topk_idx_TK, num_experts, group.size,
                         expert_alignment)
        plan = layout.plan_routing(topk_idx_TK, E, group.size)
        fields = comm.dispatch_fields(x_TH, topk_idx_TK, E, expert_alignment)
        recv_meta_WL = exchange_counts_op(plan.send_meta, group.name, comm.header("dispatch", *fields))
        route = Route(plan.order, plan.position, plan.send_meta, recv_meta_WL, expert_alignment, group.name)
        return dispatch_route(x_TH, route)


