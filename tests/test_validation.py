"""Bad inputs raise a clear ValueError / TypeError naming the argument on EVERY rank of a W = 2
group, nobody hangs, and the group stays usable afterwards."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import alltoall_ops
from alltoall_ops.errors import RoutingError
from alltoall_ops.testing import HostTraffic, RankFailures, debug_mode

E, H, T, K = 4, 3, 5, 2


def _inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g)
    idx = torch.randint(-1, E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def _round_trip(rank: int):
    x, idx, w = _inputs(rank)
    routed, tpe, handle = alltoall_ops.dispatch(x, idx, num_experts=E)
    return routed, handle, alltoall_ops.combine(routed, handle, w)


# name -> (what every rank runs, exception type, text every message must contain).
# Structural cases are SPMD (same shapes everywhere); value-dependent ones differ on one rank.
def _case(name: str, rank: int):
    x, idx, w = _inputs(rank)
    d = lambda x=x, idx=idx, **kw: alltoall_ops.dispatch(x, idx, **{"num_experts": E, **kw})  # noqa: E731
    if name == "x_ndim":
        d(x=x[0])
    elif name == "x_dtype":
        d(x=torch.ones(T, H, dtype=torch.int64))
    elif name == "topk_idx_ndim":
        d(idx=idx[:, 0])
    elif name == "topk_idx_dtype":
        d(idx=idx.float())
    elif name == "topk_idx_bool":
        d(idx=idx > 0)
    elif name == "topk_idx_no_columns":
        d(idx=idx[:, :0])
    elif name == "token_count_mismatch":
        d(idx=idx[:-1])
    elif name == "num_experts_indivisible":
        d(num_experts=3)
    elif name == "num_experts_zero":
        d(num_experts=0)
    elif name == "expert_alignment_zero":
        d(expert_alignment=0)
    elif name == "backend_unknown":
        d(backend="nccl")
    elif name == "backend_local_on_two_ranks":
        d(backend="local")
    elif name == "weights_ndim":
        routed, handle, _ = _round_trip(rank)
        alltoall_ops.combine(routed, handle, w[:, 0])
    elif name == "weights_dtype":
        routed, handle, _ = _round_trip(rank)
        alltoall_ops.combine(routed, handle, (w > 0.5).long())
    elif name == "weights_shape":
        routed, handle, _ = _round_trip(rank)
        alltoall_ops.combine(routed, handle, w[:, :1])
    elif name == "expert_out_dtype":
        routed, handle, _ = _round_trip(rank)
        alltoall_ops.combine(routed.long(), handle, w)
    elif name == "handle_not_a_handle":
        routed, handle, _ = _round_trip(rank)
        alltoall_ops.combine(routed, (handle.route.order_N, handle.position_TK), w)
    elif name == "counts_ndim":
        alltoall_ops.exchange_counts(torch.ones(2, 2, dtype=torch.int64))
    elif name == "counts_dtype":
        alltoall_ops.exchange_counts(torch.ones(E))
    elif name == "counts_indivisible":
        alltoall_ops.exchange_counts(torch.ones(3, dtype=torch.int64))
    else:
        raise AssertionError(f"unknown case {name}")


STRUCTURAL = {
    "x_ndim": (TypeError, "x:"),
    "x_dtype": (TypeError, "x:"),
    "topk_idx_ndim": (TypeError, "topk_idx"),
    "topk_idx_dtype": (TypeError, "topk_idx"),
    "topk_idx_bool": (TypeError, "topk_idx"),
    "topk_idx_no_columns": (ValueError, "topk_idx"),
    "token_count_mismatch": (ValueError, "topk_idx"),
    "num_experts_indivisible": (ValueError, "num_experts"),
    "num_experts_zero": (ValueError, "num_experts"),
    "expert_alignment_zero": (ValueError, "expert_alignment"),
    "backend_unknown": (ValueError, "backend"),
    "backend_local_on_two_ranks": (ValueError, "backend='local'"),
    "weights_ndim": (TypeError, "topk_weights"),
    "weights_dtype": (TypeError, "topk_weights"),
    "weights_shape": (ValueError, "topk_weights"),
    "expert_out_dtype": (TypeError, "expert_out"),
    "handle_not_a_handle": (TypeError, "handle"),
    "counts_ndim": (TypeError, "tokens_per_expert_global"),
    "counts_dtype": (TypeError, "tokens_per_expert_global"),
    "counts_indivisible": (ValueError, "tokens_per_expert_global"),
}


def _expect_all_ranks_raise(pool, fn, *args, exc: type, text: str) -> dict:
    with pytest.raises(RankFailures) as info:
        pool.run(fn, *args)
    failures = info.value
    assert failures.silent == []
    assert sorted(failures.errors) == list(range(pool.world_size)), str(failures)
    for rank, err in failures.errors.items():
        assert err.type_name == exc.__name__, f"rank {rank}: {err.type_name}: {err.message}"
        assert text in err.message, f"rank {rank}: {err.message!r} does not mention {text!r}"
    return failures.errors


def healthy(rank: int, world_size: int) -> None:
    """A normal round trip, checked: the group survived the previous failure in sync."""
    x, idx, w = _inputs(rank)
    _, _, y = _round_trip(rank)
    torch.testing.assert_close(y, x * (w * (idx >= 0)).sum(1, keepdim=True))


def structural_case(rank: int, world_size: int, name: str) -> None:
    _case(name, rank)


@pytest.mark.parametrize("name", list(STRUCTURAL))
def test_structural_error_on_every_rank(pool2, name):
    exc, text = STRUCTURAL[name]
    _expect_all_ranks_raise(pool2, structural_case, name, exc=exc, text=text)


def bad_expert_id_on_one_rank(rank: int, world_size: int, bad_rank: int, bad_id: int) -> None:
    x, idx, _ = _inputs(rank)
    if rank == bad_rank:
        idx[1, 1] = bad_id
    with HostTraffic() as traffic:
        try:
            alltoall_ops.dispatch(x, idx, num_experts=E)
        finally:
            # The counts travel in the agreement's all-gather: no all-to-all ran, the payload never moved.
            assert traffic.collectives == {"all_gather": 1}, traffic.collectives


@pytest.mark.parametrize("bad_rank, bad_id", [(0, E), (1, -2), (1, 1000)])
def test_bad_expert_id_on_one_rank_raises_everywhere(pool2, bad_rank, bad_id):
    errors = _expect_all_ranks_raise(
        pool2, bad_expert_id_on_one_rank, bad_rank, bad_id, exc=RoutingError, text="topk_idx"
    )
    for err in errors.values():  # every rank is told which rank and which id
        assert f"rank {bad_rank}" in err.message and str(bad_id) in err.message
    pool2.run(healthy)


def expert_out_wrong_rows(rank: int, world_size: int, bad_rank: int, delta: int) -> None:
    routed, handle, _ = _round_trip(rank)  # the handle works once ...
    expert_out = routed
    if rank == bad_rank:
        expert_out = torch.cat([routed, routed[:1] + 1]) if delta > 0 else routed[:-1]
    with debug_mode():  # combine's agreement (off by default: a rank's bad rows stay its own error)
        alltoall_ops.combine(expert_out, handle)  # ... and is reused with the wrong rows here


@pytest.mark.parametrize("bad_rank, delta", [(0, 1), (1, -1)])
def test_expert_out_wrong_rows_on_one_rank_raises_everywhere_in_debug_mode(pool2, bad_rank, delta):
    with pytest.raises(RankFailures) as info:
        pool2.run(expert_out_wrong_rows, bad_rank, delta)
    errors = info.value.errors
    assert info.value.silent == [] and sorted(errors) == [0, 1], str(info.value)
    assert errors[bad_rank].type_name == "ValueError", errors[bad_rank]
    assert "expert_out" in errors[bad_rank].message and "rows" in errors[bad_rank].message
    peer = errors[1 - bad_rank]  # told which rank failed, and its error
    assert peer.type_name == "PeerInputError", peer
    assert f"rank {bad_rank} rejected its arguments" in peer.message
    assert errors[bad_rank].message in peer.message
    pool2.run(healthy)


def test_exchange_counts_backend_without_process_group():
    """exchange_counts(backend=): "local" and "auto" on one rank need no process group and move
    nothing; "collective" needs a process group; "symm_mem" has no counts exchange of its own."""
    assert not dist.is_initialized()
    counts = torch.tensor([3, 0, 5, 1])
    for backend in ("local", "auto"):
        assert torch.equal(alltoall_ops.exchange_counts(counts, backend=backend), counts.view(1, 4))
    with pytest.raises(ValueError, match="backend='collective' needs an initialised process group"):
        alltoall_ops.exchange_counts(counts, backend="collective")
    with pytest.raises(ValueError, match="backend: exchange_counts runs on .*symm_mem exchanges its counts inside"):
        alltoall_ops.exchange_counts(counts, backend="symm_mem")


def test_errors_without_process_group():
    assert not dist.is_initialized()
    x, idx, _ = _inputs(0)
    with pytest.raises(ValueError, match="backend"):
        alltoall_ops.dispatch(x, idx, num_experts=E, backend="Local")
    with pytest.raises(ValueError, match="backend='collective'"):
        alltoall_ops.dispatch(x, idx, num_experts=E, backend="collective")
    idx[0, 0] = E
    with pytest.raises(ValueError, match="topk_idx on rank 0"):
        alltoall_ops.dispatch(x, idx, num_experts=E)
