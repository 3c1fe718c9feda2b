"""Bytes a symm_mem dispatch writes, over the routed payload's bytes (CPU, issue 38).

    python3 -m tools.bytes_written                  # H = 1024 and 7168, W = 1, 2, 4, K = 6, 8, bf16, fp8
    python3 -m tools.bytes_written --hidden 7168    # the benchmarks' H only

Every rank's dispatch of T = 32 tokens of H channels, E = 16, random top-K routing, on simulated
peers in one process (the kernels in Triton's interpreter): every kernel's masked-in stores and
every torch op's outputs (``alltoall_ops.testing.bytes_written``), over the payload: each valid
slot's row once (bf16 rows; fp8: its wire row, values and scales). One write per row is 1.0x;
the pull design writes each routed row once and, with peers, each token's row once more into
its sender's stage: 1 + 1/K plus the tags and plan (24 + 8 bytes a row, and the CPU plan's
torch ops, which are kernels on a GPU), which weigh 7x less against rows of H = 7168 than of
H = 1024.
"""

from __future__ import annotations

import argparse
import collections
import itertools

import torch

import alltoall_ops as a2a
from alltoall_ops import fp8, testing
from alltoall_ops.backends.symm_mem import run_simulated

T, H, E = 32, 1024, 16


def dispatch_bytes(W: int, K: int, payload_dtype=None, seed: int = 0, hidden: int = H,
                   ) -> tuple[collections.Counter, int]:
    """(bytes written by name, payload bytes) of one dispatch on every one of W simulated ranks,
    rows of ``hidden`` channels."""
    g = torch.Generator().manual_seed(seed)
    bufs = a2a.SymmBuffers.simulated(W, T, hidden, K, E, dtype=torch.bfloat16, device="cpu",
                                     payload_dtype=payload_dtype)
    xs = [torch.randn(T, hidden, generator=g).bfloat16() for _ in range(W)]
    idx = [torch.rand(T, E, generator=g).topk(K, dim=1).indices for _ in range(W)]
    kwargs = {} if payload_dtype is None else {"payload_dtype": payload_dtype}

    def dispatch(rank, b):
        return a2a.dispatch(xs[rank], idx[rank], num_experts=E, buffers=b, **kwargs)

    run_simulated(dispatch, bufs)  # first calls: the cached kernels and plans are not the dispatch's work
    with testing.bytes_written() as written:
        def counted(rank, b):
            with testing.TorchOpBytes(written):
                return dispatch(rank, b)
        run_simulated(counted, bufs)
    row_bytes = hidden * 2 if payload_dtype is None else fp8.packed_width(hidden)
    return written, sum(int((i >= 0).sum()) for i in idx) * row_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[H, 7168], help="H of the rows")
    args = parser.parse_args()
    print("| H | W | K | payload | written / payload | largest writers |")
    print("|---|---|---|---|---|---|")
    for hidden, payload_dtype, K, W in itertools.product(args.hidden, (None, torch.float8_e4m3fn), (6, 8), (1, 2, 4)):
        written, payload = dispatch_bytes(W, K, payload_dtype, hidden=hidden)
        top = ", ".join(f"{name} {n / payload:.3f}" for name, n in written.most_common(3))
        name = "bf16" if payload_dtype is None else "fp8"
        print(f"| {hidden} | {W} | {K} | {name} | {sum(written.values()) / payload:.3f} | {top} |", flush=True)


if __name__ == "__main__":
    main()
