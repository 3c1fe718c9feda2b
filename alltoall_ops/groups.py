"""Resolving the ``group=`` argument of the public API into what the ops take: a name."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

LOCAL = ""
"""Group name of the local backend: one rank, no communication."""


@dataclasses.dataclass(frozen=True)
class Group:
    """A resolved communication group: its registered name (``LOCAL`` for no group), rank, size."""

    name: str
    rank: int
    size: int


NO_GROUP = Group(LOCAL, 0, 1)
"""``group=NO_GROUP``: this rank alone, whatever the default process group (e.g. expert
parallelism off in a multi-rank job)."""


def resolve_group(group: Any) -> Group:
    """ProcessGroup, 1-D DeviceMesh, or None (the default group, or no group when torch.distributed
    is not initialised) -> :class:`Group`; a :class:`Group` stays as it is (``NO_GROUP``: one
    rank, no communication, also under torchrun)."""
    if isinstance(group, Group):
        return group
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return NO_GROUP
        group = dist.group.WORLD
    # NB: ProcessGroup first: under torch.compile it is an opaque object, and probing it for
    # DeviceMesh attributes with hasattr is a hard error.
    if isinstance(group, dist.ProcessGroup):
        return Group(group.group_name, group.rank(), group.size())
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


def communication_group(group: Group) -> Group:
    """The group an op communicates over: none (``LOCAL``) for a group of one rank."""
    return NO_GROUP if group.size == 1 else group


def _groups_to_warm(mesh_or_groups: Any) -> list[dist.ProcessGroup]:
    if hasattr(mesh_or_groups, "get_group") and hasattr(mesh_or_groups, "mesh"):  # DeviceMesh
        mesh = mesh_or_groups
        return [mesh.get_group(dim) for dim in range(mesh.ndim)]
    if isinstance(mesh_or_groups, dist.ProcessGroup) or mesh_or_groups is None:
        mesh_or_groups = [mesh_or_groups]
    groups = []
    for item in mesh_or_groups:
        if hasattr(item, "get_group") and hasattr(item, "mesh"):
            groups += _groups_to_warm(item)
        else:
            groups.append(process_group(resolve_group(item).name))
    return groups


def warmup(mesh_or_groups: Any = None) -> int:
    """One small all-to-all on each group so that communicator set-up (NCCL's lazy init, gloo
    pairs) stays out of the first step's latency.

    mesh_or_groups: a DeviceMesh (every dimension's group, e.g. ``["ep", "cp"]``), a
    ProcessGroup, an iterable of those or of 1-D meshes, or None (the default group).
    Collective: every member of each group must call it. Returns the number of groups warmed."""
    groups = _groups_to_warm(mesh_or_groups)
    for pg in groups:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(pg) == "nccl"
            else torch.device("cpu")
        )
        send = torch.arange(pg.size(), dtype=torch.int64, device=device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=pg)
    if groups and any(dist.get_backend(pg) == "nccl" for pg in groups):
        torch.cuda.synchronize()
    return len(groups)
