"""A small expert-parallel mixture-of-experts block, and the dense reference it must match.

Copy and adapt. :class:`MoE` is what runs on each rank of an expert-parallel group;
:class:`DenseMoE` holds every expert in one process and computes the same function on the
tokens of all ranks together, in the most direct way (one expert at a time), so that the
parallel block can be checked against it. :meth:`MoE.from_dense` builds rank r's block from a
dense one: the router is replicated, experts [r*e, (r+1)*e) are rank r's. Both can add a
:class:`SharedExpert` (``shared_ffn_size=``), a dense SwiGLU every token runs, replicated.

Shape legend (as in ``layout.py``): T local tokens, H hidden, F expert FFN width, Fs the shared
expert's FFN width, E global experts, e = E / W local experts, K top-k, R rows routed to this rank
(padding included).
Parameters of the experts are stacked along their first dimension (E in the dense block, e in
the parallel one) and share names, so ``MoE.w_up`` is a slice of ``DenseMoE.w_up``.

Example (on every rank)::

    dense = DenseMoE(hidden_size=64, ffn_size=128, num_experts=8, top_k=2,   # same seed everywhere
                     shared_ffn_size=256)                                     # optional shared expert
    moe = MoE.from_dense(dense, group=ep_group)
    y_TH = torch.compile(moe, fullgraph=True)(x_TH)
    # Replicated parameters (router, shared expert: moe.replicated_parameters()) need their
    # gradients summed over the group, as in data parallelism; the experts' gradients are
    # complete on their own rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import backends
from .api import combine, dispatch
from .groups import resolve_group
from .layout import expert_of_rows
from .overlap import wait_add
from .rows import accumulation_dtype
from .validation import check_bool, check_num_experts, check_top_k

ACTIVATIONS = ("swiglu", "gelu")
EXPERT_IMPLS = ("auto", "masked", "grouped_mm")
SHARED_EXPERT_OVERLAPS = ("combine", "none")


class Router(nn.Module):
    """Top-k softmax router: Linear H -> E, softmax, top-k, weights renormalised to sum to 1.

    The softmax runs in fp32 (fp64 for fp64 inputs)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, device=None, dtype=None):
        super().__init__()
        check_top_k(top_k, num_experts)
        self.top_k = top_k
        self.proj = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=dtype)

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x_TH (T, H) -> topk_idx_TK (T, K) int64 global expert ids, topk_weights_TK (T, K) fp32
        (fp64 for fp64 x), each row summing to 1."""
        logits_TE = self.proj(x_TH)
        probs_TE = logits_TE.to(accumulation_dtype(x_TH.dtype)).softmax(dim=-1)
        topk_weights_TK, topk_idx_TK = probs_TE.topk(self.top_k, dim=-1)
        topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(dim=-1, keepdim=True)
        return topk_idx_TK, topk_weights_TK


def _activate(up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """SwiGLU (silu(gate) * up) when there is a gate, else GELU(up)."""
    return F.silu(gate) * up if gate is not None else F.gelu(up)


class _ExpertParams(nn.Module):
    """Stacked parameters of n experts: w_gate (n, H, F) (SwiGLU only), w_up (n, H, F),
    w_down (n, F, H). Initialised like nn.Linear (uniform, bound 1/sqrt(fan_in))."""

    def __init__(self, num_experts, hidden_size, ffn_size, activation, *, device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.hidden_size, self.ffn_size = hidden_size, ffn_size
        kw = {"device": device, "dtype": dtype}
        n, H, Fd = num_experts, hidden_size, ffn_size
        self.w_gate = nn.Parameter(torch.empty(n, H, Fd, **kw)) if activation == "swiglu" else None
        self.w_up = nn.Parameter(torch.empty(n, H, Fd, **kw))
        self.w_down = nn.Parameter(torch.empty(n, Fd, H, **kw))
        self.reset_expert_parameters()

    def expert_mlp(self, x_nH: torch.Tensor, j: int) -> torch.Tensor:
        """Expert j (of this module's stack) on rows x_nH (n, H) -> (n, H)."""
        gate_nF = x_nH @ self.w_gate[j] if self.w_gate is not None else None
        return _activate(x_nH @ self.w_up[j], gate_nF) @ self.w_down[j]

    def expert_parameters(self) -> list[nn.Parameter]:
        return [w for w in (self.w_gate, self.w_up, self.w_down) if w is not None]

    @torch.no_grad()
    def reset_expert_parameters(self) -> None:
        for w in self.expert_parameters():
            bound = 1.0 / math.sqrt(w.shape[1])
            w.uniform_(-bound, bound)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP that every token runs, added to the routed experts' output (DeepSeek-MoE's
    shared expert; its n shared experts of width F are one of width n * F). Gated: scaled per token
    by ``sigmoid(x @ w_output_gate)``, as Qwen2-MoE / Qwen3-Next's ``shared_expert_gate``.

    Parameters: w_gate (H, Fs), w_up (H, Fs), w_down (Fs, H) and, gated, w_output_gate (H, 1);
    initialised like nn.Linear (uniform, bound 1/sqrt(fan_in)), in that order.

    forward(x_TH (T, H)) -> (T, H) in x's dtype::

        y_TH = (silu(x_TH @ w_gate) * (x_TH @ w_up)) @ w_down
        y_TH = sigmoid(x_TH @ w_output_gate) * y_TH        # gated only
    """

    def __init__(self, hidden_size: int, ffn_size: int, *, gated: bool = False, device=None, dtype=None):
        super().__init__()
        if isinstance(ffn_size, bool) or not isinstance(ffn_size, int) or ffn_size < 1:
            raise ValueError(f"shared_ffn_size: expected a positive int or None, got {ffn_size!r}")
        self.hidden_size, self.ffn_size, self.gated = hidden_size, ffn_size, check_bool("gated", gated)
        kw = {"device": device, "dtype": dtype}
        H, Fs = hidden_size, ffn_size
        self.w_gate = nn.Parameter(torch.empty(H, Fs, **kw))
        self.w_up = nn.Parameter(torch.empty(H, Fs, **kw))
        self.w_down = nn.Parameter(torch.empty(Fs, H, **kw))
        self.w_output_gate = nn.Parameter(torch.empty(H, 1, **kw)) if gated else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for w in (self.w_gate, self.w_up, self.w_down, self.w_output_gate):
            if w is not None:
                bound = 1.0 / math.sqrt(w.shape[0])
                w.uniform_(-bound, bound)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        y_TH = _activate(x_TH @ self.w_up, x_TH @ self.w_gate) @ self.w_down
        if self.w_output_gate is not None:
            y_TH = torch.sigmoid(x_TH @ self.w_output_gate) * y_TH  # (T, 1) gate of each token
        return y_TH


def _shared_expert(hidden_size, shared_ffn_size, gated, device, dtype) -> SharedExpert | None:
    """The block's shared expert, or None for shared_ffn_size None. Built after the router, so
    that a seed gives the router and the routed experts the weights they had without one."""
    check_bool("gated_shared_expert", gated)
    if shared_ffn_size is None:
        if gated:
            raise ValueError("gated_shared_expert=True needs a shared expert: give shared_ffn_size")
        return None
    return SharedExpert(hidden_size, shared_ffn_size, gated=gated, device=device, dtype=dtype)


class DenseMoE(_ExpertParams):
    """Single-process reference: the router and ALL E experts.

    forward(x_TH) computes y[t] = sum_k w[t, k] * expert_{idx[t, k]}(x[t]) one expert at a time:
    gather the tokens routed to it, run its MLP, add the weighted rows back (fp32 accumulation,
    fp64 for fp64), rounded to x's dtype, then adds the shared expert's output if there is one.
    No communication, no routing layout: an independent check of :class:`MoE`.

    Args:
        hidden_size: H. ffn_size: F. num_experts: E. top_k: K.
        activation: "swiglu" (w_gate, w_up, w_down) or "gelu" (w_up, w_down) for the routed experts.
        shared_ffn_size: Fs, the width of a :class:`SharedExpert` (always SwiGLU) every token
            runs; None (default): no shared expert.
        gated_shared_expert: scale the shared expert's output by sigmoid(x @ w_output_gate).
    """

    def __init__(
        self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, *,
        activation: str = "swiglu", shared_ffn_size: int | None = None, gated_shared_expert: bool = False,
        device=None, dtype=None,
    ):
        super().__init__(num_experts, hidden_size, ffn_size, activation, device=device, dtype=dtype)
        self.num_experts = num_experts
        self.router = Router(hidden_size, num_experts, top_k, device=device, dtype=dtype)
        self.shared_expert = _shared_expert(hidden_size, shared_ffn_size, gated_shared_expert, device, dtype)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        """x_TH (T, H) -> y_TH (T, H), in x's dtype."""
        topk_idx_TK, topk_weights_TK = self.router(x_TH)
        acc_dtype = accumulation_dtype(x_TH.dtype)
        y_TH = torch.zeros(x_TH.shape, dtype=acc_dtype, device=x_TH.device)
        for j in range(self.num_experts):
            tok_n, slot_n = (topk_idx_TK == j).nonzero(as_tuple=True)  # tokens routed to j
            out_nH = self.expert_mlp(x_TH[tok_n], j)
            weight_n = topk_weights_TK[tok_n, slot_n]
            y_TH = y_TH.index_add(0, tok_n, out_nH.to(acc_dtype) * weight_n[:, None].to(acc_dtype))
        y_TH = y_TH.to(x_TH.dtype)
        return y_TH if self.shared_expert is None else y_TH + self.shared_expert(x_TH)


class MoE(_ExpertParams):
    """Expert-parallel MoE block of one rank: route, dispatch, run the e local experts, combine.

    Rank r of a group of W holds the router and the shared expert, if any (both replicated), and
    experts [r*e, (r+1)*e), e = E / W.

    Args:
        hidden_size: H. ffn_size: F. num_experts: E, global, divisible by W. top_k: K.
        activation: "swiglu" or "gelu" (the routed experts).
        shared_ffn_size: Fs, the width of a :class:`SharedExpert` (SwiGLU, on every token of this
            rank, added to the combined output); None (default): no shared expert.
        gated_shared_expert: scale the shared expert's output by sigmoid(x @ w_output_gate)
            (Qwen2-MoE / Qwen3-Next).
        shared_expert_overlap: "combine" (default): the shared expert runs beside the combine's
            exchange, between its async start and its wait (:mod:`alltoall_ops.overlap`);
            "none": after the combine, nothing async. The same result bit for bit.
        group: ProcessGroup, 1-D DeviceMesh or None (default group; single process when
            torch.distributed is not initialised), as in :func:`alltoall_ops.dispatch`.
        backend: "auto" | "local" | "collective" | "symm_mem", as in :func:`alltoall_ops.dispatch`.
        buffers: the :class:`alltoall_ops.SymmBuffers` for "symm_mem" (needed under torch.compile);
            give every block the same one: compiled per block, the blocks then compile once.
        expert_alignment: pad each local expert's rows to a multiple of this (e.g. for a
            grouped GEMM that wants aligned groups); padding rows are zero and ignored.
        expert_impl: how the local experts run on their rows:
            "masked": every local expert runs on all R rows and keeps its own (``torch.where``):
                any dtype and device, plain matmuls, exact; e times the FLOPs of the grouped
                GEMM, memory R * F: right for few local experts, small blocks and tests.
            "grouped_mm": ``torch._grouped_mm`` over the expert-grouped rows (bf16 on CUDA
                sm90+; fp32 / bf16 on CPU in recent torch; H * itemsize and F * itemsize must
                be multiples of 16 bytes).
            "auto": "grouped_mm" for bf16 on CUDA sm90+, else "masked".
    """

    def __init__(
        self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, *,
        activation: str = "swiglu", shared_ffn_size: int | None = None, gated_shared_expert: bool = False,
        shared_expert_overlap: str = "combine", group: Any = None, backend: str = "auto", expert_alignment: int = 1,
        expert_impl: str = "auto", buffers: Any = None, device=None, dtype=None,
    ):
        grp = resolve_group(group)
        backends.choose(backend, grp, buffers)
        num_experts = check_num_experts(num_experts, grp.size)
        if expert_impl not in EXPERT_IMPLS:
            raise ValueError(f"expert_impl: expected one of {EXPERT_IMPLS}, got {expert_impl!r}")
        if shared_expert_overlap not in SHARED_EXPERT_OVERLAPS:
            raise ValueError(f"shared_expert_overlap: expected one of {SHARED_EXPERT_OVERLAPS}, got "
                             f"{shared_expert_overlap!r}")
        e = num_experts // grp.size
        super().__init__(e, hidden_size, ffn_size, activation, device=device, dtype=dtype)
        self.num_experts = num_experts
        self.num_local_experts = e
        self.rank, self.world_size = grp.rank, grp.size
        self.group, self.backend = group, backend
        self.expert_alignment = expert_alignment
        self.expert_impl = expert_impl
        self.shared_expert_overlap = shared_expert_overlap
        self.buffers = buffers
        self.router = Router(hidden_size, num_experts, top_k, device=device, dtype=dtype)
        self.shared_expert = _shared_expert(hidden_size, shared_ffn_size, gated_shared_expert, device, dtype)

    @classmethod
    def from_dense(cls, dense: DenseMoE, **kwargs: Any) -> MoE:
        """This rank's block holding a copy of ``dense``'s router, shared expert (if any) and of its
        experts [rank*e, (rank+1)*e). kwargs: group, backend, expert_alignment, expert_impl, buffers,
        shared_expert_overlap."""
        w_up, shared = dense.w_up, dense.shared_expert
        moe = cls(
            dense.hidden_size, dense.ffn_size, dense.num_experts, dense.router.top_k,
            activation=dense.activation, shared_ffn_size=None if shared is None else shared.ffn_size,
            gated_shared_expert=shared is not None and shared.gated,
            device=w_up.device, dtype=w_up.dtype, **kwargs,
        )
        moe.load_dense_parameters(dense)
        return moe

    @torch.no_grad()
    def load_dense_parameters(self, dense: DenseMoE) -> None:
        """Copy the router, the shared expert and this rank's slice of the experts from ``dense``."""
        if (self.shared_expert is None) != (dense.shared_expert is None):
            raise ValueError("load_dense_parameters: one block has a shared expert, the other none")
        self.router.load_state_dict(dense.router.state_dict())
        if self.shared_expert is not None:
            self.shared_expert.load_state_dict(dense.shared_expert.state_dict())
        local = self.local_expert_slice()
        for mine, full in zip(self.expert_parameters(), dense.expert_parameters()):
            mine.copy_(full[local])

    def local_expert_slice(self) -> slice:
        """Global ids of this rank's experts: [rank*e, (rank+1)*e)."""
        e = self.num_local_experts
        return slice(self.rank * e, (self.rank + 1) * e)

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds alike (the router, the shared expert): sum their gradients
        over the group."""
        shared = [] if self.shared_expert is None else list(self.shared_expert.parameters())
        return list(self.router.parameters()) + shared

    def _use_grouped_mm(self, x: torch.Tensor) -> bool:
        if self.expert_impl != "auto":
            return self.expert_impl == "grouped_mm"
        return (
            x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
        )

    def experts(self, x_RH: torch.Tensor, tokens_per_expert_e: torch.Tensor) -> torch.Tensor:
        """Run the local experts on routed rows grouped by expert.

        x_RH (R, H); tokens_per_expert_e (e,) int64 rows of each local expert, in order from
        row 0, summing to R or less (local and symm_mem: R is a static row count C; later rows
        belong to no expert: zero for local, anything, NaN included, for symm_mem; they never
        reach the result or a gradient). Returns (R, H): zero rows (padding) stay zero, the
        experts have no biases; rows past the last group are no expert's output (combine
        ignores them)."""
        if self._use_grouped_mm(x_RH):
            offsets_e = torch.cumsum(tokens_per_expert_e, 0, dtype=torch.int32)

            def matmul(a_RI, w_eIO):  # rows of expert j times w_eIO[j]
                return torch._grouped_mm(a_RI, w_eIO, offs=offsets_e)

            gate_RF = matmul(x_RH, self.w_gate) if self.w_gate is not None else None
            return matmul(_activate(matmul(x_RH, self.w_up), gate_RF), self.w_down)

        # "masked": expert_R1[r] is the local expert of row r (e for rows past the last group);
        # each expert runs on every row and keeps its own. Rows of no expert are zeroed first:
        # the weights' gradient x^T @ grad would turn their 0 * NaN into NaN.
        expert_R1 = expert_of_rows(tokens_per_expert_e, x_RH.shape[0]).unsqueeze(1)
        x_RH = torch.where(expert_R1 < self.num_local_experts, x_RH, 0)
        y_RH = torch.zeros_like(x_RH)
        for j in range(self.num_local_experts):
            y_RH = torch.where(expert_R1 == j, self.expert_mlp(x_RH, j), y_RH)
        return y_RH

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        """x_TH (T, H) tokens of this rank (T may be 0) -> y_TH (T, H), in x's dtype."""
        topk_idx_TK, topk_weights_TK = self.router(x_TH)
        routed_RH, tokens_per_expert_e, handle = dispatch(
            x_TH, topk_idx_TK, num_experts=self.num_experts, group=self.group,
            backend=self.backend, expert_alignment=self.expert_alignment, buffers=self.buffers,
        )
        out_RH = self.experts(routed_RH, tokens_per_expert_e)
        if self.shared_expert is None:
            return combine(out_RH, handle, topk_weights_TK)
        if self.shared_expert_overlap == "none":
            return combine(out_RH, handle, topk_weights_TK) + self.shared_expert(x_TH)
        # The shared expert reads x_TH only, never the exchange's rows: it runs between the
        # combine's start and its wait, beside the exchange (alltoall_ops.overlap; wait_add binds
        # it before the wait in compiled code too).
        y_TH = combine(out_RH, handle, topk_weights_TK, async_op=True)
        return wait_add(y_TH, self.shared_expert(x_TH))
