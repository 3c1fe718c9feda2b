"""Where a whole MoE layer's device time goes: each layer of ``benchmarks/moe_layer.py`` (plain,
local, symm) compiled without CUDA graphs (the kernels a graph would replay), forward + backward,
torch.profiler device time per step by kernel, and its split into GEMM kernels and the rest.

    PYTHONPATH=. python3 tools/moe_profile.py [train|train16k|decode]    # one GPU; default train

The GEMM kernels are those whose name says so (``gemm``, CUTLASS, cuBLAS's ``nvjet``): the
experts' grouped GEMMs and the router's, the same in every layer."""

from __future__ import annotations

import argparse

import torch

import alltoall_ops as a2a
from alltoall_ops.groups import NO_GROUP
from alltoall_ops.moe import MoE
from benchmarks._rounds import kernel_times
from benchmarks.moe_layer import MOE_SHAPES, plain_forward

STEPS = 5
GEMM_MARKS = ("gemm", "cutlass", "nvjet")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", default="train", choices=list(MOE_SHAPES))
    T, H, F, E, K = MOE_SHAPES[parser.parse_args(argv).shape]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    local = MoE(H, F, E, K, backend="local", group=NO_GROUP, device=dev, dtype=dtype)
    bufs = a2a.SymmBuffers(T, H, K, E, dtype=dtype, device=dev, group=NO_GROUP)
    symm = MoE(H, F, E, K, backend="symm_mem", buffers=bufs, group=NO_GROUP, device=dev, dtype=dtype)
    symm.load_state_dict(local.state_dict())
    x = torch.randn(T, H, device=dev, dtype=dtype)
    grad_y = torch.randn(T, H, device=dev, dtype=dtype)
    layers = {"plain": (local, lambda x_: plain_forward(local, x_)), "local": (local, local), "symm": (symm, symm)}
    for name, (module, forward) in layers.items():
        compiled = torch.compile(forward, fullgraph=True)
        xin = x.clone().requires_grad_(True)

        def step(module=module, compiled=compiled, xin=xin) -> None:
            module.zero_grad(set_to_none=True)
            xin.grad = None
            compiled(xin).backward(grad_y)

        for _ in range(2):
            step()  # compiles (forward and backward)
        kernels = {name: (n * us, n) for name, n, us in kernel_times(step, STEPS)}  # name -> (us a step, launches)
        total = sum(us for us, _ in kernels.values())
        gemm = sum(us for k, (us, _) in kernels.items() if any(m in k.lower() for m in GEMM_MARKS))
        launches = sum(n for _, n in kernels.values())
        print(f"== {name}, T = {T}: fwd+bwd device time {total:.1f} us a step: GEMM kernels {gemm:.1f} us, "
              f"the rest {total - gemm:.1f} us; {launches:.0f} kernels")
        for k, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:22]:
            print(f"   {us:8.1f} us  x{n:.0f}  {k[:110]}")


if __name__ == "__main__":
    main()
