"""Ranks that disagree, one bad rank, and faults, on real gloo ranks: every rank gets a clear
error (which type, which text: asserted per rank) or the right result, never a hang.

Each case is a function every rank runs; ``bad`` is True on the one rank that differs. After an
error the group must still be in step: a healthy round trip follows on the same processes.
Faults (a peer that raises elsewhere, stalls or dies) run on a fresh pool with a short library
deadline, since the group is unusable afterwards.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import alltoall_ops as a2a
from alltoall_ops import fp8
from alltoall_ops.errors import (CapacityError, CollectiveError, CollectiveTimeout, GroupMismatchError,
                                 PeerInputError)
from alltoall_ops.testing import DistributedPool, RankFailures, deadline, debug_mode

E, H, T, K = 4, 3, 5, 2
CASE_DEADLINE_S = 60.0


def _inputs(rank: int, T: int = T, H: int = H, K: int = K, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g).to(dtype)
    idx = torch.randint(-1, E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def _buffers(alignment: int = 1) -> a2a.SymmBuffers:
    return a2a.SymmBuffers(T, H, K, E, dtype=torch.float32, device="cpu", expert_alignment=alignment)


def _round_trip(rank: int, **kwargs):
    x, idx, w = _inputs(rank)
    routed, _, handle = a2a.dispatch(x, idx, num_experts=E, **kwargs)
    return routed, handle, w


def _healthy(rank: int) -> None:
    """A checked round trip: the group is in step after the previous case."""
    x, idx, w = _inputs(rank)
    routed, handle, _ = _round_trip(rank)
    torch.testing.assert_close(a2a.combine(routed, handle, w), x * (w * (idx >= 0)).sum(1, keepdim=True))


# --------------------------------------------------------------------------------------------
# Cases: name -> fn(rank, bad). Disagreements: every rank's own arguments are fine.


def _disagree_num_experts(rank, bad):
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x, idx, num_experts=8 if bad else E)


def _disagree_hidden(rank, bad):
    x, idx, _ = _inputs(rank, H=H + 1 if bad else H)
    a2a.dispatch(x, idx, num_experts=E)


def _disagree_dtype(rank, bad):
    x, idx, _ = _inputs(rank, dtype=torch.float16 if bad else torch.bfloat16)
    a2a.dispatch(x, idx, num_experts=E)


def _disagree_top_k(rank, bad):
    x, idx, _ = _inputs(rank, K=K + 1 if bad else K)
    a2a.dispatch(x, idx, num_experts=E)


def _disagree_alignment(rank, bad):
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x, idx, num_experts=E, expert_alignment=2 if bad else 1)


def _disagree_counts_length(rank, bad):
    a2a.exchange_counts(torch.ones(6 if bad else 4, dtype=torch.int64))


def _disagree_ulysses_shard(rank, bad):
    # NB: debug mode: by default a disagreement on the sizes stops in the transport (ulysses.py)
    with debug_mode():
        a2a.seq_to_head(torch.randn(1, 3 if bad else 2, 4, 2))


def _out_of_step(rank, bad):
    if bad:  # an extra call the others do not make
        a2a.exchange_counts(torch.ones(E, dtype=torch.int64))
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x, idx, num_experts=E)


def _disagree_symm_alignment(rank, bad):
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x, idx, num_experts=E, expert_alignment=2 if bad else 1, buffers=_buffers(alignment=2))


# One bad rank: its own arguments are wrong.


def _bad_x_1d(rank, bad):
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x[0] if bad else x, idx, num_experts=E)


def _bad_x_3d(rank, bad):
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x[None] if bad else x, idx, num_experts=E)


def _bad_topk_idx_float(rank, bad):
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x, idx.float() if bad else idx, num_experts=E)


def _bad_token_count(rank, bad):
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x, idx[:-1] if bad else idx, num_experts=E)


def _bad_alignment_zero(rank, bad):
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x, idx, num_experts=E, expert_alignment=0 if bad else 1)


def _bad_num_experts_indivisible(rank, bad):
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x, idx, num_experts=3 if bad else E)


def _bad_fp8_hidden(rank, bad):
    x, idx, _ = _inputs(rank, H=64 if bad else 128, dtype=torch.bfloat16)
    a2a.dispatch(x, idx, num_experts=E, payload_dtype=torch.float8_e4m3fn)


def _bad_fp8_scale_rows(rank, bad):
    x, idx, _ = _inputs(rank, H=128)
    values, scales = fp8.quantize(x)
    a2a.dispatch((values, scales[:-1] if bad else scales), idx, num_experts=E)


def _bad_fp8_scale_dtype(rank, bad):
    x, idx, _ = _inputs(rank, H=128)
    values, scales = fp8.quantize(x)
    a2a.dispatch((values, scales.bfloat16() if bad else scales), idx, num_experts=E)


def _bad_expert_out_dtype_debug_mode(rank, bad):
    routed, handle, w = _round_trip(rank)
    with debug_mode():
        a2a.combine(routed.double() if bad else routed, handle)


def _bad_weights_shape_debug_mode(rank, bad):
    routed, handle, w = _round_trip(rank)
    with debug_mode():
        a2a.combine(routed, handle, w[:, :1] if bad else w)


def _bad_counts_dtype(rank, bad):
    counts = torch.ones(E, dtype=torch.int64)
    a2a.exchange_counts(counts.float() if bad else counts)


def _bad_ulysses_heads(rank, bad):
    # NB: 2 heads of 4 are this rank's share on 2 ranks; of 3, rank 1's share is 1 head. Debug
    # mode: by default a rank's own error does not reach its peers before the deadline (ulysses.py)
    with debug_mode():
        a2a.head_to_seq(torch.randn(1, 2, 2, 2), num_heads=3 if bad else 4)


def _bad_symm_topk_idx_float(rank, bad):
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x, idx.float() if bad else idx, num_experts=E, buffers=_buffers())


def _bad_symm_x_3d(rank, bad):
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x[None] if bad else x, idx, num_experts=E, buffers=_buffers())


def _bad_symm_alignment_above_buffers(rank, bad):
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x, idx, num_experts=E, expert_alignment=4 if bad else 2, buffers=_buffers(alignment=2))


def _bad_symm_cached_topk_idx_float(rank, bad):
    x, idx, _ = _inputs(rank)
    a2a.dispatch(x, idx.float() if bad else idx, num_experts=E, backend="symm_mem")


def _bad_symm_combine_debug_mode(rank, bad):
    routed, handle, w = _round_trip(rank, buffers=_buffers())
    with debug_mode():
        a2a.combine(routed[:, :1] if bad else routed, handle, w)


# name -> (case, type on the differing rank, type on the others, text in every message)
DISAGREE = {
    "num_experts": (_disagree_num_experts, GroupMismatchError, GroupMismatchError, "num_experts"),
    "hidden": (_disagree_hidden, GroupMismatchError, GroupMismatchError, "hidden size"),
    "dtype": (_disagree_dtype, GroupMismatchError, GroupMismatchError, "torch.float16"),
    "top_k": (_disagree_top_k, GroupMismatchError, GroupMismatchError, "top_k"),
    "alignment": (_disagree_alignment, GroupMismatchError, GroupMismatchError, "expert_alignment"),
    "counts_length": (_disagree_counts_length, GroupMismatchError, GroupMismatchError, "length"),
    "ulysses_shard": (_disagree_ulysses_shard, GroupMismatchError, GroupMismatchError, "(1, 3, 4, 2)"),
    "out_of_step": (_out_of_step, GroupMismatchError, GroupMismatchError, "out of step"),
    "symm_alignment": (_disagree_symm_alignment, GroupMismatchError, GroupMismatchError, "expert_alignment"),
}
BAD_RANK = {
    "x_1d": (_bad_x_1d, TypeError, PeerInputError, "x:"),
    "x_3d": (_bad_x_3d, TypeError, PeerInputError, "x:"),
    "topk_idx_float": (_bad_topk_idx_float, TypeError, PeerInputError, "topk_idx"),
    "token_count": (_bad_token_count, ValueError, PeerInputError, "topk_idx"),
    "alignment_zero": (_bad_alignment_zero, ValueError, PeerInputError, "expert_alignment"),
    "num_experts_indivisible": (_bad_num_experts_indivisible, ValueError, PeerInputError, "num_experts"),
    "fp8_hidden": (_bad_fp8_hidden, ValueError, PeerInputError, "H divisible by 128"),
    "fp8_scale_rows": (_bad_fp8_scale_rows, TypeError, PeerInputError, "shape (5, 1)"),
    "fp8_scale_dtype": (_bad_fp8_scale_dtype, TypeError, PeerInputError, "got torch.bfloat16"),
    "expert_out_dtype_debug_mode": (_bad_expert_out_dtype_debug_mode, ValueError, PeerInputError, "torch.float64"),
    "weights_shape_debug_mode": (_bad_weights_shape_debug_mode, ValueError, PeerInputError, "topk_weights"),
    "counts_dtype": (_bad_counts_dtype, TypeError, PeerInputError, "tokens_per_expert_global"),
    "ulysses_heads": (_bad_ulysses_heads, ValueError, PeerInputError, "heads"),
    "symm_topk_idx_float": (_bad_symm_topk_idx_float, TypeError, PeerInputError, "topk_idx"),
    "symm_x_3d": (_bad_symm_x_3d, TypeError, PeerInputError, "x:"),
    "symm_alignment_above_buffers": (_bad_symm_alignment_above_buffers, CapacityError, PeerInputError,
                                     "expert_alignment"),
    "symm_cached_topk_idx_float": (_bad_symm_cached_topk_idx_float, TypeError, PeerInputError, "topk_idx"),
    "symm_combine_debug_mode": (_bad_symm_combine_debug_mode, ValueError, PeerInputError, "expert_out"),
}
LATE_DEADLINE_S = 1.0


def _late(case):
    """``case`` with the bad rank's peers entering it after the bad rank's deadline has passed
    (issue 31: their first exchange op imported torch's dynamo, seconds, while the bad rank
    joined the agreement at once): the bad rank raises its own error, its peers read it in the
    agreement they come to late."""
    def late_case(rank, bad):
        with deadline(LATE_DEADLINE_S, late=not bad):
            case(rank, bad)

    return late_case


LATE = {f"late_{name}": (_late(BAD_RANK[name][0]), *BAD_RANK[name][1:])
        for name in ("fp8_hidden", "fp8_scale_rows", "fp8_scale_dtype", "topk_idx_float")}
CASES = {**DISAGREE, **BAD_RANK, **LATE}


def run_case(rank: int, world_size: int, name: str, bad_rank: int) -> None:
    CASES[name][0](rank, rank == bad_rank)


def healthy(rank: int, world_size: int) -> None:
    _healthy(rank)


def _expect(pool, name: str, bad_rank: int) -> None:
    _, bad_type, peer_type, text = CASES[name]
    with pytest.raises(RankFailures) as info:
        pool.run(run_case, name, bad_rank, timeout=CASE_DEADLINE_S)
    failures = info.value
    assert failures.silent == [] and sorted(failures.errors) == list(range(pool.world_size)), str(failures)
    for rank, err in failures.errors.items():
        expected = bad_type if rank == bad_rank else peer_type
        assert err.type_name == expected.__name__, f"rank {rank}: {err.type_name}: {err.message}"
        assert text in err.message, f"rank {rank}: {err.message!r} does not mention {text!r}"
        if expected is PeerInputError:  # told which rank failed, with its own message
            assert f"rank {bad_rank} rejected its arguments" in err.message, err.message
            assert failures.errors[bad_rank].message in err.message
    pool.run(healthy, timeout=CASE_DEADLINE_S)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks(pool2, name):
    _expect(pool2, name, bad_rank=1)


@pytest.mark.parametrize("name", ["dtype", "top_k", "out_of_step", "topk_idx_float", "weights_shape_debug_mode",
                                  "symm_alignment_above_buffers", "late_fp8_hidden"])
def test_four_ranks(pool4, name):
    _expect(pool4, name, bad_rank=2)


def test_messages_name_every_rank(pool2):
    with pytest.raises(RankFailures) as info:
        pool2.run(run_case, "ulysses_shard", 1, timeout=CASE_DEADLINE_S)
    for err in info.value.errors.values():  # the shapes, not fingerprints
        assert "rank 0 has (1, 2, 4, 2), rank 1 has (1, 3, 4, 2)" in err.message, err.message
        assert "alltoall_ops.seq_to_head on group" in err.message
    with pytest.raises(RankFailures) as info:
        pool2.run(run_case, "dtype", 0, timeout=CASE_DEADLINE_S)
    for err in info.value.errors.values():
        assert "rank 0 has torch.float16, rank 1 has torch.bfloat16" in err.message, err.message
    pool2.run(healthy, timeout=CASE_DEADLINE_S)


# --------------------------------------------------------------------------------------------
# Configuration hazards and integer-likes (every rank alike)


def cached_buffers_grow_on_one_rank(rank: int, world_size: int) -> list:
    seen = []
    for k, alignment in ((1, 1), (2, 3)):  # rank 1's K is larger; both grow on the second call
        x, idx, w = _inputs(rank, T=T + rank, K=k + rank)
        routed, _, handle = a2a.dispatch(x, idx, num_experts=E, backend="symm_mem", expert_alignment=alignment)
        y = a2a.combine(routed, handle, w)
        torch.testing.assert_close(y, x * (w * (idx >= 0)).sum(1, keepdim=True))
        bufs = handle.buffers
        seen.append((bufs.max_tokens_per_rank, bufs.top_k, bufs.expert_alignment))
    return seen


def test_cached_symm_buffers_agree_on_the_largest_sizes(pool2):
    assert pool2.run(cached_buffers_grow_on_one_rank, timeout=CASE_DEADLINE_S) == [[(T + 1, 2, 1), (T + 1, 3, 3)]] * 2


def integer_likes(rank: int, world_size: int) -> None:
    import numpy as np

    x, idx, w = _inputs(rank)
    routed, _, handle = a2a.dispatch(x, idx, num_experts=np.int64(E), expert_alignment=np.int32(2))
    torch.testing.assert_close(a2a.combine(routed, handle, w), x * (w * (idx >= 0)).sum(1, keepdim=True))
    with pytest.raises(ValueError, match=r"expert_alignment: expected at most 65536, got 1099511627776"):
        a2a.dispatch(x, idx, num_experts=E, expert_alignment=2**40)


def test_integer_likes_and_huge_alignment(pool2):
    pool2.run(integer_likes, timeout=CASE_DEADLINE_S)


# --------------------------------------------------------------------------------------------
# Faults: a short deadline, a fresh pool each (the group is unusable afterwards)

DEADLINE_S = 3.0


def fault(rank: int, world_size: int, kind: str) -> None:
    """Rank 1 misbehaves before (or, for symm_combine_bad_rank, in) a dispatch / combine."""
    a2a.set_timeout(DEADLINE_S)
    x, idx, w = _inputs(rank)
    if rank == 1 and kind == "raises_elsewhere":
        raise KeyError("user code on rank 1 failed before its dispatch")
    if rank == 1 and kind == "dies":
        os._exit(3)
    if rank == 1 and kind == "stalls":
        time.sleep(3 * DEADLINE_S)
    if kind == "symm_fp8_late_bad_rank":  # rank 1: dequantize without payload_dtype, after rank 0's deadline
        bufs = a2a.SymmBuffers(T, 128, K, E, dtype=torch.bfloat16, device="cpu", payload_dtype=fp8.FP8)
        x = _inputs(rank, H=128, dtype=torch.bfloat16)[0]
        if rank == 1:
            time.sleep(DEADLINE_S + 0.5)
        a2a.dispatch(x, idx, num_experts=E, buffers=bufs, dequantize=True, payload_dtype=None if rank else fp8.FP8)
    if kind in ("combine_bad_rank", "symm_combine_bad_rank"):  # no exchange before combine's payload
        routed, handle, _ = _round_trip(rank, buffers=_buffers() if kind.startswith("symm") else None)
        a2a.combine(routed[:, :1] if rank == 1 else routed, handle, w)
    a2a.dispatch(x, idx, num_experts=E)


# kind -> rank 0's error type and text; rank 1's error type (None: it died)
FAULTS = {
    "raises_elsewhere": (CollectiveTimeout, "alltoall_ops.dispatch on group", "KeyError"),
    "stalls": (CollectiveTimeout, "alltoall_ops.dispatch on group", CollectiveError.__name__),
    "dies": (CollectiveError, "alltoall_ops.dispatch on group", None),
    # the peer's payload exchange ends at the deadline, or earlier when gloo sees the pair broken
    "combine_bad_rank": (CollectiveError, "alltoall_ops.combine on group", "ValueError"),
    "symm_combine_bad_rank": (CollectiveTimeout, "alltoall_ops.symm_mem barrier on group", "ValueError"),
    # rank 1 raises its own error, not the CollectiveTimeout of the exchange it came to late
    "symm_fp8_late_bad_rank": (CollectiveTimeout, "alltoall_ops.symm_mem barrier on group", "ValueError"),
}


@pytest.mark.parametrize("kind", list(FAULTS))
def test_faults_end_within_the_deadline(kind):
    peer_type, text, bad_type = FAULTS[kind]
    with DistributedPool(2) as pool:
        with pytest.raises(RankFailures) as info:
            pool.run(fault, kind, timeout=CASE_DEADLINE_S)
    failures = info.value
    err = failures.errors[0]
    assert err.type_name in (peer_type.__name__, *(c.__name__ for c in peer_type.__subclasses__())), err
    assert text in err.message and "(rank 0 of 2)" in err.message, err.message
    if peer_type is CollectiveTimeout:  # the library's deadline, not gloo's 60 s
        assert f"the library's deadline ({DEADLINE_S:g} s" in err.message, err.message
    if bad_type is None:
        assert failures.silent == [1] or 1 not in failures.errors, str(failures)
    else:
        bad = failures.errors[1]  # a stalled rank's own late collective fails or times out
        late_types = ("CollectiveError", "CollectiveTimeout") if bad_type == "CollectiveError" else (bad_type,)
        assert bad.type_name in late_types, bad


# --------------------------------------------------------------------------------------------
# The deadline's own value and which timer fired


def non_finite_timeouts(rank: int, world_size: int) -> list[str]:
    """inf, nan and the like are refused at set_timeout (the deadline stays), and the next
    dispatch runs: no OverflowError from converting the deadline."""
    before = a2a.get_timeout()
    messages = []
    for seconds in (float("inf"), float("-inf"), float("nan"), 0, -1.0, 2e9, True, "5"):
        with pytest.raises(ValueError, match="seconds: expected a finite positive number of seconds") as info:
            a2a.set_timeout(seconds)
        messages.append(str(info.value))
    assert a2a.get_timeout() == before
    _healthy(rank)
    return messages


def test_set_timeout_refuses_non_finite_seconds(pool2):
    messages = pool2.run(non_finite_timeouts, timeout=CASE_DEADLINE_S)[0]
    assert messages[0].endswith("got inf") and messages[2].endswith("got nan"), messages


def test_environment_timeout_refuses_non_finite_seconds():
    import subprocess
    import sys

    for raw, shown in (("inf", "inf"), ("soon", "'soon'")):
        env = {**os.environ, "ALLTOALL_OPS_TIMEOUT": raw}
        proc = subprocess.run([sys.executable, "-c", "import alltoall_ops"], env=env, capture_output=True, text=True)
        assert proc.returncode != 0 and "ALLTOALL_OPS_TIMEOUT: expected a finite positive number of seconds, at " \
            f"most 1e+09, got {shown}\n" in proc.stderr, proc.stderr[-2000:]


PG_TIMEOUT_S = 1.0


def process_group_timeout(rank: int, world_size: int) -> str:
    """Rank 0 dispatches on a group whose own timeout (1 s) is shorter than the library's deadline
    (30 s); rank 1 never joins. The CollectiveTimeout names the process group's timer and the
    time waited."""
    from datetime import timedelta

    import torch.distributed as dist

    group = dist.new_group([0, 1], timeout=timedelta(seconds=PG_TIMEOUT_S))
    a2a.set_timeout(30.0)
    try:
        if rank == 1:
            time.sleep(2 * PG_TIMEOUT_S)
            return ""
        x, idx, _ = _inputs(rank)
        with pytest.raises(CollectiveTimeout) as info:
            a2a.dispatch(x, idx, num_experts=E, group=group)
        return str(info.value)
    finally:
        a2a.set_timeout(600.0)
        dist.barrier()


def test_timeout_names_the_timer_that_fired(pool2):
    message = pool2.run(process_group_timeout, timeout=CASE_DEADLINE_S)[0]
    assert "the process group's own timeout (before the library's deadline (30 s))" in message, message
    waited = float(message.split("timed out after ")[1].split(" s")[0])
    assert PG_TIMEOUT_S <= waited < 10, message
    pool2.run(healthy, timeout=CASE_DEADLINE_S)
