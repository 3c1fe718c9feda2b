"""fp8 payloads on backend="symm_mem" (CPU, Triton's interpreter, simulated peers): the routed
values and scales equal the local backend's fp8 dispatch of every rank's tokens bit for bit, the
dequantized mode's gradient is the bf16 dispatch's, rows past tokens_per_expert.sum() are never
written, argument errors, one compilation across routings, opcheck."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import alltoall_ops as a2a
from alltoall_ops import fp8
from alltoall_ops.backends import symm_mem
from alltoall_ops.backends.symm_mem import backend as symm_backend
from alltoall_ops.backends.symm_mem import ops as symm_ops
from alltoall_ops.errors import GroupMismatchError
from alltoall_ops.kernels import loader

pytestmark = pytest.mark.skipif(
    not loader.load().interpreting(),
    reason="the CPU path runs Triton's interpreter: set TRITON_INTERPRET=1 (automatic without CUDA)",
)

H, K, e = 256, 2, 2  # B = 2 scales per row; e local experts per rank
FP8 = fp8.FP8


def _rank_inputs(seed: int, rank: int, T: int, num_experts: int):
    """x (T, H) bf16 over several decades (every scale regime), topk_idx (T, K) distinct experts
    with some slots dropped (-1), weights (T, K), grad_y (T, H)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = (torch.randn(T, H, generator=g) * torch.logspace(-3, 3, max(T, 1))[:T, None]).to(torch.bfloat16)
    idx = torch.rand(T, num_experts, generator=g).topk(K).indices
    idx = torch.where(torch.rand(T, K, generator=g) < 0.2, -1, idx)
    weights = torch.rand(T, K, generator=g)
    grad_y = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return x, idx, weights, grad_y


def _tokens(W: int, r: int) -> int:
    return 0 if (W == 4 and r == 2) else 5 + 2 * r  # W = 4: a rank with no tokens


def _local_reference(xs, idxs, W: int, alignment: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every rank's (values, scales, tokens_per_expert): the local backend's fp8 dispatch of all
    ranks' tokens, concatenated in rank order (expert-major, then source rank, then token), cut
    into each rank's experts."""
    (values, scales), tpe, _ = a2a.dispatch(torch.cat(xs), torch.cat(idxs), num_experts=W * e, backend="local",
                                            expert_alignment=alignment, payload_dtype=FP8)
    out, start = [], 0
    for r in range(W):
        tpe_r = tpe[r * e : (r + 1) * e]
        n = int(tpe_r.sum())
        out.append((values[start : start + n], scales[start : start + n], tpe_r))
        start += n
    return out


# --------------------------------------------------------------------------------------------
# Routed rows: bit for bit the local backend's; the tail unwritten


@pytest.mark.parametrize("W, alignment", [(1, 1), (2, 3), (4, 2)])
def test_matches_local_fp8_reference(W, alignment, unwritten_as_nan):
    E = W * e
    inputs = [_rank_inputs(W + alignment, r, _tokens(W, r), E) for r in range(W)]
    refs = _local_reference([i[0] for i in inputs], [i[1] for i in inputs], W, alignment)
    bufs = a2a.SymmBuffers.simulated(W, 9 + 2 * W, H, K, E, dtype=torch.bfloat16, device="cpu",
                                     expert_alignment=alignment, payload_dtype=FP8, timeout=60)

    def rank_fn(rank, b):
        x, idx, _, _ = inputs[rank]
        kw = dict(num_experts=E, expert_alignment=alignment, buffers=b)
        quantized = a2a.dispatch(x, idx, payload_dtype=FP8, **kw)
        prequantized = a2a.dispatch(fp8.quantize(x), idx, **kw)
        dequantized = a2a.dispatch(x, idx, payload_dtype=FP8, dequantize=True, **kw)
        return quantized, prequantized, dequantized

    C = bufs[0].capacity
    for (quantized, prequantized, dequantized), (ref_values, ref_scales, ref_tpe) in zip(
        symm_mem.run_simulated(rank_fn, bufs), refs
    ):
        R = ref_values.shape[0]
        for (values, scales), tpe, handle in (quantized, prequantized):
            assert values.dtype == FP8 and scales.dtype == torch.float32
            assert values.shape == (C, H) and scales.shape == (C, H // 128)
            assert torch.equal(tpe, ref_tpe) and handle.num_routed_1.tolist() == [R]
            assert torch.equal(values[:R].view(torch.uint8), ref_values.view(torch.uint8))
            assert torch.equal(scales[:R], ref_scales)
            # The tail: not written (NaN from the fixture's prefill).
            assert values[R:].float().isnan().all() and scales[R:].isnan().all()
            assert (handle.row_src_C[R:] == 0).all()  # not written either (the fixture's 0)
        routed, tpe, _ = dequantized
        assert routed.dtype == torch.bfloat16 and torch.equal(tpe, ref_tpe)
        assert torch.equal(routed[:R], fp8.dequantize(ref_values, ref_scales, torch.bfloat16))
        assert routed[R:].isnan().all()
    assert min(unwritten_as_nan) > 0


# --------------------------------------------------------------------------------------------
# Training: the dequantized mode's outputs and gradients are the bf16 dispatch's


@pytest.mark.parametrize("W", [1, 2])
def test_dequantized_step_equals_bf16_dispatch(W, unwritten_as_nan):
    """dispatch(dequantize=True) -> expert -> combine -> backward on fp8 buffers equals the same
    step on bf16 buffers fed the dequantized tokens: routed rows, y, and the gradients of x
    (straight-through: combine of routed's gradient, which on fp8 buffers runs combine's
    backward, a bf16 dispatch, through the same receive region) and of the weights."""
    E, alignment = W * e, 2
    T_max = 5 + 2 * W
    kw = dict(dtype=torch.bfloat16, device="cpu", expert_alignment=alignment, timeout=60)
    fp8_bufs = a2a.SymmBuffers.simulated(W, T_max, H, K, E, payload_dtype=FP8, **kw)
    bf16_bufs = a2a.SymmBuffers.simulated(W, T_max, H, K, E, **kw)

    def step(rank, b, fp8_payload: bool):
        x, idx, weights, grad_y = _rank_inputs(30 + W, rank, _tokens(W, rank), E)
        if not fp8_payload:
            x = fp8.dequantize(*fp8.quantize(x), torch.bfloat16)
        x, weights = x.requires_grad_(), weights.requires_grad_()
        routed, tpe, handle = a2a.dispatch(x, idx, num_experts=E, expert_alignment=alignment, buffers=b,
                                           **(dict(payload_dtype=FP8, dequantize=True) if fp8_payload else {}))
        y = a2a.combine(torch.tanh(routed) * 3, handle, weights)
        grad_x, grad_w = torch.autograd.grad(y, (x, weights), grad_y)
        R = int(tpe.sum())
        return routed[:R].detach(), y.detach(), grad_x, grad_w

    got = symm_mem.run_simulated(lambda r, b: step(r, b, True), fp8_bufs)
    expected = symm_mem.run_simulated(lambda r, b: step(r, b, False), bf16_bufs)
    for rank, (a, b) in enumerate(zip(got, expected)):
        for name, u, v in zip(("routed", "y", "grad_x", "grad_w"), a, b):
            assert torch.equal(u, v), f"rank {rank}: {name} differs from the bf16 dispatch"
    assert min(unwritten_as_nan) > 0  # the forward's and the backward's copy-outs left rows unwritten


def test_gradient_of_x_is_the_bf16_dispatch_gradient():
    """x's gradient through the fp8 dispatch alone is the bf16 dispatch's (the same combine)."""
    E = 4
    x, idx, _, _ = _rank_inputs(40, 0, 7, E)
    fp8_bufs = a2a.SymmBuffers(7, H, K, E, dtype=torch.bfloat16, device="cpu", payload_dtype=FP8)
    bf16_bufs = a2a.SymmBuffers(7, H, K, E, dtype=torch.bfloat16, device="cpu")
    grad_routed = torch.randn(fp8_bufs.capacity, H, generator=torch.Generator().manual_seed(41)).to(torch.bfloat16)
    grads = []
    for bufs, kw in ((fp8_bufs, dict(payload_dtype=FP8, dequantize=True)), (bf16_bufs, {})):
        xx = x.clone().requires_grad_()
        routed, _, _ = a2a.dispatch(xx, idx, num_experts=E, buffers=bufs, **kw)
        grads.append(torch.autograd.grad(routed, xx, grad_routed)[0])
    assert torch.equal(*grads)


# --------------------------------------------------------------------------------------------
# Eager cached buffers, errors


def test_cached_buffers_one_rank():
    """Without buffers=, eager calls create fp8 buffers of their own (cached apart from bf16's)."""
    symm_backend._AUTO_BUFFERS.clear()
    x, idx, _, _ = _rank_inputs(50, 0, 6, 4)
    (values, scales), tpe, handle = a2a.dispatch(x, idx, num_experts=4, backend="symm_mem", payload_dtype=FP8)
    (ref_values, ref_scales), ref_tpe, _ = a2a.dispatch(x, idx, num_experts=4, backend="local", payload_dtype=FP8)
    R = int(ref_tpe.sum())
    assert torch.equal(tpe, ref_tpe) and torch.equal(scales[:R], ref_scales[:R])  # local: C rows too
    assert torch.equal(values[:R].view(torch.uint8), ref_values[:R].view(torch.uint8))
    assert handle.buffers.payload_dtype == FP8 and handle.buffers.dtype == torch.bfloat16
    _, _, plain = a2a.dispatch(x, idx, num_experts=4, backend="symm_mem")
    assert plain.buffers.payload_dtype is None and plain.buffers is not handle.buffers
    symm_backend._AUTO_BUFFERS.clear()


def test_errors():
    x, idx, _, _ = _rank_inputs(60, 0, 4, 4)
    plain = a2a.SymmBuffers(4, H, K, 4, dtype=torch.bfloat16, device="cpu")
    fp8_bufs = a2a.SymmBuffers(4, H, K, 4, dtype=torch.bfloat16, device="cpu", payload_dtype=FP8)
    with pytest.raises(ValueError, match="needs buffers created with payload_dtype=torch.float8_e4m3fn"):
        a2a.dispatch(x, idx, num_experts=4, buffers=plain, payload_dtype=FP8)
    with pytest.raises(ValueError, match="needs buffers created with payload_dtype"):
        a2a.dispatch(fp8.quantize(x), idx, num_experts=4, buffers=plain)
    with pytest.raises(ValueError, match="serve fp8 dispatches only"):
        a2a.dispatch(x, idx, num_experts=4, buffers=fp8_bufs)
    with pytest.raises(ValueError, match="the buffers hold torch.bfloat16 rows"):
        a2a.dispatch(x.float(), idx, num_experts=4, buffers=fp8_bufs, payload_dtype=FP8)
    with pytest.raises(ValueError, match="the buffers hold no fp8 wire rows"):
        _, _, h = a2a.dispatch(x, idx, num_experts=4, buffers=plain)
        symm_ops.symm_dispatch_op(x, None, *h.slots[:-1], plain, payload="fp8")
    with pytest.raises(ValueError, match="H divisible by 128 .*, got H = 100"):
        a2a.SymmBuffers(4, 100, K, 4, dtype=torch.bfloat16, device="cpu", payload_dtype=FP8)
    with pytest.raises(ValueError, match="H divisible by 128"):
        a2a.SymmBuffers.simulated(2, 4, 192, K, 4, dtype=torch.bfloat16, device="cpu", payload_dtype=FP8)
    with pytest.raises(ValueError, match="payload_dtype: expected None or"):
        a2a.SymmBuffers(4, H, K, 4, dtype=torch.bfloat16, device="cpu", payload_dtype=torch.float16)
    assert "payload_dtype=torch.float8_e4m3fn" in repr(fp8_bufs)
    # The stage (the ROWS region) holds T_max wire rows of P bytes and combine's N_max (H,) rows.
    stage_bytes = fp8_bufs.rows.numel() * fp8_bufs.rows.element_size()
    assert stage_bytes >= max(fp8_bufs.max_tokens_per_rank * fp8.packed_width(H), fp8_bufs.max_slots * H * 2)


# --------------------------------------------------------------------------------------------
# torch.compile, opcheck


def test_compiled_once_across_routings():
    torch._dynamo.reset()
    E, T = 4, 6
    bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device="cpu", expert_alignment=2, payload_dtype=FP8)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def layer(x, idx, w, b):
        routed, tpe, handle = a2a.dispatch(x, idx, num_experts=E, expert_alignment=2, buffers=b,
                                           payload_dtype=FP8, dequantize=True)
        (values, scales), _, _ = a2a.dispatch(x.detach(), idx, num_experts=E, expert_alignment=2, buffers=b,
                                              payload_dtype=FP8)
        return a2a.combine(routed * 3, handle, w), values, scales, tpe

    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    for seed in range(2):  # two routings, one compilation
        x, idx, w, grad_y = _rank_inputs(70 + seed, 0, T, E)
        results = []
        for fn in (compiled, layer):
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            y, values, scales, tpe = fn(xx, idx, ww, bufs)
            R = int(tpe.sum())
            grads = torch.autograd.grad(y, (xx, ww), grad_y)
            results.append((y, values[:R].view(torch.uint8), scales[:R], tpe, *grads))
        for a, b in zip(*results):
            assert torch.equal(a, b)
    assert counter.frame_count == 1


def test_opcheck():
    # As test_symm_mem.test_opcheck: test_schema is left out (opaque argument; and fp8 inputs).
    tests = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    E = 4
    idx = torch.rand(5, E, generator=torch.Generator().manual_seed(80)).topk(K).indices  # every slot: n = C
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(81)).to(torch.bfloat16)
    bufs = a2a.SymmBuffers(5, H, K, E, dtype=torch.bfloat16, device="cpu", payload_dtype=FP8)
    (_, _), _, h = a2a.dispatch(x, idx, num_experts=E, buffers=bufs, payload_dtype=FP8)
    assert h.num_routed_1.tolist() == [bufs.capacity]
    route = tuple(h.slots)
    op = symm_ops.symm_dispatch_op
    dequantized = {"payload": "fp8", "out_dtype": torch.bfloat16}
    torch.library.opcheck(op, (x.clone().requires_grad_(), None, *route), dequantized, test_utils=tests)
    values, scales = fp8.quantize(x)
    torch.library.opcheck(op, (values, None, *route), {"x_scale_TB": scales, "payload": "fp8"}, test_utils=tests)
    assert "alltoall_ops::symm_dispatch" in {o.name() for o in a2a.communication_ops()}


# --------------------------------------------------------------------------------------------
# Real gloo ranks (the shared-memory stand-in): against the collective backend's fp8 dispatch


def run_against_collective(rank: int, world_size: int) -> list[int]:
    E, alignment = world_size * e, 2
    x, idx, _, _ = _rank_inputs(90, rank, 4 + 3 * rank, E)
    (ref_values, ref_scales), ref_tpe, _ = a2a.dispatch(x, idx, num_experts=E, backend="collective",
                                                        expert_alignment=alignment, payload_dtype=FP8)
    symm_backend._AUTO_BUFFERS.clear()
    explicit = a2a.SymmBuffers(8, H, K, E, dtype=torch.bfloat16, device="cpu", expert_alignment=alignment,
                               payload_dtype=FP8)
    R = ref_values.shape[0]
    sizes = []
    for bufs in (explicit, None):  # None: eager buffers cached per payload dtype, agreed on by the ranks
        (values, scales), tpe, handle = a2a.dispatch(x, idx, num_experts=E, expert_alignment=alignment,
                                                     backend="symm_mem", buffers=bufs, payload_dtype=FP8)
        assert torch.equal(tpe, ref_tpe) and torch.equal(scales[:R], ref_scales)
        assert torch.equal(values[:R].view(torch.uint8), ref_values.view(torch.uint8))
        assert handle.buffers.payload_dtype == FP8
        sizes.append(handle.buffers.max_tokens_per_rank)
    # Ranks that disagree on the payload dtype of cached buffers raise alike, before any row moves.
    disagree = "disagree on payload dtype: rank 0 has torch.bfloat16, rank 1 has torch.float8_e4m3fn"
    with pytest.raises(GroupMismatchError, match=disagree):
        a2a.dispatch(x, idx, num_experts=E, backend="symm_mem", **(dict(payload_dtype=FP8) if rank else {}))
    symm_backend._AUTO_BUFFERS.clear()
    return sizes


def test_processes_match_collective(pool2):
    assert pool2.run(run_against_collective) == [[8, 7]] * 2  # cached: sized by the largest T over the ranks


def run_bad_fp8_arguments(rank: int, world_size: int) -> tuple[str, str]:
    """Both ranks on fp8 buffers: rank 1 passes dequantize=True without payload_dtype (an
    argument check of alltoall_ops.dispatch itself), rank 0 a right fp8 dispatch. Returns what
    the rank raised; then a right dispatch on both shows the buffers still in step."""
    E = world_size * e
    bufs = a2a.SymmBuffers(4, H, K, E, dtype=torch.bfloat16, device="cpu", payload_dtype=FP8, timeout=10.0)
    x, idx, _, _ = _rank_inputs(91, rank, 4, E)
    fp8_args = dict(dequantize=True) if rank == 1 else dict(payload_dtype=FP8)
    with pytest.raises(ValueError) as err:
        a2a.dispatch(x, idx, num_experts=E, buffers=bufs, **fp8_args)
    (values, _), tpe, _ = a2a.dispatch(x, idx, num_experts=E, buffers=bufs, payload_dtype=FP8)
    assert values.shape[0] == bufs.capacity and tpe.shape == (e,)
    return type(err.value).__name__, str(err.value)


def test_bad_fp8_arguments_raise_on_every_rank(pool2):
    # Before: rank 1 told its peers through the process group while rank 0 waited in the buffers'
    # metadata exchange; both timed out, and rank 1 never raised its own error.
    (peer_type, peer_message), (own_type, own_message) = pool2.run(run_bad_fp8_arguments)
    assert own_type == "ValueError" and own_message.startswith("dequantize: only an fp8 payload is dequantized")
    assert peer_type == "PeerInputError", peer_message
    assert f"rank 1 rejected its arguments: ValueError: {own_message}" in peer_message, peer_message


def test_quantize_writes_the_wire_rows_pack_would():
    """The CUDA fp8 dispatch on symm_mem quantizes straight into its (T, P) wire rows
    (``FP8Format.encode_packed``): the kernel's out_TP equals ``payload.pack`` of fp8.quantize."""
    from alltoall_ops.payload import pack

    x = (torch.randn(9, H, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)
    rows = torch.full((9, H + 4 * H // 128), 7, dtype=torch.uint8)
    values, scales = loader.load().quantize_rows(x, max_programs=2, out_TP=rows)
    want_values, want_scales = fp8.quantize(x)
    assert torch.equal(rows, pack(want_values, want_scales))
    assert torch.equal(values, want_values.view(torch.uint8)) and torch.equal(scales, want_scales)
