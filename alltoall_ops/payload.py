"""Payload formats: how a dispatch's rows travel. Every backend has one dispatch op whatever the
format (its ``payload`` argument names one of :data:`FORMATS`); its body is

    values_TH, scale_TB = fmt.encode(x_TH, x_scale_TB)            # quantize, or x as it is
    move values_TH alone (scale_TB None), or both: apart, or as one packed byte row
        (:func:`pack` / :func:`unpack`) where one exchange moves them  # the backend's own work
    routed_RH, scale_RB = fmt.decode(values_RH, scale_RB, out_dtype)  # view, or dequantize

    plain  rows in x's dtype, no scales (routed_scale is (R, 0))
    fp8    float8_e4m3fn values (moved as uint8 bits) and one fp32 scale per 128 channels
           (:mod:`alltoall_ops.fp8`); decode views them, or dequantizes to ``out_dtype``

A new format (e.g. mxfp8: one e8m0 scale per 32 channels) is one :class:`Format` subclass and
its entry in :data:`FORMATS` (plus the public argument that selects it): no backend changes.
Legend: T tokens, H hidden, B scales per row, P bytes of a packed row, R routed rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from . import fp8
from .kernels import loader
from .rows import quantize_bits


class Format:
    """Plain rows: x travels in its own dtype, nothing beside it."""

    name = "plain"
    payload_dtype: Optional[torch.dtype] = None
    """What selects the format in the public API (``dispatch(payload_dtype=)``, ``SymmBuffers``)."""
    scale_dtype = torch.float32

    def scale_columns(self, hidden: int) -> int:
        """B, the scales of one row."""
        return 0

    def routed_dtype(self, x_dtype: torch.dtype) -> torch.dtype:
        """The dtype of routed rows that are not dequantized."""
        return x_dtype

    def encode(self, x_TH: torch.Tensor, x_scale_TB: Optional[torch.Tensor],
               max_programs: Optional[int] = None) -> tuple[torch.Tensor, Any]:
        """What travels: values (T, H) and scales (T, B), or None for none. max_programs: the
        SM budget of any kernel launch (symm_mem's buffers' ``num_sms``)."""
        return x_TH, None

    def encode_packed(self, x_TH: torch.Tensor, x_scale_TB: Optional[torch.Tensor],
                      max_programs: Optional[int] = None, out_TP: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What travels as wire rows (T, P) uint8 (:func:`pack`), for a format with scales.
        out_TP: (T, P) to write them into (symm_mem: the sender's stage), returned."""
        values_TH, scale_TB = self.encode(x_TH, x_scale_TB, max_programs)
        if out_TP is None:
            return pack(values_TH, scale_TB)
        for part, into in zip((values_TH, scale_TB), unpack(out_TP, values_TH, scale_TB)):
            into.copy_(part)
        return out_TP

    def kernel_quantizes(self, x_scale_TB: Optional[torch.Tensor]) -> bool:
        """Whether a kernel that moves x's rows may encode them on the way, as :meth:`encode_packed`
        (``row_put.post_slots(quantize=True)``: fp8 of an x not quantized yet)."""
        return False

    def decode(self, values_RH: torch.Tensor, scale_RB: Optional[torch.Tensor],
               out_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
        """The moved parts -> routed (R, H) and routed_scale (R, B). (symm_mem's pull
        dequantizes fp8 rows as it moves them: ``pull_rows(dequantize=True)``.)"""
        return values_RH, values_RH.new_empty(values_RH.shape[0], 0, dtype=self.scale_dtype)

    def empty_routed(self, x_TH: torch.Tensor, num_rows: Any,
                     out_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`decode` returns for ``num_rows`` rows, uninitialised (the ops' fakes)."""
        H = x_TH.shape[1]
        return (x_TH.new_empty(num_rows, H, dtype=out_dtype or self.routed_dtype(x_TH.dtype)),
                x_TH.new_empty(num_rows, self.scale_columns(H), dtype=self.scale_dtype))

    def wire_bytes(self, hidden: int, dtype: torch.dtype) -> int:
        """P, the bytes of one packed row of x's ``dtype`` (values, then scales)."""
        return hidden * self.routed_dtype(dtype).itemsize + self.scale_columns(hidden) * self.scale_dtype.itemsize


class FP8Format(Format):
    """DeepEP's fp8 rows (:mod:`alltoall_ops.fp8`): P = H + 4 * H / 128 bytes packed."""

    name = "fp8"
    payload_dtype = fp8.FP8

    def scale_columns(self, hidden):
        return fp8.num_blocks(hidden)

    def routed_dtype(self, x_dtype):
        return fp8.FP8

    def encode(self, x_TH, x_scale_TB, max_programs=None):
        return quantize_bits(x_TH, x_scale_TB, max_programs)

    def encode_packed(self, x_TH, x_scale_TB, max_programs=None, out_TP=None):
        # NB: into out_TP (symm_mem's stage) the kernel on every device, as symm_mem's other
        # kernels (Triton's interpreter on the CPU): what the GPU does, byte for byte
        if x_scale_TB is not None or (out_TP is None and not loader.use_kernels(x_TH)):
            return super().encode_packed(x_TH, x_scale_TB, max_programs, out_TP)
        # NB: the kernel writes the wire rows itself: no packing copy of the payload
        if out_TP is None:
            out_TP = x_TH.new_empty(x_TH.shape[0], self.wire_bytes(x_TH.shape[1], x_TH.dtype), dtype=torch.uint8)
        loader.load().quantize_rows(x_TH, max_programs=max_programs, out_TP=out_TP)
        return out_TP

    def kernel_quantizes(self, x_scale_TB):
        return x_scale_TB is None

    def decode(self, values_RH, scale_RB, out_dtype):
        if out_dtype is None:
            return values_RH.view(fp8.FP8), scale_RB
        return fp8.dequantize(values_RH.view(fp8.FP8), scale_RB, out_dtype), scale_RB


FORMATS: dict[str, Format] = {f.name: f for f in (Format(), FP8Format())}
"""Every payload format, by name (the dispatch ops' ``payload`` argument)."""
PLAIN = FORMATS["plain"]


_BY_PAYLOAD_DTYPE = {f.payload_dtype: f for f in FORMATS.values()}


def format_of(payload_dtype: Optional[torch.dtype]) -> Format:
    """The format the public ``payload_dtype`` selects: None plain rows, float8_e4m3fn fp8."""
    return _BY_PAYLOAD_DTYPE[payload_dtype]


def pack(values_TH: torch.Tensor, scale_TB: torch.Tensor) -> torch.Tensor:
    """values (T, H) and scales (T, B) -> wire rows (T, P) uint8: each row's values' bytes, then
    its scales' (one row, so one exchange moves both)."""
    return torch.cat([values_TH.view(torch.uint8), scale_TB.contiguous().view(torch.uint8)], dim=1)


def unpack(rows_RP: torch.Tensor, values_TH: torch.Tensor, scale_TB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Wire rows (R, P) -> strided views (no copy) of their values and scales, in the dtypes and
    widths of the parts that were packed (``values_TH``, ``scale_TB``)."""
    values_bytes = values_TH.shape[1] * values_TH.element_size()
    return rows_RP[:, :values_bytes].view(values_TH.dtype), rows_RP[:, values_bytes:].view(scale_TB.dtype)


@dataclasses.dataclass(frozen=True)
class Payload:
    """How one dispatch's rows travel and arrive (``dispatch(payload_dtype=...)``).

    format: the :class:`Format`. scale_TB: (T, B) scales of an x that holds quantized values;
    None: encode x. out_dtype: dequantize the routed rows to this dtype; None: values and
    scales. combine_dtype: the dtype of the expert outputs combine takes back (x's; bf16 for
    an fp8 x)."""

    format: Format
    scale_TB: Optional[torch.Tensor]
    out_dtype: Optional[torch.dtype]
    combine_dtype: torch.dtype

    @classmethod
    def of(cls, x_TH: torch.Tensor, scale_TB: Optional[torch.Tensor], dequantize: bool) -> "Payload":
        """An fp8 payload (the quantized format the public API selects, ``payload_dtype``)."""
        combine_dtype = torch.bfloat16 if x_TH.dtype == fp8.FP8 else x_TH.dtype
        return cls(format_of(fp8.FP8), scale_TB, combine_dtype if dequantize else None, combine_dtype)

    def op_kwargs(self) -> dict:
        """The payload arguments of every backend's dispatch op, by name."""
        return {"x_scale_TB": self.scale_TB, "payload": self.format.name, "out_dtype": self.out_dtype}

    def routed(self, rows_RH: torch.Tensor, scale_RB: torch.Tensor) -> Any:
        """What dispatch returns as routed: the dequantized rows, or the pair (values, scales)."""
        return rows_RH if self.out_dtype is not None else (rows_RH, scale_RB)


def op_kwargs(payload: Optional[Payload]) -> dict:
    """:meth:`Payload.op_kwargs`, none for plain rows (the ops' defaults)."""
    return {} if payload is None else payload.op_kwargs()


def routed(payload: Optional[Payload], rows_RH: torch.Tensor, scale_RB: torch.Tensor) -> Any:
    """What dispatch returns as routed: plain rows, or :meth:`Payload.routed`."""
    return rows_RH if payload is None else payload.routed(rows_RH, scale_RB)
