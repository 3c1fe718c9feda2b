"""fp8 dispatch with block scales: the rounding kernel against torch's float8_e4m3fn cast, the
quantize kernel against ``fp8.quantize`` (Triton's interpreter), dispatch's fp8
modes on W = 1, 2, 4 gloo ranks against the plain reference of the dequantized rows (exact),
the straight-through gradient, the error bound against bf16, argument errors on every rank, and
one compilation across routings. The symm_mem backend's fp8 path: tests/test_symm_fp8.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo.testing
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import alltoall_ops as a2a
from alltoall_ops import fp8, layout
from alltoall_ops.errors import GroupMismatchError, PeerInputError
from alltoall_ops.kernels import loader
from alltoall_ops.kernels.region import Region
from alltoall_ops.kernels.quantize import e4m3_bits
from alltoall_ops.reference import reference_dispatch

FRESH = settings(max_examples=40, deadline=None, derandomize=False,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


@triton.jit
def _e4m3_bits_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    tl.store(out_ptr + o, e4m3_bits(tl.load(v_ptr + o, mask=m, other=0)), mask=m)


def _kernel_bits(v: torch.Tensor) -> torch.Tensor:
    out = torch.empty(v.numel(), dtype=torch.uint8)
    _e4m3_bits_kernel[(1,)](v, out, v.numel(), BLOCK=triton.next_power_of_2(v.numel()))
    return out


def test_rounding_equals_torch_at_every_code_boundary():
    """Every positive finite fp8 value, the midpoints between neighbours (ties go to even) and
    one fp32 step either side of each, with both signs: the kernel's bits are torch's."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(fp8.FP8).float()  # 0 .. 448
    mids = (codes[:-1] + codes[1:]) / 2  # exact in fp32
    around = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    v = torch.cat([codes, around, torch.tensor([0.0, 1e-30, 448.0])])
    v = torch.cat([v, -v]).contiguous()
    assert torch.equal(_kernel_bits(v), v.to(fp8.FP8).view(torch.uint8))
    nan = torch.tensor([float("nan")])
    assert _kernel_bits(nan).item() & 0x7F == 0x7F  # NaN stays NaN


@given(st.integers(0, 2**32 - 1))
@FRESH
def test_rounding_equals_torch_on_random_values(seed):
    g = torch.Generator().manual_seed(seed)
    v = (torch.rand(4096, generator=g) * 2 - 1) * torch.logspace(-12, 0, 4096)[torch.randperm(4096, generator=g)] * 448
    assert torch.equal(_kernel_bits(v), v.to(fp8.FP8).view(torch.uint8))


@st.composite
def quantize_cases(draw):
    T = draw(st.integers(0, 40))
    H = 128 * draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32, torch.float16]))
    return T, H, dtype, draw(st.integers(0, 2**32 - 1))


def _tokens(T: int, H: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Rows spanning 12 decades (6 in fp16, which stays finite), one all-zero 128-block, one
    spike per row: every scale regime."""
    lo, hi = (-4, 2) if dtype == torch.float16 else (-8, 4)
    x = torch.randn(T, H, generator=g) * torch.logspace(lo, hi, max(T, 1))[:T, None]
    if T:
        x[0, :128] = 0
        x[torch.arange(T), torch.randint(H, (T,), generator=g)] *= 50
    return x.to(dtype)


@given(quantize_cases())
@FRESH
def test_quantize_kernel_equals_reference(case):
    T, H, dtype, seed = case
    x = _tokens(T, H, dtype, torch.Generator().manual_seed(seed))
    values, scales = loader.load().quantize_rows(x)
    ref_values, ref_scales = fp8.quantize(x)
    assert torch.equal(values, ref_values.view(torch.uint8)) and torch.equal(scales, ref_scales)


def test_non_finite_tokens_make_their_block_nan():
    """A NaN or an infinity in a 128-channel block makes the whole block dequantize to NaN (NaN
    amax or an infinite scale), in the kernel as in torch: never a finite value in its place."""
    x = torch.randn(4, 256)
    x[0, 3], x[1, 200], x[2, 5] = float("nan"), float("inf"), -float("inf")
    values, scales = loader.load().quantize_rows(x)
    ref_values, ref_scales = fp8.quantize(x)
    back = fp8.dequantize(values.view(fp8.FP8), scales, torch.float32)
    ref_back = fp8.dequantize(ref_values, ref_scales, torch.float32)
    nan_blocks = torch.tensor([[True, False], [False, True], [True, False], [False, False]])
    assert torch.equal(back.isnan(), nan_blocks.repeat_interleave(128, dim=1))
    assert torch.equal(back.isnan(), ref_back.isnan()) and torch.equal(back[~back.isnan()], ref_back[~ref_back.isnan()])


def test_quantize_error_bound():
    """Dequantized values are within half an fp8 step of x: 2**-4 relative in the normal range,
    2**-10 of the block's scale below it (fp32 output: no second rounding)."""
    g = torch.Generator().manual_seed(3)
    x = _tokens(64, 512, torch.float32, g)
    values, scales = fp8.quantize(x)
    back = fp8.dequantize(values, scales, torch.float32)
    scale_per_channel = scales.repeat_interleave(fp8.BLOCK, dim=1)
    assert torch.all((back - x).abs() <= x.abs() * 2**-4 + scale_per_channel * 2**-10)
    assert torch.all(scales > 0) and values.float().abs().amax() <= fp8.FP8_MAX


# --------------------------------------------------------------------------------------------
# dispatch with an fp8 payload, on W ranks


def _rank_inputs(W: int, seed: int, T_max: int = 24, H: int = 256, K: int = 3, e: int = 2):
    """Every rank's (x (T_s, H) bf16, topk_idx (T_s, K)), rebuilt alike on every rank."""
    xs, idxs = [], []
    for s in range(W):
        g = torch.Generator().manual_seed(seed * 1009 + s)
        T = int(torch.randint(0, T_max + 1, (1,), generator=g))
        xs.append(_tokens(T, H, torch.bfloat16, g))
        idx = torch.rand(T, W * e, generator=g).topk(min(K, W * e)).indices
        idxs.append(torch.where(torch.rand(idx.shape, generator=g) < 0.2, -1, idx))
    return xs, idxs


def fp8_dispatch_on_rank(r: int, W: int, seed: int, alignment: int, row_path_kernels: bool) -> None:
    use_kernels = loader.use_kernels
    if row_path_kernels:
        loader.use_kernels = lambda t: True  # CUDA's row path, interpreted
    try:
        _check_fp8_dispatch(r, W, seed, alignment)
    finally:
        loader.use_kernels = use_kernels


def _check_fp8_dispatch(r: int, W: int, seed: int, alignment: int) -> None:
    e = 2
    xs, idxs = _rank_inputs(W, seed, e=e)
    # The reference: the plain layout of every rank's dequantized tokens (fp32: exact).
    deq = [fp8.dequantize(*fp8.quantize(x), torch.float32) if x.shape[0] else x.float() for x in xs]
    ref_routed, ref_tpe = reference_dispatch(deq, idxs, W * e, alignment)[r]

    (values, scales), tpe, handle = a2a.dispatch(xs[r], idxs[r], num_experts=W * e, expert_alignment=alignment,
                                                 payload_dtype=fp8.FP8)
    assert values.dtype == fp8.FP8 and scales.dtype == torch.float32 and scales.shape == (values.shape[0], 2)
    R = ref_routed.shape[0]  # one rank: C static rows, zero past R
    assert torch.equal(tpe, ref_tpe) and not values[R:].view(torch.uint8).any() and not scales[R:].any()
    assert torch.equal(fp8.dequantize(values[:R], scales[:R], torch.float32), ref_routed)
    # Pre-quantized x: the same rows.
    (values_q, scales_q), _, _ = a2a.dispatch(fp8.quantize(xs[r]), idxs[r], num_experts=W * e,
                                              expert_alignment=alignment)
    assert torch.equal(values_q.view(torch.uint8), values.view(torch.uint8)) and torch.equal(scales_q, scales)

    # Training: rows arrive dequantized in x's dtype; x.grad is combine's of the gradient,
    # exactly the bf16 dispatch's.
    x = xs[r].clone().requires_grad_()
    routed, _, handle = a2a.dispatch(x, idxs[r], num_experts=W * e, expert_alignment=alignment,
                                     payload_dtype=fp8.FP8, dequantize=True)
    assert routed.dtype == torch.bfloat16 and torch.equal(routed[:R].float(), ref_routed.to(torch.bfloat16).float())
    assert not routed[R:].any()
    g = torch.Generator().manual_seed(seed + r)
    grad_routed = torch.randn(routed.shape, generator=g).to(torch.bfloat16)
    y = a2a.combine(routed * 2, handle)
    (routed * grad_routed).sum().backward(inputs=[x])
    x_plain = xs[r].clone().requires_grad_()
    routed_plain, _, handle_plain = a2a.dispatch(x_plain, idxs[r], num_experts=W * e, expert_alignment=alignment)
    (routed_plain * grad_routed).sum().backward()
    assert torch.equal(x.grad, x_plain.grad)
    assert torch.equal(y, a2a.combine(routed.detach() * 2, handle_plain))


@pytest.mark.parametrize("pool", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("alignment", [1, 4])
def test_fp8_dispatch_matches_reference(pool, alignment):
    for seed in range(2):
        pool.run(fp8_dispatch_on_rank, seed * 7 + alignment, alignment, False)


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_fp8_dispatch_kernel_row_path(pool):
    """The fused quantize-and-put kernel (CUDA's path) in the interpreter, on a group."""
    pool.run(fp8_dispatch_on_rank, 5, 2, True)


def test_fp8_dispatch_bytes_per_row():
    """A dispatched fp8 row is H + 4 H / 128 bytes: 0.516 of a bf16 row."""
    assert fp8.packed_width(7168) == 7168 + 224
    assert fp8.packed_width(7168) / (2 * 7168) == pytest.approx(0.515625)


# --------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((torch.randn(4, 100),), dict(payload_dtype=fp8.FP8), ValueError, "H divisible by 128 .*, got H = 100"),
    ((torch.randn(4, 128),), dict(payload_dtype=torch.float16), ValueError, "payload_dtype: expected None or"),
    ((torch.randn(4, 128).to(fp8.FP8),), {}, ValueError, "pass x=\\(values, scales\\)"),
    (((torch.randn(4, 128).to(fp8.FP8), torch.ones(4, 2)),), {}, TypeError, "shape \\(4, 1\\)"),
    (((torch.randn(4, 128), torch.ones(4, 1)),), {}, TypeError, "values of dtype torch.float8_e4m3fn"),
    ((torch.randn(4, 128, requires_grad=True),), dict(payload_dtype=fp8.FP8), ValueError, "dequantize=True"),
    ((torch.randn(4, 128),), dict(dequantize=True), ValueError, "only an fp8 payload is dequantized"),
])
def test_fp8_argument_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        a2a.dispatch(*args, torch.zeros(4, 2, dtype=torch.int64), num_experts=4, **kwargs)


def bad_fp8_on_rank(r: int, W: int, kind: str) -> str:
    H = 100 if (kind == "hidden" and r == 1) else 128
    payload = None if (kind == "mixed" and r == 1) else fp8.FP8
    try:
        a2a.dispatch(torch.randn(4, H), torch.zeros(4, 2, dtype=torch.int64), num_experts=4, payload_dtype=payload)
    except (ValueError, PeerInputError, GroupMismatchError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_fp8_errors_reach_every_rank(pool):
    """A rank with an fp8-incompatible H raises, its peer learns why (before any rows move); ranks
    that disagree on the payload dtype raise a GroupMismatchError naming it."""
    own, peer = pool.run(bad_fp8_on_rank, "hidden")[::-1]
    assert own.startswith("ValueError") and "H = 100" in own
    assert peer.startswith("PeerInputError") and "H = 100" in peer
    for message in pool.run(bad_fp8_on_rank, "mixed"):
        assert message.startswith("GroupMismatchError") and "payload dtype" in message


# --------------------------------------------------------------------------------------------
# compile, opcheck


def test_compiled_once_across_routings():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True)
    def layer(x, topk_idx, w):
        routed, tpe, handle = a2a.dispatch(x, topk_idx, num_experts=8, payload_dtype=fp8.FP8, dequantize=True,
                                           expert_alignment=4)
        return a2a.combine(routed * 3, handle, w)

    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(16, 256, generator=g).to(torch.bfloat16).requires_grad_()
        topk_idx = torch.rand(16, 8, generator=g).topk(2).indices
        w = torch.rand(16, 2, generator=g)
        y = layer(x, topk_idx, w)
        y.float().sum().backward()
        deq = fp8.dequantize(*fp8.quantize(x.detach()))
        expected = (deq.float() * 3 * w.sum(1, keepdim=True)).to(torch.bfloat16)
        torch.testing.assert_close(y, expected, rtol=2e-2, atol=1e-2)
        torch.testing.assert_close(x.grad.float(), 3 * w.sum(1, keepdim=True).expand(16, 256), rtol=1e-2, atol=1e-2)
    assert counter.frame_count == 1


def test_opcheck():
    g = torch.Generator().manual_seed(1)
    topk_idx = torch.randint(-1, 4, (6, 2), generator=g)
    plan = layout.plan_routing(topk_idx, 4, 1)
    splits = layout.read_splits(plan.send_meta, plan.send_meta, 2)
    route = (plan.order, plan.position, plan.send_meta, splits, 2, "")
    x = torch.randn(6, 128, generator=g, requires_grad=True)
    fp8_kwargs = {"payload": "fp8", "out_dtype": torch.float32}
    torch.library.opcheck(torch.ops.alltoall_ops.dispatch.default, (x, None, *route, None), fp8_kwargs)
    values, scales = fp8.quantize(x.detach())
    # NB: opcheck's schema test compares inputs before and after with arithmetic torch lacks for
    # fp8 tensors on the CPU; the other three checks run.
    torch.library.opcheck(torch.ops.alltoall_ops.dispatch.default, (values, None, *route, None),
                          {"x_scale_TB": scales, "payload": "fp8"},
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_sac_policy_saves_the_fp8_dispatch():
    """Under the SAC policy the checkpointed backward runs no fp8 dispatch again (MUST_SAVE, as
    every comm op); gradients equal the un-checkpointed layer's."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from alltoall_ops.testing import CommOpCounter

    op = "alltoall_ops::local_dispatch(payload=fp8)"  # one process: the local backend's fp8 dispatch
    assert torch.ops.alltoall_ops.local_dispatch.default in a2a.communication_ops()
    g = torch.Generator().manual_seed(8)
    topk_idx = torch.rand(12, 8, generator=g).topk(2).indices
    weights = torch.rand(12, 2, generator=g)
    w1 = torch.randn(128, 128, generator=g).to(torch.bfloat16)

    def layer(x):
        routed, _, handle = a2a.dispatch(x, topk_idx, num_experts=8, payload_dtype=fp8.FP8, dequantize=True)
        return a2a.combine(torch.tanh(routed @ w1), handle, weights)

    def grads(run):
        x = torch.randn(12, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).requires_grad_()
        y = run(x)
        with CommOpCounter() as counter:
            y.float().sum().backward()
        return x.grad, counter.ops

    plain, plain_ops = grads(layer)
    context_fn = partial(create_selective_checkpoint_contexts, a2a.sac_policy())
    saved, saved_ops = grads(lambda x: checkpoint(layer, x, use_reentrant=False, context_fn=context_fn))
    recomputed, recomputed_ops = grads(lambda x: checkpoint(layer, x, use_reentrant=False))
    assert torch.equal(plain, saved) and torch.equal(plain, recomputed)
    assert saved_ops == plain_ops and op not in saved_ops
    assert op in recomputed_ops  # full recompute runs it again


@given(st.integers(0, 40), st.integers(1, 3), st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
       st.data())
@FRESH
def test_the_pull_dequantizes_as_the_reference(C, blocks, dtype, data):
    """Every fp8 code (NaN included) times random scales, rows < n only: symm_mem's pull of fp8
    wire rows with ``dequantize`` (the value times its block's scale as it moves, one pass)
    equals ``fp8.dequantize`` and splits off the scale bytes; rows past n keep what they held."""
    H = 128 * blocks
    n = data.draw(st.integers(0, C), label="n")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    values = torch.randint(0, 256, (C, H), generator=g, dtype=torch.uint8)
    scales = torch.rand(C, blocks, generator=g) * torch.logspace(-6, 2, max(C, 1))[:C, None]
    wire = torch.cat([values, scales.view(torch.uint8)], 1)  # (C, P): the rows as a sender posts them
    out, tail = torch.full((C, H), 7.0, dtype=dtype), torch.full((C, 4 * blocks), 7, dtype=torch.uint8)
    loader.load().pull_rows(None, torch.tensor([n]), out, torch.empty(C, dtype=torch.int64), rows=wire,
                            row_map=torch.arange(C), position=torch.arange(C), tail=tail, dequantize=True)
    ref = fp8.dequantize(values.view(fp8.FP8), scales, dtype)
    assert torch.equal(out[:n].isnan(), ref[:n].isnan())
    assert torch.equal(out[:n].nan_to_num(), ref[:n].nan_to_num()) and (out[n:] == 7).all()
    assert torch.equal(tail[:n].view(torch.float32), scales[:n]) and (tail[n:] == 7).all()
    with pytest.raises(ValueError, match="dequantize needs a uint8 tail") if C else contextlib.nullcontext():
        loader.load().pull_rows(None, torch.tensor([n]), out, torch.empty(C, dtype=torch.int64), rows=wire,
                                row_map=torch.arange(C), position=torch.arange(C), tail=tail.float(),
                                dequantize=True)


def test_pull_rows_splits_wire_rows():
    """pull_rows with ``tail``, from a sender's tags: each pulled row's first columns into out,
    the rest into tail; a padding row reads zero; rows no slot names are not written."""
    g = torch.Generator().manual_seed(2)
    T, H, B = 6, 128, 1
    wire = torch.randint(0, 256, (T, H + 4 * B), generator=g, dtype=torch.uint8)
    dst = torch.tensor([3, -1, 0, 5, 2, 9])  # token t's row here (K = 1); 9: another rank's
    tag_a_slot = torch.stack([dst, 100 + torch.arange(T), torch.zeros(T, dtype=torch.int64)], 1)
    tags = torch.cat([torch.tensor([[T, 1, 0]]), tag_a_slot])  # the header: T tokens, 1 slot a token
    C = 8
    out, tail = torch.full((C, H), 7, dtype=torch.uint8), torch.full((C, 4 * B), 7, dtype=torch.uint8)
    row_src = torch.full((C,), 12345)
    loader.load().pull_rows(Region.of(tags), torch.tensor([C]), out, row_src, rows=wire, tail=tail, dst_stride=C,
                            pads=torch.tensor([4, 5]))
    expected = torch.full((C, H + 4 * B), 7, dtype=torch.uint8)
    expected[[3, 0, 5, 2]] = wire[[0, 2, 3, 4]]
    expected[4] = 0
    assert torch.equal(out, expected[:, :H]) and torch.equal(tail, expected[:, H:])
    assert row_src.tolist() == [102, 12345, 104, 100, -1, 103, 12345, 12345]
