"""Kernel of DeepEP's dispatch layout (``layout.dispatch_layout_op`` on CUDA): who receives what
from this rank's routing, in one launch with fixed output shapes (no host sync, CUDA-graph
capturable).

Legend: ``T`` tokens, ``K`` slots per token, ``E`` experts, ``W`` ranks, ``e = E / W`` experts
per rank, ``P = W / num_nodes`` ranks per node. Reference semantics (ids outside [0, E) count
nowhere)::

    for t in range(T):
        ranks = {idx[t, k] // e for k in range(K) if 0 <= idx[t, k] < E}
        for k: if 0 <= idx[t, k] < E: tokens_per_expert[idx[t, k]] += 1
        is_token_in_rank[t, r] = r in ranks
        for r in ranks: tokens_per_rank[r] += 1                       # once, however many experts
        for n in {r // P for r in ranks}: tokens_per_node[n] += 1      # once, however many ranks

One program per block of ``BLOCK_T`` tokens. It builds the (BLOCK_T, W) in-rank and
(BLOCK_T, num_nodes) in-node masks in registers, one pass over the K slots (a comparison of each
slot's rank / node with every rank / node: W is at most a few hundred), stores the in-rank mask,
and adds its column sums to the per-rank and per-node counts with one atomic per nonzero column;
each valid slot adds 1 to its expert's count (an atomic per slot). The counts are int64 atomics
into zeroed outputs (supported by the interpreter and by CUDA alike) and integers, so any order
gives the same result: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._config import LAUNCH_LOCK, launch, interpreting

GPU_TILE = 4096
"""Most entries of a program's (BLOCK_T, W) in-rank mask on a GPU (int32 registers: 32 per
thread at 4 warps). Not yet tuned on a GPU."""
GPU_MIN_BLOCK_T = 16
GPU_PROGRAMS = 132
"""Programs wanted at least (one per SM of an H200) while blocks stay >= GPU_MIN_BLOCK_T tokens."""
GPU_NUM_WARPS = 4


@triton.jit
def _dispatch_layout_kernel(
    idx_ptr, per_rank_ptr, per_expert_ptr, per_node_ptr, in_rank_ptr,
    T, K, E, e, W, ranks_per_node, num_nodes,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BT] tokens
    m_t = o_t < T
    o_w = tl.arange(0, BLOCK_W)  # [BW] ranks
    o_n = tl.arange(0, BLOCK_N)  # [BN] nodes
    b_in_rank = tl.zeros([BLOCK_T, BLOCK_W], dtype=tl.int32)  # 1: token t has an expert on rank r
    b_in_node = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.int32)
    for k in range(K):
        b_idx = tl.load(idx_ptr + o_t * K + k, mask=m_t, other=-1).to(tl.int64)  # [BT] slot k of each token
        m_valid = m_t & (b_idx >= 0) & (b_idx < E)
        tl.atomic_add(per_expert_ptr + b_idx, 1, mask=m_valid)
        b_rank = tl.where(m_valid, b_idx // e, -1)  # [BT], -1: nowhere
        b_node = tl.where(m_valid, b_rank // ranks_per_node, -1)
        b_in_rank |= (b_rank[:, None] == o_w[None, :]).to(tl.int32)  # [BT, BW]
        b_in_node |= (b_node[:, None] == o_n[None, :]).to(tl.int32)  # [BT, BN]
    m_w = o_w < W
    tl.store(in_rank_ptr + o_t[:, None] * W + o_w[None, :], b_in_rank != 0, mask=m_t[:, None] & m_w[None, :])
    b_per_rank = tl.sum(b_in_rank, axis=0)  # [BW] tokens of this block on each rank
    tl.atomic_add(per_rank_ptr + o_w, b_per_rank.to(tl.int64), mask=m_w & (b_per_rank > 0))
    b_per_node = tl.sum(b_in_node, axis=0)  # [BN]
    tl.atomic_add(per_node_ptr + o_n, b_per_node.to(tl.int64), mask=(o_n < num_nodes) & (b_per_node > 0))


def _block_t(T: int, W: int) -> int:
    if interpreting():  # programs run one after another: few large ones
        return triton.next_power_of_2(max(1, min(T, 256)))
    tile_cap = max(1, GPU_TILE // triton.next_power_of_2(W))
    return min(max(GPU_MIN_BLOCK_T, triton.next_power_of_2(triton.cdiv(T, GPU_PROGRAMS))), tile_cap)


def dispatch_layout(
    topk_idx: torch.Tensor, num_experts: int, world_size: int, num_nodes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_idx (T, K) integer expert ids -> tokens_per_rank (W,), tokens_per_expert (E,),
    tokens_per_node (num_nodes,), all int64, and is_token_in_rank (T, W) bool, as the module
    docstring defines them: three memsets and one launch, no host sync."""
    T, K = topk_idx.shape
    E, W = num_experts, world_size
    dev = topk_idx.device
    tokens_per_rank = torch.zeros(W, dtype=torch.int64, device=dev)
    tokens_per_expert = torch.zeros(E, dtype=torch.int64, device=dev)
    tokens_per_node = torch.zeros(num_nodes, dtype=torch.int64, device=dev)
    is_token_in_rank = torch.empty(T, W, dtype=torch.bool, device=dev)
    if T == 0:  # no program to launch (a grid of 0 programs)
        return tokens_per_rank, tokens_per_expert, tokens_per_node, is_token_in_rank
    idx = topk_idx.contiguous()
    block_t = _block_t(T, W)
    with LAUNCH_LOCK:
        launch(_dispatch_layout_kernel, topk_idx)[(triton.cdiv(T, block_t),)](
            idx, tokens_per_rank, tokens_per_expert, tokens_per_node, is_token_in_rank,
            T, K, E, E // W, W, W // num_nodes, num_nodes,
            BLOCK_T=block_t, BLOCK_W=triton.next_power_of_2(W), BLOCK_N=triton.next_power_of_2(num_nodes),
            num_warps=1 if interpreting() else GPU_NUM_WARPS,
        )
    return tokens_per_rank, tokens_per_expert, tokens_per_node, is_token_in_rank
