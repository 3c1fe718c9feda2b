"""Ulysses on several GPUs, one process per GPU (torchrun, NCCL): ``UlyssesBuffers`` over CUDA
symmetric memory against the process-group exchange, then timings with DeepSpeed's exchange.
What one GPU's simulated ranks cannot show runs here: the signal-pad barrier between processes,
the gather's loads from peer GPUs over NVLink, q's exchange beside the projections on real ranks.

    torchrun --nproc-per-node W -m benchmarks.ulysses_multigpu --check --bench --out $OUT
    torchrun --nproc-per-node 2 -m benchmarks.ulysses_multigpu --cpu --check --bench   # dry run, gloo

``--check`` (every check on every rank, PASS only where all ranks pass): seq_to_head and
head_to_seq through the buffers equal to the process group's bit for bit (uneven heads); GQA
``ulysses_attention`` forward and q, k, v gradients through the buffers, with k and v as tensors
and as callables (q's exchange first), equal to the process group's; a CUDA graph of the
exchange replayed with new inputs.
``--bench``: per shape (global (B, S, H, D) bf16, S / W positions a rank), rows timed in rounds
(every row once a round, the same order on every rank, a fresh order each round; a row reports the
median over rounds of the max over ranks of its median time): ``seq_to_head q/k/v`` through the
buffers (q, k, v in one exchange, as ``ulysses_attention``'s), our collective backend, and
DeepSpeed's permute + ``all_to_all_single`` + permute (one each), with the copy floor of the
bytes a rank posts; ``attention fwd+bwd`` with each; ``projections + attention fwd`` (q, k, v
projected from (B, S / W, H * D) rows) on each backend with the projections first and one
exchange, and with q's exchange started first (k and v as callables; ``/`` divides by the former).
Writes ``ulysses_multigpu_W{W}.json`` / ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable

import torch
import torch.distributed as dist

import alltoall_ops as a2a
from alltoall_ops.ulysses import symm_seq_to_head_op

from .bench_multigpu import captured, init_ranks, leave_together, run_checks, say, time_us
from .ulysses import SHAPES, _deepspeed_attention, _SeqAllToAll, fwd_bwd_step, summarized, timed_rounds

DRY_SHAPES = {"dry": (1, 16, 4, 8)}


def _shard(full: torch.Tensor, rank: int, W: int) -> torch.Tensor:
    """This rank's sequence chunk (dim 1) of a global tensor, contiguous."""
    return full.chunk(W, dim=1)[rank].contiguous()


def check_exchange(device, bufs: a2a.UlyssesBuffers) -> str:
    rank, W = dist.get_rank(), dist.get_world_size()
    heads = 2 * W + 1  # uneven: the first ranks one head more
    torch.manual_seed(21)  # the same global tensor on every rank
    x = _shard(torch.randn(2, 8 * W, heads, 16, device=device, dtype=torch.bfloat16), rank, W)
    y = a2a.seq_to_head(x, buffers=bufs)
    assert torch.equal(y, a2a.seq_to_head(x)), "seq_to_head: buffers != process group"
    assert torch.equal(a2a.head_to_seq(y, num_heads=heads, buffers=bufs), x), "head_to_seq: not the inverse"
    return f"W={W}, {heads} heads: = process group, inverse exact"


def check_attention(device, bufs: a2a.UlyssesBuffers) -> str:
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(22)
    shapes = [(1, 16 * W, h, 16) for h in (4 * W, W, W)]  # GQA: kv heads split across ranks
    q, k, v = (_shard(torch.randn(s, device=device, dtype=torch.float32), rank, W) for s in shapes)
    upstream = _shard(torch.randn(shapes[0], device=device), rank, W)
    results = []
    for buffers, projected in ((None, False), (bufs, False), (bufs, True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kv = (lambda t=leaves[1]: t * 1, lambda t=leaves[2]: t * 1) if projected else leaves[1:]
        out = a2a.ulysses_attention(leaves[0], *kv, is_causal=True, buffers=buffers)
        results.append((out, *torch.autograd.grad(out, leaves, upstream)))
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0])), "attention: buffers != process group"
    return "GQA fwd + q/k/v grads, tensors and callables (q first): = process group"


def check_graph(device, bufs: a2a.UlyssesBuffers) -> str:
    rank, W = dist.get_rank(), dist.get_world_size()
    x = torch.empty(2, 8, 2 * W, 16, device=device, dtype=torch.bfloat16)
    out = {}

    def step():
        out["y"] = a2a.seq_to_head(x, buffers=bufs)

    x.normal_()
    graph = captured(step)
    for seed in (1, 2, 3):  # three replays: both stage slots, and back to the first
        torch.manual_seed(seed * 10 + rank)
        x.normal_()
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out["y"], a2a.seq_to_head(x)), f"replay {seed}"
    return "captured once, 3 replays with new inputs = process group"


def bench_rows(shape: tuple, device, bufs: a2a.UlyssesBuffers) -> dict[str, tuple[Callable, float]]:
    """Row name -> (step, bytes this rank posts: what the copy floor moves)."""
    W = dist.get_world_size()
    B, S, H, D = shape
    group = dist.group.WORLD
    qkv = [torch.randn(B, S // W, H, D, device=device, dtype=torch.bfloat16) for _ in range(3)]
    upstream = torch.randn_like(qkv[0])
    nbytes = 3 * qkv[0].numel() * qkv[0].element_size()
    floor_src = torch.cat([t.flatten() for t in qkv])
    floor_dst = torch.empty_like(floor_src)
    x = torch.randn(B, S // W, H * D, device=device, dtype=torch.bfloat16)
    weights = [torch.randn(H * D, H * D, device=device, dtype=torch.bfloat16) / (H * D) ** 0.5 for _ in range(3)]
    projections = [lambda w=w: (x @ w).view(B, S // W, H, D) for w in weights]
    attention_step = fwd_bwd_step(qkv, upstream)

    def projected(q_first: bool, buffers):
        def step():
            q, k, v = projections
            with torch.no_grad():
                return a2a.ulysses_attention(q(), *((k, v) if q_first else (k(), v())), is_causal=True,
                                             buffers=buffers)
        return step

    return {
        "seq_to_head q/k/v copy floor": (lambda: floor_dst.copy_(floor_src), nbytes),
        "seq_to_head q/k/v deepspeed": (lambda: [_SeqAllToAll.apply(t, group, 2, 1) for t in qkv], nbytes),
        "seq_to_head q/k/v collective": (lambda: [a2a.seq_to_head(t, group) for t in qkv], nbytes),
        "seq_to_head q/k/v symm": (lambda: symm_seq_to_head_op(qkv, bufs, 1, 2, [], False), nbytes),  # one exchange
        "attention fwd+bwd deepspeed": (attention_step(lambda q, k, v: _deepspeed_attention(q, k, v, group)), nbytes),
        "attention fwd+bwd collective": (attention_step(lambda q, k, v: a2a.ulysses_attention(
            q, k, v, group, is_causal=True)), nbytes),
        "attention fwd+bwd symm": (attention_step(lambda q, k, v: a2a.ulysses_attention(
            q, k, v, is_causal=True, buffers=bufs)), nbytes),
        **{f"projections + attention fwd{', q first,' if q_first else ''} {name}": (projected(q_first, b), nbytes)
           for name, b in (("collective", None), ("symm", bufs)) for q_first in (False, True)},
    }


def bench(device, shapes: dict, rounds: int, out_dir: str) -> list[dict]:
    W = dist.get_world_size()
    results = []
    for shape in shapes.values():
        B, S, H, D = shape
        bufs = a2a.UlyssesBuffers(a2a.UlyssesBuffers.bytes_for([(B, S // W, H, D)] * 3, torch.bfloat16, W),
                                  device=device)
        rows = bench_rows(shape, device, bufs)
        samples = timed_rounds({row: step for row, (step, _) in rows.items()}, rounds,
                               lambda step: time_us(step, device), f"W={W} {shape} ")
        for row, s in summarized(samples, "deepspeed").items():
            results.append(dict(W=W, shape=list(shape), row=row, **s))
            say(f"W={W} {shape} {row:44s} {s['us']:10.1f} us ({s['min_us']}-{s['max_us']})  {s['ratio']:6.2f}x")
        del bufs
    if dist.get_rank() == 0:
        gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)"
        lines = [f"# Ulysses on {W} x {gpu}, bf16, {rounds} rounds (max over ranks)", "",
                 "| shape (B, S, H, D) | row | us (median) | min-max | / floor (exchange), / deepspeed "
                 "(attention), / one exchange (projections) |", "|---|---|---|---|---|"]
        lines += [f"| {tuple(r['shape'])} | {r['row']} | {r['us']} | {r['min_us']}-{r['max_us']} | {r['ratio']:.2f}x |"
                  for r in results]
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"ulysses_multigpu_W{W}.json"), "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "rows": results}, f, indent=1)
        with open(os.path.join(out_dir, f"ulysses_multigpu_W{W}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="results")
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU ranks (gloo, tiny shapes, no CUDA graph)")
    args = parser.parse_args(argv)
    device = init_ranks(args.cpu)
    failed = 0
    try:
        W = dist.get_world_size()
        say(f"W={W} x {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (dry run)'}, "
            f"torch {torch.__version__}")
        if args.check:
            bufs = a2a.UlyssesBuffers(1 << 20, device=device)
            checks = [("exchange", check_exchange), ("attention", check_attention)]
            if device.type == "cuda":
                checks.append(("cuda graph", check_graph))
            failed = run_checks([(name, lambda fn=fn: fn(device, bufs)) for name, fn in checks], device)
        if args.bench:
            shapes = DRY_SHAPES if args.cpu else {k: SHAPES[k] for k in args.shapes}
            bench(device, shapes, 1 if args.cpu else args.rounds, args.out)
        leave_together()
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
