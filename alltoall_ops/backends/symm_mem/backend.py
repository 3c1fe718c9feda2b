"""The ``symm_mem`` backend: :class:`SymmMemHandle`, buffers cached for eager calls, and
:class:`SymmMemBackend` (see the package docstring and docs/symm_mem.md)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ... import comm, overlap
from ..._compat import call, is_compiling
from ...errors import CapacityError, CollectiveError, PeerInputError
from ...groups import LOCAL, Group, process_group
from ...payload import PLAIN, Payload, op_kwargs, routed
from ...validation import check_combine_args, check_dispatch_args
from ..base import Backend, DispatchHandle, save_returned
from .buffers import CALL, SymmBuffers, check_payload
from .ops import SlotArgs, symm_combine_op, symm_dispatch_op, symm_exchange_meta_op


# --------------------------------------------------------------------------------------------
# Public entry points (called by alltoall_ops.dispatch / combine)


@dataclasses.dataclass(frozen=True)
class SymmMemHandle(DispatchHandle):
    """What ``combine`` needs to undo one symm_mem ``dispatch``; tensors, ints and the buffers.

    position_TK: each slot's send position; meta_WL: every rank's counts; slot_dst_N:
    destination of each slot; row_slot_C: one rank's slot of each routed row (with peers (2 e,):
    each local expert's padding rows); row_src_C: source of each routed row (rows past
    num_routed_1 unwritten); num_routed_1: (1,) rows of routed with data,
    tokens_per_expert.sum(); call_1: (1,) the call number of the dispatch's metadata exchange,
    which its combine's barriers carry; dropped_W: slots past each rank's capacity
    (overflow='drop'); num_rows: C."""

    position_TK: torch.Tensor
    meta_WL: torch.Tensor
    slot_dst_N: torch.Tensor
    row_slot_C: torch.Tensor
    row_src_C: torch.Tensor
    num_routed_1: torch.Tensor
    call_1: torch.Tensor
    dropped_W: torch.Tensor
    buffers: SymmBuffers
    num_rows: int
    expert_alignment: int

    @property
    def slots(self) -> SlotArgs:
        return SlotArgs(self.position_TK, self.slot_dst_N, self.row_slot_C, self.num_routed_1, self.call_1,
                        self.buffers)

    @property
    def group_name(self) -> str:
        return self.buffers.group_name

    @property
    def world_size(self) -> int:
        return self.buffers.world_size

    def check_combine(self, expert_out_CH: torch.Tensor, topk_weights_TK: Optional[torch.Tensor]) -> None:
        check_combine_args(expert_out_CH, self, topk_weights_TK)
        bufs = self.buffers
        if tuple(expert_out_CH.shape) != (bufs.capacity, bufs.hidden) or expert_out_CH.dtype != bufs.dtype:
            raise ValueError(
                f"expert_out: expected the {bufs.dtype} shape (C, H) = ({bufs.capacity}, {bufs.hidden}) of "
                f"routed, got {expert_out_CH.dtype} of shape {tuple(expert_out_CH.shape)}"
            )

    def combine(self, expert_out_CH: torch.Tensor, topk_weights_TK: Optional[torch.Tensor], *,
                async_op: bool = False) -> torch.Tensor:
        """y (T, H); rows of expert_out that dispatch did not fill (padding, rows past
        tokens_per_expert.sum()) are ignored."""
        if not async_op:  # NB: an async start queues after a pending one on the communication stream
            overlap.check_nothing_pending(self.buffers, "combine")
        self.check_combine_everywhere(expert_out_CH, topk_weights_TK)  # without debug mode, a rank that
        # raises here leaves its peers in the op's barrier until the deadline
        y_TH, _ = call(symm_combine_op, expert_out_CH=expert_out_CH, weights_TK=topk_weights_TK,
                       row_src_C=self.row_src_C, **self.slots.kwargs(), save_returned=save_returned(topk_weights_TK),
                       async_op=async_op, differentiable=(expert_out_CH, topk_weights_TK))
        return y_TH


_AUTO_BUFFERS: dict[tuple, SymmBuffers] = {}


def cached_buffers(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, grp: Group,
                   expert_alignment: int, payload: Optional[Payload] = None) -> SymmBuffers:
    """Eager convenience: buffers cached per (group, H, dtype, device, payload dtype), created
    sized from the largest T, K and expert_alignment over the ranks and re-created larger when a
    call needs more, on every rank alike. Collective: the sizes go through one agreement per call
    (a host sync), which is why compiled code must pass ``buffers=``. With an fp8 ``payload`` the
    buffers' dtype is its combine dtype. The arguments passed ``SymmMemBackend.check_dispatch``."""
    if is_compiling():
        raise RuntimeError(
            "dispatch(backend='symm_mem') under torch.compile needs buffers=: create "
            "alltoall_ops.SymmBuffers(max_tokens_per_rank=..., hidden=..., top_k=..., num_experts=..., "
            "dtype=..., device=..., group=...) once, outside the compiled region, and pass it in"
        )
    (T, H), K = x.shape, topk_idx.shape[1]
    dtype, payload_dtype = (x.dtype, None) if payload is None else (payload.combine_dtype, payload.format.payload_dtype)
    sizes = [T, K, expert_alignment]
    if grp.name != LOCAL:  # equal E, H, dtype and payload dtype; the largest T, K and alignment
        codes = [comm.dtype_code(dtype), comm.dtype_code(payload_dtype or dtype)]
        fields = comm.agree("symm_buffers", grp.name, [num_experts, H, *codes, *sizes], equal=4)
        sizes = [max(row[4 + i] for row in fields) for i in range(3)]
    t_max, k_max, a_max = sizes
    key = (grp.name, H, dtype, x.device, payload_dtype)
    bufs = _AUTO_BUFFERS.get(key)
    if (bufs is None or bufs.max_tokens_per_rank < t_max or bufs.top_k < k_max
            or bufs.num_experts != num_experts or bufs.expert_alignment < a_max):
        if bufs is not None:
            t_max, k_max, a_max = (max(t_max, bufs.max_tokens_per_rank), max(k_max, bufs.top_k),
                                   max(a_max, bufs.expert_alignment))
        group = None if grp.name == LOCAL else process_group(grp.name)
        bufs = SymmBuffers(max(t_max, 1), H, k_max, num_experts, dtype, x.device, group, expert_alignment=a_max,
                           payload_dtype=payload_dtype)
        _AUTO_BUFFERS[key] = bufs
    return bufs


def _check_buffers_fit(
    bufs: SymmBuffers, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, group: Group, expert_alignment: int,
    payload: Optional[Payload] = None,
) -> int:
    """The dispatch's checks against its buffers; returns E as an int."""
    num_experts = check_dispatch_args(x, topk_idx, num_experts, bufs.world_size, expert_alignment)
    if group.name != bufs.group_name:
        raise ValueError(
            f"group: the buffers were created for group {bufs.group_name!r}, got group "
            f"{group.name!r}; pass group=None or the buffers' group"
        )
    check_payload(bufs, PLAIN if payload is None else payload.format)
    dtype = x.dtype if payload is None else payload.combine_dtype  # fp8: the dtype of the expert outputs
    if dtype != bufs.dtype or x.shape[1] != bufs.hidden or x.device != bufs.device:
        got = f"{x.dtype}" if payload is None else f"{x.dtype} (expert outputs and gradients in {dtype})"
        raise ValueError(
            f"x: the buffers hold {bufs.dtype} rows of H = {bufs.hidden} on {bufs.device}, got "
            f"{got} of shape {tuple(x.shape)} on {x.device}"
        )
    if topk_idx.shape[1] > bufs.top_k:
        raise CapacityError(f"topk_idx: the buffers were sized for top_k = {bufs.top_k}, got K = {topk_idx.shape[1]}")
    if num_experts != bufs.num_experts:
        raise ValueError(f"num_experts: the buffers were created for E = {bufs.num_experts}, got {num_experts}")
    if expert_alignment > bufs.expert_alignment:
        raise CapacityError(
            f"expert_alignment: the buffers were sized for expert_alignment <= {bufs.expert_alignment}, got "
            f"{expert_alignment}; create SymmBuffers with expert_alignment={expert_alignment}"
        )
    return num_experts


class SymmMemBackend(Backend):
    """Peer-addressable buffers and Triton kernels: no host sync, CUDA-graph capturable."""

    name = "symm_mem"

    def check_group(self, group: Group, buffers: Any) -> None:
        if buffers is not None and not isinstance(buffers, SymmBuffers):
            raise TypeError(f"buffers: expected alltoall_ops.SymmBuffers, got {type(buffers).__name__}")

    def check_dispatch(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, *, num_experts: int, group: Group,
                       expert_alignment: int, buffers: Optional[SymmBuffers], payload: Optional[Payload]) -> int:
        """With ``buffers``, the checks against them too (:func:`_check_buffers_fit`); without, the
        group's (the eager buffers are then made to fit every rank's call: :func:`cached_buffers`)."""
        if buffers is None:
            return super().check_dispatch(x_TH, topk_idx_TK, num_experts=num_experts, group=group,
                                          expert_alignment=expert_alignment, buffers=buffers, payload=payload)
        return _check_buffers_fit(buffers, x_TH, topk_idx_TK, num_experts, group, expert_alignment, payload)

    def tell_peers(self, group: Group, buffers: Any, error: BaseException) -> None:
        """With ``buffers``: a failure row through their metadata exchange, where the peers wait,
        so they raise a PeerInputError; without: the group's agreement (:func:`cached_buffers`' exchange)."""
        if not isinstance(buffers, SymmBuffers):  # NB: "auto"'s channel may tell of buffers of a wrong type
            return super().tell_peers(group, buffers, error)
        if buffers.world_size == 1:
            return
        buffers._own_error = f"{type(error).__name__}: {error}"
        try:
            no_slots = torch.empty(0, 1, dtype=torch.int64, device=buffers.device)
            symm_exchange_meta_op(no_slots, buffers, 1, failed=True)
        except (PeerInputError, CollectiveError):
            pass  # what the peers raise, or peers later than the deadline (not told); this rank raises its own error
        finally:
            buffers._own_error = None

    def dispatch(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, *, num_experts: int, group: Group,
                 expert_alignment: int, buffers: Optional[SymmBuffers], payload: Optional[Payload],
                 async_op: bool) -> tuple[Any, torch.Tensor, SymmMemHandle]:
        """routed (C, H), tokens_per_expert (e,), handle. The first ``tokens_per_expert.sum()``
        rows of routed are the collective backend's routed rows; the rest are unspecified (not
        written). With an fp8 ``payload`` (buffers created with ``payload_dtype``): routed is the
        pair (values (C, H) float8_e4m3fn, scales (C, H / 128) fp32), or with ``out_dtype`` the
        rows dequantized to it."""
        bufs = buffers
        if bufs is None:
            bufs = cached_buffers(x_TH, topk_idx_TK, num_experts, group, expert_alignment, payload)
        overlap.check_nothing_pending(bufs, "dispatch")  # NB: even an async dispatch exchanges the metadata in place
        E = bufs.num_experts
        position_TK, meta_WL, slot_dst_N, row_slot_C, tokens_per_expert_e, num_routed_1, dropped_W = call(
            symm_exchange_meta_op, topk_idx_TK, bufs, expert_alignment)
        call_1 = meta_WL[bufs.rank, E + CALL : E + CALL + 1]  # this step's (device)
        slots = SlotArgs(position_TK, slot_dst_N, row_slot_C, num_routed_1, call_1, bufs)
        routed_CH, scale_CB, row_src_C = call(symm_dispatch_op, x_TH=x_TH, scale_TK=None, **slots.kwargs(),
                                              **op_kwargs(payload), async_op=async_op,
                                              differentiable=(x_TH,))
        handle = SymmMemHandle(position_TK, meta_WL, slot_dst_N, row_slot_C, row_src_C, num_routed_1, call_1,
                               dropped_W, bufs, bufs.capacity, expert_alignment)
        return routed(payload, routed_CH, scale_CB), tokens_per_expert_e, handle
