"""Resolving the ``group=`` argument of the public API into what the ops take: a name."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

LOCAL = ""
"""Group name of the local backend: one rank, no communication."""


@dataclasses.dataclass(frozen=True)
class Group:
    """A resolved communication group: its registered name (``LOCAL`` for no group), rank, size."""

    name: str
    rank: int
    size: int


def resolve_group(group: Any) -> Group:
    """ProcessGroup, 1-D DeviceMesh, or None (the default group, or no group when torch.distributed
    is not initialised) -> :class:`Group`."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return Group(LOCAL, 0, 1)
        group = dist.group.WORLD
    if hasattr(group, "get_group") and hasattr(group, "mesh"):  # DeviceMesh
        if group.ndim != 1:
            raise ValueError(
                f"group: expected a 1-D DeviceMesh (e.g. mesh['ep']), got a {group.ndim}-D mesh "
                f"with dims {group.mesh_dim_names}"
            )
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group: expected a ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}"
        )
    return Group(group.group_name, group.rank(), group.size())


def process_group(name: str) -> dist.ProcessGroup:
    """The ProcessGroup registered under ``name`` (works on torch 2.11 to 2.13)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def pick_backend(backend: str, group: Group) -> Group:
    """Apply ``backend=`` ("auto" | "local" | "collective") to a resolved group.

    "local" and "auto" at one rank drop the group (no communication at all)."""
    if backend not in ("auto", "local", "collective"):
        raise ValueError(
            f"backend: expected 'auto', 'local' or 'collective', got {backend!r}"
        )
    if backend == "local" and group.size != 1:
        raise ValueError(
            f"backend='local' needs a group of one rank, got a group of {group.size} ranks"
        )
    if backend == "collective" and group.name == LOCAL:
        raise ValueError(
            "backend='collective' needs an initialised process group (torch.distributed is not "
            "initialised and no group was given)"
        )
    if backend in ("auto", "local") and group.size == 1:
        return Group(LOCAL, 0, 1)
    return group
