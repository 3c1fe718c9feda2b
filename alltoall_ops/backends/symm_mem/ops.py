"""The custom ops of the symm_mem backend, with their fakes and autograd, and the checks they
run on the exchanged metadata."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Union

import torch

from ... import layout, overlap
from ..._compat import graph_constant, input_grads, inputs_as, named_inputs, per_trace
from ...comm import comm_op
from ...errors import CapacityError, GroupMismatchError, PeerInputError, RoutingError
from ...kernels import loader
from ...kernels.region import TAG_COLUMNS, Region, new_token
from ...payload import FORMATS, PLAIN
from ...rows import accumulation_dtype, weight_grad_op
from .buffers import ALIGNMENT, CALL, FAILED, META, N_SLOTS, ROWS, TAGS, SymmBuffers, check_payload
from .segments import COMBINE_OP, DISPATCH_OP, META_OP


# --------------------------------------------------------------------------------------------
# Checks on the exchanged metadata (every rank sees the same metadata, so all agree)


CHECK_COLUMNS = (FAILED, CALL, ALIGNMENT, 0, N_SLOTS)
"""Columns past the E counts that the placement kernel checks (``kernels/slot_placement.py``):
the failure flag, the call number, the alignment, the status' count of bad ids, N = T * K."""

HEADER_COLUMNS = (N_SLOTS, ALIGNMENT, FAILED, CALL)
"""Columns past the E counts of a metadata row's header, as ``kernels.row_put.put_meta`` writes it."""

def _raise_failed_checks(failed_checks_1: torch.Tensor, meta_WL: torch.Tensor, bufs: SymmBuffers,
                         expert_alignment: int) -> None:
    """The placement kernel's failed checks (1,) on every rank's metadata (W, L), in the order: a
    rank's failure flag, the call numbers, the alignments, the expert ids, T * K, and the
    capacity (unless overflow='drop'). CPU: the first failed check raises at once (every rank
    sees the same metadata, so all raise alike). CUDA: nothing here; the placement kernel's own
    device-side assert (``assert_checks``) surfaces at the next synchronisation, no host sync."""
    if failed_checks_1.device.type != "cpu":
        return
    failed_checks = int(failed_checks_1)
    if not failed_checks:
        return
    E, W, C = bufs.num_experts, bufs.world_size, bufs.capacity
    counts, status, extra = meta_WL[:, :E], meta_WL[:, E : E + layout.STATUS_COLUMNS], meta_WL[:, E:]
    n_slots = extra[:, N_SLOTS]

    def peer_failed() -> str:
        messages = bufs._segments.gather_objects(bufs._own_error)  # every rank takes this path
        s = int(torch.nonzero(extra[:, FAILED])[0])
        return (f"alltoall_ops.dispatch (symm_mem, rank {bufs.rank} of {W}): rank {s} rejected its arguments: "
                f"{messages[s] or 'see its error'}")

    def bad_ids() -> str:
        s = int(torch.nonzero(status[:, 0] > 0)[0])
        return str(layout.bad_ids_error(s, status[s].tolist(), E))

    def too_many_slots() -> str:
        s = int(torch.nonzero(n_slots > bufs.max_slots)[0])
        return (f"rank {s} dispatched T * K = {int(n_slots[s])} slots, more than the buffers' "
                f"max_tokens_per_rank * top_k = {bufs.max_slots}; {bufs.max_tokens_hint}")

    def overflow() -> str:
        needed = layout.padded_tokens_per_expert(counts, expert_alignment).view(W, -1).sum(1)  # (W,) rows per rank
        r = int(torch.nonzero(needed > C)[0])
        return (f"symm_mem dispatch overflow: rank {r} must receive {int(needed[r])} rows "
                f"(expert_alignment={expert_alignment}) but the buffers' capacity is C = {C}; "
                f"create SymmBuffers with a larger capacity (default: the worst case), or with "
                f"overflow='drop' to drop the rows past C and count them")

    checks: list[tuple[type, Callable[[], str]]] = [  # in the order of the kernel's bits
        (PeerInputError, peer_failed),
        (GroupMismatchError, lambda: (
            f"alltoall_ops.dispatch (symm_mem): the ranks are out of step: their calls on these buffers are "
            f"{extra[:, CALL].tolist()} (by rank); every rank must call dispatch the same number of times")),
        (GroupMismatchError, lambda: (
            f"alltoall_ops.dispatch (symm_mem): the ranks disagree on expert_alignment: "
            f"{extra[:, ALIGNMENT].tolist()} (by rank); every rank must pass the same")),
        (RoutingError, bad_ids),
        (CapacityError, too_many_slots),
        (CapacityError, overflow),
    ]
    kind, message = checks[(failed_checks & -failed_checks).bit_length() - 1]  # the lowest bit set
    raise kind(message())


class SlotArgs(NamedTuple):
    """One dispatch's slots on these buffers: the arguments of the ``symm_dispatch`` /
    ``symm_combine`` ops after the rows (combine's ``row_src_C`` aside), passed by name
    (``**slots.kwargs()``)."""

    position_TK: torch.Tensor
    slot_dst_N: torch.Tensor
    row_slot_C: torch.Tensor
    num_routed_1: torch.Tensor
    call_1: torch.Tensor
    buffers: SymmBuffers

    @classmethod
    def of(cls, op, inputs: tuple) -> "SlotArgs":
        """The slots among an op's autograd ``inputs``, taken by argument name."""
        return inputs_as(cls, op, inputs)

    def kwargs(self) -> dict:
        return self._asdict()


# --------------------------------------------------------------------------------------------
# Ops. Each: kernel writes into peers' buffers (dispatch: its tags and its rows into its own
# stage), barrier (all writes landed), reads into fresh tensors (dispatch: each row pulled from
# its sender's stage), barrier (every rank is done reading what a peer writes next). No op has
# an entry barrier: the last barrier of the op before it, on every rank, comes after every read
# of what it overwrites (the metadata exchange keeps one before its put, which advances the
# call number). The barriers are stamped with the op and the call number of its metadata
# exchange (call_1, device data): ranks out of step raise (CUDA: a device-side assert) there.
# On CUDA symmetric memory every barrier is the epilogue of the kernel before it (its last
# program runs it), and the metadata exchange's two barriers and put are one program
# (``_Segments.barrier_after``): 2 launches for the exchange, 2 for a dispatch or a combine.
#
# Compiled on CUDA (buffers whose barriers are device work), each op's body is inlined: its
# kernels are launched by inductor's code. They reach the buffers through the address tables (graph
# constants: ``_addresses``), and every kernel of a body sets a (1,) token (one per buffers
# object in a graph: ``_token``), which orders them as written. Inlined: one rank's plain
# buffers, and CUDA symmetric memory (the path with peers) unless ALLTOALL_OPS_INLINE_SYMMETRIC=0;
# docs/design.md ("symm_mem ops in compiled graphs").


def _inlined(bound: dict) -> bool:
    """Whether a call's body is traced into compiled graphs (``_compat.custom_op(inline=...)``).
    Not an fp8 dispatch with peers: it encodes its rows into this rank's stage, a view of the
    buffers' memory (a tensor, not an address a kernel loads), which compiled code must not hold."""
    buffers = bound["buffers"]
    if buffers.device.type != "cuda" or not buffers._segments.device_ordered:
        return False
    return not buffers.peer_path or bound.get("payload", PLAIN.name) == PLAIN.name


def _addresses(buffers: SymmBuffers) -> tuple[torch.Tensor, ...]:
    """The buffers' address tables (1, W) of TAGS, ROWS and META, constants of compiled code."""
    return tuple(graph_constant(t) for t in buffers.tables)


def _token(buffers: SymmBuffers, device: torch.device) -> torch.Tensor:
    """The ordering token of an op's kernels that touch the buffers (``kernels._config.order_after``):
    fresh in eager code, where the stream orders the ops; in a traced graph one per buffers
    object, so that inductor keeps the kernels of every op on these buffers in program order (two
    exchanges of independent inputs must not interleave: the second post would overwrite the stage
    the peers of the first pull from)."""
    return per_trace(("symm_mem token", id(buffers)), lambda: new_token(device))


def _own(buffers: SymmBuffers, tables: tuple[torch.Tensor, ...], region: int, shape: tuple[int, int],
         dtype: torch.dtype) -> Region:
    """This rank's ``region`` (TAGS, ROWS, META) of the buffers, named by address."""
    return Region(tables[region], buffers.rank, shape, dtype)


@comm_op("symm_exchange_meta", inline=_inlined)
def symm_exchange_meta_op(
    topk_idx_TK: torch.Tensor, buffers: SymmBuffers, expert_alignment: int, failed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's topk_idx (T, K) -> position (T, K) (each slot's place in send order, the
    routing plan's), meta_WL (W, L), slot_dst (N,), row_slot (one rank: (C,); with peers (2 e,),
    each local expert's padding rows, which the dispatch's pull zeroes),
    tokens_per_expert (e,), num_routed (1,), dropped (W,), int64.

    The routing plan (``layout.plan_routing``) counts this rank's slots per expert. Every rank
    puts its metadata row (L,) into every peer's buffer (an all-gather): its counts per expert,
    its routing status, then N_SLOTS = T * K, ALIGNMENT, FAILED (``failed``: this rank rejected
    its arguments) and CALL, the call number of the exchange on ``buffers``, counted on the
    device by the barrier before its put (zero on one rank, which has no peers to be out of step
    with): the dispatch and combine of this step stamp their barriers with it. Then one kernel
    (``kernels/slot_placement.py``) checks every row (raised on every rank alike, see
    ``_raise_failed_checks``) and places this rank's slots (``SymmMemHandle``): meta_WL is every
    rank's row. "One rank" here and below: buffers without the path with peers
    (``SymmBuffers.peer_path``; one rank unless allocator='symmetric'). One rank: no exchange;
    the kernel reads the plan's send_meta and this call's header, and row_slot is each routed
    row's slot, which its dispatches read their rows by (no tags). Up to ``ONE_PROGRAM_SLOTS``
    slots the first kernel's one program plans them first, one launch for both: the put's
    (``put_meta(topk_idx=...)``), or one rank's placement's (``place_slots(None, ...)``)."""
    W, E, N, k = buffers.world_size, buffers.num_experts, topk_idx_TK.numel(), loader.load()
    one_program = k.routing_plan.one_program_sizes(N, E) is not None
    meta = position_TK = token_1 = None  # one program: planned by the kernel that reads the plan
    if not one_program:
        plan = layout.plan_routing(topk_idx_TK, E, W, buffers.num_sms)
        meta, position_TK = plan.send_meta, plan.position  # one rank: the all-gather of one row is the row
    if buffers.peer_path:
        tables, token_1 = _addresses(buffers), _token(buffers, topk_idx_TK.device)
        call_1 = torch.empty(1, dtype=torch.int64, device=topk_idx_TK.device)  # set by the barrier before
        with buffers._segments.barrier_after(META_OP, call_1, token_1, advance_before=True) as epilogue:
            planned = k.put_meta(meta, (N, expert_alignment, int(failed)), call_1, tables[META], buffers.rank, E,
                                 buffers.meta_columns, HEADER_COLUMNS, token=token_1, max_programs=buffers.num_sms,
                                 epilogue=epilogue, topk_idx=topk_idx_TK if one_program else None)
        if one_program:
            position_TK, _ = planned
        meta = _own(buffers, tables, META, (W, buffers.meta_columns), torch.int64)
    p = k.place_slots(
        meta, topk_idx_TK, position_TK, num_experts=E, world_size=W, rank=buffers.rank,
        meta_columns=buffers.meta_columns, columns=CHECK_COLUMNS, expert_alignment=expert_alignment,
        max_slots=buffers.max_slots, capacity=buffers.capacity, check_overflow=buffers.overflow != "drop",
        assert_checks=True, token=token_1, max_programs=buffers.num_sms,
    )
    _raise_failed_checks(p.failed_checks_1, p.meta_WL, buffers, expert_alignment)
    return p.position_TK, p.meta_WL, p.slot_dst_N, p.row_slot_C, p.tokens_per_expert_e, p.num_routed_1, p.dropped_W


@symm_exchange_meta_op.register_fake
def _(topk_idx_TK, buffers, expert_alignment, failed=False):
    W, e = buffers.world_size, buffers.num_local_experts
    sizes = (topk_idx_TK.shape, (W, buffers.meta_columns), (topk_idx_TK.numel(),),
             (2 * e if buffers.peer_path else buffers.capacity,), (e,), (1,), (W,))
    return tuple(topk_idx_TK.new_empty(size, dtype=torch.int64) for size in sizes)


@comm_op("symm_dispatch", inline=_inlined)
@overlap.startable
def symm_dispatch_op(
    x_TH: torch.Tensor,
    scale_TK: Optional[torch.Tensor],
    position_TK: torch.Tensor,
    slot_dst_N: torch.Tensor,
    row_slot_C: torch.Tensor,
    num_routed_1: torch.Tensor,
    call_1: torch.Tensor,
    buffers: SymmBuffers,
    x_scale_TB: Optional[torch.Tensor] = None,
    payload: str = "plain",
    out_dtype: Optional[torch.dtype] = None,
    async_op: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, H) rows -> routed (C, H), routed_scale (C, B), row_src (C,) int64.

    Slot (t, k) carries row ``x_TH[t]`` (times ``scale_TK[t, k]`` in fp32, rounded once) to
    ``slot_dst_N[t * K + k]``, tagged with its send position ``position_TK[t, k]`` (one rank:
    row d pulls slot ``row_slot_C[d]``, the placement's, with no tags). num_routed_1:
    (1,) int64 n = tokens_per_expert.sum(), every received row lies below it. call_1: (1,) int64,
    the call number of the dispatch's metadata exchange (its barriers' stamp). routed: rows
    [0, n) received, zero where none; rows [n, C) unspecified (not written). row_src: each row's
    source code (``rank * N_max + position``), -1 where none; rows [n, C) not written either.
    payload, x_scale_TB, out_dtype: the rows' format, as the collective ``dispatch`` op's; a
    format with scales needs buffers created for it (``payload_dtype``): each token's packed
    wire row (``payload.pack``, P bytes) is what moves, and the receiver's pull splits it into
    values and scales. async_op: the barriers and kernels on the communication stream, pending
    until ``overlap.wait``."""
    fmt, C, H = FORMATS[payload], buffers.capacity, x_TH.shape[1]
    if fmt is not PLAIN:  # plain rows fit any buffers' stage (with fp8: combine's backward)
        check_payload(buffers, fmt)
    if fmt is PLAIN:
        values_CH, scale_CB = x_TH.new_empty(C, H), None
        row_src_C = _post_and_pull(x_TH, scale_TK, position_TK, slot_dst_N, row_slot_C, num_routed_1, call_1,
                                   buffers, values_CH)
    else:
        # NB: each slot moves one wire row (values' bytes, then its scales'), encoded where it is
        # posted (with peers: straight into this rank's stage, by the post itself where it can
        # quantize x, one launch with the tags); the pull splits the received ones
        # into values and scale bytes, rows < n only, and with out_dtype dequantizes the values
        # on the way (fp8's decode in the same pass).
        wire_TP = Encoded(lambda out_TP: fmt.encode_packed(x_TH, x_scale_TB, buffers.num_sms, out_TP=out_TP),
                          (x_TH.shape[0], fmt.wire_bytes(H, x_TH.dtype)), torch.uint8,
                          x_TH if fmt.kernel_quantizes(x_scale_TB) else None)
        values_CH = x_TH.new_empty(C, H, dtype=torch.uint8 if out_dtype is None else out_dtype)
        scale_CB = x_TH.new_empty(C, fmt.scale_columns(H), dtype=fmt.scale_dtype)
        row_src_C = _post_and_pull(wire_TP, None, position_TK, slot_dst_N, row_slot_C, num_routed_1, call_1, buffers,
                                   values_CH, scale_CB.view(torch.uint8), dequantize=out_dtype is not None)
        if out_dtype is not None:
            return values_CH, scale_CB, row_src_C
    return (*fmt.decode(values_CH, scale_CB, out_dtype), row_src_C)


class Encoded(NamedTuple):
    """Rows a dispatch encodes where they are posted (fp8's wire rows): ``write(out_TX)`` writes
    the (T, X) rows of ``dtype`` into out_TX and returns it. ``x_TH``: the float rows (T, H) that
    the post quantizes into the stage itself, in the same pass (``post_slots(quantize=True)``), or
    None (``write`` encodes them)."""

    write: Callable[[torch.Tensor], torch.Tensor]
    shape: tuple[int, int]
    dtype: torch.dtype
    x_TH: Optional[torch.Tensor]


def _post_and_pull(
    rows_TX: Union[torch.Tensor, Encoded],
    scale_TK: Optional[torch.Tensor],
    position_TK: torch.Tensor,
    slot_dst_N: torch.Tensor,
    row_slot_C: torch.Tensor,
    num_routed_1: torch.Tensor,
    call_1: torch.Tensor,
    buffers: SymmBuffers,
    out_CX: torch.Tensor,
    tail: Optional[torch.Tensor] = None,
    dequantize: bool = False,
) -> torch.Tensor:
    """The body of a dispatch: ``post_slots``: each slot's tag (destination, source code, scale)
    into this rank's tags, and (W > 1) the rows ``rows_TX`` (T, X), once each, into this rank's
    stage (the ROWS region; :class:`Encoded` rows are encoded there instead); barrier;
    ``pull_rows``: every sender's tokens with a slot here, each read once from its stage and
    stored, times each slot's scale, into the rows of ``out_CX`` its slots name (with ``tail``:
    their first columns, the rest into tail; ``dequantize``: fp8 values into a float out_CX,
    ``pull_rows``'), and the local experts' padding rows (``row_slot_C``, the placement's) zero;
    rows past num_routed not written; barrier. Each row is written once where it is used. One
    rank: only the pull, by the placement's ``row_slot_C`` (no peers, no tags, no barrier).
    Returns row_src (C,)."""
    k, device = loader.load(), out_CX.device
    (T, K), C = position_TK.shape, buffers.capacity
    encoded = isinstance(rows_TX, Encoded)
    if not encoded:
        rows_TX = rows_TX.contiguous()  # NB: one copy of strided rows, read by both kernels
    X, dtype = rows_TX.shape[1], rows_TX.dtype
    acc = accumulation_dtype(dtype, *(() if scale_TK is None else (scale_TK.dtype,)))
    row_src_C = torch.empty(C, dtype=torch.int64, device=device)
    if not buffers.peer_path:
        if encoded:
            rows_TX = rows_TX.write(torch.empty(rows_TX.shape, dtype=dtype, device=device))
        k.pull_rows(None, num_routed_1, out_CX, row_src_C, rows=rows_TX, row_map=row_slot_C,
                    position=position_TK.reshape(-1), scale=scale_TK, top_k=K, acc_dtype=acc, tail=tail,
                    dequantize=dequantize, max_programs=buffers.num_sms)
        return row_src_C
    stage_bytes = buffers.rows.numel() * buffers.rows.element_size()
    if T * X * dtype.itemsize > stage_bytes:
        raise CapacityError(f"symm_dispatch: {T} rows of {X} {dtype} do not fit the buffers' stage of "
                            f"{stage_bytes} bytes")
    tables, token_1 = _addresses(buffers), _token(buffers, device)
    # NB: peers read only symmetric memory: the rows go through this rank's stage (the ROWS region)
    quantize = encoded and rows_TX.x_TH is not None  # the post quantizes them into the stage
    if encoded and not quantize:  # encoded into the stage now (the peers are done with it); the post: tags only
        stage_bytes_TX = buffers.rows.view(-1).view(torch.uint8)[:T * X * dtype.itemsize]  # the ROWS region's start
        rows_TX = rows_TX.write(stage_bytes_TX.view(dtype).view(T, X))
    with buffers._segments.barrier_after(DISPATCH_OP, call_1, token_1) as epilogue:
        k.post_slots(rows_TX.x_TH if quantize else rows_TX, slot_dst_N, C, tables[TAGS], position_TK.reshape(-1),
                     rank=buffers.rank, tag_base=buffers.rank * buffers.max_slots, top_k=K, scale=scale_TK,
                     stage_table=tables[ROWS] if quantize or not encoded else None, acc_dtype=acc, token=token_1,
                     max_programs=buffers.num_sms, epilogue=epilogue, quantize=quantize)
    with buffers._segments.barrier_after(DISPATCH_OP, call_1, token_1) as epilogue:
        k.pull_rows(_own(buffers, tables, TAGS, (1 + buffers.max_slots, TAG_COLUMNS), torch.int64), num_routed_1,
                    out_CX, row_src_C, stage_table=tables[ROWS], dst_stride=C, scaled=scale_TK is not None,
                    pads=row_slot_C, top_k=buffers.top_k, tokens=T, acc_dtype=acc, tail=tail, token=token_1,
                    max_programs=buffers.num_sms, epilogue=epilogue, dequantize=dequantize)
    return row_src_C


@symm_dispatch_op.register_fake
def _(x_TH, scale_TK, position_TK, slot_dst_N, row_slot_C, num_routed_1, call_1, buffers, x_scale_TB=None,
      payload="plain", out_dtype=None, async_op=False):
    # NB: fixed capacity C, so no data-dependent size: the graph never waits for the counts.
    fmt, C = FORMATS[payload], buffers.capacity
    if fmt is not PLAIN:
        check_payload(buffers, fmt)
    return (*fmt.empty_routed(x_TH, C, out_dtype), x_TH.new_empty(C, dtype=torch.int64))


def _symm_dispatch_setup_context(ctx, inputs, output):
    named = named_inputs(symm_dispatch_op, inputs)
    x_TH, scale_TK = named["x_TH"], named["scale_TK"]
    ctx.slots = SlotArgs.of(symm_dispatch_op, inputs)
    # fp8-valued rows carry no gradient; dequantized ones the combine of theirs (straight-through)
    ctx.differentiable = named["payload"] == PLAIN.name or named["out_dtype"] is not None
    ctx.set_materialize_grads(False)
    scale_needs_grad = scale_TK is not None and scale_TK.requires_grad
    overlap.save_for_backward(ctx, output, named["async_op"], output[2], scale_TK,  # row_src_C
                              x_TH if scale_needs_grad else None)


def _symm_dispatch_backward(ctx, grad_routed_CH, _grad_scale_CB, _grad_row_src_C):
    # The adjoint of dispatch is combine, weighted by the same per-slot scale. Built from the ops
    # themselves (like the local backend), so double backward is exact too.
    row_src_C, scale_TK, x_TH = overlap.saved_tensors(ctx)
    if not ctx.differentiable or grad_routed_CH is None:
        return input_grads(symm_dispatch_op)
    grad_x_TH, returned_NH = symm_combine_op(expert_out_CH=grad_routed_CH, weights_TK=scale_TK, row_src_C=row_src_C,
                                             **ctx.slots.kwargs(), save_returned=x_TH is not None)
    # d scale[t, k] = <x[t], grad_routed[row of slot (t, k)]>: the returned rows are those rows.
    grad_scale_TK = None if x_TH is None else weight_grad_op(x_TH, returned_NH, ctx.slots.position_TK, scale_TK,
                                                                   ctx.slots.buffers.num_sms)
    return input_grads(symm_dispatch_op, x_TH=grad_x_TH, scale_TK=grad_scale_TK)


symm_dispatch_op.register_autograd(_symm_dispatch_backward, setup_context=_symm_dispatch_setup_context)


@comm_op("symm_combine", inline=_inlined)
@overlap.startable
def symm_combine_op(
    expert_out_CH: torch.Tensor,
    weights_TK: Optional[torch.Tensor],
    position_TK: torch.Tensor,
    slot_dst_N: torch.Tensor,
    row_slot_C: torch.Tensor,
    row_src_C: torch.Tensor,
    num_routed_1: torch.Tensor,
    call_1: torch.Tensor,
    buffers: SymmBuffers,
    save_returned: bool,
    async_op: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, H) expert outputs in dispatch order -> y (T, H), returned (N, H) or (0, H).

    Row d < num_routed_1 goes back to its source (``row_src_C[d]``; rows where it is -1, and
    every row past num_routed_1, are not read); then y[t] = sum_k weights_TK[t, k] * row of slot (t, k),
    in k order, accumulated in fp32 (fp64) and rounded once. returned: every slot's row in send
    order (zero for unsent slots), when ``save_returned``, for the weights' gradient.
    num_routed_1: dispatch's, for the backward (a dispatch). call_1: (1,) int64, the call number
    of the dispatch's metadata exchange (its barriers' stamp). async_op: as symm_dispatch's."""
    k = loader.load()
    (T, K), H = position_TK.shape, expert_out_CH.shape[1]
    y_TH = expert_out_CH.new_empty(T, H)
    returned_NH = expert_out_CH.new_empty(T * K if save_returned else 0, H)
    acc = accumulation_dtype(expert_out_CH.dtype, *(() if weights_TK is None else (weights_TK.dtype,)))
    if not buffers.peer_path:
        # NB: one rank: every row is where the reduction reads it (slot_dst = row). Nothing moves
        # and no peer waits: no buffer to order kernels on, nothing to keep alive.
        k.topk_reduce(expert_out_CH, position_TK, slot_dst_N, weights_TK, y_TH, returned_NH if save_returned else None,
                      acc, max_programs=buffers.num_sms, read_at_slot_dst=True)
        return y_TH, returned_NH
    tables, token_1 = _addresses(buffers), _token(buffers, expert_out_CH.device)
    with buffers._segments.barrier_after(COMBINE_OP, call_1, token_1) as epilogue:
        k.put_rows(expert_out_CH, row_src_C, buffers.max_slots, tables[ROWS], count=num_routed_1, token=token_1,
                   max_programs=buffers.num_sms, epilogue=epilogue)
    with buffers._segments.barrier_after(COMBINE_OP, call_1, token_1) as epilogue:
        k.topk_reduce(
            _own(buffers, tables, ROWS, (buffers.max_slots, H), expert_out_CH.dtype), position_TK, slot_dst_N,
            weights_TK, y_TH, returned_NH if save_returned else None, acc, max_programs=buffers.num_sms, token=token_1,
            epilogue=epilogue,
        )
    return y_TH, returned_NH


@symm_combine_op.register_fake
def _(expert_out_CH, weights_TK, position_TK, slot_dst_N, row_slot_C, row_src_C, num_routed_1, call_1, buffers,
      save_returned, async_op=False):
    # NB: static shapes: T and K from position_TK.
    T, K = position_TK.shape
    H = expert_out_CH.shape[1]
    return expert_out_CH.new_empty(T, H), expert_out_CH.new_empty(T * K if save_returned else 0, H)


def _symm_combine_setup_context(ctx, inputs, output):
    named = named_inputs(symm_combine_op, inputs)
    ctx.slots, ctx.save_returned = SlotArgs.of(symm_combine_op, inputs), named["save_returned"]
    ctx.set_materialize_grads(False)  # `returned_NH` gets a gradient only in double backward
    overlap.save_for_backward(ctx, output, named["async_op"], named["weights_TK"],
                              output[1] if ctx.save_returned else None)


def _symm_combine_backward(ctx, grad_y_TH, grad_returned_NH):
    weights_TK, returned_NH = overlap.saved_tensors(ctx)
    slots = ctx.slots
    grad_expert_out_CH = grad_weights_TK = None
    if ctx.needs_input_grad[0] and grad_y_TH is not None:
        # The adjoint of combine is dispatch with each slot's row scaled by its weight.
        grad_expert_out_CH, _, _ = symm_dispatch_op(x_TH=grad_y_TH, scale_TK=weights_TK, **slots.kwargs())
    if ctx.needs_input_grad[0] and grad_returned_NH is not None and ctx.save_returned:
        # returned[position[t, k]] is the row of slot (t, k): dispatch the returned rows' gradient
        # back to those rows, as N "tokens" of K = 1 taken in slot order.
        by_slot_NH = grad_returned_NH.index_select(0, slots.position_TK.reshape(-1))
        as_tokens = slots._replace(position_TK=slots.position_TK.reshape(-1, 1))
        grad_rows_CH, _, _ = symm_dispatch_op(x_TH=by_slot_NH, scale_TK=None, **as_tokens.kwargs())
        grad_expert_out_CH = grad_rows_CH if grad_expert_out_CH is None else grad_expert_out_CH + grad_rows_CH
    if ctx.needs_input_grad[1] and grad_y_TH is not None:
        if returned_NH is None:
            raise RuntimeError(
                "symm_combine: topk_weights need a gradient, but the op was called with "
                "save_returned=False; alltoall_ops.combine sets it when the weights require grad"
            )
        grad_weights_TK = weight_grad_op(grad_y_TH, returned_NH, slots.position_TK, weights_TK,
                                         slots.buffers.num_sms)
    return input_grads(symm_combine_op, expert_out_CH=grad_expert_out_CH, weights_TK=grad_weights_TK)


symm_combine_op.register_autograd(_symm_combine_backward, setup_context=_symm_combine_setup_context)
