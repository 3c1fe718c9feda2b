"""Public entry points: ``dispatch``, ``combine``, ``exchange_counts``, ``dispatch_layout``.

A dispatch chooses its backend once (:func:`backends.choose`), runs its checks once through that
backend's failure channel (``Backend.checked``), then the backend's ``dispatch`` (plan, move);
a combine is its handle's (check, move)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from . import backends, comm, layout
from .backends import DispatchHandle
from .backends.collective import exchange_counts_op
from .groups import Group, resolve_group
from .payload import Payload
from .validation import check_bool, check_counts, check_layout_args, check_payload_args


def dispatch(
    x: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]],
    topk_idx: torch.Tensor,
    *,
    num_experts: int,
    group: Any = None,
    backend: str = "auto",
    expert_alignment: int = 1,
    buffers: Any = None,
    payload_dtype: Optional[torch.dtype] = None,
    dequantize: bool = False,
    async_op: bool = False,
) -> tuple[Any, torch.Tensor, DispatchHandle]:
    """Send each token to the ranks that own its top-k experts.

    Args:
        x: (T, H) float tokens of this rank; T may be 0. Or a pair (values (T, H)
            float8_e4m3fn, scales (T, H / 128) fp32) already quantized (:func:`fp8.quantize`):
            rows travel as fp8, as with ``payload_dtype``.
        topk_idx: (T, K) integer global expert ids in [0, E); -1 drops the slot.
        num_experts: E, divisible by the group size W; rank r owns experts [r*e, (r+1)*e).
        group: ProcessGroup, 1-D DeviceMesh, or None (default group; no group when
            torch.distributed is not initialised; with ``buffers``, the buffers' group).
        backend: "auto" | "local" | "collective" | "symm_mem" (device-side, no host sync; see
            :mod:`alltoall_ops.backends.symm_mem`). "auto": "symm_mem" when ``buffers`` is given,
            "local" for one rank, else "collective".
        expert_alignment: pad each local expert's row group to a multiple of this.
        buffers: a :class:`SymmBuffers` for backend "symm_mem" (required under torch.compile;
            eager calls without it create and cache buffers).
        payload_dtype: None (rows travel in x's dtype) or ``torch.float8_e4m3fn``: each token is
            quantized once per 128 channels (H divisible by 128) and rows travel as fp8
            values plus fp32 scales, 0.52x a bf16 row's bytes (:mod:`alltoall_ops.fp8`).
            Backends "local", "collective" and "symm_mem" (buffers created with
            ``payload_dtype=torch.float8_e4m3fn``).
        dequantize: with an fp8 payload, return the routed rows dequantized to x's dtype (bf16
            for an fp8 x) instead of (values, scales); the only fp8 mode where x may require
            grad: the backward is the combine of the gradient (the quantize is straight-through).
        async_op: start the rows' exchange on a communication stream and return at once:
            routed (and every output) is ready after :func:`wait` ``(routed)``; work that does
            not read it can run in between (:mod:`alltoall_ops.overlap`). The routing plan and
            the counts' exchange run before the return, as without it.

    Returns:
        routed: (R, H) received rows, grouped by local expert, then source rank, then source
            token order; padding rows are zero. With "symm_mem", R is the buffers' fixed
            capacity C and rows past ``tokens_per_expert.sum()`` are unspecified (not written,
            may hold NaN): keep them out of every result and gradient (combine ignores them).
            With an fp8 payload and ``dequantize=False``: the pair (values (R, H)
            float8_e4m3fn, scales (R, H / 128) fp32) in that layout, zero padding rows.
        tokens_per_expert: (e,) int64 rows of ``routed`` per local expert, padding included.
        handle: a :class:`DispatchHandle` for :func:`combine`.

    Example::

        routed, tokens_per_expert, handle = dispatch(x, topk_idx, num_experts=8)
        y = combine(experts(routed, tokens_per_expert), handle, topk_weights)
    """
    grp = _group_of(group, buffers)
    # NB: a choice that fails raises on every rank before any payload moves: its peers, who may have
    # chosen well, are told in the failure channel of the backend "auto" picks, where they wait first.
    impl = backends.auto(grp, buffers).checked(grp, buffers, backends.choose, backend, grp, buffers)
    x_TH, x_scale_TB = x if isinstance(x, (tuple, list)) else (x, None)
    E, payload = impl.checked(grp, buffers, _check_dispatch, impl, x_TH, x_scale_TB, topk_idx, num_experts, grp,
                              expert_alignment, buffers, payload_dtype, dequantize, async_op)
    return impl.dispatch(x_TH, topk_idx, num_experts=E, group=grp, expert_alignment=expert_alignment,
                         buffers=buffers, payload=payload, async_op=async_op)


def _group_of(group: Any, buffers: Any) -> Group:
    """The dispatch's group: ``group`` resolved; with buffers and group=None, the buffers' group."""
    if group is None and buffers is not None and hasattr(buffers, "group_name"):
        return Group(buffers.group_name, buffers.rank, buffers.world_size)
    return resolve_group(group)


def _check_dispatch(impl: backends.Backend, x_TH: torch.Tensor, x_scale_TB: Optional[torch.Tensor],
                    topk_idx: torch.Tensor, num_experts: int, group: Group, expert_alignment: int, buffers: Any,
                    payload_dtype: Optional[torch.dtype], dequantize: bool,
                    async_op: bool) -> tuple[int, Optional[Payload]]:
    """Every check of one dispatch, once (shapes, dtypes and ints, no tensor read): the payload's
    and the backend's. Returns E as an int and the payload (None: plain rows)."""
    check_payload_args(x_TH, x_scale_TB, payload_dtype, dequantize)
    check_bool("async_op", async_op)
    payload = None
    if x_scale_TB is not None or payload_dtype is not None:
        payload = Payload.of(x_TH, x_scale_TB, dequantize)
    E = impl.check_dispatch(x_TH, topk_idx, num_experts=num_experts, group=group, expert_alignment=expert_alignment,
                            buffers=buffers, payload=payload)
    return E, payload


def combine(
    expert_out: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None, *,
    async_op: bool = False,
) -> torch.Tensor:
    """Bring expert outputs back and reduce each token's top-k slots.

    Args:
        expert_out: (R, H) rows in the order ``dispatch`` returned them. On a group (W > 1),
            in the dispatched hidden size and dtype, so that every rank's rows mean the same.
        handle: the :class:`DispatchHandle` of that dispatch.
        topk_weights: (T, K) float router weights, or None for weight 1.
        async_op: start the exchange on a communication stream and return at once: y is ready
            after :func:`wait` ``(y)``; work that does not read it (a shared expert) runs in
            between (:mod:`alltoall_ops.overlap`).

    Returns:
        y: (T, H) in expert_out's dtype, y[t] = sum_k w[t, k] * expert_out[row of (t, k)],
        accumulated in fp32 (fp64 for fp64 inputs) and rounded once; padding rows and -1
        slots contribute nothing.
    """
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle: expected the DispatchHandle returned by dispatch, got {type(handle).__name__}")
    return handle.combine(expert_out, topk_weights, async_op=check_bool("async_op", async_op))


def dispatch_layout(
    topk_idx: torch.Tensor, *, num_experts: int, group: Any = None, num_nodes: int = 1
) -> layout.DispatchLayout:
    """What this rank's routing sends where, before any communication (DeepEP's dispatch
    layout): tokens per rank (W,), slots per expert (E,), tokens per node (num_nodes,) and
    is_token_in_rank (T, W) bool; see :class:`alltoall_ops.layout.DispatchLayout`.

    Args:
        topk_idx: (T, K) integer global expert ids; -1 (and any id outside [0, E)) counts nowhere.
        num_experts: E, divisible by the group size W; rank r owns experts [r*e, (r+1)*e).
        group: as in :func:`dispatch`; gives W (nothing is exchanged).
        num_nodes: nodes the W ranks span, W / num_nodes consecutive ranks each.

    One op (``alltoall_ops::dispatch_layout``), no host sync: usable to size buffers, and under
    torch.compile or a CUDA graph."""
    grp = resolve_group(group)
    E, nodes = check_layout_args(topk_idx, num_experts, grp.size, num_nodes)
    return layout.DispatchLayout(*layout.dispatch_layout_op(topk_idx, E, grp.size, nodes))


def exchange_counts(
    tokens_per_expert_global: torch.Tensor, group: Any = None, backend: str = "auto"
) -> torch.Tensor:
    """(E,) counts this rank sends to each global expert -> (W, e) counts it receives:
    ``out[s, j]`` is what rank s sends to this rank's local expert j.

    backend: how the counts move. "local": one rank, no process group needed, nothing moves
    (the output is the input as (1, E)); "collective": the group's header agreement and one
    all-to-all (a host sync); "auto": "local" on one rank, else "collective". "symm_mem" is
    refused: its counts move inside its dispatch, through the buffers' metadata exchange
    (``symm_exchange_meta``), which needs the dispatch's buffers."""
    grp = resolve_group(group)
    comm.checked("exchange_counts", grp.name, _check_counts, tokens_per_expert_global, grp, backend)
    E = tokens_per_expert_global.shape[0]
    send_We = tokens_per_expert_global.to(torch.int64).view(grp.size, -1)
    return exchange_counts_op(send_We, grp.name, comm.header("exchange_counts", E))


def _check_counts(counts: torch.Tensor, group: Group, backend: str) -> None:
    if backends.choose(backend, group).name not in COUNTS_BACKENDS:
        raise ValueError(
            f"backend: exchange_counts runs on {COUNTS_BACKENDS} (symm_mem exchanges its counts inside its "
            f"dispatch, through the buffers' metadata exchange), got {backend!r}"
        )
    check_counts(counts, group.size)


COUNTS_BACKENDS = ("local", "collective")
"""The backends whose transport ``exchange_counts`` has ("auto" picks one of them)."""
