"""Host time of the pieces of one local dispatch / combine (a host timer around 200 calls each,
the best of three rounds), against plain torch (argsort + ``index_select``; a gather and a
weighted sum), and on a GPU the kernels alone, compiled calls and the device syncs of one local
MoE layer step (CUDA's sync debug mode and ``alltoall_ops.testing.HostTraffic``).

    PYTHONPATH=. python3 tools/host_costs.py                 # GPU: H = 7168, T = 128 and 4096
    PYTHONPATH=. python3 tools/host_costs.py --device cpu    # CPU tensors: H = 256, T = 128

K = 8, E = 256 on both. On the CPU, H = 256 and fp32 rows (bf16 arithmetic is slow there) on one
thread (``torch.set_num_threads(1)``), so that the rows cost little beside the host path.
The pieces of ``a2a.dispatch(..., backend="local")``: group (``resolve_group``), choose, checks
(every argument check of the call), plan (``layout.plan_rows``), op (the ``local_dispatch`` op
through ``_compat.call``), handle; of ``a2a.combine``: checks and op. "rest" is the whole call
minus its pieces (the API's own glue).
"""

from __future__ import annotations

import argparse
import warnings
from typing import Callable

import torch

import alltoall_ops as a2a
from alltoall_ops import backends, layout
from alltoall_ops._compat import call
from alltoall_ops.backends.local import LocalHandle, local_combine_op, local_dispatch_op
from alltoall_ops.groups import resolve_group
from alltoall_ops.moe import MoE
from alltoall_ops.testing import HostTraffic, host_us

K, E = 8, 256
HIDDEN = {"cuda": 7168, "cpu": 256}
DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}
TOKENS = {"cuda": (128, 4096), "cpu": (128,)}


def timed(fn: Callable[[], object]) -> float:
    """Host microseconds per call: 20 warm-up calls, then the best of three rounds of 200."""
    return min(host_us(fn, n=200, warmup=20) for _ in range(3))


def pieces(T: int, H: int, dev: torch.device) -> dict[str, float]:
    """Microseconds per piece of a local dispatch and combine of T tokens, and the plain rows."""
    x = torch.randn(T, H, device=dev, dtype=DTYPE[dev.type])
    weights, topk_idx = torch.randn(T, E, device=dev).softmax(-1).topk(K, dim=-1)
    grp = resolve_group(None)
    local = backends.choose("local", grp)
    plan = layout.plan_rows(topk_idx, E, 1)
    routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, backend="local")

    def checks():
        return local.check_dispatch(x, topk_idx, num_experts=E, group=grp, expert_alignment=1, buffers=None,
                                    payload=None)

    def plain_dispatch():
        order = topk_idx.reshape(-1).argsort(stable=True)
        return x.index_select(0, order // K)

    def plain_combine():
        return (routed.index_select(0, handle.row_TK.reshape(-1)).view(T, K, H).float()
                * weights[:, :, None]).sum(1).to(routed.dtype)

    dispatch = {
        "group": timed(lambda: resolve_group(None)),
        "choose": timed(lambda: backends.choose("local", grp)),
        "checks": timed(checks),
        "plan": timed(lambda: layout.plan_rows(topk_idx, E, 1)),
        "op": timed(lambda: call(local_dispatch_op, x_TH=x, scale_TK=None, row_src_C=plan.row_src, row_TK=plan.row)),
        "handle": timed(lambda: LocalHandle(plan.row_src, plan.row, 1)),
    }
    whole = timed(lambda: a2a.dispatch(x, topk_idx, num_experts=E, backend="local"))
    combine = {
        "checks": timed(lambda: handle.check_combine(routed, weights)),
        "op": timed(lambda: call(local_combine_op, expert_out_CH=routed, weights_TK=weights, row_TK=handle.row_TK,
                                 row_src_C=handle.row_src_C)),
    }
    whole_combine = timed(lambda: a2a.combine(routed, handle, weights))
    rows = {f"dispatch: {k}": v for k, v in dispatch.items()}
    rows |= {"dispatch: rest": whole - sum(dispatch.values()), "local dispatch": whole,
             "plain dispatch": timed(plain_dispatch)}
    rows |= {f"combine: {k}": v for k, v in combine.items()}
    rows |= {"combine: rest": whole_combine - sum(combine.values()), "local combine": whole_combine,
             "plain combine": timed(plain_combine)}
    if dev.type == "cuda":
        rows |= gpu_pieces(x, topk_idx, plan, routed, plain_dispatch)
    return rows


def gpu_pieces(x: torch.Tensor, topk_idx: torch.Tensor, plan: layout.RowPlan, routed: torch.Tensor,
               plain_dispatch: Callable[[], torch.Tensor]) -> dict[str, float]:
    """The kernels and small torch ops under the plan, and compiled dispatches (CUDA)."""
    from alltoall_ops.kernels import loader

    kernels, dev = loader.load(), x.device
    T, H = x.shape
    C = layout.local_capacity(T * K, E, 1)
    status_ok = layout.plan_rows_op(topk_idx, E, 1)[2][0, E:]  # the status and its no-bad-id flag
    compiled_local = torch.compile(lambda x, i: a2a.dispatch(x, i, num_experts=E)[0], fullgraph=True)
    compiled_plain = torch.compile(plain_dispatch, fullgraph=True)
    return {
        "torch.empty": timed(lambda: torch.empty(T * K, H, device=dev, dtype=torch.bfloat16)),
        "tiny add": timed(lambda: plan.status.add(0)),
        "torch.full (C,)": timed(lambda: torch.full((C,), -1, dtype=torch.int64, device=dev)),
        "plan_rows (kernels)": timed(lambda: kernels.plan_rows(topk_idx, E, 1, C)),
        "check_status": timed(lambda: layout.check_status(status_ok, E)),
        "plan_rows op": timed(lambda: layout.plan_rows_op(topk_idx, E, 1)),
        "gather_rows launcher": timed(lambda: kernels.gather_rows(x, plan.row_src, routed, top_k=K)),
        "compiled local dispatch": timed(lambda: compiled_local(x, topk_idx)),
        "compiled plain dispatch": timed(compiled_plain),
    }


def syncs_of_a_layer_step(dev: torch.device) -> tuple[int, int]:
    """(CUDA sync warnings, HostTraffic reads) of one local MoE forward + backward."""
    layer = MoE(2048, 1408, 64, 6, backend="local", device=dev, dtype=torch.bfloat16)
    x = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, HostTraffic() as traffic:
            warnings.simplefilter("always")
            layer(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
    return len(syncs), traffic.reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    dev = torch.device(parser.parse_args().device)
    H = HIDDEN[dev.type]
    if dev.type == "cpu":
        torch.set_num_threads(1)
    for T in TOKENS[dev.type]:
        print(f"T={T} H={H} K={K} E={E} {DTYPE[dev.type]} on {dev.type}, host us per call")
        for name, us in pieces(T, H, dev).items():
            print(f"T={T:5d} {name:>24}: {us:8.1f} us host")
    if dev.type == "cuda":
        syncs, reads = syncs_of_a_layer_step(dev)
        print(f"local MoE step (T=4096, fwd + bwd): {syncs} synchronising CUDA calls, {reads} HostTraffic reads")


if __name__ == "__main__":
    main()
