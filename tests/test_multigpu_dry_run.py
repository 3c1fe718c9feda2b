"""The multi-GPU checks and benchmarks (``benchmarks/bench_multigpu.py``,
``benchmarks/ulysses_multigpu.py``, torchrun) in their dry runs on two gloo CPU ranks, so that the
scripts a 2-GPU session runs work before it gets there: every check passes, every row is timed
and written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _torchrun(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", module, "--cpu", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def test_bench_multigpu_checks_dry_run():
    proc = _torchrun("benchmarks.bench_multigpu", "--check")
    assert proc.stdout.count("PASS ") >= 9 and "FAIL" not in proc.stdout, proc.stdout[-4000:]
    assert "PASS symm_mem fp8" in proc.stdout, proc.stdout[-4000:]


def test_ulysses_multigpu_dry_run(tmp_path):
    proc = _torchrun("benchmarks.ulysses_multigpu", "--check", "--bench", "--out", str(tmp_path))
    assert "PASS exchange" in proc.stdout and "PASS attention" in proc.stdout and "FAIL" not in proc.stdout, \
        proc.stdout[-4000:]
    rows = json.loads((tmp_path / "ulysses_multigpu_W2.json").read_text())["rows"]
    assert {r["row"] for r in rows} >= {"seq_to_head q/k/v symm", "attention fwd+bwd symm",
                                        "projections + attention fwd, q first, symm",
                                        "projections + attention fwd, q first, collective"}
    assert all(r["us"] > 0 for r in rows)
