"""The Ulysses exchange over peer-addressable segments (``UlyssesBuffers``): each rank posts its
tensor into its own stage, one barrier, and each rank pulls its piece of every peer's stage
straight into its place in a fresh output (no permute copy on either side).

Tensors are seen as 5-D: ``(P, D1, M, D2, Q)``, where D1 and D2 are the exchange's two dims
(the earlier first): the *split* dim, whose ranges go to the ranks (seq_to_head: heads;
head_to_seq: sequence), and the *cat* dim, along which the received pieces are joined in rank
order. A row is Q contiguous elements. Source rank q's tensor has ``c_q`` positions along cat
(``c_q = base + (q < extra)``, starting at ``coff_q = q * base + min(q, extra)`` in the output)
and ``L`` along split; this rank (``rank``) takes split positions ``[off, off + n)``.

Reference semantics, with ``stage[q]`` rank q's posted tensor and CAT_FIRST (cat is D1)::

    post:    stage[rank] = x, but its split positions [off, off + n) (its gather reads them from x)
    gather:  for q in range(W): for p, i, m, j in P x c_q x M x n:
                 out[p, coff_q + i, m, j] = (x if q == rank else stage[q])[p, i, m, off + j]

A program moves rows: for each (p, i, m), the whole range along D2 with its Q elements, contiguous
in source and output.

(split first: the same with D1 and D2 swapped). Segment layout: two header slots of
``SEQ_HEADER_WORDS`` int64 at bytes 0 and 64, two stage slots of ``slot_bytes`` from
``SEQ_STAGE_START`` (``kernels/region.py``); an exchange with call number c (the barrier's) uses
slot c % 2. One barrier per exchange is enough: a rank posts into slot (c + 1) % 2 only after
barrier c, which every peer reached after its gather of exchange c - 1, the last reader of that
slot.

Headers: ``post`` writes this rank's header (the exchange's key, with the call number as word 1);
``gather`` compares every rank's with its own before it reads that rank's rows, reads nothing
from a rank whose header differs, copies all W headers out, and sets ``failed``; with
``ASSERT_CHECKS`` (CUDA, unless debug mode names the difference on the host) a device-side
assert fires too.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ._config import LAUNCH_LOCK, assert_options, launch, program_grid, row_blocks
from .region import SEQ_HEADER_WORDS, SEQ_STAGE_START

_HEADER_WORDS, _HEADER_BYTES, _STAGE_START = (tl.constexpr(n) for n in (SEQ_HEADER_WORDS, 8 * SEQ_HEADER_WORDS,
                                                                          SEQ_STAGE_START))


@triton.jit
def _stage_ptr(segment, parity, slot_bytes, offset_bytes, ELEMENT: tl.constexpr):
    """The stage slot ``parity`` of the segment at address ``segment``, ``offset_bytes`` in (256-byte
    aligned: segments are, and so are the slots and the tensors in them)."""
    return tl.multiple_of((segment + _STAGE_START + parity * slot_bytes + offset_bytes).to(tl.pointer_type(ELEMENT)),
                          16)


# NB: a row is a whole range along D2 with Q: D2 * Q (or n * Q, c_q * Q) contiguous elements in
# source and output. Q stays specialised: its divisibility by 16 is what lets Triton vectorise the
# rows' loads and stores; the other sizes are not, so that shapes do not each compile a kernel.
@triton.jit(do_not_specialize=["rank", "slot_bytes", "offset_bytes", "P", "D1", "M", "D2", "off", "n",
                               "k0", "k1", "k2", "k3", "k4", "k5", "k6"])
def _post_kernel(x_ptr, table_ptr, calls_ptr, rank, slot_bytes, offset_bytes, P, D1, M, D2, Q, off, n,
                 k0, k1, k2, k3, k4, k5, k6,
                 SPLIT_FIRST: tl.constexpr, WRITE_HEADER: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_Q: tl.constexpr):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    parity = (tl.load(calls_ptr) + 1) & 1  # the next call's slot: its barrier advances the count
    segment = tl.load(table_ptr + rank)
    if WRITE_HEADER:
        if (pid == 0) & (tl.program_id(1) == 0):
            header = (segment + parity * _HEADER_BYTES).to(tl.pointer_type(tl.int64))
            tl.store(header + 0, k0)
            tl.store(header + 1, tl.load(calls_ptr) + 1)
            tl.store(header + 2, k1)
            tl.store(header + 3, k2)
            tl.store(header + 4, k3)
            tl.store(header + 5, k4)
            tl.store(header + 6, k5)
            tl.store(header + 7, k6)
    stage = _stage_ptr(segment, parity, slot_bytes, offset_bytes, x_ptr.dtype.element_ty)
    n_rows = P * D1 * M  # rows (p, i, m) of D2 * Q contiguous elements
    run = D2 * Q
    for block in range(pid, tl.cdiv(n_rows, BLOCK_R), programs):
        o_r = (block * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        m_r = o_r < n_rows
        if SPLIT_FIRST:  # a row is this rank's piece, or not
            split = (o_r // M) % D1
            m_r = m_r & ((split < off) | (split >= off + n))
        for c in range(tl.program_id(1) * BLOCK_Q, run, tl.num_programs(1) * BLOCK_Q):
            o_q = c + tl.arange(0, BLOCK_Q)
            m_q = o_q < run
            if not SPLIT_FIRST:  # this rank's piece: columns [off * Q, (off + n) * Q) of every row
                m_q = m_q & ((o_q < off * Q) | (o_q >= (off + n) * Q))
            mask = m_r[:, None] & m_q[None, :]
            at = o_r[:, None] * run + o_q[None, :]
            tl.store(stage + at, tl.load(x_ptr + at, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["rank", "slot_bytes", "offset_bytes", "P", "M", "n", "off", "L", "base",
                               "extra", "total"])
def _gather_kernel(x_ptr, out_ptr, table_ptr, call_ptr, failed_ptr, headers_ptr, rank, slot_bytes, offset_bytes,
                   P, M, Q, n, off, L, base, extra, total,
                   CAT_FIRST: tl.constexpr, ASSERT_CHECKS: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_Q: tl.constexpr):
    pid, programs, q = tl.program_id(0), tl.num_programs(0), tl.program_id(1)
    parity = tl.load(call_ptr) & 1
    segment = tl.load(table_ptr + q)
    words = tl.arange(0, _HEADER_WORDS)
    mine = tl.load((tl.load(table_ptr + rank) + parity * _HEADER_BYTES).to(tl.pointer_type(tl.int64)) + words)
    theirs = tl.load((segment + parity * _HEADER_BYTES).to(tl.pointer_type(tl.int64)) + words)
    differs = tl.max((mine != theirs).to(tl.int32), axis=0)
    if pid == 0:
        tl.store(headers_ptr + q * _HEADER_WORDS + words, theirs)
        if differs != 0:
            tl.atomic_or(failed_ptr, 1)
    if ASSERT_CHECKS:
        tl.device_assert(differs == 0, "alltoall_ops Ulysses (symm_mem): the ranks disagree on the exchange "
                                       "(dtype, dims, shapes, ulysses_attention arguments) or are out of step")
    c_q = base + (q < extra).to(tl.int32)  # positions of rank q's tensor along cat
    coff = q * base + tl.minimum(q, extra)  # ... and where they start in the output
    if q == rank:
        src = x_ptr
    else:
        src = _stage_ptr(segment, parity, slot_bytes, offset_bytes, x_ptr.dtype.element_ty)
    # rows (p, i, m) of the run along D2 (a whole D2 range, contiguous in source and output)
    if CAT_FIRST:  # i along cat (c_q); the run: split positions [off, off + n)
        n_rows = tl.where(differs != 0, 0, P * c_q * M)
        run = n * Q
    else:  # i along split (n); the run: all c_q cat positions
        n_rows = tl.where(differs != 0, 0, P * n * M)
        run = c_q * Q
    for block in range(pid, tl.cdiv(n_rows, BLOCK_R), programs):
        o_r = (block * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        m_r = o_r < n_rows
        m = o_r % M
        t = o_r // M
        if CAT_FIRST:
            i = t % c_q
            p = t // c_q
            src_at = ((p * c_q + i) * M + m) * L * Q + off * Q
            out_at = ((p * total + coff + i) * M + m) * run
        else:
            i = t % n
            p = t // n
            src_at = ((p * L + off + i) * M + m) * run
            out_at = ((p * n + i) * M + m) * total * Q + coff * Q
        for c in range(0, run, BLOCK_Q):
            o_q = c + tl.arange(0, BLOCK_Q)
            mask = m_r[:, None] & (o_q < run)[None, :]
            rows = tl.load(src + src_at[:, None] + o_q[None, :], mask=mask)
            tl.store(out_ptr + out_at[:, None] + o_q[None, :], rows, mask=mask)


def canonical(shape: Sequence[int], split_dim: int, cat_dim: int) -> tuple[int, int, int, int, int]:
    """``(P, D1, M, D2, Q)`` of a tensor of ``shape`` around its split and cat dims."""
    d1, d2 = sorted((split_dim, cat_dim))
    return math.prod(shape[:d1]), shape[d1], math.prod(shape[d1 + 1:d2]), shape[d2], math.prod(shape[d2 + 1:])


def post_pieces(x: torch.Tensor, table: torch.Tensor, calls_1: torch.Tensor, *, rank: int, slot_bytes: int,
                offset_bytes: int, split_dim: int, cat_dim: int, own: tuple[int, int],
                header: Optional[Sequence[int]], max_programs: Optional[int] = None) -> None:
    """Copy x (contiguous) into this rank's stage slot ``(calls_1 + 1) % 2`` at ``offset_bytes``,
    but its own piece (split positions ``own = (off, n)``), and with ``header`` (the exchange's
    key, 7 ints) write the header of that slot. table: (1, W) int64 segment addresses."""
    P, D1, M, D2, Q = canonical(x.shape, split_dim, cat_dim)
    rows, run = P * D1 * M, D2 * Q
    blocks = row_blocks("seq_pieces", rows, run, x.element_size(), max_programs)
    grid = program_grid(*blocks.grid(rows, run), max_programs)
    key = list(header) if header is not None else [0] * (SEQ_HEADER_WORDS - 1)
    with LAUNCH_LOCK:
        launch(_post_kernel, x)[(max(grid[0], 1), grid[1])](
            x, table, calls_1, rank, slot_bytes, offset_bytes, P, D1, M, D2, Q, own[0], own[1], *key,
            SPLIT_FIRST=split_dim < cat_dim, WRITE_HEADER=header is not None, BLOCK_R=blocks.BLOCK_R,
            BLOCK_Q=blocks.BLOCK_H, num_warps=blocks.num_warps)


def gather_pieces(x: torch.Tensor, out: torch.Tensor, table: torch.Tensor, call_1: torch.Tensor,
                  failed_1: torch.Tensor, headers_W8: torch.Tensor, *, rank: int, slot_bytes: int, offset_bytes: int,
                  split_dim: int, cat_dim: int, own: tuple[int, int], source_split: int,
                  cat_counts: tuple[int, int], max_programs: Optional[int] = None, assert_checks: bool = True) -> None:
    """Fill ``out`` (contiguous) with this rank's piece of every rank's posted tensor, rank q's
    at cat positions ``[coff_q, coff_q + c_q)`` (``cat_counts = (base, extra)``), this rank's own
    read from x. own: (off, n) split positions taken; source_split: L, the sources' split extent.
    call_1: the exchange's call number (its slot); headers_W8 (W, 8) int64: every rank's header;
    failed_1 (1,) int32 |= 1 when some rank's header differs from this rank's (nothing is read
    from that rank); assert_checks (CUDA): that is also a device-side assert (without: the caller
    reads failed_1)."""
    W = table.shape[-1]
    P, _, M, _, Q = canonical(out.shape, split_dim, cat_dim)
    total = out.shape[cat_dim]
    base, extra = cat_counts
    most = base + (extra > 0)  # the most cat positions of a rank
    rows, run = (P * most * M, own[1] * Q) if cat_dim < split_dim else (P * own[1] * M, most * Q)
    blocks = row_blocks("seq_pieces", rows, run, x.element_size(), max_programs)
    row_programs = program_grid(blocks.grid(rows, 1)[0], 1, None if max_programs is None else
                                max(1, max_programs // W))[0]
    with LAUNCH_LOCK:
        launch(_gather_kernel, x)[(max(row_programs, 1), W)](
            x, out, table, call_1, failed_1, headers_W8, rank, slot_bytes, offset_bytes, P, M, Q, own[1], own[0],
            source_split, base, extra, total, CAT_FIRST=cat_dim < split_dim,
            ASSERT_CHECKS=x.is_cuda and assert_checks, BLOCK_R=blocks.BLOCK_R, BLOCK_Q=blocks.BLOCK_H,
            num_warps=blocks.num_warps, **(assert_options(x) if assert_checks else {}))
