"""``torch.library.opcheck`` (schema, autograd registration, fake tensor, AOT dispatch with dynamic
shapes) of every op of the library, on the local backend in this process and on real gloo
groups through the collective path."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from alltoall_ops import comm, layout
from alltoall_ops.groups import LOCAL

OPS = torch.ops.alltoall_ops


# (T, K, expert_alignment, weighted); opcheck traces each op several times, so each config costs
# seconds: the collective runs take one each.
CONFIGS = [(6, 2, 1, True), (5, 3, 4, False), (0, 2, 2, True)]


def opcheck_all(rank: int, world_size: int, group_name: str | None, configs=CONFIGS) -> list[str]:
    """opcheck plan_routing, exchange_counts, read_splits, exchange_routing, dispatch and combine on small random
    inputs of this rank.

    group_name None: the default process group. Returns a description of each checked config."""
    if group_name is None:
        group_name = dist.group.WORLD.group_name
    checked = []
    E = 2 * world_size
    for T, K, alignment, weighted in configs:
        H = 3
        g = torch.Generator().manual_seed(1000 * rank + 10 * T + K)
        x = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
        idx = torch.randint(-1, E, (T, K), generator=g)
        w = torch.rand(T, K, generator=g, dtype=torch.float64, requires_grad=True) if weighted else None
        torch.library.opcheck(OPS.plan_routing.default, (idx, E, world_size))
        plan = layout.plan_routing(idx, E, world_size)
        header = comm.header("exchange_counts", E)
        torch.library.opcheck(OPS.exchange_counts.default, (plan.send_meta, group_name, header))
        recv_meta = OPS.exchange_counts(plan.send_meta, group_name, header)
        recv_counts, _ = layout.split_meta(recv_meta)
        R = int(layout.padded_tokens_per_expert(recv_counts, alignment).sum())
        torch.library.opcheck(OPS.read_splits.default, (plan.send_meta, recv_meta, alignment))
        dispatch_header = comm.header("dispatch", E, H, comm.dtype_code(x.dtype), K, alignment)
        torch.library.opcheck(OPS.exchange_routing.default, (plan.send_meta, group_name, dispatch_header, alignment))
        recv_meta_2, splits_2 = OPS.exchange_routing(plan.send_meta, group_name, dispatch_header, alignment)
        assert torch.equal(recv_meta_2, recv_meta) and splits_2.device.type == "cpu"
        splits = OPS.read_splits(plan.send_meta, recv_meta, alignment)
        assert splits.device.type == "cpu" and layout.HostSplits.of(splits).num_rows == R
        layout_args = (plan.order, plan.position, recv_meta, splits, alignment, group_name)

        # dispatch: forward (R data-dependent) and as combine's backward uses it (R known, scaled).
        torch.library.opcheck(OPS.dispatch.default, (x, None, *layout_args, None))
        scale = None if w is None else w.detach()
        grad_y = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
        torch.library.opcheck(OPS.dispatch.default, (grad_y, scale, *layout_args, R))

        expert_out = torch.randn(R, H, generator=g, dtype=torch.float64, requires_grad=True)
        # save_returned=False is for weights that need no gradient (inference, dispatch's backward).
        torch.library.opcheck(OPS.combine.default, (expert_out, scale, *layout_args, False))
        torch.library.opcheck(OPS.combine.default, (expert_out, w, *layout_args, True))
        checked.append(f"T={T} K={K} alignment={alignment} weighted={weighted} R={R}")
    return checked


def test_opcheck_collective_ops_on_one_rank():
    assert not dist.is_initialized()
    assert len(opcheck_all(0, 1, LOCAL)) == 3


@pytest.mark.parametrize("T, K, alignment, weighted", CONFIGS)
def test_opcheck_local_backend(T, K, alignment, weighted):
    """plan_rows, local_dispatch (forward, and scaled as combine's backward), local_combine and
    weight_grad: the local backend's ops, static shapes."""
    E, H = 4, 3
    g = torch.Generator().manual_seed(10 * T + K)
    x = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(-1, E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g, dtype=torch.float64, requires_grad=True) if weighted else None
    torch.library.opcheck(OPS.plan_rows.default, (idx, E, alignment))
    row_src, row, _ = OPS.plan_rows(idx, E, alignment)
    assert row_src.shape == (layout.local_capacity(T * K, E, alignment),)
    torch.library.opcheck(OPS.local_dispatch.default, (x, None, row_src, row))
    torch.library.opcheck(OPS.local_dispatch.default, (x, w, row_src, row))
    expert_out = torch.randn(row_src.shape[0], H, generator=g, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(OPS.local_combine.default, (expert_out, w, row, row_src))
    if weighted:
        torch.library.opcheck(OPS.weight_grad.default, (x, expert_out, row, w))


@pytest.mark.parametrize("pool, config", [(1, CONFIGS[0]), (2, CONFIGS[1])], indirect=["pool"])
def test_opcheck_collective(pool, config):
    results = pool.run(opcheck_all, None, [config])
    assert all(len(r) == 1 for r in results)
    assert all("R=0" not in r[0] for r in results)  # every rank really received rows
