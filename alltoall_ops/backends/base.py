"""The backend interface, the dispatch handle every backend returns, and the registry by name.

A backend is one module: a :class:`Backend` subclass registered with :func:`register`, and a
:class:`DispatchHandle` subclass whose ``combine`` undoes its ``dispatch``. ``alltoall_ops``'s
public ``dispatch`` / ``combine`` resolve the group, :func:`choose` a backend and call it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, ClassVar, Optional

import torch

from .. import comm
from .._compat import is_compiling
from ..groups import Group
from ..payload import Payload
from ..validation import check_combine_args, check_combine_rows

logger = logging.getLogger(__name__)


class DispatchHandle:
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

    def combine(self, expert_out_RH: torch.Tensor, topk_weights_TK: Optional[torch.Tensor],
                async_op: bool = False) -> torch.Tensor:
        """(R, H) expert outputs -> (T, H), see :func:`alltoall_ops.combine` (``async_op``: its
        exchange pending until :func:`alltoall_ops.wait`)."""
        raise NotImplementedError

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


class Backend:
    """How dispatch moves rows. Subclasses set ``name`` and implement ``dispatch``."""

    name: ClassVar[str]

    def check_group(self, group: Group, buffers: Any) -> None:
        """Raise ``ValueError`` if this backend cannot serve ``group`` (with ``buffers``)."""
        if buffers is not None:
            raise ValueError(f"buffers: only backend='symm_mem' uses buffers, got backend={self.name!r}")

    def checked(self, group: Group, buffers: Any, check: Callable[..., Any], *args: Any) -> Any:
        """``check(*args)`` (argument checks of a dispatch) through this backend's failure
        channel: on a group, a rank whose checks raise tells its peers in the exchange they wait
        in, and they raise a PeerInputError. Default: the group's agreement (``comm.checked``)."""
        return comm.checked("dispatch", group.name, check, *args)

    def dispatch(
        self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int, group: Group, expert_alignment: int,
        buffers: Any, payload: Optional[Payload] = None, async_op: bool = False,
    ) -> tuple[Any, torch.Tensor, DispatchHandle]:
        """routed (R, H) (with an fp8 ``payload``: see :func:`alltoall_ops.dispatch`),
        tokens_per_expert (e,), handle. async_op: the rows' exchange (the backend's dispatch op)
        started on the communication stream, pending until :func:`alltoall_ops.wait` on routed."""
        raise NotImplementedError


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


def _auto(group: Group, buffers: Any) -> str:
    return "symm_mem" if buffers is not None else "local" if group.size == 1 else "collective"


def checked(group: Group, buffers: Any, check: Callable[..., Any], *args: Any) -> Any:
    """``check(*args)`` before a backend is chosen (the choice's own checks among them), through
    the failure channel of the backend "auto" picks for ``group`` and ``buffers``: the exchange
    every rank's dispatch waits in first."""
    return _REGISTRY[_auto(group, buffers)].checked(group, buffers, check, *args)


def choose(name: str, group: Group, buffers: Any = None) -> Backend:
    """The backend ``backend=name`` selects for ``group``. "auto": "symm_mem" when ``buffers`` is
    given, else "local" on a group of one rank (or none), else "collective". Raises if that
    backend cannot serve it."""
    if name == "auto":
        name = _auto(group, buffers)
    if name not in _REGISTRY:
        raise ValueError(f"backend: expected one of {names()}, got {name!r}")
    backend = _REGISTRY[name]
    backend.check_group(group, buffers)
    if not is_compiling() and logger.isEnabledFor(logging.DEBUG):
        logger.debug("backend %r on group %r (%d ranks)", name, group.name or "(none)", group.size)
    return backend
