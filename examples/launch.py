"""Running an example on every rank: the launcher's ranks under torchrun (NCCL with ``--device
cuda``, else gloo), else with ``args.world_size`` 1 one rank in this process (on any device), else
``args.world_size`` spawned CPU ranks in one gloo group (:class:`alltoall_ops.testing.DistributedPool`).

An example module defines ``run_rank(rank, world_size, args) -> bool`` (True: the rank passed)
and its ``main`` returns ``run_ranks("examples.<name>", args)``, the process exit code."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist


def run_ranks(module: str, args, *, needs_group: bool = True, timeout: float = 300.0) -> int:
    """0 when ``<module>.run_rank`` passed on every rank, 1 when one failed or a rank raised, 2
    for a device that cannot run. needs_group False: one rank runs without a process group.
    ``args`` needs ``device`` and ``world_size``."""
    # NB: by module name, so that spawned ranks import the entry point also under python -m
    run_rank = importlib.import_module(module).run_rank
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device available", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: use the launcher's ranks
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return _run_here(run_rank, args, {})
    if args.world_size == 1:  # one rank, in this process
        return _run_here(run_rank, args, dict(store=dist.HashStore(), rank=0, world_size=1) if needs_group else None)
    if args.device == "cuda":
        print("--device cuda with several ranks: launch with torchrun --nproc-per-node W", file=sys.stderr)
        return 2
    from alltoall_ops.testing import DistributedPool, RankFailures

    with DistributedPool(args.world_size) as pool:
        try:
            results = pool.run(run_rank, args, timeout=timeout)
        except RankFailures as exc:
            print(exc, file=sys.stderr)
            return 1
    return 0 if all(results) else 1


def _run_here(run_rank, args, group: Optional[dict]) -> int:
    """``run_rank`` on this process's rank, in the process group that ``group``'s keyword arguments
    of ``dist.init_process_group`` make (NCCL with ``--device cuda``, else gloo; ``{}``: torchrun's
    environment), or as rank 0 of 1 without one (None). The exit code, as :func:`run_ranks`."""
    if group is None:
        return 0 if run_rank(0, 1, args) else 1
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", **group)
    try:
        ok = run_rank(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1
