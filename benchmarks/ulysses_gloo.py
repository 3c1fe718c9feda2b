"""Ulysses on gloo ranks: ours against DeepSpeed's, in the same run and the same processes.

    python -m benchmarks.ulysses_gloo                     # 2 ranks
    python -m benchmarks.ulysses_gloo --world-size 4 --rounds 30

Rows, per shape (B, S, Hh, D) fp32 (``SHAPES``), bshd, sequence sharded over W ranks (S/W a rank):
- ``seq_to_head``: one forward exchange, ``a2a.seq_to_head`` against DeepSpeed's
  ``_SeqAllToAll`` (its ``single_all_to_all``, scatter the heads, gather the sequence);
- ``attention fwd+bwd``: ``a2a.ulysses_attention`` against ``DistributedAttention``, the same
  local attention (``scaled_dot_product_attention``) on both sides, forward and backward
  (S <= ``ATTENTION_MAX_S``).

The two sides alternate within each round (the same warm processes, the same load); each round
times ``--calls`` calls of one side; a row is the median over rounds of rank 0's time per call, with
the spread (min-max over rounds). The host reads and collectives of one ``ulysses_attention``
forward + backward are counted too (``alltoall_ops.testing.HostTraffic``). CPU times, on gloo:
they measure host cost and the transport, not a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import alltoall_ops as a2a
from alltoall_ops.testing import DistributedPool, HostTraffic

SHAPES = [(1, 256, 8, 64), (2, 1024, 8, 64), (2, 4096, 16, 64)]  # (B, S, Hh, D)
ATTENTION_MAX_S = 256  # the attention rows at the shorter sequences only (its compute is O(S^2))


def _sdpa_bshd(q, k, v):
    """The local attention of both sides: (B, S, h, D) in, out."""
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    return out.transpose(1, 2)


def _per_call_us(fn: Callable[[], None], calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _contests(group, shape, world_size) -> tuple[list, tuple[int, dict]]:
    """[(op, ours, deepspeed's)] at ``shape`` (after checking that both give the same attention),
    and the host reads and collectives of one of our ulysses_attention forward + backward."""
    from deepspeed.sequence.layer import DistributedAttention, _SeqAllToAll

    B, S, H, D = shape
    q, k, v = (torch.randn(B, S // world_size, H, D, requires_grad=True) for _ in range(3))
    grad = torch.randn(B, S // world_size, H, D)
    ds_attention = DistributedAttention(_sdpa_bshd, group, scatter_idx=2, gather_idx=1)

    def ours_attention():
        torch.autograd.backward(a2a.ulysses_attention(q, k, v, group, attn_fn=_sdpa_bshd), grad)

    torch.testing.assert_close(a2a.ulysses_attention(q, k, v, group, attn_fn=_sdpa_bshd), ds_attention(q, k, v, 0))
    with HostTraffic() as traffic:
        ours_attention()
    contests = [("seq_to_head", lambda: a2a.seq_to_head(q.detach(), group),
                 lambda: _SeqAllToAll.apply(group, q.detach(), 2, 1, 0))]
    if S <= ATTENTION_MAX_S:
        contests.append(("attention fwd+bwd", ours_attention,
                         lambda: torch.autograd.backward(ds_attention(q, k, v, 0), grad)))
    return contests, (traffic.reads, dict(traffic.collectives))


def run_rank(rank, world_size, shapes, rounds, calls):
    from tests.test_deepspeed import init_deepspeed, sequence_parallel

    torch.manual_seed(rank)
    init_deepspeed()
    group = dist.group.WORLD
    rows = []
    with sequence_parallel(group):
        for shape in shapes:
            contests, traffic = _contests(group, shape, world_size)
            for name, ours, theirs in contests:
                ours(), theirs()  # warm-up
                times = {"ours": [], "deepspeed": []}
                for _ in range(rounds):
                    times["ours"].append(_per_call_us(ours, calls))
                    times["deepspeed"].append(_per_call_us(theirs, calls))
                rows.append((shape, name, times, traffic))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    with DistributedPool(args.world_size) as pool:
        rows = pool.run(run_rank, SHAPES, args.rounds, args.calls, timeout=1800)[0]
    print(f"torch {torch.__version__}, gloo, W={args.world_size}, fp32, {args.rounds} rounds x {args.calls} calls; "
          "us per call, median (min-max) over rounds, rank 0")
    print(f"{'(B, S, Hh, D)':<20} {'op':<18} {'ours':>22} {'deepspeed':>22} {'ours/ds':>8}")
    for shape, name, times, _ in rows:
        med = {side: statistics.median(t) for side, t in times.items()}
        cells = [f"{med[s]:9.0f} ({min(t):.0f}-{max(t):.0f})" for s, t in times.items()]
        print(f"{str(shape):<20} {name:<18} {cells[0]:>22} {cells[1]:>22} {med['ours'] / med['deepspeed']:8.2f}")
    print("ulysses_attention fwd+bwd, (host reads, collectives) per call:",
          sorted({(reads, tuple(sorted(c.items()))) for _, _, _, (reads, c) in rows}))


if __name__ == "__main__":
    main()
