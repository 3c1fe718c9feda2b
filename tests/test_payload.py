"""A payload format is one ``payload.Format``: a toy one defined here (int8 values with one fp32
scale per row, unknown to the package) moves through the local and collective backends' one
dispatch op unchanged, its values and scales exactly as the same parts moved as plain rows, on
one rank and on two (where they travel packed into one byte row)."""

from __future__ import annotations

import torch

from alltoall_ops import comm, layout
from alltoall_ops.backends.collective import dispatch_planned, send_along
from alltoall_ops.backends.local import local_dispatch_op
from alltoall_ops.groups import resolve_group
from alltoall_ops.payload import FORMATS, Format, Payload

T, H, K, E = 7, 64, 2, 4


class Int8Rows(Format):
    """int8 values, one fp32 scale per row (absmax / 127)."""

    name = "test_int8_rows"

    def scale_columns(self, hidden):
        return 1

    def routed_dtype(self, x_dtype):
        return torch.int8

    def encode(self, x_TH, x_scale_TB):
        scale_T1 = x_TH.float().abs().amax(1, keepdim=True).clamp(min=1e-4) / 127
        return (x_TH.float() / scale_T1).round().to(torch.int8), scale_T1

    def decode(self, values_RH, scale_RB, out_dtype, num_routed_1=None):
        if out_dtype is None:
            return values_RH, scale_RB
        return (values_RH.float() * scale_RB).to(out_dtype), scale_RB


INT8 = Int8Rows()


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), torch.randint(-1, E, (T, K), generator=g)


def test_local_dispatch_moves_a_new_format_as_its_parts(monkeypatch):
    monkeypatch.setitem(FORMATS, INT8.name, INT8)
    x, idx = _inputs(0)
    values_TH, scale_T1 = INT8.encode(x, None)
    plan = layout.plan_rows(idx, E, 2)
    route = dict(row_src_C=plan.row_src, row_TK=plan.row)
    values_CH, scale_C1 = local_dispatch_op(x_TH=x, scale_TK=None, **route, payload=INT8.name)
    assert values_CH.dtype == torch.int8 and scale_C1.shape == (plan.row_src.shape[0], 1)
    assert torch.equal(values_CH, local_dispatch_op(x_TH=values_TH, scale_TK=None, **route)[0])
    assert torch.equal(scale_C1, local_dispatch_op(x_TH=scale_T1, scale_TK=None, **route)[0])
    rows_CH, _ = local_dispatch_op(x_TH=x, scale_TK=None, **route, payload=INT8.name, out_dtype=torch.float64)
    assert torch.equal(rows_CH, INT8.decode(values_CH, scale_C1, torch.float64)[0])


def run_collective(rank: int, world_size: int) -> None:
    FORMATS.setdefault(INT8.name, INT8)
    x, idx = _inputs(10 + rank)
    group = resolve_group(None)
    plan = layout.plan_routing(idx, E, world_size)
    fields = comm.dispatch_fields(x, idx, E, 2, x.dtype, x.dtype)
    (values_RH, scale_R1), _, handle = dispatch_planned(
        x, plan, comm.header("dispatch", *fields), 2, group.name, Payload(INT8, None, None, x.dtype))
    values_TH, scale_T1 = INT8.encode(x, None)
    assert values_RH.dtype == torch.int8 and values_RH.is_contiguous() and scale_R1.is_contiguous()
    assert torch.equal(values_RH, send_along(handle, values_TH)) and torch.equal(scale_R1, send_along(handle, scale_T1))


def test_collective_dispatch_moves_a_new_format_as_its_parts(pool1, pool2):
    pool1.run(run_collective)
    pool2.run(run_collective)
