"""Triton kernels (``pip install alltoall_ops[triton]``), one file per job, each pairing a
``_name_kernel`` (``triton.jit``) with its launcher ``name``:

    routing_plan.py  ``plan_slots``: the send order of every slot, without a sort (layout);
                     ``plan_rows``: one rank's padded expert-major rows (the local backend)
    row_gather.py    ``gather_rows``: one rank's expert-major rows from its tokens (local dispatch)
    row_put.py       ``put_rows`` / ``put_meta``: rows and metadata rows into local or peer buffers
                     (``put_meta`` can plan the slots first, in its one program);
                     ``post_slots`` / ``pull_rows``: a dispatch's two halves, each row read
                     by its receiver from its sender's stage into a fresh tensor
    topk_reduce.py   ``topk_reduce``: each token's weighted sum over its top-k slots (combine)
    weight_grad.py   ``weight_grad``: the gradient of the routing weights / dispatch scale
    barrier.py       ``barrier``: the symm_mem backend's signal-pad barrier, with a deadline
    slot_placement.py ``place_slots``: the symm_mem backend's metadata checks and where each
                     slot lands, one launch
    _config.py       launch blocks per kernel, shared helpers (exact casts, the ordering token)
    region.py        ``Region``: a buffer named by its address (what compiled code may hold)

Kernels address peer memory through a pointer table: an int64 tensor holding one base address
per rank, cast to a typed pointer inside the kernel, so the same kernels serve CUDA symmetric
memory, the CPU shared-memory stand-in (Triton's interpreter) and simulated peers.

Nothing here imports Triton until a kernel is needed: :func:`loader.load` does.
"""

from .loader import load, use_kernels

__all__ = ["load", "use_kernels"]
