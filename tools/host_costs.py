"""Host time of the pieces of one local dispatch / combine on a GPU (a host timer around 200
calls each), against plain argsort + ``index_select``, and the device syncs of one local MoE
layer step (CUDA's sync debug mode and ``alltoall_ops.testing.HostTraffic``).

    PYTHONPATH=. python3 tools/host_costs.py
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

import alltoall_ops as a2a
from alltoall_ops import layout
from alltoall_ops.kernels import loader
from alltoall_ops.moe import MoE
from alltoall_ops.testing import HostTraffic, host_us

H, K, E = 7168, 8, 256


def timed(fn: Callable[[], object]) -> float:
    """Host microseconds per call: 20 warm-up calls, then 200 timed ones."""
    return host_us(fn, n=200, warmup=20)


def pieces(T: int, dev: torch.device) -> dict[str, float]:
    kernels = loader.load()
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    weights, topk_idx = torch.randn(T, E, device=dev).softmax(-1).topk(K, dim=-1)
    C = layout.local_capacity(T * K, E, 1)
    plan = layout.plan_rows(topk_idx, E, 1)
    status_ok = layout.plan_rows_op(topk_idx, E, 1)[2][0, E:]  # the status and its no-bad-id flag
    routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, backend="local")

    def plain_dispatch():
        order = topk_idx.reshape(-1).argsort(stable=True)
        return x.index_select(0, order // K)

    compiled_local = torch.compile(lambda x, i: a2a.dispatch(x, i, num_experts=E)[0], fullgraph=True)
    compiled_plain = torch.compile(plain_dispatch, fullgraph=True)
    return {
        "torch.empty": timed(lambda: torch.empty(T * K, H, device=dev, dtype=torch.bfloat16)),
        "tiny add": timed(lambda: plan.status.add(0)),
        "torch.full (C,)": timed(lambda: torch.full((C,), -1, dtype=torch.int64, device=dev)),
        "plan_rows (kernels)": timed(lambda: kernels.plan_rows(topk_idx, E, 1, C)),
        "check_status": timed(lambda: layout.check_status(status_ok, E)),
        "plan_rows op": timed(lambda: layout.plan_rows_op(topk_idx, E, 1)),
        "layout.plan_rows": timed(lambda: layout.plan_rows(topk_idx, E, 1)),
        "gather_rows launcher": timed(lambda: kernels.gather_rows(x, plan.row_src, routed, top_k=K)),
        "local dispatch": timed(lambda: a2a.dispatch(x, topk_idx, num_experts=E, backend="local")),
        "local combine": timed(lambda: a2a.combine(routed, handle, weights)),
        "plain dispatch": timed(plain_dispatch),
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
    dev = torch.device("cuda")
    for T in (128, 4096):
        for name, us in pieces(T, dev).items():
            print(f"T={T:5d} {name:>24}: {us:8.1f} us host")
    syncs, reads = syncs_of_a_layer_step(dev)
    print(f"local MoE step (T=4096, fwd + bwd): {syncs} synchronising CUDA calls, {reads} HostTraffic reads")


if __name__ == "__main__":
    main()
