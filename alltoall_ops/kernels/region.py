"""Memory a kernel reaches by address, and the token that orders such kernels (imports no Triton:
the ops name regions of the buffers)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


TAG_COLUMNS = 3
"""Columns of a sent slot's tag (int64; ``kernels.row_put``, in its sender's tags after a header
row (rows, slots a row, 0)): its destination code (``peer * stride + row``, -1: no row), its
source code (``rank * N_max + send position``), and its scale (the bits of one value of the
accumulation dtype, 0 without a scale)."""


SEQ_HEADER_FIELDS = ("op", "exchange", "ulysses_attention arguments", "dtype", "ndim", "seq_dim", "head_dim", "shape")
"""The header at the start of every piece of a Ulysses exchange (``ulysses_exchange``), one int64
each, in a UlyssesBuffers segment too (``kernels/seq_exchange.py``; there ``exchange`` is the
device call number). ``shape``: a fingerprint of the shape every rank shares; ``ulysses_attention
arguments``: a fingerprint of ``ulysses.attention_args``, 0 for a plain seq_to_head / head_to_seq."""
SEQ_HEADER_WORDS = len(SEQ_HEADER_FIELDS)
SEQ_REJECTED_DTYPE = -1
"""The dtype word of a header that says its rank rejected its arguments (``ulysses_exchange.symm_tell_peers``)."""
SEQ_STAGE_START = 256
"""Byte offset of the first stage slot in a UlyssesBuffers segment, past its two header slots."""


class Region(NamedTuple):
    """A contiguous (rows, columns) array of ``dtype`` named by its address: ``table[index]``
    (an int64 on the device) holds its base, 16-byte aligned (the kernels declare it, so that
    rows move as vectors; the symm_mem regions are 256-byte aligned). Kernels reach the symm_mem
    buffers this way, so that compiled code needs only the immutable address table as a constant,
    never the buffers (which a compile cache would copy, and CUDA graphs would copy into their
    pool)."""

    table: torch.Tensor
    index: int
    shape: tuple[int, int]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> "Region":
        """The region of a contiguous 2-D (or 1-D: one column) tensor ``t`` (eager code and tests)."""
        if not t.is_contiguous():
            raise ValueError(f"Region.of: the tensor must be contiguous, got strides {t.stride()}")
        if t.data_ptr() % 16:
            raise ValueError(f"Region.of: the tensor must start 16-byte aligned, got address {t.data_ptr():#x}")
        shape = (t.shape[0], t.numel() // max(t.shape[0], 1) if t.dim() > 1 else 1)
        return cls(torch.tensor([t.data_ptr()], dtype=torch.int64, device=t.device), 0, shape, t.dtype)


def new_token(device: torch.device) -> torch.Tensor:
    """A fresh (1,) int64 ordering token: kernels that write through regions each set it
    (``kernels._config.order_after``), so that compiled code runs them in the order launched."""
    return torch.empty(1, dtype=torch.int64, device=device)


def or_new_token(token: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The caller's ordering token, or a fresh one (a launch that orders nothing)."""
    return token if token is not None else new_token(device)
