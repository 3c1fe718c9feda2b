"""Package-level behaviour: the version, what goes to the ``alltoall_ops`` logger, the Triton
interpreter switch on a machine without CUDA and its xor reduction, a light import, dynamo
imported before a checked op's checks (in fresh processes), and the one-rank process group of
``testing``."""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import operator
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs the kernels only without CUDA")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_the_interpreter_reduces_xor_in_numpy_as_in_python(monkeypatch, dtype):
    # loader.load() gives Triton's interpreter numpy's xor reduction (tl.sort's swaps): a kernel's
    # xor over each axis and over all, and its sort, are the same integers with the
    # interpreter's own element-by-element path and against Python's xor and sort.
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    from alltoall_ops.kernels import loader

    loader.load()
    python_reduce = getattr(interpreter.ReduceOps.apply_impl, "python_reduce", None)
    if python_reduce is None:
        pytest.skip("this Triton's interpreter has other internals: its own xor reduction runs")
    kernel = _xor_and_sort_kernel()
    info = torch.iinfo(dtype)
    x = torch.randint(info.min, info.max, (4, 64), dtype=torch.int64).to(dtype)
    expected = [
        [functools.reduce(operator.xor, column) for column in x.T.tolist()],
        [functools.reduce(operator.xor, row) for row in x.tolist()],
        [functools.reduce(operator.xor, x.flatten().tolist())],
        sorted(x.flatten().tolist()),
    ]

    def run():
        outs = (torch.empty(64, dtype=dtype), torch.empty(4, dtype=dtype), torch.empty(1, dtype=dtype),
                torch.empty(256, dtype=dtype))
        kernel[(1,)](x, *outs, R=4, C=64)
        return [out.tolist() for out in outs]

    assert run() == expected
    monkeypatch.setattr(interpreter.ReduceOps, "apply_impl", python_reduce)
    assert run() == expected


@functools.cache
def _xor_and_sort_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, by_column_ptr, by_row_ptr, all_ptr, sorted_ptr, R: tl.constexpr, C: tl.constexpr):
        o_r, o_c = tl.arange(0, R), tl.arange(0, C)
        b_x = tl.load(x_ptr + o_r[:, None] * C + o_c[None, :])
        tl.store(by_column_ptr + o_c, tl.xor_sum(b_x, axis=0))
        tl.store(by_row_ptr + o_r, tl.xor_sum(b_x, axis=1))
        b_flat = tl.reshape(b_x, [R * C])
        tl.store(all_ptr + tl.arange(0, 1), tl.xor_sum(b_flat, axis=0) + tl.zeros([1], dtype=b_flat.dtype))
        tl.store(sorted_ptr + tl.arange(0, R * C), tl.sort(b_flat))

    return kernel


def test_the_import_is_light():
    """``import alltoall_ops`` imports neither dynamo (1-2 s), inductor nor triton: about 60 ms on
    top of ``import torch`` on the CI machine (issue 40; ``python -X importtime``)."""
    out = _run("""
        import sys, torch
        before = set(sys.modules)
        import alltoall_ops
        heavy = ("torch._dynamo", "torch._inductor", "triton")
        print("heavy", sorted(m for m in set(sys.modules) - before if m.split(".")[0] in heavy or m in heavy
                                or any(m.startswith(h + ".") for h in heavy)))
    """)
    assert out.returncode == 0, out.stderr
    assert "heavy []" in out.stdout, out.stdout


def test_a_checked_op_imports_dynamo_before_its_checks():
    """torch imports dynamo (1-2 s) at a custom op's first call through the dispatcher. A rank whose
    checks fail joins the agreement at once, without such a call: before issue 31 its peers,
    whose first exchange op imported dynamo, came seconds late, and past a short deadline every
    rank timed out instead of raising its error. Every rank imports it before the checks (and
    before any collective's deadline), so no rank's first op is late (tests/test_reliability.py,
    the ``late_*`` cases)."""
    out = _run("""
        import sys, torch
        import torch.distributed as dist
        import alltoall_ops as a2a
        from alltoall_ops import comm
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        print("dynamo at import", "torch._dynamo" in sys.modules)
        def check():
            print("dynamo at the check", "torch._dynamo" in sys.modules)
            raise ValueError("bad argument")
        try:
            comm.checked("dispatch", dist.group.WORLD.group_name, check)
        except ValueError as exc:
            print("raised", exc)
        dist.destroy_process_group()
    """)
    assert out.returncode == 0, out.stderr
    assert "dynamo at import False" in out.stdout, out.stdout
    assert "dynamo at the check True" in out.stdout, out.stdout
    assert "raised bad argument" in out.stdout, out.stdout


def test_destroy_process_group_frees_the_default_group_after_an_op():
    """torch.distributed.nn.functional's collectives default to ``group=group.WORLD``, evaluated
    at its first import, which an op's first collective made (through torch._dynamo's import),
    after init_process_group: ten defaults then held the group past destroy_process_group, and
    gloo's teardown at interpreter exit aborted now and then ("terminate called without an active
    exception", a CI run of the test above). ``alltoall_ops.comm`` imports it first."""
    out = _run("""
        import gc, sys, torch
        import torch.distributed as dist
        from alltoall_ops import comm
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        pg = dist.group.WORLD
        comm.agree("dispatch", pg.group_name, [0] * len(comm.FIELDS["dispatch"]))
        print("dynamo", "torch._dynamo" in sys.modules)
        dist.destroy_process_group()
        gc.collect()
        unshared = object()  # held by this script alone, as pg should be now
        print("held elsewhere", sys.getrefcount(pg) - sys.getrefcount(unshared))
    """)
    assert out.returncode == 0, out.stderr
    assert "dynamo True" in out.stdout, out.stdout
    assert "held elsewhere 0" in out.stdout, out.stdout


def test_one_rank_group_is_made_for_the_block_or_left_alone():
    # testing.one_rank_group: the default process group one-GPU tools and benchmarks take (gloo on
    # the CPU), gone after the block; inside one, an existing group is used as it is.
    import torch.distributed as dist

    from alltoall_ops.testing import one_rank_group

    assert not dist.is_initialized()
    with one_rank_group(torch.device("cpu")):
        assert (dist.get_world_size(), dist.get_backend()) == (1, "gloo")
        t = torch.ones(3)
        dist.all_reduce(t)
        with one_rank_group(torch.device("cpu")):
            assert dist.get_world_size() == 1
        assert dist.is_initialized() and t.tolist() == [1.0, 1.0, 1.0]
    assert not dist.is_initialized()
