"""The Triton kernels' launchers with strided inputs, and dropped (-1) slots whose routing weight
is NaN or inf, on every backend.

Without CUDA the kernels run on CPU tensors in Triton's interpreter; ``_rows_by_kernels(True)``
sends the local and collective backends through them, as CUDA tensors are (symm_mem on the CPU
always takes them). Values are fp64: a strided input gives the contiguous result bit for bit (the
local weights' gradient, a torch dot product over H, to a few ulps).

Functions run on ranks are module-level (they travel to the pool's processes by reference)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from functools import cache, partial
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import alltoall_ops as a2a
from alltoall_ops import layout
from alltoall_ops.backends import symm_mem
from alltoall_ops.backends.symm_mem.buffers import ALIGNMENT, CALL, FAILED, META_EXTRA, N_SLOTS
from alltoall_ops.kernels import _config, loader
from alltoall_ops.kernels._config import BUDGET_BLOCKS, GPU_BLOCKS, RowBlocks
from alltoall_ops.kernels.row_put import row_piece
from alltoall_ops.kernels.region import Region
from alltoall_ops.backends.collective import dispatch_op
from alltoall_ops.reference import reference_combine, reference_dispatch

E, H, K, T = 4, 6, 3, 7
FP64_TOL = dict(rtol=1e-12, atol=1e-12)  # only summation order may differ from the reference

needs_interpreter = pytest.mark.skipif(
    not loader.load().interpreting(), reason="the kernels run on CPU tensors only in Triton's interpreter"
)


def _rows_by_kernels(on: bool):
    """Move rows of CPU tensors with this package's Triton kernels (the CUDA path), or torch ops."""
    return mock.patch.object(loader, "use_kernels", lambda t: True) if on else contextlib.nullcontext()


def strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a non-contiguous view: every other element of the last dim of a tensor
    twice as wide, whose other elements (NaN, or -1 for integers) show up if read."""
    fill = float("nan") if t.is_floating_point() else -1
    return torch.stack([t, torch.full_like(t, fill)], dim=-1)[..., 0]


def column_major(t: torch.Tensor) -> torch.Tensor:
    """(a, b) -> the same values with strides (1, a)."""
    return t.t().contiguous().t()


def _inputs(rank: int, T: int, bad: float = 0.0):
    """x (T, H), topk_idx (T, K) with -1 slots (token 0: a padding token, every slot -1),
    weights (T, K) equal to ``bad`` on every -1 slot, grad_y (T, H); fp64."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    topk_idx = torch.randint(-1, E, (T, K), generator=g)
    topk_idx[:1] = -1
    weights = torch.rand(T, K, generator=g, dtype=torch.float64).masked_fill(topk_idx < 0, bad)
    grad_y = torch.randn(T, H, generator=g, dtype=torch.float64)
    return x, topk_idx, weights, grad_y


def _expert(routed: torch.Tensor, layout_of=lambda t: t) -> torch.Tensor:
    """Row-wise; padding rows become 0.5, which combine must ignore. ``layout_of=column_major``:
    a non-contiguous output, and a non-contiguous gradient into ``routed`` in backward."""
    return layout_of(torch.tanh(layout_of(routed)) + 0.5)


def _step(x, topk_idx, weights, grad_y, *, strided_inputs=False, **dispatch_kwargs) -> dict:
    """dispatch -> expert -> combine -> backward: y and every gradient. ``strided_inputs``: the
    weights, expert outputs and grad_y reach combine / backward as non-contiguous views."""
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    routed, tokens_per_expert, handle = a2a.dispatch(x, topk_idx, num_experts=E, **dispatch_kwargs)
    expert_out = _expert(routed, column_major if strided_inputs else lambda t: t)
    expert_out.retain_grad()
    y = a2a.combine(expert_out, handle, strided(weights) if strided_inputs else weights)
    y.backward(column_major(grad_y) if strided_inputs else grad_y)
    R = int(tokens_per_expert.sum())  # symm_mem: the rows past it are unspecified, in the gradient too
    return dict(y=y.detach(), grad_x=x.grad, grad_w=weights.grad, grad_expert_out=expert_out.grad[:R])


def _reference_y(world_size: int, alignment: int) -> list[torch.Tensor]:
    """Every rank's y from ``alltoall_ops.reference``, with the -1 slots' weights 0."""
    xs, idxs, ws, _ = zip(*(_inputs(r, T) for r in range(world_size)))
    expert_outs = [_expert(routed) for routed, _ in reference_dispatch(xs, idxs, E, alignment)]
    return reference_combine(expert_outs, idxs, E, ws, alignment, acc_dtype=torch.float64)


def _assert_dropped_slots_add_nothing(got: dict, zeroed: dict, y_ref: torch.Tensor) -> None:
    """``got``: a step with NaN / inf weights on the -1 slots; ``zeroed``: the same with 0 there."""
    for name, value in got.items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value, zeroed[name]), name
    torch.testing.assert_close(got["y"], y_ref, **FP64_TOL)


# --------------------------------------------------------------------------------------------
# Launchers called directly: a strided input gives the contiguous result; a strided output raises


def _launcher_cases() -> dict:
    """name -> (run, inputs): ``run(*inputs)`` calls the launcher and returns what it wrote."""
    k = loader.load()
    f64 = dict(dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    N = T * K
    x = torch.randn(T, H, generator=g, **f64)
    scale = torch.randn(T, K, generator=g, **f64)
    dst = torch.randperm(N, generator=g)
    dst[::4] = -1  # slots that send nothing
    position = torch.randperm(N, generator=g).view(T, K)
    ret = torch.randn(N, H, generator=g, **f64)

    def put_rows(src, dst, scale):  # one local destination, then a pointer table
        out, buf = torch.zeros(N, H, **f64), torch.zeros(N, H, **f64)
        k.put_rows(src, dst, N, out=out, top_k=K, scale=scale, acc_dtype=torch.float64)
        k.put_rows(src, dst, N, torch.tensor([buf.data_ptr()]), top_k=K, scale=scale, acc_dtype=torch.float64)
        return out, buf

    def post_slots(src, dst, scale, tag_index):  # two ranks' tags, this rank's stage
        stages, tags = torch.zeros(2, T, H, **f64), torch.full((2, 1 + N, 3), -1)
        k.post_slots(src, dst, N // 2, torch.tensor([t.data_ptr() for t in tags]), tag_index, rank=1, tag_base=100,
                     top_k=K, scale=scale, stage_table=torch.tensor([t.data_ptr() for t in stages]),
                     acc_dtype=torch.float64)
        return stages, tags

    def put_meta(send_meta):  # row 1 of two peers' (W, L) buffers: E = 4 counts, 3 status columns, a header
        metas = torch.zeros(2, 2, 11, dtype=torch.int64)
        k.put_meta(send_meta, (6, 2, 0), torch.tensor([9]), torch.tensor([m.data_ptr() for m in metas]), 1, 4, 11,
                   (3, 4, 5, 6))
        assert metas[0, 1].tolist() == [0, 1, 5, 6, 2, 3, 4, 6, 2, 0, 9]  # checks the case, any input strides
        return (metas,)

    def put_meta_planned(topk_idx):
        metas = torch.zeros(2, 2, 11, dtype=torch.int64)
        position, send_meta = k.put_meta(None, (topk_idx.numel(), 2, 0), torch.tensor([9]),
                                         torch.tensor([m.data_ptr() for m in metas]), 1, 4, 11, (3, 4, 5, 6),
                                         topk_idx=topk_idx)
        return metas, position, send_meta

    def topk_reduce(ret, position, slot_dst, weights):
        y, returned = torch.empty(T, H, **f64), torch.zeros(N, H, **f64)
        k.topk_reduce(ret, position, slot_dst, weights, y, returned, torch.float64)
        return y, returned

    def weight_grad(grad_y, returned, position):
        grad_w = torch.empty(T, K, **f64)
        k.weight_grad(grad_y, returned, position, grad_w, torch.float64)
        return (grad_w,)

    return dict(
        put_rows=(put_rows, (x, dst, scale)),
        post_slots=(post_slots, (x, dst, scale, dst.flip(0))),
        put_meta=(put_meta, (torch.arange(10).view(2, 5),)),
        put_meta_planned=(put_meta_planned, (torch.randint(-1, 4, (T, K), generator=g),)),
        topk_reduce=(topk_reduce, (ret, position, dst, scale)),
        weight_grad=(weight_grad, (x, ret, position)),
        plan_slots=(partial(k.plan_slots, num_experts=E, world_size=2),
                    (torch.randint(-1, E, (T, K), generator=g),)),
    )


@needs_interpreter
@pytest.mark.parametrize(
    "launcher", ["put_rows", "post_slots", "put_meta", "put_meta_planned", "topk_reduce", "weight_grad", "plan_slots"]
)
def test_launcher_reads_strided_inputs(launcher):
    run, inputs = _launcher_cases()[launcher]
    expected = run(*inputs)
    for i in range(len(inputs)):  # one input strided at a time
        got = run(*(strided(a) if j == i else a for j, a in enumerate(inputs)))
        for a, b in zip(got, expected):
            assert torch.equal(a, b), f"input {i} strided"


@needs_interpreter
def test_launchers_reject_strided_outputs():
    k = loader.load()
    x, w = torch.randn(4, H), torch.rand(2, 2)
    position = torch.arange(4).view(2, 2)
    with pytest.raises(ValueError, match="put_rows: out must be contiguous"):
        k.put_rows(x, torch.arange(4), 4, out=strided(torch.empty(4, H)))
    tags = Region.of(torch.full((5, 3), -1))  # NB: regions are contiguous by construction
    for i, name in enumerate(("out", "row_src")):
        outs = [torch.empty(4, H), torch.empty(4, dtype=torch.int64)]
        outs[i] = strided(outs[i])
        with pytest.raises(ValueError, match=f"pull_rows: {name} must be contiguous"):
            k.pull_rows(tags, torch.tensor([4]), *outs, rows=x, dst_stride=4)
    with pytest.raises(ValueError, match="topk_reduce: y must be contiguous"):
        k.topk_reduce(x, position, None, w, strided(torch.empty(2, H)), None, torch.float32)
    with pytest.raises(ValueError, match="topk_reduce: returned must be contiguous"):
        k.topk_reduce(x, position, None, w, torch.empty(2, H), strided(torch.empty(4, H)), torch.float32)
    with pytest.raises(ValueError, match="weight_grad: grad_w must be contiguous"):
        k.weight_grad(x[:2], x, position, strided(torch.empty(2, 2)), torch.float32)


def test_a_region_is_16_byte_aligned():
    # the kernels declare a region's base 16-byte aligned (its rows move as vectors)
    rows = torch.zeros(9, 4, dtype=torch.int64)
    assert Region.of(rows[1:]).shape == (8, 4)  # 32 bytes in
    with pytest.raises(ValueError, match="Region.of: the tensor must start 16-byte aligned"):
        Region.of(rows.view(torch.int32).view(-1)[1:])


# --------------------------------------------------------------------------------------------
# dispatch -> combine -> backward on the kernel path with strided weights, expert outputs, grads


@needs_interpreter
@pytest.mark.parametrize("alignment", [1, 3])
@pytest.mark.parametrize("backend", ["local", "symm_mem"])
def test_strided_inputs_on_the_kernel_path(backend, alignment):
    x, topk_idx, weights, grad_y = _inputs(0, T)
    kwargs = dict(backend=backend, expert_alignment=alignment)
    if backend == "symm_mem":
        kwargs["buffers"] = a2a.SymmBuffers(T, H, K, E, dtype=torch.float64, device="cpu", expert_alignment=3)
    with _rows_by_kernels(True):
        expected = _step(x, topk_idx, weights, grad_y, **kwargs)
        got = _step(x, topk_idx, weights, grad_y, strided_inputs=True, **kwargs)
    for name in ("y", "grad_x", "grad_expert_out"):
        assert torch.equal(got[name], expected[name]), name
    # A dot product over H, which torch (the local weights' gradient) sums in a layout-dependent order.
    torch.testing.assert_close(got["grad_w"], expected["grad_w"], **FP64_TOL)
    torch.testing.assert_close(got["y"], _reference_y(1, alignment)[0], **FP64_TOL)


# --------------------------------------------------------------------------------------------
# A -1 slot adds nothing to y, also with a NaN / inf weight; its weight's gradient is 0

BAD = [float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_interpreter)])
@pytest.mark.parametrize("alignment", [1, 4])
@pytest.mark.parametrize("bad", BAD)
def test_dropped_slots_local(bad, alignment, kernels):
    x, topk_idx, weights, grad_y = _inputs(0, T, bad)
    with _rows_by_kernels(kernels):
        got = _step(x, topk_idx, weights, grad_y, backend="local", expert_alignment=alignment)
        zeroed = _step(*_inputs(0, T), backend="local", expert_alignment=alignment)
        with torch.no_grad():  # the weights need no gradient: no returned rows are saved
            routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=E, expert_alignment=alignment)
            y = a2a.combine(_expert(routed), handle, weights)
    _assert_dropped_slots_add_nothing(got, zeroed, _reference_y(1, alignment)[0])
    assert torch.equal(y, got["y"])
    assert not got["grad_w"][topk_idx < 0].any()


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_interpreter)])
@pytest.mark.parametrize("alignment", [1, 4])
def test_dropped_slots_dispatch_scale(alignment, kernels):
    """dispatch's scale (combine's weights in combine's backward): a NaN on a -1 slot gives a
    finite x.grad and a zero scale gradient there."""
    x, topk_idx, _, _ = _inputs(0, T)
    plan = layout.plan_routing(topk_idx, E, 1)
    scale = torch.rand(T, K, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = []
    for bad in (float("nan"), 0.0):
        xr = x.clone().requires_grad_()
        scale = scale.detach().masked_fill(topk_idx < 0, bad).requires_grad_()
        with _rows_by_kernels(kernels):
            splits = layout.read_splits(plan.send_meta, plan.send_meta, alignment)
            routed, _ = dispatch_op(xr, scale, plan.order, plan.position, plan.send_meta, splits, alignment, "", None)
            routed.backward(torch.ones_like(routed))
        grads.append((xr.grad, scale.grad))
    for got, zeroed in zip(*grads):
        assert torch.isfinite(got).all() and torch.equal(got, zeroed)
    assert not grads[0][1][topk_idx < 0].any()


def run_dropped_slots_collective(rank: int, world_size: int, kernels: bool) -> None:
    for alignment in (1, 4):
        y_ref = _reference_y(world_size, alignment)[rank]
        for bad in BAD:
            x, topk_idx, weights, grad_y = _inputs(rank, T, bad)
            with _rows_by_kernels(kernels):
                got = _step(x, topk_idx, weights, grad_y, backend="collective", expert_alignment=alignment)
                zeroed = _step(*_inputs(rank, T), backend="collective", expert_alignment=alignment)
            _assert_dropped_slots_add_nothing(got, zeroed, y_ref)


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_interpreter)])
def test_dropped_slots_collective(pool2, kernels):
    pool2.run(run_dropped_slots_collective, kernels)


@needs_interpreter
@pytest.mark.parametrize("world_size", [1, 2])
def test_dropped_slots_symm_mem(world_size):
    for alignment in (1, 4):
        buffers = a2a.SymmBuffers.simulated(world_size, T, H, K, E, dtype=torch.float64, device="cpu",
                                            expert_alignment=alignment)
        y_ref = _reference_y(world_size, alignment)
        for bad in BAD:
            def rank_fn(rank, bufs, bad=bad, alignment=alignment):
                run = partial(_step, backend="symm_mem", expert_alignment=alignment, buffers=bufs)
                return run(*_inputs(rank, T, bad)), run(*_inputs(rank, T))

            for rank, (got, zeroed) in enumerate(symm_mem.run_simulated(rank_fn, buffers)):
                _assert_dropped_slots_add_nothing(got, zeroed, y_ref[rank])


@needs_interpreter
@pytest.mark.parametrize("count", [0, 1, 37, 300, 450])
def test_put_rows_stops_at_a_device_count_with_few_programs(monkeypatch, count):
    """``put_rows(count=)``: rows i < count go to dst[i], rows past it are not visited even with a
    destination; one row program strides over all the row blocks (combine's capacity rows)."""
    from alltoall_ops.kernels import row_put

    monkeypatch.setattr(row_put, "MAX_COUNTED_PROGRAMS", 1)
    g = torch.Generator().manual_seed(count)
    n, rows_out, width = 450, 500, 5
    src = torch.randn(n, width, generator=g, dtype=torch.float64)
    dst = torch.randperm(rows_out, generator=g)[:n]
    dst[torch.rand(n, generator=g) < 0.2] = -1  # no destination
    out = torch.full((rows_out, width), float("nan"), dtype=torch.float64)
    loader.load().put_rows(src, dst, rows_out, out=out, count=torch.tensor([count]))
    want = torch.full_like(out, float("nan"))
    sent = (dst >= 0) & (torch.arange(n) < count)
    want[dst[sent]] = src[sent]
    torch.testing.assert_close(out, want, equal_nan=True, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# What inductor sees a kernel write (compiled code copies around a launch whatever it takes for written)


def _without_interpreter(script: str, arg, timeout: int = 300) -> str:
    """stdout of ``script`` given ``arg`` (as JSON) in a Python without Triton's interpreter,
    where kernels compile for a CUDA target (no GPU needed); its stderr where it fails. With
    ``ALLTOALL_OPS_DEVICE_TRITON`` (``make test``: the GPU host's Triton, whose layouts differ from
    newer ones'), the Triton in that folder, checked."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    folder = os.environ.get("ALLTOALL_OPS_DEVICE_TRITON")
    if folder:
        folder = os.path.abspath(folder)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, env.get("PYTHONPATH")]))
        script = (f"import triton\nassert triton.__file__.startswith({folder!r}), "
                  f"('not the device Triton', triton.__file__)\n{script}")
    out = subprocess.run([sys.executable, "-c", script, json.dumps(arg)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


_EACH_CASE = """
import json, sys, traceback, triton


def constants(values):  # JSON's "tl.float32" -> triton.language.float32
    return {k: getattr(triton.language, v[3:]) if str(v).startswith("tl.") else v for k, v in values.items()}


def each_case(run):  # prints run(*case) for each case in argv[1] (JSON), or the traceback where it raised
    results = []
    for case in json.loads(sys.argv[1]):
        try:
            results.append({"result": run(*case)})
        except Exception:
            results.append({"error": traceback.format_exc()})
    print(json.dumps(results))
"""
"""Scripts given many cases end with ``each_case(run)``: one Python (one import of torch and
Triton, about 2 s) for all the cases of a parametrized test, each case failing on its own;
``constants``, a case's constexprs as JSON gives them."""


def _each_without_interpreter(script: str, cases: dict, timeout: int = 900) -> dict:
    """{key: what ``script``'s run gives for case} for ``cases`` {key: its arguments}, in one
    Python without Triton's interpreter (``_without_interpreter``)."""
    out = _without_interpreter(_EACH_CASE + script, list(cases.values()), timeout=timeout)
    results = json.loads(out.splitlines()[-1])
    return dict(zip(cases, results))


def _case_result(results: dict, key):
    """The result of case ``key`` of ``_each_without_interpreter``; its traceback fails the test."""
    if "error" in results[key]:
        pytest.fail(results[key]["error"][-3000:])
    return results[key]["result"]


_WRITTEN_BY_THE_KERNEL = """
import torch, triton
from triton.backends.compiler import GPUTarget
from torch._higher_order_ops import triton_kernel_wrap

class CudaTarget:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

triton.runtime.driver.set_active(CudaTarget())
import importlib  # the kernel's module, not through loader.load(): compiled, not interpreted


def written(module, name, shapes, scalars, dtypes):
    kwargs = {arg: torch.zeros(shape, dtype=getattr(torch, dtypes.get(arg, "int64"))) for arg, shape in shapes.items()}
    kwargs.update(constants(scalars))
    kernel = getattr(importlib.import_module(module), name)
    if hasattr(triton_kernel_wrap, "identify_accessed_tensors"):  # torch >= 2.13
        accessed = triton_kernel_wrap.identify_accessed_tensors(kernel, kwargs, {})
        written = [dep.name for dep in accessed.read_writes.writes]
    else:
        written = triton_kernel_wrap.identify_mutated_tensors(kernel, kwargs, {})
    return sorted(arg for arg in written if arg in shapes)


each_case(written)
"""

E_, N_ = 16, 64
L_ = E_ + META_EXTRA
# The barrier fused into the kernel before it (kernels/barrier.py's Epilogue): it writes the
# count of done programs through an address only
_EPILOGUE_TENSORS = {"pads_table_ptr": (2,), "counters_ptr": (1, 2), "barrier_call_ptr": (1,)}
_NO_EPILOGUE = dict(barrier_rank=0, timeout_ms=0, barrier_op=0, BARRIER=False, WORLD_SIZE=1)
_EPILOGUE = dict(barrier_rank=0, timeout_ms=1000, barrier_op=2, BARRIER=True, WORLD_SIZE=2)
_PULL_TENSORS = {"rows_ptr": (8, 16), "row_map_ptr": (N_,), "position_ptr": (N_,), "scale_ptr": (N_,),
                 "num_routed_ptr": (1,), "pads_ptr": (4,), "out_ptr": (N_, 16), "tail_ptr": (N_, 16),
                 "row_src_ptr": (N_,), "token_ptr": (1,), **_EPILOGUE_TENSORS}
_PULL_SCALARS = dict(rank=0, dst_stride=N_, world_size=2, n_pads=2, n_rows=N_, X=16, X_OUT=16, K=8, HAS_SCALE=True,
                     ACC_DTYPE="tl.float32", HAS_TAIL=False, BLOCK_R=2, BLOCK_H=16, BLOCK_C=16, BLOCK_T=1,
                     DEQUANTIZE=False)
_POST_TENSORS = {"src_ptr": (8, 16), "scale_ptr": (N_,), "dst_ptr": (N_,), "tag_index_ptr": (N_,),
                 "stage_table_ptr": (1, 2), "tags_table_ptr": (1, 2), "token_ptr": (1,), **_EPILOGUE_TENSORS}
_POST_SCALARS = dict(n_slots=N_, n_src=8, X=16, P=16, world_size=2, rank=0, tag_base=0, K=8, DST_STRIDE=N_,
                     HAS_SCALE=True, STAGE=True, QUANTIZE=False, ACC_DTYPE="tl.float32", BLOCK_R=2, BLOCK_H=16,
                     BLOCK_S=N_)
_META_TENSORS = {"send_meta_ptr": (2, E_ // 2 + 3), "call_ptr": (1,), "meta_table_ptr": (1, 2), "token_ptr": (1,),
                 "idx_ptr": (N_,), "position_ptr": (N_,), **_EPILOGUE_TENSORS}
_META_SCALARS = dict(rank=0, world_size=2, E=E_, e=E_ // 2, L=L_, n_status=3, n_slots=N_, alignment=1, failed=0,
                     col_n_slots=N_SLOTS, col_alignment=ALIGNMENT, col_failed=FAILED, col_call=CALL, BLOCK_L=32,
                     PLAN=False, NP=1, NB=1, BLOCK_W=1)
_PLAN_FIRST = dict(PLAN=True, NP=N_, NB=32, BLOCK_W=2)  # NB: E_ + 2 buckets
_PUT_TENSORS = {"src_ptr": (8, 16), "scale_ptr": (N_,), "dst_ptr": (N_,), "count_ptr": (1,), "rows_table_ptr": (1, 2),
                "out_ptr": (8, 16), "token_ptr": (1,), **_EPILOGUE_TENSORS}
_PUT_SCALARS = dict(n_rows=N_, n_src=8, H=16, world_size=2, K=8, DST_STRIDE=N_, HAS_SCALE=False, ONE_OUT=False,
                    HAS_COUNT=True, ACC_DTYPE="tl.float32", BLOCK_R=2, BLOCK_H=16)
_REDUCE_TENSORS = {"ret_ptr": (1, 2), "position_ptr": (8, 2), "slot_dst_ptr": (16,), "weights_ptr": (8, 2),
                   "y_ptr": (8, 16), "returned_ptr": (16, 16), "token_ptr": (1,), **_EPILOGUE_TENSORS}
_REDUCE_SCALARS = dict(ret_index=0, T=8, H=16, n_valid=16, RET_AT_ADDRESS=True, HAS_TOKEN=True, READ_AT_SLOT_DST=False,
                       K=2, HAS_SLOT_DST=True, HAS_WEIGHTS=True, SAVE_RETURNED=True, ACC_DTYPE="tl.float32",
                       BLOCK_T=8, BLOCK_H=16)
_PULL_STAGED = dict(_PULL_SCALARS, ROW_MAP=False, STAGED=True)
_PLACE_TENSORS = {"meta_ptr": (1, E_ + 3), "meta_table_ptr": (1, 1), "idx_ptr": (N_,), "position_ptr": (N_,),
                  "meta_out_ptr": (1, L_), "failed_checks_ptr": (1,), "slot_dst_ptr": (N_,), "row_slot_ptr": (N_,),
                  "tokens_ptr": (E_,), "num_routed_ptr": (1,), "dropped_ptr": (1,), "scratch_ptr": (1, 2, E_),
                  "token_ptr": (1,)}
_PLACE_SCALARS = dict(meta_index=0, L_in=E_ + 3, N=N_, E=E_, e=E_, rank=0, L_out=L_, alignment=1, max_slots=N_,
                      capacity=N_, col_failed=FAILED, col_call=CALL, col_alignment=ALIGNMENT, col_bad_ids=0,
                      col_n_slots=N_SLOTS, WORLD_SIZE=1, ONE_RANK=True, META_AT_ADDRESS=False, CHECK_OVERFLOW=True,
                      ASSERT_CHECKS=True, BLOCK_W=1, BLOCK_E=E_, BLOCK_S=N_, BLOCK_L=32, BLOCK_PAD=4, PLAN=False, NP=1,
                      NB=1)
_DTYPES = {  # kernel: the dtype of a tensor argument other than int64
    "row_put._pull_rows_kernel[one rank, fp8 dequantized]": {"rows_ptr": "uint8", "out_ptr": "bfloat16",
                                                             "tail_ptr": "uint8"},
    "row_put._post_slots_kernel[fp8 quantized into the stage]": {"src_ptr": "bfloat16"},
}
KERNELS = {  # kernel: (tensor arguments' shapes, other arguments, the tensors it writes)
    "slot_placement._place_slots_kernel": (
        _PLACE_TENSORS, _PLACE_SCALARS,
        ["dropped_ptr", "failed_checks_ptr", "meta_out_ptr", "num_routed_ptr", "row_slot_ptr", "scratch_ptr",
         "slot_dst_ptr", "token_ptr", "tokens_ptr"]),
    "slot_placement._place_slots_kernel[the plan first]": (  # one rank: the plan's send_meta and positions too
        _PLACE_TENSORS, dict(_PLACE_SCALARS, PLAN=True, NP=N_, NB=32),
        ["dropped_ptr", "failed_checks_ptr", "meta_out_ptr", "meta_ptr", "num_routed_ptr", "position_ptr",
         "row_slot_ptr", "scratch_ptr", "slot_dst_ptr", "token_ptr", "tokens_ptr"]),
    # the dispatch's two halves write the buffers through addresses only: inductor sees the token
    "row_put._post_slots_kernel": (_POST_TENSORS, dict(_POST_SCALARS, **_NO_EPILOGUE), ["token_ptr"]),
    "row_put._post_slots_kernel[barrier after]": (_POST_TENSORS, dict(_POST_SCALARS, **_EPILOGUE), ["token_ptr"]),
    "row_put._post_slots_kernel[fp8 quantized into the stage]": (  # the stage: by address
        {**_POST_TENSORS, "src_ptr": (8, 128)}, dict(_POST_SCALARS, X=128, P=132, HAS_SCALE=False, QUANTIZE=True,
                                                    **_EPILOGUE), ["token_ptr"]),
    "row_put._pull_rows_kernel": (
        {**_PULL_TENSORS, "stage_table_ptr": (1, 2), "tags_table_ptr": (1, 2)}, dict(_PULL_STAGED, **_NO_EPILOGUE),
        ["out_ptr", "row_src_ptr", "token_ptr"]),
    "row_put._pull_rows_kernel[barrier after]": (
        {**_PULL_TENSORS, "stage_table_ptr": (1, 2), "tags_table_ptr": (1, 2)}, dict(_PULL_STAGED, **_EPILOGUE),
        ["out_ptr", "row_src_ptr", "token_ptr"]),
    "row_put._pull_rows_kernel[one rank]": (  # reads the placement's row map, writes its outputs only
        {**_PULL_TENSORS, "stage_table_ptr": (1,), "tags_table_ptr": (1,)},
        dict(_PULL_SCALARS, ROW_MAP=True, STAGED=False, **_NO_EPILOGUE),
        ["out_ptr", "row_src_ptr", "token_ptr"]),
    "row_put._pull_rows_kernel[one rank, fp8 dequantized]": (  # fp8 wire rows: bf16 values, scale bytes
        {**_PULL_TENSORS, "rows_ptr": (8, 132), "out_ptr": (N_, 128), "tail_ptr": (N_, 4), "stage_table_ptr": (1,),
         "tags_table_ptr": (1,)},
        dict(_PULL_SCALARS, X=132, X_OUT=128, HAS_SCALE=False, HAS_TAIL=True, DEQUANTIZE=True, ROW_MAP=True,
             STAGED=False, **_NO_EPILOGUE),
        ["out_ptr", "row_src_ptr", "tail_ptr", "token_ptr"]),
    # CUDA symmetric memory's ops, inlined: the barrier writes the call number (the metadata
    # exchange's first) and the token only; the metadata put and the combine's put write peers'
    # buffers through addresses only; the combine's reduction reads its rows by address
    "barrier._barrier_kernel": (
        {"pads_table_ptr": (2,), "call_in_ptr": (1,), "call_out_ptr": (1,), "counters_ptr": (1, 2),
         "token_ptr": (1,)},
        dict(rank=0, timeout_ms=1000, op=1, advance=1, WORLD_SIZE=2),
        ["call_out_ptr", "token_ptr"]),
    "row_put._put_meta_kernel": (_META_TENSORS, dict(_META_SCALARS, **_NO_EPILOGUE), ["token_ptr"]),
    "row_put._put_meta_kernel[barriers before and after]": (  # the first sets the call number
        _META_TENSORS, dict(_META_SCALARS, **_EPILOGUE), ["call_ptr", "token_ptr"]),
    "row_put._put_meta_kernel[the plan first]": (  # its outputs: the slots' positions and send_meta
        _META_TENSORS, dict(_META_SCALARS, **_EPILOGUE, **_PLAN_FIRST),
        ["call_ptr", "position_ptr", "send_meta_ptr", "token_ptr"]),
    "row_put._put_rows_kernel": (_PUT_TENSORS, dict(_PUT_SCALARS, **_NO_EPILOGUE), ["token_ptr"]),
    "row_put._put_rows_kernel[barrier after]": (_PUT_TENSORS, dict(_PUT_SCALARS, **_EPILOGUE), ["token_ptr"]),
    "topk_reduce._topk_reduce_kernel": (_REDUCE_TENSORS, dict(_REDUCE_SCALARS, **_NO_EPILOGUE),
                                         ["returned_ptr", "token_ptr", "y_ptr"]),
    "topk_reduce._topk_reduce_kernel[barrier after]": (_REDUCE_TENSORS, dict(_REDUCE_SCALARS, **_EPILOGUE),
                                                       ["returned_ptr", "token_ptr", "y_ptr"]),
    "weight_grad._weight_grad_kernel": (
        {"grad_y_ptr": (8, 16), "returned_ptr": (N_, 16), "position_ptr": (8, 2), "grad_w_ptr": (8, 2)},
        dict(T=8, H=16, n_returned=N_, K=2, ACC_DTYPE="tl.float32", BLOCK_T=8, BLOCK_H=16),
        ["grad_w_ptr"]),
}


@cache
def _each_kernel(script: str) -> dict:
    """``script``'s result for each kernel of ``KERNELS``, its run given (module, name, shapes,
    scalars, dtypes)."""
    cases = {}
    for kernel, (shapes, scalars, _) in KERNELS.items():
        module, name = kernel.split("[")[0].split(".")
        cases[kernel] = [f"alltoall_ops.kernels.{module}", name, shapes, scalars, _DTYPES.get(kernel, {})]
    return _each_without_interpreter(script, cases)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_compiled_code_sees_only_the_outputs_written(kernel):
    # Inductor asks which arguments a user kernel writes (from its Triton IR); where its analysis
    # fails it takes every argument for written, and compiled code then copies topk_idx before
    # the launch and back into the caller's tensor after it (seen on the H200 with a scan over a
    # tuple). The analysis needs no GPU: a CUDA target stands in for the driver.
    assert _case_result(_each_kernel(_WRITTEN_BY_THE_KERNEL), kernel) == KERNELS[kernel][2]


_SM90_PTX = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def sm90_ptx(kernel, signature, constexprs, attrs=None, **options):
    target = GPUTarget("cuda", 90, 32)
    options = triton.compiler.make_backend(target).parse_options(options)
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=target, options=options.__dict__).asm["ptx"]
"""
"""The scripts below start with it: ``sm90_ptx``, a kernel's PTX for an H100 / H200, built on
the CPU."""

_WITH_CONSTANT_SCALARS = _SM90_PTX + """
import importlib


def compiles(module, name, shapes, scalars, dtypes):
    kernel = getattr(importlib.import_module(module), name)
    scalars = constants(scalars)
    pointer = {"int64": "*i64", "uint8": "*u8", "bfloat16": "*bf16"}
    signature = {arg: "constexpr" if arg in scalars else pointer[dtypes.get(arg, "int64")] for arg in kernel.arg_names}
    return bool(sm90_ptx(kernel, signature, scalars, debug=True, sanitize_overflow=False))


each_case(compiles)
"""


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernels_compile_with_every_scalar_a_constant(kernel):
    # torch 2.11's analysis above passes a kernel's scalar arguments as constants (Python ints in
    # the kernel's body): a method of a Triton scalar on one (``timeout_ms.to(...)``) failed it on
    # the H200, and inductor then took every argument for written (a leaf that requires grad
    # written in place: the compile failed). PTX for sm_90, built on the CPU.
    assert _case_result(_each_kernel(_WITH_CONSTANT_SCALARS), kernel) is True


_BARRIER_PTX = _SM90_PTX + """
from alltoall_ops.kernels import barrier, row_put, seq_exchange, topk_reduce



def clock_reads_and_asserts(kernel, W, constexprs):
    pointers = ("x0", "x1", "x2")  # the Ulysses post's tensors
    kernel = {"barrier": barrier._barrier_kernel, "put_meta": row_put._put_meta_kernel,
              "put_meta[the plan first]": row_put._put_meta_kernel,
              "put_rows": row_put._put_rows_kernel, "post_slots": row_put._post_slots_kernel,
              "pull_rows": row_put._pull_rows_kernel, "topk_reduce": topk_reduce._topk_reduce_kernel,
              "seq_post": seq_exchange._post_kernel}[kernel]
    constexprs = {**constants(constexprs), "WORLD_SIZE": W}
    signature = {name: "constexpr" if name in constexprs else "*i64" if name.endswith("_ptr") or name in pointers
                 else "i32" for name in kernel.arg_names}
    ptx = sm90_ptx(kernel, signature, constexprs, debug=True, sanitize_overflow=False, num_warps=4)
    return [ptx.count("%globaltimer"), ptx.count("call.uni __assertfail") + ptx.count("call __assertfail")]


each_case(clock_reads_and_asserts)
"""

_FUSED = {  # kernel: (its constexprs with the barrier, barriers in it)
    "barrier": ({}, 1),
    "put_meta": (dict(BLOCK_L=32, BARRIER=True, PLAN=False, NP=1, NB=1, BLOCK_W=1), 2),
    "put_meta[the plan first]": (dict(BLOCK_L=32, BARRIER=True, PLAN=True, NP=64, NB=32, BLOCK_W=2), 2),
    "put_rows": (dict(K=8, DST_STRIDE=64, HAS_SCALE=False, ONE_OUT=False, HAS_COUNT=True, ACC_DTYPE="tl.float32",
                      BLOCK_R=2, BLOCK_H=16, BARRIER=True), 1),
    "post_slots": (dict(K=8, DST_STRIDE=64, HAS_SCALE=True, STAGE=True, QUANTIZE=False, ACC_DTYPE="tl.float32",
                        BLOCK_R=2, BLOCK_H=16, BLOCK_S=64, BARRIER=True), 1),
    "pull_rows": (dict(K=8, ROW_MAP=False, STAGED=True, HAS_SCALE=True, ACC_DTYPE="tl.float32",
                       HAS_TAIL=False, BLOCK_R=2, BLOCK_H=16, BLOCK_C=16, BLOCK_T=1, BARRIER=True,
                       DEQUANTIZE=False), 1),
    "topk_reduce": (dict(RET_AT_ADDRESS=True, HAS_TOKEN=True, READ_AT_SLOT_DST=False, K=2, HAS_SLOT_DST=True,
                         HAS_WEIGHTS=True, SAVE_RETURNED=True, ACC_DTYPE="tl.float32", BLOCK_T=8, BLOCK_H=16,
                         BARRIER=True), 1),
    "seq_post": (dict(Q0=16, Q1=16, Q2=16, TENSORS=3, SPLIT_FIRST=True, WRITE_HEADER=True, BLOCK_R=4, BLOCK_Q=16,
                      BARRIER=True), 1),
}


def test_barrier_deadline_is_an_int32_of_milliseconds():
    # Inductor (torch 2.11) fails to compile a graph that passes a user kernel a Python int of 32
    # bits or more ('int' object has no attribute 'xreplace'): the default 600 s in ns did, on
    # the H200. Every deadline set_timeout takes reaches the kernel below 2**31, rounded up.
    from alltoall_ops.comm import MAX_TIMEOUT_S
    from alltoall_ops.kernels.barrier import MAX_DEVICE_TIMEOUT_MS, _device_timeout_ms

    assert MAX_DEVICE_TIMEOUT_MS == 2**31 - 1
    assert _device_timeout_ms(600.0) == 600_000
    assert _device_timeout_ms(0.0001) == 1 and _device_timeout_ms(2.0005) == 2001
    assert _device_timeout_ms(MAX_TIMEOUT_S) == MAX_DEVICE_TIMEOUT_MS


_FUSED_WORLD_SIZES = (2, 4)


@cache
def _clock_reads_and_asserts() -> dict:
    """{(kernel, W): [timer reads, asserts] in its PTX} for each kernel of ``_FUSED``."""
    return _each_without_interpreter(_BARRIER_PTX, {(kernel, W): [kernel, W, constexprs] for kernel, (constexprs, _)
                                                    in _FUSED.items() for W in _FUSED_WORLD_SIZES})


@pytest.mark.parametrize("kernel", sorted(_FUSED))
@pytest.mark.parametrize("world_size", _FUSED_WORLD_SIZES)
def test_barrier_reads_the_clock_in_every_wait_loop(kernel, world_size):
    # The deadline's clock is pure asm (so that inductor's analysis above passes), which the
    # compiler may hoist out of a loop unless its operand changes there: chained on the previous
    # reading, it is read once at the start of a barrier and once in each of its 2 * W wait loops
    # (one timer read in all would be a barrier that never times out), in the barrier kernel and
    # in the kernels that fuse barriers. PTX for sm_90, built on the CPU.
    barriers = _FUSED[kernel][1]
    out = _case_result(_clock_reads_and_asserts(), (kernel, world_size))
    timer_reads, asserts = out
    assert timer_reads == barriers * (1 + 2 * world_size), out
    assert asserts >= barriers * (1 + 2 * world_size), "the deadline's assert in every wait loop, and the stamps'"


_PTX_OPS = _SM90_PTX + """
import collections, re
from alltoall_ops.kernels import quantize, row_put, topk_reduce


def op_counts(kernel, constexprs, pointers, *warps):  # pointers: {name: type} where not *i64
    kernel = {"pull_rows": row_put._pull_rows_kernel, "put_rows": row_put._put_rows_kernel,
              "post_slots": row_put._post_slots_kernel, "quantize_rows": quantize._quantize_rows_kernel,
              "topk_reduce": topk_reduce._topk_reduce_kernel}[kernel]
    constexprs = constants(constexprs)
    names = [n for n in kernel.arg_names if n not in constexprs]
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "*i64") if n.endswith("_ptr")
                 else "i32" for n in kernel.arg_names}
    # as a launch specializes them: tensors 16-byte aligned, ints divisible by 16 (H = 7168)
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in ("ret_index", "tags_index")}
    ptx = sm90_ptx(kernel, signature, constexprs, attrs, num_warps=warps[0] if warps else 8)
    return collections.Counter(re.findall(
        r"(?:ld|st)\\.global[\\w.]*|cvt\\.rn\\.[\\w.]+|(?:ld|st)\\.shared|shfl\\.sync|bar\\.sync", ptx))


each_case(op_counts)
"""
"""Each case's PTX op counts: global loads and stores by width, float conversions, shared-memory
loads and stores, warp shuffles and barriers."""


def _ptx_ops(cases: list) -> list:
    """``_PTX_OPS``' op counts of each case [kernel, constexprs, pointers(, num_warps)], in order."""
    results = _each_without_interpreter(_PTX_OPS, dict(enumerate(cases)), timeout=600)
    return [_case_result(results, i) for i in results]


def test_rows_reached_by_address_move_as_vectors():
    # A region's base is read from memory, which tells the compiler nothing of its alignment: the
    # reduction's returned rows with peers loaded as 2-byte scalars (12.6 us against one rank's
    # 4.4 for the same rows, H100, T = 128, H = 7168) until the kernel declared the base 16-byte
    # aligned (regions are 256-byte aligned). Each kernel reaching its rows by address loads and
    # stores them as wide as when it gets them as a tensor. PTX for sm_90, built on the CPU.
    rows = dict(K=8, BLOCK_H=1024, ACC_DTYPE="tl.float32")
    reduce = dict(rows, HAS_TOKEN=True, HAS_SLOT_DST=True, HAS_WEIGHTS=True, SAVE_RETURNED=False, BLOCK_T=2,
                  BARRIER=False, WORLD_SIZE=2)
    pull = dict(rows, HAS_SCALE=False, HAS_TAIL=False, BLOCK_R=4, BLOCK_T=1,
                BLOCK_C=row_piece(RowBlocks(4, 1024, 8), 2),
                BARRIER=False, WORLD_SIZE=2, DEQUANTIZE=False)
    bf16 = "*bf16"
    cases = [["topk_reduce", dict(reduce, RET_AT_ADDRESS=True, READ_AT_SLOT_DST=False), dict(y_ptr=bf16)],
             ["topk_reduce", dict(reduce, RET_AT_ADDRESS=False, READ_AT_SLOT_DST=False),
              dict(ret_ptr=bf16, y_ptr=bf16)],
             # tail_ptr: unused without HAS_TAIL, typed as out_ptr; the pull from the senders' tags
             ["pull_rows", dict(pull, ROW_MAP=False, STAGED=True), dict(out_ptr=bf16, tail_ptr=bf16)],
             ["pull_rows", dict(pull, ROW_MAP=False, STAGED=False), dict(rows_ptr=bf16, out_ptr=bf16, tail_ptr=bf16)]]
    accesses = _ptx_ops(cases)
    by_address, by_tensor = accesses[::2], accesses[1::2]
    for kernel, address, tensor in zip(("topk_reduce", "pull_rows"), by_address, by_tensor):
        wide = {a: n for a, n in tensor.items() if ".v4." in a}
        assert wide, (kernel, tensor)
        assert {a: n for a, n in address.items() if ".v4." in a} == wide, (kernel, address, tensor)
        assert not any(a.endswith(".b16") for a in address), (kernel, address)


def test_movers_reach_their_peers_without_reducing_across_threads():
    # Each row's peer base (put_rows' destination, the pull's stage) is a load from the (W,)
    # address table. A select over the table held in registers summed a [rows, W] tile across
    # warps: shuffles and a shared-memory round trip behind a second barrier a row block, which
    # kept a program's warps in step. On 8 programs of an H100 the pull moved 656 / 498 / 395 /
    # 275 GB/s at W = 1 / 2 / 4 / 8 that way, 523-532 at every W with the load (docs/benchmarks.md,
    # twentieth session). The pull loads each slot's tag as a [rows] vector where it uses it, never
    # picking it out of a [rows, K] tile (a sum across threads per slot and step). At the budget
    # tiles, W = 8, PTX for sm_90 built on the CPU: no shuffle, no shared memory, no barrier.
    (pull_r, pull_h, pull_warps), (put_r, put_h, put_warps) = (BUDGET_BLOCKS[k] for k in ("pull_tokens", "put_rows"))
    pull = dict(K=8, ROW_MAP=False, STAGED=True, HAS_SCALE=False, ACC_DTYPE="tl.float32",
                HAS_TAIL=False, BLOCK_R=pull_r, BLOCK_H=pull_h, BARRIER=False, WORLD_SIZE=8, DEQUANTIZE=False,
                BLOCK_C=row_piece(RowBlocks(pull_r, pull_h, pull_warps), 2), BLOCK_T=1)
    put = dict(K=8, DST_STRIDE=4096, HAS_SCALE=False, ONE_OUT=False, HAS_COUNT=True, ACC_DTYPE="tl.float32",
               BLOCK_R=put_r, BLOCK_H=put_h, BARRIER=False, WORLD_SIZE=8)
    cases = [["pull_rows", pull, dict(out_ptr="*bf16", tail_ptr="*bf16"), pull_warps],
             ["put_rows", put, dict(src_ptr="*bf16", out_ptr="*bf16", scale_ptr="*fp32"), put_warps]]
    pull_ops, put_ops = _ptx_ops(cases)
    for ops in (pull_ops, put_ops):
        assert ops.get("ld.global.v4.b32"), ops  # the rows move (as vectors)
        assert not {op: n for op, n in ops.items() if op.startswith("shfl") or ".shared" in op}, ops
        assert not ops.get("bar.sync"), ops


@pytest.mark.parametrize("tiles", ["GPU", "budget"])
def test_the_pulls_pieces_give_each_thread_its_own_16_bytes(tiles):
    # The pull's step is pieces of [BLOCK_R, BLOCK_C] (row_put.row_piece), laid out 16 bytes a
    # thread with the warps on rows. A piece with fewer 16-byte vectors than the program has
    # threads is held twice over (Triton replicates it): those threads load and store the same
    # bytes again. Every pull tile, bf16 and fp8 wire rows (1-byte elements), as pull_rows launches it.
    # Without a budget the token pull spreads (BLOCK_R halved down to 1, ``row_blocks(spread=True)``).
    table = GPU_BLOCKS if tiles == "GPU" else BUDGET_BLOCKS
    for key, element_sizes in (("pull_tokens", (2,)), ("pull_tokens_fp8", (1,)), ("pull_rows", (1, 2))):
        largest, block_h, warps = table[key]
        spreads = tiles == "GPU" and key != "pull_rows"
        for block_r in [r for r in (1, 2, 4, 8, 16, 32) if r <= largest] if spreads else [largest]:
            for element_size in element_sizes:
                blocks = RowBlocks(block_r, block_h * 2 // element_size, warps)
                block_c = row_piece(blocks, element_size)
                assert blocks.BLOCK_H % block_c == 0, (key, blocks, block_c)
                assert block_r * block_c * element_size // 16 >= 32 * warps, (key, blocks, block_c)


@given(items=st.integers(1, 1 << 16), key=st.sampled_from(["pull_tokens", "pull_tokens_fp8", "pull_tokens_dequantize"]),
       budget=st.sampled_from([None, 16, 32]))
def test_a_small_token_pull_spreads_over_the_gpu(items, key, budget):
    # The fp8 wire rows' GPU tile takes 4 tokens a program (the best at T = 4096). At T = 128, W = 2
    # that is 64 programs on 132 SMs: the dispatch took 3-4% longer than with the pull's old step,
    # one token a program (H100, twenty-eighth session), and spread takes 2.5% off it (twenty-ninth).
    # A spread launch halves the tokens a program until the grid has SPREAD_PROGRAMS programs or a
    # program takes one token; a budget's tile never spreads.
    with mock.patch.object(_config, "interpreting", lambda: False):
        blocks = _config.row_blocks(key, items, 7168, 1, budget, spread=True)
        table_r = (_config.BUDGET_BLOCKS if budget else GPU_BLOCKS)[key][0]
        assert blocks == dataclasses.replace(_config.row_blocks(key, items, 7168, 1, budget), BLOCK_R=blocks.BLOCK_R)
    if budget is not None:
        assert blocks.BLOCK_R == table_r
    else:
        assert table_r % blocks.BLOCK_R == 0 and blocks.BLOCK_R & (blocks.BLOCK_R - 1) == 0, blocks
        programs = -(-items // blocks.BLOCK_R)
        assert blocks.BLOCK_R == 1 or programs >= _config.SPREAD_PROGRAMS, (items, blocks)
        assert blocks.BLOCK_R == table_r or -(-items // (2 * blocks.BLOCK_R)) < _config.SPREAD_PROGRAMS, (items, blocks)


def test_a_pull_thread_loads_one_tokens_tags_however_many_tokens_a_program_takes():
    # Under an SM budget one program an SM takes many tokens a step. A [BLOCK_R, BLOCK_H] step
    # spread a row's columns over the warps, so each thread held a vector of several tokens' rows
    # and, for each of the K slots, loaded, compared and addressed every one of their tags: on 16
    # / 32 programs of an H100 the pull moved 0.33 / 0.38 of a plain gather's GB/s (W = 4;
    # docs/benchmarks.md, twenty-fifth session; ncu on Triton 3.6: issue-bound, 669 instructions a
    # step, twenty-sixth). With [BLOCK_R, BLOCK_C] pieces whose warps lie on rows a thread holds one
    # token's row, and its 8-byte loads (tags, header, stage base) do not grow with the tokens a
    # program takes. PTX for sm_90 at 16 and 32 tokens a program, 32 warps, on the CPU.
    pull = dict(K=8, ROW_MAP=False, STAGED=True, HAS_SCALE=False, ACC_DTYPE="tl.float32", HAS_TAIL=False,
                BLOCK_H=2048, BARRIER=False, WORLD_SIZE=4, DEQUANTIZE=False)
    cases = [["pull_rows", dict(pull, BLOCK_R=rows, BLOCK_C=row_piece(RowBlocks(rows, 2048, 32), 2), BLOCK_T=1),
              dict(out_ptr="*bf16", tail_ptr="*bf16"), 32] for rows in (16, 32)]
    loads = [sum(n for op, n in ops.items() if op.startswith("ld.global") and op.endswith("b64") and ".v" not in op)
             for ops in _ptx_ops(cases)]
    assert loads[0] == loads[1], loads


def test_the_quantizing_post_stores_its_rows_as_the_quantize_does():
    # The fp8 dispatch with peers quantizes each token in its post, straight into the stage. With
    # the wire rows' stride computed in the kernel (H + H / 32 bytes) the compiler knew them only
    # 4-byte aligned: each thread stored its values as 16 single bytes, and the post took 67 us a
    # rank where quantize_rows and the tags' post take about 39 and 6 (H100, T = 4096, H = 7168,
    # W = 2; docs/benchmarks.md, twenty-third session). With the stride an argument (a multiple
    # of 16 at H = 7168, as a launch tells the compiler) the post loads and stores a tile as the
    # quantize kernel does. PTX for sm_90 at the post's GPU tile, built on the CPU.
    from alltoall_ops.kernels.quantize import POST_BLOCK_R as block_r, POST_NUM_WARPS as warps

    quantize = dict(FP8_MAX=448.0, AMAX_FLOOR=1e-4, BLOCK_R=block_r, BLOCK_C=128)
    post = dict(K=8, DST_STRIDE=4096, HAS_SCALE=False, STAGE=True, QUANTIZE=True, ACC_DTYPE="tl.float32",
                BLOCK_R=block_r, BLOCK_H=128, BLOCK_S=64, BARRIER=False, WORLD_SIZE=2)
    cases = [["quantize_rows", quantize, dict(x_ptr="*bf16", values_ptr="*u8", scales_ptr="*fp32"), warps],
             ["post_slots", post, dict(src_ptr="*bf16"), warps]]
    quantize_ops, post_ops = _ptx_ops(cases)

    def rows(ops):  # the tile's accesses (the post's tags and token are 8-byte)
        return {op: n for op, n in ops.items() if op.startswith(("ld.global", "st.global")) and not op.endswith("b64")}

    assert rows(quantize_ops).get("st.global.v4.b32"), quantize_ops  # the values as vectors
    assert rows(post_ops) == rows(quantize_ops), (post_ops, quantize_ops)


def test_the_dequantizing_pull_loads_each_block_scale_once_and_converts_in_hardware():
    # fp8 wire rows dequantized as they move (dispatch(dequantize=True), fp8 training): each
    # 128-column block's fp32 scale is loaded once per row and broadcast over its columns (loaded
    # per column, it was one scalar load per byte of the row: 64 a thread), and the values convert
    # with the GPU's instructions, fp8 pairs to halves and fp32 pairs to bf16 (decoded from the
    # bits and rounded in integer maths, as in Triton's interpreter, the pull needed 153
    # registers a thread at its old tile, and its dispatch took 2.4x the bf16 dispatch's time).
    tile = dict(BLOCK_R=4, BLOCK_H=1024)  # the GPU tile of pull_rows for 4-byte elements (fp32 products)
    threads = 8 * 32
    pull = dict(tile, K=8, ROW_MAP=False, STAGED=True, HAS_SCALE=False, ACC_DTYPE="tl.float32",
                HAS_TAIL=True, BLOCK_C=tile["BLOCK_H"], BLOCK_T=1, BARRIER=False, WORLD_SIZE=2, DEQUANTIZE=True)
    pointers = dict(out_ptr="*bf16", tail_ptr="*u8", rows_ptr="*u8")
    (accesses,) = _ptx_ops([["pull_rows", pull, pointers]])
    scale_loads = accesses.get("ld.global.b32", 0)
    block_scales = tile["BLOCK_R"] * tile["BLOCK_H"] // 128
    assert 0 < scale_loads <= -(-block_scales // threads) * 4, accesses  # a few per thread, not one per column
    values_per_thread = tile["BLOCK_R"] * tile["BLOCK_H"] // threads
    assert accesses.get("cvt.rn.f16x2.e4m3x2", 0) == values_per_thread // 2, accesses
    assert accesses.get("cvt.rn.bf16x2.f32", 0) == values_per_thread // 2, accesses


_KERNEL_RESOURCES = """
import json, sys, triton  # (triton first: alltoall_ops then compiles its kernels instead of interpreting them)
sys.path.insert(0, json.loads(sys.argv[1]))  # the repo root, for tools/
from tools.kernel_resources import measure_all
print(json.dumps([[r.case, r.kind, r.problems()] for r in measure_all()]))
"""


def test_every_data_moving_kernel_fits_its_tiles():
    # Each data-moving kernel at the tiles it launches with on an H100 / H200, built for sm_90 on
    # the CPU (tools/kernel_resources.py: Triton's cubin, cuobjdump's resource usage): no spills,
    # and at a GPU tile (one of many programs on an SM) two programs' registers fit an SM. The
    # dequantizing pull's old tile used 150 registers a thread (one program an SM), and its
    # dispatch took 2.4x the bf16 dispatch's time on an H200.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tiles = json.loads(_without_interpreter(_KERNEL_RESOURCES, root, timeout=900))
    assert sum(kind == "GPU" for _, kind, _ in tiles) >= 10, tiles  # every case ran
    assert sum(kind == "spread" for _, kind, _ in tiles) == 3, tiles  # the token pull's payloads
    assert not [tile for tile in tiles if tile[2]], [tile for tile in tiles if tile[2]]


@pytest.mark.parametrize("field, kernel_says, message", [
    ("advance_before", "one_program", "in a kernel that"),
    ("advance_after", "advances", "in a kernel whose barrier"),
])
@pytest.mark.parametrize("flag", [False, True])
def test_an_epilogue_goes_only_into_a_kernel_that_runs_it_so(field, kernel_says, message, flag):
    # Epilogue.advance_before puts the barrier before the writes into the kernel too: only a
    # one-program kernel (put_meta) can run it for every program. Epilogue.advance_after: the
    # barrier after the writes sets the call number (the Ulysses exchange's one barrier, fused
    # into its post, whose programs read the count first). The other kernels refuse either, and
    # those two refuse an epilogue without it.
    from alltoall_ops.kernels.barrier import Epilogue, epilogue_args

    t = torch.zeros(2, dtype=torch.int64)
    epilogue = Epilogue(t, t.view(1, 2), 0, 1.0, 1, t[:1], **{field: flag})
    assert epilogue_args(epilogue, t, **{kernel_says: flag})["BARRIER"]
    with pytest.raises(ValueError, match=f"{field}={flag} {message}"):
        epilogue_args(epilogue, t, **{kernel_says: not flag})


def test_an_epilogue_run_alone_advances_the_call_as_its_kernel_would(monkeypatch):
    # A kernel with nothing to do launches its epilogue's barrier alone (its peers still meet it):
    # an epilogue that advances the call number after the writes (the Ulysses post's) advances it
    # there too, through the counters' address table; the others only read call_1.
    from alltoall_ops.kernels import barrier as barrier_module

    counters_passed = []
    monkeypatch.setattr(barrier_module, "barrier", lambda *args: counters_passed.append(args[5]))
    t = torch.zeros(2, dtype=torch.int64)
    counters = t.view(1, 2)
    for advance_after in (False, True):
        epilogue = barrier_module.Epilogue(t, counters, 0, 1.0, 1, t[:1], advance_after=advance_after)
        barrier_module.barrier_alone(epilogue)
    assert counters_passed[0] is None and counters_passed[1] is counters
