"""Kernels that move rows and metadata into peer buffers, and the receiver's copy-out.

Legend: ``W`` ranks, ``E`` experts, ``N = T * K`` send slots, ``C`` receive capacity (rows),
``H`` hidden. A *destination code* ``dst = peer * stride + row`` names row ``row`` of rank
``peer``'s buffer; ``-1`` means "send nothing".

Reference semantics (``tables[r]`` is rank r's buffer)::

    put_rows:   for i in range(min(n, count)): if dst[i] >= 0:               # i: slot t * K + k
                    peer, row = divmod(dst[i], stride)                   # (with ``out``: peer 0)
                    tables[peer][row] = src[i // K] * (scale.flat[i] if scale else 1)
                    tags[peer][row] = tag_base + (tag_index[i] if tag_index else i)  # when tags
    put_meta:   for peer in range(W): meta[peer][rank] = row   # row: counts, status, header (put_meta's doc)
    copy_out:   for d in range(n):                                           # n = num_routed
                    out[d] = recv[d] if tags[d] >= 0 else 0; row_src[d] = tags[d]; tags[d] = -1
                row_src[n:] = -1                                             # out[n:] not written
                (with ``tail``: out[d], tail[d] = the first and the last columns of that row)

``max_programs`` (put_rows, copy_out; None: one program per row block): at most that many
programs, each striding over row blocks i, i + P, ... (``_config.program_grid``), as a
device-side count already bounds put_rows' (``MAX_COUNTED_PROGRAMS``); same results.

The kernels index every tensor as contiguous: the launchers copy strided inputs (``.contiguous()``,
a no-op for contiguous ones) and raise ``ValueError`` for a strided tensor they write into.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._config import (LAUNCH_LOCK, cast_rne, launch, order_after, program_grid,
                      require_contiguous, row_blocks, tl_acc_dtype, upcast)
from .region import Region, or_new_token


MAX_COUNTED_PROGRAMS = 8192
"""Row programs of a ``put_rows`` bounded by a device-side count (each strides over row blocks)."""


@triton.jit
def _select(b_index, b_table, o_w):
    """``b_table[b_index]``: [BR] indices into the (BW,) table held in registers -> [BR] (a
    select, no load for a store to wait on)."""
    return tl.sum(tl.where(b_index[:, None] == o_w[None, :], b_table[None, :], 0), axis=1)


@triton.jit
def _put_rows_kernel(
    src_ptr, scale_ptr, dst_ptr, count_ptr, rows_table_ptr, out_ptr, tags_table_ptr, tag_index_ptr, token_ptr,
    n_rows, n_src, H, world_size, tag_base,
    K: tl.constexpr, DST_STRIDE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_TAGS: tl.constexpr,
    HAS_TAG_INDEX: tl.constexpr, ONE_OUT: tl.constexpr,
    HAS_COUNT: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    order_after(token_ptr)
    n_todo = n_rows
    if HAS_COUNT:  # rows past a device-side count send nothing: no program visits them
        n_todo = tl.minimum(tl.load(count_ptr), n_rows)
    # NB: the pointer tables are read once, into registers: a row's destination is then a select.
    o_w = tl.arange(0, BLOCK_W)  # [BW] ranks
    if not ONE_OUT:
        b_rows_table = tl.load(rows_table_ptr + o_w, mask=o_w < world_size, other=0)
    if HAS_TAGS:
        b_tags_table = tl.load(tags_table_ptr + o_w, mask=o_w < world_size, other=0)
    step = tl.num_programs(0) * BLOCK_R
    o_first = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    b_dst = tl.load(dst_ptr + o_first, mask=o_first < n_todo, other=-1)  # [BR]
    for i_r in range(tl.program_id(0), tl.cdiv(n_todo, BLOCK_R), tl.num_programs(0)):
        o_r = (i_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR] rows i (slots t * K + k)
        # NB: the next block's destinations are loaded while this block's rows move (under an SM
        # budget a program does many blocks: otherwise each would wait for its own first).
        b_dst_next = tl.load(dst_ptr + o_r + step, mask=o_r + step < n_todo, other=-1)
        m_r = (o_r < n_todo) & (b_dst >= 0) & (b_dst < world_size * DST_STRIDE)  # never out of bounds
        # NB: K and DST_STRIDE are compile-time constants: a division by one is a multiply and a
        # shift; by a runtime int64 it is a ~60-instruction routine per element, which took more
        # issue slots than the row moves themselves on an SM budget.
        b_peer = tl.where(m_r, b_dst // DST_STRIDE, 0)
        b_row = tl.where(m_r, b_dst % DST_STRIDE, 0)
        b_src = o_r // K  # a token's K slots are neighbours: its row is read from memory once
        m_r = m_r & (b_src < n_src)
        if HAS_SCALE:
            b_scale = upcast(tl.load(scale_ptr + o_r, mask=m_r, other=0), ACC_DTYPE)
        if ONE_OUT:
            p_row = out_ptr + b_row * H  # [BR]
        else:
            # NB: the bases are 16-byte aligned (launcher's contract), which the compiler cannot
            # know of a loaded address: with the hint 16-byte vector stores, without it one
            # 2-byte store per element (8x the instructions; it is what limits an SM budget).
            p_peer = tl.multiple_of(_select(b_peer, b_rows_table, o_w).to(tl.pointer_type(src_ptr.dtype.element_ty)),
                                    16)
            p_row = p_peer + b_row * H  # [BR] each row's destination
        for i_h in range(tl.program_id(1), tl.cdiv(H, BLOCK_H), tl.num_programs(1)):  # column blocks
            o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
            m = m_r[:, None] & (o_h < H)[None, :]
            b_x = tl.load(src_ptr + b_src[:, None] * H + o_h[None, :], mask=m, other=0)  # [BR, BH]
            if HAS_SCALE:  # fp32 (fp64) product, rounded once
                b_x = cast_rne(upcast(b_x, ACC_DTYPE) * b_scale[:, None], src_ptr.dtype.element_ty)
            tl.store(p_row[:, None] + o_h[None, :], b_x, mask=m)
        if HAS_TAGS:
            if tl.program_id(1) == 0:
                if HAS_TAG_INDEX:
                    b_tag = tl.load(tag_index_ptr + o_r, mask=m_r, other=0)
                else:
                    b_tag = o_r
                p_tags = _select(b_peer, b_tags_table, o_w).to(tl.pointer_type(tl.int64))
                tl.store(p_tags + b_row, tag_base + b_tag, mask=m_r)
        b_dst = b_dst_next


def put_rows(
    src: torch.Tensor,
    dst: torch.Tensor,
    dst_stride: int,
    rows_table: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    top_k: int = 1,
    scale: Optional[torch.Tensor] = None,
    tags_table: Optional[torch.Tensor] = None,
    tag_index: Optional[torch.Tensor] = None,
    tag_base: int = 0,
    acc_dtype: torch.dtype = torch.float32,
    count: Optional[torch.Tensor] = None,
    token: Optional[torch.Tensor] = None,
    max_programs: Optional[int] = None,
) -> None:
    """Write row ``i // top_k`` of ``src`` (rows, H) to the destination code ``dst[i]`` for every
    i < n, times ``scale.flat[i]`` when given; neighbouring i of one source row share its read.

    rows_table / tags_table: (W,) int64 base addresses of every rank's row buffer (``src.dtype``;
    16-byte aligned, as every region of SymmBuffers is: the kernel's vector stores rely on it)
    / int64 tag buffer; each row's tag is ``tag_base + tag_index[i]`` (default i). ``out``
    instead of ``rows_table``: one local (dst_stride, H) destination, no pointer table.
    ``count``: a one-element int64 device tensor; rows i >= count have no destination (-1) and
    are not visited: at most ``MAX_COUNTED_PROGRAMS`` row programs stride over the first count
    rows, so a mostly empty capacity C costs no launch of a program per row. ``token``: a (1,)
    int64 the kernel sets to 0 (``_config.order_after``; default: a fresh one). ``max_programs``: at
    most that many programs in all (an SM budget, ``_config.program_grid``), striding the same way.
    top_k and dst_stride are compile-time constants of the kernel: one compilation per (K, C)."""
    n, H = dst.numel(), src.shape[1]
    if n == 0 or H == 0:
        if token is not None:
            token.zero_()
        return
    if (out is None) == (rows_table is None):
        raise ValueError("put_rows: pass exactly one of rows_table and out")
    require_contiguous("put_rows", out=out)
    src, dst, scale, rows_table, tags_table, tag_index = (
        None if t is None else t.contiguous() for t in (src, dst, scale, rows_table, tags_table, tag_index)
    )
    world_size = 1 if out is not None else rows_table.numel()
    blocks = row_blocks("put_rows", n, H, src.element_size(), max_programs)
    row_programs, h_programs = blocks.grid(n, H)
    if count is not None:
        row_programs = min(row_programs, MAX_COUNTED_PROGRAMS)
    row_programs, h_programs = program_grid(row_programs, h_programs, max_programs)
    with LAUNCH_LOCK:
        launch(_put_rows_kernel, src)[(row_programs, h_programs)](
            src, scale if scale is not None else src, dst, count if count is not None else dst,
            rows_table if rows_table is not None else dst, out if out is not None else src,
            tags_table if tags_table is not None else dst, tag_index if tag_index is not None else dst,
            or_new_token(token, dst.device), n, src.shape[0], H, world_size, tag_base, K=top_k,
            DST_STRIDE=dst_stride,
            HAS_SCALE=scale is not None, HAS_TAGS=tags_table is not None, HAS_TAG_INDEX=tag_index is not None,
            ONE_OUT=out is not None, HAS_COUNT=count is not None, ACC_DTYPE=tl_acc_dtype(acc_dtype),
            BLOCK_R=blocks.BLOCK_R, BLOCK_H=blocks.BLOCK_H, BLOCK_W=triton.next_power_of_2(world_size),
            num_warps=blocks.num_warps,
        )


@triton.jit
def _put_meta_kernel(
    send_meta_ptr, call_ptr, meta_table_ptr, token_ptr, rank, world_size, E, e, L, n_status,
    n_slots, alignment, failed, col_n_slots, col_alignment, col_failed, col_call,
    BLOCK_L: tl.constexpr,
):
    order_after(token_ptr)
    for i_peer in range(tl.program_id(0), world_size, tl.num_programs(0)):
        p_meta = tl.load(meta_table_ptr + i_peer).to(tl.pointer_type(tl.int64))
        for i_l in range(0, L, BLOCK_L):
            o_l = i_l + tl.arange(0, BLOCK_L)  # [BL] columns of the row
            m_counts = o_l < E  # expert g's count: the plan's row of its owner
            b_row = tl.load(send_meta_ptr + (o_l // e) * (e + n_status) + o_l % e, mask=m_counts, other=0)
            m_status = (o_l >= E) & (o_l < E + n_status)
            b_row = tl.where(m_status, tl.load(send_meta_ptr + e + o_l - E, mask=m_status, other=0), b_row)
            b_row = tl.where(o_l == E + col_n_slots, n_slots, b_row)
            b_row = tl.where(o_l == E + col_alignment, alignment, b_row)
            b_row = tl.where(o_l == E + col_failed, failed, b_row)
            b_row = tl.where(o_l == E + col_call, tl.load(call_ptr), b_row)
            tl.store(p_meta + rank * L + o_l, b_row, mask=o_l < L)


def put_meta(send_meta: torch.Tensor, header: tuple[int, int, int], call_1: torch.Tensor, meta_table: torch.Tensor,
             rank: int, num_experts: int, meta_columns: int, columns: tuple[int, int, int, int],
             token: Optional[torch.Tensor] = None, max_programs: Optional[int] = None) -> None:
    """This rank's metadata row into row ``rank`` of every rank's (W, L = meta_columns) int64
    metadata buffer, assembled on the way: column g < E the count of expert g (``send_meta``, the
    routing plan's (W, e + status), row g // e, column g % e), then the status (its first row's
    last columns), then the header: ``header`` = (n_slots, alignment, failed) and the call
    number ``call_1`` (1,) at the offsets ``columns`` = (n_slots, alignment, failed, call) past
    E; other columns 0. A program per peer, or at most ``max_programs`` striding over them (an
    SM budget). token: as put_rows'."""
    W, E = meta_table.numel(), num_experts
    send_meta, meta_table = send_meta.contiguous(), meta_table.contiguous()
    e = E // send_meta.shape[0]
    grid = program_grid(W, 1, max_programs)[:1]
    with LAUNCH_LOCK:
        launch(_put_meta_kernel, send_meta)[grid](
            send_meta, call_1, meta_table, or_new_token(token, send_meta.device), rank, W, E, e, meta_columns,
            send_meta.shape[1] - e, *header, *columns, BLOCK_L=triton.next_power_of_2(max(1, min(meta_columns, 1024))),
        )


@triton.jit
def _copy_out_kernel(
    recv_table_ptr, recv_index, tags_table_ptr, tags_index, num_routed_ptr, out_ptr, tail_ptr, row_src_ptr,
    token_ptr, n_rows, X, X_OUT,
    HAS_TAIL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    order_after(token_ptr)
    # NB: the regions' bases are loaded here, not in a helper: inductor's analysis of which
    # arguments a kernel writes would see a store through a helper's result as a store into the
    # helper's arguments (the address tables, constants of the graph).
    recv_ptr = tl.load(recv_table_ptr + recv_index).to(tl.pointer_type(out_ptr.dtype.element_ty))
    tags_ptr = tl.load(tags_table_ptr + tags_index).to(tl.pointer_type(tl.int64))
    n_routed = tl.load(num_routed_ptr)  # rows [0, n_routed) of out are written, the rest left as they are
    for i_r in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_R), tl.num_programs(0)):  # row blocks
        o_r = (i_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR]
        m_r = o_r < n_rows
        m_routed = m_r & (o_r < n_routed)
        b_tag = tl.load(tags_ptr + o_r, mask=m_routed, other=-1)  # [BR] source code of each row, -1: none
        if i_r * BLOCK_R < n_routed:  # NB: a block past n_routed moves no row, only writes row_src
            m_valid = m_routed & (b_tag >= 0)
            for i_h in range(tl.cdiv(X, BLOCK_H)):
                o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
                m_h = (o_h < X)[None, :]
                b_x = tl.load(recv_ptr + o_r[:, None] * X + o_h[None, :], mask=m_valid[:, None] & m_h, other=0)
                if HAS_TAIL:  # columns [0, X_OUT) to out, [X_OUT, X) to tail
                    m_out = (o_h < X_OUT)[None, :]
                    tl.store(out_ptr + o_r[:, None] * X_OUT + o_h[None, :], b_x,
                             mask=m_routed[:, None] & m_h & m_out)
                    tl.store(tail_ptr + o_r[:, None] * (X - X_OUT) + (o_h - X_OUT)[None, :], b_x,
                             mask=m_routed[:, None] & m_h & ~m_out)
                else:
                    tl.store(out_ptr + o_r[:, None] * X + o_h[None, :], b_x, mask=m_routed[:, None] & m_h)
            # NB: each program owns its row blocks across all of X, so resetting the tags here
            # cannot race with another program's read of them; within the program, every thread
            # holding a copy of b_tag must have loaded it before one of them resets it: the
            # barrier (without it, slow programs read -1 and dropped rows; seen on the H200 only
            # under an SM budget). Past n_routed the tags stay -1.
            tl.debug_barrier()
            tl.store(tags_ptr + o_r, tl.full([BLOCK_R], -1, tl.int64), mask=m_routed)
        tl.store(row_src_ptr + o_r, b_tag, mask=m_r)


def copy_out(
    recv: Region, tags: Region, num_routed: torch.Tensor, out: torch.Tensor, row_src: torch.Tensor,
    tail: Optional[torch.Tensor] = None,
    token: Optional[torch.Tensor] = None,
    max_programs: Optional[int] = None,
) -> None:
    """Copy the first n = ``num_routed`` rows of this rank's receive buffer recv (C, X) into
    ``out``, zero where no row arrived; rows [n, C) of ``out`` are not written. recv and tags:
    regions named by address (``_config.Region``), tags (C, 1) int64. ``num_routed``: a
    one-element int64 tensor on the device (read by the kernel: no host sync). ``row_src`` (C,)
    gets each row's tag (-1 past n); the tags are reset to -1 for the next call. With ``tail``
    (C, X - X_out) of recv's dtype, out (C, X_out) takes the first X_out columns of each row and
    tail the rest (fp8 wire rows into values and scale bytes, no copy of the whole buffer).
    ``max_programs``: at most that many programs, each striding over row blocks (an SM budget).
    token: as put_rows'."""
    C, X = recv.shape
    if C == 0:
        if token is not None:
            token.zero_()
        return
    require_contiguous("copy_out", out=out, row_src=row_src, tail=tail)
    x_out = X if tail is None else out.shape[1]
    if tail is not None and (tail.dtype != recv.dtype or out.dtype != recv.dtype or tail.shape[1] != X - x_out):
        raise ValueError(f"copy_out: out and tail must split recv's {X} columns in its dtype {recv.dtype}, got "
                         f"{out.dtype} {tuple(out.shape)} and {tail.dtype} {tuple(tail.shape)}")
    blocks = row_blocks("copy_out", C, X, out.element_size(), max_programs)
    with LAUNCH_LOCK:  # NB: one program per row block across all of X (see the kernel)
        launch(_copy_out_kernel, out)[program_grid(blocks.grid(C, X)[0], 1, max_programs)[:1]](
            recv.table, recv.index, tags.table, tags.index, num_routed, out, tail if tail is not None else out,
            row_src, or_new_token(token, out.device), C, X, x_out,
            HAS_TAIL=tail is not None, BLOCK_R=blocks.BLOCK_R, BLOCK_H=blocks.BLOCK_H, num_warps=blocks.num_warps,
        )
