"""The ``local`` backend: one rank, no process group, no communication and no host sync.

Static shapes: ``routed`` always has C = T * K + E * (expert_alignment - 1) rows
(``layout.local_capacity``), the most any routing needs. Rows [0, tokens_per_expert.sum()) are the
expert-major rows (expert 0's group first, each in token order, padded to the alignment), and
every other row (padding, and the tail left by dropped slots and unused padding) is ZERO, as is
combine's gradient for it, so expert code that runs on all C rows (a per-expert loop, a plain
matmul) cannot leak them into a result or a weight gradient. The routing layout lives on the
device (``layout.plan_rows``: one to three kernel launches on CUDA, or a sort); the ops:

    local_dispatch  (T, H) tokens -> (C, H) rows: one gather (``rows.gather_rows``); with an
                    fp8 payload (``alltoall_ops.payload``) one for the values, one for the scales
    local_combine   (C, H) expert outputs -> (T, H): one top-k reduction reading the rows in
                    place (``rows.weighted_slot_sum``)

The ops are in the library's comm-op registry (``comm.comm_op``) like every backend's dispatch
and combine: a group of one exchanges with itself, and selective checkpointing saves them, so a
layer's saved tensors do not depend on the expert-parallel size. The adjoint of dispatch is
combine with the slot scales as weights, and the other way round;
the weights' gradient is ``rows.weight_grad_op`` over the expert outputs themselves (nothing
copied for it in the forward). Bad expert ids: a ``RoutingError`` on the CPU, a device-side
assert on CUDA (``layout.plan_rows``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .. import comm, layout, overlap
from .._compat import call, input_grads, named_inputs
from ..groups import LOCAL, Group
from ..payload import FORMATS, PLAIN, Payload, op_kwargs, routed
from ..rows import gather_rows, weight_grad_op, weighted_slot_sum
from .base import Backend, DispatchHandle


# --------------------------------------------------------------------------------------------
# dispatch


@comm.comm_op("local_dispatch", inline=True)
@overlap.startable
def local_dispatch_op(
    x_TH: torch.Tensor, scale_TK: Optional[torch.Tensor], row_src_C: torch.Tensor, row_TK: torch.Tensor,
    x_scale_TB: Optional[torch.Tensor] = None, payload: str = "plain", out_dtype: Optional[torch.dtype] = None,
    async_op: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H) tokens -> (C, H) expert-major rows and their (C, B) scales: row d is
    x[row_src[d] // K] (times scale_TK.flat[row_src[d]] in fp32, rounded once), zero where
    row_src[d] < 0. row_TK: each slot's row (C: none), for the backward. payload, x_scale_TB,
    out_dtype: the rows' format, as the collective ``dispatch`` op's (fp8: values and scales
    gathered apart, each once). async_op: started on the communication stream, pending until
    ``overlap.wait`` (:mod:`alltoall_ops.overlap`)."""
    fmt, K = FORMATS[payload], row_TK.shape[1]
    values_TH, scale_TB = fmt.encode(x_TH, x_scale_TB)
    values_CH = gather_rows(values_TH, scale_TK, row_src_C, K)
    return fmt.decode(values_CH, None if scale_TB is None else gather_rows(scale_TB, None, row_src_C, K), out_dtype)


@local_dispatch_op.register_fake
def _(x_TH, scale_TK, row_src_C, row_TK, x_scale_TB=None, payload="plain", out_dtype=None, async_op=False):
    # NB: C rows whatever the routing: no data-dependent size.
    return FORMATS[payload].empty_routed(x_TH, row_src_C.shape[0], out_dtype)


def _local_dispatch_setup_context(ctx, inputs, output):
    named = named_inputs(local_dispatch_op, inputs)
    x_TH, scale_TK = named["x_TH"], named["scale_TK"]
    # fp8-valued rows carry no gradient; dequantized ones the combine of theirs (straight-through)
    ctx.differentiable = named["payload"] == PLAIN.name or named["out_dtype"] is not None
    ctx.set_materialize_grads(False)
    scale_needs_grad = scale_TK is not None and scale_TK.requires_grad
    overlap.save_for_backward(ctx, output, named["async_op"], scale_TK, named["row_src_C"], named["row_TK"],
                              x_TH if scale_needs_grad else None)


def _local_dispatch_backward(ctx, grad_routed_CH, _grad_scale_CB):
    scale_TK, row_src_C, row_TK, x_TH = overlap.saved_tensors(ctx)
    if not ctx.differentiable or grad_routed_CH is None:
        return input_grads(local_dispatch_op)
    # The adjoint of dispatch is combine, weighted by the same per-slot scale.
    grad_x_TH = local_combine_op(expert_out_CH=grad_routed_CH, weights_TK=scale_TK, row_TK=row_TK, row_src_C=row_src_C)
    grad_scale_TK = None if x_TH is None else weight_grad_op(x_TH, grad_routed_CH, row_TK, scale_TK)
    return input_grads(local_dispatch_op, x_TH=grad_x_TH, scale_TK=grad_scale_TK)


local_dispatch_op.register_autograd(_local_dispatch_backward, setup_context=_local_dispatch_setup_context)


# --------------------------------------------------------------------------------------------
# combine


@comm.comm_op("local_combine", inline=True)
@overlap.startable
def local_combine_op(
    expert_out_CH: torch.Tensor, weights_TK: Optional[torch.Tensor], row_TK: torch.Tensor, row_src_C: torch.Tensor,
    async_op: bool = False,
) -> torch.Tensor:
    """(C, H) expert outputs -> y (T, H), y[t] = sum_k weights[t, k] * expert_out[row[t, k]]
    (fp32 accumulation, k order, rounded once); dropped slots (row C) add nothing. Rows no slot
    points at are not read. row_src_C: for the backward. async_op: as local_dispatch's."""
    return weighted_slot_sum(expert_out_CH, row_TK, weights_TK, expert_out_CH.shape[0])


@local_combine_op.register_fake
def _(expert_out_CH, weights_TK, row_TK, row_src_C, async_op=False):
    return expert_out_CH.new_empty(row_TK.shape[0], expert_out_CH.shape[1])


def _local_combine_setup_context(ctx, inputs, output):
    named = named_inputs(local_combine_op, inputs)
    weights_TK = named["weights_TK"]
    weights_need_grad = weights_TK is not None and weights_TK.requires_grad
    overlap.save_for_backward(ctx, output, named["async_op"], weights_TK, named["row_TK"], named["row_src_C"],
                              named["expert_out_CH"] if weights_need_grad else None)


def _local_combine_backward(ctx, grad_y_TH):
    weights_TK, row_TK, row_src_C, expert_out_CH = overlap.saved_tensors(ctx)
    grad_expert_out_CH = grad_weights_TK = None
    if ctx.needs_input_grad[0]:
        # The adjoint of combine is dispatch with each slot's row scaled by its weight: rows no
        # slot fills get a zero gradient.
        grad_expert_out_CH, _ = local_dispatch_op(x_TH=grad_y_TH, scale_TK=weights_TK, row_src_C=row_src_C,
                                                  row_TK=row_TK)
    if ctx.needs_input_grad[1]:
        grad_weights_TK = weight_grad_op(grad_y_TH, expert_out_CH, row_TK, weights_TK)
    return input_grads(local_combine_op, expert_out_CH=grad_expert_out_CH, weights_TK=grad_weights_TK)


local_combine_op.register_autograd(_local_combine_backward, setup_context=_local_combine_setup_context)


# --------------------------------------------------------------------------------------------
# The backend


@dataclasses.dataclass(frozen=True)
class LocalHandle(DispatchHandle):
    """The local backend's handle: the device-side row layout (``layout.RowPlan``'s row_src (C,)
    and row (T, K)) and C; nothing on the host but sizes."""

    row_src_C: torch.Tensor
    row_TK: torch.Tensor
    expert_alignment: int
    group_name: str = LOCAL
    world_size: int = 1

    @property
    def position_TK(self) -> torch.Tensor:
        return self.row_TK

    @property
    def num_rows(self) -> int:
        return self.row_src_C.shape[0]

    def combine(self, expert_out_CH: torch.Tensor, topk_weights_TK: Optional[torch.Tensor], *,
                async_op: bool = False) -> torch.Tensor:
        self.check_combine(expert_out_CH, topk_weights_TK)
        return call(local_combine_op, expert_out_CH=expert_out_CH, weights_TK=topk_weights_TK, row_TK=self.row_TK,
                    row_src_C=self.row_src_C, async_op=async_op, differentiable=(expert_out_CH, topk_weights_TK))


class LocalBackend(Backend):
    """One rank: expert-major rows with a static row count, no communication, no host sync."""

    name = "local"

    def check_group(self, group: Group, buffers: Any) -> None:
        super().check_group(group, buffers)
        if group.size != 1:
            raise ValueError(f"backend='local' needs a group of one rank, got a group of {group.size} ranks")

    def dispatch(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, *, num_experts: int, group: Group,
                 expert_alignment: int, buffers: Any, payload: Optional[Payload],
                 async_op: bool) -> tuple[Any, torch.Tensor, LocalHandle]:
        plan = layout.plan_rows(topk_idx_TK, num_experts, expert_alignment)
        routed_CH, scale_CB = call(local_dispatch_op, x_TH=x_TH, scale_TK=None, row_src_C=plan.row_src,
                                   row_TK=plan.row, **op_kwargs(payload), async_op=async_op, differentiable=(x_TH,))
        handle = LocalHandle(plan.row_src, plan.row, expert_alignment)
        return routed(payload, routed_CH, scale_CB), plan.tokens_per_expert, handle
