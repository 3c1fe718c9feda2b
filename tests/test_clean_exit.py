"""``make demo`` (and every example and benchmark that spawns CPU ranks through
``testing.DistributedPool``) ends clean: no warning from Python's resource tracker about leaked
semaphores or shared memory, no traceback, no process left behind (issue 40: the demo ended with
"There appear to be 4 leaked semaphore objects": each rank's tqdm lock, which torch.fx's
Interpreter makes at a compile, never unlinked since the ranks leave by ``os._exit``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _session_processes(sid: int) -> list[str]:
    """The live processes of session ``sid`` (Linux /proc), as 'pid command'."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
            if int(fields[3]) == sid and fields[0] != "Z":  # state, ppid, pgrp, session
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{entry.name} {command}")
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_demo_ends_without_leaks():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.Popen([sys.executable, "-m", "examples.demo", "--world-size", "2", "--steps", "2"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10  # the resource tracker leaves when the demo's end closes its pipe
    while (left := _session_processes(proc.pid)) and time.monotonic() < deadline:  # session id: the demo's pid
        time.sleep(0.2)
    assert proc.returncode == 0, err[-4000:]
    assert "PASS: expert-parallel training matches the dense reference" in out, out[-2000:]
    assert "leaked" not in err and "resource_tracker" not in err and "Traceback" not in err, err[-4000:]
    assert left == [], f"processes left behind by the demo: {left}"
