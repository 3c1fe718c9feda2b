"""``kernels._config.CachedLaunch``: a key seen before launches the kernel Triton compiled for it
with every argument in order; anything Triton specializes on (alignment, ``== 1``, ``% 16``, a
constexpr, an option) makes a new key that goes through Triton's own launcher. A stand-in kernel
records the launches (the CPU has no CUDA launcher); the GPU tests run every kernel through it."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from alltoall_ops.kernels import _config


class Param:
    def __init__(self, name, is_constexpr=False, default=None):
        self.name, self.is_constexpr, self.default = name, is_constexpr, default


class Compiled:
    """What ``kernel[grid](...)`` returns: a compiled kernel with its raw launcher."""

    function, packed_metadata = "function", "packed"

    def __init__(self, launches):
        self.launches = launches

    def run(self, *launch):
        self.launches.append(("direct", launch))


class Kernel:
    """A ``triton.jit`` stand-in: ``src, n, X, BLOCK: constexpr, FLAG: constexpr = True``."""

    params = [Param("src"), Param("n"), Param("X"), Param("BLOCK", True), Param("FLAG", True, True)]

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append(("triton", grid, args, meta))
            return Compiled(self.launches)
        return launch


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(_config, "device_and_stream", lambda: (0, 1234))
    return Kernel()


def launches_of(kernel, *calls):
    """The kind of each launch of ``calls`` ((grid, args, meta) each) through one CachedLaunch."""
    cached = _config.CachedLaunch(kernel)
    for grid, args, meta in calls:
        cached[grid](*args, **meta)
    return [launch[0] for launch in kernel.launches]


def test_a_key_seen_before_launches_directly_with_every_argument_in_order(kernel):
    src = torch.empty(64)
    cached = _config.CachedLaunch(kernel)
    for _ in range(3):
        cached[(5,)](src, 32, 48, BLOCK=16, num_warps=4)
    assert [launch[0] for launch in kernel.launches] == ["triton", "direct", "direct"]
    assert kernel.launches[0][1:] == ((5,), (src, 32, 48), {"BLOCK": 16, "num_warps": 4})
    grid_and_stream, values = kernel.launches[1][1][:7], kernel.launches[1][1][7:]
    assert grid_and_stream == (5, 1, 1, 1234, "function", "packed", None)
    assert values == (None, None, src, 32, 48, 16, True)  # the hooks, then params with the default


@pytest.mark.parametrize("change", ["unaligned tensor", "dtype", "int 1", "int % 16", "int width",
                                    "constexpr", "option"])
def test_what_triton_specializes_on_makes_a_new_key(kernel, change):
    base = torch.empty(64)
    args, meta = (base[:32], 32, 48), {"BLOCK": 16}
    changed = {
        "unaligned tensor": ((base[1:33], 32, 48), meta),
        "dtype": ((base[:32].double(), 32, 48), meta),
        "int 1": ((base[:32], 1, 48), meta),
        "int % 16": ((base[:32], 32, 47), meta),
        "int width": ((base[:32], 32, 2**40), meta),
        "constexpr": (args, {"BLOCK": 32}),
        "option": (args, {"BLOCK": 16, "num_warps": 8}),
    }[change]
    assert launches_of(kernel, ((1,), args, meta), ((1,), *changed), ((1,), *changed)) == [
        "triton", "triton", "direct"]


def test_what_triton_does_not_specialize_on_keeps_the_key(kernel):
    base = torch.empty(128)
    calls = [((1,), (base[:32], 32, 48), {"BLOCK": 16, "FLAG": True}),
             ((7, 2), (base[64:], 64, 96), {"BLOCK": 16, "FLAG": True}),  # aligned view, ints % 16 alike
             ((3,), (torch.empty(8), 33, 17), {"BLOCK": 16}),  # 33 and 17 alike; FLAG by default
             ((3,), (torch.empty(8), 35, 19), {"BLOCK": 16})]
    assert launches_of(kernel, *calls) == ["triton", "direct", "triton", "direct"]


def test_constexpr_values_key_by_value():
    assert _config._specialization(tl.float32, True) == tl.float32
    assert _config._specialization(tl.float32, True) != _config._specialization(tl.float64, True)
    assert _config._specialization(0.5, False) == _config._specialization(2.0, False)


def test_a_launch_hook_goes_through_triton(kernel, monkeypatch):
    monkeypatch.setattr(_config.triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    src = torch.empty(8)
    assert launches_of(kernel, *[((1,), (src, 2, 2), {"BLOCK": 4})] * 2) == ["triton", "triton"]
