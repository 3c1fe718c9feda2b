"""Routing layout maths, with no communication: the ``alltoall_ops::plan_routing`` op (two
Triton kernels on CUDA, plain torch ops elsewhere) and pure, traceable tensor functions.

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

import torch

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


class SlotShape:
    """(T, K) of a per-call handle that holds ``position`` (T, K)."""

    position: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.position.shape[0]

    @property
    def top_k(self) -> int:
        return self.position.shape[1]


def plan_routing(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> RoutingPlan:
    """Sort the (T, K) slots of ``topk_idx`` into send order and count them per expert.

    Out-of-range ids are treated as dropped here and reported in the status columns, so that
    the metadata exchange can tell every rank about them before any payload moves. One op
    (``alltoall_ops::plan_routing``): on CUDA two kernel launches and no sort (up to
    ``kernels.routing.MAX_SLOTS`` slots; a stable sort above)."""
    order, position, send_meta = plan_routing_op(topk_idx, num_experts, world_size)
    return RoutingPlan(order=order, position=position, send_meta=send_meta)


@torch.library.custom_op("alltoall_ops::plan_routing", mutates_args=())
def plan_routing_op(
    topk_idx: torch.Tensor, num_experts: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, K) integer expert ids -> order (N,), position (T, K), send_meta (W, e + STATUS_COLUMNS)."""
    from .symm_mem import loader

    if loader.use_kernels(topk_idx):
        kernels = loader.kernels()
        if topk_idx.numel() <= kernels.routing.MAX_SLOTS:
            return kernels.plan_slots(topk_idx, num_experts, world_size)
    return _plan_routing_torch(topk_idx, num_experts, world_size)


@plan_routing_op.register_fake
def _(topk_idx, num_experts, world_size):
    # NB: every shape follows from T, K, E and W: nothing waits for the ids.
    T, K = topk_idx.shape
    new = dict(dtype=torch.int64, device=topk_idx.device)
    e = num_experts // world_size
    return topk_idx.new_empty(T * K, **new), topk_idx.new_empty(T, K, **new), \
        topk_idx.new_empty(world_size, e + STATUS_COLUMNS, **new)


def _plan_routing_torch(topk_idx: torch.Tensor, num_experts: int, world_size: int):
    """plan_routing_op in torch ops: a stable sort of the slots by expert (the reference of the
    Triton kernels in ``kernels/routing.py``)."""
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


def split_meta(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, e + STATUS_COLUMNS) metadata -> counts (W, e) and status (W, STATUS_COLUMNS)."""
    return meta[:, :-STATUS_COLUMNS], meta[:, -STATUS_COLUMNS:]


def padded_tokens_per_expert(recv_counts: torch.Tensor, expert_alignment: int) -> torch.Tensor:
    """(W, e) rows received from each rank per local expert -> (e,) rows per expert, padded."""
    per_expert = recv_counts.sum(0)
    if expert_alignment == 1:
        return per_expert
    return (per_expert + expert_alignment - 1) // expert_alignment * expert_alignment


def expert_of_rows(tokens_per_expert: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(e,) rows per local expert (``dispatch``'s tokens_per_expert) -> (num_rows,) int64 local
    expert of each routed row; e for rows past the last group (symm_mem's capacity rows)."""
    rows = torch.arange(num_rows, device=tokens_per_expert.device)
    return torch.searchsorted(torch.cumsum(tokens_per_expert, 0), rows, right=True)


def expert_major_rows(recv_counts: torch.Tensor, expert_alignment: int) -> torch.Tensor:
    """Destination row in the expert-major output of each rank-major received row.

    recv_counts: (W, e). Returns (sum(recv_counts),) int64, a injection into
    [0, padded_tokens_per_expert(recv_counts).sum()); rows it misses are padding.
    """
    padded = padded_tokens_per_expert(recv_counts, expert_alignment)  # (e,)
    expert_start = torch.cumsum(padded, 0) - padded  # (e,)
    earlier_ranks = torch.cumsum(recv_counts, 0) - recv_counts  # (W, e)
    block_dst = expert_start + earlier_ranks  # (W, e) first expert-major row of block (s, j)
    flat = recv_counts.reshape(-1)  # rank-major block sizes, (W * e,)
    block_src = torch.cumsum(flat, 0) - flat
    total = int(flat.sum())
    shift = torch.repeat_interleave(block_dst.reshape(-1) - block_src, flat, output_size=total)
    return shift + torch.arange(total, device=recv_counts.device)
