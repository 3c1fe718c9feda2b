"""Device-side barrier over signal pads (CUDA symmetric memory only), stamped with the op and
call number it belongs to.

Every rank owns a pad of W int32 flags that all peers can reach. Reference semantics, with
``stamp = (call * 4 + op) mod 2**31`` (never 0: op is 1, 2 or 3) and ``call = call_1[0]``
(with a counter: first ``count += 1; call_1[0] = count``)::

    for peer in range(W): wait until pad[peer][rank] == 0, then set it to stamp   (release)
    for peer in range(W): wait until pad[rank][peer] != 0, read it, set it to 0   (acquire)
    assert every value read == stamp                                              (out of step)

The release / acquire pair orders every write this rank issued before the barrier (earlier
kernels on its stream) before every read a peer issues after it. The flags return to 0, so the
barrier can be reused at once. Every rank reads every rank's stamp, so ranks out of step (a
combine meeting a dispatch, or another layer's combine) all fail the same barrier, before any
row moves. The call number is read on the device: a CUDA graph's replays carry their own. It
spins, so it needs all ranks' barrier kernels to run concurrently: real processes (one per GPU),
never the Triton interpreter, whose programs run one after another; the CPU path synchronises
through the process group instead. A rank that does not arrive within the deadline makes the
waiting kernels fail (a CUDA error), never spin forever.

Both failures are a device-side assert naming the cause (the launch takes ``assert_options``;
inductor compiles the kernels it launches with their asserts). Nothing in the kernel is opaque to
inductor's analysis of which arguments a kernel writes (Triton IR): the deadline's clock is a
*pure* inline-asm read of ``%globaltimer`` whose operand is the previous reading (so it is read
again at every turn of a spin loop, never hoisted), and the kernel writes only ``call_out`` and the
token. So compiled code that inlines an op's barriers neither clones nor copies around them.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._config import LAUNCH_LOCK, assert_options, launch, order_after
from .region import or_new_token


@triton.jit
def _now_ns(dep):
    """The GPU's global timer in ns. The asm is pure (inductor's analysis of written arguments
    skips only pure asm), so the compiler reads the timer again only for a new operand ``dep``."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64,
                                     is_pure=True, pack=1)


@triton.jit
def _waited(start, now, timeout_ns):
    """The timer read again (its operand the last reading ``now``: a new value at every turn of
    a spin loop), asserting that no more than timeout_ns (int64) passed since ``start``."""
    now = _now_ns(now)
    tl.device_assert(now - start <= timeout_ns,
                     "alltoall_ops symm_mem barrier: a peer did not arrive within the buffers' timeout")
    return now


@triton.jit
def arrive_and_wait(pads_table_ptr, rank, timeout_ms, call, op, after, WORLD_SIZE: tl.constexpr):
    """The barrier itself (one program): this rank's stamp of (call, op) into every rank's pad
    (release, system scope), then every rank's stamp out of its own (acquire), asserting that all
    are equal and that all arrive within timeout_ms of the clock's first reading, whose operand is
    ``after`` (two barriers in one kernel need different ones, or they share that reading). A
    kernel that fuses it orders its other threads' work around it with ``tl.debug_barrier``."""
    timeout_ns = tl.cast(timeout_ms, tl.int64) * 1_000_000  # NB: a Python int where torch 2.11 specializes it
    start = _now_ns(after)
    now = start
    stamp = ((call * 4 + op) & 0x7FFFFFFF).to(tl.int32)
    p_own = tl.load(pads_table_ptr + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD_SIZE):
        p_peer = tl.load(pads_table_ptr + peer).to(tl.pointer_type(tl.int32))
        old = tl.atomic_cas(p_peer + rank, 0, stamp, sem="release", scope="sys")
        while old != 0:
            now = _waited(start, now, timeout_ns)
            old = tl.atomic_cas(p_peer + rank, 0, stamp, sem="release", scope="sys")
    mismatch = 0
    for peer in tl.static_range(WORLD_SIZE):
        seen = tl.atomic_xchg(p_own + peer, 0, sem="acquire", scope="sys")
        while seen == 0:
            now = _waited(start, now, timeout_ns)
            seen = tl.atomic_xchg(p_own + peer, 0, sem="acquire", scope="sys")
        mismatch |= (seen != stamp).to(tl.int32)
    tl.device_assert(mismatch == 0, "alltoall_ops symm_mem barrier: the ranks are out of step (their op or call "
                     "number differ: a combine met a dispatch, or another layer's op)")


@triton.jit
def advance_call(counters_ptr, call_out_ptr):
    """This rank's next call number: its count of calls (at address ``counters_ptr[0]``) + 1,
    stored back and into ``call_out`` (1,). One program."""
    count_ptr = tl.load(counters_ptr).to(tl.pointer_type(tl.int64))
    call = tl.load(count_ptr) + 1
    tl.store(count_ptr, call)
    tl.store(call_out_ptr, call)
    return call


@triton.jit
def last_program_arrives(pads_table_ptr, counters_ptr, rank, timeout_ms, call_ptr, op, WORLD_SIZE: tl.constexpr,
                         ADVANCE: tl.constexpr):
    """The barrier after a kernel's writes into peers' memory, as its epilogue: every program
    counts itself done (acquire-release, system scope, once all its threads' writes are issued),
    and the last one resets the count (at address ``counters_ptr[1]``) and runs the barrier.
    Release is cumulative, so the barrier's release orders every program's writes before the
    peers' reads; no program waits for another (no residency assumption). ADVANCE: the barrier
    first sets ``call_ptr`` to this rank's next call number (``advance_call``); every program
    has read the count before it counted itself done."""
    tl.debug_barrier()
    done_ptr = tl.load(counters_ptr + 1).to(tl.pointer_type(tl.int64))
    n_programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    done_before = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="sys")
    if done_before == n_programs - 1:
        tl.store(done_ptr, 0)  # NB: read again only by a later kernel on this stream
        if ADVANCE:
            call = advance_call(counters_ptr, call_ptr)
        else:
            call = tl.load(call_ptr)
        arrive_and_wait(pads_table_ptr, rank, timeout_ms, call, op, done_before, WORLD_SIZE)


# NB: rank is not specialised: every rank runs the same binary. (Specialised, rank 1 got its
# own kernel; its first launch loaded a module while rank 0's barrier spun on the device, which
# CUDA's lazy module loading can turn into a deadlock when ranks share a process.) Nor are op
# and advance: one binary for every barrier.
@triton.jit(do_not_specialize=["rank", "timeout_ms", "op", "advance"])
def _barrier_kernel(pads_table_ptr, rank, timeout_ms, op, call_in_ptr, call_out_ptr, counters_ptr, advance,
                    token_ptr, WORLD_SIZE: tl.constexpr):
    order_after(token_ptr)
    if advance != 0:
        call = advance_call(counters_ptr, call_out_ptr)
    else:
        call = tl.load(call_in_ptr)
    arrive_and_wait(pads_table_ptr, rank, timeout_ms, call, op, rank, WORLD_SIZE)


MAX_DEVICE_TIMEOUT_MS = 2**31 - 1
"""The longest deadline a barrier kernel keeps (about 24.8 days): its argument is an int32 of
milliseconds, since inductor (torch 2.11) cannot pass a Python int of 32 bits or more to a user
kernel. Longer timeouts are cut to it."""


def _device_timeout_ms(timeout_s: float) -> int:
    """timeout_s in whole milliseconds, rounded up, at most MAX_DEVICE_TIMEOUT_MS."""
    return min(math.ceil(timeout_s * 1e3), MAX_DEVICE_TIMEOUT_MS)


def barrier(pads_table: torch.Tensor, rank: int, timeout_s: float, op: int, call_1: torch.Tensor,
            counter: Optional[torch.Tensor] = None, token: Optional[torch.Tensor] = None) -> None:
    """Wait on the current stream until every rank of the pads' group reaches this barrier.

    pads_table: (W,) int64 device addresses of every rank's signal pad (W int32 flags each).
    op: 1, 2 or 3, the op the barrier belongs to. call_1: (1,) int64 on the device, the call
    number; with counter ((1,) int64 holding the address of this rank's count of calls, an int64)
    it is first set to ``count += 1`` (the one case where the kernel writes it). token: as
    ``put_rows``'. Ranks whose (op, call) differ, or past timeout_s, fail a device-side assert:
    the launch fails with a CUDA error (the context is then unusable, as after any device-side
    fault) instead of pairing different ops or spinning forever."""
    token = or_new_token(token, call_1.device)
    with LAUNCH_LOCK:
        launch(_barrier_kernel, pads_table)[(1,)](
            pads_table, rank, _device_timeout_ms(timeout_s), op, call_1, token if counter is None else call_1,
            call_1 if counter is None else counter, int(counter is not None), token,
            WORLD_SIZE=pads_table.numel(), num_warps=1, **assert_options(call_1))


def barrier_alone(epilogue: "Epilogue", token: Optional[torch.Tensor] = None) -> None:
    """``epilogue``'s barrier launched by itself, where its kernel has nothing to do (its peers
    still meet it), advancing the call number where the epilogue would (``advance_after``)."""
    barrier(epilogue.pads_table, epilogue.rank, epilogue.timeout_s, epilogue.op, epilogue.call_1,
            epilogue.counters if epilogue.advance_after else None, token)


class Epilogue(NamedTuple):
    """The barrier after a kernel that writes peers' memory or reads memory that peers write
    next, fused into that kernel (``last_program_arrives``): one launch fewer per barrier.
    pads_table (W,) as ``barrier``'s; counters (2,) int64, the addresses of this rank's count of
    calls and of its count of done programs (int64, zero between kernels); the barrier's op, and
    call_1 (1,), its call number.
    ``advance_before``: the barrier before the writes too, which sets call_1 to this rank's next
    call number: a one-program kernel only (``put_meta``), which the other kernels refuse.
    ``advance_after``: the barrier after the writes sets call_1 to this rank's next call number
    (the Ulysses post, whose programs read the count first); the kernels that do not advance it
    refuse it, and that post refuses an epilogue without it."""

    pads_table: torch.Tensor
    counters: torch.Tensor
    rank: int
    timeout_s: float
    op: int
    call_1: torch.Tensor
    advance_before: bool = False
    advance_after: bool = False


def epilogue_args(epilogue: Optional[Epilogue], like: torch.Tensor, one_program: bool = False,
                  advances: bool = False) -> dict:
    """A fusing kernel's arguments for ``epilogue``, launch options included (its asserts), or
    without one ``BARRIER`` False and ``like`` in place of its tensors. one_program: the kernel
    runs both barriers in one program (``Epilogue.advance_before`` must say so); advances: its
    barrier after the writes advances the call number (``Epilogue.advance_after`` must say so)."""
    if epilogue is not None and epilogue.advance_before != one_program:
        raise ValueError(f"epilogue: advance_before={epilogue.advance_before} in a kernel that "
                         f"{'is' if one_program else 'is not'} one program "
                         "(put_meta is; post_slots, pull_rows, put_rows and topk_reduce are not)")
    if epilogue is not None and epilogue.advance_after != advances:
        raise ValueError(f"epilogue: advance_after={epilogue.advance_after} in a kernel whose barrier "
                         f"{'advances' if advances else 'does not advance'} the call number "
                         "(the Ulysses post's does; post_slots, pull_rows, put_rows and topk_reduce's do not)")
    if epilogue is None:
        return dict(pads_table_ptr=like, counters_ptr=like, barrier_call_ptr=like, barrier_rank=0, timeout_ms=0,
                    barrier_op=0, BARRIER=False, WORLD_SIZE=1)
    return dict(pads_table_ptr=epilogue.pads_table, counters_ptr=epilogue.counters, barrier_call_ptr=epilogue.call_1,
                barrier_rank=epilogue.rank, timeout_ms=_device_timeout_ms(epilogue.timeout_s), barrier_op=epilogue.op,
                BARRIER=True, WORLD_SIZE=epilogue.pads_table.numel(), **assert_options(epilogue.call_1))

