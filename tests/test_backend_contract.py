"""The backend contract: a dispatch chooses its backend once, runs its argument checks once
(through the chosen backend's failure channel), then the backend's ``dispatch`` (plan, move);
``Backend.dispatch`` and every handle's ``combine`` take their options by keyword."""

from __future__ import annotations

import inspect

import pytest
import torch

import alltoall_ops as a2a
from alltoall_ops import api, backends, validation
from alltoall_ops.backends import base
from alltoall_ops.backends.symm_mem import backend as symm_backend
from alltoall_ops.groups import NO_GROUP, Group
from alltoall_ops.testing import RankFailures

E, T, H, K = 4, 5, 8, 2


class CheckCounts:
    """Calls of ``validation.check_dispatch_args`` (wherever a backend calls it) and of the
    payload's checks while installed."""

    def __init__(self):
        self.dispatch_args = self.payload_args = 0
        self._saved = []

    def __enter__(self) -> "CheckCounts":
        def counted(field, real):
            def fn(*args, **kwargs):
                setattr(self, field, getattr(self, field) + 1)
                return real(*args, **kwargs)
            return fn

        for module in (base, symm_backend):
            self._patch(module, "check_dispatch_args", counted("dispatch_args", validation.check_dispatch_args))
        self._patch(api, "check_payload_args", counted("payload_args", validation.check_payload_args))
        return self

    def _patch(self, module, name, fn):
        self._saved.append((module, name, getattr(module, name)))
        setattr(module, name, fn)

    def __exit__(self, *exc):
        for module, name, real in reversed(self._saved):
            setattr(module, name, real)


def _inputs(rank: int = 0):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(T, H, generator=g), torch.randint(-1, E, (T, K), generator=g)


@pytest.mark.parametrize("how", ["local", "symm_mem buffers", "symm_mem cached"])
def test_a_dispatch_checks_its_arguments_once(how):
    x, idx = _inputs()
    kwargs = {"local": dict(backend="local"), "symm_mem cached": dict(backend="symm_mem"),
              "symm_mem buffers": dict(buffers=a2a.SymmBuffers(T, H, K, E, dtype=x.dtype, device="cpu"))}[how]
    with CheckCounts() as counts:
        routed, _, handle = a2a.dispatch(x, idx, num_experts=E, **kwargs)
    assert (counts.dispatch_args, counts.payload_args) == (1, 1)
    a2a.combine(routed, handle)


def checks_of_a_dispatch(rank: int, world_size: int, backend: str) -> tuple[int, int]:
    x, idx = _inputs(rank)
    with CheckCounts() as counts:
        a2a.dispatch(x, idx, num_experts=E, backend=backend)
    return counts.dispatch_args, counts.payload_args


@pytest.mark.parametrize("backend", ["collective", "symm_mem"])
def test_a_dispatch_on_a_group_checks_its_arguments_once(pool2, backend):
    assert pool2.run(checks_of_a_dispatch, backend) == [(1, 1)] * 2


def test_a_failed_choice_runs_no_argument_check():
    x, idx = _inputs()
    with CheckCounts() as counts, pytest.raises(ValueError, match="backend: expected one of"):
        a2a.dispatch(x, idx, num_experts=E, backend="nccl")
    assert counts.dispatch_args == counts.payload_args == 0


# name -> (the bad rank's dispatch options, its peers', text in every message)
BAD_CHOICE = {
    "unknown name": (dict(backend="nccl"), {}, "backend: expected one of"),
    "local on two ranks": (dict(backend="local"), {}, "backend='local' needs a group of one rank"),
    "buffers with collective": (dict(backend="collective", buffers=True), dict(buffers=True), "buffers:"),
}


def bad_choice(rank: int, world_size: int, name: str, bad_rank: int) -> None:
    options = BAD_CHOICE[name][rank != bad_rank]
    if options.get("buffers"):
        options = {**options, "buffers": a2a.SymmBuffers(T, H, K, E, dtype=torch.float32, device="cpu")}
    x, idx = _inputs(rank)
    a2a.dispatch(x, idx, num_experts=E, **options)


def healthy(rank: int, world_size: int) -> None:
    x, idx = _inputs(rank)
    routed, _, handle = a2a.dispatch(x, idx, num_experts=E)
    torch.testing.assert_close(a2a.combine(routed, handle), x * (idx >= 0).sum(1, keepdim=True))


@pytest.mark.parametrize("name", list(BAD_CHOICE))
def test_a_choice_that_fails_on_one_rank_raises_on_every_rank(pool2, name):
    """The peers, whose own choice is fine, wait in their backend's first exchange (the group's
    agreement, or the buffers' metadata exchange): the bad rank tells them there."""
    with pytest.raises(RankFailures) as info:
        pool2.run(bad_choice, name, 1, timeout=60)
    errors = info.value.errors
    assert info.value.silent == [] and sorted(errors) == [0, 1], str(info.value)
    assert errors[1].type_name == "ValueError" and BAD_CHOICE[name][2] in errors[1].message, errors[1]
    assert errors[0].type_name == "PeerInputError" and "rank 1 rejected its arguments" in errors[0].message
    assert errors[1].message in errors[0].message
    pool2.run(healthy, timeout=60)


def _options(fn) -> dict[str, inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())[1:]  # after self
    return {p.name: p for p in params if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD}


def test_every_backend_takes_the_contract_by_keyword():
    """Each registered backend's dispatch has the base's keyword-only, annotated options, and
    every handle's combine takes async_op by keyword."""
    contract = _options(backends.Backend.dispatch)
    assert list(contract) == ["num_experts", "group", "expert_alignment", "buffers", "payload", "async_op"]
    for name in backends.names()[1:]:
        options = _options(type(backends.choose(name, _group_for(name))).dispatch)
        assert list(options) == list(contract), name
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY and p.annotation is not inspect.Parameter.empty
                   for p in options.values()), name
    for handle_type in _subclasses(backends.DispatchHandle):
        assert _options(handle_type.combine)["async_op"].kind is inspect.Parameter.KEYWORD_ONLY, handle_type


def _group_for(name: str):
    # NB: collective refuses a process-less group; its class is all the test reads
    return Group("contract", 0, 2) if name == "collective" else NO_GROUP


def _subclasses(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]
