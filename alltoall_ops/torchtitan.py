"""A token dispatcher with torchtitan's interface (``torchtitan/models/common/token_dispatcher.py``:
``Config``, ``wire_meshes``, ``dispatch``, ``combine``), served by this library's backends.

In a torchtitan (0.3.0) model config, replace the dispatcher's config; torchtitan's
``RoutedExperts`` builds it (``Config.build()``), wires the EP mesh in its ``parallelize`` and calls
``dispatch`` / ``combine`` around its ``GroupedExperts``::

    from alltoall_ops.torchtitan import TokenDispatcher
    moe_config.routed_experts.token_dispatcher = TokenDispatcher.Config(num_experts=E, top_k=K)
    # what RoutedExperts then does:
    dispatcher = config.token_dispatcher.build()
    dispatcher.wire_meshes(ep_mesh=parallel_dims.get_optional_mesh("ep"))   # None: no expert parallelism
    routed_RD, tokens_per_local_expert_e, metadata = dispatcher.dispatch(
        x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
    out_TD = dispatcher.combine(experts(routed_RD, tokens_per_local_expert_e), metadata, x_TD)

Differences from torchtitan's own dispatchers: ``routed_RD`` is grouped by local expert, then
source rank, then token, with each expert's rows padded to ``expert_alignment`` (zero rows);
``num_local_tokens_per_expert_E`` is not needed (the counts come from the ids, once) and is
ignored; the scores weight the expert outputs in ``combine``, summed in fp32 (fp64 for fp64 rows) and
rounded once, where torchtitan's first rounds each row to fp32 (the same for bf16 experts).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from . import backends
from .api import combine, dispatch
from .backends import DispatchHandle
from .groups import NO_GROUP
from .validation import check_top_k


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatchMetadata:
    """What ``combine`` needs: the dispatch's handle and the (T, K) routing scores."""

    handle: DispatchHandle
    topk_scores_TK: torch.Tensor


class TokenDispatcher:
    """torchtitan-style token dispatcher: ``dispatch`` / ``combine`` over the expert-parallel
    mesh given to :meth:`wire_meshes` (not an ``nn.Module``: no parameters or buffers)."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Config:
        """num_experts: E (global); top_k: K; backend: as in :func:`alltoall_ops.dispatch`
        ("auto", "local", "collective", "symm_mem"); expert_alignment: pad each local expert's
        rows to a multiple of this; buffers: a :class:`alltoall_ops.SymmBuffers` for
        "symm_mem" (required under torch.compile; one for every MoE layer: blocks compiled one
        by one then compile once)."""

        num_experts: int
        top_k: int
        backend: str = "auto"
        expert_alignment: int = 1
        buffers: Any = None

        def build(self) -> "TokenDispatcher":
            """The dispatcher, as torchtitan's ``Config.build()`` (``RoutedExperts`` calls it)."""
            return TokenDispatcher(self)

        def to_dict(self) -> dict:
            """The fields, as torchtitan's config logging reads them (buffers by their repr)."""
            fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            return {**fields, "buffers": None if self.buffers is None else repr(self.buffers)}

    def __init__(self, config: Config):
        check_top_k(config.top_k, config.num_experts, "Config.top_k")
        if config.backend not in backends.names():
            raise ValueError(f"Config.backend: expected one of {backends.names()}, got {config.backend!r}")
        self.config = config
        self.ep_mesh: Any = None

    def wire_meshes(self, *, ep_mesh: Optional[Any]) -> None:
        """The expert-parallel mesh (a 1-D DeviceMesh or ProcessGroup); None: this rank alone.
        A DeviceMesh is kept as its ProcessGroup, which compiled code can take."""
        self.ep_mesh = ep_mesh.get_group() if hasattr(ep_mesh, "get_group") else ep_mesh

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchMetadata]:
        """(T, D) tokens -> routed_input_RD (R, D), num_tokens_per_local_expert_e (e,), metadata."""
        del num_local_tokens_per_expert_E  # counted from the ids by the dispatch itself
        cfg = self.config
        routed_RD, tokens_per_local_expert_e, handle = dispatch(
            x_TD, topk_expert_ids_TK, num_experts=cfg.num_experts,
            group=NO_GROUP if self.ep_mesh is None else self.ep_mesh, backend=cfg.backend,
            expert_alignment=cfg.expert_alignment, buffers=cfg.buffers,
        )
        return routed_RD, tokens_per_local_expert_e, DispatchMetadata(handle=handle, topk_scores_TK=topk_scores_TK)

    def combine(
        self,
        routed_output_RD: torch.Tensor,
        metadata: DispatchMetadata,
        x_TD: torch.Tensor,
        *,
        num_local_tokens_after_padding: Optional[int] = None,
        local_seq_len_after_padding: Optional[int] = None,
    ) -> torch.Tensor:
        """(R, D) expert outputs -> out_TD (T, D) in x's dtype: each token's K outputs weighted
        by its scores and summed in fp32. The padding arguments are torchtitan's bookkeeping for
        sequence parallelism, which this dispatcher does not do: accepted and unused."""
        del num_local_tokens_after_padding, local_seq_len_after_padding
        out_TD = combine(routed_output_RD, metadata.handle, metadata.topk_scores_TK)
        return out_TD.to(x_TD.dtype)
