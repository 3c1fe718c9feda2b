"""Expert-parallel implementations for Hugging Face transformers (5.x), served by this library.

transformers shards a MoE model's experts with ``DistributedConfig(ep_size=W, ep_implementation=
name)`` and builds, once per experts module, the ``EPImplementation`` registered under ``name`` in
``transformers.distributed.expert_parallel.EPImplementationInterface``. It is called with the
tokens of this rank, ``(hidden_states_TH, top_k_index_TK, top_k_weights_TK)`` (global expert
ids), runs the module's own experts forward on the rows it brings (local expert ids, one slot a
row) and returns each token's weighted output. :func:`register` adds:

- ``"alltoall_ops"``: :func:`alltoall_ops.dispatch` over the EP group ("collective": NCCL / gloo,
  one host read per layer, in the dispatch; "local" on one rank), the experts on the rows grouped
  by local expert, :func:`alltoall_ops.combine` with the router weights (fp32 accumulation).
- ``"alltoall_ops_symm_mem"``: the same over :class:`alltoall_ops.SymmBuffers` (no host sync,
  static shapes; CUDA-graph capturable). Every experts module of one configuration shares one
  set of buffers (:func:`shared_buffers`: a model compiled per layer compiles once), made by
  the first eager forward for ``max_tokens_per_rank`` tokens (the class attribute;
  :func:`register` sets it).

Usage (every rank)::

    import alltoall_ops.integrations.transformers as a2a_hf
    a2a_hf.register()
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(fsdp_size=W, ep_size=W, ep_implementation="alltoall_ops"))

The rows handed to the experts carry local expert id e (``num_local_experts``, transformers'
"not on this rank" sentinel, which its experts forwards skip) where they belong to no expert:
the static rows past ``tokens_per_expert.sum()`` of the local and symm_mem backends (symm_mem's
may hold NaN, and so may their rows of combine's backward: both are masked). TP groups
(``tp_size > 1``: the ranks of a TP group hold the same batch) are handled as transformers'
``"all_to_all"`` handles them: each rank of the TP group dispatches its slice of the rows (a
DTensor ``Replicate -> Shard(0)``, no communication; its backward all-gathers the gradients) and
the outputs are gathered back over TP.

Shape legend: T tokens of this rank, H hidden, K top-k, E global experts, e = E / W local
experts, R routed rows (C, static, for local and symm_mem).
"""

from __future__ import annotations

from typing import Any

import torch

from ..api import combine, dispatch
from ..backends.symm_mem import SymmBuffers
from ..layout import expert_of_rows

NAMES = ("alltoall_ops", "alltoall_ops_symm_mem")


class AllToAllOpsEP:
    """transformers ``EPImplementation`` over :func:`alltoall_ops.dispatch` / :func:`combine`.

    Built by transformers as ``cls(experts, ep_mesh, tp_mesh)`` once per experts module, with
    the experts' parameters already sharded (``experts.num_experts`` is e). Duck-typed like
    ``EPImplementation`` (same attributes), so that this module imports without transformers."""

    backend = "auto"
    """As in :func:`alltoall_ops.dispatch`: "auto" is "local" on one rank, else "collective"."""
    expert_alignment = 1
    """Pad each local expert's rows to a multiple of this (zero rows, skipped by combine)."""
    needs_shared_batch = False

    def __init__(self, experts: torch.nn.Module, ep_mesh: Any, tp_mesh: Any):
        self.experts = experts
        self.experts_forward = experts.forward  # the experts' own forward, on local expert ids
        self.num_local_experts = experts.num_experts
        self.ep_mesh, self.tp_mesh = ep_mesh, tp_mesh
        self.ep_group = ep_mesh.get_group()
        self.num_experts = self.num_local_experts * ep_mesh.size()

    def buffers_for(self, x_TH: torch.Tensor, top_k: int) -> Any:
        """The :class:`SymmBuffers` of this module (None: not the symm_mem backend)."""
        return None

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """(T, H) tokens, (T, K) global expert ids, (T, K) router weights -> (T, H) outputs."""
        num_tokens = hidden_states.shape[0]
        if self.tp_mesh.size() > 1:
            hidden_states, top_k_index, top_k_weights = (
                _tp_slice(t, self.tp_mesh) for t in (hidden_states, top_k_index, top_k_weights))
        routed_RH, tokens_per_expert_e, handle = dispatch(
            hidden_states, top_k_index, num_experts=self.num_experts, group=self.ep_group, backend=self.backend,
            expert_alignment=self.expert_alignment, buffers=self.buffers_for(hidden_states, top_k_index.shape[1]),
        )
        grouped = _grouped_mm_experts(self.experts)
        masked = self.backend == "symm_mem"
        if masked or not grouped:
            # expert_R1[r]: row r's local expert; e (transformers' off-rank sentinel) past the last group
            expert_R1 = expert_of_rows(tokens_per_expert_e, routed_RH.shape[0]).unsqueeze(1)
        if masked:  # rows past the groups hold whatever the buffers held
            valid_R1 = expert_R1 < self.num_local_experts
            routed_RH = torch.where(valid_R1, routed_RH, 0)
        if grouped:  # the rows come grouped by expert: straight to grouped_mm (see _grouped_mm_experts)
            out_RH = _grouped_swiglu(self.experts, routed_RH, tokens_per_expert_e)
        else:
            # one slot a row with weight 1: the router weights are applied by combine, on the sender
            ones_R1 = torch.ones(expert_R1.shape, dtype=routed_RH.dtype, device=routed_RH.device)
            out_RH = self.experts_forward(routed_RH, expert_R1, ones_R1)
        if masked:  # and so do those rows of combine's backward: keep them out of the experts' gradients
            out_RH = torch.where(valid_R1, out_RH, 0)
        y_TH = combine(out_RH, handle, top_k_weights)
        if self.tp_mesh.size() > 1:
            y_TH = _tp_gather(y_TH, self.tp_mesh, num_tokens)
        return y_TH


def _grouped_mm_experts(experts: torch.nn.Module) -> bool:
    """Whether ``experts`` runs transformers' ``grouped_mm`` experts forward with gated weights,
    no bias and no post-expert norm. That forward sorts its rows by expert (a sort, a gather of
    the rows and their weights), runs two grouped GEMMs and scatters the rows back (an inverse
    permutation, a second gather, a sum over one slot), masking the sentinel rows three times:
    on rows that dispatch already grouped by expert, all but the GEMMs and the gate repeat
    dispatch's work, forward and backward, on every layer. Such experts get the rows straight
    (:func:`_grouped_swiglu`); every other experts module gets its own forward."""
    config = getattr(experts, "config", None)
    return (getattr(config, "_experts_implementation", None) == "grouped_mm" and getattr(experts, "has_gate", False)
            and not getattr(experts, "has_bias", True) and not getattr(experts, "has_post_expert_norm", True)
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


def _grouped_swiglu(experts: torch.nn.Module, routed_RH: torch.Tensor, tokens_per_expert_e: torch.Tensor
                    ) -> torch.Tensor:
    """transformers' ``grouped_mm_experts_forward`` on rows already grouped by local expert (the
    first ``tokens_per_expert_e.sum()``), with weight 1: its two grouped GEMMs and gate, without
    the sort, gathers and scatter. Rows past the groups are not read, and their outputs are not
    written (combine reads only the rows of the groups; symm_mem's caller masks them)."""
    from transformers.integrations.moe import _grouped_linear

    offsets_e = torch.cumsum(tokens_per_expert_e, dim=0, dtype=torch.int32)
    h_RF = _grouped_linear(routed_RH, experts.gate_up_proj, offsets_e, is_transposed=experts.is_transposed)
    h_RF = experts._apply_gate(h_RF)
    return _grouped_linear(h_RF, experts.down_proj, offsets_e, is_transposed=experts.is_transposed)


class AllToAllOpsSymmMemEP(AllToAllOpsEP):
    """:class:`AllToAllOpsEP` over :class:`alltoall_ops.SymmBuffers`: no host sync, static
    shapes. One set of buffers serves every experts module of its configuration (see
    :func:`shared_buffers`), made by the first eager call (collective: every rank of the EP group
    calls together, as in any forward) for ``max_tokens_per_rank`` tokens a call, in the dtype and
    on the device of the hidden states; more tokens raise on every rank."""

    backend = "symm_mem"
    max_tokens_per_rank = 4096

    def __init__(self, experts: torch.nn.Module, ep_mesh: Any, tp_mesh: Any):
        super().__init__(experts, ep_mesh, tp_mesh)
        self.buffers = None

    def buffers_for(self, x_TH: torch.Tensor, top_k: int) -> SymmBuffers:
        if self.buffers is None:
            _made_eagerly(torch.compiler.is_compiling())
            # NB: compiled code then sees the buffers as a constant of the graph, the same for every layer
            self.buffers = shared_buffers(self.max_tokens_per_rank, x_TH.shape[1], top_k, self.num_experts,
                                          x_TH.dtype, x_TH.device, self.ep_group, self.expert_alignment)
        return self.buffers


_SHARED_BUFFERS: dict[tuple, SymmBuffers] = {}


def shared_buffers(max_tokens_per_rank: int, hidden: int, top_k: int, num_experts: int, dtype: torch.dtype,
                   device: torch.device, group: Any, expert_alignment: int) -> SymmBuffers:
    """The :class:`SymmBuffers` of this configuration, made on first use (collective) and shared
    by every experts module that asks for it. Compiled code embeds the buffers as a constant
    guarded on identity, so experts' forwards compiled per layer compile once for all layers
    with one shared set, and once per layer (past dynamo's recompile limit: 8) with one set
    each. Sharing is safe: no output aliases the buffers, and every rank calls the layers in the
    same order, forward and backward (docs/symm_mem.md, "Buffer lifetime")."""
    key = (max_tokens_per_rank, hidden, top_k, num_experts, dtype, device, group.group_name, expert_alignment)
    if key not in _SHARED_BUFFERS:
        bufs = SymmBuffers(max_tokens_per_rank=max_tokens_per_rank, hidden=hidden, top_k=top_k,
                           num_experts=num_experts, dtype=dtype, device=device, group=group,
                           expert_alignment=expert_alignment)
        bufs.max_tokens_hint = (f"raise it with {__name__}.register(max_tokens_per_rank=...) (tokens of one rank "
                                f"in one forward: batch * sequence; now {max_tokens_per_rank})")
        _SHARED_BUFFERS[key] = bufs
    return _SHARED_BUFFERS[key]


@torch._dynamo.assume_constant_result  # NB: run at trace time, so that its error reaches the user as raised
def _made_eagerly(compiling: bool) -> bool:
    """Raises when the symm_mem buffers would be made under torch.compile."""
    if compiling:
        raise RuntimeError(
            "ep_implementation='alltoall_ops_symm_mem': the buffers are made by the first forward, which must run "
            "eagerly (a collective setup step): run one forward before compiling the model or its experts")
    return True


IMPLEMENTATIONS = {"alltoall_ops": AllToAllOpsEP, "alltoall_ops_symm_mem": AllToAllOpsSymmMemEP}


def register(*, max_tokens_per_rank: int | None = None) -> tuple[str, ...]:
    """Register :data:`NAMES` in transformers' ``EPImplementationInterface`` (imports
    transformers); returns the names. max_tokens_per_rank: T_max of the symm_mem buffers (tokens
    of one rank in one forward: batch * sequence), default 4096."""
    from transformers.distributed.expert_parallel import EPImplementationInterface

    if max_tokens_per_rank is not None:
        AllToAllOpsSymmMemEP.max_tokens_per_rank = int(max_tokens_per_rank)
    for name, cls in IMPLEMENTATIONS.items():
        EPImplementationInterface.register(name, cls)
    return NAMES


def _tp_slice(t: torch.Tensor, tp_mesh: Any) -> torch.Tensor:
    """This TP rank's slice of rows the TP group shares (``Replicate -> Shard(0)``: a local chunk;
    its backward all-gathers the row gradients), as transformers' ``"all_to_all"`` does."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(0)]).to_local()


def _tp_gather(y_tH: torch.Tensor, tp_mesh: Any, num_tokens: int) -> torch.Tensor:
    """The TP group's row slices back into (T, H) on every rank (``Shard(0) -> Replicate``)."""
    from torch.distributed.tensor import DTensor, Shard

    H = y_tH.shape[-1]
    y = DTensor.from_local(y_tH.contiguous(), tp_mesh, [Shard(0)], shape=(num_tokens, H), stride=(H, 1))
    return y.full_tensor()
