"""The backend interface, the dispatch handle every backend returns, and the registry by name.

A backend is one module: a :class:`Backend` subclass registered with :func:`register`, and a
:class:`DispatchHandle` subclass whose ``combine`` undoes its ``dispatch``. ``alltoall_ops``'s
public ``dispatch`` resolves the group, picks a backend (:func:`choose`), runs the call's checks
once through that backend's failure channel (:meth:`Backend.checked`), then its ``dispatch``
(plan, move); the public ``combine`` calls the handle's (check, move).
"""

from __future__ import annotations

import abc
import logging
from typing import Any, Callable, ClassVar, Optional, TypeVar

import torch

from .. import comm
from .._compat import is_compiling
from ..groups import LOCAL, Group
from ..payload import Payload
from ..validation import check_combine_args, check_combine_rows, check_dispatch_args

logger = logging.getLogger(__name__)

T = TypeVar("T")


class DispatchHandle(abc.ABC):
    """What ``combine`` needs to undo one ``dispatch``; each backend has its own kind.

    Every handle has ``position_TK`` (T, K) int64, each slot's send position, ``num_rows`` (R,
    the rows of ``routed``), ``expert_alignment``, ``group_name`` and ``world_size``. Handles
    hold tensors, ints and (symm_mem) an opaque buffers object, so they pass through compiled
    graphs."""

    position_TK: torch.Tensor
    num_rows: int
    expert_alignment: int
    group_name: str
    world_size: int

    @property
    def num_tokens(self) -> int:
        """T of the dispatch."""
        return self.position_TK.shape[0]

    @property
    def top_k(self) -> int:
        """K of the dispatch."""
        return self.position_TK.shape[1]

    @abc.abstractmethod
    def combine(self, expert_out_RH: torch.Tensor, topk_weights_TK: Optional[torch.Tensor], *,
                async_op: bool = False) -> torch.Tensor:
        """(R, H) expert outputs -> (T, H), see :func:`alltoall_ops.combine`: its checks
        (:meth:`check_combine_everywhere`), then its op (``async_op``: its exchange pending until
        :func:`alltoall_ops.wait`)."""

    def check_combine(self, expert_out_RH: torch.Tensor, topk_weights_TK: Optional[torch.Tensor]) -> None:
        """Raise on a bad combine argument (this rank's own checks; no communication)."""
        check_combine_args(expert_out_RH, self, topk_weights_TK)
        check_combine_rows(expert_out_RH, self.num_rows)

    def check_combine_everywhere(self, expert_out_RH: torch.Tensor, topk_weights_TK: Optional[torch.Tensor]) -> None:
        """:meth:`check_combine`, before combine moves anything.

        Combine starts with no exchange of its own (its split sizes are the dispatch's), so a
        rank whose checks raise leaves its peers in the payload exchange until the library's
        deadline. Debug mode (``ALLTOALL_OPS_DEBUG=1``, eager, W > 1) adds one header agreement:
        then every rank raises (its peers a PeerInputError), and ranks that pass expert outputs
        of different hidden sizes or dtypes raise a GroupMismatchError instead of exchanging
        mismatched rows."""
        if self.world_size > 1 and comm.debug() and not is_compiling():
            comm.checked("combine", self.group_name, self.check_combine, expert_out_RH, topk_weights_TK)
            comm.agree("combine", self.group_name, comm.combine_fields(expert_out_RH, self.top_k))
        else:
            self.check_combine(expert_out_RH, topk_weights_TK)


def save_returned(topk_weights_TK: Optional[torch.Tensor]) -> bool:
    """Whether combine keeps the returned rows (N, H): for the weights' gradient only."""
    return topk_weights_TK is not None and topk_weights_TK.requires_grad and torch.is_grad_enabled()


class Backend(abc.ABC):
    """How dispatch moves rows. A subclass sets ``name`` and implements ``dispatch`` (plan, then
    move); it overrides ``check_group`` / ``check_dispatch`` where it serves fewer calls than
    these accept, and ``tell_peers`` where its peers wait elsewhere than in the group's agreement."""

    name: ClassVar[str]

    def check_group(self, group: Group, buffers: Any) -> None:
        """Raise ``ValueError`` / ``TypeError`` if this backend cannot serve ``group`` (with
        ``buffers``): the checks of the choice."""
        if buffers is not None:
            raise ValueError(f"buffers: only backend='symm_mem' uses buffers, got backend={self.name!r}")

    def check_dispatch(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, *, num_experts: int, group: Group,
                       expert_alignment: int, buffers: Any, payload: Optional[Payload]) -> int:
        """Raise on a dispatch argument this backend rejects (shapes, dtypes and ints: no tensor
        read, so every rank of an SPMD program raises alike); returns E as an int."""
        return check_dispatch_args(x_TH, topk_idx_TK, num_experts, group.size, expert_alignment)

    def tell_peers(self, group: Group, buffers: Any, error: BaseException) -> None:
        """The failure channel: take part, with this rank's ``error``, in the exchange where the
        peers' dispatch waits first (default: the group's agreement), so that they raise a
        PeerInputError; returns, and the caller raises ``error``."""
        comm.tell("dispatch", group.name, error)

    def checked(self, group: Group, buffers: Any, check: Callable[..., T], *args: Any) -> T:
        """``check(*args)``; on a group, a ``TypeError`` / ``ValueError`` it raises is told to the
        peers first (:meth:`tell_peers`). Under torch.compile the checks run at trace time, where no
        collective can: they raise on this rank only."""
        if group.name == LOCAL or is_compiling():
            return check(*args)
        try:
            return check(*args)
        except (TypeError, ValueError) as exc:
            self.tell_peers(group, buffers, exc)
            raise

    @abc.abstractmethod
    def dispatch(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, *, num_experts: int, group: Group,
                 expert_alignment: int, buffers: Any, payload: Optional[Payload],
                 async_op: bool) -> tuple[Any, torch.Tensor, DispatchHandle]:
        """Plan, then move: routed (R, H) (with an fp8 ``payload``: see
        :func:`alltoall_ops.dispatch`), tokens_per_expert (e,), handle. Its arguments passed
        :meth:`check_dispatch` (``num_experts`` is the int it returned). async_op: the rows'
        exchange (the backend's dispatch op) started on the communication stream, pending until
        :func:`alltoall_ops.wait` on routed."""


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Make ``backend`` available as ``backend=<its name>``."""
    if backend.name in _REGISTRY or backend.name == "auto":
        raise ValueError(f"backend name {backend.name!r} is taken")
    _REGISTRY[backend.name] = backend
    return backend


def names() -> tuple[str, ...]:
    """Every accepted ``backend=`` value, "auto" first."""
    return ("auto", *_REGISTRY)


def auto(group: Group, buffers: Any = None) -> Backend:
    """The backend ``backend="auto"`` picks: "symm_mem" when ``buffers`` is given, else "local" on
    a group of one rank (or none), else "collective"."""
    return _REGISTRY["symm_mem" if buffers is not None else "local" if group.size == 1 else "collective"]


def choose(name: str, group: Group, buffers: Any = None) -> Backend:
    """The backend ``backend=name`` selects for ``group`` (and ``buffers``), verified and logged:
    raises ``ValueError`` / ``TypeError`` if that backend cannot serve them (no communication)."""
    backend = auto(group, buffers) if name == "auto" else _REGISTRY.get(name)
    if backend is None:
        raise ValueError(f"backend: expected one of {names()}, got {name!r}")
    backend.check_group(group, buffers)
    if not is_compiling() and logger.isEnabledFor(logging.DEBUG):
        logger.debug("backend %r on group %r (%d ranks)", backend.name, group.name or "(none)", group.size)
    return backend
