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


HARDWARE_CASTS = tl.constexpr(not _INTERPRETED)
"""Whether jitted helpers convert floats with the GPU's instructions (round to nearest even, as
torch) or, in Triton's interpreter (whose numpy emulation truncates and gets subnormals wrong),
on the bits: the same values either way, fewer instructions on a GPU."""


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
    """``kernel`` (a ``triton.jit`` function) as a launcher for tensors like ``like``: itself for
    plain tensors (eager code, an op's body at run time), ``torch.library.wrap_triton(kernel)``
    while an inlined op's body is traced (``_compat.custom_op(inline=True)``: functional or fake
    tensors), so that the launch becomes a node of the graph that inductor compiles."""
    if type(like) is torch.Tensor or _INTERPRETED:
        return kernel
    return torch.library.wrap_triton(kernel)


def assert_options(like: torch.Tensor) -> dict:
    """Launch options that keep a kernel's ``tl.device_assert`` for tensors like ``like``.

    Triton compiles device asserts only with ``debug``; inductor compiles the kernels it launches
    with it (``config.assert_indirect_indexing``, on by default) and without the overflow checks
    that ``debug`` adds, and so does an eager CUDA launch with these options. Traced launches
    (``wrap_triton``) and the interpreter take none."""
    if type(like) is torch.Tensor and like.device.type == "cuda" and not _INTERPRETED:
        return {"debug": True, "sanitize_overflow": False}
    return {}


@triton.jit
def order_after(token_ptr):
    """Store 0 into the (1,) token from one program: the kernel then mutates the token, which is
    all inductor sees of its writes through addresses, so kernels that do it run in program order
    (docs/design.md, "symm_mem ops in compiled graphs")."""
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(token_ptr, tl.zeros([], dtype=tl.int64))


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
    "pull_rows": (4, 2048, 8),
    "pull_tokens": (1, 4096, 4),  # tokens (each stored into its rows here), not rows; H100, twenty-fourth session
    "pull_tokens_fp8": (4, 2048, 4),  # the same, fp8 wire rows moved as they are; H100, twenty-seventh session
    "pull_tokens_dequantize": (4, 8192, 4),  # the same, fp8 wire rows dequantized; H100, tune_kernels --pull
    "weight_grad": (1, 4096, 8),
    "seq_pieces": (2, 2048, 4),  # Ulysses rows: a rank's heads of a position (h * D elements); H100, --ulysses
}
"""(BLOCK_R, BLOCK_H for 2-byte elements, num_warps) of each kernel on a GPU; measured on one H200
with ``tools/tune_kernels.py`` (docs/benchmarks.md has the sweep). Wider elements get
proportionally narrower BLOCK_H, so a program moves the same bytes."""

BUDGET_BLOCKS: dict[str, tuple[int, int, int]] = {
    "put_rows": (16, 2048, 32),
    "topk_reduce": (8, 2048, 32),
    "pull_rows": (32, 2048, 32),
    "pull_tokens": (32, 2048, 32),  # H100, tune_kernels --pull --pull-sms 16 32 (W = 4; bf16 and fp8 wire rows)
    "pull_tokens_fp8": (32, 2048, 32),  # the same sweep (the best tile of both payloads)
    "pull_tokens_dequantize": (32, 2048, 16),  # the same sweep
    "weight_grad": (8, 2048, 16),
    "seq_pieces": (8, 2048, 16),
}
"""The same under an SM budget (``max_programs``): one program per SM, so each program holds an
SM's worth of bytes in flight (32-128 KB a step, 32 warps) instead of a small tile among many on
the SM. On one H200 (``tools/sm_budget_diag.py``, T = 4096, H = 2048, K = 6, bf16, 16 programs)
the GPU tiles moved 69 (put_rows) / 246 (copy_out, now pull_rows) / 276 (topk_reduce) GB/s, these tiles 259 /
978 / 902, a plain scatter kernel (``benchmarks/scatter_kernel.py``) 938; docs/benchmarks.md."""


SPREAD_PROGRAMS = 264
"""Programs a spread launch (``row_blocks(spread=True)``) keeps its rows a program from going
under: two an SM of an H100 (132 SMs), so that a small launch still has every SM loading."""


def row_blocks(kernel: str, n_rows: int, H: int, element_size: int = 2,
               max_programs: Optional[int] = None, spread: bool = False) -> RowBlocks:
    """Launch blocks of ``kernel`` (a key of :data:`GPU_BLOCKS`) for n_rows rows of H elements;
    with ``max_programs`` (an SM budget) :data:`BUDGET_BLOCKS`' where it has the kernel.
    ``spread`` (without a budget): BLOCK_R halves, down to 1, while n_rows would take fewer than
    :data:`SPREAD_PROGRAMS` programs (a tile sized for T = 4096 leaves most SMs idle at T = 128).

    The interpreter runs programs one after another in Python, so there few large programs are
    fastest; on a GPU small tiles keep every SM busy with loads in flight."""
    if interpreting():
        block_r = triton.next_power_of_2(max(1, min(n_rows, 256)))
        return RowBlocks(block_r, triton.next_power_of_2(max(1, min(H, 4096))), 1)
    table = BUDGET_BLOCKS if max_programs is not None and kernel in BUDGET_BLOCKS else GPU_BLOCKS
    block_r, block_h, num_warps = table[kernel]
    while spread and max_programs is None and block_r > 1 and triton.cdiv(n_rows, block_r) < SPREAD_PROGRAMS:
        block_r //= 2
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
    interpreter and the GPU agree with torch bit for bit. A GPU's own conversion (HARDWARE_CASTS)
    already rounds so."""
    if DTYPE == tl.bfloat16 and HARDWARE_CASTS:
        return x.to(tl.float32).to(tl.bfloat16)  # as the bits below: fp64 through fp32
    elif DTYPE == tl.bfloat16:
        b_bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        b_bits = b_bits + 0x7FFF + ((b_bits >> 16) & 1)  # round half to even at bit 16
        b_out = (b_bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x == x, b_out, float("nan")).to(tl.bfloat16)  # noqa: PLR0124 - NaN stays NaN
    else:
        return x.to(DTYPE)
