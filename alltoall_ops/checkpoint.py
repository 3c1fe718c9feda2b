"""Selective activation checkpointing (SAC) policy that never re-runs communication.

Example::

    from functools import partial
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context_fn = partial(create_selective_checkpoint_contexts, a2a.sac_policy())
    y = checkpoint(moe_block, x, use_reentrant=False, context_fn=context_fn)
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.utils.checkpoint import CheckpointPolicy

from .comm import communication_ops

_FUNCTIONAL_COLLECTIVES = ("all_to_all_single", "wait_tensor")
"""The functional all-to-all, and the wait that ends it and every async exchange of this library
(``alltoall_ops.wait``): a start and its wait are both saved, never re-run."""


def _functional_collective_ops() -> tuple[torch._ops.OpOverload, ...]:
    ops = torch.ops._c10d_functional
    return tuple(getattr(ops, name).default for name in _FUNCTIONAL_COLLECTIVES if hasattr(ops, name))


def _is_device_to_host_copy(op, args, kwargs) -> bool:
    """``aten._to_copy`` of a non-CPU tensor to the CPU (e.g. ``split_sizes.tolist()`` inputs)."""
    if op is not torch.ops.aten._to_copy.default or not args:
        return False
    device = kwargs.get("device")
    src = args[0]
    return (
        device is not None
        and torch.device(device).type == "cpu"
        and isinstance(src, torch.Tensor)
        and src.device.type != "cpu"
    )


def sac_policy(save: Iterable = (), recompute: Iterable = ()) -> Callable:
    """A policy for ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

    MUST_SAVE: every communication op of this library (read from the op registry, so ops of new
    backends are covered; with ``async_op`` they are the starts), the functional-collective
    all-to-all and ``wait_tensor`` (the waits), device-to-host copies, and the ops in ``save``.
    MUST_RECOMPUTE: the ops in ``recompute``. PREFER_RECOMPUTE: everything else. ``save`` /
    ``recompute`` take OpOverloads (``torch.ops.aten.mm.default``). Stateless."""
    must_save = frozenset(communication_ops()) | frozenset(_functional_collective_ops()) | frozenset(save)
    must_recompute = frozenset(recompute)
    overlap = must_save & must_recompute
    if overlap:
        raise ValueError(f"recompute: ops {sorted(map(str, overlap))} are also marked to save")

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in must_save or _is_device_to_host_copy(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        if op in must_recompute:
            return CheckpointPolicy.MUST_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy
