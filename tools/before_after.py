"""This tree against an older commit in one process, on a GPU: host-bound dispatch / combine and
whole MoE layers, eager and compiled (no CUDA graphs, and the decode layer under
``mode="reduce-overhead"``), with the plain-PyTorch rows of the same process. Rounds interleave
the trees, so a slow spell of the host shows in both; each row is the median over rounds of the
wall time per step (n steps between two synchronisations) and the host time to issue them.

    python3 -m tools.before_after prepare b180ff9 --into _before   # here: the old package, renamed
    python3 -m tools.before_after run --before _before --out $OUT   # on the GPU host (carry _before)

``prepare`` writes ``<into>/alltoall_ops_before``: the package at that commit with its op namespace
renamed (``alltoall_ops_before::``), so both trees register their ops in one process.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Callable

import torch

BEFORE = "alltoall_ops_before"


def prepare(rev: str, into: pathlib.Path) -> None:
    """``<into>/alltoall_ops_before``: the package at ``rev``, its op namespace renamed."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = pathlib.Path(tmp) / "tree.tar"
        subprocess.run(["git", "archive", "-o", str(archive), rev, "alltoall_ops"], check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        target = into / BEFORE
        into.mkdir(parents=True, exist_ok=True)
        if target.exists():
            raise SystemExit(f"{target} exists: remove it first")
        (pathlib.Path(tmp) / "alltoall_ops").rename(target)
    for path in target.rglob("*.py"):
        text = path.read_text()
        path.write_text(text.replace("alltoall_ops::", f"{BEFORE}::").replace("ops.alltoall_ops", f"ops.{BEFORE}"))


def timed(step: Callable[[], object], n: int) -> tuple[float, float]:
    """(wall us, host us) per step over n steps, after 5 warm-up steps."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6, host / n * 1e6


def op_cases(trees: dict, add: Callable, dev: str) -> None:
    """Dispatch and combine alone, (H, K, E) = (7168, 8, 256), T = 128 and 4096, bf16."""
    H, K, E = 7168, 8, 256
    for T in (128, 4096):
        torch.manual_seed(T)
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        w, idx = torch.randn(T, E, device=dev).softmax(-1).topk(K, dim=-1)

        def plain_dispatch(x, idx):
            order = idx.reshape(-1).argsort(stable=True)
            return x.index_select(0, order // K), order

        def plain_combine(rows, order, w):
            out = torch.empty_like(rows).index_copy_(0, order, rows)
            return (out.view(-1, K, rows.shape[1]).float() * w[..., None]).sum(1).to(rows.dtype)

        rows, order = plain_dispatch(x, idx)
        pd, pc = torch.compile(plain_dispatch, fullgraph=True), torch.compile(plain_combine, fullgraph=True)
        add(f"T={T} dispatch plain eager", lambda x=x, idx=idx: plain_dispatch(x, idx))
        add(f"T={T} dispatch plain compiled", lambda x=x, idx=idx, pd=pd: pd(x, idx))
        add(f"T={T} combine plain compiled", lambda rows=rows, order=order, w=w, pc=pc: pc(rows, order, w))
        for tag, a2a in trees.items():
            routed, tokens, handle = a2a.dispatch(x, idx, num_experts=E, backend="local")
            n = int(tokens.sum())
            cd = torch.compile(lambda x, i, a2a=a2a: a2a.dispatch(x, i, num_experts=E)[0], fullgraph=True)
            cc = torch.compile(lambda r, h, w, a2a=a2a: a2a.combine(r, h, w), fullgraph=True)
            bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device=dev)
            sd = torch.compile(lambda x, i, a2a=a2a, b=bufs: a2a.dispatch(x, i, num_experts=E, buffers=b)[0],
                               fullgraph=True)
            y = a2a.combine(routed, handle, w)
            equal = (torch.equal(cd(x, idx), routed), torch.equal(cc(routed, handle, w), y),
                     torch.equal(sd(x, idx)[:n], routed[:n]))
            print(f"check T={T} {tag}: compiled local dispatch, combine, symm_mem dispatch equal to eager: {equal}")
            add(f"T={T} dispatch local eager {tag}",
                lambda x=x, idx=idx, a2a=a2a: a2a.dispatch(x, idx, num_experts=E, backend="local"))
            add(f"T={T} combine local eager {tag}", lambda r=routed, h=handle, w=w, a2a=a2a: a2a.combine(r, h, w))
            add(f"T={T} dispatch local compiled {tag}", lambda x=x, idx=idx, cd=cd: cd(x, idx))
            add(f"T={T} combine local compiled {tag}", lambda r=routed, h=handle, w=w, cc=cc: cc(r, h, w))
            add(f"T={T} dispatch symm.w1 eager {tag}",
                lambda x=x, idx=idx, a2a=a2a, b=bufs: a2a.dispatch(x, idx, num_experts=E, buffers=b))
            add(f"T={T} dispatch symm.w1 compiled {tag}", lambda x=x, idx=idx, sd=sd: sd(x, idx))


def layer_cases(trees: dict, add: Callable, dev: str) -> None:
    """``benchmarks.moe_layer``'s layers: decode forward (compiled; and reduce-overhead) and the
    training step (compiled), plain / local / symm_mem of each tree, one set of weights."""
    from benchmarks.moe_layer import plain_forward

    shapes = {"decode": (128, 2048, 1408, 64, 6), "train": (4096, 2048, 1408, 64, 6)}
    for shape, (T, H, F, E, K) in shapes.items():
        torch.manual_seed(T + H)
        state, layers = None, {}
        for tag, a2a in trees.items():
            moe = importlib.import_module(f"{a2a.__name__}.moe")
            local = moe.MoE(H, F, E, K, backend="local", device=dev, dtype=torch.bfloat16)
            state = state or local.state_dict()
            bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device=dev)
            symm = moe.MoE(H, F, E, K, backend="symm_mem", buffers=bufs, device=dev, dtype=torch.bfloat16)
            for layer in (local, symm):
                layer.load_state_dict(state)
            layers[f"local.compile {tag}"], layers[f"symm.compile {tag}"] = (local, local), (symm, symm)
        reference = layers[f"local.compile {next(iter(trees))}"][0]
        layers["plain.compile"] = (reference, lambda x_, m=reference: plain_forward(m, x_))
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        grad_y = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            want = plain_forward(reference, x)
        for name, (module, fn) in layers.items():
            modes = {"": {}, ".graph": {"mode": "reduce-overhead"}} if shape == "decode" else {"": {}}
            for suffix, kwargs in modes.items():
                compiled = torch.compile(fn, fullgraph=True, **kwargs)
                if shape == "decode":
                    def step(c=compiled, graphed=bool(suffix), x=x):
                        if graphed:
                            torch.compiler.cudagraph_mark_step_begin()
                        with torch.no_grad():
                            return c(x)

                    got = [step() for _ in range(3)][-1]
                    err = float((got.float() - want.float()).norm() / want.float().norm())
                    print(f"check decode {name}{suffix}: relative error against plain eager {err:.2e}")
                else:
                    xin = x.clone().requires_grad_()

                    def step(c=compiled, module=module, xin=xin, grad_y=grad_y):
                        module.zero_grad(set_to_none=True)
                        xin.grad = None
                        c(xin).backward(grad_y)

                label, _, tag = name.partition(" ")
                op = "fwd" if shape == "decode" else "fwd+bwd"
                add(f"MoE {shape} T={T} {op} {label}{suffix} {tag}".strip(), step)


def run(before: pathlib.Path, rounds: int, out: str | None, profiled: list[str], only: str = "all") -> None:
    if rounds < 1:
        raise SystemExit(f"--rounds: expected at least 1, got {rounds}")
    sys.path.insert(0, str(before))
    import alltoall_ops
    old = __import__(BEFORE)
    trees = {"before": old, "after": alltoall_ops}
    cases: dict[str, Callable] = {}
    dev = "cuda"
    if only in ("all", "ops"):
        op_cases(trees, cases.__setitem__, dev)
    if only in ("all", "layers"):
        layer_cases(trees, cases.__setitem__, dev)
    samples: dict[str, list] = {name: [] for name in cases}
    for done in range(1, rounds + 1):
        for name, step in cases.items():
            samples[name].append(timed(step, 20 if "train" in name else 50))
        table = summary(samples)
        if out:  # after every round, so a run cut short by a time limit still leaves its rounds
            with open(os.path.join(out, "before_after.json"), "w") as f:
                json.dump(table, f, indent=1)
        print(f"round {done} of {rounds} done", flush=True)
    for name, row in table.items():
        print(f"{name:58s} wall {row['wall_us']:9.1f}  host {row['host_us']:9.1f}  {row['wall_us_by_round']}",
              flush=True)
    for name in profiled:
        host_profile(name, cases[name])


def summary(samples: dict[str, list]) -> dict[str, dict]:
    """Per case: the medians over rounds of the wall and host time per step, and each round's wall."""
    return {name: {"wall_us": round(statistics.median(v[0] for v in values), 1),
                   "host_us": round(statistics.median(v[1] for v in values), 1),
                   "wall_us_by_round": [round(v[0], 1) for v in values]}
            for name, values in samples.items()}


def host_profile(name: str, step: Callable[[], object], steps: int = 20) -> None:
    """The Python functions taking the most host time over ``steps`` steps of one case."""
    import cProfile
    import io
    import pstats

    timed(step, 1)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
    print(f"host profile of {steps} steps of {name}:\n{text.getvalue()}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="write the renamed old package")
    p.add_argument("rev")
    p.add_argument("--into", type=pathlib.Path, required=True)
    r = sub.add_parser("run", help="time both trees (GPU)")
    r.add_argument("--before", type=pathlib.Path, required=True)
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--out", default=None)
    r.add_argument("--profile", nargs="*", default=[], help="cases (row names) to profile on the host")
    r.add_argument("--only", choices=("all", "ops", "layers"), default="all",
                   help="dispatch and combine alone, or the whole layers")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.rev, args.into)
    else:
        run(args.before, args.rounds, args.out, args.profile, args.only)


if __name__ == "__main__":
    main()
