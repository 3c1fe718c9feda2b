"""One training step (forward, loss, backward) of a small Hugging Face transformers MoE model on
one device, with each expert-parallel implementation installed on every experts module at
EP = 1, in one run:

    python -m benchmarks.hf_step --out $OUT      # one GPU: bf16, grouped_mm experts
    python -m benchmarks.hf_step --smoke         # every row on the CPU, tiny shapes, fp32

Rows (the same weights and tokens in each):
- ``plain``: the model with no expert parallelism (the experts' own forward on the router's ids):
  what a single-GPU user runs.
- ``all_to_all``: transformers' built-in ``ep_implementation="all_to_all"`` (sorts the slots,
  reads the split sizes on the host, ``all_to_all_single`` on a group of one).
- ``alltoall_ops``: ours (the local backend on a group of one: no host sync, static rows).
- ``alltoall_ops_symm_mem``: ours over ``SymmBuffers`` for the step's tokens (W = 1).

Each implementation is installed as transformers installs it (``EpDispatchExpertsParallel``
with ``ep_size = 1`` meshes; ``ep_size=1`` in a ``DistributedConfig`` installs nothing).
Suffix ``.compile``: ``torch.compile(model)`` (default mode; the built-in one breaks the graph
at its host read), after one eager step, from a reset dynamo (the rows share the model's code:
without it a row would run on an earlier row's cache entries); the graphs and graph breaks that
its first compiled step made are reported. Before timing, each row's loss and gradients are
compared with ``plain``'s. Reported: the median step time (``alltoall_ops.testing.timer``) and
the host time to issue a step (``host_us``; equal to the step time when host-bound).
"""

from __future__ import annotations

import argparse
import copy
import functools
import socket

import torch
import torch.distributed as dist

from alltoall_ops.testing import host_us, timer
from benchmarks._table import save_step_table
from examples.train_hf_moe import build_config, next_token_loss, tokens

IMPLEMENTATIONS = ("plain", "all_to_all", "alltoall_ops", "alltoall_ops_symm_mem")
SHAPES = {"gpu": dict(hidden=1024, ffn=1408, head_dim=64, vocab=4096, batch=8, seq=512),
          "smoke": dict(hidden=64, ffn=96, head_dim=16, vocab=128, batch=2, seq=16)}


def install(model: torch.nn.Module, name: str, mesh) -> torch.nn.Module:
    """``model`` with ``ep_implementation=name`` on every experts module, EP = 1 (``plain``: as is)."""
    from transformers.distributed.expert_parallel import EpDispatchExpertsParallel

    if name != "plain":
        style = EpDispatchExpertsParallel()
        for layer in model.model.layers:
            layer.mlp.experts._is_expert_parallel = True  # as transformers' expert sharding marks them
            style.install_forward(layer.mlp.experts, mesh, tp_mesh=mesh, ep_implementation=name)
    return model


def train_step(model, ids_BS: torch.Tensor) -> torch.Tensor:
    """Forward, next-token loss, backward (gradients set to None first); returns the loss."""
    model.zero_grad(set_to_none=True)
    loss = next_token_loss(model(input_ids=ids_BS).logits, ids_BS)
    loss.backward()
    return loss.detach()


def grads(model) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("mixtral", "qwen3_moe"), default="mixtral")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--out", default=None, help="folder for hf_step.json / hf_step.md")
    args = p.parse_args(argv)
    from alltoall_ops.integrations import transformers as a2a_hf
    from torch._dynamo.utils import counters  # after alltoall_ops: it imports triton
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SHAPES["gpu" if cuda else "smoke"]
    with socket.socket() as s:  # a group of one rank on a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    B, S = shape["batch"], shape["seq"]
    a2a_hf.register(max_tokens_per_rank=B * S)
    config, cls = build_config(args.model, vocab=shape["vocab"], hidden=shape["hidden"], ffn=shape["ffn"],
                               head_dim=shape["head_dim"])
    config._experts_implementation = "grouped_mm" if cuda else "batched_mm"
    torch.manual_seed(0)
    base = cls(config).to(device, dtype)
    ids = tokens(0, B, S, config.vocab_size).to(device)
    time_us = timer(device)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    rows, want = [], None
    for name in IMPLEMENTATIONS:
        for compiled in (False, True):
            model = install(copy.deepcopy(base), name, mesh)
            loss = train_step(model, ids)  # eager first: symm_mem makes its buffers here
            # a fresh dynamo per row: the rows share the model's code, so an earlier row's cache
            # entries (and its graph breaks) would otherwise serve this one
            torch._dynamo.reset()
            counters.clear()
            step = torch.compile(model) if compiled else model
            loss = train_step(step, ids)
            graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
            if want is None:
                want = loss, grads(model)
            torch.testing.assert_close(loss, want[0], **tol)
            for g, w in zip(grads(model), want[1]):
                torch.testing.assert_close(g, w, **tol)
            row = f"{name}.compile" if compiled else name
            one_step = functools.partial(train_step, step, ids)
            us, host = time_us(one_step), host_us(one_step, n=10)
            rows.append(dict(row=row, step_us=us, host_us=host, graphs=graphs, graph_breaks=breaks))
            print(f"{row:28s} {us:10.1f} us/step   host {host:10.1f} us   {graphs} graphs, {breaks} breaks",
                  flush=True)
            del model, step
    dist.destroy_process_group()
    plain = {r["row"].removeprefix("plain"): r["step_us"] for r in rows if r["row"].startswith("plain")}
    device_name = torch.cuda.get_device_name() if cuda else "CPU"
    what = (f"{args.model}, 2 layers, H={shape['hidden']}, F={shape['ffn']}, 8 experts, top-2, "
            f"T={B * S} tokens a step, {dtype}, {device_name}, torch {torch.__version__}")
    lines = [f"# One training step of a transformers model, EP = 1 ({what})", "",
             "| row | step (us) | host (us) | vs plain | graphs | graph breaks |", "|---|---|---|---|---|---|"]
    for r in rows:
        suffix = ".compile" if r["row"].endswith(".compile") else ""
        lines.append(f"| {r['row']} | {r['step_us']:.1f} | {r['host_us']:.1f} | {r['step_us'] / plain[suffix]:.2f}x "
                     f"| {r['graphs']} | {r['graph_breaks']} |")
    save_step_table(args.out, "hf_step", what, rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
