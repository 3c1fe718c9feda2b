"""Device-side barrier over signal pads (CUDA symmetric memory only).

Every rank owns a pad of W int32 flags that all peers can reach. Reference semantics::

    for peer in range(W): wait until pad[peer][rank] == 0, then set it to 1     (release)
    for peer in range(W): wait until pad[rank][peer] == 1, then set it to 0     (acquire)

The release / acquire pair orders every write this rank issued before the barrier (earlier
kernels on its stream) before every read a peer issues after it. The flags return to 0, so the
barrier can be reused at once. It spins, so it needs all ranks' barrier kernels to run
concurrently: real processes (one per GPU), never the Triton interpreter, whose programs run one
after another; the CPU path synchronises through the process group instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._config import LAUNCH_LOCK


# NB: rank is not specialised: every rank runs the same binary. (Specialised, rank 1 got its
# own kernel; its first launch loaded a module while rank 0's barrier spun on the device, which
# CUDA's lazy module loading can turn into a deadlock when ranks share a process.)
@triton.jit(do_not_specialize=["rank"])
def _barrier_kernel(pads_table_ptr, rank, WORLD_SIZE: tl.constexpr):
    p_own = tl.load(pads_table_ptr + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD_SIZE):
        p_peer = tl.load(pads_table_ptr + peer).to(tl.pointer_type(tl.int32))
        old = tl.atomic_cas(p_peer + rank, 0, 1, sem="release", scope="sys")
        while old != 0:
            old = tl.atomic_cas(p_peer + rank, 0, 1, sem="release", scope="sys")
    for peer in tl.static_range(WORLD_SIZE):
        old = tl.atomic_cas(p_own + peer, 1, 0, sem="acquire", scope="sys")
        while old != 1:
            old = tl.atomic_cas(p_own + peer, 1, 0, sem="acquire", scope="sys")


def barrier(pads_table: torch.Tensor, rank: int) -> None:
    """Wait on the current stream until every rank of the pads' group reaches this barrier.

    pads_table: (W,) int64 device addresses of every rank's signal pad (W int32 flags each)."""
    with LAUNCH_LOCK:
        _barrier_kernel[(1,)](pads_table, rank, WORLD_SIZE=pads_table.numel(), num_warps=1)
