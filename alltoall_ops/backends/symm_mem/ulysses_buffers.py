"""``UlyssesBuffers``: the stage slots of the Ulysses exchange over peer-addressable memory
(``seq_to_head`` / ``head_to_seq`` / ``ulysses_attention`` with ``buffers=``; the exchange is
``ulysses_exchange.symm_exchange``, its kernels ``kernels/seq_exchange.py``)."""

from __future__ import annotations

import math
import uuid
from typing import Any, Optional, Sequence

import torch

from ..._compat import register_value_type
from ...comm import get_timeout
from ...groups import resolve_group
from ...kernels.loader import check_kernels_run_on
from ...kernels.region import SEQ_STAGE_START
from ...layout import round_up
from ...validation import positive_int
from .buffers import PeerBuffers, _default_device
from .segments import _Segments, address_table, check_same_sizes, make_segments, simulated_segments

PIECE_ALIGN = 256
"""Byte alignment of each tensor of an exchange in a stage slot."""


class UlyssesBuffers(PeerBuffers):
    """Peer-addressable stage slots for the Ulysses exchange (``backend`` symm_mem): pass them as
    ``buffers=`` to :func:`alltoall_ops.seq_to_head`, :func:`~alltoall_ops.head_to_seq` or
    :func:`~alltoall_ops.ulysses_attention`, and the exchange runs as Triton kernels over them:
    each rank copies its tensors into its own stage (but its own piece), one barrier, and each
    rank reads its piece of every peer's stage straight into its place in a fresh output, no
    permute on either side, no host sync (CUDA-graph capturable), a 64-byte header in the stage
    checked on the device.

    Collective: every rank of ``group`` creates them with the same ``max_bytes``, once. Under
    torch.compile they are a constant of the graph (an opaque value type, like ``SymmBuffers``).
    One set serves any number of exchanges, in any order, with autograd and recomputation:
    every output is a fresh tensor. Memory per rank: two stage slots (exchange c uses slot c % 2,
    so one barrier per exchange suffices), ``2 * max_bytes`` plus 256 bytes.

    Args:
        max_bytes: the most bytes one rank posts in one exchange: the sum over the exchanged
            tensors of their bytes on the rank with the most heads, each rounded up to 256
            (:meth:`bytes_for` computes it for given shapes).
        group: ProcessGroup, 1-D DeviceMesh or None (the default group).
        device: cuda (default when there is one) or cpu (the kernels in Triton's interpreter over
            a shared-memory stand-in, as ``SymmBuffers``).
        timeout: seconds a barrier waits for its peers (default: the library's deadline).
        num_sms: None or the SM budget of the exchange's kernels on this rank.
    """

    _CONFIG_FIELDS = "rank, W, max_bytes, device type, group, num_sms"

    def __init__(self, max_bytes: int, group: Any = None, device: Any = None, *, timeout: Optional[float] = None,
                 num_sms: Optional[int] = None):
        grp = resolve_group(group)
        device = _default_device(device)
        max_bytes, num_sms = _checked_sizes(max_bytes, num_sms)
        check_kernels_run_on(device)
        if grp.size > 1:
            check_same_sizes("UlyssesBuffers", "max_bytes, device type", (max_bytes, device.type), grp.name)
        timeout = get_timeout() if timeout is None else timeout
        segments = make_segments(_segment_bytes(max_bytes), grp, device, timeout)
        self._setup(grp.rank, grp.size, grp.name, max_bytes, device, num_sms, segments)

    @classmethod
    def simulated(cls, world_size: int, max_bytes: int, device: Any = None, *, timeout: float = 120.0,
                  num_sms: Optional[int] = None) -> list["UlyssesBuffers"]:
        """Buffers of ``world_size`` simulated ranks in this process, on one device: run rank r's
        calls with ``buffers[r]`` in its own thread (:func:`alltoall_ops.run_simulated`)."""
        device = _default_device(device)
        max_bytes, num_sms = _checked_sizes(max_bytes, num_sms)
        check_kernels_run_on(device)
        name = f"simulated-{uuid.uuid4().hex[:8]}"
        out = []
        for rank, segments in enumerate(simulated_segments(world_size, _segment_bytes(max_bytes), device, timeout)):
            bufs = cls.__new__(cls)
            bufs._setup(rank, world_size, name, max_bytes, device, num_sms, segments)
            out.append(bufs)
        return out

    @staticmethod
    def bytes_for(shapes: Sequence[Sequence[int]], dtype: torch.dtype, world_size: int, head_dim: int = 2) -> int:
        """``max_bytes`` for exchanges of tensors of ``shapes`` (as one rank passes them to
        seq_to_head, e.g. q, k, v's (B, S/W, H, D)) in ``dtype`` over ``world_size`` ranks, and their
        way back (head_to_seq, the backward): each with ceil(H / W) * W heads."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        total = 0
        for shape in shapes:
            heads = shape[head_dim]
            padded = -(-heads // world_size) * world_size
            total += round_up(math.prod(shape) // max(heads, 1) * padded * itemsize, PIECE_ALIGN)
        return max(total, 1)

    def _setup(self, rank: int, world_size: int, group_name: str, max_bytes: int, device: torch.device,
               num_sms: Optional[int], segments: _Segments) -> None:
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        self.max_bytes, self.device, self.num_sms = max_bytes, device, num_sms
        self.slot_bytes = round_up(max_bytes, PIECE_ALIGN)
        self._segments = segments
        self.plans: dict = {}  # the Ulysses plans of exchanges on these buffers, by arguments
        self._config_key = (rank, world_size, max_bytes, device.type, group_name, num_sms,
                            segments.compiled_addresses())
        # (1, W) int64: every rank's segment address (immutable; the kernels reach the stages by it)
        self.table = address_table(list(segments.bases), device)
        segments.setup_barrier()

    def __repr__(self) -> str:
        return (f"UlyssesBuffers(rank={self.rank}, world_size={self.world_size}, max_bytes={self.max_bytes}, "
                f"device={self.device}" + ("" if self.num_sms is None else f", num_sms={self.num_sms}") + ")")


def _checked_sizes(max_bytes: Any, num_sms: Any) -> tuple[int, Optional[int]]:
    return positive_int("max_bytes", max_bytes), None if num_sms is None else positive_int("num_sms", num_sms)


def _segment_bytes(max_bytes: int) -> int:
    return SEQ_STAGE_START + 2 * round_up(max_bytes, PIECE_ALIGN)


register_value_type(UlyssesBuffers, constant_members=("rank", "world_size", "group_name", "max_bytes", "device",
                                                      "num_sms", "slot_bytes"))
