"""ulysses_attention against DeepSpeed's own Ulysses, ``deepspeed.sequence.layer.DistributedAttention``,
on real gloo ranks: same sequence shards in, same local attention (causal fp64 sdpa) on both sides;
forward output and the gradients of q, k and v must agree (fp64, tight tolerances). Heads split
evenly and unevenly (W not dividing them: DeepSpeed gives the first Hh % W ranks one head more, as
``head_counts`` does), in both layouts (DeepSpeed's ``batch_dim_idx`` 0 and 1).

deepspeed is imported only inside the rank functions (the spawned worker processes), never in the
pytest process itself: importing it sets up its accelerator and logging there."""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import alltoall_ops as a2a

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install -e '.[deepspeed]')",
)

B, D = 2, 4


def _full(seed: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _causal_attention(layout: str):
    """The local attention both sides run: causal fp64 sdpa on the (B, H, S, D) permutation of
    tensors in ``layout`` (full sequence, this rank's heads); the output in ``layout``."""
    to_bhsd = (1, 2, 0, 3) if layout == "sbhd" else (0, 2, 1, 3)  # (S, B, H, D) / (B, S, H, D) -> (B, H, S, D)
    back = (2, 0, 1, 3) if layout == "sbhd" else (0, 2, 1, 3)

    def attention(q, k, v):
        out = F.scaled_dot_product_attention(*(t.permute(to_bhsd) for t in (q, k, v)), is_causal=True)
        return out.permute(back)

    return attention


class _SequenceParallelMpu:
    """The sequence-parallel group as DeepSpeed's ``groups`` module asks for it: its uneven-heads
    path reads this rank's position from ``groups.mpu`` (without one it assumes rank 0)."""

    def __init__(self, group):
        self.group = group

    def get_sequence_parallel_group(self):
        return self.group

    def get_sequence_parallel_world_size(self):
        return dist.get_world_size(self.group)

    def get_sequence_parallel_rank(self):
        return dist.get_rank(self.group)


def init_deepspeed() -> None:
    """``deepspeed.comm`` on the process group this rank already has (workers only: see the module
    docstring)."""
    import deepspeed.comm as ds_dist

    if ds_dist.is_initialized():
        return
    # (deepspeed.comm.torch the module: the attribute of deepspeed.comm by that name is torch)
    ds_torch_backend = importlib.import_module("deepspeed.comm.torch")
    # On CPU, DeepSpeed's backend JIT-compiles a shared-memory all-reduce kernel (C++, ~1 min,
    # needs a compiler) that no all-to-all uses: skip that build, keep everything else.
    build_shm_op, ds_torch_backend.build_shm_op = ds_torch_backend.build_shm_op, lambda: None
    try:
        ds_dist.init_distributed(dist_backend="gloo")  # wraps the process group the pool set up
    finally:
        ds_torch_backend.build_shm_op = build_shm_op


@contextlib.contextmanager
def sequence_parallel(group) -> Iterator[None]:
    """DeepSpeed's ``groups.mpu`` set to ``group`` inside the block (its uneven-heads path reads
    this rank's position from it)."""
    from deepspeed.utils import groups

    saved_mpu, groups.mpu = groups.mpu, _SequenceParallelMpu(group)
    try:
        yield
    finally:
        groups.mpu = saved_mpu


def run_against_deepspeed(rank, world_size, heads, layout, seed):
    """Rank ``rank``'s sequence chunk of q, k, v (heads each; built in full from ``seed`` on every
    rank) through DeepSpeed's DistributedAttention and through ulysses_attention: forward output
    and gradients of q, k, v compared. Returns the output shape."""
    from deepspeed.sequence.layer import DistributedAttention

    init_deepspeed()
    group = dist.group.WORLD
    W, S = world_size, 2 * world_size
    seq_dim, batch_dim_idx = (0, 1) if layout == "sbhd" else (1, 0)
    to_layout = (lambda t: t.transpose(0, 1)) if layout == "sbhd" else (lambda t: t)
    q, k, v, upstream = (to_layout(_full(seed + i, (B, S, heads, D))) for i in range(4))

    def shard(t):
        return t.chunk(W, dim=seq_dim)[rank]

    attention = _causal_attention(layout)
    # DeepSpeed's Ulysses: scatter the heads (dim 2), gather the sequence (dim 0 or 1).
    ds_attention = DistributedAttention(attention, group, scatter_idx=2, gather_idx=seq_dim)
    ds_in = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    with sequence_parallel(group):
        ds_out = ds_attention(*ds_in, batch_dim_idx)
        ds_grads = torch.autograd.grad(ds_out, ds_in, shard(upstream))

    ours_in = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    out = a2a.ulysses_attention(*ours_in, group=group, layout=layout, attn_fn=attention)
    grads = torch.autograd.grad(out, ours_in, shard(upstream))

    assert out.shape == ds_out.shape == shard(q).shape, (out.shape, ds_out.shape)
    torch.testing.assert_close(out, ds_out, rtol=1e-10, atol=1e-10, msg="forward")
    for name, got, want in zip("qkv", grads, ds_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"grad {name}")
    # Not a vacuous agreement: the result is causal attention over the whole gathered sequence.
    full = [t.detach() for t in (q, k, v)]
    torch.testing.assert_close(out.detach(), shard(attention(*full)), rtol=1e-12, atol=1e-12)
    return tuple(out.shape)


# Heads per group size: divisible by W, and not (DeepSpeed's uneven split; it needs Hh >= W).
HEADS = {2: [4, 2, 3, 5], 4: [8, 4, 6, 5]}


@pytest.mark.parametrize("pool", [2, 4], indirect=True)
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_ulysses_attention_matches_deepspeed_distributed_attention(pool, layout):
    W = pool.world_size
    for heads in HEADS[W]:
        shapes = pool.run(run_against_deepspeed, heads, layout, 11 * heads + W)
        expected = (B, 2, heads, D) if layout == "bshd" else (2, B, heads, D)
        assert shapes == [expected] * W, heads
