"""The routing maths, once, for every backend; no communication: the
``alltoall_ops::plan_routing`` op (two Triton kernels on CUDA, plain torch ops elsewhere), pure
traceable tensor functions (padding, block starts, expert-major rows, each slot's destination
row) and the one host read of a dispatch's split sizes.

Shape legend (used across the package):
    T  local tokens          H  hidden size          K  top-k slots per token
    E  global experts        W  group size           e = E / W local experts
    N = T * K routed slots   R  rows received by a rank (padding included)

Layout conventions:
- *Send order* (on the source rank): valid slots sorted by global expert id, stable in slot
  index; since rank r owns experts [r*e, (r+1)*e) this is rank-major, then local expert, then
  token order. Dropped (-1) and out-of-range slots come after all valid ones.
- *Rank-major* (what the all-to-all delivers): for each source rank, for each local expert, rows.
- *Expert-major* (what ``dispatch`` returns): for each local expert, for each source rank, rows;
  each expert's group is zero-padded to a multiple of ``expert_alignment``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence, TypeVar

import torch

from ._compat import call, custom_op
from .errors import RoutingError
from .kernels import loader
from .validation import BAD_IDS

IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)

STATUS_COLUMNS = 3
"""Extra columns of a routing-metadata matrix: (number of bad expert ids, min id, max id)."""


@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    """Per-call routing layout of one rank, built by :func:`plan_routing`.

    order: (N,) int64, slot index (t * K + k) at each send-order position.
    position: (T, K) int64, send-order position of each slot (the inverse of ``order``);
        dropped slots have positions >= the number of valid slots.
    send_meta: (W, e + STATUS_COLUMNS) int64; ``send_meta[r, :e]`` counts the slots this rank
        sends to each local expert of rank r; the status columns repeat this rank's input check.
    """

    order: torch.Tensor
    position: torch.Tensor
    send_meta: torch.Tensor


def plan_routing(topk_idx: torch.Tensor, num_experts: int, world_size: int,
                 max_programs: Optional[int] = None) -> RoutingPlan:
    """Sort the (T, K) slots of ``topk_idx`` into send order and count them per expert.

    Out-of-range ids are treated as dropped here and reported in the status columns, so that
    the metadata exchange can tell every rank about them before any payload moves. One op
    (``alltoall_ops::plan_routing``; called directly in plain eager code): on CUDA one kernel
    launch up to ``ONE_PROGRAM_SLOTS`` slots, else three, and no sort (up to
    ``kernels.routing_plan.MAX_SLOTS`` slots; a stable sort above), of
    at most ``max_programs`` programs each (an SM budget: symm_mem's ``num_sms``)."""
    order, position, send_meta = call(plan_routing_op, topk_idx, num_experts, world_size, max_programs)
    return RoutingPlan(order=order, position=position, send_meta=send_meta)


def _plan_routing(
    topk_idx: torch.Tensor, num_experts: int, world_size: int, max_programs: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, K) integer expert ids -> order (N,), position (T, K), send_meta (W, e + STATUS_COLUMNS)."""
    if loader.use_kernels(topk_idx):
        kernels = loader.load()
        if topk_idx.numel() <= kernels.routing_plan.MAX_SLOTS:
            return kernels.plan_slots(topk_idx, num_experts, world_size, max_programs)
    return _plan_routing_torch(topk_idx, num_experts, world_size)


plan_routing_op = custom_op("alltoall_ops::plan_routing", _plan_routing, inline=True)


@plan_routing_op.register_fake
def _(topk_idx, num_experts, world_size, max_programs=None):
    # NB: every shape follows from T, K, E and W: nothing waits for the ids.
    T, K = topk_idx.shape
    new = dict(dtype=torch.int64, device=topk_idx.device)
    e = num_experts // world_size
    return topk_idx.new_empty(T * K, **new), topk_idx.new_empty(T, K, **new), \
        topk_idx.new_empty(world_size, e + STATUS_COLUMNS, **new)


def _plan_routing_torch(topk_idx: torch.Tensor, num_experts: int, world_size: int):
    """plan_routing_op in torch ops: a stable sort of the slots by expert (the reference of the
    Triton kernels in ``kernels/routing_plan.py``)."""
    T, K = topk_idx.shape
    N = T * K
    e = num_experts // world_size
    idx = topk_idx.reshape(N).to(torch.int64)
    valid = (idx >= 0) & (idx < num_experts)
    bad = (idx < -1) | (idx >= num_experts)
    bucket = torch.where(valid, idx, num_experts)  # (N,), E = the "goes nowhere" bucket
    # NB: the narrowest key dtype: a radix sort makes one pass per key byte (2 instead of 8).
    key_dtype = torch.int16 if num_experts < torch.iinfo(torch.int16).max else torch.int32
    order = torch.argsort(bucket.to(key_dtype), stable=True)
    position = torch.empty_like(order).scatter_(
        0, order, torch.arange(N, device=idx.device)
    )
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    guard = torch.full((1,), -1, dtype=torch.int64, device=idx.device)  # min/max of empty T
    with_guard = torch.cat([idx, guard])
    status = torch.stack([bad.sum(), with_guard.min(), with_guard.max()])  # (STATUS_COLUMNS,)
    send_meta = torch.cat(
        [counts[:num_experts].view(world_size, e), status.expand(world_size, STATUS_COLUMNS)],
        dim=1,
    )
    return order, position.view(T, K), send_meta


def local_capacity(num_slots: int, num_experts: int, expert_alignment: int) -> int:
    """C = N + E * (expert_alignment - 1): the static row count of one rank's expert-major rows
    (``plan_rows``), the most N slots over E experts padded to the alignment can need."""
    return num_slots + num_experts * (expert_alignment - 1)


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """One rank's expert-major rows (the ``local`` backend's layout), built by :func:`plan_rows`.

    row_src: (C,) int64, the slot t * K + k whose token fills each row, -1 for padding and for
        the rows past the last expert's group (C = :func:`local_capacity`).
    row: (T, K) int64, the row of each slot; C for a dropped slot (-1, or an id outside [0, E)).
    tokens_per_expert: (E,) int64 rows of each expert's group, padded to the alignment.
    status: (STATUS_COLUMNS,) int64, (number of bad expert ids, min id, max id).
    Rows: expert 0's group first, each group in token order, groups padded to the alignment."""

    row_src: torch.Tensor
    row: torch.Tensor
    tokens_per_expert: torch.Tensor
    status: torch.Tensor


def plan_rows(topk_idx: torch.Tensor, num_experts: int, expert_alignment: int) -> RowPlan:
    """Where every slot of ``topk_idx`` (T, K) lands among one rank's C expert-major rows, on the
    device with static shapes (no host sync). One op (``alltoall_ops::plan_rows``): on CUDA the
    kernels of ``kernels/routing_plan.py`` (one launch up to its ``ONE_PROGRAM_SLOTS`` slots),
    which also assert that no id is bad; a stable sort elsewhere and above its ``MAX_SLOTS``."""
    row_src, row, meta = call(plan_rows_op, topk_idx, num_experts, expert_alignment)
    return RowPlan(row_src, row, meta[0, :num_experts], meta[0, num_experts : num_experts + STATUS_COLUMNS])


def _plan_rows(
    topk_idx: torch.Tensor, num_experts: int, expert_alignment: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, K) integer expert ids -> row_src (C,), row (T, K), meta (1, E + STATUS_COLUMNS + 1):
    tokens per expert, the status, and 1 where no id is bad (0 else)."""
    C = local_capacity(topk_idx.numel(), num_experts, expert_alignment)
    if loader.use_kernels(topk_idx) and topk_idx.numel() <= loader.load().routing_plan.MAX_SLOTS:
        on_cuda = topk_idx.device.type == "cuda"
        planned = loader.load().plan_rows(topk_idx, num_experts, expert_alignment, C, assert_valid=on_cuda)
        if on_cuda:  # the kernel's own device-side assert: no launch of its own
            return planned
    else:
        planned = _plan_rows_torch(topk_idx, num_experts, expert_alignment, C)
    check_status(planned[2][0, num_experts:], num_experts)
    return planned


def check_status(status_ok: torch.Tensor, num_experts: int) -> None:
    """Raise :class:`RoutingError` if one rank's routing status (num_bad, min id, max id, then 1
    where no id is bad) reports bad expert ids; no host read: a device-side assert on CUDA (it
    surfaces at the next synchronisation, as a CUDA error), on the CPU the same assert, re-raised
    as the typed error with the ids it saw."""
    ok_1 = status_ok[STATUS_COLUMNS:]
    if status_ok.device.type != "cpu":
        torch._assert_async(ok_1, BAD_IDS)
        return
    try:
        torch._assert_async(ok_1, BAD_IDS)
    except RuntimeError:
        raise bad_ids_error(0, status_ok[:STATUS_COLUMNS].tolist(), num_experts) from None


# NB: inlined on CUDA only, where a bad id is a device-side assert anyway; on the CPU the call
# keeps raising the RoutingError that names the ids.
plan_rows_op = custom_op("alltoall_ops::plan_rows", _plan_rows, inline="cuda")


@plan_rows_op.register_fake
def _(topk_idx, num_experts, expert_alignment):
    # NB: C follows from T, K, E and the alignment: the rows never wait for the ids.
    T, K = topk_idx.shape
    new = dict(dtype=torch.int64, device=topk_idx.device)
    C = local_capacity(T * K, num_experts, expert_alignment)
    return (topk_idx.new_empty(C, **new), topk_idx.new_empty(T, K, **new),
            topk_idx.new_empty(1, num_experts + STATUS_COLUMNS + 1, **new))


def _plan_rows_torch(topk_idx: torch.Tensor, num_experts: int, expert_alignment: int, num_rows: int):
    """plan_rows_op in torch ops (the reference of the kernels' ``plan_rows``): the send order of
    :func:`_plan_routing_torch`, each slot moved to its expert's padded group."""
    T, K = topk_idx.shape
    _, position_TK, meta_1L = _plan_routing_torch(topk_idx, num_experts, 1)
    counts_E, status_S = meta_1L[0, :num_experts], meta_1L[0, num_experts:]
    padded_E = round_up(counts_E, expert_alignment)
    idx_N = topk_idx.reshape(-1).to(torch.int64)
    valid_N = (idx_N >= 0) & (idx_N < num_experts)
    shift_E = exclusive_cumsum(padded_E, 0) - exclusive_cumsum(counts_E, 0)  # group start - first send position
    row_N = torch.where(valid_N, shift_E.index_select(0, idx_N.clamp(0, num_experts - 1)) + position_TK.reshape(-1),
                        num_rows)
    row_src = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=topk_idx.device)
    row_src.scatter_(0, row_N, torch.arange(T * K, device=topk_idx.device))  # dropped slots land on row C
    ok_1 = (status_S[:1] == 0).to(torch.int64)
    return row_src[:num_rows].clone(), row_N.view(T, K), torch.cat([padded_E, status_S, ok_1])[None]


class DispatchLayout(NamedTuple):
    """Who receives what from this rank's routing, as DeepEP's ``get_dispatch_layout`` counts it
    (ids outside [0, E) count nowhere):

    tokens_per_rank: (W,) int64, tokens with at least one of their K experts on rank r;
    tokens_per_expert: (E,) int64, slots routed to each global expert;
    tokens_per_node: (num_nodes,) int64, tokens with at least one expert on a rank of node n
        (ranks [n * W / num_nodes, (n + 1) * W / num_nodes));
    is_token_in_rank: (T, W) bool, token t goes to rank r (once, however many of r's experts)."""

    tokens_per_rank: torch.Tensor
    tokens_per_expert: torch.Tensor
    tokens_per_node: torch.Tensor
    is_token_in_rank: torch.Tensor


@torch.library.custom_op("alltoall_ops::dispatch_layout", mutates_args=())
def dispatch_layout_op(
    topk_idx: torch.Tensor, num_experts: int, world_size: int, num_nodes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, K) expert ids -> :class:`DispatchLayout`'s four tensors, with fixed shapes and no host
    sync on every device: on CUDA one Triton kernel launch after three memsets
    (``kernels/dispatch_layout.py``; CUDA-graph capturable), plain torch ops elsewhere
    (:func:`_dispatch_layout_torch`, the kernel's reference)."""
    if loader.use_kernels(topk_idx):
        return loader.load().dispatch_layout(topk_idx, num_experts, world_size, num_nodes)
    return _dispatch_layout_torch(topk_idx, num_experts, world_size, num_nodes)


@dispatch_layout_op.register_fake
def _(topk_idx, num_experts, world_size, num_nodes):
    new = dict(dtype=torch.int64, device=topk_idx.device)
    T = topk_idx.shape[0]
    return (topk_idx.new_empty(world_size, **new), topk_idx.new_empty(num_experts, **new),
            topk_idx.new_empty(num_nodes, **new), topk_idx.new_empty(T, world_size, dtype=torch.bool))


def _dispatch_layout_torch(
    topk_idx: torch.Tensor, num_experts: int, world_size: int, num_nodes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dispatch_layout_op in torch ops (the reference of the Triton kernel in
    ``kernels/dispatch_layout.py``)."""
    T, K = topk_idx.shape
    E, W = num_experts, world_size
    idx_TK = topk_idx.to(torch.int64)
    valid_TK = (idx_TK >= 0) & (idx_TK < E)
    safe_TK = torch.where(valid_TK, idx_TK, 0)
    tokens_per_expert_E = torch.zeros(E, dtype=torch.int64, device=topk_idx.device)
    tokens_per_expert_E.scatter_add_(0, safe_TK.reshape(-1), valid_TK.reshape(-1).to(torch.int64))
    in_rank_TW = torch.zeros(T, W, dtype=torch.int64, device=topk_idx.device)
    in_rank_TW.scatter_reduce_(1, safe_TK // (E // W), valid_TK.to(torch.int64), reduce="amax")
    in_node_TN = in_rank_TW.view(T, num_nodes, W // num_nodes).amax(2)
    return in_rank_TW.sum(0), tokens_per_expert_E, in_node_TN.sum(0), in_rank_TW.bool()


def split_meta(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, e + STATUS_COLUMNS) metadata -> counts (W, e) and status (W, STATUS_COLUMNS)."""
    return meta[:, :-STATUS_COLUMNS], meta[:, -STATUS_COLUMNS:]


def round_up(n: IntOrTensor, multiple: int) -> IntOrTensor:
    """``n`` (an int or an integer tensor) rounded up to a multiple of ``multiple``: the size of
    an expert's row group padded to ``expert_alignment``."""
    return (n + multiple - 1) // multiple * multiple


def exclusive_cumsum(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum of the entries before each entry along ``dim`` (the start of each block)."""
    return t.cumsum(dim) - t


def padded_tokens_per_expert(recv_counts: torch.Tensor, expert_alignment: int) -> torch.Tensor:
    """(W, G) rows from each rank per expert (G = e for one receiver) -> (G,) rows per expert, padded."""
    per_expert = recv_counts.sum(0)
    return per_expert if expert_alignment == 1 else round_up(per_expert, expert_alignment)


def block_starts(counts: torch.Tensor, num_local_experts: int, expert_alignment: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each (source rank, expert) block of rows starts in its owner's expert-major output.

    counts: (W, G) rows each source rank s sends to each expert g of one or more owners
    (G = owners * e, owner of g = g // e). Returns ``starts`` (W, G), the first row of block
    (s, g) on g's owner (its expert group's start, plus the rows of g from lower ranks), and
    ``padded`` (G,), each expert's group size padded to ``expert_alignment``."""
    padded = padded_tokens_per_expert(counts, expert_alignment)  # (G,)
    expert_start = exclusive_cumsum(padded.view(-1, num_local_experts), 1).view(-1)  # (G,)
    return expert_start + exclusive_cumsum(counts, 0), padded


def expert_of_rows(tokens_per_expert: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(e,) rows per local expert (``dispatch``'s tokens_per_expert) -> (num_rows,) int64 local
    expert of each routed row; e for rows past the last group (symm_mem's capacity rows)."""
    rows = torch.arange(num_rows, device=tokens_per_expert.device)
    return torch.searchsorted(torch.cumsum(tokens_per_expert, 0), rows, right=True)


def expert_major_rows(recv_counts: torch.Tensor, expert_alignment: int, num_received: int) -> torch.Tensor:
    """Destination row in the expert-major output of each rank-major received row.

    recv_counts: (W, e); num_received: its sum (known on the host: no sync here). Returns
    (num_received,) int64, an injection into [0, padded_tokens_per_expert(recv_counts).sum());
    rows it misses are padding.
    """
    starts, _ = block_starts(recv_counts, recv_counts.shape[1], expert_alignment)  # (W, e)
    flat = recv_counts.reshape(-1)  # rank-major block sizes, (W * e,)
    shift = torch.repeat_interleave(starts.reshape(-1) - exclusive_cumsum(flat, 0), flat, output_size=num_received)
    return shift + torch.arange(num_received, device=recv_counts.device)


def bad_ids_error(rank: int, status: Sequence[int], num_experts: int) -> RoutingError:
    """The error for rank ``rank``'s routing status (num_bad, min id, max id) with num_bad > 0."""
    num_bad, lo, hi = status
    return RoutingError(
        f"topk_idx on rank {rank} of the group holds {num_bad} expert id(s) outside "
        f"[-1, {num_experts}) (min {lo}, max {hi}); expected -1 or a global expert id"
    )


@dataclasses.dataclass(frozen=True)
class HostSplits:
    """A dispatch's split sizes as Python ints, from the (2W + 2,) int64 CPU tensor that
    :func:`read_splits` returns (reading it is no device sync)."""

    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    num_valid: int  # valid slots of this rank (= sum(send_splits))
    num_rows: int  # rows of the expert-major output, padding included

    @classmethod
    def of(cls, splits_S: torch.Tensor) -> HostSplits:
        *sizes, num_valid, num_rows = splits_S.tolist()
        W = len(sizes) // 2
        return cls(sizes[:W], sizes[W:], num_valid, num_rows)


def read_splits(send_meta_WL: torch.Tensor, recv_meta_WL: torch.Tensor, expert_alignment: int) -> torch.Tensor:
    """The host sync of a dispatch (one per MoE layer and step): read both metadata matrices
    (W, e + STATUS_COLUMNS), check every rank's routing status, derive the split sizes.

    Returns splits_S (2W + 2,) int64 on the CPU: rows sent to each rank, rows received from each
    rank, this rank's valid slots, rows of the expert-major output (see :class:`HostSplits`);
    the later ops of the layer (combine, both backward ops) read it instead of the device.
    Raises :class:`RoutingError` (on every rank alike, since all see the same statuses) if any
    rank's ``topk_idx`` held expert ids outside [-1, E). The op ``alltoall_ops::read_splits``,
    called directly in plain eager code."""
    return call(read_splits_op, send_meta_WL, recv_meta_WL, expert_alignment)


def _read_splits(send_meta_WL: torch.Tensor, recv_meta_WL: torch.Tensor, expert_alignment: int) -> torch.Tensor:
    W = send_meta_WL.shape[0]
    # NB: one small copy and plain Python sums: on a slow host each extra tensor op costs more
    # than the arithmetic on W * (e + S) ints. One rank receives what it sends: one matrix.
    host = (recv_meta_WL if W == 1 else torch.cat([send_meta_WL, recv_meta_WL])).tolist()
    return host_splits(host[:W], host[-W:], expert_alignment)


def host_splits(send_rows: list[list[int]], recv_rows: list[list[int]], expert_alignment: int) -> torch.Tensor:
    """The split sizes (2W + 2,) int64 CPU tensor (see :class:`HostSplits`) of both metadata
    matrices already on the host (W rows of e + STATUS_COLUMNS ints each); raises the
    :class:`RoutingError` of the first rank whose status reports bad expert ids."""
    S, W = STATUS_COLUMNS, len(send_rows)
    send_counts, recv_counts = [row[:-S] for row in send_rows], [row[:-S] for row in recv_rows]
    for src, row in enumerate(recv_rows):
        if row[-S]:
            raise bad_ids_error(src, row[-S:], W * len(send_counts[0]))
    per_expert = recv_counts[0] if W == 1 else [sum(col) for col in zip(*recv_counts)]
    num_rows = sum(per_expert) if expert_alignment == 1 else sum(round_up(c, expert_alignment) for c in per_expert)
    send_splits = [sum(c) for c in send_counts]
    return torch.tensor(send_splits + [sum(c) for c in recv_counts] + [sum(send_splits), num_rows])


read_splits_op = custom_op("alltoall_ops::read_splits", _read_splits)


@read_splits_op.register_fake
def _(send_meta_WL, recv_meta_WL, expert_alignment):
    # NB: on the CPU whatever the metadata's device: later ops read it without a device sync.
    return torch.empty(2 * send_meta_WL.shape[0] + 2, dtype=torch.int64, device="cpu")
