"""Multi-GPU correctness check and benchmark, one process per GPU (torchrun, NCCL).

    torchrun --nproc-per-node W -m benchmarks.bench_multigpu [--check] [--bench] [--out results]
    torchrun --nproc-per-node W -m benchmarks.bench_multigpu --vdev2d    # torch's all_to_all_vdev_2d

``--check``: collective and symm_mem backends (real CUDA symmetric memory) on fp64 / bf16 inputs
against the plain-PyTorch reference of the gathered global view: dispatch, combine and their
gradients; the fp8 dispatch of both (rows bit for bit, the straight-through gradient); the
two-stage dispatch on a (2, W / 2) mesh against the flat one (W >= 4, even); Ulysses seq <->
head, inductor compile (one compilation across routings; on GPUs the symm_mem ops inlined too,
``ALLTOALL_OPS_INLINE_SYMMETRIC=1``), and a CUDA graph of the symm_mem dispatch + combine replayed
with new routing.
``--bench``: dispatch and combine per rank at (T, H, K, E) = (4096, 7168, 8, 256) and the decode
shape (128, 7168, 8, 256), bf16, for this library's collective and symm_mem backends and the plain
``all_to_all_single`` path (argsort, count exchange, host sync, payload all-to-all); then the
dispatch with an fp8 payload on both backends and by hand (quantize, pack, the plain path). Reports the
median time (max over ranks), logical GB/s (rows received per rank, own rows included, as DeepEP
counts) and link GB/s (rows that cross to another GPU). ``--vdev2d`` times torch's NVSHMEM
``all_to_all_vdev_2d`` in a process of its own (its allocator backend must be chosen first).
``--budgets 16 24 32 all``: the symm_mem dispatch and combine at T = 4096 on SymmBuffers with each
SM budget (``num_sms``), alone and beside a shared-expert SwiGLU GEMM on another stream: the
real peer bandwidth per budget (link GB/s), the number one GPU cannot give (issue 28).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
import traceback
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

import alltoall_ops as a2a
from alltoall_ops import fp8
from alltoall_ops.payload import pack
from alltoall_ops.reference import reference_combine, reference_dispatch
from alltoall_ops.testing import inline_symmetric, moe_step, routing

BENCH_SHAPES = ((4096, 7168, 8, 256), (128, 7168, 8, 256))


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's tensor (any first dim), on the CPU."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t.detach().cpu())
    return out


# --- correctness --------------------------------------------------------------------------


def check_dispatch_combine(backend: str, dtype: torch.dtype, device) -> str:
    rank, W = dist.get_rank(), dist.get_world_size()
    T, H, K, E, A = 40 + 7 * rank, 64, 4, 8 * W, 4
    torch.manual_seed(1000 + rank)
    x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
    topk_idx = torch.randint(-1, E, (T, K), device=device)
    weights = torch.rand(T, K, device=device, dtype=dtype, requires_grad=True)
    kwargs = {}
    if backend == "symm_mem":
        kwargs["buffers"] = a2a.SymmBuffers(64, H, K, E, dtype=dtype, device=device, expert_alignment=A)
    routed, tokens_per_expert, handle = a2a.dispatch(
        x, topk_idx, num_experts=E, expert_alignment=A, backend=backend, **kwargs
    )
    R = int(tokens_per_expert.sum())
    routed = routed[:R]  # symm_mem: the capacity rows past R are unspecified (not written)
    y = a2a.combine(torch.cat([routed * 2 + 1, routed.new_zeros(handle.num_rows - R, H)]), handle, weights)
    grad_y = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, weights), grad_y)

    xs, idxs, ws, gys = gathered(x), gathered(topk_idx), gathered(weights), gathered(grad_y)
    ref_xs = [t.double().requires_grad_() for t in xs]
    ref = reference_dispatch(ref_xs, idxs, E, A)
    ref_routed, ref_tpe = ref[rank]
    assert torch.equal(tokens_per_expert.cpu(), ref_tpe), "tokens_per_expert"
    assert torch.equal(routed.double().cpu(), ref_routed.detach()), "routed rows (padding rows zero)"
    ref_outs = [r * 2 + 1 for r, _ in ref]
    ref_ws = [w.double().requires_grad_() for w in ws]
    ref_ys = reference_combine(ref_outs, idxs, E, ref_ws, A, acc_dtype=torch.float64)
    total = sum((yy * g.double()).sum() for yy, g in zip(ref_ys, gys))
    ref_gx, ref_gw = torch.autograd.grad(total, (ref_xs[rank], ref_ws[rank]))
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    for name, got, want in (("y", y, ref_ys[rank]), ("dx", gx, ref_gx), ("dw", gw, ref_gw)):
        err = ((got.double().cpu() - want.detach()).norm() / want.detach().norm().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"
    return f"{backend} {str(dtype)[6:]}: R={R} rows, fwd + grads match the reference"


def check_fp8(backend: str, device) -> str:
    """fp8 payload: every rank's (values, scales) dequantize to the reference layout of the
    gathered dequantized tokens exactly; in dequantize mode x's gradient is the bf16 dispatch's."""
    rank, W = dist.get_rank(), dist.get_world_size()
    T, H, K, E, A = 40 + 7 * rank, 256, 4, 8 * W, 4
    torch.manual_seed(2000 + rank)
    x = torch.randn(T, H, device=device).to(torch.bfloat16)
    topk_idx = torch.randint(-1, E, (T, K), device=device)

    def buffers():
        if backend != "symm_mem":
            return {}
        bufs = a2a.SymmBuffers(64, H, K, E, dtype=torch.bfloat16, device=device, expert_alignment=A,
                               payload_dtype=fp8.FP8)
        return {"buffers": bufs}

    (values, scales), tpe, _ = a2a.dispatch(x, topk_idx, num_experts=E, expert_alignment=A, backend=backend,
                                            payload_dtype=fp8.FP8, **buffers())
    R = int(tpe.sum())
    deq = [fp8.dequantize(*fp8.quantize(t), torch.float32) for t in gathered(x)]
    ref_routed, ref_tpe = reference_dispatch(deq, gathered(topk_idx), E, A)[rank]
    assert torch.equal(tpe.cpu(), ref_tpe), "tokens_per_expert"
    assert torch.equal(fp8.dequantize(values[:R], scales[:R], torch.float32).cpu(), ref_routed), "fp8 rows"
    xg = x.clone().requires_grad_()
    routed, _, _ = a2a.dispatch(xg, topk_idx, num_experts=E, expert_alignment=A, backend=backend,
                                payload_dtype=fp8.FP8, dequantize=True, **buffers())
    assert torch.equal(routed[:R].float().cpu(), ref_routed.to(torch.bfloat16).float()), "dequantized rows"
    grad = torch.randn_like(routed)
    grad[R:] = 0  # symm_mem: the capacity rows past R are not the layer's
    (gx,) = torch.autograd.grad(routed, xg, grad)
    xp = x.clone().requires_grad_()
    bf16_kwargs = {"buffers": a2a.SymmBuffers(64, H, K, E, dtype=torch.bfloat16, device=device, expert_alignment=A)} \
        if backend == "symm_mem" else {}
    routed_p, _, _ = a2a.dispatch(xp, topk_idx, num_experts=E, expert_alignment=A, backend=backend, **bf16_kwargs)
    (gp,) = torch.autograd.grad(routed_p, xp, grad)
    assert torch.equal(gx, gp), "straight-through gradient != the bf16 dispatch's"
    return f"{backend} fp8: R={R} rows = reference bit for bit, x.grad = bf16 dispatch's"


def check_hierarchical(device) -> str:
    """Two stages on a (2, W / 2) mesh against the flat dispatch: each expert's rows (any order),
    y and the gradients (bf16 and fp8 payloads)."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, W = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (2, W // 2), mesh_dim_names=("node", "local"))
    groups = dict(node_group=mesh["node"], local_group=mesh["local"])
    T, H, K, E = 48, 128, 4, 4 * W
    torch.manual_seed(3000 + rank)
    x = torch.randn(T, H, device=device, dtype=torch.float64)
    topk_idx, weights = routing(T, K, E, device=device, seed=3000 + rank)
    weights = weights.double()

    def step(dispatch_fn, x_):
        x_ = x_.clone().requires_grad_()
        routed, tpe, handle = dispatch_fn(x_)
        y = a2a.combine(torch.tanh(routed), handle, weights)
        (gx,) = torch.autograd.grad(y.sum(), x_)
        return routed.detach(), tpe, y.detach(), gx

    def per_expert(routed, tpe):
        return [sorted(map(tuple, rows.tolist())) for rows in routed.split(tpe.tolist())]

    for name, kwargs, x_in in (("fp64", {}, x), ("fp8", dict(payload_dtype=fp8.FP8, dequantize=True), x.float())):
        flat = step(lambda x_, kw=kwargs: a2a.dispatch(x_, topk_idx, num_experts=E, **kw), x_in)
        staged = step(lambda x_, kw=kwargs: a2a.hierarchical_dispatch(x_, topk_idx, num_experts=E, **groups, **kw),
                      x_in)
        assert torch.equal(flat[1], staged[1]) and per_expert(*flat[:2]) == per_expert(*staged[:2]), name
        tol = 1e-12 if name == "fp64" else 1e-5
        for what, a, b in (("y", flat[2], staged[2]), ("x.grad", flat[3], staged[3])):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"{name} {what}")
    return f"2 x {W // 2} mesh: rows per expert, y and x.grad = flat (fp64; fp8 dequantized)"


def check_ulysses(device) -> str:
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)  # the same global tensor on every rank
    full = torch.randn(2, 16 * W, 4 * W, 8, device=device, dtype=torch.float64)
    shard = full.chunk(W, dim=1)[rank].clone().requires_grad_()
    y = a2a.seq_to_head(shard)
    assert torch.equal(y, full.chunk(W, dim=2)[rank]), "seq_to_head"
    assert torch.equal(a2a.head_to_seq(y), shard), "head_to_seq"
    (g,) = torch.autograd.grad(y, shard, torch.ones_like(y))
    assert torch.equal(g, torch.ones_like(shard))
    return f"W={W} exact, inverse exact"


def check_compile(device, backend: str, inline: bool = False) -> str:
    """A compiled (fullgraph) MoE step's output and gradients against eager's over 3 routings, one
    compilation. ``inline`` (symm_mem on CUDA symmetric memory): with ``ALLTOALL_OPS_INLINE_SYMMETRIC=1``,
    inductor's code of the forward and backward launches every kernel itself (no symm op called),
    the barriers included (the launches per graph are reported), and a step after a dispatch
    whose outputs nothing uses runs (every rank drops that dispatch alike)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.utils import run_and_get_code

    rank, W = dist.get_rank(), dist.get_world_size()
    T, H, K, E = 64, 32, 2, 4 * W
    kwargs = {}
    if backend == "symm_mem":
        kwargs["buffers"] = a2a.SymmBuffers(T, H, K, E, dtype=torch.float32, device=device)
    with inline_symmetric(inline):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(moe_step, backend=counter, fullgraph=True)
        torch.manual_seed(3)
        expert_w = torch.randn(E // W, H, H, device=device, requires_grad=True)
        codes = []
        for step in range(3):
            torch.manual_seed(100 * step + rank)
            x = torch.randn(T, H, device=device, requires_grad=True)
            topk_idx, weights = routing(T, K, E, device=device, seed=10 * step + rank)

            def compiled_step(x=x, topk_idx=topk_idx, weights=weights):
                y = compiled(x, topk_idx, weights, expert_w, E, backend=backend, **kwargs)
                return y, torch.autograd.grad(y.sum(), (x, expert_w))

            (y, g), codes = run_and_get_code(compiled_step) if step == 0 else (compiled_step(), codes)
            ye = moe_step(x, topk_idx, weights, expert_w, E, backend=backend, **kwargs)
            ge = torch.autograd.grad(ye.sum(), (x, expert_w))
            torch.testing.assert_close(y, ye, rtol=1e-4, atol=1e-5)
            for a, b in zip(g, ge):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert counter.frame_count == 1, counter.frame_count
        if inline:  # a dispatch whose outputs nothing uses: dropped on every rank alike, or a peer would wait

            def unused_dispatch_then_step(x, topk_idx, weights):
                a2a.dispatch(x, topk_idx, num_experts=E, backend=backend, **kwargs)
                return moe_step(x, topk_idx, weights, expert_w, E, backend=backend, **kwargs)

            y = torch.compile(unused_dispatch_then_step, fullgraph=True)(x, topk_idx, weights)
            torch.testing.assert_close(y, moe_step(x, topk_idx, weights, expert_w, E, backend=backend, **kwargs),
                                       rtol=1e-4, atol=1e-5)
    if not inline:
        return f"{backend}: inductor, 1 compilation over 3 routings, = eager"
    called = [c for c in codes if "alltoall_ops.symm_" in c]
    assert not called, "a symm_mem op is still called, not inlined"
    launches = [(len(re.findall(r"\.run\(", c)), len(re.findall(r"\b_barrier_kernel_\d+\.run\(", c))) for c in codes]
    return (f"{backend} inlined: 1 compilation over 3 routings, = eager; launches (all, barriers) in inductor's code "
            f"per graph (forward, backward): {launches}")


def captured(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``step`` run once on a side stream (the warm-up capture needs), then captured in a CUDA
    graph, every rank after a barrier (the step's exchanges wait for every rank's)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    return graph


def check_cuda_graph(device) -> str:
    rank, W = dist.get_rank(), dist.get_world_size()
    T, H, K, E = 96, 128, 4, 8 * W
    bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device=device)
    x = torch.empty(T, H, device=device, dtype=torch.bfloat16)
    topk_idx = torch.empty(T, K, device=device, dtype=torch.int64)
    weights = torch.empty(T, K, device=device, dtype=torch.float32)
    out = {}

    def load(seed):
        torch.manual_seed(seed * 10 + rank)
        x.copy_(torch.randn(T, H, device=device))
        idx, w = routing(T, K, E, device=device, seed=seed * 10 + rank)
        topk_idx.copy_(idx)
        weights.copy_(w)

    def step():
        routed, tpe, h = a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)
        out["y"], out["tpe"] = a2a.combine(routed * 2, h, weights), tpe

    load(0)
    graph = captured(step)
    for seed in (1, 2):
        load(seed)
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        routed, tpe, h = a2a.dispatch(x, topk_idx, num_experts=E, backend="collective")
        y_ref = a2a.combine(routed * 2, h, weights)
        assert torch.equal(out["tpe"], tpe) and torch.equal(out["y"], y_ref), f"replay {seed}"
    return "captured once, 2 replays with new routing = collective backend (bitwise)"


# --- benchmark ----------------------------------------------------------------------------


def plain_dispatch(x, topk_idx, E, group):
    """The usual path: argsort, count exchange, host sync, all_to_all_single of the rows."""
    W = dist.get_world_size(group)
    order = torch.argsort(topk_idx.reshape(-1), stable=True)
    send = x.index_select(0, order // topk_idx.shape[1])
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(
        0, topk_idx.reshape(-1), torch.ones_like(order))
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    splits = torch.stack([counts.view(W, -1).sum(1), recv_counts.view(W, -1).sum(1)]).tolist()
    out = x.new_empty(sum(splits[1]), x.shape[1])
    dist.all_to_all_single(out, send, splits[1], splits[0], group=group)
    return out, order, splits


def plain_combine(expert_out, order, splits, weights, T, group):
    back = expert_out.new_empty(sum(splits[0]), expert_out.shape[1])
    dist.all_to_all_single(back, expert_out, splits[0], splits[1], group=group)
    K = weights.shape[1]
    rows = back.float() * weights.reshape(-1)[order].float()[:, None]
    y = torch.zeros(T, back.shape[1], dtype=torch.float32, device=back.device)
    return y.index_add_(0, order // K, rows).to(back.dtype)


def time_us(fn, device, iters: int = 30) -> float:
    """Median over iterations of CUDA-event time (wall clock on CPU), each iteration started
    together on all ranks; the max over ranks."""
    cuda = device.type == "cuda"
    for _ in range(5):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters if cuda else 3):
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    med = torch.tensor([sorted(times)[len(times) // 2]], device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def plain_fp8_dispatch(x, topk_idx, E, group):
    """The same by hand with an fp8 payload: quantize (``fp8.quantize``), pack values and scales
    into one wire row (``payload.pack``), then the plain path on the packed rows."""
    return plain_dispatch(pack(*fp8.quantize(x)), topk_idx, E, group)


def fp8_implementations(x, topk_idx, E: int, bufs8, group) -> dict:
    """name -> dispatch fn with an fp8 payload (combine is the bf16 one)."""
    return {
        "ours/collective fp8": lambda: a2a.dispatch(x, topk_idx, num_experts=E, backend="collective",
                                                    payload_dtype=fp8.FP8),
        "ours/symm_mem fp8": lambda: a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs8, payload_dtype=fp8.FP8),
        "torch all_to_all_single fp8": lambda: plain_fp8_dispatch(x, topk_idx, E, group),
    }


def implementations(x, topk_idx, weights, E: int, bufs, group) -> dict:
    """name -> (dispatch fn, combine fn) for one shape; combine fns reuse one dispatch's output."""
    T = x.shape[0]
    routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, backend="collective")
    s_routed, _, s_handle = a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)
    p_out, order, splits = plain_dispatch(x, topk_idx, E, group)
    return {
        "ours/collective": (
            lambda: a2a.dispatch(x, topk_idx, num_experts=E, backend="collective"),
            lambda: a2a.combine(routed, handle, weights),
        ),
        "ours/symm_mem": (
            lambda: a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs),
            lambda: a2a.combine(s_routed, s_handle, weights),
        ),
        "torch all_to_all_single": (
            lambda: plain_dispatch(x, topk_idx, E, group),
            lambda: plain_combine(p_out, order, splits, weights, T, group),
        ),
    }


def bench_shape(T: int, H: int, K: int, E: int, device) -> list[dict]:
    rank, W = dist.get_rank(), dist.get_world_size()
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    topk_idx, weights = routing(T, K, E, device=device, seed=rank + T)
    dest = topk_idx // (E // W)  # (T, K) destination rank of each slot
    # Rows received per rank, own rows included (logical), and rows crossing to a peer (link),
    # both summed over ranks here and averaged below.
    counts = torch.tensor([dest.numel(), int((dest != rank).sum())], device=device)
    dist.all_reduce(counts)
    recv_rows, link_rows = counts.tolist()
    row_bytes = H * x.element_size()
    logical, link = recv_rows * row_bytes / W, link_rows * row_bytes / W  # per rank
    bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device=device)
    rows = []

    def measure(name: str, op: str, fn, row_scale: float = 1.0) -> None:
        """One row; row_scale: bytes of a moved row relative to a bf16 row (fp8: 0.516)."""
        us = time_us(fn, device)
        lg, lk = logical * row_scale / us / 1e3, link * row_scale / us / 1e3
        rows.append(dict(W=W, T=T, H=H, K=K, E=E, impl=name, op=op, us=us, logical_GBps=lg, link_GBps=lk))
        say(f"W={W} T={T:5d} {name:>28} {op:>8}: {us:9.1f} us  logical {lg:7.1f} GB/s  link {lk:7.1f} GB/s")

    for name, fns in implementations(x, topk_idx, weights, E, bufs, dist.group.WORLD).items():
        for op, fn in zip(("dispatch", "combine"), fns):
            measure(name, op, fn)
    del bufs
    bufs8 = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device=device, payload_dtype=fp8.FP8)
    for name, fn in fp8_implementations(x, topk_idx, E, bufs8, dist.group.WORLD).items():
        measure(name, "dispatch", fn, fp8.packed_width(H) / row_bytes)
    return rows


def bench(device, out_dir: str, shapes) -> list[dict]:
    rows = [row for shape in shapes for row in bench_shape(*shape, device)]
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        with open(os.path.join(out_dir, f"bench_multigpu_W{dist.get_world_size()}.json"), "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return rows


def bench_budgets(device, out_dir: str, budgets: list[str]) -> list[dict]:
    """symm_mem dispatch + combine at each SM budget, alone and beside a GEMM on another stream."""
    from benchmarks.overlap import concurrently, shared_expert

    rank, W = dist.get_rank(), dist.get_world_size()
    T, H, K, E, F = (4096, 7168, 8, 256, 2048) if device.type == "cuda" else (32, 128, 2, 8, 64)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    topk_idx, weights = routing(T, K, E, device=device, seed=rank + T)
    link_rows = torch.tensor([int((topk_idx // (E // W) != rank).sum())], device=device)
    dist.all_reduce(link_rows)
    link = 2 * int(link_rows) / W * H * x.element_size()  # per rank, both directions of dispatch + combine
    gemm = shared_expert(T, H, F, device)
    rows = []
    for name in budgets:
        num_sms = None if name == "all" else int(name)
        bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device=device, num_sms=num_sms)

        def step(bufs=bufs):
            routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)
            return a2a.combine(routed, handle, weights)

        us = time_us(step, device)
        both = time_us(concurrently(step, gemm, device.type == "cuda"), device)
        gemm_us = time_us(gemm, device)
        rows.append(dict(W=W, budget=name, us=us, link_GBps=link / us / 1e3, gemm_us=gemm_us, both_us=both))
        say(f"W={W} budget {name:>4}: dispatch+combine {us:9.1f} us  link {link / us / 1e3:7.1f} GB/s  "
            f"GEMM {gemm_us:8.1f} us  both {both:9.1f} us  (both / max {both / max(us, gemm_us):.2f})")
        del bufs
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"bench_multigpu_budgets_W{W}.json"), "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    return rows


def bench_vdev2d(device) -> None:
    """torch's NVSHMEM all_to_all_vdev_2d (dispatch direction only), same shapes."""
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.set_backend("NVSHMEM")
    rank, W = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    for T, H, K, E in BENCH_SHAPES:
        e = E // W
        topk_idx, _ = routing(T, K, E, device=device, seed=rank + T)
        order = torch.argsort(topk_idx.reshape(-1), stable=True)
        counts = torch.bincount(topk_idx.reshape(-1), minlength=E)
        max_out = W * T * K
        inp = symm_mem.empty(T * K, H, dtype=torch.bfloat16, device=device)
        out = symm_mem.empty(max_out, H, dtype=torch.bfloat16, device=device)
        in_splits = symm_mem.empty(E, dtype=torch.int64, device=device)
        out_splits_offsets = symm_mem.empty((2, E), dtype=torch.int64, device=device)
        for t in (inp, out, in_splits, out_splits_offsets):
            symm_mem.rendezvous(t, name)
        in_splits.copy_(counts)
        inp.copy_(torch.randn(T, H, device=device, dtype=torch.bfloat16).index_select(0, order // K))

        args_ = (inp, out, in_splits, out_splits_offsets, name)
        us = time_us(lambda a=args_: torch.ops.symm_mem.all_to_all_vdev_2d(*a), device)
        received = int(out_splits_offsets[0].sum())
        say(f"W={W} T={T:5d} {'torch all_to_all_vdev_2d':>24} dispatch: {us:9.1f} us  logical "
            f"{received * H * 2 / us / 1e3:7.1f} GB/s (rank 0)  [e={e}]")


def init_ranks(cpu: bool) -> torch.device:
    """This torchrun rank's process group and device: NCCL on GPU LOCAL_RANK, or gloo on the CPU
    (``cpu``: a dry run)."""
    if cpu:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=120))
    return device


def leave_together() -> None:
    """A barrier before the process group goes, after a run that went well: rank 0 writes the
    results after the last collective, and a peer that tore its gloo connections down meanwhile
    aborted at exit now and then ("terminate called without an active exception": the dry run of
    ulysses_multigpu, about 1 in 10 under pytest). Not after an error: the others may not come."""
    dist.barrier()


def run_checks(checks: list[tuple[str, Callable[[], str]]], device: torch.device) -> int:
    """Run every check on every rank (a failure is reported and the next runs), print PASS only
    where all ranks passed, with the check's detail or the failing rank's traceback; returns the
    number failed."""
    failed = 0
    for name, fn in checks:
        try:
            detail, ok = fn(), 1
        except Exception:  # report, keep going: every check runs on every rank
            detail, ok = traceback.format_exc(limit=4), 0
        agreed = torch.tensor([ok], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        failed += int(agreed) == 0
        say(f"{'PASS' if int(agreed) else 'FAIL'} {name}: {detail}")
        if not ok:
            print(f"rank {dist.get_rank()}: {detail}", flush=True)
    return failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--vdev2d", action="store_true")
    parser.add_argument("--out", default="results")
    parser.add_argument("--budgets", nargs="+", metavar="SMS|all", help="SM budgets of the symm_mem exchange")
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU ranks (gloo, tiny shapes, no CUDA graph)")
    args = parser.parse_args(argv)
    device = init_ranks(args.cpu)
    failed = 0
    try:
        gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)"
        say(f"W={dist.get_world_size()} x {gpu}, torch {torch.__version__}")
        a2a.warmup()
        if args.vdev2d:
            bench_vdev2d(device)
            return 0
        if args.check:
            checks = [
                ("collective fp64", lambda: check_dispatch_combine("collective", torch.float64, device)),
                ("collective bf16", lambda: check_dispatch_combine("collective", torch.bfloat16, device)),
                ("symm_mem fp32", lambda: check_dispatch_combine("symm_mem", torch.float32, device)),
                ("symm_mem bf16", lambda: check_dispatch_combine("symm_mem", torch.bfloat16, device)),
                ("collective fp8", lambda: check_fp8("collective", device)),
                ("symm_mem fp8", lambda: check_fp8("symm_mem", device)),
                ("ulysses", lambda: check_ulysses(device)),
                ("compile collective", lambda: check_compile(device, "collective")),
                ("compile symm_mem", lambda: check_compile(device, "symm_mem")),
            ]
            if dist.get_world_size() % 2 == 0 and dist.get_world_size() >= 4:
                checks.append(("hierarchical", lambda: check_hierarchical(device)))
            if device.type == "cuda":
                checks.append(("compile symm_mem inlined", lambda: check_compile(device, "symm_mem", inline=True)))
                checks.append(("cuda graph symm_mem", lambda: check_cuda_graph(device)))
            failed = run_checks(checks, device)
        if args.bench:
            bench(device, args.out, BENCH_SHAPES if device.type == "cuda" else ((32, 128, 2, 8), (8, 128, 2, 8)))
        if args.budgets:
            bench_budgets(device, args.out, args.budgets)
        leave_together()
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
