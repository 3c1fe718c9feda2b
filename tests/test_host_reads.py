"""Host reads and collectives per MoE layer step (forward dispatch, combine, backward of both),
counted from outside the library (:class:`alltoall_ops.testing.HostTraffic`).

One rank (the ``local`` backend) reads nothing: its rows have a static count and its layout
stays on the device. On a group (``collective``) the forward dispatch reads its split sizes
once (the layer's one device sync on a GPU: NCCL takes host split sizes); combine, both
backward ops and the expert_out row check reuse them. The counts travel inside
the dispatch's header agreement (one all-gather, one read), or, when they do not fit its
payload, in an all-to-all after it (a second read). Combine moves nothing but its rows, unless
debug mode asks for its agreement.
"""

from __future__ import annotations

import pytest
import torch

import alltoall_ops as a2a
from alltoall_ops import comm
from alltoall_ops.errors import RoutingError
from alltoall_ops.testing import HostTraffic, debug_mode

E, T, H, K = 4, 9, 6, 2


def _step(rank: int, alignment: int, layer=None):
    """One layer step: route, dispatch, a per-row expert, combine, backward; returns the traffic."""
    g = torch.Generator().manual_seed(7 + rank)  # fresh inputs per rank
    x = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K, generator=g, dtype=torch.float64, requires_grad=True)
    topk_idx = torch.randint(-1, E, (T, K), generator=g)

    def moe(x, w):
        routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, expert_alignment=alignment)
        return a2a.combine(torch.tanh(routed) * 2, handle, w)

    fn = moe if layer is None else layer(moe)
    fn(x, w)  # warm-up (compilation, buffers)
    with HostTraffic() as traffic:
        fn(x, w).sum().backward()
    assert x.grad is not None and w.grad is not None
    return traffic.reads, dict(traffic.collectives)


@pytest.mark.parametrize("alignment", [1, 3])
def test_one_rank_reads_nothing_and_exchanges_nothing(alignment):
    assert _step(0, alignment) == (0, {})


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_one_rank_compiled_reads_nothing(backend):
    compiled = lambda fn: torch.compile(fn, backend=backend, fullgraph=True)  # noqa: E731
    assert _step(0, 2, compiled) == (0, {})


def test_one_rank_bad_ids_raise_a_routing_error():
    """The bad-id check rides on the routing plan (a device-side assert on CUDA): still a
    RoutingError naming the ids on the CPU."""
    x = torch.randn(T, H, dtype=torch.float64)
    topk_idx = torch.randint(0, E, (T, K))
    topk_idx[3, 1] = E
    with pytest.raises(RoutingError, match=rf"1 expert id\(s\) outside \[-1, {E}\) \(min -1, max {E}\)"):
        a2a.dispatch(x, topk_idx, num_experts=E)


def test_the_counter_sees_reads_outside_the_library():
    with HostTraffic() as traffic:
        float(torch.ones(()))
        bool(torch.ones(()) > 0)
    assert traffic.reads == 2


def _group_step(rank: int, world_size: int, alignment: int, debug: bool, payload_len: int = comm.PAYLOAD_LEN):
    comm.PAYLOAD_LEN, before = payload_len, comm.PAYLOAD_LEN
    try:
        with debug_mode(debug):
            return _step(rank, alignment)
    finally:
        comm.PAYLOAD_LEN = before


@pytest.mark.parametrize("alignment", [1, 2])
def test_two_ranks_read_the_splits_once(pool2, alignment):
    # the agreement's all-gather carries the counts (one read); 4 payload all-to-alls: dispatch,
    # combine, and their adjoints in backward
    expected = (1, {"all_gather": 1, "all_to_all_single": 4})
    assert pool2.run(_group_step, alignment, False) == [expected] * 2


def test_counts_too_many_for_the_agreement_move_after_it(pool2):
    # W * L = 2 * (2 + 3) = 10 counts > 4: the agreement, then an all-to-all of the counts and
    # a second read
    expected = (2, {"all_gather": 1, "all_to_all_single": 5})
    assert pool2.run(_group_step, 1, False, 4) == [expected] * 2


def test_debug_mode_adds_the_combine_agreement(pool2):
    expected = (2, {"all_gather": 2, "all_to_all_single": 4})
    assert pool2.run(_group_step, 1, True) == [expected] * 2
