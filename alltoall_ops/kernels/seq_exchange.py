"""The Ulysses exchange over peer-addressable segments (``UlyssesBuffers``): each rank posts its
tensors into its own stage, one barrier, and each rank pulls its piece of every peer's stage
straight into its place in a fresh output (no permute copy on either side); up to
:data:`MAX_TENSORS` tensors (q, k, v) in one post and one gather launch.

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

Headers: ``post`` writes this rank's header (the exchange's key, with the call number as word 1)
and zeroes ``failed``; ``gather`` compares every rank's with its own before it reads that rank's
rows, reads nothing from a rank whose header differs, copies all W headers out, and sets
``failed``; with
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
from .barrier import Epilogue, epilogue_args, last_program_arrives
from .region import SEQ_HEADER_FIELDS, SEQ_HEADER_WORDS, SEQ_REJECTED_DTYPE, SEQ_STAGE_START

_REJECTED_DTYPE = tl.constexpr(SEQ_REJECTED_DTYPE)
_DTYPE, _ARGS, _NDIM, _SHAPE = (tl.constexpr(SEQ_HEADER_FIELDS.index(f))
                                for f in ("dtype", "ulysses_attention arguments", "ndim", "shape"))
_HEADER_WORDS, _HEADER_BYTES, _STAGE_START = (tl.constexpr(n) for n in (SEQ_HEADER_WORDS, 8 * SEQ_HEADER_WORDS,
                                                                          SEQ_STAGE_START))


@triton.jit
def _stage_ptr(segment, parity, slot_bytes, offset_bytes, ELEMENT: tl.constexpr):
    """The stage slot ``parity`` of the segment at address ``segment``, ``offset_bytes`` in (256-byte
    aligned: segments are, and so are the slots and the tensors in them)."""
    return tl.multiple_of((segment + _STAGE_START + parity * slot_bytes + offset_bytes).to(tl.pointer_type(ELEMENT)),
                          16)


MAX_TENSORS = 3
"""Tensors one exchange moves in one post and one gather launch (q, k and v)."""


# NB: a row is a whole range along D2 with Q: D2 * Q (or n * Q, c_q * Q) contiguous elements in
# source and output. Q stays specialised: its divisibility by 16 is what lets Triton vectorise the
# rows' loads and stores; the other sizes are not, so that shapes do not each compile a kernel.
@triton.jit
def _post_rows(x_ptr, segment, parity, slot_bytes, offset_bytes, P, D1, M, D2, off, n, Q: tl.constexpr,
               SPLIT_FIRST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr):
    """One tensor's part of a post: this program's rows of it into the stage slot ``parity``.
    The programs cover only what is posted (all but this rank's piece), so none is idle."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    stage = _stage_ptr(segment, parity, slot_bytes, offset_bytes, x_ptr.dtype.element_ty)
    run = D2 * Q  # a row (p, i, m): D2 * Q contiguous elements
    if SPLIT_FIRST:  # the rows of split positions [off, off + n) are this rank's piece
        kept = D1 - n
        n_rows = P * kept * M  # the posted rows, (p, i', m) over the kept split positions
        left, first = run, run  # ... whole
    else:  # columns [off * Q, (off + n) * Q) of every row are this rank's piece
        n_rows = P * D1 * M
        left, first = off * Q, (off + n) * Q
    left_blocks = tl.cdiv(left, BLOCK_Q)  # column blocks of [0, left), then of [first, run)
    col_blocks = left_blocks + tl.cdiv(run - first, BLOCK_Q)
    for block in range(pid, tl.cdiv(n_rows, BLOCK_R), programs):
        o_r = block * BLOCK_R + tl.arange(0, BLOCK_R)  # int32: the launcher checks the rows < 2**31
        m_r = o_r < n_rows
        if SPLIT_FIRST:  # posted row (p, i', m) is row (p, i' + n (i' >= off), m)
            t = o_r // M
            kept_i = t % kept
            o_r += (t // kept * n + tl.where(kept_i >= off, n, 0)) * M
        for j in range(tl.program_id(1), col_blocks, tl.num_programs(1)):
            c = tl.where(j < left_blocks, j * BLOCK_Q, first + (j - left_blocks) * BLOCK_Q)
            o_q = c + tl.arange(0, BLOCK_Q)
            mask = m_r[:, None] & (o_q < tl.where(j < left_blocks, left, run))[None, :]
            at = o_r.to(tl.int64)[:, None] * run + o_q[None, :]
            tl.store(stage + at, tl.load(x_ptr + at, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["rank", "slot_bytes", "k0", "k1", "k2", "k3", "k4", "k5", "k6",
                               "o0", "P0", "A0", "M0", "B0", "f0", "n0", "o1", "P1", "A1", "M1", "B1", "f1", "n1",
                               "o2", "P2", "A2", "M2", "B2", "f2", "n2"])
def _post_kernel(table_ptr, calls_ptr, failed_ptr, rank, slot_bytes, k0, k1, k2, k3, k4, k5, k6,
                 x0, o0, P0, A0, M0, B0, f0, n0, x1, o1, P1, A1, M1, B1, f1, n1, x2, o2, P2, A2, M2, B2, f2, n2,
                 pads_table_ptr, counters_ptr, barrier_call_ptr, barrier_rank, timeout_ms, barrier_op,
                 Q0: tl.constexpr, Q1: tl.constexpr, Q2: tl.constexpr, TENSORS: tl.constexpr,
                 SPLIT_FIRST: tl.constexpr, WRITE_HEADER: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BARRIER: tl.constexpr, WORLD_SIZE: tl.constexpr):
    # tensor t: x_t, its offset in the slot o_t (bytes), its (P, D1, M, D2, Q) = (P_t, A_t, M_t,
    # B_t, Q_t) and the split positions it keeps [f_t, f_t + n_t); the first TENSORS of them
    parity = (tl.load(calls_ptr) + 1) & 1  # the next call's slot: its barrier advances the count
    segment = tl.load(table_ptr + rank)
    if WRITE_HEADER:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(failed_ptr, 0)  # the gather's flag (it runs after the barrier)
            header = (segment + parity * _HEADER_BYTES).to(tl.pointer_type(tl.int64))
            tl.store(header + 0, k0)
            tl.store(header + 1, tl.load(calls_ptr) + 1)
            tl.store(header + 2, k1)
            tl.store(header + 3, k2)
            tl.store(header + 4, k3)
            tl.store(header + 5, k4)
            tl.store(header + 6, k5)
            tl.store(header + 7, k6)
    _post_rows(x0, segment, parity, slot_bytes, o0, P0, A0, M0, B0, f0, n0, Q0, SPLIT_FIRST, BLOCK_R, BLOCK_Q)
    if TENSORS > 1:
        _post_rows(x1, segment, parity, slot_bytes, o1, P1, A1, M1, B1, f1, n1, Q1, SPLIT_FIRST, BLOCK_R, BLOCK_Q)
    if TENSORS > 2:
        _post_rows(x2, segment, parity, slot_bytes, o2, P2, A2, M2, B2, f2, n2, Q2, SPLIT_FIRST, BLOCK_R, BLOCK_Q)
    if BARRIER:  # the exchange's barrier, which advances the call number (every program read it above)
        last_program_arrives(pads_table_ptr, counters_ptr, barrier_rank, timeout_ms, barrier_call_ptr, barrier_op,
                             WORLD_SIZE, True)


@triton.jit
def _any_of(bad, words, first, end):
    """1 where any of header words [first, end) differs (``bad``: [HEADER_WORDS] bool), else 0."""
    return tl.max((bad & (words >= first) & (words < end)).to(tl.int32), axis=0)


@triton.jit
def _gather_rows(x_ptr, out_ptr, src_segment, parity, slot_bytes, offset_bytes, readable, rank, q, P, M, n, off, L,
                 base, extra, total, Q: tl.constexpr, CAT_FIRST: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_Q: tl.constexpr):
    """One tensor's part of a gather: this program's rows of rank q's piece (none unless
    ``readable``: rank q's header is this rank's)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    c_q = base + (q < extra).to(tl.int32)  # positions of rank q's tensor along cat
    coff = q * base + tl.minimum(q, extra)  # ... and where they start in the output
    if q == rank:
        src = x_ptr
    else:
        src = _stage_ptr(src_segment, parity, slot_bytes, offset_bytes, x_ptr.dtype.element_ty)
    # rows (p, i, m) of the run along D2 (a whole D2 range, contiguous in source and output); a
    # row's index o_r counts them in the order of the tensor whose rows are all read or written
    # (CAT_FIRST: the source's, i along cat; else the output's, i along split), so only p = o_r //
    # (rows of one p) takes a division (in int32: the launcher checks the row counts < 2**31)
    if CAT_FIRST:  # i along cat (c_q); the run: split positions [off, off + n)
        per_p = c_q * M
        run = n * Q
        src_stride, out_stride, skip, shift = L * Q, run, total - c_q, coff
    else:  # i along split (n); the run: all c_q cat positions
        per_p = n * M
        run = c_q * Q
        src_stride, out_stride, skip, shift = run, total * Q, L - n, off
    n_rows = tl.where(readable, P * per_p, 0)
    for block in range(pid, tl.cdiv(n_rows, BLOCK_R), programs):
        o_r = block * BLOCK_R + tl.arange(0, BLOCK_R)
        m_r = o_r < n_rows
        other = o_r + (o_r // per_p * skip + shift) * M  # the row's index in the other tensor
        if CAT_FIRST:  # source row o_r, output row (p * total + coff + i) * M + m
            src_at = o_r.to(tl.int64) * src_stride + off * Q
            out_at = other.to(tl.int64) * out_stride
        else:  # source row (p * L + off + i) * M + m, output row o_r
            src_at = other.to(tl.int64) * src_stride
            out_at = o_r.to(tl.int64) * out_stride + coff * Q
        for c in range(0, run, BLOCK_Q):
            o_q = c + tl.arange(0, BLOCK_Q)
            mask = m_r[:, None] & (o_q < run)[None, :]
            rows = tl.load(src + src_at[:, None] + o_q[None, :], mask=mask)
            tl.store(out_ptr + out_at[:, None] + o_q[None, :], rows, mask=mask)


@triton.jit(do_not_specialize=["rank", "slot_bytes", "o0", "P0", "M0", "n0", "f0", "L0", "b0", "e0", "t0",
                               "o1", "P1", "M1", "n1", "f1", "L1", "b1", "e1", "t1",
                               "o2", "P2", "M2", "n2", "f2", "L2", "b2", "e2", "t2"])
def _gather_kernel(table_ptr, call_ptr, failed_ptr, headers_ptr, rank, slot_bytes,
                   x0, y0, o0, P0, M0, n0, f0, L0, b0, e0, t0, x1, y1, o1, P1, M1, n1, f1, L1, b1, e1, t1,
                   x2, y2, o2, P2, M2, n2, f2, L2, b2, e2, t2,
                   Q0: tl.constexpr, Q1: tl.constexpr, Q2: tl.constexpr, TENSORS: tl.constexpr,
                   CAT_FIRST: tl.constexpr, ASSERT_CHECKS: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_Q: tl.constexpr):
    # tensor t: x_t, its output y_t, its offset in the slot o_t (bytes), P_t, M_t, Q_t, the split
    # positions taken [f_t, f_t + n_t), the sources' split extent L_t, (base, extra) = (b_t, e_t)
    # of the cat positions per rank, the output's cat extent t_t; the first TENSORS of them
    q = tl.program_id(1)
    parity = tl.load(call_ptr) & 1
    segment = tl.load(table_ptr + q)
    words = tl.arange(0, _HEADER_WORDS)
    mine = tl.load((tl.load(table_ptr + rank) + parity * _HEADER_BYTES).to(tl.pointer_type(tl.int64)) + words)
    theirs = tl.load((segment + parity * _HEADER_BYTES).to(tl.pointer_type(tl.int64)) + words)
    bad = mine != theirs  # [HEADER_WORDS]
    differs = tl.max(bad.to(tl.int32), axis=0)
    if tl.program_id(0) == 0:
        tl.store(headers_ptr + q * _HEADER_WORDS + words, theirs)
        if differs != 0:
            tl.atomic_or(failed_ptr, 1)
    if ASSERT_CHECKS:  # one assert per header field, so that the CUDA error names it (as the CPU's error)
        tl.device_assert(tl.sum(tl.where(words == _DTYPE, theirs, 0), axis=0) != _REJECTED_DTYPE,
                         "alltoall_ops Ulysses (symm_mem): a rank rejected its arguments (its own error says why)")
        tl.device_assert(_any_of(bad, words, 0, _ARGS) == 0, "alltoall_ops Ulysses (symm_mem): the ranks disagree on "
                         "the exchange: they are out of step (another op, or another call on these buffers)")
        tl.device_assert(_any_of(bad, words, _ARGS, _ARGS + 1) == 0, "alltoall_ops Ulysses (symm_mem): the ranks "
                         "disagree on the exchange: ulysses_attention's arguments differ")
        tl.device_assert(_any_of(bad, words, _DTYPE, _DTYPE + 1) == 0, "alltoall_ops Ulysses (symm_mem): the ranks "
                         "disagree on the exchange: dtype")
        tl.device_assert(_any_of(bad, words, _NDIM, _SHAPE) == 0, "alltoall_ops Ulysses (symm_mem): the ranks "
                         "disagree on the exchange: ndim, seq_dim or head_dim")
        tl.device_assert(_any_of(bad, words, _SHAPE, _SHAPE + 1) == 0, "alltoall_ops Ulysses (symm_mem): the ranks "
                         "disagree on the exchange: shape")
    same = differs == 0
    _gather_rows(x0, y0, segment, parity, slot_bytes, o0, same, rank, q, P0, M0, n0, f0, L0, b0, e0, t0, Q0,
                 CAT_FIRST, BLOCK_R, BLOCK_Q)
    if TENSORS > 1:
        _gather_rows(x1, y1, segment, parity, slot_bytes, o1, same, rank, q, P1, M1, n1, f1, L1, b1, e1, t1, Q1,
                     CAT_FIRST, BLOCK_R, BLOCK_Q)
    if TENSORS > 2:
        _gather_rows(x2, y2, segment, parity, slot_bytes, o2, same, rank, q, P2, M2, n2, f2, L2, b2, e2, t2, Q2,
                     CAT_FIRST, BLOCK_R, BLOCK_Q)


def canonical(shape: Sequence[int], split_dim: int, cat_dim: int) -> tuple[int, int, int, int, int]:
    """``(P, D1, M, D2, Q)`` of a tensor of ``shape`` around its split and cat dims."""
    d1, d2 = sorted((split_dim, cat_dim))
    return math.prod(shape[:d1]), shape[d1], math.prod(shape[d1 + 1:d2]), shape[d2], math.prod(shape[d2 + 1:])


_MAX_ROWS = 2**31 - 2**16
"""The kernels count a tensor's rows (P * D1 * M, of D2 * Q elements) in int32, a tile past the last."""


def _check_rows(tensors: Sequence[torch.Tensor], split_dim: int, cat_dim: int) -> None:
    """ValueError where a tensor has more than :data:`_MAX_ROWS` rows (before any launch; every
    rank with the same shapes raises alike)."""
    for t in tensors:
        P, D1, M, _, _ = canonical(t.shape, split_dim, cat_dim)
        if P * D1 * M > _MAX_ROWS:
            raise ValueError(f"alltoall_ops Ulysses (symm_mem): a tensor of shape {tuple(t.shape)} has {P * D1 * M} "
                             f"rows (the product of its sizes before dim {max(split_dim, cat_dim)}); the kernels "
                             f"take at most {_MAX_ROWS}")


def _per_tensor(args: list[tuple]) -> tuple[list, dict]:
    """The kernel arguments of at most MAX_TENSORS tensors (``args[t]``, Q last), padded with the
    first's (unused: the kernel reads the first TENSORS) and flattened; and the constexprs Q0..Q2
    and TENSORS."""
    padded = args + [args[0]] * (MAX_TENSORS - len(args))
    return [a for t in padded for a in t[:-1]], {**{f"Q{i}": t[-1] for i, t in enumerate(padded)},
                                                  "TENSORS": len(args)}


def _posted_blocks(shapes: Sequence[tuple], owns: Sequence[tuple[int, int]], split_first: bool,
                   block_q: int) -> tuple[int, int]:
    """The most rows and column blocks of BLOCK_Q that a post moves of one of its tensors (all but
    the rank's piece: rows of the split positions it keeps, or, split second, their columns)."""
    rows, cols = 0, 1
    for (P, D1, M, D2, Q), (off, n) in zip(shapes, owns):
        if split_first:
            rows, cols = max(rows, P * (D1 - n) * M), max(cols, triton.cdiv(D2 * Q, block_q))
        else:
            posted = triton.cdiv(off * Q, block_q) + triton.cdiv((D2 - off - n) * Q, block_q)
            rows, cols = max(rows, P * D1 * M), max(cols, posted)
    return rows, cols


def post_pieces(xs: Sequence[torch.Tensor], table: torch.Tensor, calls_1: torch.Tensor, failed_1: torch.Tensor, *,
                rank: int, slot_bytes: int, offsets_bytes: Sequence[int], split_dim: int, cat_dim: int,
                owns: Sequence[tuple[int, int]], header: Sequence[int], max_programs: Optional[int] = None,
                epilogue: Optional[Epilogue] = None) -> None:
    """Copy each x of ``xs`` (contiguous, one dtype) into this rank's stage slot
    ``(calls_1 + 1) % 2`` at its ``offsets_bytes``, but its own piece (split positions
    ``owns[i] = (off, n)``), MAX_TENSORS a launch, write the header of that slot (``header``: the
    exchange's key, 7 ints) and set ``failed_1`` (1,) int32 to 0 (:func:`gather_pieces`' flag).
    table: (1, W) int64 segment addresses. ``epilogue`` (``advance_after`` set): the exchange's
    barrier, which advances the call number, run by the last launch's last program."""
    _check_rows(xs, split_dim, cat_dim)
    for first in range(0, len(xs), MAX_TENSORS):
        chunk = slice(first, first + MAX_TENSORS)
        shapes = [canonical(x.shape, split_dim, cat_dim) for x in xs[chunk]]
        run = max(D2 * Q for _, _, _, D2, Q in shapes)
        blocks = row_blocks("seq_pieces", max(P * D1 * M for P, D1, M, _, _ in shapes), run, xs[0].element_size(),
                            max_programs)
        rows, cols = _posted_blocks(shapes, owns[chunk], split_dim < cat_dim, blocks.BLOCK_H)
        grid = program_grid(triton.cdiv(rows, blocks.BLOCK_R), cols, max_programs)
        write_header = first == 0
        key = list(header) if write_header else [0] * (SEQ_HEADER_WORDS - 1)
        tensors, constexprs = _per_tensor([(x, o, *shape[:4], *own, shape[4]) for x, o, shape, own in
                                           zip(xs[chunk], offsets_bytes[chunk], shapes, owns[chunk])])
        last = first + MAX_TENSORS >= len(xs)
        with LAUNCH_LOCK:
            launch(_post_kernel, xs[0])[(max(grid[0], 1), grid[1])](
                table, calls_1, failed_1, rank, slot_bytes, *key, *tensors, **constexprs,
                SPLIT_FIRST=split_dim < cat_dim, WRITE_HEADER=write_header, BLOCK_R=blocks.BLOCK_R,
                BLOCK_Q=blocks.BLOCK_H, num_warps=blocks.num_warps,
                **epilogue_args(epilogue if last else None, calls_1, advances=True))


def gather_pieces(xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], table: torch.Tensor,
                  call_1: torch.Tensor, failed_1: torch.Tensor, headers_W8: torch.Tensor, *, rank: int,
                  slot_bytes: int, offsets_bytes: Sequence[int], split_dim: int, cat_dim: int,
                  owns: Sequence[tuple[int, int]], source_splits: Sequence[int],
                  cat_counts: Sequence[tuple[int, int]], max_programs: Optional[int] = None,
                  assert_checks: bool = True) -> None:
    """Fill each of ``outs`` (contiguous) with this rank's piece of every rank's posted tensor of
    ``xs`` (MAX_TENSORS a launch), rank q's at cat positions ``[coff_q, coff_q + c_q)``
    (``cat_counts[i] = (base, extra)``), this rank's own read from x. owns[i]: (off, n) split
    positions taken; source_splits[i]: L, the sources' split extent. call_1: the exchange's call
    number (its slot); headers_W8 (W, 8) int64: every rank's header; failed_1 (1,) int32 (zeroed
    by the post) |= 1 when some rank's header differs from this rank's (nothing is read from that
    rank); assert_checks
    (CUDA): that is also a device-side assert (without: the caller reads failed_1)."""
    W, x = table.shape[-1], xs[0]
    _check_rows([*xs, *outs], split_dim, cat_dim)
    for first in range(0, len(xs), MAX_TENSORS):
        chunk = slice(first, first + MAX_TENSORS)
        per_tensor, rows, run = [], 0, 0
        for x_i, out, offset, own, L, (base, extra) in zip(xs[chunk], outs[chunk], offsets_bytes[chunk],
                                                           owns[chunk], source_splits[chunk], cat_counts[chunk]):
            P, _, M, _, Q = canonical(out.shape, split_dim, cat_dim)
            most = base + (extra > 0)  # the most cat positions of a rank
            rows_i, run_i = (P * most * M, own[1] * Q) if cat_dim < split_dim else (P * own[1] * M, most * Q)
            rows, run = max(rows, rows_i), max(run, run_i)
            per_tensor.append((x_i, out, offset, P, M, own[1], own[0], L, base, extra, out.shape[cat_dim], Q))
        blocks = row_blocks("seq_pieces", rows, run, x.element_size(), max_programs)
        row_programs = program_grid(blocks.grid(rows, 1)[0], 1, None if max_programs is None else
                                    max(1, max_programs // W))[0]
        tensors, constexprs = _per_tensor(per_tensor)
        with LAUNCH_LOCK:
            launch(_gather_kernel, x)[(max(row_programs, 1), W)](
                table, call_1, failed_1, headers_W8, rank, slot_bytes, *tensors, **constexprs,
                CAT_FIRST=cat_dim < split_dim, ASSERT_CHECKS=x.is_cuda and assert_checks, BLOCK_R=blocks.BLOCK_R,
                BLOCK_Q=blocks.BLOCK_H, num_warps=blocks.num_warps, **(assert_options(x) if assert_checks else {}))
