"""Package-level behaviour: the version, what goes to the ``alltoall_ops`` logger, the Triton
interpreter switch on a machine without CUDA, and an op's first call importing nothing (in fresh
processes)."""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

import alltoall_ops as a2a


def test_version_is_the_installed_one():
    assert a2a.__version__ == importlib.metadata.version("alltoall_ops")


def test_logs_buffer_creation_and_backend_choice(caplog):
    with caplog.at_level(logging.DEBUG, logger="alltoall_ops"):
        a2a.dispatch(torch.randn(3, 4), torch.zeros(3, 1, dtype=torch.int64), num_experts=2)
        a2a.SymmBuffers(3, 4, 1, 2, dtype=torch.float32, device="cpu")
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("alltoall_ops")]
    assert any("backend 'local'" in m for m in messages), messages
    assert any(m.startswith("SymmBuffers(") and "MiB per rank" in m for m in messages), messages


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, check=False, env={**environ, **env})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is switched on only without CUDA")
def test_interpreter_is_switched_on_without_cuda_and_logged():
    out = _run("""
        import logging, os
        logging.basicConfig(level=logging.INFO)
        import alltoall_ops
        print("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"))
    """)
    assert out.returncode == 0, out.stderr
    assert "TRITON_INTERPRET 1" in out.stdout
    assert "set TRITON_INTERPRET=1 for this process" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is switched on only without CUDA")
def test_an_explicit_triton_interpret_is_left_alone():
    out = _run("""
        import os, torch
        import alltoall_ops as a2a
        print("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"))
        x = torch.randn(3, 4)
        y = a2a.combine(*a2a.dispatch(x, torch.zeros(3, 1, dtype=torch.int64), num_experts=2)[::2])
        print("local backend ok", torch.equal(y, x))
        try:
            a2a.SymmBuffers(3, 4, 1, 2, dtype=torch.float32, device="cpu")
        except RuntimeError as exc:
            print(exc)
    """, TRITON_INTERPRET="0")
    assert out.returncode == 0, out.stderr
    assert "TRITON_INTERPRET 0" in out.stdout
    assert "local backend ok True" in out.stdout
    assert "SymmBuffers on the CPU run the kernels in Triton's interpreter" in out.stdout


def test_the_first_op_call_imports_nothing():
    """torch imports dynamo (1-2 s) at a custom op's first call through the dispatcher; the package
    imports it, so no rank's first op is seconds late. Before: a rank whose checks failed joined
    the agreement at once, its peers' first exchange op imported dynamo, and past a short
    deadline every rank timed out instead of raising its error (issue 31)."""
    out = _run("""
        import sys, torch
        import alltoall_ops as a2a
        before = set(sys.modules)
        a2a.layout.dispatch_layout_op(torch.zeros(2, 1, dtype=torch.int64), 2, 1, 1)
        print("imported", sorted(set(sys.modules) - before))
    """)
    assert out.returncode == 0, out.stderr
    assert "imported []" in out.stdout, out.stdout
