"""GPU checks of the fp8 dispatch on one GPU (torch 2.11, triton 3.6): the compiled quantize
kernel against torch's CUDA float8_e4m3fn cast and ``fp8.quantize``, bit for bit, also replayed
from a CUDA graph; dispatch's fp8 modes (quantized, pre-quantized, dequantized with the
straight-through gradient) against the bf16 dispatch of the dequantized tokens, eager and
compiled with inductor (one compilation across routings).

    python -m tools.gpu_fp8_check                    # PASS / FAIL per check; exit status 1 on a failure
    python -m pytest -m gpu tests/test_fp8_gpu.py    # the same checks, one test each
"""

from __future__ import annotations

import functools
import sys
import traceback

import torch
import torch._dynamo.testing

import alltoall_ops as a2a
from alltoall_ops import fp8
from alltoall_ops.kernels import loader
from alltoall_ops.testing import routing

DEV = torch.device("cuda")
FAILURES: list[str] = []


def check(name: str, fn) -> None:
    try:
        fn()
        print(f"PASS {name}", flush=True)
    except Exception as exc:  # noqa: BLE001 - every check runs; the exit status reports
        traceback.print_exc(limit=4)
        FAILURES.append(f"{name}: {type(exc).__name__}: {exc}")
        print(f"FAIL {name}: {exc}", flush=True)


def tokens(T: int, H: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, H, device=DEV, generator=g) * torch.logspace(-8, 4, max(T, 1), device=DEV)[:T, None]
    if T:
        x[0, :128] = 0
    return x.to(dtype)


def rounding_sweep() -> None:
    """Every fp8 code, the midpoints between codes and one fp32 step either side, both signs,
    through the kernel (rows of 127 values and 448: scale factor 1)."""
    codes = torch.arange(0, 127, dtype=torch.uint8, device=DEV).view(fp8.FP8).float()
    mids = (codes[:-1] + codes[1:]) / 2
    v = torch.cat([codes, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    v = torch.cat([v, -v])
    v = torch.cat([v, torch.zeros(-v.numel() % 127, device=DEV)]).view(-1, 127)
    x = torch.cat([v, torch.full((v.shape[0], 1), 448.0, device=DEV)], dim=1)  # (rows, 128), amax 448
    values, _ = loader.load().quantize_rows(x)
    assert torch.equal(values, x.to(fp8.FP8).view(torch.uint8)), "rounding differs from torch's cast"


def non_finite() -> None:
    """A NaN or an infinity makes its whole block dequantize to NaN, as torch's ops do."""
    x = torch.randn(4, 256, device=DEV)
    x[0, 3], x[1, 200], x[2, 5] = float("nan"), float("inf"), -float("inf")
    values, scales = loader.load().quantize_rows(x)
    back = fp8.dequantize(values.view(fp8.FP8), scales, torch.float32)
    ref = fp8.dequantize(*fp8.quantize(x), torch.float32)
    assert torch.equal(back.isnan(), ref.isnan()) and int(back.isnan().sum()) == 3 * 128, "NaN blocks differ"
    assert torch.equal(back[~back.isnan()], ref[~ref.isnan()]), "finite blocks differ"


def quantize(T: int, H: int, dtype) -> None:
    x = tokens(T, H, T + H, dtype)
    values, scales = loader.load().quantize_rows(x)
    ref_values, ref_scales = fp8.quantize(x)
    bad = (values != ref_values.view(torch.uint8)).sum().item()
    assert bad == 0 and torch.equal(scales, ref_scales), f"{bad} values differ from fp8.quantize"


def dispatch_modes(T: int, H: int, K: int, E: int, alignment: int) -> None:
    x = tokens(T, H, 7 * T)
    idx, _ = routing(T, K, E, seed=11 * T, device=DEV, dropped=0.1)
    deq = fp8.dequantize(*fp8.quantize(x), torch.float32)
    ref, ref_tpe, _ = a2a.dispatch(deq, idx, num_experts=E, expert_alignment=alignment)
    (values, scales), tpe, _ = a2a.dispatch(x, idx, num_experts=E, expert_alignment=alignment,
                                            payload_dtype=fp8.FP8)
    assert torch.equal(tpe, ref_tpe) and torch.equal(fp8.dequantize(values, scales, torch.float32), ref)
    (values_q, scales_q), _, _ = a2a.dispatch(fp8.quantize(x), idx, num_experts=E, expert_alignment=alignment)
    assert torch.equal(values_q.view(torch.uint8), values.view(torch.uint8)) and torch.equal(scales_q, scales)
    xg = x.clone().requires_grad_()
    routed, _, handle = a2a.dispatch(xg, idx, num_experts=E, expert_alignment=alignment, payload_dtype=fp8.FP8,
                                     dequantize=True)
    assert torch.equal(routed, ref.to(torch.bfloat16))
    grad = torch.randn_like(routed)
    (routed * grad).sum().backward()
    xp = x.clone().requires_grad_()
    routed_p, _, _ = a2a.dispatch(xp, idx, num_experts=E, expert_alignment=alignment)
    (routed_p * grad).sum().backward()
    assert torch.equal(xg.grad, xp.grad), "straight-through gradient != the bf16 dispatch's"


def compiled_and_graph() -> None:
    T, H, K, E = 512, 1024, 8, 64

    def step(x, idx, w):
        routed, _, handle = a2a.dispatch(x, idx, num_experts=E, payload_dtype=fp8.FP8, dequantize=True)
        return a2a.combine(routed, handle, w)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for seed in range(3):
        x = tokens(T, H, seed)
        idx, _ = routing(T, K, E, seed=seed + 100, device=DEV, dropped=0.1)
        w = torch.rand(T, K, device=DEV)
        torch.testing.assert_close(compiled(x, idx, w), step(x, idx, w), rtol=0, atol=0)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations over 3 routings"
    # The dispatch reads its split sizes on the host (not capturable); its quantize kernel is:
    x = tokens(T, H, 5)
    loader.load().quantize_rows(x)  # warm-up (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, scales = loader.load().quantize_rows(x)
    x.copy_(tokens(T, H, 9))
    graph.replay()
    ref_values, ref_scales = fp8.quantize(x)
    assert torch.equal(values, ref_values.view(torch.uint8)) and torch.equal(scales, ref_scales), "replay differs"


CHECKS = [
    ("rounding: every code, midpoint and neighbour", rounding_sweep),
    ("non-finite tokens: their blocks NaN, as torch", non_finite),
    *((f"quantize_rows T={T} H={H} {dtype}", functools.partial(quantize, T, H, dtype))
      for T, H, dtype in [(4096, 7168, torch.bfloat16), (128, 7168, torch.bfloat16), (333, 384, torch.float32),
                          (1, 128, torch.float16), (0, 256, torch.bfloat16)]),
    *((f"dispatch fp8 modes T={T} H={H} K={K} E={E} alignment={a}", functools.partial(dispatch_modes, T, H, K, E, a))
      for T, H, K, E, a in [(4096, 7168, 8, 256, 1), (300, 256, 4, 16, 8), (0, 128, 2, 4, 1)]),
    ("compiled once across routings; kernel in a CUDA graph", compiled_and_graph),
]
"""(name, check): every check of this file, in the order main runs them."""


def main() -> int:
    for name, fn in CHECKS:
        check(name, fn)
    print("FAILURES:" if FAILURES else "ALL PASS", *FAILURES, sep="\n  ")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
