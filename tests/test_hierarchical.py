"""``hierarchical_dispatch`` (node-aware two stages) against the flat dispatch / combine on real
gloo ranks arranged as N nodes x L ranks: tokens per expert and each expert's rows equal, y and
the gradients of x and the weights equal in fp64, and the rows that cross the node boundary are
one per (token, other node), fewer than the flat path's one per (token, other rank); with an fp8
payload, the same rows per expert as the flat fp8 dispatch. Errors reach every rank of the mesh:
a rank's bad arguments, bad expert ids, E differing between ranks, a flat dispatch met by a
stage (each case asserts what every rank raised, then a healthy round trip on the same groups)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import alltoall_ops as a2a
from alltoall_ops import fp8, layout
from alltoall_ops.hierarchical import node_crossings
from alltoall_ops.payload import pack
from alltoall_ops.testing import deadline

H, T, K = 5, 7, 3


def _inputs(rank: int, E: int, seed: int):
    g = torch.Generator().manual_seed(seed + rank)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # K distinct experts
    idx[torch.rand(T, K, generator=g) < 0.15] = -1
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w = torch.rand(T, K, generator=g, dtype=torch.float64)
    upstream = torch.randn(T, H, generator=g, dtype=torch.float64)
    return x, idx, w, upstream


def _experts(routed_RH: torch.Tensor, tokens_per_expert_e: torch.Tensor) -> torch.Tensor:
    """Row-wise and different per local expert, so a row at the wrong expert shows."""
    expert_R = layout.expert_of_rows(tokens_per_expert_e, routed_RH.shape[0])
    return torch.tanh(routed_RH) * (1.0 + expert_R[:, None].to(routed_RH.dtype))


def _step(dispatch_fn, x, idx, w, upstream):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    routed, tokens_per_expert, handle = dispatch_fn(x, idx)
    y = a2a.combine(_experts(routed, tokens_per_expert), handle, w)
    y.backward(upstream)
    return routed.detach(), tokens_per_expert, handle, y.detach(), x.grad, w.grad


def _sent_to_other(handle, same: list[int]) -> int:
    splits = layout.HostSplits.of(handle.route.splits_S)
    return sum(n for r, n in enumerate(splits.send_splits) if r not in same)


def run_two_stage(rank: int, world_size: int, num_nodes: int, alignment: int, seed: int):
    N, L = num_nodes, world_size // num_nodes
    E = 2 * world_size
    mesh = init_device_mesh("cpu", (N, L), mesh_dim_names=("node", "local"))
    x, idx, w, upstream = _inputs(rank, E, seed)
    flat = _step(lambda x_, i_: a2a.dispatch(x_, i_, num_experts=E, expert_alignment=alignment), x, idx, w, upstream)
    staged = _step(lambda x_, i_: a2a.hierarchical_dispatch(
        x_, i_, num_experts=E, node_group=mesh["node"], local_group=mesh["local"], expert_alignment=alignment),
        x, idx, w, upstream)
    (routed_f, tpe_f, handle_f, *rest_f), (routed_s, tpe_s, handle_s, *rest_s) = flat, staged
    assert torch.equal(tpe_f, tpe_s)
    for start, n in zip((torch.cumsum(tpe_f, 0) - tpe_f).tolist(), tpe_f.tolist()):  # each expert's rows, any order
        group_f, group_s = routed_f[start : start + n], routed_s[start : start + n]
        assert torch.equal(group_f[group_f[:, 0].argsort()], group_s[group_s[:, 0].argsort()])
    for name, got, want in zip(("y", "x.grad", "w.grad"), rest_s, rest_f):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)
    node = rank // L
    flat_rows, staged_rows = node_crossings(idx, E, N, L, node)
    assert _sent_to_other(handle_f, list(range(node * L, (node + 1) * L))) == flat_rows
    assert _sent_to_other(handle_s.node_stage, [node]) == staged_rows
    return flat_rows, staged_rows


@pytest.mark.parametrize("pool, num_nodes, alignment", [(4, 2, 1), (4, 2, 3), (4, 4, 1), (4, 1, 2)],
                         indirect=["pool"])
def test_equals_flat_and_crosses_nodes_once_per_token(pool, num_nodes, alignment):
    counts = pool.run(run_two_stage, num_nodes, alignment, 10 * num_nodes + alignment)
    flat, staged = (sum(c[i] for c in counts) for i in (0, 1))
    assert staged <= flat
    if num_nodes == 2:  # 2 ranks per node: some tokens have 2 experts on one other node
        assert staged < flat, counts


def run_swapped_groups(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("node", "local"))
    x, idx, _, _ = _inputs(rank, 2 * world_size, 0)
    with pytest.raises(ValueError) as info:
        a2a.hierarchical_dispatch(x, idx, num_experts=2 * world_size, node_group=mesh["local"],
                                  local_group=mesh["node"])
    return str(info.value)


def test_swapped_groups_raise_on_every_rank(pool4):
    messages = pool4.run(run_swapped_groups)
    assert all("node_group, local_group: expected the ranks of this rank's node group" in m for m in messages)
    assert "node group [0, 2] and local group [0, 1]" in messages[0] and "got [0, 1] and [0, 2]" in messages[0]


def test_one_process_is_the_flat_path():
    x, idx = torch.randn(4, 3, dtype=torch.float64), torch.tensor([[0, 1], [1, -1], [0, 0], [-1, -1]])
    routed, tokens_per_expert, handle = a2a.hierarchical_dispatch(x, idx, num_experts=2, node_group=None,
                                                                  local_group=None)
    assert tokens_per_expert.tolist() == [3, 2]
    torch.testing.assert_close(a2a.combine(routed * 2, handle), 2 * x * (idx >= 0).sum(1, keepdim=True))


def run_compiled(rank: int, world_size: int) -> int:
    """The two-stage layer under torch.compile (fullgraph, aot_eager) equals eager over two routings."""
    from torch._dynamo.testing import CompileCounterWithBackend

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("node", "local"))
    node_group, local_group = mesh["node"].get_group(), mesh["local"].get_group()
    E = 2 * world_size

    def layer(x, idx, w):
        routed, tokens_per_expert, handle = a2a.hierarchical_dispatch(
            x, idx, num_experts=E, node_group=node_group, local_group=local_group)
        return a2a.combine(_experts(routed, tokens_per_expert), handle, w)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    for seed in (1, 2):
        x, idx, w, _ = _inputs(rank, E, seed)
        torch.testing.assert_close(compiled(x, idx, w), layer(x, idx, w), rtol=1e-12, atol=1e-12)
    return counter.frame_count


def test_compiles_once_over_routings(pool4):
    assert pool4.run(run_compiled) == [1] * 4


def _errors(fn, *args, **kwargs) -> str:
    """``fn(*args, **kwargs)``'s error as "Type: message" (the library's and TypeError), or "no error"."""
    try:
        fn(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _mesh(world_size: int, num_nodes: int):
    mesh = init_device_mesh("cpu", (num_nodes, world_size // num_nodes), mesh_dim_names=("node", "local"))
    return dict(node_group=mesh["node"], local_group=mesh["local"])


def _healthy_two_stage(rank: int, world_size: int, groups: dict) -> None:
    """A checked two-stage round trip: the mesh's groups are in step after an error."""
    E = 2 * world_size
    x, idx, w, _ = _inputs(rank, E, 3)
    routed, _, handle = a2a.hierarchical_dispatch(x, idx, num_experts=E, **groups)
    torch.testing.assert_close(a2a.combine(routed, handle, w), x * (w * (idx >= 0)).sum(1, keepdim=True))


def run_bad_rank(rank: int, world_size: int, late: bool) -> str:
    """Rank 0 passes a float topk_idx: it raises its own TypeError, every other rank a
    PeerInputError (its node group's in the first stage, the rest through the second).
    ``late``: the other ranks enter the dispatch after rank 0's deadline has passed in the first
    stage (before: rank 0 raised CollectiveTimeout and skipped the second stage, and rank 2
    waited past every deadline for the message of a rank that had left)."""
    groups = _mesh(world_size, 2)
    x, idx, _, _ = _inputs(rank, 2 * world_size, 0)
    with deadline(1.0, late=late and rank != 0):
        got = _errors(lambda: a2a.hierarchical_dispatch(x, idx.float() if rank == 0 else idx,
                                                        num_experts=2 * world_size, **groups))
    _healthy_two_stage(rank, world_size, groups)
    return got


@pytest.mark.parametrize("late", [False, True])
def test_a_bad_rank_tells_every_rank(pool4, late):
    got = pool4.run(run_bad_rank, late)
    assert got[0].startswith("TypeError: topk_idx"), got[0]
    own = got[0].removeprefix("TypeError: ")
    for rank in (1, 2, 3):
        assert got[rank].startswith("PeerInputError") and "rank 0 rejected its arguments" in got[rank], got[rank]
        assert own in got[rank], got[rank]


def run_bad_ids(rank: int, world_size: int, num_nodes: int, bad_rank: int, bad_id: int, seed: int) -> tuple:
    """One rank's topk_idx holds ``bad_id`` (E or below -1) in a random slot: the two-stage
    dispatch raises the flat dispatch's RoutingError on every rank."""
    E = 2 * world_size
    groups = _mesh(world_size, num_nodes)
    x, idx, _, _ = _inputs(rank, E, seed)
    if rank == bad_rank:
        g = torch.Generator().manual_seed(seed)
        idx.view(-1)[torch.randint(idx.numel(), (1,), generator=g)] = bad_id
    flat = _errors(a2a.dispatch, x, idx, num_experts=E)
    staged = _errors(lambda: a2a.hierarchical_dispatch(x, idx, num_experts=E, **groups))
    _healthy_two_stage(rank, world_size, groups)
    return flat, staged


@pytest.mark.parametrize("num_nodes, bad_rank, bad_id", [(2, 2, 8), (2, 1, -2), (1, 3, 8), (4, 1, -5)])
def test_bad_expert_ids_raise_on_every_rank(pool4, num_nodes, bad_rank, bad_id):
    got = pool4.run(run_bad_ids, num_nodes, bad_rank, bad_id, 40 + num_nodes + bad_rank)
    flat = got[0][0]
    assert flat.startswith(f"RoutingError: topk_idx on rank {bad_rank} of the group holds 1 expert id(s) outside "
                           f"[-1, 8) (min {min(bad_id, -1)}, max "), flat
    for rank, (flat_r, staged) in enumerate(got):
        assert flat_r == flat, (rank, flat_r)
        assert staged.startswith("RoutingError") and flat.removeprefix("RoutingError: ") in staged, (rank, staged)


def run_num_experts_differ(rank: int, world_size: int, who: str) -> str:
    """The ranks disagree on E (16 vs 8 on a 2 x 2 mesh): on one node, on one rank, or on one
    local index (every node then agrees within its node group, the disagreement shows inside)."""
    L = world_size // 2
    groups = _mesh(world_size, 2)
    differs = {"node 1": rank // L == 1, "rank 3": rank == 3, "local rank 1": rank % L == 1}[who]
    E = 8 if differs else 16
    x, idx, _, _ = _inputs(rank, 8, 5)
    got = _errors(lambda: a2a.hierarchical_dispatch(x, idx, num_experts=E, **groups))
    _healthy_two_stage(rank, world_size, groups)
    return got


@pytest.mark.parametrize("who", ["node 1", "rank 3", "local rank 1"])
def test_num_experts_differing_raises_on_every_rank(pool4, who):
    for rank, got in enumerate(pool4.run(run_num_experts_differ, who)):
        assert got.startswith("GroupMismatchError") and "the ranks disagree on num_experts" in got, (rank, got)
        assert "16" in got and "8" in got, (rank, got)


def run_flat_and_two_stage(rank: int, world_size: int, num_nodes: int, hidden: int, seed: int) -> str:
    """Rank 0 calls the flat dispatch on the group of the two-stage path's one exchange (node
    group on 2 x 1, local group on 1 x 2), rank 1 the two-stage dispatch: out of step."""
    groups = _mesh(world_size, num_nodes)
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(T, hidden, generator=g, dtype=torch.float64)
    idx = torch.randint(-1, 2, (T, K), generator=g)
    if rank == 0:
        group = groups["node_group" if num_nodes == 2 else "local_group"]
        got = _errors(a2a.dispatch, x, idx, num_experts=2, group=group)
    else:
        got = _errors(lambda: a2a.hierarchical_dispatch(x, idx, num_experts=2, **groups))
    _healthy_two_stage(rank, world_size, groups)
    return got


@pytest.mark.parametrize("num_nodes, hidden", [(2, H), (2, 8), (1, H)])
def test_flat_and_two_stage_out_of_step_raise_on_every_rank(pool2, num_nodes, hidden):
    got = pool2.run(run_flat_and_two_stage, num_nodes, hidden, 60 + hidden)
    for rank in (0, 1):
        assert got[rank].startswith("GroupMismatchError") and "out of step" in got[rank], (rank, got[rank])
        assert "rank 0 is in dispatch" in got[rank] and "rank 1 is in hierarchical_dispatch" in got[rank], got[rank]


def _rows_by_expert(routed: torch.Tensor, tokens_per_expert: torch.Tensor) -> list[list[bytes]]:
    """Each expert's rows as sorted byte strings: the same rows in any order compare equal."""
    starts = (torch.cumsum(tokens_per_expert, 0) - tokens_per_expert).tolist()
    as_bytes = routed.contiguous().view(torch.uint8)
    counts = tokens_per_expert.tolist()
    return [sorted(bytes(row.tolist()) for row in as_bytes[s : s + n]) for s, n in zip(starts, counts)]


def run_two_stage_fp8(rank: int, world_size: int, seed: int) -> None:
    """fp8 rows across nodes: the same (values, scales) per expert as the flat fp8 dispatch; with
    dequantize=True (fp32 x) the same rows, y and x's gradient (the quantize straight-through)."""
    N, L, H8 = 2, world_size // 2, 128
    E = 2 * world_size
    mesh = init_device_mesh("cpu", (N, L), mesh_dim_names=("node", "local"))
    _, idx, w, _ = _inputs(rank, E, seed)
    g = torch.Generator().manual_seed(seed + 100 + rank)
    x = torch.randn(T, H8, generator=g)
    groups = dict(node_group=mesh["node"], local_group=mesh["local"])
    with pytest.raises(ValueError, match="two-stage fp8 dispatch without dequantize takes bf16 tokens"):
        a2a.hierarchical_dispatch(x, idx, num_experts=E, payload_dtype=fp8.FP8, **groups)  # fp32 x, every rank
    (v_f, s_f), tpe_f, _ = a2a.dispatch(x.bfloat16(), idx, num_experts=E, payload_dtype=fp8.FP8)
    (v_s, s_s), tpe_s, handle = a2a.hierarchical_dispatch(x.bfloat16(), idx, num_experts=E, payload_dtype=fp8.FP8,
                                                          **groups)
    assert torch.equal(tpe_f, tpe_s)
    assert _rows_by_expert(pack(v_f, s_f), tpe_f) == _rows_by_expert(pack(v_s, s_s), tpe_s)
    y_s = a2a.combine(fp8.dequantize(v_s, s_s), handle, w.bfloat16())  # combine takes bf16 rows back
    assert y_s.dtype == torch.bfloat16 and y_s.shape == (T, H8)

    flat = _step(lambda x_, i_: a2a.dispatch(x_, i_, num_experts=E, payload_dtype=fp8.FP8, dequantize=True),
                 x, idx, w.float(), torch.ones(T, H8))
    staged = _step(lambda x_, i_: a2a.hierarchical_dispatch(x_, i_, num_experts=E, payload_dtype=fp8.FP8,
                                                            dequantize=True, **groups), x, idx, w.float(),
                   torch.ones(T, H8))
    assert _rows_by_expert(flat[0], flat[1]) == _rows_by_expert(staged[0], staged[1])
    for name, got, want in zip(("y", "x.grad", "w.grad"), staged[3:], flat[3:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)  # fp32 sums in another order


def test_fp8_two_stage_equals_flat(pool4):
    pool4.run(run_two_stage_fp8, 7)
