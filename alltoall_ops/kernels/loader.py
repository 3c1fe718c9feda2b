"""Loading the Triton kernels (Triton is optional), deciding which tensors use them, and Triton's
interpreter on machines without CUDA.

Why the interpreter is a process-wide setting: Triton decides at decoration time whether a
``triton.jit`` function is compiled or interpreted, for its own library too (``tl.sum``,
``tl.cdiv`` are jit functions decorated when ``triton`` is imported), an interpreted kernel
cannot call a compiled one, and modules Triton imports later assert the mode; its knob writes
through to ``os.environ``. So the library's kernels cannot be interpreted alone. On a machine
without CUDA (where no compiled Triton kernel can run anyway) importing alltoall_ops sets
``TRITON_INTERPRET=1`` before anything imports triton, logs it (logger ``alltoall_ops``), and
leaves an explicit ``TRITON_INTERPRET`` (``0`` opts out: the CPU kernels, and so the CPU
symm_mem backend, are then unavailable) alone. With CUDA nothing is set.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from types import ModuleType

import torch

logger = logging.getLogger(__name__)


def _enable_interpreter_without_cuda() -> None:
    if torch.cuda.is_available() or "TRITON_INTERPRET" in os.environ:
        return
    if "triton" in sys.modules:  # too late: load() explains it if a CPU kernel is needed
        return
    os.environ["TRITON_INTERPRET"] = "1"
    logger.info("no CUDA: set TRITON_INTERPRET=1 for this process, so that alltoall_ops' Triton kernels "
                "run on CPU tensors in Triton's interpreter (set TRITON_INTERPRET=0 to opt out)")


_enable_interpreter_without_cuda()


@functools.cache
def load() -> ModuleType:
    """The kernel launchers (:mod:`alltoall_ops.kernels.launchers`), imported on first use."""
    try:
        import triton
    except ImportError as exc:
        raise ImportError("backend='symm_mem' needs Triton: pip install 'alltoall_ops[triton]'") from exc
    from . import launchers

    if launchers.interpreting() and not _interpreted(triton.language.cdiv):
        raise RuntimeError(
            "alltoall_ops' kernels run in Triton's interpreter here (no CUDA), but triton was imported "
            "before TRITON_INTERPRET=1 was set; set it in the environment, or import alltoall_ops before "
            "anything imports triton"
        )
    if launchers.interpreting():
        _interpreter_reduces_xor_in_numpy()
    logger.info("Triton kernels loaded (%s)", "interpreted" if launchers.interpreting() else "compiled")
    return launchers


def _interpreter_reduces_xor_in_numpy() -> None:
    """Give Triton's interpreter numpy's xor reduction, where it reduces element by element in
    Python: ``tl.sort`` (the one-program routing plan, up to 1024 keys) swaps by an xor
    reduction at each of its log2(N) (log2(N) + 1) / 2 stages, and a sort of 1024 keys took 2-6 s
    on a CPU core instead of 0.1-0.2. The result is the same integer, bit for bit
    (``tests/test_package.py`` pins it against the interpreter's own path). Left alone where
    the interpreter's internals differ from Triton 3.6-3.9's."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import ReduceOps
        xor, python_reduce = tl.standard._xor_combine, ReduceOps.apply_impl
    except (ImportError, AttributeError):
        return
    if hasattr(python_reduce, "python_reduce"):
        return

    def apply_impl(self, input):
        if self.combine_fn is xor and len(input) == 1:
            data = input[0].handle.data
            return self.to_tensor(np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims), input[0].dtype)
        return python_reduce(self, input)

    apply_impl.python_reduce = python_reduce
    ReduceOps.apply_impl = apply_impl


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_kernels(t: torch.Tensor) -> bool:
    """Whether work on ``t`` goes through the Triton kernels: CUDA tensors when Triton imports
    (checked once per process). CPU tensors take plain torch ops (the symm_mem backend aside,
    whose CPU path is the kernels in Triton's interpreter)."""
    return t.is_cuda and _triton_importable()


def _interpreted(fn) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fn, InterpretedFunction)


def check_kernels_run_on(device: torch.device) -> None:
    """Raise if the loaded kernels cannot run on ``device`` (compiled vs interpreted)."""
    k = load()
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
