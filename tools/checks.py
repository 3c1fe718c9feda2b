"""The command-line runner of the GPU check tools: each check a function returning a detail
line (or None) and raising on failure."""

from __future__ import annotations

import time
import traceback
from typing import Callable, Iterable


def run_checks(checks: Iterable[Callable[[], object]]) -> int:
    """Run every check, printing ``PASS name: detail (seconds)`` or ``FAIL name:`` and its
    traceback, then ``ALL PASS`` or the failed names; returns the exit code (1 on any failure)."""
    failed = []
    for fn in checks:
        t0 = time.perf_counter()
        try:
            detail = fn() or ""
            print(f"PASS {fn.__name__}: {detail} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception:
            failed.append(fn.__name__)
            print(f"FAIL {fn.__name__}:\n{traceback.format_exc()}", flush=True)
    print("ALL PASS" if not failed else f"FAILED: {failed}")
    return 1 if failed else 0
