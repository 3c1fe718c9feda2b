"""The symm_mem kernels under an SM budget beside a GEMM on another stream (issue 24).

    python -m benchmarks.overlap [--out results] [--world-size 2] [--budgets 8 16 32 all]
    python -m benchmarks.overlap --smoke        # CPU: tiny shapes, serial, times mean nothing

One GPU. The exchange: every rank's dispatch + combine of one MoE layer, W ranks simulated in
this process (``SymmBuffers.simulated(..., num_sms=budget)``, one thread per rank, as
``benchmarks/bench.py`` does), T tokens each, captured in one CUDA graph (``bench.Captured``)
and replayed; expert outputs = routed rows. The GEMM: the layer's shared expert, a dense SwiGLU
``(silu(x @ w_gate) * (x @ w_up)) @ w_down`` at (T, H, F) = (4096, 2048, 2816), bf16, every token.
For each SM budget (8 / 16 / 32 SMs, and ``all``: ``num_sms=None``, no cap):

- ``exchange``: the graph replay alone;
- ``gemm``: the shared expert alone;
- ``both``: the two at once, the replay on one stream and the GEMM on another, both forked from
  and joined back into the timing stream, so the CUDA events of ``testing.timer``
  (``triton.testing.do_bench``: medians, warm-up) span both streams: the pair's wall time;
- ``GEMM, budget left free`` and ``both, GEMM leaving the budget free``: the same two with the
  GEMM's matmuls leaving the budget's SMs to the exchange (:func:`matmuls_leave_free`: cuBLASLt
  with torch's experimental SM carveout); without it cuBLAS's kernels take every SM, and the
  exchange's launches wait for them (a higher stream priority did not help: docs/benchmarks.md);
- ``serial``: exchange + gemm, what ``both`` would be without any overlap;
- ``GB/s``: the exchange's bytes (every kernel's rows read once and written once: per rank
  3 T + N + 3 n + P rows of H, n rows received, P the rank's (token, destination rank) pairs:
  the dispatch stages T rows, and its receivers read each pair's row once and write n rows; the
  combine puts n rows back and reduces N into T) over its time, and the same for a plain 30-line
  scatter kernel of bf16 rows to a permuted destination on as many programs (``scatter``, its
  best tile of 8 rows and 16 warps): the bandwidth per SM the exchange keeps.

Then the ``MoE`` layer (symm_mem at W = 1, a shared expert, T = 4096) forward + backward with
``shared_expert_overlap="combine"`` against ``"none"``, at the budgets given, in the same run.

Before timing, each budget's results (every rank's routed rows below ``tokens_per_expert.sum()``,
tokens_per_expert, y) are checked equal to the uncapped run's. ``--smoke`` runs every path on
the CPU (Triton's interpreter, no streams: ``both`` runs the two one after the other). Writes
``overlap_{gpu,smoke}.json`` and ``.md`` into ``--out``. A budget does nothing until the
symm_mem ops pass ``max_programs=buffers.num_sms`` to their launches (docs/symm_mem.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import alltoall_ops as a2a
from alltoall_ops import SymmBuffers
from alltoall_ops.backends.symm_mem import run_simulated
from alltoall_ops.testing import routing, timer
from benchmarks.bench import Captured

SHAPE = (4096, 2048, 6, 64, 2816)
"""(T, H, K, E, F): the MoE layer of ``benchmarks/moe_layer.py`` (T, H, E, K), shared expert F."""
SMOKE_SHAPE = (24, 32, 2, 8, 48)
BUDGETS = ("8", "16", "32", "all")
DTYPE = torch.bfloat16


def shared_expert(T: int, H: int, F_: int, device: torch.device) -> Callable[[], torch.Tensor]:
    """A dense SwiGLU over (T, H) tokens, bf16: three GEMMs of T x H x F (one of them fused up)."""
    g = torch.Generator(device=device).manual_seed(1)
    x_TH = torch.randn(T, H, device=device, generator=g).to(DTYPE)
    w_gate_up_H2F = (torch.randn(H, 2 * F_, device=device, generator=g) / H**0.5).to(DTYPE)
    w_down_FH = (torch.randn(F_, H, device=device, generator=g) / F_**0.5).to(DTYPE)

    def run() -> torch.Tensor:
        gate_TF, up_TF = (x_TH @ w_gate_up_H2F).chunk(2, dim=-1)
        return (F.silu(gate_TF) * up_TF) @ w_down_FH  # (T, H)

    return run


class Exchange:
    """Every simulated rank's dispatch + combine on buffers with SM budget ``num_sms``, captured
    once (``bench.Captured``); ``replay()`` re-runs it, ``outs`` its per-rank results."""

    def __init__(self, W: int, shape: tuple, num_sms: Optional[int], device: torch.device):
        T, H, K, E, _ = shape
        self.xs = [torch.randn(T, H, device=device, generator=torch.Generator(device=device).manual_seed(10 + r))
                   .to(DTYPE) for r in range(W)]
        self.routes = [routing(T, K, E, device=device, seed=20 + r) for r in range(W)]
        self.bufs = SymmBuffers.simulated(W, T, H, K, E, dtype=DTYPE, device=device, num_sms=num_sms)
        self.E = E
        self.graph = Captured(self._step, device.type == "cuda", relaxed=True)

    def _rank(self, r: int, bufs: SymmBuffers):
        topk_idx, weights = self.routes[r]
        routed, tokens_per_expert, handle = a2a.dispatch(self.xs[r], topk_idx, num_experts=self.E, buffers=bufs)
        return routed, tokens_per_expert, a2a.combine(routed, handle, weights)

    def _step(self, stream: Optional[torch.cuda.Stream]):
        return run_simulated(self._rank, self.bufs, stream=stream)

    def replay(self) -> None:
        self.graph.replay()

    def nbytes(self) -> int:
        """Bytes one replay reads and writes (every rank's rows, each read once and written once)."""
        W, total = len(self.xs), 0
        for (topk_idx, _), (_, tpe, _) in zip(self.routes, self.graph.outs):
            T, n, N = topk_idx.shape[0], int(tpe.sum()), int((topk_idx >= 0).sum())
            dest = torch.where(topk_idx >= 0, topk_idx // (self.E // W), W)  # (T, K) each slot's rank, W: none
            P = int(torch.nn.functional.one_hot(dest, W + 1)[..., :W].amax(1).sum())  # (token, rank) pairs
            total += (3 * T + N + 3 * n + P) * self.xs[0].shape[1] * self.xs[0].element_size()
        return total

    def results(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every rank's (routed rows with data, tokens_per_expert, y), after a replay."""
        outs = self.graph.run()
        return [(routed[: int(tpe.sum())].clone(), tpe.clone(), y.clone()) for routed, tpe, y in outs]


def plain_scatter(T: int, H: int, K: int, programs: Optional[int], device: torch.device) -> tuple[Callable, int]:
    """A plain scatter of N = T * K bf16 rows (H) to a random permutation of N rows on ``programs``
    persistent programs (None: one per 8 rows), and its bytes: the reference of bandwidth per SM."""
    from benchmarks import scatter_kernel

    N = T * K
    src = torch.randn(N, H, device=device).to(DTYPE)
    out = torch.empty_like(src)
    perm = torch.randperm(N, device=device)
    return (lambda: scatter_kernel.scatter_rows(src, perm, out, programs)), 2 * N * H * src.element_size()


def moe_overlap(budgets: list[tuple[str, Optional[int]]], device: torch.device, time_us) -> list[dict]:
    """MoE layer fwd + bwd (symm_mem, W = 1, shared expert) with shared_expert_overlap 'combine'
    and 'none', per budget: equal results first, then both timed."""
    from alltoall_ops.moe import MoE

    T, H, K, E, F_ = SMOKE_SHAPE if device.type == "cpu" else SHAPE
    rows = []
    for label, num_sms in budgets:
        bufs = SymmBuffers(T, H, K, E, DTYPE, device, num_sms=num_sms)
        x = torch.randn(T, H, device=device, generator=torch.Generator(device=device).manual_seed(3)).to(DTYPE)
        outs, times = [], {}
        for mode in ("combine", "none"):
            torch.manual_seed(0)
            moe = MoE(H, F_ // 2, E, K, shared_ffn_size=F_, shared_expert_overlap=mode, backend="symm_mem",
                      buffers=bufs, device=device, dtype=DTYPE)
            xr = x.clone().requires_grad_()

            def step(moe: MoE = moe, xr: torch.Tensor = xr) -> torch.Tensor:
                y = moe(xr)
                y.float().square().mean().backward()
                return y

            outs.append((step().detach(), xr.grad.clone()))
            xr.grad = None
            times[mode] = time_us(step)
        same = all(torch.equal(a, b) for a, b in zip(*outs))
        rows.append(dict(budget=label, combine_us=times["combine"], none_us=times["none"], equal=same))
        print(f"{label:>14}: MoE fwd+bwd overlap 'combine' {times['combine']:9.1f} us, 'none' {times['none']:9.1f} "
              f"us, ratio {times['combine'] / times['none']:.3f}, equal {same}", flush=True)
    return rows


@contextlib.contextmanager
def matmuls_leave_free(num_sms: Optional[int], cuda: bool):
    """Inside, matmuls leave ``num_sms`` SMs free for a kernel beside them: cuBLASLt (the default
    cuBLAS path ignores the carveout) with ``torch._C._set_sm_carveout_experimental``, torch's
    experimental knob; both restored after. Nothing changes for ``num_sms=None`` or on the CPU."""
    if num_sms is None or not cuda:
        yield
        return
    library, carveout = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(num_sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(carveout)
        torch.backends.cuda.preferred_blas_library(library)


def carved(gemm: Callable[[], object], num_sms: Optional[int], cuda: bool) -> Callable[[], None]:
    """``gemm`` with its matmuls leaving ``num_sms`` SMs free (:func:`matmuls_leave_free`)."""
    def run() -> None:
        with matmuls_leave_free(num_sms, cuda):
            gemm()

    return run


def concurrently(first: Callable[[], object], second: Callable[[], object], cuda: bool) -> Callable[[], None]:
    """One call runs ``first`` and ``second`` on two side streams forked from the current stream
    and joined back into it (so events on the current stream span both); on the CPU, serially."""
    if not cuda:
        def serial() -> None:
            first()
            second()

        return serial
    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def pair() -> None:
        here = torch.cuda.current_stream()
        for s, fn in zip(streams, (first, second)):
            s.wait_stream(here)
            with torch.cuda.stream(s):
                fn()
        for s in streams:
            here.wait_stream(s)

    return pair


def budgets(names: list[str], device: torch.device) -> list[tuple[str, Optional[int]]]:
    """(label, num_sms) of each ``--budgets`` item: a number of SMs, or 'all' (no cap)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    out = []
    for name in names:
        if name == "all":
            out.append((f"all ({sms} SMs)" if sms else "all", None))
        else:
            out.append((name, int(name)))
    return out


def markdown(rows: list[dict], header: str, moe_rows: list[dict]) -> str:
    lines = [f"# symm_mem exchange beside a shared-expert GEMM\n\n{header}\n",
             "| SM budget | exchange (us) | exchange GB/s | plain scatter GB/s | ratio | GEMM (us) | both (us) | "
             "both / max | serial sum (us) | saved by overlap | GEMM, budget left free (us) | "
             "both, GEMM leaving the budget free (us) | that / max | saved by overlap |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        saved = 1 - r["both_us"] / r["serial_us"] if r["serial_us"] else 0.0
        carved_serial = r["exchange_us"] + r["gemm_carved_us"]
        lines.append(f"| {r['budget']} | {r['exchange_us']:.1f} | {r['exchange_gbps']:.0f} | {r['scatter_gbps']:.0f} | "
                     f"{r['exchange_gbps'] / r['scatter_gbps']:.2f} | {r['gemm_us']:.1f} | {r['both_us']:.1f} | "
                     f"{r['both_us'] / max(r['exchange_us'], r['gemm_us']):.2f} | {r['serial_us']:.1f} | {saved:.0%} | "
                     f"{r['gemm_carved_us']:.1f} | {r['both_carved_us']:.1f} | "
                     f"{r['both_carved_us'] / max(r['exchange_us'], r['gemm_carved_us']):.2f} | "
                     f"{1 - r['both_carved_us'] / carved_serial:.0%} |")
    if moe_rows:
        lines += ["", "| SM budget | MoE fwd+bwd, overlap 'combine' (us) | 'none' (us) | combine / none | equal |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['budget']} | {r['combine_us']:.1f} | {r['none_us']:.1f} | "
                  f"{r['combine_us'] / r['none_us']:.3f} | {r['equal']} |" for r in moe_rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (no GPU needed)")
    parser.add_argument("--out", default="results", help="folder for the JSON and markdown")
    parser.add_argument("--world-size", type=int, default=2, help="simulated ranks (default 2)")
    parser.add_argument("--budgets", nargs="+", default=list(BUDGETS), metavar="SMS|all",
                        help=f"SM budgets (default {' '.join(BUDGETS)})")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("benchmarks.overlap: no CUDA device here; nothing to measure. "
              "Run it on a GPU host, or pass --smoke for a tiny CPU run (its times mean nothing).")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cuda = device.type == "cuda"
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    T, H, K, E, F_ = shape
    W = args.world_size
    time_us = timer(device)
    import triton

    cpu = platform.processor() or "cpu"
    name = torch.cuda.get_device_name(device) if cuda else f"CPU smoke ({cpu}; times mean nothing)"
    given = sys.argv[1:] if argv is None else argv
    command = "python -m benchmarks.overlap " + " ".join(shlex.quote(a) for a in given)
    header = (f"{name}; torch {torch.__version__}, triton {triton.__version__}; W = {W} simulated ranks, "
              f"(T, H, K, E) = {(T, H, K, E)}, shared expert F = {F_}, bf16; command: `{command}`")
    print(header, flush=True)
    gemm = shared_expert(T, H, F_, device)
    t0 = time.perf_counter()
    reference, rows, failures = None, [], []
    for label, num_sms in budgets(args.budgets, device):
        exchange = Exchange(W, shape, num_sms, device)
        got = exchange.results()
        if reference is None:
            reference = Exchange(W, shape, None, device).results() if num_sms is not None else got
        for r, (mine, want) in enumerate(zip(got, reference)):
            for what, a, b in zip(("routed", "tokens_per_expert", "y"), mine, want):
                if not torch.equal(a, b):
                    failures.append(f"budget {label}: rank {r}'s {what} differs from the uncapped run's")
        gemm_carved = carved(gemm, num_sms, cuda)
        row = dict(budget=label, num_sms=num_sms, exchange_us=time_us(exchange.replay), gemm_us=time_us(gemm),
                   both_us=time_us(concurrently(exchange.replay, gemm, cuda)), gemm_carved_us=time_us(gemm_carved),
                   both_carved_us=time_us(concurrently(exchange.replay, gemm_carved, cuda)))
        row["serial_us"] = row["exchange_us"] + row["gemm_us"]
        row["exchange_gbps"] = exchange.nbytes() / row["exchange_us"] / 1e3
        scatter, scatter_bytes = plain_scatter(T, H, K, num_sms, device)
        row["scatter_gbps"] = scatter_bytes / time_us(scatter) / 1e3
        rows.append(row)
        print(f"{label:>14}: exchange {row['exchange_us']:9.1f} us ({row['exchange_gbps']:5.0f} GB/s, plain scatter "
              f"{row['scatter_gbps']:5.0f})  gemm {row['gemm_us']:9.1f} us  both {row['both_us']:9.1f} us  "
              f"serial {row['serial_us']:9.1f} us  GEMM, budget left free {row['gemm_carved_us']:9.1f} us  both, GEMM "
              f"leaving the budget free {row['both_carved_us']:9.1f} us",
              flush=True)
        del exchange
    moe_rows = moe_overlap(budgets(args.budgets, device), device, time_us)
    tag = "gpu" if cuda else "smoke"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"overlap_{tag}.json"), "w") as f:
        json.dump({"header": header, "device": name, "command": command, "world_size": W,
                   "shape_THKEF": list(shape), "rows": rows, "moe_rows": moe_rows, "failures": failures}, f, indent=1)
    with open(os.path.join(args.out, f"overlap_{tag}.md"), "w") as f:
        f.write(markdown(rows, header, moe_rows) + "".join(f"\nFAILED {x}\n" for x in failures))
    print(markdown(rows, header, moe_rows))
    for x in failures:
        print(f"FAILED {x}")
    print(f"{'FAILED' if failures else 'OK'}: {len(rows)} budgets in {time.perf_counter() - t0:.0f} s; "
          f"{os.path.join(args.out, f'overlap_{tag}')}.json / .md", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
