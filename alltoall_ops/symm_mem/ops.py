"""The custom ops of the symm_mem backend, with their fakes and autograd, and the checks they
run on the exchanged metadata."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import layout
from ..ops import accumulation_dtype, comm_op
from .buffers import META, RECV, RET, TAGS, SymmBuffers
from .loader import kernels


# --------------------------------------------------------------------------------------------
# Checks on the exchanged metadata (every rank sees the same metadata, so all agree)


def _fail(ok: torch.Tensor, message: Callable[[], str]) -> None:
    """Raise ``ValueError(message())`` where ``ok`` is False. CPU: at once. CUDA: no host sync, a
    device-side assert (``torch._assert_async``) that surfaces at the next synchronisation."""
    if ok.device.type == "cpu":
        if not bool(ok):
            raise ValueError(message())
    else:
        torch._assert_async(ok, "alltoall_ops symm_mem: routing check failed (bad expert ids, "
                                "T * K above the buffers' max_tokens_per_rank * top_k, or overflow)")


def _check_meta(meta: torch.Tensor, bufs: SymmBuffers, expert_alignment: int) -> None:
    E, W, C = bufs.num_experts, bufs.world_size, bufs.capacity
    counts, status, n_slots = meta[:, :E], meta[:, E : E + layout.STATUS_COLUMNS], meta[:, -1]

    def bad_ids() -> str:
        s = int(torch.nonzero(status[:, 0] > 0)[0])
        num_bad, lo, hi = status[s].tolist()
        return (f"topk_idx on rank {s} of the group holds {num_bad} expert id(s) outside "
                f"[-1, {E}) (min {lo}, max {hi}); expected -1 or a global expert id")

    _fail((status[:, 0] == 0).all(), bad_ids)

    def too_many_slots() -> str:
        s = int(torch.nonzero(n_slots > bufs.max_slots)[0])
        return (f"rank {s} dispatched T * K = {int(n_slots[s])} slots, more than the buffers' "
                f"max_tokens_per_rank * top_k = {bufs.max_slots}; create SymmBuffers with a larger "
                f"max_tokens_per_rank")

    _fail((n_slots <= bufs.max_slots).all(), too_many_slots)
    if bufs.overflow == "drop":
        return
    padded = (counts.sum(0) + expert_alignment - 1) // expert_alignment * expert_alignment  # (E,)
    needed = padded.view(W, -1).sum(1)  # (W,) rows each rank must receive

    def overflow() -> str:
        r = int(torch.nonzero(needed > C)[0])
        return (f"symm_mem dispatch overflow: rank {r} must receive {int(needed[r])} rows "
                f"(expert_alignment={expert_alignment}) but the buffers' capacity is C = {C}; "
                f"create SymmBuffers with a larger capacity (default: the worst case), or with "
                f"overflow='drop' to drop the rows past C and count them")

    _fail((needed <= C).all(), overflow)


# --------------------------------------------------------------------------------------------
# Ops. Each: entry barrier (peers are done reading what we will overwrite), kernel writes into
# peers' buffers, barrier (all writes landed), copy out of our own buffers into fresh tensors.


@comm_op("symm_exchange_meta")
def symm_exchange_meta_op(send_row: torch.Tensor, buffers: SymmBuffers, expert_alignment: int) -> torch.Tensor:
    """(L,) int64 metadata row of this rank -> (W, L), row s from rank s (an all-gather).

    Checks every rank's row (expert ids, T * K, and without overflow='drop' the capacity) and
    raises on all ranks alike."""
    k = kernels()
    buffers._barrier()
    k.put_meta(send_row.contiguous(), buffers.table[META], buffers.rank)
    buffers._barrier()
    meta = buffers.meta.clone()
    _check_meta(meta, buffers, expert_alignment)
    return meta


@symm_exchange_meta_op.register_fake
def _(send_row, buffers, expert_alignment):
    # NB: one row from each of the W ranks.
    return send_row.new_empty(buffers.world_size, send_row.shape[0])


@comm_op("symm_dispatch")
def symm_dispatch_op(
    x: torch.Tensor,
    scale: Optional[torch.Tensor],
    position: torch.Tensor,
    slot_dst: torch.Tensor,
    buffers: SymmBuffers,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H) rows -> routed (C, H), row_src (C,) int64.

    Slot (t, k) carries row ``x[t]`` (times ``scale[t, k]`` in fp32, rounded once) to
    ``slot_dst[t * K + k]``, tagged with its send position ``position[t, k]``. routed: rows
    received, zero where none; row_src: each row's source code (``rank * N_max + position``),
    -1 where none."""
    k = kernels()
    K = position.shape[1]
    acc = accumulation_dtype(x.dtype, *(() if scale is None else (scale.dtype,)))
    buffers._barrier()
    k.put_rows(
        x.contiguous(), slot_dst, buffers.capacity, buffers.table[RECV],
        top_k=K, scale=None if scale is None else scale.contiguous(), tags_table=buffers.table[TAGS],
        tag_index=position.reshape(-1), tag_base=buffers.rank * buffers.max_slots, acc_dtype=acc,
    )
    buffers._barrier()
    routed = x.new_empty(buffers.capacity, x.shape[1])
    row_src = torch.empty(buffers.capacity, dtype=torch.int64, device=x.device)
    k.dispatch_copy_out(buffers.recv, buffers.tags, routed, row_src)
    return routed, row_src


@symm_dispatch_op.register_fake
def _(x, scale, position, slot_dst, buffers):
    # NB: fixed capacity C, so no data-dependent size: the graph never waits for the counts.
    C = buffers.capacity
    return x.new_empty(C, x.shape[1]), x.new_empty(C, dtype=torch.int64)


def _symm_dispatch_setup_context(ctx, inputs, output):
    _, _, ctx.position, _, ctx.buffers = inputs
    ctx.save_for_backward(inputs[3], output[1])  # slot_dst, row_src


def _symm_dispatch_backward(ctx, grad_routed, _grad_row_src):
    # The adjoint of dispatch is combine with unit weights.
    slot_dst, row_src = ctx.saved_tensors
    grad_x, _ = symm_combine_op(grad_routed, None, ctx.position, slot_dst, row_src, ctx.buffers, False)
    return grad_x, None, None, None, None


symm_dispatch_op.register_autograd(_symm_dispatch_backward, setup_context=_symm_dispatch_setup_context)


@comm_op("symm_combine")
def symm_combine_op(
    expert_out: torch.Tensor,
    weights: Optional[torch.Tensor],
    position: torch.Tensor,
    slot_dst: torch.Tensor,
    row_src: torch.Tensor,
    buffers: SymmBuffers,
    save_returned: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, H) expert outputs in dispatch order -> y (T, H), returned (N, H) or (0, H).

    Row d goes back to its source (``row_src[d]``); then y[t] = sum_k weights[t, k] *
    row of slot (t, k), in k order, accumulated in fp32 (fp64) and rounded once. returned:
    every slot's row in send order (zero for unsent slots), when ``save_returned``, for the
    weights' gradient."""
    k = kernels()
    T, K = position.shape
    buffers._barrier()
    k.put_rows(expert_out.contiguous(), row_src, buffers.max_slots, buffers.table[RET])
    buffers._barrier()
    H = expert_out.shape[1]
    y = expert_out.new_empty(T, H)
    returned = expert_out.new_empty(T * K if save_returned else 0, H)
    acc = accumulation_dtype(expert_out.dtype, *(() if weights is None else (weights.dtype,)))
    k.combine_reduce(
        buffers.ret, position, slot_dst, None if weights is None else weights.contiguous(), y,
        returned if save_returned else None, acc,
    )
    return y, returned


@symm_combine_op.register_fake
def _(expert_out, weights, position, slot_dst, row_src, buffers, save_returned):
    # NB: static shapes: T and K from position.
    T, K = position.shape
    H = expert_out.shape[1]
    return expert_out.new_empty(T, H), expert_out.new_empty(T * K if save_returned else 0, H)


def _symm_combine_setup_context(ctx, inputs, output):
    _, weights, ctx.position, _, _, ctx.buffers, save_returned = inputs
    ctx.save_for_backward(weights, inputs[3], output[1] if save_returned else None)
    ctx.mark_non_differentiable(output[1])  # an auxiliary output, kept for the weights' gradient


def _symm_combine_backward(ctx, grad_y, _grad_returned):
    weights, slot_dst, returned = ctx.saved_tensors
    grad_expert_out = grad_weights = None
    if ctx.needs_input_grad[0]:
        # The adjoint of combine is dispatch with each slot's row scaled by its weight.
        grad_expert_out, _ = symm_dispatch_op(grad_y, weights, ctx.position, slot_dst, ctx.buffers)
    if ctx.needs_input_grad[1]:
        if returned is None:
            raise RuntimeError(
                "symm_combine: topk_weights need a gradient, but the op was called with "
                "save_returned=False; alltoall_ops.combine sets it when the weights require grad"
            )
        grad_weights = symm_weight_grad_op(grad_y, returned, ctx.position, weights)
    return grad_expert_out, grad_weights, None, None, None, None, None


symm_combine_op.register_autograd(_symm_combine_backward, setup_context=_symm_combine_setup_context)


@torch.library.custom_op("alltoall_ops::symm_weight_grad", mutates_args=())
def symm_weight_grad_op(
    grad_y: torch.Tensor, returned: torch.Tensor, position: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """grad_w (T, K) = <grad_y[t], returned[position[t, k]]> in fp32 (fp64), in weights' dtype.
    Local: no communication."""
    grad_w = torch.empty(position.shape, dtype=weights.dtype, device=grad_y.device)
    acc = accumulation_dtype(returned.dtype, weights.dtype, grad_y.dtype)
    kernels().combine_weight_grad(grad_y.contiguous(), returned, position, grad_w, acc)
    return grad_w


@symm_weight_grad_op.register_fake
def _(grad_y, returned, position, weights):
    return weights.new_empty(position.shape)
