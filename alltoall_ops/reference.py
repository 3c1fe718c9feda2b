"""Plain-PyTorch references for ``dispatch`` and ``combine``, written for obviousness, not speed.

They take the *global* view (every rank's inputs, as lists indexed by rank) and return every
rank's result, following the layout contract literally with Python loops. They are built from
differentiable indexing, so ``torch.autograd`` through them gives the reference gradients.

Example::

    outs = reference_dispatch(xs, topk_idxs, num_experts=8)       # [(routed, tokens_per_expert)]
    ys = reference_combine([f(r) for r, _ in outs], topk_idxs, num_experts=8, topk_weights=ws)
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def reference_slot_rows(
    topk_idxs: Sequence[torch.Tensor], num_experts: int, expert_alignment: int = 1
) -> tuple[list[list[tuple[int, int, int]]], list[list[int]]]:
    """Where every slot lands, from the layout contract.

    topk_idxs: per source rank, (T_s, K) expert ids in [-1, E).
    Returns ``rows`` and ``tokens_per_expert``: ``rows[d]`` lists, in routed-row order, the
    (source rank, t, k) of each non-padding row of destination rank d, with ``None`` for a
    padding row; ``tokens_per_expert[d]`` is rank d's (e,) padded group sizes.
    """
    W = len(topk_idxs)
    e = num_experts // W
    rows: list[list] = []
    sizes: list[list[int]] = []
    for d in range(W):  # destination rank
        rows_d, sizes_d = [], []
        for j in range(e):  # local expert, global id d * e + j
            group = [
                (s, t, k)
                for s in range(W)  # then source rank
                for t in range(topk_idxs[s].shape[0])  # then token
                for k in range(topk_idxs[s].shape[1])  # then slot
                if int(topk_idxs[s][t, k]) == d * e + j
            ]
            group += [None] * (-len(group) % expert_alignment)  # zero padding
            rows_d += group
            sizes_d.append(len(group))
        rows.append(rows_d)
        sizes.append(sizes_d)
    return rows, sizes


def reference_dispatch(
    xs: Sequence[torch.Tensor],
    topk_idxs: Sequence[torch.Tensor],
    num_experts: int,
    expert_alignment: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global view -> each destination rank's ``(routed (R_d, H), tokens_per_expert (e,))``.

    xs: per source rank, (T_s, H); topk_idxs: per source rank, (T_s, K). Padding rows are zero.
    """
    rows, sizes = reference_slot_rows(topk_idxs, num_experts, expert_alignment)
    H = xs[0].shape[1]
    zero = xs[0].new_zeros(H)
    out = []
    for rows_d, sizes_d in zip(rows, sizes):
        picked = [zero if r is None else xs[r[0]][r[1]] for r in rows_d]
        routed = torch.stack(picked) if picked else xs[0].new_zeros(0, H)
        out.append((routed, torch.tensor(sizes_d, dtype=torch.int64)))
    return out


def reference_combine(
    expert_outs: Sequence[torch.Tensor],
    topk_idxs: Sequence[torch.Tensor],
    num_experts: int,
    topk_weights: Optional[Sequence[torch.Tensor]] = None,
    expert_alignment: int = 1,
    acc_dtype: Optional[torch.dtype] = None,
) -> list[torch.Tensor]:
    """Each destination rank's (R_d, H) expert outputs -> each source rank's (T_s, H) result.

    y_s[t] = sum_k w_s[t, k] * expert_out[row of (s, t, k)], summed over k in order; -1 slots
    and padding rows contribute nothing. ``acc_dtype``: dtype of the products and the sum
    (default: that of the expert outputs, i.e. no extra precision); the result is rounded
    once to the expert outputs' dtype.
    """
    rows, _ = reference_slot_rows(topk_idxs, num_experts, expert_alignment)
    where = {r: (d, i) for d, rows_d in enumerate(rows) for i, r in enumerate(rows_d) if r is not None}
    dtype = expert_outs[0].dtype
    acc_dtype = acc_dtype or dtype
    H, device = expert_outs[0].shape[1], expert_outs[0].device
    ys = []
    for s, idx in enumerate(topk_idxs):
        T, K = idx.shape
        y_rows = []
        for t in range(T):
            acc = torch.zeros(H, dtype=acc_dtype, device=device)
            for k in range(K):
                if (s, t, k) in where:
                    d, i = where[(s, t, k)]
                    term = expert_outs[d][i].to(acc_dtype)
                    if topk_weights is not None:
                        term = term * topk_weights[s][t, k].to(acc_dtype)
                    acc = acc + term
            y_rows.append(acc)
        y = torch.stack(y_rows) if y_rows else torch.zeros(0, H, dtype=acc_dtype, device=device)
        ys.append(y.to(dtype))
    return ys
