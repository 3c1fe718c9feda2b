"""Allocators: memory every rank of a group can write (one rank, a CPU shared-memory stand-in,
CUDA symmetric memory, simulated peers in one process), and their barriers.

Every barrier carries a *stamp*, ``call * 4 + op``: the op (``META_OP``, ``DISPATCH_OP``, ``COMBINE_OP``;
a backward is the op it runs) and the call number of the metadata exchange it belongs to (a
dispatch's, and so its combine's and their backwards'). Ranks whose stamps at one barrier differ
are out of step (a combine met a dispatch, or another layer's combine): the CPU stand-in raises
:class:`GroupMismatchError` on every rank at once; the CUDA barrier kernel fails a device-side
assert. The call number is device data (``call_1``): a CUDA graph's replays carry their own.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
import uuid
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from ... import comm
from ..._compat import graph_constant
from ...errors import CollectiveError, CollectiveTimeout, GroupMismatchError
from ...groups import Group, process_group
from ...kernels import loader

INLINE_SYMMETRIC = "ALLTOALL_OPS_INLINE_SYMMETRIC"
"""The environment variable that, set to 0 while a graph is traced, keeps symm_mem's ops on CUDA
symmetric memory opaque calls (``_CudaSymmetricSegments.device_ordered``; inlined by default)."""

META_OP, DISPATCH_OP, COMBINE_OP = 1, 2, 3
"""Barrier op codes: the metadata exchange, a dispatch's row put, a combine's row put."""
_OP_NAMES = {META_OP: "a dispatch's metadata exchange", DISPATCH_OP: "a dispatch's rows (or a combine's backward)",
             COMBINE_OP: "a combine (or a dispatch's backward)"}


def stamp(op: int, call: int) -> int:
    """What a barrier of ``op`` in the step of metadata exchange ``call`` carries (the CUDA kernel
    keeps its low 31 bits)."""
    return call * 4 + op


def describe_stamp(value: int) -> str:
    return f"{_OP_NAMES.get(value % 4, f'op {value % 4}')} of call {value // 4}"


def setup_gather(group_name: str, obj: Any) -> list:
    """Every rank's ``obj``, by rank: an exchange while SymmBuffers are created. A failed one (a
    peer that exited) raises :class:`CollectiveError` named like every fault
    (``alltoall_ops.SymmBuffers on group <name> (rank r of W)``)."""
    pg = process_group(group_name)
    out: list = [None] * pg.size()
    try:
        dist.all_gather_object(out, obj, group=pg)
    except RuntimeError as exc:
        raise CollectiveError(f"{comm.where('SymmBuffers', pg)}: failed while the ranks created their buffers "
                              f"(a peer exited or stalled?): {exc}") from exc
    return out


def check_same_sizes(kind: str, fields: str, sizes: tuple, group_name: str) -> None:
    """Every rank must create its ``kind`` buffers with the same ``sizes`` (named by ``fields``):
    one exchange at set-up (:func:`setup_gather`); a difference raises ValueError on every rank."""
    by_rank = setup_gather(group_name, sizes)
    if any(s != by_rank[0] for s in by_rank):
        raise ValueError(f"{kind}: every rank must pass the same sizes; got ({fields}) = {by_rank} (by rank)")


def address_table(addresses: list[int], device: torch.device) -> torch.Tensor:
    """Device addresses as a (1, n) int64 tensor: what kernels index (``table[0, i]``) and compiled
    code holds as a constant (see ``SymmBuffers.tables``)."""
    return torch.tensor([addresses], dtype=torch.int64, device=device)


class _Segments:
    """This rank's segment (``local``, uint8) and every rank's segment base (``bases``)."""

    local: torch.Tensor
    bases: list[int]
    calls_1: torch.Tensor
    """(1,) int64 on the segment's device: the barriers with ``advance`` so far (call numbers)."""
    device_ordered = True
    """Whether the barriers are device work (or nothing), so that an op's body is a sequence of
    kernels compiled code can launch with no Python between them (it is then inlined)."""

    def barrier(self, op: int, call_1: torch.Tensor, advance: bool = False,
                token: Optional[torch.Tensor] = None) -> None:
        """Return once every rank has reached the barrier (in device order for device work),
        stamped ``stamp(op, call_1)``. call_1: (1,) int64 on the device; with ``advance`` (the
        metadata exchange) first set to this rank's next call number on the segments. One rank
        has no peers: nothing to wait for or compare, call_1 is left as it is. token: the op's
        ordering token (``kernels._config.order_after``), which a barrier kernel sets."""

    @contextlib.contextmanager
    def barrier_after(self, op: int, call_1: torch.Tensor, token: Optional[torch.Tensor] = None,
                      advance_before: bool = False, advance_after: bool = False) -> Iterator[Optional[Any]]:
        """The barrier after the kernel the block launches, which writes peers' memory or reads
        what they write next (and with ``advance_before``, the metadata exchange's, one advancing
        the call before it; with ``advance_after``, that barrier advances the call): barriers
        here, around the block, which gets None; or fused into that kernel (CUDA symmetric memory),
        which then gets their ``kernels.barrier.Epilogue`` (a one-program kernel with
        ``advance_before``: ``put_meta``; ``advance_after``: the Ulysses post)."""
        if advance_before:
            self.barrier(op, call_1, advance=True, token=token)
        yield None
        self.barrier(op, call_1, advance=advance_after, token=token)

    def setup_barrier(self) -> None:
        """A host-level barrier for set-up, before any op runs."""

    def gather_objects(self, obj: Any) -> list:
        """Every rank's ``obj``, by rank (a host exchange, for error messages only)."""
        return [obj]

    def compiled_addresses(self) -> tuple[int, ...]:
        """The device addresses compiled code may hold as constants (of the segments, and of what
        an inlined barrier reaches): the buffers' repr names them, which AOTAutograd's cache keys
        a graph on (a hit in another process must not run on this one's addresses)."""
        return tuple(self.bases)


class _LocalSegments(_Segments):
    """One rank: plain device memory, nothing to wait for."""

    def __init__(self, nbytes: int, device: torch.device):
        self.local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.bases = [self.local.data_ptr()]
        self.calls_1 = torch.zeros(1, dtype=torch.int64, device=device)


class _SharedMemorySegments(_Segments):
    """CPU stand-in for symmetric memory: each rank creates a file-backed shared mapping
    (``/dev/shm`` where it exists), every peer maps it, and the file is unlinked once all have.
    Barriers go through the process group; their stamps through (2, W) int64 pads past the
    segment (pad[i % 2, s]: rank s's stamp at barrier i; a peer writes pad i % 2 again only after
    barrier i + 1, which this rank enters after reading it)."""

    device_ordered = False

    def __init__(self, nbytes: int, group: Group, timeout: float):
        self._pg = process_group(group.name)
        self._rank, self._timeout = group.rank, timeout
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        name = os.path.join(folder, f"alltoall_ops_{uuid.uuid4().hex}_{group.rank}")
        size = nbytes + 2 * group.size * 8  # nbytes: a multiple of the regions' alignment (256)
        mapped = torch.from_file(name, shared=True, size=size, dtype=torch.uint8)
        mapped.zero_()
        try:
            names = setup_gather(self._pg.group_name, name)
            peers = [mapped if r == group.rank else torch.from_file(names[r], shared=True, size=size, dtype=torch.uint8)
                     for r in range(group.size)]
            self.setup_barrier()  # every peer has mapped every file
        finally:
            os.unlink(name)
        self._peers = peers  # the mappings outlive their addresses in the pointer tables
        self.local = mapped[:nbytes]
        self.bases = [t.data_ptr() for t in peers]
        self._pads = [t[nbytes:].view(torch.int64).view(2, group.size) for t in peers]  # every rank's pads
        self._barriers = 0  # barriers passed: selects the pad
        self.calls_1 = torch.zeros(1, dtype=torch.int64)

    def barrier(self, op: int, call_1: torch.Tensor, advance: bool = False,
                token: Optional[torch.Tensor] = None) -> None:
        if advance:
            call_1.copy_(self.calls_1.add_(1))
        mine, i = stamp(op, int(call_1)), self._barriers % 2
        for pads in self._pads:
            pads[i, self._rank] = mine
        comm.run("symm_mem barrier", self._pg.group_name, lambda pg: dist.barrier(group=pg, async_op=True),
                 timeout=self._timeout)
        self._barriers += 1
        seen = self._pads[self._rank][i].tolist()
        if any(s != mine for s in seen):
            per_rank = ", ".join(f"rank {r} is in {describe_stamp(s)}" for r, s in enumerate(seen))
            raise GroupMismatchError(
                f"{comm.where('symm_mem', self._pg)}: the ranks are out of step on these SymmBuffers: {per_rank}; "
                "every rank must run dispatch, combine and their backwards on the same buffers in the same order"
            )

    def setup_barrier(self) -> None:
        comm.run("SymmBuffers", self._pg.group_name, lambda pg: dist.barrier(group=pg, async_op=True),
                 timeout=self._timeout)

    def gather_objects(self, obj: Any) -> list:
        return comm.gather_objects("symm_mem", self._pg.group_name, obj)


class _CudaSymmetricSegments(_Segments):
    """CUDA symmetric memory (one process per GPU): ``empty`` + ``rendezvous``; barriers are a
    kernel on the signal pads."""

    @property
    def device_ordered(self) -> bool:
        """Barrier kernels are device work: their ops are inlined, unless
        ``ALLTOALL_OPS_INLINE_SYMMETRIC=0`` (each op one opaque call; docs/gpu.md)."""
        return os.environ.get(INLINE_SYMMETRIC, "1") != "0"

    def __init__(self, nbytes: int, group: Group, device: torch.device, timeout: float):
        import torch.distributed._symmetric_memory as symm_mem

        self._timeout = timeout
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required on torch 2.11
            symm_mem.enable_symm_mem_for_group(group.name)
        self._rank = group.rank
        self._pg = process_group(group.name)
        self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.local.zero_()
        try:
            self._handle = symm_mem.rendezvous(self.local, group.name)
        except RuntimeError as exc:
            raise CollectiveError(f"{comm.where('SymmBuffers', self._pg)}: symmetric-memory rendezvous failed: "
                                  f"{exc}") from exc
        self.bases = list(self._handle.buffer_ptrs)
        self.pads_table = address_table(list(self._handle.signal_pad_ptrs), device)
        self.calls_1 = torch.zeros(1, dtype=torch.int64, device=device)
        self._done_1 = torch.zeros(1, dtype=torch.int64, device=device)  # a fused barrier's done programs
        # NB: compiled code holds the addresses (immutable) as constants, never the counters themselves
        self._counters = address_table([self.calls_1.data_ptr(), self._done_1.data_ptr()], device)

    def barrier(self, op: int, call_1: torch.Tensor, advance: bool = False,
                token: Optional[torch.Tensor] = None) -> None:
        loader.load().barrier(graph_constant(self.pads_table), self._rank, self._timeout, op, call_1,
                              graph_constant(self._counters) if advance else None, token)

    @contextlib.contextmanager
    def barrier_after(self, op: int, call_1: torch.Tensor, token: Optional[torch.Tensor] = None,
                      advance_before: bool = False, advance_after: bool = False) -> Iterator[Optional[Any]]:
        yield loader.load().Epilogue(graph_constant(self.pads_table), graph_constant(self._counters), self._rank,
                                     self._timeout, op, call_1, advance_before, advance_after)

    def compiled_addresses(self) -> tuple[int, ...]:
        return (*self.bases, *self._handle.signal_pad_ptrs, self.calls_1.data_ptr(), self._done_1.data_ptr())

    def setup_barrier(self) -> None:
        torch.cuda.synchronize(self.local.device)
        comm.run("SymmBuffers", self._pg.group_name, lambda pg: dist.barrier(group=pg, async_op=True))

    def gather_objects(self, obj: Any) -> list:
        return comm.gather_objects("symm_mem", self._pg.group_name, obj)


class _SimulatedSegments(_Segments):
    """Simulated peers: every rank's segment on one device of one process, one thread per rank.

    The barrier is a thread barrier: every thread has queued its work before any goes on, and
    one device stream runs queued work in order, so no host-device sync is needed (CUDA graph
    capture works when every thread queues onto the capturing stream). Its stamps are not
    compared (that would read the device); the metadata checks compare the call numbers."""

    def __init__(self, local: torch.Tensor, bases: list[int], barrier: threading.Barrier, timeout: float, rank: int,
                 board: list):
        self.local, self.bases = local, bases
        self._barrier, self._timeout = barrier, timeout  # the barrier's own timeout
        self._rank, self._board = rank, board  # board: one slot per rank, shared by the threads
        self.calls_1 = torch.zeros(1, dtype=torch.int64, device=local.device)

    device_ordered = False  # a thread barrier: Python between the kernels

    def barrier(self, op: int, call_1: torch.Tensor, advance: bool = False,
                token: Optional[torch.Tensor] = None) -> None:
        if advance:
            call_1.copy_(self.calls_1.add_(1))
        self._wait()

    def gather_objects(self, obj: Any) -> list:
        self._board[self._rank] = obj
        self._wait()
        out = list(self._board)
        self._wait()  # every thread has read the board before it is written again
        return out

    def _wait(self) -> None:
        """The thread barrier. The rank whose wait ran out raises CollectiveTimeout (the ranks
        that were waiting with it see the barrier broken: BrokenBarrierError, as after
        :meth:`abort`, which ``run_simulated`` takes for a consequence, not the cause)."""
        started = time.monotonic()
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError as exc:
            waited = time.monotonic() - started
            if waited < self._timeout:  # NB: broken by another thread (its timeout, or abort)
                raise
            raise CollectiveTimeout(f"alltoall_ops.symm_mem barrier (simulated rank {self._rank} of "
                                    f"{self._barrier.parties}): timed out after {waited:.3g} s: a peer did not "
                                    f"arrive within the buffers' timeout ({self._timeout:g} s)") from exc

    def setup_barrier(self) -> None:
        pass  # all segments are set up by one thread

    def abort(self) -> None:
        self._barrier.abort()


def make_segments(nbytes: int, group: Group, device: torch.device, timeout: float,
                  symmetric: bool = False) -> _Segments:
    """This rank's segment of ``nbytes`` for ``group``: plain memory for one rank (unless
    ``symmetric``: torch symmetric memory, a check of that path on a one-GPU host), the CPU
    stand-in on the CPU, CUDA symmetric memory on a GPU."""
    if group.size == 1 and not symmetric:
        return _LocalSegments(nbytes, device)
    if device.type == "cpu":
        return _SharedMemorySegments(nbytes, group, timeout)
    return _CudaSymmetricSegments(nbytes, group, device, timeout)


def simulated_segments(world_size: int, nbytes: int, device: torch.device, timeout: float) -> list[_SimulatedSegments]:
    """The segments of ``world_size`` simulated ranks on one device (one thread per rank)."""
    locals_ = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world_size)]
    bases = [t.data_ptr() for t in locals_]
    barrier = threading.Barrier(world_size, timeout=timeout)
    board: list = [None] * world_size
    return [_SimulatedSegments(local, bases, barrier, timeout, rank, board) for rank, local in enumerate(locals_)]
