"""Where a whole MoE layer's device time goes: each layer of ``benchmarks/moe_layer.py`` (plain,
local, symm) compiled without CUDA graphs (the kernels a graph would replay), forward + backward,
torch.profiler device time per step by kernel, and its split into GEMM kernels and the rest.

    PYTHONPATH=. python3 tools/moe_profile.py [train|train16k|decode]    # one GPU; default train

The GEMM kernels are those whose name says so (``gemm``, CUTLASS, cuBLAS's ``nvjet``): the
experts' grouped GEMMs and the router's, the same in every layer."""

from __future__ import annotations

import argparse

import torch

from benchmarks._rounds import kernel_times
from benchmarks.moe_layer import MOE_SHAPES, build_layers

STEPS = 5
GEMM_MARKS = ("gemm", "cutlass", "nvjet")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", default="train", choices=list(MOE_SHAPES))
    shape = MOE_SHAPES[parser.parse_args(argv).shape]
    T, H = shape[:2]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    layers = build_layers(shape, dev, dtype, ("plain", "local", "symm"))
    x = torch.randn(T, H, device=dev, dtype=dtype)
    grad_y = torch.randn(T, H, device=dev, dtype=dtype)
    for name, (module, forward) in layers.items():
        compiled = torch.compile(forward, fullgraph=True)
        xin = x.clone().requires_grad_(True)

        def step(module=module, compiled=compiled, xin=xin) -> None:
            module.zero_grad(set_to_none=True)
            xin.grad = None
            compiled(xin).backward(grad_y)

        for _ in range(2):
            step()  # compiles (forward and backward)
        kernels = {kernel: (n * us, n) for kernel, n, us in kernel_times(step, STEPS)}  # -> (us a step, launches)
        total = sum(us for us, _ in kernels.values())
        gemm = sum(us for k, (us, _) in kernels.items() if any(m in k.lower() for m in GEMM_MARKS))
        launches = sum(n for _, n in kernels.values())
        print(f"== {name}, T = {T}: fwd+bwd device time {total:.1f} us a step: GEMM kernels {gemm:.1f} us, "
              f"the rest {total - gemm:.1f} us; {launches:.0f} kernels")
        for k, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:22]:
            print(f"   {us:8.1f} us  x{n:.0f}  {k[:110]}")


if __name__ == "__main__":
    main()
