"""Kernels that move rows and metadata into peer buffers, and the receiver's pull.

Legend: ``W`` ranks, ``E`` experts, ``N = T * K`` send slots, ``C`` receive capacity (rows),
``H`` hidden. A *destination code* ``dst = peer * stride + row`` names row ``row`` of rank
``peer``'s buffer; ``-1`` means "send nothing".

Reference semantics (``tables[r]`` is rank r's buffer)::

    put_rows:   for i in range(min(n, count)): if dst[i] >= 0:               # i: slot t * K + k
                    peer, row = divmod(dst[i], stride)                   # (with ``out``: peer 0)
                    tables[peer][row] = src[i // K] * (scale.flat[i] if scale else 1)
    put_meta:   for peer in range(W): meta[peer][rank] = row   # row: counts, status, header (put_meta's doc)
                (with topk_idx: the routing plan first, routing_plan's one program: send_meta, position)
    post_slots: stage[rank][:n] = rows                                       # with a stage (W > 1)
                (quantize: stage[rank][:n] = pack(*fp8.quantize(rows)), fp8 wire rows)
                tags[rank][0] = (n, K, 0)                                    # the header
                for i in range(N): tags[rank][1 + i] = (dst[i] if 0 <= dst[i] < W * stride else -1,
                                                        tag_base + tag_index[i], bits(scale.flat[i]) or 0)
    pull_rows:  for s in range(W): n_s, K_s = tags[s][0][:2]                 # every sender
                    for t in range(n_s):                                 # source(s)[t] loaded once
                        for k in range(K_s): dst, code, bits = tags[s][1 + t * K_s + k]
                            if dst // stride == rank: d = dst % stride
                                out[d] = source(s)[t] * scale(bits); row_src[d] = code
                for each padding span [a, b) of ``pads``: out[a:b] = 0, row_src[a:b] = -1
                (rows no slot names and no span covers are not written; source(s): stage[s], or
                 ``rows``; with ``tail``: out[d], tail[d] = the first and the last columns of that
                 row; with a ``row_map`` (one rank, no tags), for d < n = num_routed: i =
                 row_map[d], code, bits = position.flat[i], scale.flat[i] if i >= 0; out[d] =
                 rows[i // K] * scale or 0; out[n:] not written)

A dispatch is ``post_slots``, a barrier, then ``pull_rows``: each row is written once where it
is used (the receiver's fresh output), and each token's row once more into its sender's stage
(W > 1), since peers can read only symmetric memory; each receiver reads a token's row once,
however many of its slots it receives. One rank pulls by the placement's row map alone (one
launch). Combine (few rows per token) puts.

``max_programs`` (put_rows, post_slots, pull_rows; None: one program per row block): at most
that many programs, each striding over row blocks i, i + P, ... (``_config.program_grid``), as a
device-side count already bounds put_rows' and pull_rows' (``MAX_COUNTED_PROGRAMS``); same results.

The kernels index every tensor as contiguous: the launchers copy strided inputs (``.contiguous()``,
a no-op for contiguous ones) and raise ``ValueError`` for a strided tensor they write into.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._config import (LAUNCH_LOCK, RowBlocks, cast_rne, interpreting, launch, order_after, program_grid,
                      require_contiguous, row_blocks, tl_acc_dtype, upcast)
from ..fp8 import AMAX_FLOOR, BLOCK, FP8_MAX, packed_width
from .barrier import Epilogue, advance_call, arrive_and_wait, barrier_alone, epilogue_args, last_program_arrives
from .quantize import e4m3_value, quantize_block, tiles as quantize_tiles
from .region import TAG_COLUMNS, Region, or_new_token
from .routing_plan import GPU_NUM_WARPS as PLAN_NUM_WARPS, NOT_PLANNED_FIRST, PlannedFirst, plan_first


MAX_COUNTED_PROGRAMS = 8192
"""Most row programs of a kernel whose rows a device-side count bounds (``put_rows``' count,
``pull_rows``' num_routed): each strides over row blocks, so a mostly empty capacity C launches
no program per row block of it."""


@triton.jit
def _put_rows_kernel(
    src_ptr, scale_ptr, dst_ptr, count_ptr, rows_table_ptr, out_ptr, token_ptr,
    n_rows, n_src, H, world_size,
    pads_table_ptr, counters_ptr, barrier_call_ptr, barrier_rank, timeout_ms, barrier_op,
    K: tl.constexpr, DST_STRIDE: tl.constexpr, HAS_SCALE: tl.constexpr, ONE_OUT: tl.constexpr,
    HAS_COUNT: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BARRIER: tl.constexpr, WORLD_SIZE: tl.constexpr,
):
    order_after(token_ptr)
    n_todo = n_rows
    if HAS_COUNT:  # rows past a device-side count send nothing: no program visits them
        n_todo = tl.minimum(tl.load(count_ptr), n_rows)
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
            # NB: the peer's base is a load from the (W,) table, as pull_rows' stage base (a
            # select over the table in registers moved about 10% fewer bytes on 8-32 programs). The
            # bases are 16-byte aligned (launcher's contract), which the compiler cannot know of
            # a loaded address: with the hint 16-byte vector stores, without it one 2-byte store
            # per element (8x the instructions; it is what limits an SM budget).
            p_peer = tl.multiple_of(tl.load(rows_table_ptr + b_peer).to(tl.pointer_type(src_ptr.dtype.element_ty)),
                                    16)
            p_row = p_peer + b_row * H  # [BR] each row's destination
        for i_h in range(tl.program_id(1), tl.cdiv(H, BLOCK_H), tl.num_programs(1)):  # column blocks
            o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
            m = m_r[:, None] & (o_h < H)[None, :]
            b_x = tl.load(src_ptr + b_src[:, None] * H + o_h[None, :], mask=m, other=0)  # [BR, BH]
            if HAS_SCALE:  # fp32 (fp64) product, rounded once
                b_x = cast_rne(upcast(b_x, ACC_DTYPE) * b_scale[:, None], src_ptr.dtype.element_ty)
            tl.store(p_row[:, None] + o_h[None, :], b_x, mask=m)
        b_dst = b_dst_next
    if BARRIER:
        last_program_arrives(pads_table_ptr, counters_ptr, barrier_rank, timeout_ms, barrier_call_ptr, barrier_op,
                             WORLD_SIZE, False)


def put_rows(
    src: torch.Tensor,
    dst: torch.Tensor,
    dst_stride: int,
    rows_table: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    top_k: int = 1,
    scale: Optional[torch.Tensor] = None,
    acc_dtype: torch.dtype = torch.float32,
    count: Optional[torch.Tensor] = None,
    token: Optional[torch.Tensor] = None,
    max_programs: Optional[int] = None,
    epilogue: Optional[Epilogue] = None,
) -> None:
    """Write row ``i // top_k`` of ``src`` (rows, H) to the destination code ``dst[i]`` for every
    i < n, times ``scale.flat[i]`` when given; neighbouring i of one source row share its read.

    rows_table: (W,) int64 base addresses of every rank's row buffer (``src.dtype``; 16-byte
    aligned, as every region of SymmBuffers is: the kernel's vector stores rely on it). ``out``
    instead of ``rows_table``: one local (dst_stride, H) destination, no pointer table.
    ``count``: a one-element int64 device tensor; rows i >= count have no destination (-1) and
    are not visited: at most ``MAX_COUNTED_PROGRAMS`` row programs stride over the first count
    rows, so a mostly empty capacity C costs no launch of a program per row. ``token``: a (1,)
    int64 the kernel sets to 0 (``_config.order_after``; default: a fresh one). ``max_programs``: at
    most that many programs in all (an SM budget, ``_config.program_grid``), striding the same way.
    top_k and dst_stride are compile-time constants of the kernel: one compilation per (K, C).
    ``epilogue``: the barrier after the writes, run by the kernel's last program."""
    n, H = dst.numel(), src.shape[1]
    if n == 0 or H == 0:
        if epilogue is not None:  # nothing to write, still a barrier
            barrier_alone(epilogue, token)
        elif token is not None:
            token.zero_()
        return
    if (out is None) == (rows_table is None):
        raise ValueError("put_rows: pass exactly one of rows_table and out")
    require_contiguous("put_rows", out=out)
    src, dst, scale, rows_table = (None if t is None else t.contiguous() for t in (src, dst, scale, rows_table))
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
            or_new_token(token, dst.device), n, src.shape[0], H, world_size, K=top_k, DST_STRIDE=dst_stride,
            HAS_SCALE=scale is not None, ONE_OUT=out is not None, HAS_COUNT=count is not None,
            ACC_DTYPE=tl_acc_dtype(acc_dtype), BLOCK_R=blocks.BLOCK_R, BLOCK_H=blocks.BLOCK_H,
            num_warps=blocks.num_warps, **epilogue_args(epilogue, dst),
        )


@triton.jit
def _put_meta_kernel(
    send_meta_ptr, call_ptr, meta_table_ptr, token_ptr, idx_ptr, position_ptr, rank, world_size, E, e, L, n_status,
    n_slots, alignment, failed, col_n_slots, col_alignment, col_failed, col_call,
    pads_table_ptr, counters_ptr, barrier_call_ptr, barrier_rank, timeout_ms, barrier_op,
    BLOCK_L: tl.constexpr, BARRIER: tl.constexpr, WORLD_SIZE: tl.constexpr,
    PLAN: tl.constexpr, NP: tl.constexpr, NB: tl.constexpr, BLOCK_W: tl.constexpr,
):
    order_after(token_ptr)
    if PLAN:  # one program: the routing plan of idx first (send_meta and each slot's position), read below
        plan_first(idx_ptr, position_ptr, send_meta_ptr, n_slots, E, e, world_size, NP, NB, BLOCK_W)
    if BARRIER:  # one program: the barrier before the puts (the peers are done with the rows), advancing the call
        arrive_and_wait(pads_table_ptr, barrier_rank, timeout_ms, advance_call(counters_ptr, call_ptr), barrier_op,
                        barrier_rank, WORLD_SIZE)
        tl.debug_barrier()
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
    if BARRIER:
        last_program_arrives(pads_table_ptr, counters_ptr, barrier_rank, timeout_ms, barrier_call_ptr, barrier_op,
                             WORLD_SIZE, False)


def put_meta(send_meta: Optional[torch.Tensor], header: tuple[int, int, int], call_1: torch.Tensor,
             meta_table: torch.Tensor, rank: int, num_experts: int, meta_columns: int,
             columns: tuple[int, int, int, int], token: Optional[torch.Tensor] = None,
             max_programs: Optional[int] = None, epilogue: Optional[Epilogue] = None,
             topk_idx: Optional[torch.Tensor] = None,
             ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's metadata row into row ``rank`` of every rank's (W, L = meta_columns) int64
    metadata buffer, assembled on the way: column g < E the count of expert g (``send_meta``, the
    routing plan's (W, e + status), row g // e, column g % e), then the status (its first row's
    last columns), then the header: ``header`` = (n_slots, alignment, failed) and the call
    number ``call_1`` (1,) at the offsets ``columns`` = (n_slots, alignment, failed, call) past
    E; other columns 0. A program per peer, or at most ``max_programs`` striding over them (an
    SM budget). token: as put_rows'. ``epilogue`` (its call_1 is call_1, ``advance_before``
    set): the barrier before the puts, which sets call_1 to this rank's next call number, and
    the one after them, both in one program.

    ``topk_idx`` (T, K) instead of ``send_meta`` (at most ``routing_plan.ONE_PROGRAM_SLOTS``
    slots, ``routing_plan.one_program_sizes``): one program plans them first, as ``plan_slots``
    does (no order), and returns (position (T, K), send_meta (W, e + 3)): the plan and the put
    in one launch."""
    W, E = meta_table.numel(), num_experts
    e, dev, meta_table = E // W, call_1.device, meta_table.contiguous()
    if (send_meta is None) == (topk_idx is None):
        raise ValueError("put_meta: pass exactly one of send_meta and topk_idx")
    plan = dict(NOT_PLANNED_FIRST, BLOCK_W=triton.next_power_of_2(W))
    if topk_idx is not None:
        if topk_idx.numel() != header[0]:
            raise ValueError(f"put_meta: topk_idx of {topk_idx.numel()} slots, the header's n_slots {header[0]}")
        idx, position, send_meta, constexprs = PlannedFirst.of(topk_idx, E, W, "put_meta")
        plan.update(constexprs, **({} if interpreting() else dict(num_warps=PLAN_NUM_WARPS)))
    else:
        send_meta = send_meta.contiguous()
        idx = position = send_meta  # unread
    grid = (1,) if epilogue is not None or topk_idx is not None else program_grid(W, 1, max_programs)[:1]
    with LAUNCH_LOCK:
        launch(_put_meta_kernel, send_meta)[grid](
            send_meta, call_1, meta_table, or_new_token(token, dev), idx, position, rank, W, E, e, meta_columns,
            send_meta.shape[1] - e, *header, *columns, BLOCK_L=triton.next_power_of_2(max(1, min(meta_columns, 1024))),
            **epilogue_args(epilogue, call_1, one_program=True), **plan,
        )
    return None if topk_idx is None else (position, send_meta)


_TAG_COLUMNS = tl.constexpr(TAG_COLUMNS)
_FP8_BLOCK = tl.constexpr(BLOCK)
_FP8_MAX, _AMAX_FLOOR = tl.constexpr(FP8_MAX), tl.constexpr(AMAX_FLOOR)
_SLOTS_PER_BLOCK = 1024
"""Slots per block of post_slots' tag loop."""


@triton.jit
def _post_slots_kernel(
    src_ptr, scale_ptr, dst_ptr, tag_index_ptr, stage_table_ptr, tags_table_ptr, token_ptr,
    n_slots, n_src, X, P, world_size, rank, tag_base,
    pads_table_ptr, counters_ptr, barrier_call_ptr, barrier_rank, timeout_ms, barrier_op,
    K: tl.constexpr, DST_STRIDE: tl.constexpr, HAS_SCALE: tl.constexpr, STAGE: tl.constexpr,
    QUANTIZE: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr, BARRIER: tl.constexpr, WORLD_SIZE: tl.constexpr,
):
    order_after(token_ptr)
    if QUANTIZE:  # this rank's rows, once each, quantized into fp8 wire rows in its own stage
        # (``payload.pack``'s of P bytes: X values, then X / 128 fp32 scales), where the receivers
        # read them. NB: P is an argument, so that the launch tells the compiler its alignment (the
        # rows' stores are vectors only where P is a multiple of 16)
        wire_ptr = tl.multiple_of(tl.load(stage_table_ptr + rank).to(tl.pointer_type(tl.uint8)), 16)
        for i_r in range(tl.program_id(0), tl.cdiv(n_src, BLOCK_R), tl.num_programs(0)):
            o_r = (i_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR] source rows
            m_r = o_r < n_src
            for i_b in range(tl.program_id(1), X // _FP8_BLOCK, tl.num_programs(1)):  # 128-channel blocks
                o_c = i_b * _FP8_BLOCK + tl.arange(0, _FP8_BLOCK)  # [128]
                b_x = upcast(tl.load(src_ptr + o_r[:, None] * X + o_c[None, :], mask=m_r[:, None], other=0),
                             tl.float32)
                b_values, b_scale = quantize_block(b_x, _FP8_MAX, _AMAX_FLOOR)  # [BR, 128], [BR]
                tl.store(wire_ptr + o_r[:, None] * P + o_c[None, :], b_values, mask=m_r[:, None])
                tl.store((wire_ptr + o_r * P + X + i_b * 4).to(tl.pointer_type(tl.float32)), b_scale, mask=m_r)
    elif STAGE:  # this rank's rows, once each, into its own stage, where the receivers read them
        stage_ptr = tl.multiple_of(tl.load(stage_table_ptr + rank).to(tl.pointer_type(src_ptr.dtype.element_ty)), 16)
        for i_r in range(tl.program_id(0), tl.cdiv(n_src, BLOCK_R), tl.num_programs(0)):
            o_r = (i_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR] source rows
            for i_h in range(tl.program_id(1), tl.cdiv(X, BLOCK_H), tl.num_programs(1)):
                o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
                m = (o_r < n_src)[:, None] & (o_h < X)[None, :]
                b_x = tl.load(src_ptr + o_r[:, None] * X + o_h[None, :], mask=m)
                tl.store(stage_ptr + o_r[:, None] * X + o_h[None, :], b_x, mask=m)
    # each slot's tag into this rank's tags, where the receivers read them: a header (rows, slots
    # a row), then (destination code or -1, source code, scale bits) per slot
    p_tags = tl.load(tags_table_ptr + rank).to(tl.pointer_type(tl.int64))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(p_tags, tl.full([], n_src, tl.int64))
        tl.store(p_tags + 1, tl.full([], K, tl.int64))
    if tl.program_id(1) == 0:
        for i_s in range(tl.program_id(0), tl.cdiv(n_slots, BLOCK_S), tl.num_programs(0)):
            o_s = (i_s * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)  # [BS] slots t * K + k
            m_s = o_s < n_slots
            b_dst = tl.load(dst_ptr + o_s, mask=m_s, other=-1)
            m_dst = m_s & (b_dst >= 0) & (b_dst < world_size * DST_STRIDE) & (o_s // K < n_src)
            b_bits = tl.zeros([BLOCK_S], dtype=tl.int64)
            if HAS_SCALE:
                b_scale = upcast(tl.load(scale_ptr + o_s, mask=m_s, other=0), ACC_DTYPE)
                if ACC_DTYPE == tl.float64:
                    b_bits = b_scale.to(tl.int64, bitcast=True)
                else:
                    b_bits = b_scale.to(tl.int32, bitcast=True).to(tl.int64)
            p_tag = p_tags + (1 + o_s) * _TAG_COLUMNS
            tl.store(p_tag, tl.where(m_dst, b_dst, -1), mask=m_s)
            tl.store(p_tag + 1, tag_base + tl.load(tag_index_ptr + o_s, mask=m_s, other=0), mask=m_s)
            tl.store(p_tag + 2, b_bits, mask=m_s)
    if BARRIER:
        last_program_arrives(pads_table_ptr, counters_ptr, barrier_rank, timeout_ms, barrier_call_ptr, barrier_op,
                             WORLD_SIZE, False)


def post_slots(
    rows: torch.Tensor,
    dst: torch.Tensor,
    dst_stride: int,
    tags_table: torch.Tensor,
    tag_index: torch.Tensor,
    *,
    rank: int,
    tag_base: int,
    top_k: int = 1,
    scale: Optional[torch.Tensor] = None,
    stage_table: Optional[torch.Tensor] = None,
    acc_dtype: torch.dtype = torch.float32,
    token: Optional[torch.Tensor] = None,
    max_programs: Optional[int] = None,
    epilogue: Optional[Epilogue] = None,
    quantize: bool = False,
) -> None:
    """The sender's half of a pulled exchange, into this rank's tags (``tags_table``: (W,) int64
    base addresses of every rank's (1 + N_max, TAG_COLUMNS) tags; row ``rank``'s written): a
    header (n = ``rows.shape[0]``, ``top_k``), then for every slot i < N = ``dst.numel()`` its
    tag (destination code ``dst[i] = peer * dst_stride + row``, -1 where none or out of range,
    source code ``tag_base + tag_index[i]``, the bits of ``scale.flat[i]`` in ``acc_dtype`` or
    0), which the receivers' ``pull_rows`` read. With ``stage_table`` ((W,) base addresses of
    every rank's stage, 16-byte aligned), this rank's ``rows`` (n, X) are also copied into its
    own stage, once each, where the receivers read them (without it they read ``rows`` itself:
    tests); ``quantize``: float rows (n, H), H a multiple of 128, quantized there into fp8 wire
    rows instead (``fp8.quantize``, ``payload.pack``'s rows of P = H + 4 H / 128 bytes), in the
    same pass. token, max_programs, epilogue: as put_rows'."""
    n_src, X = rows.shape
    if quantize and (stage_table is None or X % BLOCK):
        raise ValueError(f"post_slots: quantize needs a stage and rows of a multiple of {BLOCK} channels, got "
                         f"{X} channels{'' if stage_table is not None else ' and no stage'}")
    N = dst.numel()
    rows, dst, scale, tag_index, tags_table = (
        None if t is None else t.contiguous() for t in (rows, dst, scale, tag_index, tags_table))
    world_size = tags_table.numel()
    blocks = row_blocks("put_rows", n_src, X, rows.element_size(), max_programs)
    block_r, num_warps = blocks.BLOCK_R, blocks.num_warps
    if quantize:
        (row_programs, h_programs), block_r, num_warps = quantize_tiles(n_src, X, max_programs, post=True)
    elif stage_table is not None:
        row_programs, h_programs = blocks.grid(n_src, X)
        row_programs, h_programs = program_grid(max(row_programs, 1), h_programs, max_programs)
    else:
        row_programs, h_programs = program_grid(triton.cdiv(max(N, 1), _SLOTS_PER_BLOCK), 1, max_programs)
    with LAUNCH_LOCK:
        launch(_post_slots_kernel, rows)[(row_programs, h_programs)](
            rows, scale if scale is not None else rows, dst, tag_index,
            stage_table if stage_table is not None else tags_table, tags_table, or_new_token(token, rows.device),
            N, n_src, X, packed_width(X) if quantize else X, world_size, rank, tag_base, K=top_k,
            DST_STRIDE=dst_stride, HAS_SCALE=scale is not None, STAGE=stage_table is not None, QUANTIZE=quantize,
            ACC_DTYPE=tl_acc_dtype(acc_dtype), BLOCK_R=block_r, BLOCK_H=blocks.BLOCK_H, BLOCK_S=_SLOTS_PER_BLOCK,
            num_warps=num_warps, **epilogue_args(epilogue, dst),
        )


@triton.jit
def _slot_rows(p_tag, k, o_t, n_tokens, top_k, own_first, dst_stride):
    """Slot k's rows here (codes less own_first) of tokens o_t [BR] of a sender (p_tag [BR]: each
    token's first tag), and which of them name a row here: this rank's destination codes are
    [own_first, own_first + dst_stride)."""
    # NB: o_t against a scalar, not a mask & a scalar (the interpreter)
    b_dst = tl.load(p_tag + k * _TAG_COLUMNS, mask=o_t < tl.where(top_k > k, n_tokens, 0), other=-1)
    return b_dst - own_first, (b_dst >= own_first) & (b_dst < own_first + dst_stride)


@triton.jit
def _store_columns(out_ptr, tail_ptr, o_row, m_row, o_h, b_x, X, X_OUT, HAS_TAIL: tl.constexpr):
    """Columns o_h < X of rows o_row (masked by m_row): [0, X_OUT) into out, [X_OUT, X) into tail
    (with HAS_TAIL; else X_OUT = X)."""
    m_h = o_h < X
    if HAS_TAIL:
        m_out = o_h < X_OUT
        tl.store(out_ptr + o_row * X_OUT + o_h, b_x.to(out_ptr.dtype.element_ty), mask=m_row & m_h & m_out)
        tl.store(tail_ptr + o_row * (X - X_OUT) + (o_h - X_OUT), b_x.to(tail_ptr.dtype.element_ty),
                 mask=m_row & m_h & ~m_out)
    else:
        tl.store(out_ptr + o_row * X + o_h, b_x, mask=m_row & m_h)


@triton.jit
def _store_dequantized(out_ptr, tail_ptr, o_row, m_row, o_b, o_h, b_value, b_block_scale, n_scales, X_OUT):
    """Rows o_row [BR] (masked by m_row) of dequantized values [BR, BB, 128] of scale blocks o_b
    [BB] (columns o_h [BB, 128]) into out, and their scales [BR, BB] into tail."""
    m_write = m_row[:, None] & (o_b < n_scales)[None, :]  # [BR, BB]
    tl.store(out_ptr + o_row[:, None, None] * X_OUT + o_h[None, :, :], b_value, mask=m_write[:, :, None])
    tl.store(tail_ptr.to(tl.pointer_type(tl.float32)) + o_row[:, None] * n_scales + o_b[None, :], b_block_scale,
             mask=m_write)


@triton.jit
def _pull_rows_kernel(
    rows_ptr, stage_table_ptr, tags_table_ptr, rank, dst_stride, world_size, row_map_ptr, position_ptr, scale_ptr,
    num_routed_ptr, pads_ptr, n_pads, out_ptr, tail_ptr, row_src_ptr, token_ptr, n_rows, X, X_OUT,
    pads_table_ptr, counters_ptr, barrier_call_ptr, barrier_rank, timeout_ms, barrier_op,
    K: tl.constexpr, ROW_MAP: tl.constexpr, STAGED: tl.constexpr, HAS_SCALE: tl.constexpr,
    ACC_DTYPE: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BARRIER: tl.constexpr, WORLD_SIZE: tl.constexpr,
    DEQUANTIZE: tl.constexpr,
):
    order_after(token_ptr)
    BLOCK_B: tl.constexpr = BLOCK_H // _FP8_BLOCK if BLOCK_H >= _FP8_BLOCK else 1  # dequantize: scale blocks a step
    SLOTS: tl.constexpr = 1 if ROW_MAP else K  # rows a loaded row is stored into: a token's slots (peers)
    n_scales = X_OUT // _FP8_BLOCK
    o_c = tl.arange(0, _FP8_BLOCK)  # [128] columns of a scale block
    # An item: one rank, a block of rows d, each row's slot from the placement's row map; peers, a
    # block of one sender's tokens, each token's row loaded once and stored into every row of this
    # rank that one of its slots goes to, the senders in turn (the programs running at once read
    # from all of them). NB: each slot's tag is loaded once an item, a [BLOCK_R] vector per slot k,
    # and its row here, mask (and scale) held in tuples for the item's column steps; never picked
    # out of a [BLOCK_R, K] tile: that is a sum across threads (shuffles, shared memory, barriers).
    # The tuples fit because a thread holds one token (the step's layout, below); where a thread
    # held several tokens' rows they spilled (H100, W = 4, fp8 wire rows, 16 programs: 1095 ->
    # 4408 us; twenty-fifth session, docs/benchmarks.md). The tags' bases are loaded here, not in
    # a helper: inductor's analysis of which arguments a kernel writes would see a store through
    # a helper's result as a store into the helper's arguments (the address tables).
    if ROW_MAP:
        n_routed = tl.minimum(tl.load(num_routed_ptr), n_rows)  # rows [0, n_routed) written, the rest left as they are
        n_items = tl.cdiv(n_routed, BLOCK_R)
    else:
        n_token_blocks = tl.zeros([], dtype=tl.int64)
        for w in range(world_size):  # each sender's tokens: its header's first word
            n_tokens_w = tl.load(tl.load(tags_table_ptr + w).to(tl.pointer_type(tl.int64)))
            n_token_blocks = tl.maximum(n_token_blocks, tl.cdiv(n_tokens_w, BLOCK_R))
        n_items = n_token_blocks * world_size
        own_first = rank * dst_stride  # destination codes of this rank's rows: [own_first, own_first + dst_stride)
    for i_item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        if ROW_MAP:
            first, n_first = i_item * BLOCK_R, n_routed
        else:
            s = i_item % world_size
            p_tags = tl.load(tags_table_ptr + s).to(tl.pointer_type(tl.int64))
            n_tokens, top_k = tl.load(p_tags), tl.load(p_tags + 1)  # the header: K = top_k >= K_s
            first, n_first = (i_item // world_size) * BLOCK_R, n_tokens
        if first < n_first:
            o_i = (first + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR] rows here (row map) or the sender's tokens
            if ROW_MAP:
                m_routed = o_i < n_routed
                b_slot = tl.load(row_map_ptr + o_i, mask=m_routed, other=-1)  # [BR] each row's slot i, -1: none
                b_code = tl.load(position_ptr + b_slot, mask=m_routed & (b_slot >= 0), other=-1)  # its send position
                m_src = m_routed & (b_code >= 0)  # [BR] rows to load
                p_src = rows_ptr + (b_slot // K) * X  # [BR]
                o_dsts, m_dsts = (o_i,), (m_routed,)
                if HAS_SCALE:
                    b_scales = (upcast(tl.load(scale_ptr + b_slot, mask=m_src, other=0), ACC_DTYPE),)
                tl.store(row_src_ptr + o_i, b_code, mask=m_routed)
            else:
                p_tag = p_tags + (1 + o_i * top_k) * _TAG_COLUMNS  # [BR] each token's first slot's tag
                m_src = o_i < 0  # [BR] tokens with a row here
                o_dsts, m_dsts, b_scales = (), (), ()  # K [BR] vectors: slot k's row here, whether it has one, scale
                for k in tl.static_range(K):
                    o_dst, m_k = _slot_rows(p_tag, k, o_i, n_tokens, top_k, own_first, dst_stride)
                    m_src |= m_k
                    tl.store(row_src_ptr + o_dst, tl.load(p_tag + k * _TAG_COLUMNS + 1, mask=m_k), mask=m_k)
                    o_dsts, m_dsts = o_dsts + (tl.where(m_k, o_dst, 0),), m_dsts + (m_k,)
                    if HAS_SCALE:  # the slot's scale bits
                        b_bits = tl.load(p_tag + k * _TAG_COLUMNS + 2, mask=m_k, other=0)
                        if ACC_DTYPE == tl.float64:
                            b_scales = b_scales + (b_bits.to(tl.float64, bitcast=True),)
                        else:
                            b_scales = b_scales + (b_bits.to(tl.int32).to(tl.float32, bitcast=True),)
                if STAGED:  # 16-byte aligned stages (every region of SymmBuffers): vector loads
                    p_src = tl.multiple_of(tl.load(stage_table_ptr + s).to(tl.pointer_type(tail_ptr.dtype.element_ty)),
                                           16) + o_i * X  # [BR]
                else:
                    p_src = rows_ptr + o_i * X
            if DEQUANTIZE:  # fp8 values times the fp32 scale of their 128-column block, rounded once
                # NB: a step is [BLOCK_R, BLOCK_B, 128]: whole scale blocks, each block's scale loaded
                # once and broadcast over its columns in the tile's own layout. The scales (the
                # wire row's tail) go to tail as they are.
                p_scale = (p_src + X_OUT).to(tl.pointer_type(tl.float32))  # [BR] each row's scales
                for i_b in range(0, n_scales, BLOCK_B):
                    o_b = i_b + tl.arange(0, BLOCK_B)  # [BB] blocks
                    m_read = m_src[:, None] & (o_b < n_scales)[None, :]  # [BR, BB]
                    b_block_scale = tl.load(p_scale[:, None] + o_b[None, :], mask=m_read, other=0)  # [BR, BB]
                    o_h = o_b[:, None] * _FP8_BLOCK + o_c[None, :]  # [BB, 128]
                    b_bits = tl.load(p_src[:, None, None] + o_h[None, :, :], mask=m_read[:, :, None], other=0)
                    b_value = cast_rne(e4m3_value(b_bits) * b_block_scale[:, :, None], out_ptr.dtype.element_ty)
                    for k in tl.static_range(SLOTS):  # NB: each slot's rows reloaded (held: 4 tokens a thread at
                        # the GPU tile, 204 registers against 168, 2 programs an SM against 3; the
                        # dispatch 3% slower at W = 4, H100, twenty-sixth session)
                        if ROW_MAP:
                            o_dst, m_dst = o_i, m_routed
                        else:
                            o_dst, m_dst = _slot_rows(p_tag, k, o_i, n_tokens, top_k, own_first, dst_stride)
                        _store_dequantized(out_ptr, tail_ptr, o_dst, m_dst, o_b, o_h, b_value, b_block_scale, n_scales,
                                           X_OUT)
            else:
                # NB: a step is BLOCK_H // BLOCK_C loads of [BLOCK_R, BLOCK_C], all issued before the
                # first store, then each stored into its slots' rows. The launcher sets BLOCK_C so
                # that the warps spread over rows, not columns (a warp on a row at the budget tiles):
                # a thread holds one row, so it loads one token's tags once an item, computes each
                # slot's row address once a step and stores its pieces at constant offsets from it.
                # With the columns of a step spread over the warps (a [BLOCK_R, BLOCK_H] or [REPS,
                # BLOCK_R, LANES] step: Triton 3.6 put the warps on the columns first), each thread held
                # 4 rows and reloaded their tags each step: 669 instructions a step, and the pull
                # moved 0.33x a plain gather's GB/s on 16 programs of an H100 (ncu: issue-bound;
                # twenty-sixth session, docs/benchmarks.md). The tail (HAS_TAIL: fp8 scale
                # bytes, X - X_OUT <= BLOCK_T) is loaded with the first values and stored after the
                # last: one load's wait an item. Stored with each piece instead (two addresses a
                # slot), the fp8 GPU tile took 118 registers a thread, 4 programs an SM.
                o_cols = tl.arange(0, BLOCK_C)[None, :]  # [1, BC]
                if HAS_TAIL:
                    o_tail = tl.arange(0, BLOCK_T)[None, :]  # [1, BT]
                    m_tail = o_tail < X - X_OUT
                    b_tail = tl.load(p_src[:, None] + X_OUT + o_tail, mask=m_src[:, None] & m_tail, other=0)
                for i_h in range(0, X_OUT, BLOCK_H):
                    b_xs = ()  # BLOCK_H // BLOCK_C [BR, BC] pieces of the rows
                    for i_c in tl.static_range(BLOCK_H // BLOCK_C):
                        o_h = i_h + i_c * BLOCK_C + o_cols
                        b_xs = b_xs + (tl.load(p_src[:, None] + o_h, mask=m_src[:, None] & (o_h < X_OUT), other=0),)
                    for k in tl.static_range(SLOTS):
                        for i_c in tl.static_range(BLOCK_H // BLOCK_C):
                            o_h = i_h + i_c * BLOCK_C + o_cols
                            b_y = b_xs[i_c]
                            if HAS_SCALE:  # fp32 (fp64) product, rounded once
                                b_y = cast_rne(upcast(b_y, ACC_DTYPE) * b_scales[k][:, None], out_ptr.dtype.element_ty)
                            tl.store(out_ptr + o_dsts[k][:, None] * X_OUT + o_h, b_y,
                                     mask=m_dsts[k][:, None] & (o_h < X_OUT))
                if HAS_TAIL:
                    for k in tl.static_range(SLOTS):
                        tl.store(tail_ptr + o_dsts[k][:, None] * (X - X_OUT) + o_tail, b_tail,
                                 mask=m_dsts[k][:, None] & m_tail)
    if not ROW_MAP:
        for i_pad in range(tl.program_id(0), n_pads, tl.num_programs(0)):  # a local expert's padding rows: zero
            for row in range(tl.load(pads_ptr + i_pad), tl.load(pads_ptr + n_pads + i_pad)):
                for i_h in range(0, X, BLOCK_H):
                    o_h = i_h + tl.arange(0, BLOCK_H)
                    b_zero = tl.zeros([BLOCK_H], dtype=tail_ptr.dtype.element_ty)
                    _store_columns(out_ptr, tail_ptr, row, o_h < X, o_h, b_zero, X, X_OUT, HAS_TAIL)
                tl.store(row_src_ptr + row, -1)
    if BARRIER:  # every rank is done reading the stages and tags before any writes them again
        last_program_arrives(pads_table_ptr, counters_ptr, barrier_rank, timeout_ms, barrier_call_ptr, barrier_op,
                             WORLD_SIZE, False)


def pull_tile(wire_rows: bool, dequantize: bool) -> str:
    """The key of the token pull's tiles (``_config.GPU_BLOCKS``, ``BUDGET_BLOCKS``): fp8 wire rows
    (values and their scales' tail) moved as they are, dequantized, or rows of one dtype."""
    return "pull_tokens_dequantize" if dequantize else "pull_tokens_fp8" if wire_rows else "pull_tokens"


def row_piece(blocks: RowBlocks, element_size: int) -> int:
    """Columns of one load of the pull's step (``BLOCK_C``): 16 bytes a thread, a warp's 32
    threads along a row, as many warps on a row as the program has more warps than rows (warps on
    rows, not columns)."""
    return min(blocks.BLOCK_H, 32 * 16 // element_size * max(1, blocks.num_warps // blocks.BLOCK_R))


def pull_rows(
    tags: Optional[Region], num_routed: torch.Tensor, out: torch.Tensor, row_src: torch.Tensor, *,
    rows: Optional[torch.Tensor] = None,
    stage_table: Optional[torch.Tensor] = None,
    dst_stride: int = 0,
    scaled: bool = False,
    pads: Optional[torch.Tensor] = None,
    row_map: Optional[torch.Tensor] = None,
    position: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None,
    top_k: int = 1,
    tokens: int = 1,
    acc_dtype: torch.dtype = torch.float32,
    tail: Optional[torch.Tensor] = None,
    token: Optional[torch.Tensor] = None,
    max_programs: Optional[int] = None,
    epilogue: Optional[Epilogue] = None,
    dequantize: bool = False,
) -> None:
    """The receiver's half of a pulled exchange, into ``out`` (C, X) and ``row_src`` (C,).

    With ``tags`` (a region of this rank's tags, ``_config.Region``, whose table names every
    rank's, ``post_slots``' layout: a header (rows n_s, slots a row K_s), then a tag (destination
    code, source code, scale bits) per slot): for every sender s and slot i < n_s K_s whose
    destination code is ``tags.index * dst_stride + d``, ``out[d]`` = row i // K_s of s's rows,
    times the slot's scale when ``scaled`` (in ``acc_dtype``, rounded once), and ``row_src[d]``
    its source code. Each sender's row is loaded once, and stored into every row of this rank
    that one of its slots goes to. s's rows: ``stage_table[s]`` (every rank's stage, (W,) base
    addresses), or ``rows`` (every sender's, tests). ``pads`` (2, e): each local expert's
    padding rows [pads[0, j], pads[1, j]), zero with row_src -1 (the placement's, with peers).
    ``top_k``: at least every sender's K_s; ``tokens``: the rows a sender posts, for the grid
    (more are still pulled). ``num_routed`` is not read: the rows written are the ones the
    senders' slots and the pads name, all below it.

    One rank, without tags: ``row_map`` (C,) (the placement's row_slot: each row's slot i, -1
    none), with ``rows``, ``position`` (N,) and ``scale`` (N,) or None: for the first n =
    ``num_routed`` rows d (a one-element int64 device tensor, no host sync), row d is ``rows[i //
    top_k]`` times ``scale[i]``, zero where i is -1, its code ``position[i]``; rows [n, C) of
    out and row_src are not written.

    With ``tail`` (C, X - X_out) of out's dtype, out (C, X_out) takes the first X_out columns
    of each row and tail the rest (fp8 wire rows into values and scale bytes); ``dequantize``:
    out (C, X_out) is float and takes each fp8 value (the row's first X_out bytes) times the fp32
    scale of its 128-column block (the row's tail bytes), rounded once, as ``fp8.dequantize``
    (tail and the source rows uint8: one pass). At most ``MAX_COUNTED_PROGRAMS`` programs, or
    max_programs (an SM budget), each striding over its blocks. token: as put_rows'.
    ``epilogue``: the barrier after the reads (no rank writes a stage or tags again before every
    rank is done with them), run by the kernel's last program."""
    if (tags is None) == (row_map is None):
        raise ValueError("pull_rows: pass exactly one of tags and row_map")
    if row_map is not None and (rows is None or position is None):
        raise ValueError("pull_rows: a row_map needs rows and position (one rank)")
    C = out.shape[0]
    if C == 0:
        if epilogue is not None:
            barrier_alone(epilogue, token)
        elif token is not None:
            token.zero_()
        return
    if (rows is None) == (stage_table is None):
        raise ValueError("pull_rows: pass exactly one of rows and stage_table")
    require_contiguous("pull_rows", out=out, row_src=row_src, tail=tail)
    X = out.shape[1] + (0 if tail is None else tail.shape[1])
    wire = out.dtype if tail is None else tail.dtype  # the source rows' dtype
    if dequantize and (tail is None or wire != torch.uint8 or not out.dtype.is_floating_point or scaled
                       or scale is not None or out.shape[1] % BLOCK):
        raise ValueError(f"pull_rows: dequantize needs a uint8 tail, a float out of a multiple of {BLOCK} columns "
                         f"and no scale (got tail {None if tail is None else tail.dtype}, out {tuple(out.shape)} "
                         f"{out.dtype})")
    if tail is not None and tail.dtype != out.dtype and not dequantize:
        raise ValueError(f"pull_rows: out and tail must have one dtype, got {out.dtype} and {tail.dtype}")
    if rows is not None and (rows.dtype != wire or rows.shape[1] != X):
        raise ValueError(f"pull_rows: rows must be (n, {X}) {wire}, got {tuple(rows.shape)} {rows.dtype}")
    if tags is not None and C > dst_stride:
        raise ValueError(f"pull_rows: out of {C} rows, more than the destination codes' stride {dst_stride}")
    rows, row_map, position, scale, pads = (None if t is None else t.contiguous()
                                            for t in (rows, row_map, position, scale, pads))
    # NB: a dequantizing tile holds fp32 products: sized as 4-byte elements, as many registers as a plain one
    element_size = 4 if dequantize else wire.itemsize
    if tags is None:
        blocks = row_blocks("pull_rows", C, X, element_size, max_programs)
        programs, K = blocks.grid(C, X)[0], top_k  # NB: one program per row block across all of X (see the kernel)
        tags_table, world_size = row_map, 1  # unread
    else:
        world_size = tags.table.numel()  # items: every sender's tokens
        blocks = row_blocks(pull_tile(tail is not None, dequantize), world_size * tokens, X, element_size,
                            max_programs, spread=True)
        programs, K = world_size * triton.cdiv(max(tokens, 1), blocks.BLOCK_R), top_k
        tags_table = tags.table
    with LAUNCH_LOCK:
        launch(_pull_rows_kernel, out)[program_grid(min(programs, MAX_COUNTED_PROGRAMS), 1, max_programs)[:1]](
            rows if rows is not None else out, stage_table if stage_table is not None else tags_table, tags_table,
            0 if tags is None else tags.index, dst_stride, world_size,
            row_map if row_map is not None else row_src, position if position is not None else row_src,
            scale if scale is not None else num_routed, num_routed, pads if pads is not None else row_src,
            0 if pads is None else pads.numel() // 2, out, tail if tail is not None else out, row_src,
            or_new_token(token, out.device), C, X, out.shape[1], K=K,
            ROW_MAP=row_map is not None, STAGED=stage_table is not None,
            HAS_SCALE=scaled if row_map is None else scale is not None, ACC_DTYPE=tl_acc_dtype(acc_dtype),
            HAS_TAIL=tail is not None, BLOCK_R=blocks.BLOCK_R, BLOCK_H=blocks.BLOCK_H,
            BLOCK_C=blocks.BLOCK_H if interpreting() else row_piece(blocks, wire.itemsize),  # interpreter: one piece
            BLOCK_T=triton.next_power_of_2(max(1, X - out.shape[1])),
            num_warps=blocks.num_warps, DEQUANTIZE=dequantize,
            **epilogue_args(epilogue, out),
        )
