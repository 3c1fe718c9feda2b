"""The symm_mem exchange under every SM budget on a CUDA GPU (issue 28): simulated W = 2, 4, 8
ranks on one device, budgets 1 ... 132 and none, four routings (random with dropped slots, skewed
to one expert, a rank that sends nothing, capacity overflow with overflow='drop'), plain bf16 and
fp8 payloads, eager and replayed from a CUDA graph. Every output (routed rows below
tokens_per_expert.sum(), tokens_per_expert, y, the unweighted y, grad_x, grad_w; fp8: values,
scales) equals the uncapped eager run bit for bit, and the uncapped run equals the collective
backend on gloo CPU ranks (``tools/gpu_symm_check.compare``: rows exact, y within the FMA bound)
or, for fp8, the local backend's fp8 dispatch of all ranks' tokens. The race it pins: the
copy-out's read and reset of each row's tag without a barrier (wrong rows under small grids).
The CPU suite's counterpart is tests/test_kernel_races.py."""

from __future__ import annotations

import pytest
import torch

import alltoall_ops as a2a
from alltoall_ops import fp8
from alltoall_ops.backends.symm_mem import run_simulated
from alltoall_ops.testing import DistributedPool
from tools import gpu_symm_check as symm

pytestmark = pytest.mark.gpu

BUDGETS = [1, 2, 3, 8, 16, 24, 32, 64, 132, None]
ROUTINGS = ["random", "skewed", "silent_rank", "drop"]


def _spec(routing: str, W: int) -> dict:
    spec = symm._spec(7, T=64, H=256, K=4, E=16, A=2)
    if routing == "skewed":
        spec["crowd"] = 0  # every valid slot to expert 0 (ids clamped)
    return spec


def _inputs(spec: dict, routing: str, rank: int):
    x, topk_idx, weights, grad_y = symm.make_inputs(spec, rank)
    if routing == "silent_rank" and rank == 1:
        topk_idx = torch.full_like(topk_idx, -1)
    return x, topk_idx, weights, grad_y


def _rank_outputs(rank: int, bufs: a2a.SymmBuffers, inputs: tuple, payload: str) -> list[torch.Tensor]:
    """One rank's outputs (no host read: also captured in a CUDA graph)."""
    if payload == "fp8":
        out = symm.fp8_rank(rank, bufs, inputs)
        return [out["values"].view(torch.uint8), out["scales"], out["tpe"]]
    out = symm.symm_rank(rank, bufs, inputs)
    return [out[k] for k in ("routed", "tpe", "y", "y1", "grad_x", "grad_w", "dropped")]


def _valid(outs: list[torch.Tensor], payload: str) -> list[torch.Tensor]:
    """The outputs with routed rows cut at tokens_per_expert.sum() (the rest is unspecified)."""
    tpe = outs[2] if payload == "fp8" else outs[1]
    n = int(tpe.sum())
    return [t[:n].clone() if i in ((0, 1) if payload == "fp8" else (0,)) else t.clone() for i, t in enumerate(outs)]


def _run(W: int, spec: dict, routing: str, payload: str, num_sms, graph: bool) -> list[list[torch.Tensor]]:
    extra = dict(payload_dtype=fp8.FP8) if payload == "fp8" else {}
    if routing == "drop":
        extra.update(capacity=48, overflow="drop")
    bufs = symm.simulated_buffers(W, spec, num_sms=num_sms, **extra)
    inputs = [symm.on_device(_inputs(spec, routing, r)) for r in range(W)]

    def step(r, b):
        return _rank_outputs(r, b, inputs[r], payload)

    if not graph:
        outs = run_simulated(step, bufs)
    else:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        run_simulated(step, bufs, stream=stream)  # warm-up
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream, capture_error_mode="relaxed"):
            outs = run_simulated(step, bufs, stream=stream)
        g.replay()
    symm._sync()
    return [_valid(o, payload) for o in outs]


def _reference(W: int, spec: dict, routing: str, payload: str):
    if payload == "fp8":
        refs = symm.fp8_reference(spec, W, [_inputs(spec, routing, r) for r in range(W)])
        return [[values.view(torch.uint8), scales, tpe] for values, scales, tpe in refs]
    masked = [[] for _ in range(W)]
    if routing == "silent_rank":  # every slot of rank 1 routed nowhere, as _inputs does
        T, K = symm.make_inputs(spec, 1)[1].shape
        masked[1] = [(t, k) for t in range(T) for k in range(K)]
    with DistributedPool(W) as pool:
        return pool.run(symm.collective_reference, spec, masked)


@pytest.mark.parametrize("payload", ["plain", "fp8"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("W", [2, 4, 8])
def test_every_budget_equals_the_uncapped_run(W, routing, payload):
    spec = _spec(routing, W)
    want = _run(W, spec, routing, payload, None, graph=False)
    if routing != "drop":  # the dropped slots' reference: tests/test_symm_mem_gpu.py::test_overflow_drop
        refs = _reference(W, spec, routing, payload)
        for r, (got, ref) in enumerate(zip(want, refs)):
            if payload == "fp8":
                for a, b, what in zip(got, ref, ("values", "scales", "tokens_per_expert")):
                    assert torch.equal(a.cpu(), b), f"rank {r}: fp8 {what} differ from the local reference"
            else:  # rows exact, y within the FMA bound
                names = ("routed", "tpe", "y", "y1", "grad_x", "grad_w")
                symm.compare(dict(zip(names, got)), ref, int(ref["tpe"].sum()))
    failures = []
    for num_sms in BUDGETS:
        for graph in (False, True):
            got = _run(W, spec, routing, payload, num_sms, graph)
            for r, (g_r, w_r) in enumerate(zip(got, want)):
                for i, (a, b) in enumerate(zip(g_r, w_r)):
                    if not torch.equal(a, b):
                        failures.append(f"num_sms={num_sms} {'graph' if graph else 'eager'} rank {r} output {i}")
    assert not failures, failures

