"""GPU checks of the reliability fixes (issue 10), on one CUDA GPU:

1. the symm_mem barrier kernel passes when every rank arrives, and fails its device-side assert
   within its deadline when a peer never does (a pad flag that never clears), or at once when
   two ranks' stamps differ (two streams of one GPU as two ranks); each in a child process,
   since the assert leaves the CUDA context unusable, and the assert names the cause;
2. the kernel path with strided inputs and NaN / inf weights on dropped slots (local backend):
   equal to the contiguous call, finite, and equal to the run with those weights set to 0.

    python -m tools.gpu_fault_check                  # PASS / FAIL per check
    python -m pytest -m gpu tests/test_faults_gpu.py  # the same checks, one test each
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

import alltoall_ops as a2a
from alltoall_ops.kernels import loader
from tools.checks import run_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stuck_barrier() -> None:
    """Child: a one-rank barrier whose own flag is already set, so the release never succeeds."""
    pad = torch.ones(1, dtype=torch.int32, device="cuda")
    table = torch.tensor([pad.data_ptr()], dtype=torch.int64, device="cuda")
    loader.load().barrier(table, 0, 1.0, 1, torch.ones(1, dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()


def _out_of_step_barrier() -> None:
    """Child: two 'ranks' on two streams of one GPU meet in one barrier with different call numbers
    (the first launch loads the kernel; the second, on the other stream, finds it loaded)."""
    k = loader.load()
    pads = torch.zeros(2, 2, dtype=torch.int32, device="cuda")
    table = torch.tensor([pads[r].data_ptr() for r in range(2)], dtype=torch.int64, device="cuda")
    for rank, stream in enumerate(torch.cuda.Stream() for _ in range(2)):
        with torch.cuda.stream(stream):
            k.barrier(table, rank, 60.0, 1, torch.full((1,), 1 + rank, dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()


def _failed_child(flag: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    child = subprocess.run([sys.executable, "-m", "tools.gpu_fault_check", flag], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    return child, time.monotonic() - start


def check_barrier() -> str:
    pad = torch.zeros(1, dtype=torch.int32, device="cuda")
    table = torch.tensor([pad.data_ptr()], dtype=torch.int64, device="cuda")
    loader.load().barrier(table, 0, 1.0, 1, torch.ones(1, dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()
    ok = int(pad) == 0
    seen = [f"passes when all arrive: {ok}"]
    for flag, cause in (("--stuck-barrier", "did not arrive within"), ("--out-of-step-barrier", "out of step")):
        child, waited = _failed_child(flag)
        named = child.returncode != 0 and "device-side assert" in child.stderr and cause in child.stderr
        seen.append(f"{flag[2:]}: ended in {waited:.1f} s (stuck: deadline 1 s + start-up), exit code "
                    f"{child.returncode}, assert naming '{cause}': {named}")
        ok = ok and named
    assert ok, "; ".join(seen) + f"; last child's stderr tail: {child.stderr[-1500:]}"
    return "; ".join(seen)


def check_kernel_inputs() -> str:
    torch.manual_seed(0)
    T, H, K, E = 300, 256, 4, 16
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(-1, E, (T, K), device="cuda")
    w_full = torch.rand(T, 2 * K, device="cuda")
    w = w_full[:, ::2]  # strided
    w_nan = w.clone()
    w_nan[idx < 0] = float("nan")
    seen = []
    for alignment in (1, 16):
        routed, _, handle = a2a.dispatch(x, idx, num_experts=E, expert_alignment=alignment)
        out = (routed.float() * 1.5).to(routed.dtype)
        out_strided = out.t().contiguous().t()  # column-major
        y_ref = a2a.combine(out, handle, w.contiguous())
        y_strided = a2a.combine(out_strided, handle, w)
        y_nan = a2a.combine(out, handle, w_nan)
        y_zero = a2a.combine(out, handle, torch.where(idx < 0, 0.0, w_nan))
        same = torch.equal(y_ref, y_strided)
        finite = bool(torch.isfinite(y_nan).all()) and torch.equal(y_nan, y_zero)
        seen.append(f"alignment {alignment}: strided weights / expert_out equal to contiguous: {same}; "
                    f"NaN weights on dropped slots: finite and equal to zero weights: {finite}")
        assert same and finite, seen[-1]
    return "; ".join(seen)


CHECKS = [check_barrier, check_kernel_inputs]


def main() -> int:
    return run_checks(CHECKS)


if __name__ == "__main__":
    if sys.argv[1:] == ["--stuck-barrier"]:
        _stuck_barrier()
    elif sys.argv[1:] == ["--out-of-step-barrier"]:
        _out_of_step_barrier()
    else:
        sys.exit(main())
