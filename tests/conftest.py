"""Shared fixtures: multi-process gloo pools (W = 1, 2, 4), started lazily and reused by the whole
session, a hypothesis profile sized for a 2-core CI machine, and the skip of the tests marked
``gpu`` where no CUDA GPU runs compiled kernels."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from alltoall_ops import testing
from alltoall_ops.testing import DistributedPool

settings.register_profile(
    "ci",
    max_examples=8,  # the default for multi-rank examples (process round-trips); cheap tests ask for more
    deadline=None,  # a distributed example includes process round-trips
    derandomize=False,  # fresh examples on every run, so CI keeps exploring
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,  # a failure prints the @reproduce_failure blob that replays it
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

RANK_TIMEOUT_S = 90.0
"""Per-run timeout used by the tests: longer than gloo's own (60 s), so that a rank stuck in a
collective surfaces as gloo's error rather than as a silent rank."""


class _LazyPool:
    """A :class:`DistributedPool` whose processes start on first use (DistributedPool already
    starts lazily; this wrapper only fixes the tests' default timeout)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.pool = DistributedPool(world_size)

    def run(self, fn, *args, timeout: float = RANK_TIMEOUT_S, **kwargs):
        return self.pool.run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        self.pool.close()


def _pool_fixture(world_size: int):
    @pytest.fixture(scope="session")
    def fixture():
        pool = _LazyPool(world_size)
        yield pool
        pool.close()

    return fixture


pool1 = _pool_fixture(1)
pool2 = _pool_fixture(2)
pool4 = _pool_fixture(4)


@pytest.fixture
def pool(request):
    """The session's pool of ``request.param`` ranks; use as
    ``@pytest.mark.parametrize("pool", [1, 2, 4], indirect=True)``."""
    return request.getfixturevalue(f"pool{request.param}")


@pytest.fixture
def unwritten_as_nan():
    """:func:`alltoall_ops.testing.nan_unwritten_rows` for the whole test: yields its list."""
    with testing.nan_unwritten_rows() as unwritten:
        yield unwritten


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` (``python -m pytest -m gpu tests/`` on a GPU host) skip without CUDA,
    and under ``TRITON_INTERPRET=1``: they check the compiled kernels on the device, whose CPU
    path (the same kernels in Triton's interpreter) the rest of the suite runs."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and compiled Triton kernels (TRITON_INTERPRET unset)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
