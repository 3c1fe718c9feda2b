"""Argument checks of the public API. Each raises ``TypeError`` / ``ValueError`` naming the
argument, what was expected and what came, before any communication.

These checks read only shapes, dtypes and Python ints, which SPMD programs share across ranks,
so every rank raises alike. Expert ids out of range need tensor values: they travel with the
exchanged counts, and every rank raises on the first read of them (``layout.read_splits``).
Combine's checks are local (its row count against the handle's R): see
``DispatchHandle.check_combine_everywhere`` for what the peers see."""

from __future__ import annotations

import operator
from typing import Optional

import torch

from . import fp8
from ._compat import is_compiling


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} tensor of shape {tuple(t.shape)}"


def _require_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")


def _require_float_matrix(name: str, t: torch.Tensor, shape_doc: str) -> None:
    _require_tensor(name, t)
    if t.ndim != 2 or not t.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a 2-D floating-point tensor {shape_doc}, got {_describe(t)}")


MAX_EXPERT_ALIGNMENT = 1 << 16
"""The largest ``expert_alignment``: padding adds up to ``e * (alignment - 1)`` rows."""


def as_int(value):
    """``value`` as an int (integer-likes such as numpy ints accepted; a SymInt under
    torch.compile as it is), or None for anything else (bools and tensors included)."""
    if isinstance(value, torch.SymInt):
        return value
    try:
        return None if isinstance(value, (bool, torch.Tensor)) else operator.index(value)
    except TypeError:
        return None


def check_bool(name: str, value) -> bool:
    """``value`` if it is a bool; raises ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return value


def positive_int(name: str, value, maximum: Optional[int] = None) -> int:
    """``value`` as an int (integer-likes such as numpy ints accepted), checked to be in
    [1, maximum]; raises ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, torch.SymInt):
        return value
    number = as_int(value)
    if number is None or number < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name}: expected at most {maximum}, got {number}")
    return number


BAD_IDS = "alltoall_ops.dispatch: topk_idx holds expert ids outside [-1, num_experts)"
"""The message of the device-side assert that a bad expert id raises on CUDA, found on the device
by the routing plan (torch takes fewer than 255 characters)."""


def check_topk_idx(topk_idx: torch.Tensor, x: Optional[torch.Tensor] = None) -> None:
    """Raise unless ``topk_idx`` is a 2-D integer tensor (T, K); with ``x`` (T, H), unless it
    also has x's T rows, K >= 1 columns and x's device."""
    _require_tensor("topk_idx", topk_idx)
    dtype = topk_idx.dtype
    if topk_idx.ndim != 2 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"topk_idx: expected a 2-D integer tensor (T, K), got {_describe(topk_idx)}")
    if x is None:
        return
    if topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_idx: expected {x.shape[0]} rows (T of x), got {_describe(topk_idx)}"
        )
    if topk_idx.shape[1] < 1:
        raise ValueError(f"topk_idx: expected K >= 1 columns, got {_describe(topk_idx)}")
    if topk_idx.device != x.device:
        raise ValueError(f"topk_idx: expected device {x.device} (that of x), got {topk_idx.device}")


def check_num_experts(num_experts: int, world_size: int) -> int:
    """``num_experts`` as an int, checked to be positive and a multiple of the group size."""
    num_experts = positive_int("num_experts", num_experts)
    if num_experts % world_size != 0:
        raise ValueError(
            f"num_experts: expected a multiple of the group size {world_size}, got {num_experts}"
        )
    return num_experts


def check_top_k(top_k: int, num_experts: int, name: str = "top_k") -> None:
    """Raise unless 1 <= ``top_k`` <= ``num_experts`` (a router's or a config's K)."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{name}: expected 1 <= top_k <= num_experts = {num_experts}, got {top_k}")


def check_dispatch_args(
    x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, world_size: int, expert_alignment: int
) -> int:
    """Raise on a bad dispatch argument; return ``num_experts`` as an int."""
    _require_float_matrix("x", x, "(T, H)")
    check_topk_idx(topk_idx, x)
    num_experts = check_num_experts(num_experts, world_size)
    positive_int("expert_alignment", expert_alignment, MAX_EXPERT_ALIGNMENT)
    return num_experts


def check_layout_args(topk_idx: torch.Tensor, num_experts: int, world_size: int, num_nodes: int) -> tuple[int, int]:
    """Raise on a bad ``dispatch_layout`` argument; return (num_experts, num_nodes) as ints."""
    check_topk_idx(topk_idx)
    num_experts = check_num_experts(num_experts, world_size)
    num_nodes = positive_int("num_nodes", num_nodes)
    if world_size % num_nodes != 0:
        raise ValueError(f"num_nodes: expected a divisor of the group size {world_size}, got {num_nodes}")
    return num_experts, num_nodes


def check_counts(counts: torch.Tensor, world_size: int) -> None:
    """Raise on a bad ``exchange_counts`` argument: (E,) integer counts, E a multiple of W."""
    if not isinstance(counts, torch.Tensor) or counts.ndim != 1 or counts.dtype.is_floating_point \
            or counts.dtype == torch.bool:
        got = _describe(counts) if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise TypeError(f"tokens_per_expert_global: expected a 1-D integer tensor of shape (E,), got {got}")
    if counts.shape[0] % world_size != 0:
        raise ValueError(
            f"tokens_per_expert_global: expected a length E that is a multiple of the group size {world_size}, "
            f"got E = {counts.shape[0]}"
        )


def check_payload_args(
    x_TH: torch.Tensor, x_scale_TB: Optional[torch.Tensor], payload_dtype: Optional[torch.dtype], dequantize: bool
) -> None:
    """Raise on a bad payload argument of a dispatch: x (T, H) (with ``x_scale_TB``: fp8 values
    and their (T, H / 128) fp32 scales), ``payload_dtype``, ``dequantize``; shapes and dtypes
    only, so every rank raises alike."""
    if not isinstance(x_TH, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor or a pair (values, scales), got {type(x_TH).__name__}")
    _require_float_matrix("x", x_TH, "(T, H)")
    if x_scale_TB is not None and not isinstance(x_scale_TB, torch.Tensor):
        raise TypeError(f"x: expected scales as a torch.Tensor, got {type(x_scale_TB).__name__}")
    fp8.check_payload_dtype(payload_dtype)
    if x_scale_TB is None:
        if x_TH.dtype == fp8.FP8:
            raise ValueError("x: an fp8 x comes with its scales: pass x=(values, scales) "
                             "(see alltoall_ops.fp8.quantize)")
        if payload_dtype is None:
            if dequantize:
                raise ValueError("dequantize: only an fp8 payload is dequantized; pass "
                                 "payload_dtype=torch.float8_e4m3fn")
            return
    elif x_TH.dtype != fp8.FP8:
        raise TypeError(
            f"x: expected (values, scales) with values of dtype {fp8.FP8}, got values of dtype {x_TH.dtype}"
        )
    T, H = x_TH.shape
    fp8.check_hidden("x", H)
    if x_scale_TB is not None:
        expected = (T, fp8.num_blocks(H))
        if x_scale_TB.dtype != torch.float32 or tuple(x_scale_TB.shape) != expected:
            raise TypeError(
                f"x: expected scales of dtype torch.float32 and shape {expected} (one per {fp8.BLOCK} channels), "
                f"got {x_scale_TB.dtype} of shape {tuple(x_scale_TB.shape)}"
            )
        if x_scale_TB.device != x_TH.device:
            raise ValueError(f"x: expected scales on {x_TH.device} (that of the values), got {x_scale_TB.device}")
    if x_TH.requires_grad and torch.is_grad_enabled() and not dequantize:
        raise ValueError(
            "x requires grad, but fp8 rows cannot carry a gradient: pass dequantize=True (rows travel as fp8 and "
            "arrive dequantized in x's dtype; the backward is a combine of the gradient), or detach x"
        )


def check_combine_args(expert_out: torch.Tensor, handle, topk_weights: Optional[torch.Tensor]) -> None:
    """Raise on a bad combine argument (``handle``: a ``DispatchHandle``)."""
    _require_float_matrix("expert_out", expert_out, "(R, H)")
    position = handle.position_TK
    if expert_out.device != position.device:
        raise ValueError(f"expert_out: expected device {position.device}, got {expert_out.device}")
    if topk_weights is None:
        return
    _require_float_matrix("topk_weights", topk_weights, "(T, K)")
    if tuple(topk_weights.shape) != tuple(position.shape):
        raise ValueError(
            f"topk_weights: expected shape (T, K) = {tuple(position.shape)} of the dispatch, "
            f"got {_describe(topk_weights)}"
        )
    if topk_weights.device != expert_out.device:
        raise ValueError(f"topk_weights: expected device {expert_out.device}, got {topk_weights.device}")


def check_combine_rows(expert_out: torch.Tensor, num_rows) -> None:
    """expert_out must have the R rows its dispatch returned (a host check of two sizes, no
    sync; under torch.compile a runtime assertion on the symbolic sizes)."""
    rows = expert_out.shape[0]
    if is_compiling():  # NB: dynamo takes only a message without captured values
        torch._check(rows == num_rows, lambda: "combine: expert_out must have the rows its dispatch returned")
    elif rows != num_rows:
        raise ValueError(f"combine: expert_out has {rows} rows but its handle's dispatch returned {num_rows}; "
                         f"pass the expert outputs of that same dispatch")
