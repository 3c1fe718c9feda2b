"""Many layers on one :class:`alltoall_ops.SymmBuffers` (issue 31, case 5): a stack of 12
:class:`alltoall_ops.moe.MoE` blocks sharing one set of buffers, each block compiled on its own
(``fullgraph=True``, as torchtitan compiles per block), compiles once for all of them: the
buffers are the graph's one constant, guarded on identity, and the same object in every block.
One set each would be one compilation per block, and dynamo stops at its recompile limit (8).
Results and gradients equal the eager stack's, forward and backward, over steps with fresh
routings, on 2 gloo ranks. (transformers' ``"alltoall_ops_symm_mem"`` shares its buffers
the same way: tests/test_transformers.py::test_symm_mem.)"""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounterWithBackend

import alltoall_ops as a2a
from alltoall_ops.moe import MoE

LAYERS, T, H, F, E, K, FS = 12, 4, 8, 4, 4, 2, 6
STEPS = 2


def _stack(layers, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = x + layer(x)
    return x


def compiled_stack_vs_eager(rank: int, world_size: int) -> int:
    """The stack compiled per block against eager, each step's output and every gradient; the
    number of compilations."""
    buffers = a2a.SymmBuffers(T, H, K, E, dtype=torch.float64, device="cpu")
    torch.manual_seed(0)  # the same router and shared experts on every rank
    blocks = [MoE(H, F, E, K, shared_ffn_size=FS, backend="symm_mem", buffers=buffers, dtype=torch.float64)
              for _ in range(LAYERS)]
    params = [p for b in blocks for p in b.parameters()]
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = [torch.compile(b, backend=counter, fullgraph=True) for b in blocks]
    for step in range(STEPS):
        torch.manual_seed(100 * step + rank)  # fresh tokens: a new routing
        x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
        results = []
        for layers in (blocks, compiled):
            y = _stack(layers, x)
            results.append((y, *torch.autograd.grad(y.square().sum(), [x, *params])))
        for want, got in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    return counter.frame_count


def test_blocks_sharing_buffers_compile_once(pool2):
    assert pool2.run(compiled_stack_vs_eager, timeout=300) == [1, 1]
