"""The SM budget of the symm_mem kernels (``max_programs`` of the launchers, ``SymmBuffers(num_sms=)``).

Each capped launcher, with ``max_programs`` 1, 2 and 3, writes exactly what it writes uncapped:
the row blocks are made tiny (4 rows, 4 columns, 64 for wide rows: ``_tiny_blocks``) so that a few rows make
several row blocks, a number that is no multiple of the cap, and some launches have two column
blocks. Zero rows, a device-side count below the rows (put_rows ``count=``, pull_rows'
``num_routed``, fp8 rows dequantized too) included. fp64 values (bf16 for the fp8 kernels' input).
"""

from __future__ import annotations

import pytest
import torch

import alltoall_ops as a2a
from alltoall_ops import fp8
from alltoall_ops.backends.symm_mem import run_simulated
from alltoall_ops.kernels import loader
from alltoall_ops.kernels.region import Region
from alltoall_ops.payload import pack

needs_interpreter = pytest.mark.skipif(
    not loader.load().interpreting(), reason="the kernels run on CPU tensors only in Triton's interpreter"
)
pytestmark = needs_interpreter

CAPS = [1, 2, 3]
ROWS = [0, 5, 13]  # 0, 2 and 4 row blocks of 4 rows
F64 = dict(dtype=torch.float64)


@pytest.fixture(autouse=True)
def _tiny_blocks(monkeypatch):
    """4 x 4 blocks for the kernels that take theirs from ``row_blocks``; the fp8 kernels take
    their GPU blocks (8 rows, one 128-channel block a program), under a budget too."""
    from alltoall_ops.kernels import _config, quantize, row_put, topk_reduce, weight_grad

    def tiny(kernel, n_rows, H, element_size=2, max_programs=None, spread=False):  # 64 columns for fp8 rows (H = 128)
        return _config.RowBlocks(4, 4 if H < 64 else 64, 1)

    for module in (row_put, topk_reduce, weight_grad):
        monkeypatch.setattr(module, "row_blocks", tiny)
    monkeypatch.setattr(quantize, "interpreting", lambda: False)
    monkeypatch.setattr(quantize, "BUDGET_BLOCK_R", quantize.GPU_BLOCK_R)


def _same(got: tuple, want: tuple) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def test_program_grid():
    from alltoall_ops.kernels._config import program_grid

    assert program_grid(7, 2) == (7, 2)  # None: today's grid
    assert program_grid(7, 1, 3) == (3, 1)
    assert program_grid(7, 2, 3) == (3, 1)  # rows first; every kernel strides over the columns too
    assert program_grid(7, 2, 8) == (7, 1)
    assert program_grid(2, 7, 8) == (2, 4)  # few rows (decode): column programs take the rest
    assert program_grid(2, 1, 3) == (2, 1)  # fewer blocks than the budget: one program each
    assert program_grid(0, 1, 3) == (0, 1)
    for rows, cols, cap in [(7, 2, 1), (2, 7, 3), (1, 16, 8), (64, 7, 24)]:
        r, c = program_grid(rows, cols, cap)
        assert r * c <= cap and r >= 1 and c >= 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_programs"):
            program_grid(7, 1, bad)


@pytest.mark.parametrize("H", [3, 6])  # one and two column blocks
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("count", [None, 0, 6])  # a device-side count below the rows
def test_put_rows(n, H, count):
    k = loader.load()
    K, rows_out = 2, 20
    g = torch.Generator().manual_seed(n * 10 + H)
    src = torch.randn(n // K + 1, H, generator=g, **F64)
    scale = torch.randn(n, generator=g, **F64)
    dst = torch.randperm(rows_out, generator=g)[:n]
    dst[::3] = -1
    count_1 = None if count is None else torch.tensor([count])

    def run(max_programs):
        out = torch.full((rows_out, H), float("nan"), **F64)
        buf = torch.full((rows_out, H), float("nan"), **F64)
        k.put_rows(src, dst, rows_out, out=out, top_k=K, scale=scale, acc_dtype=torch.float64, count=count_1,
                   max_programs=max_programs)
        k.put_rows(src, dst, rows_out, torch.tensor([buf.data_ptr()]), top_k=K, count=count_1,
                   max_programs=max_programs)
        return out, buf

    want = run(None)
    for cap in CAPS:
        _same(run(cap), want)


@pytest.mark.parametrize("H", [3, 6])  # one and two column blocks
@pytest.mark.parametrize("n", ROWS)
def test_post_slots(n, H):
    k = loader.load()
    K, rows_out, W = 2, 20, 2
    g = torch.Generator().manual_seed(n * 10 + H)
    src = torch.randn(n // K + 1, H, generator=g, **F64)
    scale = torch.randn(n, generator=g, **F64)
    dst = torch.randperm(W * rows_out, generator=g)[:n]
    dst[::3] = -1

    def run(max_programs):
        stages = torch.full((W, rows_out, H), float("nan"), **F64)
        tags = torch.full((W, 1 + n, 3), -7)
        k.post_slots(src, dst, rows_out, torch.tensor([t.data_ptr() for t in tags]), dst.flip(0), rank=1,
                     tag_base=100, top_k=K, scale=scale, stage_table=torch.tensor([t.data_ptr() for t in stages]),
                     acc_dtype=torch.float64, max_programs=max_programs)
        return stages, tags

    want = run(None)
    assert torch.equal(want[0][1, : src.shape[0]], src)  # this rank's rows, staged once each
    # this rank's tags alone: the header (rows, K), then each slot's destination, source code, scale bits
    assert (want[1][0] == -7).all() and want[1][1, 0, :2].tolist() == [src.shape[0], K]
    assert torch.equal(want[1][1, 1:], torch.stack([dst, 100 + dst.flip(0), scale.view(torch.int64)], 1))
    for cap in CAPS:
        _same(run(cap), want)


@pytest.mark.parametrize("n", ROWS)
def test_post_slots_quantizing(n):
    # The fp8 dispatch's post with peers: each row quantized into this rank's stage (fp8.quantize's
    # bits and scales, packed as one wire row) and the tags the plain post writes, in one launch,
    # the same under every budget; without a stage it raises before any launch.
    k = loader.load()
    K, rows_out, W, H = 2, 20, 2, 256  # two channel blocks
    g = torch.Generator().manual_seed(n)
    src = torch.randn(n // K + 1, H, generator=g).bfloat16()
    dst = torch.randperm(W * rows_out, generator=g)[:n]
    dst[::3] = -1

    def run(max_programs, quantize=True):
        stages = torch.zeros(W, rows_out, fp8.packed_width(H), dtype=torch.uint8)
        tags = torch.full((W, 1 + n, 3), -7)
        k.post_slots(src, dst, rows_out, torch.tensor([t.data_ptr() for t in tags]), dst.flip(0), rank=1,
                     tag_base=100, top_k=K, stage_table=torch.tensor([t.data_ptr() for t in stages]) if quantize
                     else None, max_programs=max_programs, quantize=quantize)
        return stages, tags

    want = run(None)
    assert torch.equal(want[0][1, : src.shape[0]], pack(*fp8.quantize(src)))  # this rank's rows, once each
    assert torch.equal(want[1], run(None, quantize=False)[1])  # the plain post's tags
    for cap in CAPS:
        _same(run(cap), want)
    with pytest.raises(ValueError, match="quantize needs a stage"):
        k.post_slots(src, dst, rows_out, torch.zeros(W, dtype=torch.int64), dst, rank=1, tag_base=0, quantize=True)


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("C", ROWS)
def test_pull_rows(C, tail):
    # One sender's tags (K = 2): a token block at a time, each token's row stored into its rows
    # here; the padding rows zeroed by the programs in turn.
    k = loader.load()
    X, x_out, T, K = 6, 4, 7, 2
    g = torch.Generator().manual_seed(C)
    rows = torch.randn(T, X, generator=g, **F64)
    n_pad = min(C, 2)
    dst = torch.full((T * K,), -1)
    mine = torch.randperm(T * K, generator=g)[: C - n_pad]
    dst[mine] = n_pad + torch.arange(mine.numel())  # rows [n_pad, C) from the slots, [0, n_pad) padding
    tags = torch.cat([torch.tensor([[T, K, 0]]), torch.stack([dst, torch.arange(T * K), 0 * dst], 1)])
    pads = torch.tensor([0, 0, 1, n_pad])  # two experts' padding rows: [0, 1) and [0 + 1, n_pad)

    def run(max_programs):
        out = torch.full((C, x_out if tail else X), float("nan"), **F64)
        rest = torch.full((C, X - x_out), float("nan"), **F64) if tail else None
        row_src = torch.full((C,), -7)
        k.pull_rows(Region.of(tags), torch.tensor([C]), out, row_src, rows=rows, tail=rest, dst_stride=max(C, 1),
                    pads=pads, top_k=K, tokens=2, max_programs=max_programs)
        return out, row_src, *(() if rest is None else (rest,))

    want = run(None)
    whole = torch.cat(want[::2], 1) if tail else want[0]
    assert torch.equal(whole[n_pad:], rows[mine.sort().indices.new_tensor(mine.tolist()) // K])
    assert (whole[:n_pad] == 0).all() and torch.equal(want[1], torch.cat([torch.full((n_pad,), -1), mine]))
    for cap in CAPS:
        _same(run(cap), want)


@pytest.mark.parametrize("H", [3, 6])
@pytest.mark.parametrize("T", ROWS)
def test_topk_reduce(T, H):
    k = loader.load()
    K = 3
    N = T * K
    g = torch.Generator().manual_seed(T * 10 + H)
    ret = torch.randn(N, H, generator=g, **F64)
    position = torch.randperm(N, generator=g).view(T, K)
    slot_dst = torch.randint(-1, 4, (N,), generator=g)
    weights = torch.randn(T, K, generator=g, **F64)

    def run(max_programs):
        y, returned = torch.full((T, H), float("nan"), **F64), torch.full((N, H), float("nan"), **F64)
        k.topk_reduce(ret, position, slot_dst, weights, y, returned, torch.float64, num_valid=N - N // 3,
                      max_programs=max_programs)
        return y, returned

    want = run(None)
    for cap in CAPS:
        _same(run(cap), want)


@pytest.mark.parametrize("T", ROWS)
def test_weight_grad(T):
    k = loader.load()
    K, H = 2, 6
    g = torch.Generator().manual_seed(T)
    grad_y = torch.randn(T, H, generator=g, **F64)
    returned = torch.randn(T * K, H, generator=g, **F64)
    position = torch.randperm(T * K, generator=g).view(T, K)

    def run(max_programs):
        grad_w = torch.full((T, K), float("nan"), **F64)
        k.weight_grad(grad_y, returned, position, grad_w, torch.float64, max_programs=max_programs)
        return (grad_w,)

    want = run(None)
    for cap in CAPS:
        _same(run(cap), want)


@pytest.mark.parametrize("H", [128, 256])  # one and two 128-channel blocks
@pytest.mark.parametrize("T", [0, 5, 21])  # 0, 1 and 3 blocks of 8 rows
def test_fp8_rows(T, H):
    k = loader.load()
    g = torch.Generator().manual_seed(T + H)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    values, scales = k.quantize_rows(x)
    for cap in CAPS:
        _same(k.quantize_rows(x, max_programs=cap), (values, scales))
    wire = torch.cat([values, scales.view(torch.uint8)], 1)  # the fp8 rows as symm_mem moves them
    for n in sorted({0, T // 2 + 1, T}):
        def run(max_programs, n=n):  # the pull that dequantizes them (rows < n)
            out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
            k.pull_rows(None, torch.tensor([n]), out, torch.empty(T, dtype=torch.int64), rows=wire,
                        row_map=torch.arange(T), position=torch.arange(T), tail=torch.empty_like(wire[:, H:]),
                        dequantize=True, max_programs=max_programs)
            return (out,)

        want = run(None)
        for cap in CAPS:
            _same(run(cap), want)


# --------------------------------------------------------------------------------------------
# SymmBuffers(num_sms=)


def _buffers(**kwargs) -> a2a.SymmBuffers:
    return a2a.SymmBuffers(4, 8, 2, 4, dtype=torch.float32, device="cpu", **kwargs)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_buffers_reject_a_bad_num_sms(bad):
    with pytest.raises(ValueError, match=r"num_sms: expected a positive int, got"):
        _buffers(num_sms=bad)
    with pytest.raises(ValueError, match="num_sms"):
        a2a.SymmBuffers.simulated(2, 4, 8, 2, 4, dtype=torch.float32, device="cpu", num_sms=bad)


def test_buffers_take_num_sms():
    bufs = _buffers()
    assert bufs.num_sms is None and "num_sms" not in repr(bufs)
    bufs = _buffers(num_sms=16)
    assert bufs.num_sms == 16 and repr(bufs).endswith(", num_sms=16)")
    assert bufs._config_key[-2] == 16  # the key compiled code names the buffers by
    assert a2a.SymmBuffers._compiled(*_key_of(bufs)) is bufs
    simulated = a2a.SymmBuffers.simulated(2, 4, 8, 2, 4, dtype=torch.float32, device="cpu", num_sms=3)
    assert [b.num_sms for b in simulated] == [3, 3]


def _key_of(bufs: a2a.SymmBuffers) -> tuple:
    bufs.__fx_repr__()
    return bufs._key, bufs._config_key


@pytest.mark.parametrize("payload", ["plain", "fp8"])
def test_symm_mem_step_under_a_budget(payload):
    """A training step of W = 2 simulated ranks (dispatch, combine, backward) gives the same
    results, bit for bit, on buffers with num_sms 1 and 3 as on buffers without a budget (the
    tiny blocks make several row blocks of each launch)."""
    W, T, K, E = 2, 7, 3, 4
    fp8 = payload == "fp8"
    H, dtype = (128, torch.bfloat16) if fp8 else (6, torch.float64)

    def step(rank: int, bufs: a2a.SymmBuffers) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
        topk_idx = torch.randint(-1, E, (T, K), generator=g)
        weights = torch.rand(T, K, generator=g, dtype=torch.float64 if not fp8 else torch.float32).requires_grad_()
        extra = dict(payload_dtype=torch.float8_e4m3fn, dequantize=True) if fp8 else {}
        routed, tokens_per_expert, handle = a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs, **extra)
        n = int(tokens_per_expert.sum())
        rows = torch.arange(routed.shape[0])[:, None] < n  # rows past n are unspecified
        y = a2a.combine(torch.where(rows, routed * 2 + 1, 0), handle, weights)
        y.backward(torch.randn(T, H, generator=g).to(dtype))
        return [routed[:n].detach(), tokens_per_expert, y.detach(), x.grad, weights.grad]

    def run(num_sms):
        extra = dict(payload_dtype=torch.float8_e4m3fn) if fp8 else {}
        bufs = a2a.SymmBuffers.simulated(W, T, H, K, E, dtype=dtype, device="cpu", num_sms=num_sms, **extra)
        return run_simulated(step, bufs)

    want = run(None)
    for num_sms in (1, 3):
        for got_rank, want_rank in zip(run(num_sms), want):
            _same(got_rank, want_rank)


@pytest.mark.parametrize("payload", ["plain", "fp8"])
def test_every_launch_of_a_step_obeys_the_budget(monkeypatch, payload):
    """Every kernel launch of a simulated W = 2 training step (plan, metadata, puts, copy-out,
    reduce, fp8 quantize / dequantize, the weights' gradient) has at most num_sms programs, read
    from the interpreter's grid; without a budget some launches have more (the check can fail)."""
    from triton.runtime import interpreter

    grids: list[int] = []
    builder = interpreter.interpreter_builder
    set_grid_dim = builder.set_grid_dim

    def recording(nx, ny, nz):
        grids.append(nx * ny * nz)
        return set_grid_dim(nx, ny, nz)

    monkeypatch.setattr(builder, "set_grid_dim", recording)
    fp8 = payload == "fp8"
    W, T, K, E = 2, 9, 3, 4
    H, dtype = (256, torch.bfloat16) if fp8 else (8, torch.float32)
    extra = dict(payload_dtype=torch.float8_e4m3fn) if fp8 else {}

    def step(rank: int, bufs: a2a.SymmBuffers) -> None:
        x = torch.randn(T, H).to(dtype).requires_grad_()
        weights = torch.rand(T, K, requires_grad=True)
        routed, tpe, handle = a2a.dispatch(x, torch.randint(0, E, (T, K)), num_experts=E, buffers=bufs,
                                           dequantize=fp8, **extra)
        rows = torch.arange(routed.shape[0])[:, None] < tpe.sum()
        a2a.combine(torch.where(rows, routed, 0), handle, weights).float().sum().backward()

    for num_sms in (None, 1, 3):
        grids.clear()
        run_simulated(step, a2a.SymmBuffers.simulated(W, T, H, K, E, dtype=dtype, device="cpu", num_sms=num_sms,
                                                      **extra))
        assert len(grids) > 10
        if num_sms is None:
            assert max(grids) > 3
        else:
            assert max(grids) <= num_sms, grids
