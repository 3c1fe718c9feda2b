"""The library's exception types. Each subclasses the builtin a caller would catch anyway
(``ValueError`` for bad input, ``RuntimeError`` / ``TimeoutError`` for faults), so existing
``except ValueError`` code keeps working.

Messages name the op, the group and the rank where that helps: ``alltoall_ops.<op> on group
<name> (rank r of W): ...``.
"""

from __future__ import annotations


class RoutingError(ValueError):
    """Expert ids outside [-1, E) in some rank's ``topk_idx`` (raised on every rank)."""


class CapacityError(ValueError):
    """A dispatch does not fit its symm_mem buffers: more slots, rows or alignment than they
    were created for."""


class GroupMismatchError(ValueError):
    """The ranks of a group disagree on something every rank must share (E, H, dtype, top-k,
    alignment, shapes), or are out of step (different ops, or different call counts)."""


class PeerInputError(ValueError):
    """Another rank of the group rejected its own arguments; the message carries its error."""


class CollectiveError(RuntimeError):
    """A collective under an op of this library failed; ``__cause__`` is the original error."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective or barrier of this library did not complete within its deadline."""


__all__ = ["CapacityError", "CollectiveError", "CollectiveTimeout", "GroupMismatchError", "PeerInputError",
           "RoutingError"]
