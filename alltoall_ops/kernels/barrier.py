"""Device-side barrier over signal pads (CUDA symmetric memory only).

Every rank owns a pad of W int32 flags that all peers can reach. Reference semantics::

    for peer in range(W): wait until pad[peer][rank] == 0, then set it to 1     (release)
    for peer in range(W): wait until pad[rank][peer] == 1, then set it to 0     (acquire)

The release / acquire pair orders every write this rank issued before the barrier (earlier
kernels on its stream) before every read a peer issues after it. The flags return to 0, so the
barrier can be reused at once. It spins, so it needs all ranks' barrier kernels to run
concurrently: real processes (one per GPU), never the Triton interpreter, whose programs run one
after another; the CPU path synchronises through the process group instead. A rank that does not
arrive within the deadline makes the waiting kernels trap (a CUDA error), never spin forever.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._config import LAUNCH_LOCK


@triton.jit
def _now_ns(dep):
    """The GPU's global timer in ns (``dep``: any scalar, for the asm's operand list)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _trap(dep):
    """Abort the kernel: the launch fails and the CUDA context reports an error at the next sync."""
    tl.inline_asm_elementwise("trap;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)


# NB: rank is not specialised: every rank runs the same binary. (Specialised, rank 1 got its
# own kernel; its first launch loaded a module while rank 0's barrier spun on the device, which
# CUDA's lazy module loading can turn into a deadlock when ranks share a process.)
@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def _barrier_kernel(pads_table_ptr, rank, timeout_ns, WORLD_SIZE: tl.constexpr):
    start = _now_ns(rank)
    p_own = tl.load(pads_table_ptr + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD_SIZE):
        p_peer = tl.load(pads_table_ptr + peer).to(tl.pointer_type(tl.int32))
        old = tl.atomic_cas(p_peer + rank, 0, 1, sem="release", scope="sys")
        while old != 0:
            if _now_ns(rank) - start > timeout_ns:
                _trap(rank)
            old = tl.atomic_cas(p_peer + rank, 0, 1, sem="release", scope="sys")
    for peer in tl.static_range(WORLD_SIZE):
        old = tl.atomic_cas(p_own + peer, 1, 0, sem="acquire", scope="sys")
        while old != 1:
            if _now_ns(rank) - start > timeout_ns:
                _trap(rank)
            old = tl.atomic_cas(p_own + peer, 1, 0, sem="acquire", scope="sys")


def barrier(pads_table: torch.Tensor, rank: int, timeout_s: float) -> None:
    """Wait on the current stream until every rank of the pads' group reaches this barrier.

    pads_table: (W,) int64 device addresses of every rank's signal pad (W int32 flags each).
    timeout_s: past it the kernel traps: the launch fails with a CUDA error (the context is then
    unusable, as after any device-side fault) instead of spinning forever."""
    with LAUNCH_LOCK:
        _barrier_kernel[(1,)](pads_table, rank, int(timeout_s * 1e9), WORLD_SIZE=pads_table.numel(), num_warps=1)
