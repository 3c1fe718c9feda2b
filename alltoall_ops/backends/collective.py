"""The ``collective`` backend: dispatch / combine over a process group with functional-collective
style all-to-alls (NCCL on GPUs, gloo on CPUs), and its custom ops, which the ``local`` backend
runs on a group of one rank (no exchange).

A dispatch reads its split sizes on the host once (``exchange_routing`` on a group,
``layout.read_splits`` on one rank: the one device sync of a layer step); combine and both
backward ops reuse them from a small CPU tensor. Its routing layout travels as a
:class:`RouteArgs` (the ops' arguments after the payload):
    order_N (N,), position_TK (T, K), recv_meta_WL (W, e + STATUS_COLUMNS), all int64 on the
    payload's device; splits_S (2W + 2,) int64 on the CPU (``layout.HostSplits``);
    expert_alignment, group_name. W = recv_meta_WL.shape[0]; W == 1 exchanges nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import torch

from .. import comm, layout, overlap
from .._compat import call, input_grads, inputs_as, named_inputs
from ..groups import LOCAL, Group, process_group
from ..payload import FORMATS, PLAIN, Payload, op_kwargs, pack, routed, unpack
from ..rows import rows_in_send_order, weight_grad_op, weighted_slot_sum
from .base import Backend, DispatchHandle, save_returned


class RouteArgs(NamedTuple):
    """One dispatch's routing layout on this rank: the arguments of the ``dispatch`` /
    ``combine`` ops after the rows, passed by name (``**route.kwargs()``)."""

    order_N: torch.Tensor
    position_TK: torch.Tensor
    recv_meta_WL: torch.Tensor
    splits_S: torch.Tensor
    expert_alignment: int
    group_name: str

    @classmethod
    def of(cls, op, inputs: tuple) -> "RouteArgs":
        """The route among an op's autograd ``inputs``, taken by argument name."""
        return inputs_as(cls, op, inputs)

    def kwargs(self) -> dict:
        return self._asdict()


def _rows_are_send_order(recv_meta_WL: torch.Tensor, expert_alignment: int) -> bool:
    """One rank without padding: the routed rows are the valid slots in send order."""
    return recv_meta_WL.shape[0] == 1 and expert_alignment == 1


def _expert_major_rows(recv_meta_WL: torch.Tensor, splits: layout.HostSplits, expert_alignment: int):
    """(sum(recv_splits),) expert-major row of each rank-major received row, or None where the
    two orders coincide (one rank, no padding)."""
    if _rows_are_send_order(recv_meta_WL, expert_alignment):
        return None
    recv_counts_We, _ = layout.split_meta(recv_meta_WL)
    return layout.expert_major_rows(recv_counts_We, expert_alignment, sum(splits.recv_splits))


# --------------------------------------------------------------------------------------------
# exchange_counts


@comm.comm_op("exchange_counts")
def exchange_counts_op(send_Wc: torch.Tensor, group_name: str, header: list[int]) -> torch.Tensor:
    """(W, c) int64, row r sent to rank r -> (W, c), row s received from rank s.

    header: ``[op code, *fields]`` (``comm.FIELDS``) that every rank must agree on; the ranks
    check it (:func:`comm.agree`) before the counts move, so a disagreement on c is an error
    on every rank, never a mismatched exchange."""
    return _exchange_counts(send_Wc, group_name, header)


def _exchange_counts(send_Wc: torch.Tensor, group_name: str, header: list[int]) -> torch.Tensor:
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


@comm.comm_op("exchange_routing")
def exchange_routing_op(
    send_meta_WL: torch.Tensor, group_name: str, header: list[int], expert_alignment: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A dispatch's metadata exchange on a group, with its header agreement and its one host
    read: send_meta (W, L), row r for rank r -> recv_meta (W, L) (row s from rank s, on
    send_meta's device) and splits_S (2W + 2,) on the CPU (``layout.HostSplits``).

    When the W * L counts fit an agreement's payload (``comm.PAYLOAD_LEN``) they travel inside
    it: one all-gather, one read. Else the agreement, an all-to-all of the counts and a second
    read (``layout.read_splits``). Raises on every rank alike (see :func:`comm.agree`; bad
    expert ids: :class:`RoutingError`)."""
    W, L = send_meta_WL.shape
    op, fields = comm.op_name(header[0]), header[1:]
    if W == 1:  # a group of one agrees with itself and receives what it sends
        return send_meta_WL.clone(), layout.read_splits(send_meta_WL, send_meta_WL, expert_alignment)
    if W * L > comm.PAYLOAD_LEN:
        recv_meta_WL = _exchange_counts(send_meta_WL, group_name, header)
        return recv_meta_WL, layout.read_splits(send_meta_WL, recv_meta_WL, expert_alignment)
    sent_by_rank = comm.agree_and_gather(op, group_name, fields, send_meta_WL)  # W rows of W * L
    r = process_group(group_name).rank()
    send_rows = [sent_by_rank[r][s * L : (s + 1) * L] for s in range(W)]
    recv_rows = [sent[r * L : (r + 1) * L] for sent in sent_by_rank]
    recv_meta_WL = torch.tensor(recv_rows, dtype=torch.int64).to(send_meta_WL.device, non_blocking=True)
    return recv_meta_WL, layout.host_splits(send_rows, recv_rows, expert_alignment)


@exchange_routing_op.register_fake
def _(send_meta_WL, group_name, header, expert_alignment):
    W = send_meta_WL.shape[0]
    return torch.empty_like(send_meta_WL), torch.empty(2 * W + 2, dtype=torch.int64, device="cpu")


# --------------------------------------------------------------------------------------------
# dispatch


@comm.comm_op("dispatch")
@overlap.startable
def dispatch_op(
    x_TH: torch.Tensor,
    scale_TK: Optional[torch.Tensor],
    order_N: torch.Tensor,
    position_TK: torch.Tensor,
    recv_meta_WL: torch.Tensor,
    splits_S: torch.Tensor,
    expert_alignment: int,
    group_name: str,
    num_rows: Optional[int],
    x_scale_TB: Optional[torch.Tensor] = None,
    payload: str = "plain",
    out_dtype: Optional[torch.dtype] = None,
    async_op: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H) tokens -> routed (R, H) rows grouped by local expert, then source rank, then
    token, and routed_scale (R, B); padding rows zero. No host sync: the split sizes come from
    splits_S (on the CPU). async_op: started on the communication stream, pending until
    ``overlap.wait`` (:mod:`alltoall_ops.overlap`).

    scale_TK: multiplies each slot's row (in fp32, rounded once) before sending (plain rows).
    num_rows: R when the caller knows it (in backward: sizes the fake), else None.
    payload: the rows' format (``payload.FORMATS``): "plain", routed in x's dtype and
    routed_scale (R, 0); "fp8", x quantized once per token (or, with x_scale_TB (T, B), x's
    float8_e4m3fn values and those scales), routed float8_e4m3fn (with ``out_dtype``:
    dequantized to it; the backward is combine, the quantize straight-through) and its fp32
    scales."""
    fmt = FORMATS[payload]
    splits = layout.HostSplits.of(splits_S)
    values_TH, scale_TB = fmt.encode(x_TH, x_scale_TB)
    if scale_TB is None:
        send_VH = rows_in_send_order(values_TH, scale_TK, order_N, position_TK, splits.num_valid)
        parts = [_exchange_rows(send_VH, recv_meta_WL, splits, group_name), None]
    elif recv_meta_WL.shape[0] == 1:  # nothing to exchange: values and scales move apart
        parts = [rows_in_send_order(p, None, order_N, position_TK, splits.num_valid) for p in (values_TH, scale_TB)]
    else:  # one exchange of packed rows
        send_VP = rows_in_send_order(pack(values_TH, scale_TB), None, order_N, position_TK, splits.num_valid)
        parts = unpack(_exchange_rows(send_VP, recv_meta_WL, splits, group_name), values_TH, scale_TB)
    expert_major_R = _expert_major_rows(recv_meta_WL, splits, expert_alignment)
    if expert_major_R is not None:
        parts = [None if p is None else _place_rows(p, expert_major_R, splits.num_rows) for p in parts]
    return fmt.decode(*parts, out_dtype)


def _exchange_rows(send_VX: torch.Tensor, recv_meta_WL: torch.Tensor, splits: layout.HostSplits,
                   group_name: str) -> torch.Tensor:
    """Rows in send order (V, X) -> the rows every rank sent this one, rank-major."""
    if recv_meta_WL.shape[0] == 1:
        return send_VX  # one rank: what it sends is what it receives
    received_X = send_VX.new_empty(sum(splits.recv_splits), send_VX.shape[1])
    comm.all_to_all("dispatch", group_name, received_X, send_VX, splits.recv_splits, splits.send_splits)
    return received_X


def _place_rows(received_X: torch.Tensor, expert_major_R: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Rank-major received rows -> (num_rows, X) expert-major rows, zero padding rows."""
    routed_RX = received_X.new_zeros(num_rows, received_X.shape[1])
    routed_RX.index_copy_(0, expert_major_R, received_X)
    return routed_RX


@dispatch_op.register_fake
def _(x_TH, scale_TK, order_N, position_TK, recv_meta_WL, splits_S, expert_alignment, group_name, num_rows,
      x_scale_TB=None, payload="plain", out_dtype=None, async_op=False):
    # NB: R depends on what the peers send: in splits_S, whose values the trace does not see (one
    # unbacked size for both outputs).
    if num_rows is None:
        num_rows = torch.library.get_ctx().new_dynamic_size()
    return FORMATS[payload].empty_routed(x_TH, num_rows, out_dtype)


def _dispatch_setup_context(ctx, inputs, output):
    named = named_inputs(dispatch_op, inputs)
    x_TH, scale_TK = named["x_TH"], named["scale_TK"]
    ctx.route = RouteArgs.of(dispatch_op, inputs)
    # fp8-valued rows carry no gradient; dequantized ones the combine of theirs (straight-through)
    ctx.differentiable = named["payload"] == PLAIN.name or named["out_dtype"] is not None
    ctx.set_materialize_grads(False)
    overlap.save_for_backward(ctx, output, named["async_op"], scale_TK,
                              x_TH if scale_TK is not None and scale_TK.requires_grad else None)


def _dispatch_backward(ctx, grad_routed_RH, _grad_scale_RB):
    scale_TK, x_TH = overlap.saved_tensors(ctx)
    if not ctx.differentiable or grad_routed_RH is None:
        return input_grads(dispatch_op)
    # The adjoint of dispatch is combine, weighted by the same per-slot scale.
    grad_x_TH, returned_NH = combine_op(grad_routed_RH, scale_TK, **ctx.route.kwargs(), save_returned=x_TH is not None)
    grad_scale_TK = None if x_TH is None else weight_grad_op(x_TH, returned_NH, ctx.route.position_TK, scale_TK)
    return input_grads(dispatch_op, x_TH=grad_x_TH, scale_TK=grad_scale_TK)


dispatch_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup_context)


# --------------------------------------------------------------------------------------------
# combine


@comm.comm_op("combine")
@overlap.startable
def combine_op(
    expert_out_RH: torch.Tensor,
    weights_TK: Optional[torch.Tensor],
    order_N: torch.Tensor,
    position_TK: torch.Tensor,
    recv_meta_WL: torch.Tensor,
    splits_S: torch.Tensor,
    expert_alignment: int,
    group_name: str,
    save_returned: bool,
    async_op: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, H) expert outputs in dispatch order -> y (T, H) and the returned rows.

    y[t] = sum_k weights[t, k] * expert_out[row of slot (t, k)] (fp32 accumulation).
    returned: with ``save_returned``, (N, H), each valid slot's row in send order and zero rows
    after them (for the weights' gradient); else (0, H). No host sync (splits_S is on the CPU)
    and no exchange but the rows' own: the caller has checked expert_out's rows against R.
    async_op: as dispatch's."""
    H = expert_out_RH.shape[1]
    nothing_returned = expert_out_RH.new_empty(0, H)
    one_rank = recv_meta_WL.shape[0] == 1
    splits = layout.HostSplits.of(splits_S)
    expert_major_R = _expert_major_rows(recv_meta_WL, splits, expert_alignment)
    if one_rank and expert_major_R is None and not save_returned:
        # The expert outputs already are the valid slots' rows in send order: nothing moves.
        return weighted_slot_sum(expert_out_RH, position_TK, weights_TK, splits.num_valid), nothing_returned
    returned_NH = expert_out_RH.new_empty(order_N.shape[0], H)
    returned_NH[splits.num_valid:].zero_()  # dropped slots read zero rows
    received_VH = returned_NH[:splits.num_valid]
    if one_rank:  # gather straight into the returned rows
        if expert_major_R is None:
            received_VH.copy_(expert_out_RH)
        else:
            torch.index_select(expert_out_RH, 0, expert_major_R, out=received_VH)
    else:
        rank_major = expert_out_RH if expert_major_R is None else expert_out_RH.index_select(0, expert_major_R)
        comm.all_to_all("combine", group_name, received_VH, rank_major, splits.send_splits, splits.recv_splits)
    y_TH = weighted_slot_sum(returned_NH, position_TK, weights_TK, splits.num_valid)
    return y_TH, returned_NH if save_returned else nothing_returned


@combine_op.register_fake
def _(expert_out_RH, weights_TK, order_N, position_TK, recv_meta_WL, splits_S, expert_alignment, group_name,
      save_returned, async_op=False):
    # NB: both shapes are static: T from position, N from order (0 rows when not saved).
    H = expert_out_RH.shape[1]
    returned_rows = order_N.shape[0] if save_returned else 0
    return expert_out_RH.new_empty(position_TK.shape[0], H), expert_out_RH.new_empty(returned_rows, H)


def _combine_setup_context(ctx, inputs, output):
    named = named_inputs(combine_op, inputs)
    expert_out_RH, weights_TK = named["expert_out_RH"], named["weights_TK"]
    ctx.route, ctx.save_returned = RouteArgs.of(combine_op, inputs), named["save_returned"]
    ctx.num_rows = expert_out_RH.shape[0]
    ctx.set_materialize_grads(False)  # `returned` gets a gradient only in double backward
    overlap.save_for_backward(ctx, output, named["async_op"], weights_TK, output[1] if ctx.save_returned else None)


def _combine_backward(ctx, grad_y_TH, grad_returned_NH):
    weights_TK, returned_NH = overlap.saved_tensors(ctx)
    route = ctx.route
    grads_expert_out = []
    if ctx.needs_input_grad[0] and grad_y_TH is not None:
        # The adjoint of combine is dispatch with each slot's row scaled by its weight.
        grads_expert_out.append(dispatch_op(grad_y_TH, weights_TK, **route.kwargs(), num_rows=ctx.num_rows)[0])
    if ctx.needs_input_grad[0] and grad_returned_NH is not None and ctx.save_returned:
        # `returned` holds rows already in send order: dispatch them as K = 1 "tokens".
        in_send_order = torch.arange(route.order_N.shape[0], device=route.order_N.device)
        as_tokens = route._replace(order_N=in_send_order, position_TK=in_send_order[:, None])
        grads_expert_out.append(dispatch_op(grad_returned_NH, None, **as_tokens.kwargs(), num_rows=ctx.num_rows)[0])
    grad_expert_out = sum(grads_expert_out[1:], grads_expert_out[0]) if grads_expert_out else None
    grad_weights_TK = None
    if ctx.needs_input_grad[1] and grad_y_TH is not None:
        if returned_NH is None:
            raise RuntimeError("combine: the weights need a gradient, but the forward ran with save_returned=False")
        grad_weights_TK = weight_grad_op(grad_y_TH, returned_NH, route.position_TK, weights_TK)
    return input_grads(combine_op, expert_out_RH=grad_expert_out, weights_TK=grad_weights_TK)


combine_op.register_autograd(_combine_backward, setup_context=_combine_setup_context)


# --------------------------------------------------------------------------------------------
# The backend


@dataclasses.dataclass(frozen=True)
class RouteHandle(DispatchHandle):
    """The handle of the ``collective`` backend (and of each stage of ``hierarchical_dispatch``):
    the dispatch's :class:`RouteArgs`, R, and the hidden size and dtype of the routed rows (which
    every rank agreed on)."""

    route: RouteArgs
    num_rows: int
    hidden_size: int
    dtype: torch.dtype

    @property
    def position_TK(self) -> torch.Tensor:
        return self.route.position_TK

    @property
    def expert_alignment(self) -> int:
        return self.route.expert_alignment

    @property
    def group_name(self) -> str:
        return self.route.group_name

    @property
    def world_size(self) -> int:
        return self.route.recv_meta_WL.shape[0]

    def check_combine(self, expert_out_RH: torch.Tensor, topk_weights_TK: Optional[torch.Tensor]) -> None:
        super().check_combine(expert_out_RH, topk_weights_TK)
        # NB: rows like the dispatched ones on every rank: the payload exchange's sizes agree
        # without an exchange of its own.
        if self.world_size > 1 and (expert_out_RH.shape[1], expert_out_RH.dtype) != (self.hidden_size, self.dtype):
            raise ValueError(
                f"expert_out: expected rows of the dispatched hidden size {self.hidden_size} and dtype {self.dtype} "
                f"(on a group every rank's rows must match), got {expert_out_RH.dtype} of shape "
                f"{tuple(expert_out_RH.shape)}"
            )

    def combine(self, expert_out_RH: torch.Tensor, topk_weights_TK: Optional[torch.Tensor], *,
                async_op: bool = False) -> torch.Tensor:
        self.check_combine_everywhere(expert_out_RH, topk_weights_TK)
        y_TH, _ = call(combine_op, expert_out_RH, topk_weights_TK, **self.route.kwargs(),
                       save_returned=save_returned(topk_weights_TK), async_op=async_op,
                       differentiable=(expert_out_RH, topk_weights_TK))
        return y_TH


def dispatch_route(x_TH: torch.Tensor, plan: layout.RoutingPlan, recv_meta_WL: torch.Tensor, splits_S: torch.Tensor,
                   expert_alignment: int, group_name: str, payload: Optional[Payload] = None, async_op: bool = False):
    """Dispatch ``x_TH`` along ``plan`` once its counts are exchanged (``recv_meta_WL``) and
    its split sizes read (``splits_S``): routed (R, H) (with an fp8 ``payload`` and no
    dequantization: the pair (values (R, H), scales (R, H / 128))), tokens_per_expert (e,), handle.
    async_op: the rows' exchange pending until ``overlap.wait(routed)``."""
    route = RouteArgs(plan.order, plan.position, recv_meta_WL, splits_S, expert_alignment, group_name)
    routed_RH, scale_RB = call(dispatch_op, x_TH=x_TH, scale_TK=None, **route.kwargs(), num_rows=None,
                               **op_kwargs(payload), async_op=async_op, differentiable=(x_TH,))
    recv_counts_We, _ = layout.split_meta(recv_meta_WL)
    tokens_per_expert_e = layout.padded_tokens_per_expert(recv_counts_We, expert_alignment)
    dtype = x_TH.dtype if payload is None else payload.combine_dtype
    handle = RouteHandle(route, routed_RH.shape[0], x_TH.shape[1], dtype)
    return routed(payload, routed_RH, scale_RB), tokens_per_expert_e, handle


def dispatch_planned(x_TH: torch.Tensor, plan: layout.RoutingPlan, header: list[int], expert_alignment: int,
                     group_name: str, payload: Optional[Payload] = None, async_op: bool = False):
    """Exchange ``plan``'s counts on the group (``exchange_routing``: the header agreement and
    the one host read), then :func:`dispatch_route`: routed, tokens_per_expert (e,), handle."""
    recv_meta_WL, splits_S = exchange_routing_op(plan.send_meta, group_name, header, expert_alignment)
    return dispatch_route(x_TH, plan, recv_meta_WL, splits_S, expert_alignment, group_name, payload, async_op)


def send_along(handle: RouteHandle, rows_TC: torch.Tensor) -> torch.Tensor:
    """Per-token rows (T, C) (floats, or integers such as expert ids) dispatched along
    ``handle``'s route: (R, C), laid out as its routed rows (padding rows zero). Differentiable
    for float rows, as any dispatch."""
    return dispatch_op(rows_TC, None, **handle.route.kwargs(), num_rows=handle.num_rows)[0]


class CollectiveBackend(Backend):
    """All-to-alls over a process group: per layer step one host read, in the forward
    dispatch's metadata exchange (its header agreement carries the counts)."""

    name = "collective"

    def check_group(self, group: Group, buffers: Any) -> None:
        super().check_group(group, buffers)
        if group.name == LOCAL:
            raise ValueError(
                "backend='collective' needs an initialised process group (torch.distributed is not "
                "initialised and no group was given)"
            )

    def dispatch(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, *, num_experts: int, group: Group,
                 expert_alignment: int, buffers: Any, payload: Optional[Payload],
                 async_op: bool) -> tuple[Any, torch.Tensor, RouteHandle]:
        plan = layout.plan_routing(topk_idx_TK, num_experts, group.size)
        dtype, payload_dtype = (x_TH.dtype,) * 2 if payload is None else (payload.combine_dtype,
                                                                          payload.format.payload_dtype)
        fields = comm.dispatch_fields(x_TH, topk_idx_TK, num_experts, expert_alignment, dtype, payload_dtype)
        return dispatch_planned(x_TH, plan, comm.header("dispatch", *fields), expert_alignment, group.name, payload,
                                async_op)
