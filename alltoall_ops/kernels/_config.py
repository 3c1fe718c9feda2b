"""Launch configuration shared by the kernels: blocks, the SM budget's grid, the launch lock, casts."""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Optional

import torch
import triton
import triton.language as tl

from ..validation import positive_int

try:  # read once: triton.jit reads it at decoration
    _INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # Triton without knobs
    _INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when this package's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when
    they were imported): on CPU tensors, one program after another."""
    return _INTERPRETED


def require_contiguous(launcher: str, **outputs: Optional[torch.Tensor]) -> None:
    """Raise ``ValueError`` for each given tensor that a kernel would write as if contiguous."""
    for name, t in outputs.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(
                f"{launcher}: {name} must be contiguous (the kernel writes it in place), got shape "
                f"{tuple(t.shape)} with strides {t.stride()}"
            )


def launch(kernel, like: torch.Tensor):
    """``kernel`` (a ``triton.jit`` function) as a launcher for tensors like ``like``: itself in
    the interpreter; ``torch.library.wrap_triton(kernel)`` while an inlined op's body is traced
    (``_compat.custom_op(inline=True)``: functional or fake tensors), so that the launch becomes a
    node of the graph that inductor compiles; for plain GPU tensors (eager code, an opaque op's
    body at run time) its :class:`CachedLaunch`."""
    if _INTERPRETED:
        return kernel
    if type(like) is torch.Tensor:
        return _CACHED.get(kernel) or _CACHED.setdefault(kernel, CachedLaunch(kernel))
    return torch.library.wrap_triton(kernel)


class CachedLaunch:
    """``kernel[grid](*args, **meta)`` with the compiled kernel kept per specialization.

    Triton's launcher binds the arguments, specializes them and hashes a cache key on every call
    (~30 us of Python on the H200 host, docs/benchmarks.md); here a call builds a key from what
    Triton specializes on (each tensor's dtype and 16-byte alignment; each int's ``== 1``,
    ``% 16 == 0`` and width; every other value itself, with the options), and a key seen before
    launches its compiled kernel directly. The key is at least as fine as Triton's, so a kernel
    is only reused where Triton would reuse it. A new key, or a launch hook (a profiler's), goes
    through ``kernel[grid]`` and keeps what it compiled. Parameters after the positional
    arguments come by keyword (or take their defaults), as in ``kernel[grid]``."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.params = kernel.params
        self.names = {p.name for p in kernel.params}
        self.compiled: dict[tuple, object] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **meta: self.run(grid, args, meta)

    def run(self, grid: tuple[int, ...], args: tuple, meta: dict) -> None:
        values = args + tuple(meta.get(p.name, p.default) for p in self.params[len(args):])
        options = tuple(sorted((k, v) for k, v in meta.items() if k not in self.names))
        device, stream = device_and_stream()
        key = (device, options, tuple(_specialization(v, p.is_constexpr) for v, p in zip(values, self.params)))
        compiled = self.compiled.get(key)
        if compiled is None or _launch_hooked():
            self.compiled[key] = self.kernel[grid](*args, **meta)
            return
        grid = tuple(grid) + (1, 1)
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *values)


def _launch_hooked() -> bool:
    """Whether a launch hook is set (a profiler's: Triton 3.6 holds one function or None, later
    versions a chain of them)."""
    hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    return any(getattr(hook, "calls", hook) for hook in hooks)


def device_and_stream() -> tuple[int, int]:
    """The current CUDA device and its current (raw) stream, as Triton's launcher reads them."""
    device = triton.runtime.driver.active.get_current_device()
    return device, triton.runtime.driver.active.get_current_stream(device)


def _specialization(value, constexpr: bool) -> object:
    """What Triton's launcher specializes a kernel on for one argument (or a finer description):
    a constexpr's value; a tensor's dtype and alignment; an int's ``== 1``, ``% 16`` and width;
    a float's type (Triton passes it as fp32 whatever its value)."""
    if constexpr:
        return value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if type(value) is int:
        return int, value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value >= 2**63
    if type(value) is float:
        return float
    return type(value), value


_CACHED: dict[object, CachedLaunch] = {}


LAUNCH_LOCK = threading.RLock()
"""Held by every launcher: Triton's interpreter patches ``triton.language`` for the duration of a
launch, so launches from several threads (simulated ranks) must not overlap."""


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """Rows per program (``BLOCK_R``), columns per program or per inner step (``BLOCK_H``), warps."""

    BLOCK_R: int
    BLOCK_H: int
    num_warps: int

    def grid(self, n_rows: int, H: int) -> tuple[int, int]:
        """Programs over (row blocks, column blocks): each program owns a [BLOCK_R, BLOCK_H] tile."""
        return triton.cdiv(max(n_rows, 0), self.BLOCK_R), triton.cdiv(max(H, 1), self.BLOCK_H)


def program_grid(row_programs: int, col_programs: int = 1, max_programs: Optional[int] = None) -> tuple[int, int]:
    """The launch grid (row programs, column programs) under a budget of ``max_programs``.

    None: the grid as given (one program per tile, unless put_rows' count bounds it). A number:
    at most that many programs in all, rows first: ``min(rows, max_programs)`` row programs and
    as many column programs as the rest allows (at least one); every capped kernel strides over
    both (program (i, j) does row blocks i, i + P, ... and in each column blocks j, j + Q, ...),
    so the results do not depend on the grid. An SM budget: a program is one SM's worth of work
    at a time (docs/symm_mem.md)."""
    if max_programs is None:
        return row_programs, col_programs
    max_programs = positive_int("max_programs", max_programs)
    rows = min(row_programs, max_programs)
    return rows, min(col_programs, max(1, max_programs // max(rows, 1)))


GPU_BLOCKS: dict[str, tuple[int, int, int]] = {
    "put_rows": (1, 4096, 4),
    "gather_rows": (1, 4096, 4),  # as put_rows (not swept on its own)
    "topk_reduce": (2, 1024, 8),
    "copy_out": (2, 2048, 8),
    "weight_grad": (1, 4096, 8),
}
"""(BLOCK_R, BLOCK_H for 2-byte elements, num_warps) of each kernel on a GPU; measured on one H200
with ``tools/tune_kernels.py`` (docs/benchmarks.md has the sweep). Wider elements get
proportionally narrower BLOCK_H, so a program moves the same bytes."""

BUDGET_BLOCKS: dict[str, tuple[int, int, int]] = {
    "put_rows": (8, 2048, 32),
    "topk_reduce": (8, 2048, 32),
    "copy_out": (32, 2048, 32),
    "weight_grad": (8, 2048, 16),
}
"""The same under an SM budget (``max_programs``): one program per SM, so each program holds an
SM's worth of bytes in flight (32-128 KB a step, 32 warps) instead of a small tile among many on
the SM. On one H200 (``tools/sm_budget_diag.py``, T = 4096, H = 2048, K = 6, bf16, 16 programs)
the GPU tiles moved 69 (put_rows) / 246 (copy_out) / 276 (topk_reduce) GB/s, these tiles 259 /
978 / 902, a plain scatter kernel (``benchmarks/scatter_kernel.py``) 938; docs/benchmarks.md."""


def row_blocks(kernel: str, n_rows: int, H: int, element_size: int = 2,
               max_programs: Optional[int] = None) -> RowBlocks:
    """Launch blocks of ``kernel`` (a key of :data:`GPU_BLOCKS`) for n_rows rows of H elements;
    with ``max_programs`` (an SM budget) :data:`BUDGET_BLOCKS`' where it has the kernel.

    The interpreter runs programs one after another in Python, so there few large programs are
    fastest; on a GPU small tiles keep every SM busy with loads in flight."""
    if interpreting():
        block_r = triton.next_power_of_2(max(1, min(n_rows, 256)))
        return RowBlocks(block_r, triton.next_power_of_2(max(1, min(H, 4096))), 1)
    table = BUDGET_BLOCKS if max_programs is not None and kernel in BUDGET_BLOCKS else GPU_BLOCKS
    block_r, block_h, num_warps = table[kernel]
    block_h = max(16, block_h * 2 // max(element_size, 1))
    return RowBlocks(block_r, min(block_h, triton.next_power_of_2(max(16, H))), num_warps)


_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


def tl_acc_dtype(dtype: torch.dtype):
    """The Triton dtype of an accumulation dtype (fp32 or fp64)."""
    return _TL_DTYPES[dtype]


@triton.jit
def upcast(x, DTYPE: tl.constexpr):
    """``x.to(DTYPE)`` for a float DTYPE at least as wide, exact on every backend.

    NB: bf16 widens by shifting its bits (exact), because Triton's interpreter emulates the
    conversion in numpy and gets subnormals wrong."""
    if x.dtype == tl.bfloat16:
        b_bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return b_bits.to(tl.float32, bitcast=True).to(DTYPE)
    else:
        return x.to(DTYPE)


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr):
    """``x.to(DTYPE)`` rounding to nearest even on every backend.

    NB: Triton's interpreter converts fp32 to bf16 by truncation (numpy has no bf16), while
    torch and GPUs round to nearest even; doing the bf16 rounding on the bits makes the
    interpreter and the GPU agree with torch bit for bit."""
    if DTYPE == tl.bfloat16:
        b_bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        b_bits = b_bits + 0x7FFF + ((b_bits >> 16) & 1)  # round half to even at bit 16
        b_out = (b_bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x == x, b_out, float("nan")).to(tl.bfloat16)  # noqa: PLR0124 - NaN stays NaN
    else:
        return x.to(DTYPE)
