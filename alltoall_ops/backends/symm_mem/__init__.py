"""The ``symm_mem`` backend: dispatch / combine through peer-addressable buffers and Triton
kernels, with no host sync, so a dispatch + combine step captures in a CUDA graph.

Modules: ``segments`` (the allocators), ``buffers`` (``SymmBuffers``, ``run_simulated``), ``ops``
(the custom ops, their fakes and autograd, the checks of the exchanged metadata), ``backend``
(the routing on the device, ``SymmMemHandle``, cached eager buffers, ``SymmMemBackend``). The
kernels are in :mod:`alltoall_ops.kernels`. See docs/symm_mem.md.

Every rank holds one :class:`SymmBuffers` (created collectively, once). Its segment, which every
peer can read and write, holds three regions; one (1, W) int64 *address table* per region on
the device gives its address on every rank, and the kernels reach every region through them
(compiled code holds the tables as constants, never the regions):

    tags  (1 + N_max, 3) int64  of each slot this rank sends, after a header (T, K, 0), read by
                        its receivers: destination code (-1 none), source code ``rank * N_max +
                        send_position``, scale bits
    rows  (N_max, H)    this rank's slots coming back from combine, in send order; during a
                        dispatch, its stage: this rank's rows (once per token), which peers read
                        (sized for T_max fp8 wire rows too)
    meta  (W, L) int64  row s: rank s's counts per global expert, its routing status, its N,
                        alignment, failure flag and call number (``buffers.META_EXTRA`` columns)

One call of an op (``write peers; barrier; read into fresh tensors; barrier``: a dispatch's
receivers pull each row from its sender's stage) leaves nothing behind that a later
call could overwrite: every returned tensor is a copy, so any number of layers may share one
``SymmBuffers``, in any order, with autograd, recomputation and selective checkpointing.

Allocators, one op code: CUDA symmetric memory (``torch.distributed._symmetric_memory``, one
process per GPU, barriers are a signal-pad kernel); a CPU stand-in (a shared-memory segment per
rank mapped by every peer, Triton's interpreter, barriers through the process group); simulated
peers in one process (all ranks' segments on one device, one thread per rank; barriers order
the threads, the device runs their work in order on one stream); one rank (no peers).

Capacity rule: ``C = W * max_tokens_per_rank * top_k + e * (expert_alignment - 1)`` rows by
default: the most a rank can receive (every slot of every rank routed to it, each local
expert's group padded). ``capacity=`` may set a smaller C; more rows than C is *overflow*.
"""


from .backend import SymmMemBackend, SymmMemHandle
from .buffers import SymmBuffers, run_simulated
from .ulysses_buffers import UlyssesBuffers

__all__ = ["SymmBuffers", "SymmMemBackend", "SymmMemHandle", "UlyssesBuffers", "run_simulated"]
