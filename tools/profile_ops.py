"""Where the time of one dispatch / combine goes on one GPU: torch.profiler tables (top kernels
and host-side ops) for the local and symm_mem backends.

    python tools/profile_ops.py [T ...]      # default T = 4096; 128 is the decode shape; (H, K, E) = (7168, 8, 256)
    python tools/profile_ops.py --world-size 2 --num-sms 16 --shape 2048 6 64 4096
                                             # symm_mem on W simulated peers under an SM budget
                                             # (benchmarks/overlap.py's shape): every rank's step
    python tools/profile_ops.py --world-size 2 --payload fp8.dequantize
                                             # fp8 on the wire (fp8: the dispatch alone)

With ``--world-size`` above 1 only symm_mem runs (every rank's dispatch + combine, eager, one
thread per simulated rank), and the table is of all ranks' kernels.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import alltoall_ops as a2a
from alltoall_ops.backends.symm_mem import run_simulated


def cases(T: int, H: int, K: int, E: int, world_size: int, num_sms: int | None, payload: str = "bf16") -> dict:
    """name -> one step (dispatch + combine) of every rank; with peers and ``payload`` fp8, the
    dispatch alone with fp8 rows out, or (``fp8.dequantize``) fp8 on the wire, bf16 rows out,
    and the combine of those."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn(T, H, device=dev, generator=g).bfloat16() for _ in range(world_size)]
    routes = [torch.randn(T, E, device=dev, generator=g).softmax(-1).topk(K, dim=-1) for _ in range(world_size)]
    if world_size == 1:
        (x,), ((weights, topk_idx),) = xs, routes
        bufs = a2a.SymmBuffers(T, H, K, E, dtype=torch.bfloat16, device=dev, num_sms=num_sms)
        return {
            "local": lambda: a2a.combine(*a2a.dispatch(x, topk_idx, num_experts=E, backend="local")[::2], weights),
            "symm_mem": lambda: a2a.combine(*a2a.dispatch(x, topk_idx, num_experts=E, buffers=bufs)[::2], weights),
        }
    fp8 = {} if payload == "bf16" else dict(payload_dtype=torch.float8_e4m3fn)
    buffers = a2a.SymmBuffers.simulated(world_size, T, H, K, E, dtype=torch.bfloat16, device=dev, num_sms=num_sms,
                                        **fp8)

    def rank_step(rank: int, bufs: a2a.SymmBuffers):
        weights, topk_idx = routes[rank]
        routed, _, handle = a2a.dispatch(xs[rank], topk_idx, num_experts=E, buffers=bufs, **fp8,
                                         **({"dequantize": True} if payload == "fp8.dequantize" else {}))
        return routed if payload == "fp8" else a2a.combine(routed, handle, weights)

    return {f"symm_mem, W = {world_size} simulated, {payload}": lambda: run_simulated(rank_step, buffers)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", type=int, nargs="*", default=[4096])
    parser.add_argument("--shape", type=int, nargs=3, default=(7168, 8, 256), metavar=("H", "K", "E"))
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--num-sms", type=int, default=None, help="the buffers' SM budget (default none)")
    parser.add_argument("--payload", choices=["bf16", "fp8", "fp8.dequantize"], default="bf16",
                        help="with --world-size > 1: fp8 (the dispatch alone) or fp8.dequantize (bf16 out, and "
                        "the combine)")
    args = parser.parse_args(argv)
    H, K, E = args.shape
    budget = "" if args.num_sms is None else f", {args.num_sms} SMs"
    for T in args.tokens:
        for name, step in cases(T, H, K, E, args.world_size, args.num_sms, args.payload).items():
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            cuda = torch.autograd.DeviceType.CUDA
            kernels = sum(e.count for e in prof.key_averages() if getattr(e, "device_type", None) == cuda)
            ops = "dispatch" if args.payload == "fp8" else "dispatch + combine"
            print(f"===== {name}{budget}, T = {T}, (H, K, E) = {(H, K, E)}: {ops}, 5 steps, "
                  f"{kernels / 5:.0f} GPU activities per step")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
