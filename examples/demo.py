"""Train a small MoE block with expert parallelism under torch.compile, checked step by step
against a dense single-process reference.

    python -m examples.demo                           # 4 spawned CPU ranks (gloo), aot_eager
    python -m examples.demo --world-size 1 --device cuda --compile-backend inductor
    torchrun --nproc-per-node 4 -m examples.demo --device cuda        # launcher's ranks, NCCL

The block is ``x + MoE(RMSNorm(x))`` (:class:`Block`); with ``--ulysses`` it starts with
``x + attention(x)``, causal self-attention over the ranks' shards of one sequence, run
sequence-parallel through Ulysses all-to-all. Every rank builds the same dense block
from ``--seed``; rank r's expert-parallel block holds the replicated norm and router and experts
[r*e, (r+1)*e). Each step, rank r trains on its own shard of a synthetic regression batch
(uneven shards: rank r has ``--tokens + 8 r`` tokens). Every rank also runs the dense block on
the whole batch, one process, no communication, and the step's loss and every gradient must
match; the dense block is trained alongside with its own optimizer, so the check covers the
whole run. Prints per-step loss, errors, PASS/FAIL and tokens/s, and the comm ops of the
compiled graphs; exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from alltoall_ops import ulysses_attention
from alltoall_ops.inspect import CompiledGraphs, capturing_backend
from alltoall_ops.moe import DenseMoE, MoE
from examples.launch import run_ranks

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2}
"""Largest relative error (max |ep - ref| / max |ref| per tensor) that passes, per dtype."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--backend", choices=("auto", "local", "collective"), default="auto",
                   help="dispatch/combine backend")
    p.add_argument("--compile-backend", choices=("aot_eager", "inductor", "none"), default=None,
                   help="torch.compile backend; none = eager (default: aot_eager on cpu, inductor on cuda)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expert-alignment", type=int, default=1)
    p.add_argument("--tokens", type=int, default=128, help="tokens of rank 0 per step (rank r: + 8 r)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--activation", choices=("swiglu", "gelu"), default="swiglu")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--ulysses", action="store_true",
                   help="add causal self-attention over the ranks' shards of one sequence, "
                        "sequence-parallel with Ulysses all-to-all (equal shards then)")
    p.add_argument("--heads", type=int, default=8,
                   help="attention heads (--ulysses); split unevenly when W does not divide them")
    args = p.parse_args(argv)
    if args.compile_backend is None:
        args.compile_backend = "inductor" if args.device == "cuda" else "aot_eager"
    return args


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention over one sequence; x_sH (s, H) -> (s, H).

    With ``group`` (sequence-parallel): x_sH is this rank's shard of the sequence (rank order),
    and attention runs through :func:`alltoall_ops.ulysses_attention` (seq -> head all-to-all,
    SDPA on the full sequence and this rank's heads, head -> seq). Without: plain SDPA on the
    whole sequence (the dense reference). Parameters are replicated across ranks."""

    def __init__(self, hidden_size: int, heads: int, group=None, *, device=None, dtype=None):
        super().__init__()
        self.heads, self.group = heads, group
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False, device=device, dtype=dtype)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False, device=device, dtype=dtype)

    def forward(self, x_sH: torch.Tensor) -> torch.Tensor:
        s, H = x_sH.shape
        q, k, v = self.qkv(x_sH).view(1, s, 3, self.heads, H // self.heads).unbind(2)  # (1, s, Hh, Dh)
        if self.group is not None:
            y = ulysses_attention(q, k, v, group=self.group, is_causal=True)
        else:
            y = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            ).transpose(1, 2)  # (1, s, Hh, Dh)
        return self.out(y.reshape(s, H))


class Block(nn.Module):
    """``x + mixer(x)`` (when a mixer is given), then ``x + moe(norm(x))``; x_TH (T, H) -> (T, H).

    moe: a :class:`MoE` (expert-parallel) or :class:`DenseMoE` (reference). mixer: an optional
    token mixer (e.g. attention), the slot a sequence-parallel demo fills."""

    def __init__(self, moe: nn.Module, hidden_size: int, mixer: nn.Module | None = None):
        super().__init__()
        self.mixer = mixer
        self.norm = nn.RMSNorm(hidden_size, eps=1e-6, device=moe.w_up.device, dtype=moe.w_up.dtype)
        self.moe = moe

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        if self.mixer is not None:
            x_TH = x_TH + self.mixer(x_TH)
        return x_TH + self.moe(self.norm(x_TH))


def build_blocks(args, device: torch.device, dtype: torch.dtype) -> tuple[Block, Block]:
    """(dense reference block, this rank's expert-parallel block), the same on every rank."""
    torch.manual_seed(args.seed)
    dense_moe = DenseMoE(
        args.hidden, args.ffn, args.experts, args.top_k, activation=args.activation,
        device=device, dtype=dtype,
    )
    attention = {}
    if args.ulysses:
        sequence_parallel = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        for name, group in (("dense", None), ("ep", sequence_parallel)):
            torch.manual_seed(args.seed + 1)  # the same parameters in both
            attention[name] = CausalSelfAttention(args.hidden, args.heads, group, device=device, dtype=dtype)
    dense = Block(dense_moe, args.hidden, attention.get("dense"))
    with torch.no_grad():  # a norm weight away from 1, so that its gradient check means something
        dense.norm.weight.uniform_(0.5, 1.5)
    ep_moe = MoE.from_dense(dense_moe, backend=args.backend, expert_alignment=args.expert_alignment)
    ep = Block(ep_moe, args.hidden, attention.get("ep"))
    ep.norm.load_state_dict(dense.norm.state_dict())
    return dense, ep


def make_batch(args, step: int, world_size: int, device, dtype):
    """Step ``step``'s tokens of all ranks x (T_all, H), targets (T_all, H), and rank r's
    rows [offsets[r], offsets[r + 1]). The target is x plus a fixed random map: x + tanh(x A)."""
    uneven = 0 if args.ulysses else 8  # Ulysses needs equal sequence shards
    tokens = [args.tokens + uneven * r for r in range(world_size)]
    offsets = [sum(tokens[:r]) for r in range(world_size + 1)]
    gen = torch.Generator().manual_seed(args.seed)
    A_HH = torch.randn(args.hidden, args.hidden, generator=gen) / args.hidden**0.5
    gen.manual_seed(args.seed * 1000 + step + 1)
    x = torch.randn(offsets[-1], args.hidden, generator=gen)
    target = x + torch.tanh(x @ A_HH)
    return x.to(device, dtype), target.to(device, dtype), offsets


def squared_error(out_TH: torch.Tensor, target_TH: torch.Tensor, num_all_tokens: int) -> torch.Tensor:
    """This rank's share of the global loss, the mean over all ranks' tokens of
    ||out - target||^2 (the shares sum to it). fp32 (fp64 for fp64)."""
    diff = (out_TH - target_TH).to(torch.float64 if out_TH.dtype == torch.float64 else torch.float32)
    return diff.square().sum() / num_all_tokens


def _max_errors(pairs) -> tuple[float, float]:
    """Max abs and max relative (to the reference's largest magnitude) error over (got, ref)."""
    abs_err = rel_err = 0.0
    for got, ref in pairs:
        err = (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0
        scale = ref.double().abs().max().item() if ref.numel() else 0.0
        abs_err = max(abs_err, err)
        rel_err = max(rel_err, err / scale if scale > 0 else err)
    return abs_err, rel_err


@torch.no_grad()
def load_from_expert_parallel(dense: Block, ep: Block, world_size: int) -> None:
    """Copy every rank's expert-parallel parameters into the dense block (experts gathered)."""
    dense_params = dict(dense.named_parameters())
    for name, p in ep.named_parameters():
        if name.startswith("moe.w_") and world_size > 1:  # experts: all ranks' slices, in order
            parts = [torch.empty_like(p) for _ in range(world_size)]
            dist.all_gather(parts, p.detach().contiguous())
            dense_params[name].copy_(torch.cat(parts))
        else:
            dense_params[name].copy_(p)


def run_rank(rank: int, world_size: int, args) -> bool:
    """Train ``args.steps`` steps on this rank; returns whether every step matched."""
    distributed = dist.is_available() and dist.is_initialized()
    on_cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    dense, ep = build_blocks(args, device, dtype)
    graphs = CompiledGraphs()
    model = ep
    if args.compile_backend != "none":
        model = torch.compile(ep, backend=capturing_backend(graphs, args.compile_backend), fullgraph=True)
    opt_ep = torch.optim.SGD(ep.parameters(), lr=args.lr, momentum=0.9)
    opt_dense = torch.optim.SGD(dense.parameters(), lr=args.lr, momentum=0.9)
    replicated = list(ep.norm.parameters()) + ep.moe.replicated_parameters()
    if ep.mixer is not None:
        replicated += list(ep.mixer.parameters())
    local = ep.moe.local_expert_slice()

    say(
        f"{'Ulysses attention (' + str(args.heads) + ' heads) + ' if args.ulysses else ''}"
        f"MoE block: H={args.hidden} F={args.ffn} E={args.experts} top-{args.top_k} {args.activation}, "
        f"{ep.moe.num_local_experts} experts/rank; W={world_size} rank{'s' if world_size > 1 else ''} "
        f"on {args.device} "
        f"({'process group ' + dist.get_backend() if distributed else 'single process'}), "
        f"backend={args.backend}, expert_alignment={args.expert_alignment}, dtype={args.dtype}, "
        f"compile={args.compile_backend}"
    )
    # bf16: rounding makes two independently trained copies drift apart within a few steps, so
    # the reference restarts from the expert-parallel block's parameters before every step.
    resync = dtype == torch.bfloat16
    say(
        "reference: dense block on all ranks' tokens in one process, "
        + ("re-synced to the expert-parallel parameters every step" if resync else
           "trained alongside with its own optimizer")
    )
    tol = TOLERANCE[dtype]
    all_ok = True
    for step in range(args.steps):
        x_all, target_all, offsets = make_batch(args, step, world_size, device, dtype)
        rows = slice(offsets[rank], offsets[rank + 1])
        if resync:
            load_from_expert_parallel(dense, ep, world_size if distributed else 1)

        # --- expert-parallel step (timed)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt_ep.zero_grad(set_to_none=True)
        out = model(x_all[rows])
        loss = squared_error(out, target_all[rows], offsets[-1])
        loss.backward()
        if distributed:
            for p in replicated:  # data-parallel parameters: sum the gradient shares
                dist.all_reduce(p.grad)
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
        else:
            global_loss = loss.detach()
        grads_ep = [p.grad.clone() for p in ep.parameters()]
        opt_ep.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0

        # --- dense reference on all ranks' tokens, same parameters so far
        opt_dense.zero_grad(set_to_none=True)
        out_ref = dense(x_all)
        loss_ref = squared_error(out_ref, target_all, offsets[-1])
        loss_ref.backward()
        opt_dense.step()

        dense_grads = dict(dense.named_parameters())
        pairs = []
        for (name, _), g in zip(ep.named_parameters(), grads_ep):
            ref = dense_grads[name].grad
            is_expert = name.startswith("moe.w_")
            pairs.append((g, ref[local] if is_expert else ref))
        grad_abs, grad_rel = _max_errors(pairs)
        out_abs, out_rel = _max_errors([(out.detach(), out_ref.detach()[rows])])
        loss_abs, loss_rel = _max_errors([(global_loss, loss_ref.detach())])
        errors = torch.tensor([grad_abs, grad_rel, out_abs, out_rel, loss_abs, loss_rel], device=device)
        if distributed:
            dist.all_reduce(errors, op=dist.ReduceOp.MAX)
        grad_abs, grad_rel, out_abs, out_rel, loss_abs, loss_rel = errors.tolist()
        ok = max(grad_rel, out_rel, loss_rel) <= tol
        all_ok &= ok
        note = "  (incl. compilation)" if step == 0 and args.compile_backend != "none" else ""
        say(
            f"step {step + 1}/{args.steps}  loss {global_loss.item():.6f} (ref {loss_ref.item():.6f})  "
            f"max err: out {out_abs:.1e} abs / {out_rel:.1e} rel, grads {grad_abs:.1e} abs / "
            f"{grad_rel:.1e} rel  {'PASS' if ok else 'FAIL'}  "
            f"{offsets[-1] / step_s:,.0f} tok/s{note}"
        )
        if step == 0 and args.compile_backend != "none":
            say("comm ops of the compiled graphs (rank 0):")
            say("\n".join("  " + line for line in graphs.summary().splitlines()))

    if args.compile_backend != "none":
        compiles = torch.tensor([len(graphs.forward)], device=device)
        if distributed:
            dist.all_reduce(compiles, op=dist.ReduceOp.MAX)
        once = int(compiles) == 1
        all_ok &= once
        say(
            f"compilations over {args.steps} steps (max over ranks): {int(compiles)}, graph breaks: "
            f"{graphs.graph_breaks}  {'PASS' if once else 'FAIL: expected exactly one'}"
        )
    if distributed:
        flag = torch.tensor([0 if all_ok else 1], device=device)
        dist.all_reduce(flag)
        all_ok = int(flag) == 0
    say(f"{'PASS' if all_ok else 'FAIL'}: expert-parallel training matches the dense reference "
        f"(relative tolerance {tol:g})")
    return all_ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_ranks("examples.demo", args, needs_group=args.backend == "collective")


if __name__ == "__main__":
    sys.exit(main())
