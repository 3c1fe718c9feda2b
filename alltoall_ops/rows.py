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


def quantize(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8.quantize` (one kernel launch on CUDA): x (T, H) float -> values (T, H) as uint8
    (float8_e4m3fn bits) and scales (T, H / 128) fp32."""
    if loader.use_kernels(x_TH):
        return loader.load().quantize_rows(x_TH)
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
    returned_NH: torch.Tensor, position_TK: torch.Tensor, v_TH: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(T, K): out[t, k] = <v[t], returned[position[t, k]]>, in fp32 (fp64) then ``out_dtype``.

    The gradient of a slot's scale (weight) is this dot product with the rows the slot sent or
    received (returned_NH: rows in send order)."""
    acc_dtype = accumulation_dtype(returned_NH.dtype, v_TH.dtype, out_dtype)
    v_TH = v_TH.to(acc_dtype)
    dots = [
        (v_TH * returned_NH.index_select(0, position_TK[:, k]).to(acc_dtype)).sum(-1)
        for k in range(position_TK.shape[1])
    ]
    return torch.stack(dots, dim=1).to(out_dtype)
