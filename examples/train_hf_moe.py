"""Train a small mixture-of-experts language model from a Hugging Face transformers config, with
expert parallelism through this library, checked step by step against the same model on one rank.

    python -m examples.train_hf_moe                        # 2 spawned CPU ranks (gloo)
    python -m examples.train_hf_moe --world-size 4 --model qwen3_moe --steps 20
    python -m examples.train_hf_moe --device cuda --world-size 1   # one rank, in this process
    torchrun --nproc-per-node 2 -m examples.train_hf_moe   # the launcher's ranks (--device cuda: NCCL)

The model (Mixtral or Qwen3-MoE, tiny, random init, no download) is saved by rank 0 and loaded
on every rank twice: expert-parallel (``DistributedConfig(fsdp_size=W, ep_size=W,
ep_implementation="alltoall_ops")``, after ``alltoall_ops.integrations.transformers.register()``)
and whole, on one rank. Each step draws fresh token ids (made here: a repeating pattern a model
can learn); rank r trains the expert-parallel model on its share of the batch, and every rank
also trains the whole model on the whole batch. The losses must match at every step. Prints one
line per step and PASS / FAIL; exits non-zero on FAIL.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from examples.launch import run_ranks

TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-3, torch.bfloat16: 5e-2}
"""Largest relative loss difference (expert-parallel vs one rank) that passes, per dtype: AdamW
normalises each update, so rounding differences grow over the steps."""
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.train_hf_moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2,
                   help="ranks to spawn (1: this process, on any device; ignored under torchrun)")
    p.add_argument("--model", choices=("mixtral", "qwen3_moe"), default="mixtral")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float64",
                   help="float64 by default: in lower precision a near-tie in the router can pick other experts "
                        "on the two sides and the losses part")
    return p.parse_args(argv)


def build_config(kind: str, *, vocab: int = 128, hidden: int = 64, ffn: int = 96, head_dim: int = 16):
    """(config, model class) of a small random-init model: 2 layers, 4 attention heads of
    ``head_dim`` (Qwen3-MoE), 8 experts of width ``ffn``, top-2."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, num_experts_per_tok=2, max_position_embeddings=256)
    if kind == "mixtral":
        return transformers.MixtralConfig(intermediate_size=ffn, num_local_experts=8, **common), \
            transformers.MixtralForCausalLM
    return transformers.Qwen3MoeConfig(intermediate_size=ffn, moe_intermediate_size=ffn, num_experts=8,
                                       head_dim=head_dim, decoder_sparse_step=1, **common), \
        transformers.Qwen3MoeForCausalLM


def tokens(step: int, rows: int, seq: int, vocab: int) -> torch.Tensor:
    """(rows, seq) ids of step ``step``: each row counts up from a random start with a random
    stride (mod vocab), so the next token is learnable from the two before it."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    return (start + stride * torch.arange(seq)) % vocab


def next_token_loss(logits_BSV: torch.Tensor, ids_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, in fp32 at least (fp64 for fp64 logits)."""
    V = logits_BSV.shape[-1]
    logits = logits_BSV[:, :-1].reshape(-1, V).to(torch.promote_types(logits_BSV.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits, ids_BS[:, 1:].reshape(-1))


def undo_expert_grad_division(model, world_size: int) -> None:
    """transformers 5.24's data + expert parallel layout leaves each expert's gradient divided by
    W once too often (its built-in "all_to_all" alike; see tests/test_transformers.py):
    multiply it back so the expert-parallel model trains like the whole one."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name and p.grad is not None:
                p.grad.mul_(world_size)


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> bool:
    from transformers.distributed import DistributedConfig

    from alltoall_ops.integrations import transformers as a2a_hf

    a2a_hf.register()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    config, cls = build_config(args.model)
    folder = [tempfile.mkdtemp() if rank == 0 else None]  # rank 0 saves the model, every rank loads it
    dist.broadcast_object_list(folder)
    path = os.path.join(folder[0], "model")
    if rank == 0:
        torch.manual_seed(0)
        cls(config).save_pretrained(path)
    dist.barrier()
    load = dict(dtype=dtype, experts_implementation="batched_mm" if device.type == "cpu" else None)
    ep = cls.from_pretrained(path, distributed_config=DistributedConfig(
        fsdp_size=world_size, ep_size=world_size, ep_implementation="alltoall_ops"), **load).to(device)
    whole = cls.from_pretrained(path, **load).to(device)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=args.lr) for m in (ep, whole)]
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    ok, start = True, time.perf_counter()
    for step in range(args.steps):
        ids_all = tokens(step, world_size * args.batch, args.seq, config.vocab_size).to(device)
        loss = next_token_loss(ep(input_ids=ids_all[mine]).logits, ids_all[mine])
        loss_whole = next_token_loss(whole(input_ids=ids_all).logits, ids_all)
        loss.backward()
        loss_whole.backward()
        undo_expert_grad_division(ep, world_size)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # each rank's loss is its batch's mean: the global one their mean
        global_loss /= world_size
        err = abs(global_loss.item() - loss_whole.item()) / max(abs(loss_whole.item()), 1e-12)
        passed = err <= TOLERANCE[dtype]
        ok &= passed
        if rank == 0:
            tok_s = (step + 1) * world_size * args.batch * args.seq / (time.perf_counter() - start)
            print(f"step {step + 1}/{args.steps}  loss {global_loss.item():.6f} (one rank {loss_whole.item():.6f})  "
                  f"rel diff {err:.1e}  {'PASS' if passed else 'FAIL'}  {tok_s:,.0f} tok/s", flush=True)
    dist.barrier()  # every rank has loaded the model
    if rank == 0:
        shutil.rmtree(folder[0])
        print(("PASS" if ok else "FAIL") + f": {args.model} with ep_implementation='alltoall_ops' on {world_size} "
              f"ranks matches the model on one rank (relative tolerance {TOLERANCE[dtype]:g})", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    return run_ranks("examples.train_hf_moe", parse_args(argv), timeout=600.0)


if __name__ == "__main__":
    sys.exit(main())
