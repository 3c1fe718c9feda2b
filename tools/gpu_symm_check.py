"""GPU checks of the symm_mem backend on a one-GPU host (torch 2.11, triton 3.6).

The kernels run compiled on the GPU with all peers simulated in one process (every rank's buffers
on the one device, reached through the same pointer table; one thread per rank queueing onto
one stream), and are compared with the collective backend, which runs on the CPU in W gloo
processes on the same inputs. Then: CUDA graph capture of dispatch + combine, replayed with new
routing; an fp8 payload (against the local backend's fp8 dispatch, then captured and replayed);
overflow='drop'; the overflow error as a device-side assert; torch.compile on this torch;
the signal-pad barrier kernel across two streams; timings of one rank at a DeepSeek-like size.

    python -m tools.gpu_symm_check                    # everything, a table at the end
    python -m tools.gpu_symm_check --quick            # the quick correctness checks only
    GPU_SYMM_DEVICE=cpu python -m tools.gpu_symm_check --quick   # a dry run here (Triton's interpreter)
    python -m pytest -m gpu tests/test_symm_mem_gpu.py   # every correctness check, one test each

Exact where the arithmetic is the same (moving rows, sums without products, single products);
the weighted sum may differ by the GPU's fused multiply-add (bound: one ulp of the output
dtype); the weights' gradient sums H products in another order (bound: relative 1e-5).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch

import alltoall_ops as a2a
from alltoall_ops import fp8
from alltoall_ops.backends import symm_mem
from alltoall_ops.backends.symm_mem import ops as symm_ops
from alltoall_ops.kernels import loader
from alltoall_ops.rows import weight_grad_op
from alltoall_ops.testing import DistributedPool, inline_symmetric, one_rank_group, timer

DEVICE = torch.device(os.environ.get("GPU_SYMM_DEVICE", "cuda:0"))  # "cpu": a dry run (interpreter)
ROWS: list[tuple[str, str, str]] = []


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _spec(seed: int, T: int = 48, H: int = 256, K: int = 4, E: int = 16, A: int = 2,
          dtype: torch.dtype = torch.bfloat16, w_dtype: torch.dtype = torch.float32) -> dict:
    return dict(seed=seed, T=T, H=H, K=K, E=E, A=A, dtype=dtype, w_dtype=w_dtype)


def make_inputs(spec: dict, rank: int, masked: Any = None):
    """Deterministic CPU inputs of one rank: x (T, H), topk_idx (T, K), weights (T, K), grad_y (T, H).
    T varies with the rank; masked: (t, k) slots to route nowhere."""
    g = torch.Generator().manual_seed(1000 * spec["seed"] + rank)
    T, H, K, E = spec["T"] + 3 * rank, spec["H"], spec["K"], spec["E"]
    x = torch.randn(T, H, generator=g).to(spec["dtype"])
    topk_idx = torch.randint(-1, E, (T, K), generator=g)
    if spec.get("crowd") is not None:
        topk_idx = topk_idx.clamp(max=spec["crowd"])
    weights = torch.rand(T, K, generator=g).to(spec["w_dtype"])
    grad_y = torch.randn(T, H, generator=g).to(spec["dtype"])
    for t, k in masked or ():
        topk_idx[t, k] = -1
    return x, topk_idx, weights, grad_y


def collective_reference(rank: int, world_size: int, spec: dict, masked: Any = None) -> dict:
    """The collective backend (gloo, CPU) with autograd: expert output = routed * 2 + 1."""
    x, topk_idx, weights, grad_y = make_inputs(spec, rank, None if masked is None else masked[rank])
    x, weights = x.requires_grad_(), weights.requires_grad_()
    routed, tpe, handle = a2a.dispatch(x, topk_idx, num_experts=spec["E"], backend="collective",
                                       expert_alignment=spec["A"])
    out = routed * 2 + 1
    y = a2a.combine(out, handle, weights)
    y1 = a2a.combine(out.detach(), handle)
    grad_x, grad_w = torch.autograd.grad(y, (x, weights), grad_y)
    # sum_k |terms|, the scale of the tolerance (in the dispatched dtype, as combine on a group requires)
    y_abs = a2a.combine(out.detach().abs(), handle, weights.detach().abs()).double()
    return dict(routed=routed.detach(), tpe=tpe, y=y.detach(), y1=y1, grad_x=grad_x, grad_w=grad_w, y_abs=y_abs)


def symm_rank(rank: int, bufs: symm_mem.SymmBuffers, inputs: tuple) -> dict:
    """Forward and the backward ops of one rank, called directly (one thread per simulated rank:
    the autograd engine would run every rank's backward on one device thread)."""
    x, topk_idx, weights, grad_y = inputs
    A = bufs.expert_alignment
    routed, tpe, h = a2a.dispatch(x, topk_idx, num_experts=bufs.num_experts, expert_alignment=A, buffers=bufs)
    out = routed * 2 + 1
    route = dict(row_src_C=h.row_src_C, **h.slots.kwargs())
    y, returned = symm_ops.symm_combine_op(out, weights, **route, save_returned=True)
    y1, _ = symm_ops.symm_combine_op(out, None, **route, save_returned=False)
    grad_out, _, _ = symm_ops.symm_dispatch_op(grad_y, weights, *h.slots)  # combine's adjoint
    grad_x, _ = symm_ops.symm_combine_op(grad_out * 2, None, **route, save_returned=False)  # dispatch's adjoint
    grad_w = weight_grad_op(grad_y, returned, h.position_TK, weights)
    return dict(routed=routed, tpe=tpe, y=y, y1=y1, grad_x=grad_x, grad_w=grad_w, dropped=h.dropped_W)


def compare(gpu: dict, ref: dict, capacity: int) -> str:
    """Raise on a mismatch; return a short account of the inexact comparisons."""
    g = {k: v.cpu() for k, v in gpu.items()}
    assert torch.equal(g["tpe"], ref["tpe"]), ("tokens_per_expert", g["tpe"], ref["tpe"])
    R = int(ref["tpe"].sum())
    assert g["routed"].shape[0] == capacity >= R
    assert torch.equal(g["routed"][:R], ref["routed"]), "routed rows"
    assert torch.equal(g["y1"], ref["y1"]), "unweighted combine"
    assert torch.equal(g["grad_x"], ref["grad_x"]), "grad_x"
    # A fused multiply-add skips one fp32 rounding per slot: |dy| <= K * eps32 * sum_k |terms|
    # before the final rounding, which may then differ by one ulp of y's dtype.
    y, y_ref = g["y"].double(), ref["y"].double()
    K = g["grad_w"].shape[1]
    bound = K * torch.finfo(torch.float32).eps * ref["y_abs"] + torch.finfo(ref["y"].dtype).eps * y_ref.abs()
    excess = ((y - y_ref).abs() - bound).max()
    assert excess <= 0, ("y beyond the FMA bound", float(excess))
    differ = int((g["y"] != ref["y"]).sum())
    torch.testing.assert_close(g["grad_w"], ref["grad_w"], rtol=1e-5, atol=1e-5)
    return f"y: {differ}/{y.numel()} elements differ (FMA), all within the bound"


def record(name: str, fn: Callable[[], str]) -> bool:
    t0 = time.time()
    try:
        detail = fn()
        ROWS.append((name, "ok", f"{detail} [{time.time() - t0:.1f}s]"))
    except Exception as exc:
        traceback.print_exc()
        ROWS.append((name, "FAIL", f"{type(exc).__name__}: {str(exc)[:300]}"))
    print("ROW", " | ".join(ROWS[-1]), flush=True)  # a later hang keeps what came before
    return ROWS[-1][1] == "ok"


def simulated_buffers(W: int, spec: dict, **kwargs) -> list[symm_mem.SymmBuffers]:
    return a2a.SymmBuffers.simulated(W, spec["T"] + 3 * (W - 1), spec["H"], spec["K"], spec["E"],
                                     dtype=spec["dtype"], device=DEVICE, expert_alignment=spec["A"], **kwargs)


def on_device(inputs: tuple) -> tuple:
    return tuple(t.to(DEVICE) for t in inputs)


def check_simulated(pool: DistributedPool, spec: dict) -> str:
    W = pool.world_size
    refs = pool.run(collective_reference, spec)
    bufs = simulated_buffers(W, spec)
    outs = symm_mem.run_simulated(lambda r, b: symm_rank(r, b, on_device(make_inputs(spec, r))), bufs)
    _sync()
    notes = [compare(o, ref, bufs[0].capacity) for o, ref in zip(outs, refs)]
    return f"W={W} {spec['dtype']} C={bufs[0].capacity} R={[int(r['tpe'].sum()) for r in refs]}; " + notes[0]


def _dropped_slots(topk_idxs: list, E: int, W: int, capacity: int) -> list:
    e = E // W
    dropped = [[] for _ in range(W)]
    for d in range(W):
        rows = [(s, t, k) for j in range(d * e, (d + 1) * e) for s in range(W)
                for t in range(topk_idxs[s].shape[0]) for k in range(topk_idxs[s].shape[1])
                if int(topk_idxs[s][t, k]) == j]
        for s, t, k in rows[capacity:]:
            dropped[s].append((t, k))
    return dropped


def check_drop(pool: DistributedPool) -> str:
    W, capacity = pool.world_size, 160
    spec = dict(_spec(7, A=1), crowd=5)  # crowd the low experts: rank 0 receives more than C
    idxs = [make_inputs(spec, r)[1] for r in range(W)]
    dropped = _dropped_slots(idxs, spec["E"], W, capacity)
    refs = pool.run(collective_reference, spec, dropped)
    bufs = simulated_buffers(W, spec, capacity=capacity, overflow="drop")
    outs = symm_mem.run_simulated(lambda r, b: symm_rank(r, b, on_device(make_inputs(spec, r))), bufs)
    for o, ref in zip(outs, refs):
        compare(o, ref, capacity)
    e = spec["E"] // W
    per_rank = [sum(1 for s in range(W) for t, k in dropped[s] if int(idxs[s][t, k]) // e == d) for d in range(W)]
    assert all(o["dropped"].cpu().tolist() == per_rank for o in outs), (per_rank, [o["dropped"] for o in outs])
    assert per_rank[0] > 0
    return f"W={W} C={capacity}: dropped {per_rank} rows, rest equal to the collective backend"


def replay_with_new_routings(bufs, rank_fn: Callable, static: list, specs: list, references: Callable,
                             compare_fn: Callable, rows_of: Callable) -> list[list[int]]:
    """Capture every rank's ``rank_fn(r, buffers, static[r])`` in one CUDA graph, then for each
    spec copy its inputs into ``static``, replay, and compare every rank's outputs with
    ``references(spec)``. Returns the rows each rank received, per replay."""
    W = len(bufs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    symm_mem.run_simulated(lambda r, b: rank_fn(r, b, static[r]), bufs, stream=stream)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="relaxed"):
        outs = symm_mem.run_simulated(lambda r, b: rank_fn(r, b, static[r]), bufs, stream=stream)
    replays = []
    for spec in specs:
        refs = references(spec)
        for r in range(W):
            for dst, src in zip(static[r], make_inputs(spec, r)):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for out, ref in zip(outs, refs):
            compare_fn(out, ref)
        replays.append([rows_of(ref) for ref in refs])
    return replays


def check_cuda_graph(pool: DistributedPool) -> str:
    """Capture every rank's dispatch + combine (+ backward ops) in one graph; replay with new routing."""
    W = pool.world_size
    specs = [_spec(20), _spec(21), _spec(22)]
    bufs = simulated_buffers(W, specs[0])
    static = [on_device(make_inputs(specs[0], r)) for r in range(W)]
    replays = replay_with_new_routings(
        bufs, symm_rank, static, specs[1:], lambda spec: pool.run(collective_reference, spec),
        lambda out, ref: compare(out, ref, bufs[0].capacity), lambda ref: int(ref["tpe"].sum()))
    return f"W={W}: captured once, replayed with 2 new routings (R per rank {replays}) = collective"


def fp8_reference(spec: dict, W: int, inputs: list | None = None) -> list[tuple]:
    """Every rank's (values, scales, tokens_per_expert) of an fp8 dispatch: the local backend (CPU)
    on all ranks' tokens (``inputs``, default ``make_inputs``) concatenated in rank order, cut
    into each rank's experts."""
    inputs = inputs or [make_inputs(spec, r) for r in range(W)]
    e = spec["E"] // W
    (values, scales), tpe, _ = a2a.dispatch(torch.cat([i[0] for i in inputs]), torch.cat([i[1] for i in inputs]),
                                            num_experts=spec["E"], backend="local", expert_alignment=spec["A"],
                                            payload_dtype=fp8.FP8)
    out, start = [], 0
    for r in range(W):
        n = int(tpe[r * e : (r + 1) * e].sum())
        out.append((values[start : start + n], scales[start : start + n], tpe[r * e : (r + 1) * e]))
        start += n
    return out


def fp8_rank(rank: int, bufs: symm_mem.SymmBuffers, inputs: tuple) -> dict:
    x, topk_idx = inputs[:2]
    (values, scales), tpe, _ = a2a.dispatch(x, topk_idx, num_experts=bufs.num_experts,
                                            expert_alignment=bufs.expert_alignment, buffers=bufs,
                                            payload_dtype=fp8.FP8)
    dequantized, _, _ = a2a.dispatch(x, topk_idx, num_experts=bufs.num_experts, expert_alignment=bufs.expert_alignment,
                                     buffers=bufs, payload_dtype=fp8.FP8, dequantize=True)  # in the pull
    return dict(values=values, scales=scales, tpe=tpe, dequantized=dequantized)


def compare_fp8(out: dict, ref: tuple) -> None:
    values, scales, tpe = ref
    R = values.shape[0]
    assert torch.equal(out["tpe"].cpu(), tpe), ("tokens_per_expert", out["tpe"], tpe)
    assert torch.equal(out["values"][:R].cpu().view(torch.uint8), values.view(torch.uint8)), "fp8 values"
    assert torch.equal(out["scales"][:R].cpu(), scales), "fp8 scales"
    dequantized = out["dequantized"][:R].cpu()
    assert torch.equal(dequantized, fp8.dequantize(values, scales, dequantized.dtype)), "fp8 rows dequantized"


def check_fp8() -> str:
    """fp8 payload, simulated W=2: values and scales (the quantize kernel, packed wire rows) equal
    the local backend's fp8 dispatch bit for bit, and a dispatch with ``dequantize=True`` (the
    pull dequantizes) their ``fp8.dequantize``; on CUDA every rank's fp8 dispatch is then
    captured in one graph and replayed with new tokens and routing."""
    W = 2
    specs = [_spec(60), _spec(61), _spec(62)]
    bufs = simulated_buffers(W, specs[0], payload_dtype=fp8.FP8)
    static = [on_device(make_inputs(specs[0], r)) for r in range(W)]
    outs = symm_mem.run_simulated(lambda r, b: fp8_rank(r, b, static[r]), bufs)
    _sync()
    for o, ref in zip(outs, fp8_reference(specs[0], W)):
        compare_fp8(o, ref)
    detail = f"W={W} C={bufs[0].capacity}: eager = local fp8"
    if DEVICE.type != "cuda":
        return detail
    replays = replay_with_new_routings(bufs, fp8_rank, static, specs[1:], lambda spec: fp8_reference(spec, W),
                                       compare_fp8, lambda ref: ref[0].shape[0])
    return f"{detail}; captured once, replayed with 2 new routings (R per rank {replays}) = local fp8"


def check_compile() -> str:
    from alltoall_ops.inspect import CompiledGraphs, capturing_backend

    bufs = a2a.SymmBuffers(16, 64, 2, 8, dtype=torch.bfloat16, device=DEVICE, expert_alignment=2)
    details = []
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()

        def step(x, topk_idx, weights):
            routed, tpe, h = a2a.dispatch(x, topk_idx, num_experts=8, expert_alignment=2, buffers=bufs)
            return a2a.combine(routed * 2 + 1, h, weights)

        graphs = CompiledGraphs()
        compiled = torch.compile(step, backend=capturing_backend(graphs, backend), fullgraph=True)
        for seed in range(2):
            spec = _spec(30 + seed, T=16, H=64, K=2, E=8)
            x, topk_idx, weights, grad_y = on_device(make_inputs(spec, 0))
            res = []
            for fn in (compiled, step):
                xx, ww = x.clone().requires_grad_(), weights.clone().requires_grad_()
                y = fn(xx, topk_idx, ww)
                res.append((y, *torch.autograd.grad(y, (xx, ww), grad_y)))
            assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
            torch.testing.assert_close(res[0][2], res[1][2], rtol=1e-5, atol=1e-5)
        assert (len(graphs.forward), len(graphs.backward)) == (1, 1), (len(graphs.forward), len(graphs.backward))
        details.append(f"{backend}: 1 fw + 1 bw graph over 2 routings")
    summary = graphs.summary().splitlines()
    return "; ".join(details) + f"; {summary[1].strip()}"


def check_overflow_assert() -> str:
    """Overflow on CUDA: the placement kernel's own device-side assert, naming the overflow, eager
    and compiled (no assert kernel of its own; inductor compiles the kernel with its asserts)."""
    seen = []
    rows = "lambda x, idx, **kw: a2a.dispatch(x, idx, **kw)[0]"
    for how, call in (("eager", f"({rows})"), ("compiled", f"torch.compile({rows}, fullgraph=True)")):
        code = (
            "import torch, alltoall_ops as a2a\n"
            "b = a2a.SymmBuffers(4, 8, 2, 2, dtype=torch.float32, device='cuda', capacity=3)\n"
            "x = torch.randn(4, 8, device='cuda'); idx = torch.zeros(4, 2, dtype=torch.int64, device='cuda')\n"
            f"{call}(x, idx, num_experts=2, buffers=b)\n"
            "print('queued without a host sync', flush=True)\n"
            "torch.cuda.synchronize()\n"
            "print('NO ERROR')\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
        assert "NO ERROR" not in out.stdout and out.returncode != 0, (how, out.stdout, out.stderr[-800:])
        assert "device-side assert" in out.stderr, (how, out.stderr[-800:])
        assert "a metadata check failed: overflow" in out.stderr, (how, out.stderr[-1500:])
        seen.append(f"{how} {'at the sync' if 'queued without a host sync' in out.stdout else 'at a later launch'}")
    return f"overflow surfaced as the placement's device-side assert, {', '.join(seen)}"


def check_barrier_streams() -> str:
    """The signal-pad barrier kernel with two 'ranks' on two streams of one GPU: a write queued
    before the barrier on stream 0 is seen by a read queued after it on stream 1."""
    k = loader.load()
    W = 2
    pads = torch.zeros(W, W, dtype=torch.int32, device=DEVICE)
    table = torch.tensor([pads[r].data_ptr() for r in range(W)], dtype=torch.int64, device=DEVICE)
    data = torch.zeros(1 << 24, device=DEVICE)
    seen = torch.empty_like(data)
    streams = [torch.cuda.Stream() for _ in range(W)]
    call_1 = torch.ones(1, dtype=torch.int64, device=DEVICE)  # both ranks in the same op and call
    data.fill_(0.0)
    seen.copy_(data)  # first launches (module loads) before any barrier spins
    done = threading.Event()
    threading.Thread(target=lambda: done.wait(60) or os._exit(3), daemon=True).start()  # a hang ends the run
    try:
        torch.cuda.synchronize()
        for it in range(50):
            with torch.cuda.stream(streams[0]):
                data.fill_(float(it + 1))
                k.barrier(table, 0, 60.0, 1, call_1)
            with torch.cuda.stream(streams[1]):
                k.barrier(table, 1, 60.0, 1, call_1)
                seen.copy_(data)
            torch.cuda.synchronize()
            assert bool((seen == it + 1).all()), it
    finally:
        done.set()  # a failure that did not hang reports as one
    assert not pads.any()
    return "50 rounds, flags back to 0, writes before the barrier visible after it"


def check_bf16_rounding() -> str:
    """Scaled rows (combine's backward): fp32 products rounded once to bf16, as torch rounds them,
    including NaN, infinities, ties, overflow to inf and subnormals."""
    T, k, H = 64, 2, 256
    g = torch.Generator().manual_seed(5)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.0e38, 1e-40, -1e-39])
    x = torch.randn(T, H, generator=g)
    x[: len(special), 0] = special
    x = x.to(torch.bfloat16).to(DEVICE)
    scale = (torch.rand(T, k, generator=g) * 4 - 2)
    scale[:4] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 2.0, -1.5])[:, None]
    scale = scale.to(DEVICE)
    bufs = a2a.SymmBuffers(T, H, k, 1, dtype=torch.bfloat16, device=DEVICE)
    _, _, h = a2a.dispatch(x, torch.zeros(T, k, dtype=torch.int64, device=DEVICE), num_experts=1, buffers=bufs)
    routed, _, _ = symm_ops.symm_dispatch_op(x, scale, *h.slots)
    order = torch.argsort(h.position_TK.reshape(-1))  # send position i holds slot order[i]
    expected = (x.float()[order // k] * scale.reshape(-1)[order, None]).to(torch.bfloat16)
    torch.testing.assert_close(routed, expected, rtol=0, atol=0, equal_nan=True)
    return f"{routed.numel()} products bit-equal to torch's, special values included"


def check_symmetric_memory_one_rank() -> str:
    """torch.distributed._symmetric_memory (empty + rendezvous) in a one-rank NCCL group: the
    allocator of real multi-GPU runs and the ops' path with peers (signal-pad barrier kernels,
    the metadata put, tags, the stage), against the local backend: eager, then compiled with
    those ops inlined (``ALLTOALL_OPS_INLINE_SYMMETRIC=1``: inductor launches every kernel,
    barriers included), forward and backward."""
    import re

    from torch._inductor.utils import run_and_get_code

    with one_rank_group(DEVICE):
        with inline_symmetric():  # read while the graphs are traced (the default; explicit here)
            spec = _spec(50, T=40, H=128)
            E, A = spec["E"], spec["A"]
            bufs = a2a.SymmBuffers(spec["T"], spec["H"], spec["K"], E, dtype=spec["dtype"], device=DEVICE,
                                   expert_alignment=A, allocator="symmetric")
            assert type(bufs._segments).__name__ == "_CudaSymmetricSegments" and bufs.peer_path

            def forward(x, topk_idx, weights, backend, buffers):
                routed, tpe, h = a2a.dispatch(x, topk_idx, num_experts=E, expert_alignment=A, backend=backend,
                                              buffers=buffers)
                return a2a.combine(routed * 2, h, weights), tpe

            def step(fn, x, topk_idx, weights, backend, buffers=None):
                x, weights = x.detach().requires_grad_(), weights.detach().requires_grad_()
                y, tpe = fn(x, topk_idx, weights, backend, buffers)
                return y, tpe, torch.autograd.grad(y.float().square().sum(), (x, weights))

            compiled = torch.compile(forward, fullgraph=True)
            codes: list[str] = []
            for seed in (50, 51):
                x, topk_idx, weights, _ = on_device(make_inputs(_spec(seed, T=40, H=128), 0))
                want = step(forward, x, topk_idx, weights, "local")
                eager = step(forward, x, topk_idx, weights, "symm_mem", bufs)
                if seed == 50:  # the forward's and the backward's code
                    got, codes = run_and_get_code(step, compiled, x, topk_idx, weights, "symm_mem", bufs)
                else:
                    got = step(compiled, x, topk_idx, weights, "symm_mem", bufs)
                for name, a, b, c in zip(("y", "tokens_per_expert"), want, eager, got):
                    assert torch.equal(a, b) and torch.equal(a, c), name
                for a, b, c in zip(want[2], eager[2], got[2]):
                    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-5)
            # two exchanges of independent inputs on one buffers object in one graph: their kernels must
            # not interleave (the second post would overwrite the stage the first pull reads)
            inputs = [on_device(make_inputs(_spec(seed, T=40, H=128), 0))[:3] for seed in (52, 53)]
            pair = torch.compile(lambda a, b: [forward(*i, "symm_mem", bufs)[0] for i in (a, b)], fullgraph=True)
            for got, i in zip(pair(*inputs), inputs):
                assert torch.equal(got, forward(*i, "local", None)[0]), "two exchanges on one buffers interleaved"
            torch.cuda.synchronize()
            # every program of a kernel with a fused barrier counted itself once, and the last reset the count
            assert int(bufs._segments._done_1) == 0, f"fused barriers' count of done programs: {bufs._segments._done_1}"
            assert not [c for c in codes if "alltoall_ops.symm_" in c], "a symm_mem op is still called, not inlined"
            barriers = [len(re.findall(r"\b_barrier_kernel_\d+\.run\(", c)) for c in codes]
            launches = [len(re.findall(r"\.run\(", c)) for c in codes]
            # no barrier kernel of its own: every barrier is the epilogue of the kernel before it (after the
            # writes, after the reads; the metadata exchange's two in its put); T * K = 160 slots: the put's
            # program plans them (no plan kernel of its own)
            assert barriers == [0, 0], barriers
            assert not re.search(r"\b_(plan_in_one_program|block_counts)_kernel_\d+\.run\(", codes[0]), "a plan launch"
            return (f"C={bufs.capacity}: 2 routings equal to the local backend, eager and compiled with the ops "
                    f"inlined, and two independent exchanges in one graph; inductor's code per graph (forward, "
                    f"backward): {launches} launches, of which barriers {barriers}")


def check_timing() -> str:
    """One rank (no peers) at T=4096, H=7168, K=8, E=256, bf16: the kernels' cost alone."""
    T, H, K, E = 4096, 7168, 8, 256
    bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(T, H, device=DEVICE, generator=g).to(torch.bfloat16)
    topk_idx = torch.rand(T, E, device=DEVICE, generator=g).topk(K, dim=1).indices
    weights = torch.rand(T, K, device=DEVICE, generator=g)
    routed, _, h = a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)
    time_us = timer(DEVICE)
    t_dispatch = time_us(lambda: a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs))
    t_combine = time_us(lambda: a2a.combine(routed, h, weights))
    static = {}

    def step():
        r, _, hh = a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)
        static["y"] = a2a.combine(r, hh, weights)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    t_graph = time_us(graph.replay)
    y_ref = a2a.combine(*a2a.dispatch(x, topk_idx, num_experts=E, backend="local")[::2], weights)
    graph.replay()
    torch.cuda.synchronize()
    differ = int((static["y"] != y_ref).sum())
    nbytes_row = H * 2
    dispatch_bytes = 2 * T * K * nbytes_row  # one rank: each routed row read from x and written once (pull_rows)
    combine_bytes = 3 * T * K * nbytes_row + T * nbytes_row  # read + write peers, reduce read, y
    return (f"dispatch {t_dispatch:.0f} us ({dispatch_bytes / t_dispatch / 1e6:.2f} TB/s), combine "
            f"{t_combine:.0f} us ({combine_bytes / t_combine / 1e6:.2f} TB/s), graph replay of both "
            f"{t_graph:.0f} us; y vs local backend: {differ} elements differ (FMA)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="correctness checks only")
    args = parser.parse_args(argv)
    import triton

    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "CPU dry run"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {where}", flush=True)
    ROWS.clear()
    cuda = DEVICE.type == "cuda"
    with DistributedPool(2) as pool2:
        record("simulated W=2 bf16", lambda: check_simulated(pool2, _spec(1)))
        if not args.quick:
            record("simulated W=2 fp32", lambda: check_simulated(pool2, _spec(2, dtype=torch.float32)))
        if cuda:
            record("cuda graph W=2", lambda: check_cuda_graph(pool2))
        if not args.quick:
            record("overflow='drop' W=2", lambda: check_drop(pool2))
    if not args.quick:
        with DistributedPool(4) as pool4:
            record("simulated W=4 bf16", lambda: check_simulated(pool4, _spec(3, A=3)))
            if cuda:
                record("cuda graph W=4", lambda: check_cuda_graph(pool4))
    record("bf16 rounding", check_bf16_rounding)
    record("fp8 W=2", check_fp8)
    record("torch.compile W=1", check_compile)
    if cuda:
        record("symmetric memory W=1", check_symmetric_memory_one_rank)
    if not args.quick and cuda:
        record("overflow error", check_overflow_assert)
        record("timing W=1", check_timing)
        record("barrier kernel", check_barrier_streams)  # last: a hang ends the run
    width = max(len(name) for name, _, _ in ROWS)
    print("\n" + "\n".join(f"{name:<{width}}  {status:<4}  {detail}" for name, status, detail in ROWS))
    failed = [name for name, status, _ in ROWS if status != "ok"]
    print("PASS" if not failed else f"FAIL: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
