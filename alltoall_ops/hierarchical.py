"""Node-aware two-stage dispatch and combine (DeepEP's normal mode, on this library's ops).

W = N nodes x L ranks; rank (n, l) is global rank n * L + l and owns experts
[(n * L + l) * e, (n * L + l + 1) * e). Dispatch:

1. across nodes (``node_group``: the N ranks with this rank's local index l): each token goes
   once to every node that holds one of its experts, to the rank with the same l there, with
   its top-k ids; a token with several experts on one node crosses the node boundary once;
2. inside the node (``local_group``: the L ranks of this node): the arrived tokens go to the
   ranks owning their experts on this node, as the flat dispatch sends them.

Combine undoes it: inside the node each arrived token's weighted top-k sum over this node's
experts (fp32), then one row back per (token, node), summed at the source. Forward and
gradients equal the flat dispatch / combine up to the order of the fp32 sums.

Each stage starts with the header agreement of op ``hierarchical_dispatch`` (not ``dispatch``:
a flat dispatch never pairs with a stage) carrying the whole operation's fields (E, H, dtypes,
K, alignment, N, L), across nodes and then inside the node, so every pair of ranks is compared
through one of them. The first stage's carries the bad-id status of every rank of the node
group against E; an error there is forwarded (:func:`comm.forward`) into the second stage's
agreement, so every rank of the mesh raises it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from . import comm, layout
from ._compat import is_compiling
from .api import combine
from .backends import DispatchHandle
# NB: the collective backend's, not the Backend interface: the first stage's counts move in its
# own exchange (hierarchical_exchange, below) and the weights and ids follow a stage's route
# (send_along), both of which need a variable-size route that a handle exposes; symm_mem's
# fixed-capacity buffers serve one group each.
from .backends.collective import RouteHandle, dispatch_planned, dispatch_route, send_along
from .groups import LOCAL, Group, communication_group, process_group, resolve_group
from .payload import Payload
from .validation import check_dispatch_args, check_payload_args

OP = "hierarchical_dispatch"


@dataclasses.dataclass(frozen=True)
class HierarchicalHandle(DispatchHandle):
    """The two stages' handles: across nodes (``node_stage``) and inside the node (``local_stage``)."""

    node_stage: RouteHandle
    local_stage: RouteHandle

    @property
    def position_TK(self) -> torch.Tensor:
        return self.node_stage.position_TK

    @property
    def num_rows(self) -> int:
        return self.local_stage.num_rows

    @property
    def expert_alignment(self) -> int:
        return self.local_stage.expert_alignment

    @property
    def group_name(self) -> str:
        return self.local_stage.group_name

    @property
    def world_size(self) -> int:
        return self.node_stage.world_size * self.local_stage.world_size

    def combine(self, expert_out_RH: torch.Tensor, topk_weights_TK: Optional[torch.Tensor], *,
                async_op: bool = False) -> torch.Tensor:
        """(R, H) expert outputs -> (T, H): per node, then across nodes (with ``async_op``, the
        exchange across nodes is the one pending until the wait)."""
        arrived_weights = None
        if topk_weights_TK is not None:  # each arrived token's K weights, at its forwarding rank
            arrived_weights = send_along(self.node_stage, topk_weights_TK)
        partial_AH = combine(expert_out_RH, self.local_stage, arrived_weights)  # this node's share
        return combine(partial_AH, self.node_stage, async_op=async_op)  # one row per (token, node), summed


def _members(group: Group) -> list[int]:
    """Global ranks of ``group``'s members, in group order."""
    if group.name == LOCAL:
        return [dist.get_rank() if dist.is_initialized() else 0]
    return dist.get_process_group_ranks(process_group(group.name))


def _check_mesh(across: Group, inside: Group) -> None:
    """Raise ``ValueError`` unless the groups form the N x L layout (rank n * L + l at node n,
    local index l). Every rank of a misbuilt mesh sees its own groups break the pattern, so all
    raise alike (e.g. when the node and local groups are swapped)."""
    N, L, n, lo = across.size, inside.size, across.rank, inside.rank
    want_across, want_inside = [m * L + lo for m in range(N)], [n * L + j for j in range(L)]
    got_across, got_inside = _members(across), _members(inside)
    if (got_across, got_inside) != (want_across, want_inside):
        raise ValueError(
            f"node_group, local_group: expected the ranks of this rank's node group {want_across} and local group "
            f"{want_inside} (rank n * L + l is local rank l of node n), got {got_across} and {got_inside}"
        )


def hierarchical_dispatch(
    x: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]],
    topk_idx: torch.Tensor,
    *,
    num_experts: int,
    node_group: Any,
    local_group: Any,
    expert_alignment: int = 1,
    payload_dtype: Optional[torch.dtype] = None,
    dequantize: bool = False,
) -> tuple[Any, torch.Tensor, HierarchicalHandle]:
    """:func:`alltoall_ops.dispatch` in two stages (module docstring); same returns: routed
    (R, H) grouped by local expert (then forwarding rank of this node, then arrival order),
    tokens_per_expert (e,), and a handle for :func:`alltoall_ops.combine`.

    node_group / local_group: this rank's group across nodes (N ranks, ordered by node) and
    inside its node (L ranks, ordered by local index), e.g. ``mesh["node"]`` and
    ``mesh["local"]`` of ``init_device_mesh(dev, (N, L), mesh_dim_names=("node", "local"))``.
    x, payload_dtype, dequantize: as in :func:`alltoall_ops.dispatch`; with an fp8 payload the
    rows cross nodes as fp8 (values and scales). Without ``dequantize`` they stay fp8 inside the
    node too and routed is (values, scales) (x: bf16, the dtype combine then takes); with it
    they arrive dequantized and move inside the node in x's dtype (the gradient's path)."""
    across, inside = resolve_group(node_group), resolve_group(local_group)
    N, L = across.size, inside.size
    node_name, local_name = communication_group(across).name, communication_group(inside).name
    E = comm.checked(OP, (node_name, local_name), _check_args, x, topk_idx, num_experts, N, L, expert_alignment,
                     payload_dtype, dequantize)
    if not is_compiling():  # NB: process-group queries do not trace; eager calls check the mesh
        _check_mesh(across, inside)
    x_TH, x_scale_TB = x if isinstance(x, (tuple, list)) else (x, None)
    payload = None
    if x_scale_TB is not None or payload_dtype is not None:
        payload = Payload.of(x_TH, x_scale_TB, dequantize)
    dtype, wire_dtype = (x_TH.dtype,) * 2 if payload is None else (payload.combine_dtype, payload.format.payload_dtype)
    header = comm.header(OP, *comm.dispatch_fields(x_TH, topk_idx, E, expert_alignment, dtype, wire_dtype), N, L)
    per_node = E // N
    idx_TK = topk_idx.to(torch.int64)
    valid_TK = (idx_TK >= 0) & (idx_TK < E)
    node_TK = torch.where(valid_TK, idx_TK // per_node, -1)
    # NB: a token crosses to a node once: its later slots on the same node send nothing. Bad
    # ids stay as they are, so that the plan's status reports them.
    K = node_TK.shape[1]
    earlier_KK = torch.ones(K, K, dtype=torch.bool, device=node_TK.device).tril(-1)  # [k, j]: j < k
    earlier_same_TKK = (node_TK[:, :, None] == node_TK[:, None, :]) & earlier_KK
    first_TK = ~earlier_same_TKK.any(-1)
    plan = layout.plan_routing(torch.where(first_TK | ~valid_TK, idx_TK, -1), E, N)
    counts_Ne, status_NS = layout.split_meta(plan.send_meta)
    # NB: the status (num_bad, min id, max id) as the flat dispatch reports it: the max of every
    # id (a deduplicated slot may have held it; the min is at most -1 either way).
    max_id = torch.cat([idx_TK.reshape(-1), idx_TK.new_full((1,), -1)]).max()
    send_meta_NL = torch.cat([counts_Ne.sum(1, keepdim=True), status_NS[:, :2], max_id.expand(N, 1)], 1)
    recv_meta_NL, splits_S = node_exchange_op(send_meta_NL, node_name, local_name, header)
    arrived, _, node_stage = dispatch_route(x_TH, plan, recv_meta_NL, splits_S, 1, node_name, payload)
    arrived_idx_AK = send_along(node_stage, idx_TK)  # int64 rows, as any rows
    on_this_node_AK = (arrived_idx_AK >= 0) & (arrived_idx_AK // per_node == across.rank)
    local_idx_AK = torch.where(on_this_node_AK, arrived_idx_AK - across.rank * per_node, -1)
    local_plan = layout.plan_routing(local_idx_AK, per_node, L)
    arrived_AH, arrived_scale_AB = arrived if isinstance(arrived, tuple) else (arrived, None)
    local_payload = None if arrived_scale_AB is None else Payload.of(arrived_AH, arrived_scale_AB, False)
    routed_RH, tokens_per_expert_e, local_stage = dispatch_planned(
        arrived_AH, local_plan, header, expert_alignment, local_name, local_payload)
    return routed_RH, tokens_per_expert_e, HierarchicalHandle(node_stage, local_stage)


@comm.comm_op("hierarchical_exchange")
def node_exchange_op(send_meta_NL: torch.Tensor, node_group: str, local_group: str,
                     header: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first stage's metadata exchange: send_meta (N, 1 + STATUS_COLUMNS), row n the tokens
    for node n and this rank's bad-id status (against E) -> recv_meta (N, 1 + STATUS_COLUMNS),
    row m from node m (on send_meta's device), and splits_S (2N + 2,) on the CPU.

    One agreement on ``node_group`` carrying the counts (one all-gather, one host read), as the
    flat dispatch's. Raises :class:`RoutingError` naming the rank (n * L + l) with bad ids, and
    the agreement's errors; each is forwarded into the second stage's agreement on
    ``local_group`` first, so every rank of the mesh raises it."""
    op, fields = comm.op_name(header[0]), header[1:]
    N, S, E = send_meta_NL.shape[0], layout.STATUS_COLUMNS, fields[0]
    n, local_rank, L = _rank_in(node_group), _rank_in(local_group), fields[-1]
    try:
        if N == 1:
            sent_by_node = [send_meta_NL.reshape(-1).tolist()]  # Host sync: (1 + S,)
        else:
            sent_by_node = comm.agree_and_gather(op, node_group, fields, send_meta_NL)  # N rows of N * (1 + S)
        for m, sent in enumerate(sent_by_node):
            if sent[1]:  # each row: the count, then the sender's status (num_bad, min id, max id)
                raise layout.bad_ids_error(m * L + local_rank, sent[1 : 1 + S], E)
    except comm.FORWARDABLE as exc:
        comm.forward(op, local_group, exc)
        raise
    send_rows = [sent_by_node[n][m * (1 + S) : (m + 1) * (1 + S)] for m in range(N)]
    recv_rows = [sent[n * (1 + S) : (n + 1) * (1 + S)] for sent in sent_by_node]
    recv_meta_NL = torch.tensor(recv_rows, dtype=torch.int64).to(send_meta_NL.device, non_blocking=True)
    return recv_meta_NL, layout.host_splits(send_rows, recv_rows, 1)


def _rank_in(group_name: str) -> int:
    return 0 if group_name == LOCAL else process_group(group_name).rank()


@node_exchange_op.register_fake
def _(send_meta_NL, node_group, local_group, header):
    N = send_meta_NL.shape[0]
    return torch.empty_like(send_meta_NL), torch.empty(2 * N + 2, dtype=torch.int64, device="cpu")


MAX_NODES = comm.PAYLOAD_LEN // (1 + layout.STATUS_COLUMNS)
"""The most nodes a two-stage dispatch spans: the first stage's counts travel in its agreement."""


def _check_args(x: Any, topk_idx: torch.Tensor, num_experts: int, num_nodes: int, ranks_per_node: int,
                expert_alignment: int, payload_dtype: Optional[torch.dtype], dequantize: bool) -> int:
    """:func:`check_dispatch_args` (and the fp8 checks) of a two-stage dispatch; returns E."""
    if num_nodes > MAX_NODES:
        raise ValueError(f"node_group: expected at most {MAX_NODES} ranks (one per node), got {num_nodes}")
    values, scales = x if isinstance(x, (tuple, list)) else (x, None)
    check_payload_args(values, scales, payload_dtype, dequantize)
    E = check_dispatch_args(values, topk_idx, num_experts, num_nodes * ranks_per_node, expert_alignment)
    if scales is None and payload_dtype is not None and not dequantize and values.dtype != torch.bfloat16:
        # NB: the second stage moves fp8 pairs, whose combine takes bf16 expert outputs.
        raise ValueError(f"x: a two-stage fp8 dispatch without dequantize takes bf16 tokens (combine then takes bf16 "
                         f"expert outputs), got {values.dtype}; pass dequantize=True or bf16 x")
    return E


def node_crossings(topk_idx: torch.Tensor, num_experts: int, num_nodes: int, ranks_per_node: int,
                   node: int) -> tuple[int, int]:
    """Rows this rank (on node ``node``) sends across the node boundary: (flat, two-stage). The
    flat dispatch sends one row per valid slot (token, expert); the two-stage one per (token,
    destination node); both count destinations on other nodes only. A host read (reports)."""
    per_node = num_experts // num_nodes
    nodes = [[g // per_node for g in row if 0 <= g < num_experts] for row in topk_idx.tolist()]
    flat = sum(n != node for row in nodes for n in row)
    staged = sum(len(set(row) - {node}) for row in nodes)
    return flat, staged
