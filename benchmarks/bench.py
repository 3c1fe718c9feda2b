"""Benchmark of dispatch / combine against plain PyTorch and the byte floor (``make bench``).

    python -m benchmarks.bench [--out results] [--shapes 4096 128] [--skip 'symm.w8*' '*.compile']
    python -m benchmarks.bench --smoke                    # CPU: tiny shapes, labelled; times mean nothing
    python -m benchmarks.bench --replot results/bench_gpu.json     # markdown + PNG from saved numbers

For each shape (T, H, K, E), bf16, with fresh random top-k routing (K distinct experts per token,
softmax weights), rows of (impl, op); ``--skip`` takes these names (shell patterns):

- ``torch`` / ``torch.compile``: the usual argsort + index_select dispatch and fp32 ``index_add_``
  combine, eager / under ``torch.compile``;
- ``local`` / ``local.compile``: this library's dispatch (routing plan + metadata + payload) and
  combine, ``backend="local"`` (W = 1), eager / compiled;
- ``layout`` / ``layout.compile`` / ``layout.compile.graph``: the layout step alone (routing ->
  send order, destination rows, tokens per expert), eager / compiled / compiled and replayed
  from a CUDA graph (its GPU time without launch costs);
- ``fp8`` (rows ``torch.fp8``, ``local.fp8``, ``local.fp8.compile``): dispatch with an fp8 payload
  (``payload_dtype=torch.float8_e4m3fn``: quantize in the row put, 128-channel fp32 scales) against
  the same by hand (``fp8.quantize``, then argsort + gather of values and scales); floor: read x
  once, write T*K rows of H + 4H/128 bytes;
- ``dispatch_layout`` (rows ``torch.dispatch_layout``, ``dispatch_layout``,
  ``dispatch_layout.graph``): DeepEP's dispatch layout for W = 8 ranks on 2 nodes, the op (a Triton
  kernel on CUDA) against its torch-ops reference, eager and replayed from a CUDA graph;
- ``symm.w1`` / ``symm.w1.compile``: ``backend="symm_mem"`` with one rank (``SymmBuffers``, no
  peers), eager / compiled; ``symm.w1.graph``: its dispatch + combine captured in one CUDA graph
  and replayed (the decode-latency number; op ``dispatch+combine``); ``symm.w1.compile.graph``:
  the same step compiled (inductor fuses the layout maths), then captured and replayed;
- ``symm.w2`` / ``symm.w4`` / ``symm.w8``: the symm_mem kernels with W ranks simulated in one
  process on the one GPU (``SymmBuffers.simulated``, one thread per rank), each rank holding T
  tokens; every rank's dispatch (and separately every rank's combine) captured in one CUDA graph,
  whose replay is timed (label ``symm.wW.graph``): one step of all W ranks together; then the
  same dispatch with an fp8 payload (``symm.wW.fp8.graph``, skip it as ``symm.wW.fp8``), checked
  bit for bit against the local fp8 dispatch of all ranks' tokens, and fp8 training's dispatch
  (``symm.wW.fp8.dequantize.graph``: fp8 on the wire, bf16 rows out, ``dequantize=True``; floor
  the bf16 dispatch's), checked against ``fp8.dequantize`` of the same rows. Where the
  default capacity C = W*T*K rows per rank would not fit in ``--symm-mem-gb``, C = 2*T*K (twice
  the expected load of random routing) with overflow='error', and the label says ``(C=2TK)``.

``--smoke`` (CPU): tiny shapes, the kernels in Triton's interpreter; there are no CUDA graphs, so
the graph rows run eagerly through the same code path (an emulated replay: re-run, copy into the
captured outputs) and are labelled ``symm.w1.eager(cpu)`` / ``symm.wW.eager(cpu)``.

Checks before timing: local == argsort reference (routed exactly, y within bf16 rounding);
compiled == eager; symm W=1 == local (first ``tokens_per_expert.sum()`` rows exactly, the rest
unspecified, y within bf16 rounding); symm W>1 == what the collective backend gives (computed in one
process: the local backend on all ranks' tokens concatenated, whose expert-major rows are every
destination rank's rows in rank order), eagerly and again from the graph replay; combine is
checked with expert outputs that differ per row.

Bytes (``bytes_logical``): dispatch reads x once and writes T*K rows, ``(T + T*K) * H * 2``;
combine reads T*K rows and writes T rows, the same count; summed over ranks for W > 1.
``bytes_peer``: rows whose destination rank is not their source rank (W > 1), times H * 2.
The floor is bytes_logical at the device-to-device copy bandwidth measured in the same run
(bytes read + written over the time of a 1 GiB copy); simulated peers share one GPU, so peer
bytes go through the same HBM. Timing: medians of ``triton.testing.do_bench`` (CUDA events)
after warm-up. Compile time (first call) is excluded and reported separately. torch.compile runs
with ``dynamic=False`` (one static graph per shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import functools
import gc
import json
import os
import platform
import shlex
import sys
import time
import traceback
from typing import Callable, Optional

import torch

import alltoall_ops as a2a
from alltoall_ops import SymmBuffers, fp8, layout
from alltoall_ops.backends.symm_mem import run_simulated
from alltoall_ops.moe import MoE
from alltoall_ops.testing import routing, timer

SHAPES = ((4096, 7168, 8, 256), (128, 7168, 8, 256), (8192, 7168, 8, 256), (16384, 4096, 8, 128))
"""The issue's shapes, the decode shape second (run in this order: a --deadline-s cut drops the last)."""
SMOKE_SHAPES = ((64, 128, 2, 8), (16, 128, 4, 8))  # H = 128: the fp8 rows need H % 128 == 0
SMOKE_MOE_SHAPE = (64, 32, 48, 8, 2)
PEERS = (2, 4, 8)
IMPLS = ("torch", "torch.compile", "layout", "layout.compile", "local", "local.compile", "fp8", "dispatch_layout",
         "symm.w1", "symm.w1.compile", "symm.w1.graph", "symm.w1.compile.graph", *(f"symm.w{w}" for w in PEERS),
         "moe", "moe.compile")
MOE_SHAPE = (4096, 2048, 1408, 64, 6)
"""(T, H, F, E, K) of the MoE-layer rows: a DeepSeek-V2-Lite-sized layer, SwiGLU experts."""
DTYPE = torch.bfloat16


@dataclasses.dataclass
class Row:
    shape: tuple[int, int, int, int]
    impl: str
    op: str
    us: float
    floor_us: float
    bytes_logical: int = 0
    bytes_peer: int = 0

    @property
    def ratio(self) -> float:
        return self.us / self.floor_us


def tokens(T: int, H: int, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(T, H, device=device, generator=gen).to(DTYPE)


# --- plain PyTorch baseline -----------------------------------------------------------------


def torch_dispatch(x: torch.Tensor, topk_idx: torch.Tensor):
    """argsort + gather: (T, H) -> (T*K, H) rows grouped by expert, and the sort order."""
    order = torch.argsort(topk_idx.reshape(-1), stable=True)
    return x.index_select(0, order // topk_idx.shape[1]), order


def torch_combine(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, T: int):
    """fp32 index_add_ of weighted rows back to their tokens."""
    K = weights.shape[1]
    rows = expert_out.float() * weights.reshape(-1)[order].float()[:, None]
    out = torch.zeros(T, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    return out.index_add_(0, order // K, rows).to(expert_out.dtype)


# --- this library ---------------------------------------------------------------------------


def ours_dispatch(x, topk_idx, num_experts: int):
    return a2a.dispatch(x, topk_idx, num_experts=num_experts, backend="local")


def ours_combine(expert_out, handle, weights):
    return a2a.combine(expert_out, handle, weights)


def ours_layout(topk_idx, num_experts: int):
    """The local backend's layout step alone (W = 1): routing -> each row's slot, each slot's
    row, tokens per expert (``layout.plan_rows``)."""
    plan = layout.plan_rows(topk_idx, num_experts, 1)
    return plan.row_src, plan.row, plan.tokens_per_expert


def torch_fp8_dispatch(x: torch.Tensor, topk_idx: torch.Tensor):
    """What a user writes by hand for an fp8 dispatch: quantize per token (``fp8.quantize``),
    then argsort + gather of the values and of the scales."""
    values, scales = fp8.quantize(x)
    order = torch.argsort(topk_idx.reshape(-1), stable=True)
    token = order // topk_idx.shape[1]
    return values.view(torch.uint8).index_select(0, token).view(fp8.FP8), scales.index_select(0, token)


def ours_fp8_dispatch(x, topk_idx, num_experts: int):
    return a2a.dispatch(x, topk_idx, num_experts=num_experts, backend="local", payload_dtype=fp8.FP8)


LAYOUT_W, LAYOUT_NODES = 8, 2
"""The rank and node counts the dispatch-layout rows count for (EP8 on 2 nodes of 4)."""


def ours_dispatch_layout(topk_idx, num_experts: int):
    return layout.dispatch_layout_op(topk_idx, num_experts, LAYOUT_W, LAYOUT_NODES)


def torch_dispatch_layout(topk_idx, num_experts: int):
    """The same counts in plain torch ops (scatter_add_ / scatter_reduce_ / amax)."""
    return layout._dispatch_layout_torch(topk_idx, num_experts, LAYOUT_W, LAYOUT_NODES)


# --- checks ---------------------------------------------------------------------------------


def row_offsets(num_rows: int, rank: int, like: torch.Tensor) -> torch.Tensor:
    """(num_rows, 1) small exact values, different from row to row: added to routed rows they
    make expert outputs that tell a token's K slots apart (same arithmetic in both paths)."""
    i = torch.arange(num_rows, device=like.device)
    return (((i * 7 + rank * 13) % 61 - 30).to(like.dtype) / 8)[:, None]


def check_routed(what: str, routed: torch.Tensor, tpe: torch.Tensor, ref_rows: torch.Tensor,
                 ref_tpe: torch.Tensor) -> None:
    """tokens_per_expert equal; the first R rows equal the reference exactly (symm_mem: the rows
    past them are unspecified, not written by the pull, and not checked)."""
    R = int(ref_tpe.sum())
    if not torch.equal(tpe.cpu(), ref_tpe.cpu()):
        raise AssertionError(f"{what}: tokens_per_expert {tpe.tolist()} != reference {ref_tpe.tolist()}")
    if routed.shape[0] < R or not torch.equal(routed[:R], ref_rows):
        raise AssertionError(f"{what}: routed rows differ from the reference ({routed.shape[0]} rows, "
                             f"R = {R})")


def check_y(what: str, y: torch.Tensor, y_ref: torch.Tensor) -> int:
    """Within bf16 rounding of the fp32 top-k sum (the order of additions and fused multiply-adds
    may differ): |y - y_ref| <= 1e-4 + 1e-2 |y_ref| (one bf16 ulp is at most 2^-7 |y|).
    Returns how many elements differ at all."""
    if y.shape != y_ref.shape:
        raise AssertionError(f"{what}: y has shape {tuple(y.shape)}, the reference {tuple(y_ref.shape)}")
    diff = (y.float() - y_ref.float()).abs()
    bad = int((diff > 1e-4 + 1e-2 * y_ref.float().abs()).sum())
    if bad:
        raise AssertionError(f"{what}: {bad} elements of y beyond bf16 rounding "
                             f"(max |diff| {float(diff.max()):.3g})")
    return int((y != y_ref).sum())


# --- timing ---------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, time_us) -> float:
    """Bytes read + written per second of a large device-to-device copy."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src))
    return 2 * n / (us * 1e-6)


class Bench:
    """One run: timer, bandwidth, rows, notes, failures; each implementation a guarded section."""

    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.args, self.device = args, device
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.time_us = timer(device)
        self.bandwidth = copy_bandwidth(device, self.time_us)
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.failures: list[str] = []
        self.compile_s: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"NOTE {text}", flush=True)

    def skipped(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.args.skip for name in aliases(key))

    def section(self, shape, key: str, fn: Callable[[], None]) -> None:
        """Run one implementation's checks and timings; a failure is recorded, the run goes on."""
        if self.skipped(key):
            return
        if self.args.deadline_s and self.elapsed() > self.args.deadline_s:
            self.note(f"{shape} {key}: not run, past --deadline-s {self.args.deadline_s:g}")
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported in the table and the exit status
            traceback.print_exc(limit=6)
            self.failures.append(f"{shape} {key}: {type(exc).__name__}: {str(exc)[:300]}")
            print(f"FAIL {self.failures[-1]}", flush=True)
        self.free()
        print(f"  [{key}: {time.perf_counter() - t0:.1f} s; {self.elapsed():.0f} s so far]", flush=True)

    def first_call(self, label: str, fn: Callable[[], object]):
        """Call a compiled fn once (compiles it); the seconds go to compile_s, not to the rows."""
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        self.compile_s[label] = round(time.perf_counter() - t0, 2)
        print(f"  compile {label}: {self.compile_s[label]:.1f} s", flush=True)
        return out

    def measure(self, shape, impl: str, op: str, fn: Callable[[], object], nbytes: int,
                peer: int = 0) -> None:
        us = self.time_us(fn)
        row = Row(tuple(shape), impl, op, us, nbytes / self.bandwidth * 1e6, int(nbytes), int(peer))
        self.rows.append(row)
        print(f"{row.shape} {impl:>24} {op:>16}: {us:10.1f} us  floor {row.floor_us:8.1f}  "
              f"x{row.ratio:.2f}", flush=True)


def aliases(key: str) -> tuple[str, ...]:
    """Names --skip matches: the key, and for simulated peers also ``symm.wW.graph``."""
    peers = key.startswith("symm.w") and key != "symm.w1" and "." not in key[len("symm."):]
    return (key, f"{key}.graph") if peers else (key,)


def compile_fn(fn, backend: str, **kwargs):
    return torch.compile(fn, backend=backend, dynamic=False, **kwargs)


def _copy_into(static, fresh) -> None:
    """Copy a fresh result into a static one of the same structure (tensors, tuples/lists,
    dataclasses such as dispatch handles); everything else (ints, buffers) is left alone."""
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    elif isinstance(static, (tuple, list)):
        for a, c in zip(static, fresh):
            _copy_into(a, c)
    elif dataclasses.is_dataclass(static):
        for field in dataclasses.fields(static):
            _copy_into(getattr(static, field.name), getattr(fresh, field.name))


class Captured:
    """``fn(stream)`` captured in a CUDA graph: ``outs`` are its static outputs, ``replay()``
    re-runs the captured work into them. Warm-up first, on the capture stream. ``relaxed``: the
    capture mode for work queued by several threads (simulated ranks).

    Without CUDA (``--smoke``) a stand-in runs the same code path: capture calls fn once,
    replay calls it again and copies the result into ``outs``, as a replay overwrites them."""

    def __init__(self, fn: Callable[[Optional[torch.cuda.Stream]], object], cuda: bool,
                 relaxed: bool = False):
        self.fn, self.graph = fn, None
        if not cuda:
            self.outs = fn(None)
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(stream)  # warm-up: nothing lazy may happen during capture
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        self.graph = torch.cuda.CUDAGraph()
        mode = "relaxed" if relaxed else "global"
        with torch.cuda.graph(self.graph, stream=stream, capture_error_mode=mode):
            self.outs = fn(stream)

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            _copy_into(self.outs, self.fn(None))

    def run(self):
        """Replay, wait, and return the outputs (for the checks)."""
        self.replay()
        if self.graph is not None:
            torch.cuda.synchronize()
        return self.outs


# --- one shape: W = 1 -----------------------------------------------------------------------


def bench_shape(b: Bench, shape) -> None:
    """torch, local and symm_mem at W = 1, eager / compiled / graph, each checked, then timed."""
    T, H, K, E = shape
    dev, backend = b.device, b.args.compile_backend
    compiled = backend != "none"
    torch._dynamo.reset()  # one static compilation per function and shape
    x = tokens(T, H, dev, seed=T + H)
    topk_idx, weights = routing(T, K, E, device=dev, seed=T + H + 1)
    nbytes = (T + T * K) * H * x.element_size()

    # Both implementations against each other before timing (same grouping at W = 1).
    routed, tpe, handle = ours_dispatch(x, topk_idx, E)
    routed_ref, order = torch_dispatch(x, topk_idx)
    assert torch.equal(routed, routed_ref), "local dispatch differs from the argsort reference"
    expert_out = torch.randn_like(routed)
    y = ours_combine(expert_out, handle, weights)
    y_ref = torch_combine(expert_out, order, weights, T)
    check_y("local combine vs index_add", y, y_ref)

    def torch_eager():
        b.measure(shape, "torch", "dispatch", lambda: torch_dispatch(x, topk_idx), nbytes)
        b.measure(shape, "torch", "combine", lambda: torch_combine(expert_out, order, weights, T), nbytes)

    def torch_compiled():
        td, tc = compile_fn(torch_dispatch, backend), compile_fn(torch_combine, backend)
        r, o = b.first_call(f"{shape} torch.compile dispatch", lambda: td(x, topk_idx))
        assert torch.equal(r, routed_ref) and torch.equal(o, order), "compiled torch dispatch != eager"
        yc = b.first_call(f"{shape} torch.compile combine", lambda: tc(expert_out, order, weights, T))
        check_y("compiled torch combine", yc, y_ref)
        b.measure(shape, "torch.compile", "dispatch", lambda: td(x, topk_idx), nbytes)
        b.measure(shape, "torch.compile", "combine", lambda: tc(expert_out, order, weights, T), nbytes)

    layout_ref = ours_layout(topk_idx, E)
    layout_bytes = topk_idx.numel() * topk_idx.element_size() * 3  # read ids, write order + position

    def layout_eager():
        b.measure(shape, "layout", "layout", lambda: ours_layout(topk_idx, E), layout_bytes)

    def layout_compiled():
        cl = compile_fn(ours_layout, backend, fullgraph=True)
        out = b.first_call(f"{shape} layout.compile", lambda: cl(topk_idx, E))
        assert all(torch.equal(a, r) for a, r in zip(out, layout_ref)), "compiled layout != eager"
        b.measure(shape, "layout.compile", "layout", lambda: cl(topk_idx, E), layout_bytes)
        if b.cuda:  # the same compiled code replayed from a CUDA graph: no host launch costs
            graph = Captured(lambda _stream: cl(topk_idx, E), b.cuda)
            assert all(torch.equal(a, r) for a, r in zip(graph.run(), layout_ref)), "layout graph != eager"
            b.measure(shape, "layout.compile.graph", "layout", graph.replay, layout_bytes)

    # fp8: a row is H + 4 H / 128 bytes; the floor reads x (bf16) once and writes T*K fp8 rows.
    fp8_bytes = T * H * x.element_size() + T * K * fp8.packed_width(H)

    def fp8_rows():
        (values, scales), t, _ = ours_fp8_dispatch(x, topk_idx, E)
        assert torch.equal(t, tpe), "fp8 dispatch: tokens_per_expert differ"
        ref_values, ref_scales = torch_fp8_dispatch(x, topk_idx)
        assert torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8)), "fp8 values != torch reference"
        assert torch.equal(scales, ref_scales), "fp8 scales != torch reference"
        err = (fp8.dequantize(values, scales, torch.float32) - routed.float()).abs()
        b.note(f"{shape} fp8 dispatch == torch quantize + argsort bit for bit; |dequantized - bf16 row| max "
               f"{err.max().item():.3g}, mean {err.mean().item():.3g}, relative to mean |x| "
               f"{(err.mean() / routed.float().abs().mean()).item():.3g}; bytes per row {fp8.packed_width(H)} "
               f"vs {2 * H} bf16")
        b.measure(shape, "torch.fp8", "dispatch", lambda: torch_fp8_dispatch(x, topk_idx), fp8_bytes)
        b.measure(shape, "local.fp8", "dispatch", lambda: ours_fp8_dispatch(x, topk_idx, E), fp8_bytes)
        if compiled:
            cd = compile_fn(ours_fp8_dispatch, backend, fullgraph=True)
            (cv, cs), _, _ = b.first_call(f"{shape} local.fp8.compile dispatch", lambda: cd(x, topk_idx, E))
            assert torch.equal(cv.view(torch.uint8), values.view(torch.uint8)), "compiled fp8 dispatch != eager"
            b.measure(shape, "local.fp8.compile", "dispatch", lambda: cd(x, topk_idx, E), fp8_bytes)

    # DeepEP's dispatch layout for W = 8 on 2 nodes: read the ids, write is_token_in_rank (T, W).
    dl_bytes = topk_idx.numel() * topk_idx.element_size() + T * LAYOUT_W

    def dispatch_layout_rows():
        ours, ref = ours_dispatch_layout(topk_idx, E), torch_dispatch_layout(topk_idx, E)
        assert all(torch.equal(a, r) for a, r in zip(ours, ref)), "dispatch_layout != its torch reference"
        b.measure(shape, "torch.dispatch_layout", "layout", lambda: torch_dispatch_layout(topk_idx, E), dl_bytes)
        b.measure(shape, "dispatch_layout", "layout", lambda: ours_dispatch_layout(topk_idx, E), dl_bytes)
        if b.cuda:  # from a CUDA graph: the kernel's GPU time without launch costs
            graph = Captured(lambda _stream: ours_dispatch_layout(topk_idx, E), b.cuda)
            assert all(torch.equal(a, r) for a, r in zip(graph.run(), ref)), "dispatch_layout graph != eager"
            b.measure(shape, "dispatch_layout.graph", "layout", graph.replay, dl_bytes)

    def local_eager():
        b.measure(shape, "local", "dispatch", lambda: ours_dispatch(x, topk_idx, E), nbytes)
        b.measure(shape, "local", "combine", lambda: ours_combine(expert_out, handle, weights), nbytes)

    def local_compiled():
        cd = compile_fn(ours_dispatch, backend, fullgraph=True)
        cc = compile_fn(ours_combine, backend, fullgraph=True)
        r, t, _ = b.first_call(f"{shape} local.compile dispatch", lambda: cd(x, topk_idx, E))
        assert torch.equal(r, routed) and torch.equal(t, tpe), "compiled local dispatch != eager"
        yc = b.first_call(f"{shape} local.compile combine", lambda: cc(expert_out, handle, weights))
        check_y("compiled local combine", yc, y)
        b.measure(shape, "local.compile", "dispatch", lambda: cd(x, topk_idx, E), nbytes)
        b.measure(shape, "local.compile", "combine", lambda: cc(expert_out, handle, weights), nbytes)

    # symm_mem, one rank: C = T*K rows, each row of routed checked against the local backend.
    symm: dict = {}

    def symm_setup() -> dict:
        if not symm:
            bufs = SymmBuffers(T, H, K, E, dtype=DTYPE, device=dev)
            s_routed, s_tpe, s_handle = a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)
            check_routed("symm W=1 dispatch vs local", s_routed, s_tpe, routed, tpe)
            R = int(tpe.sum())
            s_routed[:R] += row_offsets(R, 0, s_routed)  # expert outputs that differ per row
            local_out = routed.clone()
            local_out[:R] += row_offsets(R, 0, local_out)
            s_y = a2a.combine(s_routed, s_handle, weights)
            differ = check_y("symm W=1 combine vs local", s_y, ours_combine(local_out, handle, weights))
            b.note(f"{shape} symm W=1 (C={bufs.capacity}) = local backend: routed exact; y: {differ} "
                   f"elements differ in bf16 rounding")
            symm.update(bufs=bufs, routed=s_routed, handle=s_handle, y=s_y)
        return symm

    def symm_eager():
        s = symm_setup()
        bufs = s["bufs"]
        b.measure(shape, "symm.w1", "dispatch",
                  lambda: a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs), nbytes)
        b.measure(shape, "symm.w1", "combine", lambda: a2a.combine(s["routed"], s["handle"], weights), nbytes)

    def symm_compiled():
        s = symm_setup()
        bufs = s["bufs"]
        sd = compile_fn(lambda x, i: a2a.dispatch(x, i, num_experts=E, buffers=bufs), backend, fullgraph=True)
        sc = compile_fn(lambda out, h, w: a2a.combine(out, h, w), backend, fullgraph=True)
        r, t, h = b.first_call(f"{shape} symm.w1.compile dispatch", lambda: sd(x, topk_idx))
        check_routed("compiled symm W=1 dispatch", r, t, routed, tpe)
        yc = b.first_call(f"{shape} symm.w1.compile combine", lambda: sc(s["routed"], h, weights))
        check_y("compiled symm W=1 combine", yc, s["y"])
        b.measure(shape, "symm.w1.compile", "dispatch", lambda: sd(x, topk_idx), nbytes)
        b.measure(shape, "symm.w1.compile", "combine", lambda: sc(s["routed"], h, weights), nbytes)

    def symm_step(x, topk_idx, weights, bufs):
        """One symm_mem dispatch + combine (identity experts): the step the graph rows replay."""
        r, _, h = a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)
        return a2a.combine(r, h, weights)

    def symm_graph():
        bufs = symm_setup()["bufs"]
        y_eager = symm_step(x, topk_idx, weights, bufs)
        graph = Captured(lambda _stream: symm_step(x, topk_idx, weights, bufs), b.cuda)
        if not torch.equal(graph.run(), y_eager):
            raise AssertionError("symm W=1 graph replay: y differs from the eager step")
        impl = "symm.w1.graph" if b.cuda else "symm.w1.eager(cpu)"  # no CUDA graphs on the CPU
        b.measure(shape, impl, "dispatch+combine", graph.replay, 2 * nbytes)

    def symm_compiled_graph():
        bufs = symm_setup()["bufs"]
        y_eager = symm_step(x, topk_idx, weights, bufs)
        cstep = compile_fn(lambda x, i, w: symm_step(x, i, w, bufs), backend, fullgraph=True)
        b.first_call(f"{shape} symm.w1.compile.graph", lambda: cstep(x, topk_idx, weights))
        graph = Captured(lambda _stream: cstep(x, topk_idx, weights), b.cuda)
        check_y("symm W=1 compiled graph replay vs eager", graph.run(), y_eager)
        impl = "symm.w1.compile.graph" if b.cuda else "symm.w1.compile.eager(cpu)"
        b.measure(shape, impl, "dispatch+combine", graph.replay, 2 * nbytes)

    sections = (  # (key, run, needs a compile backend)
        ("torch", torch_eager, False), ("torch.compile", torch_compiled, True),
        ("layout", layout_eager, False), ("layout.compile", layout_compiled, True),
        ("local", local_eager, False), ("local.compile", local_compiled, True),
        ("fp8", fp8_rows, False), ("dispatch_layout", dispatch_layout_rows, False),
        ("symm.w1", symm_eager, False), ("symm.w1.compile", symm_compiled, True),
        ("symm.w1.graph", symm_graph, False), ("symm.w1.compile.graph", symm_compiled_graph, True),
    )
    for key, run, needs_compile in sections:
        if compiled or not needs_compile:
            b.section(shape, key, run)


# --- a whole MoE layer -------------------------------------------------------------------------


def bench_moe(b: Bench, shape=MOE_SHAPE) -> None:
    """Forward + backward of :class:`alltoall_ops.moe.MoE` (local backend; grouped_mm experts on
    CUDA sm90+), eager and compiled (fullgraph), the same module and inputs. The byte floor is
    that of its two dispatches and two combines (forward and backward); matmuls come on top."""
    T, H, F, E, K = shape
    dev = b.device
    torch._dynamo.reset()
    torch.manual_seed(T + H)
    layer = MoE(H, F, E, K, backend="local", device=dev, dtype=DTYPE)
    x = tokens(T, H, dev, seed=T + F).requires_grad_()
    grad_y = tokens(T, H, dev, seed=T + F + 1)
    key, nbytes = (T, H, K, E), 4 * (T + T * K) * H * 2

    def step(fn):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        fn(x).backward(grad_y)
        return x.grad, layer.w_up.grad

    eager = tuple(g.clone() for g in step(layer))

    def run_eager():
        b.measure(key, "moe", "fwd+bwd", lambda: step(layer), nbytes)

    def run_compiled():
        compiled = torch.compile(layer, backend=b.args.compile_backend, fullgraph=True)
        grads = b.first_call(f"{key} moe.compile", lambda: step(compiled))
        for what, got, want in zip(("x.grad", "w_up.grad"), grads, eager):
            err = float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))
            if err > 2e-2:
                raise AssertionError(f"compiled MoE layer: {what} rel. error {err:.3g} vs eager")
        b.measure(key, "moe.compile", "fwd+bwd", lambda: step(compiled), nbytes)

    b.note(f"MoE layer (T, H, F, E, K) = {shape}, SwiGLU, local backend, "
           f"{'grouped_mm' if layer._use_grouped_mm(x) else 'masked'} experts; floor = its 2 dispatches + 2 combines")
    b.section(key, "moe", run_eager)
    if b.args.compile_backend != "none":
        b.section(key, "moe.compile", run_compiled)


# --- one shape: W simulated ranks -------------------------------------------------------------


def peer_reference(xs, idxs, ws, E: int):
    """What the collective backend gives every rank, in one process: the local backend on all
    ranks' tokens concatenated groups rows by expert, then source rank, then token, which is
    every destination rank's expert-major layout, in rank order. Combine's expert outputs are
    the routed rows plus :func:`row_offsets` of each destination rank."""
    W = len(xs)
    routed, tpe, handle = a2a.dispatch(torch.cat(xs), torch.cat(idxs), num_experts=E, backend="local")
    tpe = tpe.view(W, E // W)
    R = tpe.sum(1).tolist()
    starts = [sum(R[:d]) for d in range(W)]
    expert_out = routed.clone()
    for d in range(W):
        expert_out[starts[d] : starts[d] + R[d]] += row_offsets(R[d], d, expert_out)
    y = a2a.combine(expert_out, handle, torch.cat(ws))
    return routed, tpe, R, starts, y


def note_above_design(b: Bench, W: int, design_bytes: int) -> None:
    """Note the last row's time above ``design_bytes`` at the copy bandwidth, us a rank: what a
    W-rank dispatch's design reads and writes (docs/design.md, "What bounds the dispatch")."""
    row = b.rows[-1]
    design_us = design_bytes / b.bandwidth * 1e6
    b.note(f"{row.shape} {row.impl} {row.op}: the design's bytes take {design_us / row.floor_us:.2f}x the floor; "
           f"the time above them is {(row.us - design_us) / W:.1f} us a rank")


def bench_peers(b: Bench, shape, W: int) -> None:
    """symm_mem with W ranks simulated on this device, T tokens each: checked eagerly, then every
    rank's dispatch in one CUDA graph and every rank's combine in another, replays timed."""
    T, H, K, E = shape
    dev = b.device
    if E % W:
        b.note(f"{shape} symm.w{W}: E = {E} is not divisible by W = {W}; skipped")
        return
    e, N, row_bytes = E // W, T * K, H * torch.empty((), dtype=DTYPE).element_size()
    full = W * N  # the default capacity: every slot of every rank could land on one rank

    def need_gb(C: int) -> float:  # per rank: routed (C rows), stage / returned rows, reference,
        return W * row_bytes * (C + 3 * N) / 1e9  # slack (N each)

    mode = b.args.symm_capacity
    capped = mode == "2tk" or (mode == "auto" and need_gb(full) > b.args.symm_mem_gb)
    C = min(2 * N, full) if capped else full
    capped = C < full

    def label(name: str) -> str:  # e.g. symm.w8.graph, symm.w8.fp8.graph (C=2TK), symm.w2.eager(cpu)
        return name + (".graph" if b.cuda else ".eager(cpu)") + (" (C=2TK)" if capped else "")

    impl = label(f"symm.w{W}")

    xs = [tokens(T, H, dev, seed=T + H + 7919 * (r + 1)) for r in range(W)]
    routes = [routing(T, K, E, device=dev, seed=T + H + 7919 * (r + 1) + 1) for r in range(W)]
    idxs, ws = [r[0] for r in routes], [r[1] for r in routes]
    dests = [idx // e for idx in idxs]
    recv = torch.stack([torch.bincount(d.reshape(-1), minlength=W) for d in dests]).sum(0).tolist()
    if max(recv) > C:  # would be a device-side assert (overflow='error'): say so instead
        b.note(f"{shape} symm.w{W}: a rank receives {max(recv)} rows > C = {C}; skipped")
        return
    peer_rows = sum(int((d != r).sum()) for r, d in enumerate(dests))
    pairs = sum(int(torch.nn.functional.one_hot(d, W).amax(1).sum()) for d in dests)  # (token, rank): rows pulled
    nbytes, peer_bytes = W * (T + N) * row_bytes, peer_rows * row_bytes

    ref_routed, ref_tpe, R, starts, ref_y = peer_reference(xs, idxs, ws, E)
    b.free()
    bufs = SymmBuffers.simulated(W, T, H, K, E, dtype=DTYPE, device=dev,
                                 capacity=C if capped else None, overflow="error")

    def dispatch(r: int, bb: SymmBuffers):
        return a2a.dispatch(xs[r], idxs[r], num_experts=E, buffers=bb)

    def combine_all(outs, stream=None):
        return run_simulated(lambda r, bb: a2a.combine(outs[r][0], outs[r][2], ws[r]), bufs, stream=stream)

    def check_dispatch(what: str, outs) -> None:
        """Every rank's rows against the reference; then each rank's routed rows get their
        row_offsets, so that combine sees expert outputs that differ per row."""
        for r, (routed, tpe, _) in enumerate(outs):
            check_routed(f"{what} rank {r} dispatch", routed, tpe,
                         ref_routed[starts[r] : starts[r] + R[r]], ref_tpe[r])
            routed[: R[r]] += row_offsets(R[r], r, routed)

    def check_combine(what: str, ys) -> int:
        return sum(check_y(f"{what} rank {r} combine", y, ref_y[r * T : (r + 1) * T])
                   for r, y in enumerate(ys))

    def eager() -> int:  # one thread per rank, all on the default stream
        outs = run_simulated(dispatch, bufs)
        b.sync()
        check_dispatch(f"symm W={W} eager", outs)
        ys = combine_all(outs)
        b.sync()
        return check_combine(f"symm W={W} eager", ys)

    differ = eager()
    b.free()
    # Every rank's dispatch in one graph; every rank's combine of that dispatch's rows in another
    # (captured after a replay of the first, so that its warm-up reads real handles).
    g_dispatch = Captured(lambda stream: run_simulated(dispatch, bufs, stream=stream), b.cuda, relaxed=True)
    d_outs = g_dispatch.run()
    check_dispatch(f"symm W={W} graph", d_outs)
    g_combine = Captured(lambda stream: combine_all(d_outs, stream), b.cuda, relaxed=True)
    differ_g = check_combine(f"symm W={W} graph", g_combine.run())
    b.note(f"{shape} symm W={W} simulated (C={C}{', capped at 2*T*K' if capped else ''}; rows received per "
           f"rank {min(recv)}..{max(recv)}; {peer_rows} of {W * N} rows cross to a peer) = collective-"
           f"equivalent reference, eager and {'graph replay' if b.cuda else 'emulated replay'}; y: "
           f"{differ}/{differ_g} elements differ in bf16 rounding")
    b.measure(shape, impl, "dispatch", g_dispatch.replay, nbytes, peer_bytes)
    note_above_design(b, W, (W * (2 * T + N) + pairs) * row_bytes)  # x read, the stage written; pulled, written
    b.measure(shape, impl, "combine", g_combine.replay, nbytes, peer_bytes)
    if b.skipped(f"symm.w{W}.fp8"):
        return
    # The same step's dispatch with an fp8 payload (combine stays bf16): fresh buffers for fp8
    # wire rows, every rank's rows checked bit for bit against the local fp8 dispatch of all
    # ranks' tokens (the same expert-major layout, in rank order), one graph replay timed.
    bufs = g_dispatch = g_combine = d_outs = None  # free the bf16 buffers first
    b.free()
    (ref_values, ref_scales), _, _ = a2a.dispatch(torch.cat(xs), torch.cat(idxs), num_experts=E, backend="local",
                                                  payload_dtype=fp8.FP8)
    fp8_bufs = SymmBuffers.simulated(W, T, H, K, E, dtype=DTYPE, device=dev, capacity=C if capped else None,
                                     overflow="error", payload_dtype=fp8.FP8)

    def dispatch_fp8(r: int, bb: SymmBuffers, dequantize: bool = False):
        return a2a.dispatch(xs[r], idxs[r], num_experts=E, buffers=bb, payload_dtype=fp8.FP8, dequantize=dequantize)

    g_fp8 = Captured(lambda stream: run_simulated(dispatch_fp8, fp8_bufs, stream=stream), b.cuda, relaxed=True)
    for r, ((values, scales), tpe, _) in enumerate(g_fp8.run()):
        rows = slice(starts[r], starts[r] + R[r])
        check_routed(f"symm W={W} fp8 graph rank {r} values", values.view(torch.uint8), tpe,
                     ref_values[rows].view(torch.uint8), ref_tpe[r])
        check_routed(f"symm W={W} fp8 graph rank {r} scales", scales, tpe, ref_scales[rows], ref_tpe[r])
    P = fp8.packed_width(H)
    fp8_bytes = W * (T * row_bytes + N * P)  # read x (bf16) once, write every slot's wire row
    b.measure(shape, label(f"symm.w{W}.fp8"), "dispatch", g_fp8.replay, fp8_bytes, peer_rows * P)
    note_above_design(b, W, W * (T * row_bytes + T * P + N * P) + pairs * P)  # x read, wire rows staged; pulled
    if b.skipped(f"symm.w{W}.fp8.dequantize"):
        return
    # fp8 training's dispatch: fp8 on the wire, the rows dequantized to bf16 as the pull moves them
    # (dequantize=True), equal bit for bit to fp8.dequantize of the local fp8 dispatch's rows; its
    # floor is the bf16 dispatch's (read x once, write every slot's bf16 row).
    g_fp8 = None  # free its graph first
    b.free()
    g_deq = Captured(lambda stream: run_simulated(functools.partial(dispatch_fp8, dequantize=True), fp8_bufs,
                                                  stream=stream), b.cuda, relaxed=True)
    ref_rows = fp8.dequantize(ref_values, ref_scales, DTYPE)
    for r, (routed, tpe, _) in enumerate(g_deq.run()):
        check_routed(f"symm W={W} fp8 dequantized graph rank {r}", routed, tpe,
                     ref_rows[starts[r] : starts[r] + R[r]], ref_tpe[r])
    b.measure(shape, label(f"symm.w{W}.fp8.dequantize"), "dispatch", g_deq.replay, nbytes, peer_rows * P)
    note_above_design(b, W, W * (T * row_bytes + T * P + N * row_bytes) + pairs * P)


# --- output ---------------------------------------------------------------------------------


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f}" if nbytes >= 1e5 or not nbytes else f"{nbytes / 1e6:.3g}"


def markdown(rows: list[Row], header: str, extra: str = "") -> str:
    lines = [header, "",
             "| T | H | K | E | impl | op | us | floor us | time / floor | logical MB | peer MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        T, H, K, E = r.shape
        lines.append(f"| {T} | {H} | {K} | {E} | {r.impl} | {r.op} | {r.us:.1f} | {r.floor_us:.1f} | "
                     f"{r.ratio:.2f} | {_mb(r.bytes_logical)} | {_mb(r.bytes_peer)} |")
    return "\n".join(lines) + "\n" + extra


def compact(rows: list[Row]) -> str:
    """The table for a terminal whose last lines are all that come back (ops: d = dispatch,
    c = combine, d+c = both in one graph)."""
    short = {"dispatch": "d", "combine": "c", "dispatch+combine": "d+c"}
    out = [f"{'T x H':>10} {'impl':<25} {'op':<3} {'us':>9} {'floor':>8} {'x':>7} {'peerMB':>7}"]
    for r in rows:
        out.append(f"{f'{r.shape[0]}x{r.shape[1]}':>10} {r.impl:<25} {short.get(r.op, r.op):<3} {r.us:9.1f} "
                   f"{r.floor_us:8.1f} {r.ratio:7.2f} {r.bytes_peer / 1e6:7.0f}")
    return "\n".join(out)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r.shape for r in rows))
    ops = [op for op in ("dispatch", "combine", "dispatch+combine") if any(r.op == op for r in rows)]
    fig, axes = plt.subplots(len(ops), 1, figsize=(15, 4.2 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        impls = list(dict.fromkeys(r.impl for r in rows if r.op == op))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            ratio = {r.shape: r.ratio for r in rows if r.impl == impl and r.op == op}
            ratios = [ratio.get(s, 0) for s in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], ratios, width, label=impl)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels([f"T={s[0]} H={s[1]} K={s[2]} E={s[3]}" for s in shapes])
        ax.set_yscale("log")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("time / byte floor (log)")
        ax.set_title(op)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def notes_text(notes: list[str], compile_s: dict, failures: list[str]) -> str:
    parts = []
    if notes:
        parts += ["", "Notes:", *(f"- {n}" for n in notes)]
    if compile_s:
        parts += ["", "Compile + first call, seconds (excluded from the timings): "
                  + "; ".join(f"{k} {v:.1f}" for k, v in compile_s.items())]
    if failures:
        parts += ["", "FAILED:", *(f"- {f}" for f in failures)]
    return "\n".join(parts) + "\n"


def write_outputs(out: str, tag: str, header: str, meta: dict, rows: list[Row], notes: list[str],
                  compile_s: dict, failures: list[str], png: bool = True) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"bench_{tag}.json"), "w") as f:
        json.dump({"header": header, **meta,
                   "rows": [dict(dataclasses.asdict(r), ratio=r.ratio) for r in rows],
                   "notes": notes, "compile_s": compile_s, "failures": failures}, f, indent=1)
    with open(os.path.join(out, f"bench_{tag}.md"), "w") as f:
        f.write(markdown(rows, header, notes_text(notes, compile_s, failures)))
    if png and rows:
        plot(rows, os.path.join(out, f"bench_{tag}.png"))


def replot(path: str) -> int:
    with open(path) as f:
        data = json.load(f)
    fields = {f.name for f in dataclasses.fields(Row)}
    rows = [Row(**{k: (tuple(v) if k == "shape" else v) for k, v in r.items() if k in fields})
            for r in data["rows"]]
    out, name = os.path.split(path)
    tag = name[len("bench_"):-len(".json")] if name.startswith("bench_") else name.rsplit(".", 1)[0]
    meta = {k: v for k, v in data.items() if k not in ("header", "rows", "notes", "compile_s", "failures")}
    write_outputs(out or ".", tag, data["header"], meta, rows, data.get("notes", []),
                  data.get("compile_s", {}), data.get("failures", []))
    print(f"wrote {os.path.join(out or '.', f'bench_{tag}')}.md / .png")
    return 0


def pick_shapes(wanted: Optional[list[str]], smoke: bool) -> list[tuple[int, int, int, int]]:
    """--shapes items: 'T' (a listed shape with that T) or 'T,H,K,E'."""
    table = SMOKE_SHAPES if smoke else SHAPES
    if not wanted:
        return list(table)
    shapes = []
    for item in wanted:
        parts = [int(p) for p in item.replace("x", ",").split(",")]
        if len(parts) == 4:
            shapes.append(tuple(parts))
            continue
        match = [s for s in table if s[0] == parts[0]] if len(parts) == 1 else []
        if not match:
            raise SystemExit(f"--shapes: {item!r} is neither T,H,K,E nor the T of a listed shape {table}")
        shapes.append(match[0])
    return shapes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (no GPU needed)")
    parser.add_argument("--out", default="results", help="folder for JSON, markdown and PNG")
    parser.add_argument("--compile-backend", default="inductor", choices=("inductor", "aot_eager", "none"))
    parser.add_argument("--shapes", nargs="+", metavar="T|T,H,K,E",
                        help=f"a subset (by T) or other shapes; default {SHAPES} "
                             f"({SMOKE_SHAPES} with --smoke)")
    parser.add_argument("--skip", nargs="+", default=[], metavar="IMPL",
                        help=f"implementations to leave out (shell patterns) of {', '.join(IMPLS)}")
    parser.add_argument("--symm-capacity", default="auto", choices=("auto", "2tk", "full"),
                        help="C of the simulated-peer buffers: 'full' = W*T*K (no overflow possible), "
                             "'2tk' = 2*T*K, 'auto' = full where it fits in --symm-mem-gb, else 2*T*K")
    parser.add_argument("--symm-mem-gb", type=float, default=100.0,
                        help="device memory the simulated-peer runs may plan for (default 100)")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="start no new implementation after this many seconds (0: no limit); "
                             "results are written after every shape either way")
    parser.add_argument("--replot", metavar="JSON",
                        help="rewrite the markdown and PNG of a saved run, then exit")
    args = parser.parse_args(argv)
    if args.replot:
        return replot(args.replot)
    if not torch.cuda.is_available() and not args.smoke:
        print("benchmarks.bench: no CUDA device here; nothing to measure. "
              "Run it on a GPU host, or pass --smoke for a tiny CPU run (its times mean nothing).")
        return 0
    unknown = [p for p in args.skip if not any(fnmatch.fnmatchcase(n, p) for k in IMPLS for n in aliases(k))]
    if unknown:
        parser.error(f"--skip {unknown}: matches none of {', '.join(IMPLS)}")
    shapes = pick_shapes(args.shapes, args.smoke)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch.manual_seed(0)
    b = Bench(args, device)
    import triton

    name = torch.cuda.get_device_name() if b.cuda else f"CPU smoke ({platform.processor() or 'cpu'})"
    given = sys.argv[1:] if argv is None else argv
    command = "python -m benchmarks.bench " + " ".join(shlex.quote(a) for a in given)
    header = (f"{name}; torch {torch.__version__}, triton {triton.__version__}; "
              f"copy bandwidth {b.bandwidth / 1e12:.3f} TB/s (read + write); bf16; command: `{command}`")
    meta = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "command": command,
            "bandwidth_Bps": b.bandwidth}
    print(header, flush=True)
    tag = "smoke" if args.smoke else "gpu"
    for shape in shapes:
        t0 = time.perf_counter()
        b.section(shape, "W=1", lambda shape=shape: bench_shape(b, shape))  # each impl a section inside
        for W in PEERS:
            b.section(shape, f"symm.w{W}", lambda shape=shape, W=W: bench_peers(b, shape, W))
        print(f"== {shape}: {time.perf_counter() - t0:.0f} s ({b.elapsed():.0f} s so far)", flush=True)
        write_outputs(args.out, tag, header, meta, b.rows, b.notes, b.compile_s, b.failures, png=False)
    moe_shape = SMOKE_MOE_SHAPE if args.smoke else MOE_SHAPE
    if not (b.skipped("moe") and b.skipped("moe.compile")):
        b.section(moe_shape, "MoE layer", lambda: bench_moe(b, moe_shape))
    write_outputs(args.out, tag, header, meta, b.rows, b.notes, b.compile_s, b.failures)
    print("\n" + header)
    print(compact(b.rows))
    if b.compile_s:
        worst = max(b.compile_s, key=b.compile_s.get)
        print(f"compile + first call: {sum(b.compile_s.values()):.0f} s over {len(b.compile_s)} functions "
              f"(longest {b.compile_s[worst]:.0f} s: {worst}); excluded from the timings")
    for n in b.notes:
        print(f"- {n[:230]}")
    for f in b.failures:
        print(f"FAILED {f}")
    print(f"{'FAILED' if b.failures else 'OK'}: {len(b.rows)} rows in {b.elapsed():.0f} s; "
          f"{os.path.join(args.out, f'bench_{tag}')}.json / .md / .png", flush=True)
    return 1 if b.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
