"""The row work each rank does locally around an exchange: gather its tokens' rows into send
order, reduce each token's top-k returned rows, and the per-slot dot products of the weights'
gradient. A Triton kernel on CUDA (one launch each), plain torch ops elsewhere.

Legend: T tokens, K slots per token, N = T * K, H hidden; ``position_TK[t, k]`` is the send
position of slot (t, k) (``layout.plan_routing``), slots at positions >= ``num_valid`` are
dropped.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import fp8
from ._compat import custom_op, input_grads
from .kernels import loader


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """fp64 if any input is fp64, else fp32: the dtype products and top-k sums accumulate in."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def rows_in_send_order(
    x_TH: torch.Tensor, scale_TK: Optional[torch.Tensor], order_N: torch.Tensor, position_TK: torch.Tensor,
    num_valid: int,
) -> torch.Tensor:
    """(num_valid, H): row i is ``x_TH[order_N[i] // K]``, times ``scale_TK.flat[order_N[i]]`` in
    fp32 (fp64) rounded once: the valid slots' rows in send order."""
    K = position_TK.shape[1]
    acc_dtype = accumulation_dtype(x_TH.dtype, *(() if scale_TK is None else (scale_TK.dtype,)))
    if loader.use_kernels(x_TH):
        # Token-major: the program of slot (t, k) reads x[t] once for all its K slots and stores
        # it at row position[t, k]; dropped slots (positions >= num_valid) store nothing.
        send_VH = x_TH.new_empty(num_valid, x_TH.shape[1])
        loader.load().put_rows(x_TH, position_TK.reshape(-1), num_valid, out=send_VH, top_k=K, scale=scale_TK,
                               acc_dtype=acc_dtype)
        return send_VH
    sorted_slots = order_N[:num_valid]
    send_VH = x_TH.index_select(0, sorted_slots // K)
    if scale_TK is not None:
        slot_scale = scale_TK.reshape(-1).index_select(0, sorted_slots)
        send_VH = (send_VH.to(acc_dtype) * slot_scale.to(acc_dtype)[:, None]).to(x_TH.dtype)
    return send_VH


def quantize_bits(
    x_TH: torch.Tensor, x_scale_TB: Optional[torch.Tensor] = None, max_programs: Optional[int] = None,
    out_TP: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bits an fp8 payload moves: values (T, H) as uint8 (float8_e4m3fn bits) and scales
    (T, H / 128) fp32. x (T, H) float is quantized (:func:`fp8.quantize`, which returns float8
    values; one kernel launch on CUDA, of at most ``max_programs`` programs: an SM budget); with
    ``x_scale_TB``, x already holds float8_e4m3fn values and those scales, returned as they are.
    ``out_TP``: packed wire rows to quantize into on CUDA (``kernels.quantize.quantize_rows``)."""
    if x_scale_TB is not None:
        return x_TH.view(torch.uint8), x_scale_TB
    if loader.use_kernels(x_TH):
        return loader.load().quantize_rows(x_TH, max_programs=max_programs, out_TP=out_TP)
    values_TH, scales_TB = fp8.quantize(x_TH)
    return values_TH.view(torch.uint8), scales_TB


def weighted_slot_sum(
    returned_nH: torch.Tensor, position_TK: torch.Tensor, weights_TK: Optional[torch.Tensor], num_valid: int
) -> torch.Tensor:
    """y[t] = sum_k w[t, k] * returned[position[t, k]] over the valid slots (position < num_valid),
    accumulated in fp32 (fp64), rounded once; (T, H) in returned's dtype.

    returned_nH: rows in send order, num_valid <= n <= N, the rows after the valid ones unread.
    A dropped slot adds nothing, even with a NaN / inf weight. Slots are added in k order:
    deterministic."""
    T, K = position_TK.shape
    H = returned_nH.shape[1]
    acc_dtype = accumulation_dtype(returned_nH.dtype, *(() if weights_TK is None else (weights_TK.dtype,)))
    if loader.use_kernels(returned_nH):
        # One pass: each returned row read once, y written once.
        y_TH = returned_nH.new_empty(T, H)
        loader.load().topk_reduce(returned_nH, position_TK, None, weights_TK, y_TH, None, acc_dtype, num_valid)
        return y_TH
    acc_TH = torch.zeros(T, H, dtype=acc_dtype, device=returned_nH.device)
    for k in range(K if num_valid > 0 else 0):
        slot_T = position_TK[:, k]
        rows_TH = returned_nH.index_select(0, slot_T.clamp(max=num_valid - 1)).to(acc_dtype)
        if weights_TK is not None:
            rows_TH = rows_TH * weights_TK[:, k : k + 1].to(acc_dtype)
        acc_TH += torch.where((slot_T < num_valid)[:, None], rows_TH, 0)  # masks the product, NaN weights too
    return acc_TH.to(returned_nH.dtype)


def slot_dot(
    returned_nH: torch.Tensor, position_TK: torch.Tensor, v_TH: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(T, K): out[t, k] = <v[t], returned[position[t, k]]>, in fp32 (fp64) then ``out_dtype``; 0
    where position[t, k] is not a row of returned (n rows).

    The gradient of a slot's scale (weight) is this dot product with the rows the slot sent or
    received (returned_nH: rows in send order, or the local backend's expert-major rows)."""
    acc_dtype = accumulation_dtype(returned_nH.dtype, v_TH.dtype, out_dtype)
    n = returned_nH.shape[0]
    if n == 0:
        return torch.zeros(position_TK.shape, dtype=out_dtype, device=v_TH.device)
    v_TH = v_TH.to(acc_dtype)
    dots = []
    for k in range(position_TK.shape[1]):
        slot_T = position_TK[:, k]
        rows_TH = returned_nH.index_select(0, slot_T.clamp(0, n - 1)).to(acc_dtype)
        dots.append(torch.where((slot_T >= 0) & (slot_T < n), (v_TH * rows_TH).sum(-1), 0))
    return torch.stack(dots, dim=1).to(out_dtype)


def gather_rows(
    src_TX: torch.Tensor, scale_TK: Optional[torch.Tensor], row_src_C: torch.Tensor, top_k: int
) -> torch.Tensor:
    """(C, X): row d is ``src_TX[row_src_C[d] // top_k]`` (times ``scale_TK.flat[row_src_C[d]]`` in
    fp32 (fp64), rounded once), zero where ``row_src_C[d] < 0``: the local backend's expert-major
    rows from its tokens (``layout.plan_rows``). One kernel launch on CUDA."""
    C, X = row_src_C.shape[0], src_TX.shape[1]
    acc_dtype = accumulation_dtype(src_TX.dtype, *(() if scale_TK is None else (scale_TK.dtype,)))
    if loader.use_kernels(src_TX):
        out_CX = src_TX.new_empty(C, X)
        loader.load().gather_rows(src_TX, row_src_C, out_CX, top_k=top_k, scale=scale_TK, acc_dtype=acc_dtype)
        return out_CX
    if src_TX.shape[0] == 0:  # no slot: every row is empty
        return src_TX.new_zeros(C, X)
    slot_C = row_src_C.clamp(min=0)
    rows_CX = src_TX.index_select(0, slot_C // top_k)
    if scale_TK is not None:
        slot_scale_C = scale_TK.reshape(-1).index_select(0, slot_C)
        rows_CX = (rows_CX.to(acc_dtype) * slot_scale_C.to(acc_dtype)[:, None]).to(src_TX.dtype)
    return torch.where((row_src_C >= 0)[:, None], rows_CX, torch.zeros((), dtype=src_TX.dtype))


def _weight_grad(
    grad_y_TH: torch.Tensor, rows_nH: torch.Tensor, position_TK: torch.Tensor, weights_TK: torch.Tensor,
    max_programs: Optional[int] = None,
) -> torch.Tensor:
    """grad_w (T, K) = :func:`slot_dot` (rows_nH, position_TK, grad_y_TH) in weights_TK's dtype:
    the gradient of combine's weights (of dispatch's per-slot scale) from the slots' rows; one
    kernel launch on CUDA, of at most ``max_programs`` programs (an SM budget). Its backward is
    plain torch (differentiable again)."""
    if not loader.use_kernels(grad_y_TH):
        return slot_dot(rows_nH, position_TK, grad_y_TH, weights_TK.dtype)
    grad_w_TK = torch.empty(position_TK.shape, dtype=weights_TK.dtype, device=grad_y_TH.device)
    acc = accumulation_dtype(rows_nH.dtype, weights_TK.dtype, grad_y_TH.dtype)
    loader.load().weight_grad(grad_y_TH, rows_nH, position_TK, grad_w_TK, acc, max_programs=max_programs)
    return grad_w_TK


# NB: inlined on CUDA, where it is one kernel: compiled backwards launch it from inductor's code
# (an opaque call cost ~150 us of host a call in a compiled transformers step).
weight_grad_op = custom_op("alltoall_ops::weight_grad", _weight_grad, inline="cuda")


@weight_grad_op.register_fake
def _(grad_y_TH, rows_nH, position_TK, weights_TK, max_programs=None):
    return weights_TK.new_empty(position_TK.shape)


def _weight_grad_setup_context(ctx, inputs, output):
    grad_y_TH, rows_nH, ctx.position_TK = inputs[:3]
    ctx.save_for_backward(grad_y_TH, rows_nH)


def _weight_grad_backward(ctx, grad_grad_w_TK):
    # grad_w is bilinear in (grad_y, rows): gathers, a sum over k and an index_add, masked like
    # slot_dot. weights only give the dtype: no gradient.
    grad_y_TH, rows_nH = ctx.saved_tensors
    T, K = ctx.position_TK.shape
    n, H = rows_nH.shape
    slots_N = ctx.position_TK.reshape(-1)
    valid_N = (slots_N >= 0) & (slots_N < n)
    slots_N = slots_N.clamp(0, max(n - 1, 0))
    acc = accumulation_dtype(rows_nH.dtype, grad_y_TH.dtype, grad_grad_w_TK.dtype)
    gg_TK1 = torch.where(valid_N.view(T, K), grad_grad_w_TK.to(acc), 0)[:, :, None]
    grad_grad_y_TH = grad_rows_nH = None
    if ctx.needs_input_grad[0]:
        slot_rows_TKH = rows_nH.index_select(0, slots_N).view(T, K, H).to(acc) if n else \
            rows_nH.new_zeros(T, K, H, dtype=acc)
        grad_grad_y_TH = (gg_TK1 * slot_rows_TKH).sum(1).to(grad_y_TH.dtype)
    if ctx.needs_input_grad[1]:
        per_slot_NH = (gg_TK1 * grad_y_TH.to(acc)[:, None, :]).reshape(T * K, H)
        grad_rows_nH = torch.zeros_like(rows_nH).index_add(0, slots_N, per_slot_NH.to(rows_nH.dtype))
    return input_grads(weight_grad_op, grad_y_TH=grad_grad_y_TH, rows_nH=grad_rows_nH)


weight_grad_op.register_autograd(_weight_grad_backward, setup_context=_weight_grad_setup_context)
