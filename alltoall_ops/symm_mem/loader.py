"""Loading the Triton kernels (Triton is optional), deciding which tensors use them, and setting
``TRITON_INTERPRET=1`` without CUDA before anything imports triton."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

if not torch.cuda.is_available():
    # NB: without CUDA the kernels run in Triton's interpreter. Triton decides at decoration
    # time, its own library (tl.cdiv, tl.sum) included, so this must be set before anything
    # imports triton: here, when alltoall_ops is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

_KERNELS = None


def kernels():
    """The Triton kernels, imported on first use (Triton is an optional dependency)."""
    global _KERNELS
    if _KERNELS is None:
        try:
            import triton
        except ImportError as exc:
            raise ImportError(
                "backend='symm_mem' needs Triton: pip install 'alltoall_ops[triton]'"
            ) from exc
        from .. import kernels as module

        if module.interpreting() and not _interpreted(triton.language.cdiv):
            raise RuntimeError(
                "backend='symm_mem' runs its kernels in Triton's interpreter here (no CUDA), but triton "
                "was imported before TRITON_INTERPRET=1 was set; set it in the environment, or import "
                "alltoall_ops before anything imports triton"
            )
        _KERNELS = module
    return _KERNELS


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_kernels(t: torch.Tensor) -> bool:
    """Whether work on ``t`` goes through this package's Triton kernels: CUDA tensors when Triton
    imports (checked once per process); CPU tensors take plain torch ops (the symm_mem backend
    aside, whose CPU path is the kernels in Triton's interpreter)."""
    return t.is_cuda and _triton_importable()


def _interpreted(fn: Any) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fn, InterpretedFunction)


def _check_kernels_run_on(device: torch.device) -> None:
    k = kernels()
    if device.type == "cpu" and not k.interpreting():
        raise RuntimeError(
            "SymmBuffers on the CPU run the kernels in Triton's interpreter, but they were loaded "
            "compiled; set TRITON_INTERPRET=1 before alltoall_ops' kernels are imported"
        )
    if device.type == "cuda" and k.interpreting():
        raise RuntimeError(
            "SymmBuffers on CUDA need compiled Triton kernels, but TRITON_INTERPRET=1 was set when "
            "they were imported; unset it"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected a cpu or cuda device, got {device}")
