"""Ulysses on one GPU: the exchange alone and attention forward + backward, ours against the
DeepSpeed-style exchange, with the copy floor, in interleaved rounds.

    python -m benchmarks.ulysses --out $OUT                  # (1, 4096, 32, 128), (1, 32768, 32, 128) bf16
    python -m benchmarks.ulysses --smoke                     # every path on the CPU, tiny shapes
    python -m benchmarks.ulysses --profile                   # also the exchange's kernels (torch.profiler)

Shapes are the global (B, S, H, D) of q, k and v; each of the W ranks holds S / W positions.
Rows (per shape):

- ``seq_to_head q/k/v``: the forward exchange of q, k and v (one call: ``seq_to_head`` of each,
  or ``ulysses_attention``'s one exchange of the three):
  - ``deepspeed.w1``: what DeepSpeed's ``_SeqAllToAll`` does, on a one-rank NCCL group: permute
    each tensor into (W, ...) pieces, ``all_to_all_single``, permute back (3 copies a tensor);
  - ``collective.w1``: ours on the same group (one rank: a copy of each tensor);
  - ``symm.wW.sim``: ours through ``UlyssesBuffers.simulated`` (W ranks on this GPU, one thread
    each; the time covers every rank's exchange, W times one rank's bytes, and every rank's host
    work, one after another in this process); ``.graph``: the same captured in one CUDA graph and
    replayed (``bench.Captured``): the device's time alone, what W processes each issuing their
    own rank's work would approach;
  - ``copy floor``: one ``copy_`` of the bytes every rank posts (all ranks' q, k and v: one read
    and one write of each byte), the least any exchange can move them in; ``/ floor`` divides by it.
- ``attention fwd+bwd``: ``ulysses_attention`` (causal SDPA, bf16) forward and backward with the
  same backends; ``deepspeed.w1`` runs DeepSpeed's exchange around the same SDPA. ``sdpa`` is the
  attention alone on the gathered tensors (no exchange).
- ``projections + attention fwd``: each simulated rank projects q, k and v from its input rows
  (three (H * D, H * D) matmuls) and runs ``ulysses_attention``'s forward: the projections first
  and q, k, v in one exchange, or ``, q first``: k and v given as callables, so q's exchange
  starts on the communication stream before their projections run (``.graph`` rows only; ``/``
  divides q first by the one exchange of the same W): what starting q early hides.

W = 1 rows run the same attention work on one rank; simulated rows split it over W ranks that run
one after another on the one GPU, so their time is the whole group's work; they run
``ulysses_attention``'s exchanges and attention phase by phase
(``testing.simulated_ulysses_attention``: PyTorch's autograd engine runs CUDA backwards on one
device thread, where the simulated ranks' threads would wait for each other); ``.graph``: the
whole step captured in one CUDA graph and replayed. What only NVLink can
show (the link's bandwidth, the barrier's latency across GPUs) is not here. Each round times every
row once, in a fresh order; a row reports the median over rounds (CUDA events,
``triton.testing.do_bench`` medians) and its spread. ``--profile``: per W, the kernels of the
``.graph`` exchange and the copy floor's copy, their time a launch and bandwidth (read + write), to
show where the exchange's time over its design floor goes. Writes ``ulysses_{gpu,smoke}.json`` /
``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from typing import Callable

import torch
import torch.distributed as dist

import alltoall_ops as a2a
from alltoall_ops.backends.symm_mem import run_simulated
from alltoall_ops.testing import one_rank_group, simulated_ulysses_attention, timer
from alltoall_ops.ulysses import symm_seq_to_head_op

from ._rounds import kernel_times
from .bench import Captured

SHAPES = {"4096": (1, 4096, 32, 128), "32768": (1, 32768, 32, 128)}
SMOKE_SHAPES = {"4096": (1, 8, 4, 8)}


class _SeqAllToAll(torch.autograd.Function):
    """DeepSpeed's exchange (``deepspeed.sequence.layer._SeqAllToAll``, written again here for a
    group of W ranks): scatter ``scatter_dim``, gather ``gather_dim``, permute + all_to_all_single
    + permute; the backward is the exchange back."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.args = (group, gather_dim, scatter_dim)
        W = dist.get_world_size(group)
        pieces = x.unflatten(scatter_dim, (W, -1)).movedim(scatter_dim, 0).contiguous()  # permute
        out = torch.empty_like(pieces)
        dist.all_to_all_single(out, pieces, group=group)
        return torch.cat(out.unbind(0), dim=gather_dim).contiguous()  # permute back

    @staticmethod
    def backward(ctx, grad):
        return _SeqAllToAll.apply(grad, *ctx.args), None, None, None


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)


def _deepspeed_attention(q, k, v, group):
    q, k, v = (_SeqAllToAll.apply(t, group, 2, 1) for t in (q, k, v))
    return _SeqAllToAll.apply(_sdpa(q, k, v), group, 1, 2)


def fwd_bwd_step(qkv: list, upstream: torch.Tensor) -> Callable[[Callable], Callable[[], None]]:
    """``attention_step(fn)``: a step that runs ``fn(q, k, v)`` (leaves copied from ``qkv``) and its
    backward from ``upstream``."""
    leaves = [t.clone().requires_grad_() for t in qkv]

    def attention_step(fn: Callable) -> Callable[[], None]:
        def step() -> None:
            for t in leaves:
                t.grad = None
            fn(*leaves).backward(upstream)
        return step
    return attention_step


def cases(shape: tuple, device: torch.device, worlds: list[int]) -> dict[str, tuple[Callable, float]]:
    """Row name -> (step, bytes moved per step: what the copy floor moves)."""
    B, S, H, D = shape
    dtype = torch.bfloat16
    qkv = [torch.randn(shape, device=device, dtype=dtype) for _ in range(3)]
    upstream = torch.randn(shape, device=device, dtype=dtype)
    group = dist.group.WORLD
    nbytes = 3 * qkv[0].numel() * qkv[0].element_size()
    floor_src = torch.cat([t.flatten() for t in qkv])
    floor_dst = torch.empty_like(floor_src)
    out: dict[str, tuple[Callable, float]] = {}
    out["seq_to_head q/k/v copy floor"] = (lambda: floor_dst.copy_(floor_src), nbytes)
    out["seq_to_head q/k/v deepspeed.w1"] = (lambda: [_SeqAllToAll.apply(t, group, 2, 1) for t in qkv], nbytes)
    out["seq_to_head q/k/v collective.w1"] = (lambda: [a2a.seq_to_head(t, group) for t in qkv], nbytes)
    attention_step = fwd_bwd_step(qkv, upstream)

    out["attention fwd+bwd sdpa"] = (attention_step(_sdpa), nbytes)
    out["attention fwd+bwd deepspeed.w1"] = (attention_step(lambda q, k, v: _deepspeed_attention(q, k, v, group)),
                                             nbytes)
    out["attention fwd+bwd collective.w1"] = (attention_step(lambda q, k, v: a2a.ulysses_attention(
        q, k, v, group, is_causal=True)), nbytes)
    for W in worlds:
        bufs = a2a.UlyssesBuffers.simulated(W, a2a.UlyssesBuffers.bytes_for([(B, S // W, H, D)] * 3, dtype, W),
                                            device=device)
        local = [[t.narrow(1, r * (S // W), S // W).contiguous() for t in qkv] for r in range(W)]
        local_up = [upstream.narrow(1, r * (S // W), S // W).contiguous() for r in range(W)]

        def qkv_together(rank, b, local=local):  # the one exchange of ulysses_attention's forward
            return symm_seq_to_head_op(local[rank], b, 1, 2, [], False)

        def attention(b=bufs, local=local, local_up=local_up, stream=None):
            return simulated_ulysses_attention(b, local, local_up, stream=stream)

        out[f"seq_to_head q/k/v symm.w{W}.sim"] = (lambda b=bufs, f=qkv_together: run_simulated(f, b), nbytes)
        graph = Captured(lambda stream, b=bufs, f=qkv_together: run_simulated(f, b, stream=stream),
                         device.type == "cuda", relaxed=True)
        out[f"seq_to_head q/k/v symm.w{W}.sim.graph"] = (graph.replay, nbytes)
        out[f"attention fwd+bwd symm.w{W}.sim"] = (attention, nbytes)
        graph = Captured(lambda stream, f=attention: f(stream=stream), device.type == "cuda", relaxed=True)
        out[f"attention fwd+bwd symm.w{W}.sim.graph"] = (graph.replay, nbytes)
        for row, q_first in (("projections + attention fwd", False), ("projections + attention fwd, q first,", True)):
            step = _projected_attention(bufs, local, q_first)
            graph = Captured(lambda stream, f=step, b=bufs: run_simulated(f, b, stream=stream), device.type == "cuda",
                             relaxed=True)
            out[f"{row} symm.w{W}.sim.graph"] = (graph.replay, nbytes)
    return out


def _projected_attention(bufs: list, local: list, q_first: bool) -> Callable:
    """A simulated rank's forward of attention from its input rows (B, S/W, H * D): q projected,
    then k and v's projections and the exchange: the projections first and q, k, v in one exchange,
    or (``q_first``) q's exchange started before the projections run, k and v's after them
    (``ulysses_attention`` given callables)."""
    B, s, H, D = local[0][0].shape
    xs = [t[0].reshape(B, s, H * D) for t in local]  # stand-ins for the ranks' inputs
    weights = [torch.randn(H * D, H * D, device=xs[0].device, dtype=xs[0].dtype) / (H * D) ** 0.5 for _ in range(3)]

    def step(rank, b):
        x = xs[rank]
        q, k, v = ((lambda w=w: (x @ w).view(B, s, H, D)) for w in weights)
        with torch.no_grad():
            return a2a.ulysses_attention(q(), k, v, is_causal=True, buffers=b) if q_first else \
                a2a.ulysses_attention(q(), k(), v(), is_causal=True, buffers=b)
    return step


def timed_rounds(rows: dict[str, Callable[[], object]], rounds: int, time_us: Callable[[Callable], float],
                 label: str = "") -> dict[str, list[float]]:
    """Per row, its time (``time_us(step)``) in each round: every round times every row once, in
    an order shuffled afresh each round, seeded by the round (on every rank of a group alike)."""
    samples: dict[str, list[float]] = {row: [] for row in rows}
    for r in range(rounds):
        order = list(rows)
        random.Random(r).shuffle(order)
        for row in order:
            samples[row].append(time_us(rows[row]))
            print(f"{label}round {r + 1}/{rounds} {row:44s} {samples[row][-1]:10.1f} us", flush=True)
    return samples


def summarized(samples: dict[str, list[float]], deepspeed: str) -> dict[str, dict]:
    """Per row: the median over rounds (``us``), its spread, and ``ratio``, over the median of the
    row it is judged against: an exchange row the copy floor, an attention row DeepSpeed's
    (``attention fwd+bwd <deepspeed>``), a ``q first`` row the same backend's one exchange."""
    medians = {row: statistics.median(values) for row, values in samples.items()}

    def reference(row: str) -> str:
        if row.startswith("seq_to_head"):
            return "seq_to_head q/k/v copy floor"
        if ", q first," in row:
            return row.replace(", q first,", "")
        return row if row.startswith("projections") else f"attention fwd+bwd {deepspeed}"

    return {row: dict(us=round(medians[row], 1), min_us=round(min(values), 1), max_us=round(max(values), 1),
                      ratio=round(medians[row] / medians[reference(row)], 3)) for row, values in samples.items()}


def kernel_profile(rows: dict[str, tuple[Callable, float]], worlds: list[int], replays: int = 5) -> list[dict]:
    """The kernels of the copy floor and, per W, of the ``seq_to_head q/k/v symm.wW.sim.graph``
    replay: launches a step, us a launch, and for the copy, the post and the gather their read +
    write bandwidth (a rank posts (W - 1) / W of its bytes and gathers W pieces of 1 / W; even
    splits)."""
    floor_step, nbytes = rows["seq_to_head q/k/v copy floor"]
    name, launches, us = max(kernel_times(floor_step, replays), key=lambda k: k[1] * k[2])
    out = [dict(world=1, kernel=f"copy floor: {name[:40]}", launches=launches, us=round(us, 1),
                gb_s=round(2 * nbytes / us / 1e3))]
    for W in worlds:
        moved = {"_post_kernel": 2 * (W - 1) / W * nbytes / W, "_gather_kernel": 2 * nbytes / W}
        for name, launches, us in kernel_times(rows[f"seq_to_head q/k/v symm.w{W}.sim.graph"][0], replays):
            nb = moved.get(name)
            out.append(dict(world=W, kernel=name[:60], launches=launches, us=round(us, 1),
                            gb_s=round(nb / us / 1e3) if nb else None))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for ulysses_{gpu,smoke}.json / .md")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--worlds", nargs="*", type=int, default=[2, 4], help="simulated world sizes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (times mean nothing)")
    parser.add_argument("--profile", action="store_true", help="also the kernels of each .graph exchange (GPU)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    with one_rank_group(device):
        shapes = SMOKE_SHAPES if args.smoke else {k: SHAPES[k] for k in args.shapes}
        rounds = 1 if args.smoke else args.rounds
        time_us = timer(device)
        results, kernels = [], []
        for shape in shapes.values():
            rows = cases(shape, device, args.worlds)
            samples = timed_rounds({row: step for row, (step, _) in rows.items()}, rounds, time_us, f"{shape} ")
            for row, s in summarized(samples, "deepspeed.w1").items():
                gb_s = round(rows[row][1] / s["us"] / 1e3, 1) if row.startswith("seq_to_head") else None
                results.append(dict(shape=list(shape), row=row, **s, gb_s=gb_s))
            if args.profile and not args.smoke:
                kernels += [dict(shape=list(shape), **k) for k in kernel_profile(rows, args.worlds)]
        lines = [f"# Ulysses on one {'CPU (smoke)' if args.smoke else torch.cuda.get_device_name()}, bf16, "
                 f"{rounds} rounds", "",
                 "| shape (B, S, H, D) | row | us (median) | min-max | / floor (exchange), / deepspeed.w1 (attention), "
                 "/ one exchange (projections) | GB/s |", "|---|---|---|---|---|---|"]
        lines += [f"| {tuple(r['shape'])} | {r['row']} | {r['us']} | {r['min_us']}-{r['max_us']} | {r['ratio']:.2f}x | "
                  f"{r['gb_s'] if r['gb_s'] is not None else ''} |" for r in results]
        if kernels:
            lines += ["", "Kernels of the `seq_to_head q/k/v symm.wW.sim.graph` replays and of the copy floor "
                      "(torch.profiler; GB/s: read + write)", "",
                      "| shape | W | kernel | launches a replay | us a launch | GB/s |", "|---|---|---|---|---|---|"]
            lines += [f"| {tuple(k['shape'])} | {k['world']} | {k['kernel']} | {k['launches']:g} | {k['us']} | "
                      f"{k['gb_s'] or ''} |" for k in kernels]
        print("\n".join(lines))
        if args.out:
            tag = "smoke" if args.smoke else "gpu"
            with open(os.path.join(args.out, f"ulysses_{tag}.json"), "w") as f:
                json.dump(dict(rows=results, kernels=kernels), f, indent=1)
            with open(os.path.join(args.out, f"ulysses_{tag}.md"), "w") as f:
                f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
