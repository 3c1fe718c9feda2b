"""The symm_mem metadata checks' kernel (``kernels/meta_check.py``) against the six checks in plain
torch, on random metadata matrices (Triton's interpreter without CUDA, compiled with it), and
``_check_meta``'s CPU path: the first failed check raises its own error."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import alltoall_ops as a2a
from alltoall_ops import layout
from alltoall_ops.backends.symm_mem import ops as symm_ops
from alltoall_ops.backends.symm_mem.buffers import ALIGNMENT, CALL, FAILED, META_EXTRA, N_SLOTS
from alltoall_ops.errors import CapacityError, GroupMismatchError, PeerInputError, RoutingError
from alltoall_ops.kernels import loader

DEVICE = "cpu" if loader.load().interpreting() else "cuda"


def _call_1(call: int) -> torch.Tensor:
    """The (1,) device tensor the checks compare the call column with."""
    return torch.tensor([call], device=DEVICE)


def _needed_W(counts_WE: torch.Tensor, alignment: int) -> torch.Tensor:
    """(W, E) slots of each source rank per expert -> (W,) rows each rank receives, padded."""
    W, E = counts_WE.shape
    return layout.round_up(counts_WE.sum(0), alignment).view(W, E // W).sum(1)


def _reference(meta_WL: torch.Tensor, E: int, call: int, alignment: int, max_slots: int, capacity: int,
               check_overflow: bool) -> int:
    """The six checks of ``_check_meta`` in its order, as a bitmask."""
    checks = [
        (meta_WL[:, E + FAILED] != 0).any(),
        (meta_WL[:, E + CALL] != call).any(),
        (meta_WL[:, E + ALIGNMENT] != alignment).any(),
        (meta_WL[:, E] > 0).any(),  # the status' first column: bad expert ids
        (meta_WL[:, E + N_SLOTS] > max_slots).any(),
        check_overflow and (_needed_W(meta_WL[:, :E], alignment) > capacity).any(),
    ]
    return sum(int(bool(c)) << i for i, c in enumerate(checks))


@st.composite
def metadata(draw):
    """(meta_WL, E, call, alignment, max_slots, capacity, check_overflow): each flag column mostly
    right, max_slots and the capacity on their bounds or one off."""
    W, e = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    E = W * e
    alignment, call = draw(st.integers(1, 4)), draw(st.integers(1, 10**6))

    def column(good: int, bad: st.SearchStrategy) -> list[int]:
        return [draw(st.one_of(st.just(good), bad)) if draw(st.booleans()) else good for _ in range(W)]

    counts_WE = torch.tensor(draw(st.lists(st.lists(st.integers(0, 9), min_size=E, max_size=E),
                                           min_size=W, max_size=W)))
    n_slots = counts_WE.sum(1)
    bad_ids = column(0, st.integers(1, 3))
    status = [[bad_ids[s], draw(st.integers(-1, E)), draw(st.integers(-1, E))] for s in range(W)]
    meta_WL = torch.zeros(W, E + META_EXTRA, dtype=torch.int64)
    meta_WL[:, :E] = counts_WE
    meta_WL[:, E : E + layout.STATUS_COLUMNS] = torch.tensor(status)
    meta_WL[:, E + N_SLOTS] = n_slots
    meta_WL[:, E + FAILED] = torch.tensor(column(0, st.just(1)))
    meta_WL[:, E + CALL] = torch.tensor(column(call, st.integers(0, call + 1)))
    meta_WL[:, E + ALIGNMENT] = torch.tensor(column(alignment, st.integers(1, 4)))
    near = st.sampled_from([-1, 0, 0, 1])  # on the bound half the time: a check off by one fails
    max_slots = max(0, int(n_slots.max()) + draw(near))
    capacity = max(1, int(_needed_W(counts_WE, alignment).max()) + draw(near))
    return meta_WL, E, call, alignment, max_slots, capacity, draw(st.booleans())


@settings(max_examples=50, deadline=None, derandomize=False)
@given(metadata())
def test_kernel_matches_the_checks(case):
    meta_WL, E, call, alignment, max_slots, capacity, check_overflow = case
    failed_checks_1 = loader.load().check_meta(
        meta_WL.to(DEVICE), E, symm_ops.CHECK_COLUMNS, _call_1(call), alignment, max_slots, capacity, check_overflow
    )
    assert failed_checks_1.shape == (1,) and failed_checks_1.dtype == torch.int64
    expected = _reference(meta_WL, E, call, alignment, max_slots, capacity, check_overflow)
    assert int(failed_checks_1) == expected, f"{int(failed_checks_1):06b} != {expected:06b} (bits: check 0 last)"


@pytest.mark.parametrize("W, e", [(48, 40), (3, 1500)])
def test_more_than_one_tile(W, e):
    # Past the kernel's tile of TILE = 1024 (rank, expert) entries: several blocks of ranks (both),
    # of local experts (e = 1500); e not a power of two. The capacity just enough, then one short.
    alignment, call = 3, 7
    E = W * e
    meta_WL = torch.zeros(W, E + META_EXTRA, dtype=torch.int64)
    meta_WL[:, :E] = torch.randint(0, 5, (W, E), generator=torch.Generator().manual_seed(W))
    meta_WL[:, E + CALL], meta_WL[:, E + ALIGNMENT] = call, alignment
    most = int(_needed_W(meta_WL[:, :E], alignment).max())
    for capacity, expected in ((most, 0), (most - 1, 1 << 5)):
        failed_checks_1 = loader.load().check_meta(
            meta_WL.to(DEVICE), E, symm_ops.CHECK_COLUMNS, _call_1(call), alignment, 0, capacity, True
        )
        assert int(failed_checks_1) == expected == _reference(meta_WL, E, call, alignment, 0, capacity, True)


FAILURES = [  # check i of the kernel's bits: how to fail it on one rank (E = 2, call 1), the error
    (lambda m: m[0, 2 + FAILED].fill_(1), PeerInputError, "rank 0 rejected its arguments"),
    (lambda m: m[0, 2 + CALL].fill_(2), GroupMismatchError, "out of step"),
    (lambda m: m[0, 2 + ALIGNMENT].fill_(2), GroupMismatchError, "disagree on expert_alignment"),
    (lambda m: m[0, 2:5].copy_(torch.tensor([1, -1, 7])), RoutingError, "1 expert id(s) outside"),
    (lambda m: m[0, 2 + N_SLOTS].fill_(3), CapacityError, "T * K = 3 slots"),
    (lambda m: m[0, 0].fill_(4), CapacityError, "overflow: rank 0 must receive 4 rows"),
]


@pytest.mark.parametrize("first", range(len(FAILURES)))
def test_the_first_failed_check_raises(first):
    # Checks first.. all fail: _check_meta raises the first one's error (CPU), with its message.
    if DEVICE != "cpu":
        pytest.skip("CUDA: a device-side assert, no exception")
    bufs = a2a.SymmBuffers(2, 1, 1, 2, dtype=torch.float32, device="cpu", capacity=3)  # N_max = 2
    meta_WL = torch.zeros(1, 2 + META_EXTRA, dtype=torch.int64)
    meta_WL[0, 2 + CALL], meta_WL[0, 2 + ALIGNMENT] = 1, 1
    symm_ops._check_meta(meta_WL, bufs, 1, _call_1(1))  # passes
    for fail, _, _ in FAILURES[first:]:
        fail(meta_WL)
    _, kind, message = FAILURES[first]
    with pytest.raises(kind, match=re.escape(message)) as err:
        symm_ops._check_meta(meta_WL, bufs, 1, _call_1(1))
    assert type(err.value) is kind


def test_the_device_assert_message_fits():
    assert len(symm_ops.CHECK_FAILED) < 255  # torch._assert_async's limit (RuntimeError past it)
