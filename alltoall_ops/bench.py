"""Benchmark of dispatch / combine against plain PyTorch and the byte floor (``make bench``).

    python -m alltoall_ops.bench [--out results] [--shapes ...]      # on a GPU host
    python -m alltoall_ops.bench --smoke                             # CPU: tiny shapes, labelled

For each shape (T, H, K, E), bf16, with fresh random top-k routing (distinct experts per token):
- ``ours/local``: this library's dispatch (routing plan + metadata + payload) and combine at W = 1;
- ``torch``: the usual argsort + index_select dispatch and fp32 ``index_add_`` combine;
each eager and under ``torch.compile``. Outputs are checked against a reference before timing.

Bytes: dispatch reads x once and writes T*K rows (``(T + T*K) * H * itemsize``); combine reads
T*K rows and writes T rows, the same count. The floor is those bytes at the device-to-device
copy bandwidth measured in the same run (bytes read + written over time of a large copy).
Timing: CUDA-event medians of ``triton.testing.do_bench`` after warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from typing import Callable

import torch

from . import api

SHAPES = ((4096, 7168, 8, 256), (8192, 7168, 8, 256), (16384, 4096, 8, 128), (128, 7168, 8, 256))
SMOKE_SHAPES = ((64, 32, 2, 8), (16, 32, 4, 8))


@dataclasses.dataclass
class Row:
    shape: tuple[int, int, int, int]
    impl: str
    op: str
    us: float
    floor_us: float

    @property
    def ratio(self) -> float:
        return self.us / self.floor_us


def routing(T: int, K: int, E: int, device: torch.device, seed: int):
    """Top-k of random scores: K distinct experts per token, weights softmax-normalised."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.randn(T, E, device=device, generator=gen)
    weights, topk_idx = scores.softmax(-1).topk(K, dim=-1)
    return topk_idx, weights


# --- plain PyTorch baseline -----------------------------------------------------------------


def torch_dispatch(x: torch.Tensor, topk_idx: torch.Tensor):
    """argsort + gather: (T, H) -> (T*K, H) rows grouped by expert, and the sort order."""
    order = torch.argsort(topk_idx.reshape(-1), stable=True)
    return x.index_select(0, order // topk_idx.shape[1]), order


def torch_combine(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, T: int):
    """fp32 index_add_ of weighted rows back to their tokens."""
    K = weights.shape[1]
    rows = expert_out.float() * weights.reshape(-1)[order].float()[:, None]
    out = torch.zeros(T, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    return out.index_add_(0, order // K, rows).to(expert_out.dtype)


# --- this library ---------------------------------------------------------------------------


def ours_dispatch(x, topk_idx, num_experts: int):
    return api.dispatch(x, topk_idx, num_experts=num_experts, backend="local")


def ours_combine(expert_out, handle, weights):
    return api.combine(expert_out, handle, weights)


# --- timing ---------------------------------------------------------------------------------


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median microseconds of fn(): CUDA events via triton.testing.do_bench, else wall clock."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: 1e3 * triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")

    def wall(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e6 * sorted(times)[len(times) // 2]

    return wall


def copy_bandwidth(device: torch.device, time_us) -> float:
    """Bytes read + written per second of a large device-to-device copy."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src))
    return 2 * n / (us * 1e-6)


def bench_shape(shape, device, time_us, bandwidth, compile_backend: str) -> list[Row]:
    T, H, K, E = shape
    dtype = torch.bfloat16
    x = torch.randn(T, H, device=device, dtype=dtype)
    topk_idx, weights = routing(T, K, E, device, seed=T + H)
    floor_us = (T + T * K) * H * x.element_size() / bandwidth * 1e6

    # Check both implementations against each other before timing (same grouping at W = 1).
    routed, _, handle = ours_dispatch(x, topk_idx, E)
    routed_ref, order = torch_dispatch(x, topk_idx)
    assert torch.equal(routed, routed_ref), "dispatch differs from the argsort reference"
    expert_out = torch.randn_like(routed)
    y = ours_combine(expert_out, handle, weights)
    y_ref = torch_combine(expert_out, order, weights, T)
    err = ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
    assert err < 1e-2, f"combine differs from the index_add reference: rel err {err:.2e}"

    impls = {
        "ours/local": (lambda: ours_dispatch(x, topk_idx, E), lambda: ours_combine(expert_out, handle, weights)),
        "torch": (lambda: torch_dispatch(x, topk_idx), lambda: torch_combine(expert_out, order, weights, T)),
    }
    if compile_backend != "none":
        cd = torch.compile(ours_dispatch, backend=compile_backend, fullgraph=True)
        cc = torch.compile(ours_combine, backend=compile_backend, fullgraph=True)
        td = torch.compile(torch_dispatch, backend=compile_backend)
        tc = torch.compile(torch_combine, backend=compile_backend)
        impls["ours/local compiled"] = (lambda: cd(x, topk_idx, E), lambda: cc(expert_out, handle, weights))
        impls["torch compiled"] = (lambda: td(x, topk_idx), lambda: tc(expert_out, order, weights, T))
    rows = []
    for name, (dispatch_fn, combine_fn) in impls.items():
        rows.append(Row(shape, name, "dispatch", time_us(dispatch_fn), floor_us))
        rows.append(Row(shape, name, "combine", time_us(combine_fn), floor_us))
    return rows


def markdown(rows: list[Row], header: str) -> str:
    lines = [header, "", "| T | H | K | E | impl | op | us | floor us | time / floor |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        T, H, K, E = r.shape
        lines.append(f"| {T} | {H} | {K} | {E} | {r.impl} | {r.op} | {r.us:.1f} | {r.floor_us:.1f} | {r.ratio:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r.shape for r in rows}, key=lambda s: (s[0] == 128, s))
    series = sorted({(r.impl, r.op) for r in rows})
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(series)
    for i, (impl, op) in enumerate(series):
        ratios = [next((r.ratio for r in rows if r.shape == s and r.impl == impl and r.op == op), 0) for s in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], ratios, width, label=f"{impl} {op}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels([f"T={s[0]} H={s[1]}\nK={s[2]} E={s[3]}" for s in shapes])
    ax.set_yscale("log")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("time / byte floor (log)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (no GPU needed)")
    parser.add_argument("--out", default="results", help="folder for JSON, markdown and PNG")
    parser.add_argument("--compile-backend", default="inductor", choices=("inductor", "aot_eager", "none"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("alltoall_ops.bench: no CUDA device here; nothing to measure. "
              "Run it on a GPU host, or pass --smoke for a tiny CPU run (its times mean nothing).")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    time_us = timer(device)
    bandwidth = copy_bandwidth(device, time_us)
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU smoke ({platform.processor() or 'cpu'})"
    import triton

    header = (f"{name}; torch {torch.__version__}, triton {triton.__version__}; "
              f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    print(header, flush=True)
    rows = []
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        for row in bench_shape(shape, device, time_us, bandwidth, args.compile_backend):
            rows.append(row)
            print(f"{row.shape} {row.impl:>22} {row.op:>8}: {row.us:9.1f} us  floor {row.floor_us:7.1f}  x{row.ratio:.2f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    tag = "smoke" if args.smoke else "gpu"
    with open(os.path.join(args.out, f"bench_{tag}.json"), "w") as f:
        json.dump({"header": header, "bandwidth_Bps": bandwidth,
                   "rows": [dict(dataclasses.asdict(r), ratio=r.ratio) for r in rows]}, f, indent=1)
    with open(os.path.join(args.out, f"bench_{tag}.md"), "w") as f:
        f.write(markdown(rows, header))
    plot(rows, os.path.join(args.out, f"bench_{tag}.png"))
    print(markdown(rows, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
