"""Triton kernels (``pip install alltoall_ops[triton]``): the ``symm_mem`` backend's, and on CUDA
the routing layout, row puts and top-k reduction of every backend.

Each file pairs a ``_name_kernel`` (``triton.jit``) with its launcher ``name``. The kernels
address peer memory through a pointer table: an int64 tensor holding one base address per rank,
cast to a typed pointer inside the kernel, so the same kernels serve CUDA symmetric memory,
the CPU shared-memory stand-in (Triton interpreter) and simulated peers in one process.

Importing this package needs Triton; on a machine without CUDA the caller must set
``TRITON_INTERPRET=1`` first (``alltoall_ops.symm_mem`` does).
"""

from __future__ import annotations

import triton

from ._config import interpreting, row_blocks
from .barrier import barrier
from .routing import plan_slots
from .symm_combine import combine_reduce, combine_weight_grad
from .symm_dispatch import dispatch_copy_out, put_meta, put_rows

__all__ = [
    "barrier", "combine_reduce", "combine_weight_grad", "dispatch_copy_out", "interpreting",
    "plan_slots", "put_meta", "put_rows", "row_blocks", "triton",
]
