"""Registers, spills and shared memory of the data-moving kernels at the tiles they launch with on
an H100 / H200 (sm_90), built on the CPU: Triton compiles each kernel to a cubin for sm_90 and
``cuobjdump -res-usage`` (bundled with Triton) reads its resources, ``cuobjdump -sass`` its
instructions (a static count: a loop's body once; where one SM runs a kernel alone, under an SM
budget, instructions rather than bytes can set its pace). No GPU needed.

    python -m tools.kernel_resources            # the table; exit status 1 if a tile has a problem
    python -m tools.kernel_resources pull       # the cases whose name has "pull"
    make kernel-resources [KERNELS=pull]        # with the GPU host's Triton (3.6), as it builds them

The layout Triton gives a tile, and so registers and instructions, can change between Triton
versions: on the same source 3.9 put a pull step's warps on rows and 3.6 on its columns (1424 against
2472 instructions; twenty-sixth session). Read them with the GPU host's version (the header names
the one used).

Each case is a kernel as a dispatch or combine with peers launches it at H = 7168, K = 8, W = 2
(bf16 rows, fp8 wire rows of H + 4 H / 128 bytes), its tile from ``_config.row_blocks`` (the GPU
tile, with ``num_sms`` the budget tile, and for the token pull the spread tile it launches with
at T = 128, ``SPREAD_ITEMS`` tokens of all senders), integer arguments specialised as such a launch
specialises them (divisible by 16) and barriers fused where the path with peers fuses them.
``Resources.problems`` holds a tile to what it is for: a GPU tile is one of many programs on an SM, so two of
its programs must fit an SM's 65536 registers; a budget tile is the SM's one program (32 warps:
at most 64 registers a thread); neither may spill (local memory). The dequantizing pull's old
tile (4 rows of 4096 bytes, bit-level conversions) used 153 registers a thread: one program per
SM, and its dispatch took 2.4x the bf16 dispatch's time on an H200 (docs/benchmarks.md, "twelfth
session").
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile

REGISTERS_PER_SM = 65536
"""Registers of one SM on sm_90 (H100, H200)."""
H, K, W = 7168, 8, 2
SPREAD_ITEMS = W * 128
"""Every sender's tokens a receiver's pull scans at T = 128 (the decode shape): few enough that
``row_blocks(spread=True)`` spreads the token pull's tiles (one token a program)."""
WIRE = H + 4 * H // 128
"""Bytes of an fp8 wire row at H (values, then the fp32 scale of each 128-column block)."""
_NOT_SPECIALISED = {"rank", "tag_base", "barrier_rank", "timeout_ms", "barrier_op", "world_size", "ret_index",
                    "tags_index"}
"""Integer arguments a launch passes that are small or not multiples of 16."""


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    module: str  # under alltoall_ops.kernels
    kernel: str
    constexprs: dict
    pointers: dict  # argument -> Triton pointer type, where not *i64
    tile: tuple  # (row_blocks key, row width X, element size), ("quantize",) or ("quantize", "post")
    tile_names: tuple = ("BLOCK_R", "BLOCK_H")  # the kernel's names for rows and columns per step
    barrier: bool = False  # the path with peers fuses a barrier (and its asserts) into it


def _cases() -> list[Case]:
    f32 = "tl.float32"
    bf16 = {"src_ptr": "*bf16", "out_ptr": "*bf16", "rows_ptr": "*bf16", "tail_ptr": "*bf16", "scale_ptr": "*fp32"}
    wire = dict(bf16, rows_ptr="*u8", out_ptr="*u8", tail_ptr="*u8")
    pull = dict(K=K, ROW_MAP=False, STAGED=True, HAS_SCALE=False, ACC_DTYPE=f32, HAS_TAIL=False,
                WORLD_SIZE=W, DEQUANTIZE=False)
    seq = dict(Q0=128, Q1=128, Q2=128, TENSORS=3)
    seq_tensors = {f"{p}{i}": "*bf16" for p in "xy" for i in range(3)}
    return [
        Case("put_rows (combine)", "row_put", "_put_rows_kernel",
             dict(K=1, DST_STRIDE=4096, HAS_SCALE=False, ONE_OUT=False, HAS_COUNT=True, ACC_DTYPE=f32,
                  WORLD_SIZE=W), bf16, ("put_rows", H, 2), barrier=True),
        Case("post_slots (dispatch, into the stage)", "row_put", "_post_slots_kernel",
             dict(K=K, DST_STRIDE=4096, HAS_SCALE=False, STAGE=True, QUANTIZE=False, ACC_DTYPE=f32, BLOCK_S=64,
                  WORLD_SIZE=W), bf16, ("put_rows", H, 2), barrier=True),
        Case("post_slots (fp8 dispatch, quantized into the stage)", "row_put", "_post_slots_kernel",
             dict(K=K, DST_STRIDE=4096, HAS_SCALE=False, STAGE=True, QUANTIZE=True, ACC_DTYPE=f32, BLOCK_H=128,
                  BLOCK_S=64, WORLD_SIZE=W), bf16, ("quantize", "post"), barrier=True),
        Case("pull_rows (dispatch, bf16)", "row_put", "_pull_rows_kernel", pull, bf16, ("pull_tokens", H, 2),
             barrier=True),
        Case("pull_rows (fp8 wire rows)", "row_put", "_pull_rows_kernel", dict(pull, HAS_TAIL=True), wire,
             ("pull_tokens_fp8", WIRE, 1), barrier=True),
        Case("pull_rows (fp8 dequantized)", "row_put", "_pull_rows_kernel",
             dict(pull, HAS_TAIL=True, DEQUANTIZE=True), dict(wire, out_ptr="*bf16"),
             ("pull_tokens_dequantize", WIRE, 4), barrier=True),
        Case("pull_rows (one rank)", "row_put", "_pull_rows_kernel",
             dict(pull, ROW_MAP=True, STAGED=False, WORLD_SIZE=1), bf16, ("pull_rows", H, 2)),
        Case("topk_reduce (combine)", "topk_reduce", "_topk_reduce_kernel",
             dict(RET_AT_ADDRESS=True, HAS_TOKEN=True, READ_AT_SLOT_DST=False, K=K, HAS_SLOT_DST=True,
                  HAS_WEIGHTS=True, SAVE_RETURNED=False, ACC_DTYPE=f32, WORLD_SIZE=W),
             {"y_ptr": "*bf16", "weights_ptr": "*fp32"}, ("topk_reduce", H, 2), ("BLOCK_T", "BLOCK_H"),
             barrier=True),
        Case("gather_rows (local)", "row_gather", "_gather_rows_kernel", dict(HAS_SCALE=False, ACC_DTYPE=f32),
             bf16, ("gather_rows", H, 2)),
        Case("weight_grad", "weight_grad", "_weight_grad_kernel", dict(K=K, ACC_DTYPE=f32),
             {"grad_y_ptr": "*bf16", "returned_ptr": "*bf16", "grad_w_ptr": "*fp32"}, ("weight_grad", H, 2),
             ("BLOCK_T", "BLOCK_H")),
        Case("quantize_rows (fp8)", "quantize", "_quantize_rows_kernel",
             dict(FP8_MAX=448.0, AMAX_FLOOR=1e-4, BLOCK_C=128),
             {"x_ptr": "*bf16", "values_ptr": "*u8", "scales_ptr": "*fp32"}, ("quantize",)),
        Case("Ulysses post (q, k, v)", "seq_exchange", "_post_kernel",
             dict(seq, SPLIT_FIRST=False, WRITE_HEADER=True, WORLD_SIZE=W), seq_tensors, ("seq_pieces", 2048, 2),
             ("BLOCK_R", "BLOCK_Q"), barrier=True),
        Case("Ulysses gather (q, k, v)", "seq_exchange", "_gather_kernel",
             dict(seq, CAT_FIRST=True, ASSERT_CHECKS=True), seq_tensors, ("seq_pieces", 2048, 2),
             ("BLOCK_R", "BLOCK_Q"), barrier=True),
    ]


@dataclasses.dataclass(frozen=True)
class Resources:
    case: str
    kind: str  # "GPU", "budget" (one program an SM) or "spread" (the GPU tile spread: ``SPREAD_ITEMS``)
    tile: tuple  # (rows, columns, warps)
    registers: int  # a thread's
    local: int  # bytes of local memory a thread (spills)
    shared: int  # bytes a program
    instructions: int  # SASS instructions of the kernel (static: a loop's body counts once)

    def problems(self) -> list[str]:
        """What this tile should not have: spills; a GPU tile two of whose programs do not fit an SM."""
        out = [f"{self.local} bytes of local memory a thread (spills)"] if self.local else []
        threads = 32 * self.tile[2]
        if self.kind != "budget" and 2 * threads * self.registers > REGISTERS_PER_SM:
            out.append(f"{self.registers} registers a thread: fewer than two programs of {threads} threads an SM")
        return out


def measure(case: Case, kind: str = "GPU") -> Resources:
    """Compile ``case`` at its ``kind`` of tile (:class:`Resources`) for sm_90 and read its resources."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from alltoall_ops.kernels import _config, quantize
    from alltoall_ops.kernels.row_put import row_piece

    kernel = getattr(importlib.import_module(f"alltoall_ops.kernels.{case.module}"), case.kernel)
    max_programs = 16 if kind == "budget" else None
    if case.tile[0] == "quantize":
        _, rows, warps = quantize.tiles(4096, 7168, max_programs, post=case.tile == ("quantize", "post"))
        tile = dict(BLOCK_R=rows)
        shape = (rows, 128, warps)
    else:
        key, X, element_size = case.tile
        blocks = _config.row_blocks(key, SPREAD_ITEMS if kind == "spread" else 65536, X, element_size, max_programs,
                                    spread=kind == "spread")
        tile = dict(zip(case.tile_names, (blocks.BLOCK_R, blocks.BLOCK_H)))
        if case.kernel == "_pull_rows_kernel":  # the columns of one load, as pull_rows sets them
            tile["BLOCK_C"] = row_piece(blocks, element_size)
            tile["BLOCK_T"] = triton.next_power_of_2(X - H) if case.constexprs["HAS_TAIL"] else 1  # the fp8 scales
        shape = (blocks.BLOCK_R, blocks.BLOCK_H, blocks.num_warps)
    constexprs = {k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v
                  for k, v in {**case.constexprs, **tile}.items()}
    if "BARRIER" in kernel.arg_names:
        constexprs["BARRIER"] = case.barrier
    options = dict(num_warps=shape[2])
    if case.barrier:  # a fused barrier's asserts compile with debug (``_config.assert_options``)
        options.update(debug=True, sanitize_overflow=False)
    signature = {n: "constexpr" if n in constexprs else case.pointers.get(n, "*i64") if n.endswith("_ptr")
                 or n in case.pointers else "i32" for n in kernel.arg_names}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
             if t != "constexpr" and n not in _NOT_SPECIALISED}
    target = GPUTarget("cuda", 90, 32)
    parsed = triton.compiler.make_backend(target).parse_options(options)
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=target, options=parsed.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|LOCAL|SHARED):(\d+)", usage))
    instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+\S", sass, re.M))  # "/*0040*/  LDG.E.128 ..." lines
    return Resources(case.name, kind, shape, int(fields["REG"]), int(fields["LOCAL"]), int(fields["SHARED"]),
                     instructions)


def measure_all(only: str = "") -> list[Resources]:
    """Every case (whose name contains ``only``) at its GPU tile and, where it has them, its budget
    tile and (the token pull) its spread tile."""
    from alltoall_ops.kernels import _config

    out = []
    for case in _cases():
        if only not in case.name:
            continue
        out.append(measure(case))
        if case.tile[0] == "quantize" or case.tile[0] in _config.BUDGET_BLOCKS:
            out.append(measure(case, "budget"))
        if case.tile[0].startswith("pull_tokens"):
            out.append(measure(case, "spread"))
    return out


def main(argv: list[str]) -> int:
    if "triton" in sys.modules:
        sys.exit("tools.kernel_resources: run it as a program (it imports Triton to compile, not to interpret)")
    os.environ["TRITON_INTERPRET"] = "0"  # compile for sm_90 on any machine (alltoall_ops would interpret without CUDA)
    import triton

    rows = measure_all(argv[0] if argv else "")
    print(f"Triton {triton.__version__}, sm_90")
    print(f"{'kernel':40s} {'tile':7s} {'rows x cols, warps':20s} {'regs':>5s} {'local':>6s} {'shared':>7s} "
          f"{'SASS':>5s}  problems")
    for r in rows:
        tile = f"{r.tile[0]} x {r.tile[1]}, {r.tile[2]}"
        print(f"{r.case:40s} {r.kind:7s} {tile:20s} {r.registers:5d} {r.local:6d} "
              f"{r.shared:7d} {r.instructions:5d}  {'; '.join(r.problems()) or '-'}")
    return 1 if any(r.problems() for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
