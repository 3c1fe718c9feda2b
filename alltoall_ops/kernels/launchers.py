"""Every kernel launcher, imported together by :func:`alltoall_ops.kernels.loader.load` (this
module imports Triton)."""

from __future__ import annotations

from . import routing_plan
from ._config import interpreting, row_blocks
from .barrier import Epilogue, barrier
from .dispatch_layout import dispatch_layout
from .quantize import quantize_rows
from .row_gather import gather_rows
from .routing_plan import plan_rows, plan_slots
from .seq_exchange import gather_pieces, post_pieces
from .row_put import post_slots, pull_rows, put_meta, put_rows
from .slot_placement import place_slots
from .topk_reduce import topk_reduce
from .weight_grad import weight_grad

__all__ = [
    "Epilogue", "barrier", "dispatch_layout", "gather_pieces", "gather_rows", "interpreting", "place_slots",
    "plan_rows", "plan_slots", "post_pieces", "post_slots", "pull_rows", "put_meta", "put_rows",
    "quantize_rows", "routing_plan", "row_blocks", "topk_reduce", "weight_grad",
]
