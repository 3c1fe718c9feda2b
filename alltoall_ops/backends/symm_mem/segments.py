"""Allocators: memory every rank of a group can write (one rank, a CPU shared-memory stand-in,
CUDA symmetric memory, simulated peers in one process)."""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
from typing import Any

import torch
import torch.distributed as dist

from ... import comm
from ...groups import Group, process_group
from ...kernels import loader


class _Segments:
    """This rank's segment (``local``, uint8) and every rank's segment base (``bases``)."""

    local: torch.Tensor
    bases: list[int]

    def barrier(self) -> None:
        """Return once every rank has reached the barrier (in device order for device work)."""

    def setup_barrier(self) -> None:
        """A host-level barrier for set-up, before any op runs."""
        self.barrier()

    def gather_objects(self, obj: Any) -> list:
        """Every rank's ``obj``, by rank (a host exchange, for error messages only)."""
        return [obj]


class _LocalSegments(_Segments):
    """One rank: plain device memory, nothing to wait for."""

    def __init__(self, nbytes: int, device: torch.device):
        self.local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.bases = [self.local.data_ptr()]


class _SharedMemorySegments(_Segments):
    """CPU stand-in for symmetric memory: each rank creates a file-backed shared mapping
    (``/dev/shm`` where it exists), every peer maps it, and the file is unlinked once all have.
    Barriers go through the process group."""

    def __init__(self, nbytes: int, group: Group, timeout: float):
        self._pg = process_group(group.name)
        self._timeout = timeout
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        name = os.path.join(folder, f"alltoall_ops_{uuid.uuid4().hex}_{group.rank}")
        self.local = torch.from_file(name, shared=True, size=nbytes, dtype=torch.uint8)
        self.local.zero_()
        names: list[Any] = [None] * group.size
        try:
            dist.all_gather_object(names, name, group=self._pg)
            self._peers = [
                self.local if r == group.rank
                else torch.from_file(names[r], shared=True, size=nbytes, dtype=torch.uint8)
                for r in range(group.size)
            ]
            dist.barrier(group=self._pg)  # every peer has mapped every file
        finally:
            os.unlink(name)
        self.bases = [t.data_ptr() for t in self._peers]

    def barrier(self) -> None:
        comm.run("symm_mem barrier", self._pg.group_name, lambda pg: dist.barrier(group=pg, async_op=True),
                 timeout=self._timeout)

    def gather_objects(self, obj: Any) -> list:
        return comm.gather_objects("symm_mem", self._pg.group_name, obj)


class _CudaSymmetricSegments(_Segments):
    """CUDA symmetric memory (one process per GPU): ``empty`` + ``rendezvous``; barriers are a
    kernel on the signal pads."""

    def __init__(self, nbytes: int, group: Group, device: torch.device, timeout: float):
        import torch.distributed._symmetric_memory as symm_mem

        self._timeout = timeout
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required on torch 2.11
            symm_mem.enable_symm_mem_for_group(group.name)
        self._rank = group.rank
        self._pg = process_group(group.name)
        self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.local.zero_()
        self._handle = symm_mem.rendezvous(self.local, group.name)
        self.bases = list(self._handle.buffer_ptrs)
        self.pads_table = torch.tensor(list(self._handle.signal_pad_ptrs), dtype=torch.int64, device=device)

    def barrier(self) -> None:
        loader.load().barrier(self.pads_table, self._rank, self._timeout)

    def setup_barrier(self) -> None:
        torch.cuda.synchronize(self.local.device)
        dist.barrier(group=self._pg)

    def gather_objects(self, obj: Any) -> list:
        return comm.gather_objects("symm_mem", self._pg.group_name, obj)


class _SimulatedSegments(_Segments):
    """Simulated peers: every rank's segment on one device of one process, one thread per rank.

    The barrier is a thread barrier: every thread has queued its work before any goes on, and
    one device stream runs queued work in order, so no host-device sync is needed (CUDA graph
    capture works when every thread queues onto the capturing stream)."""

    def __init__(self, local: torch.Tensor, bases: list[int], barrier: threading.Barrier, rank: int,
                 board: list):
        self.local, self.bases = local, bases
        self._barrier = barrier
        self._rank, self._board = rank, board  # board: one slot per rank, shared by the threads

    def barrier(self) -> None:
        self._barrier.wait()

    def gather_objects(self, obj: Any) -> list:
        self._board[self._rank] = obj
        self._barrier.wait()
        out = list(self._board)
        self._barrier.wait()  # every thread has read the board before it is written again
        return out

    def setup_barrier(self) -> None:
        pass  # all segments are set up by one thread

    def abort(self) -> None:
        self._barrier.abort()
