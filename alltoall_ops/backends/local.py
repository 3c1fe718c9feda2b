"""The ``local`` backend: one rank, no process group, no communication. Dispatch sorts the
slots into expert-major rows and combine gathers them back, through the collective backend's
ops on a group of one (they exchange nothing there; the dispatch reads its split sizes on the
host once, as on a group)."""

from __future__ import annotations

from .. import layout
from ..groups import LOCAL, Group
from ..validation import check_dispatch_args
from .base import Backend
from .collective import dispatch_route


class LocalBackend(Backend):
    name = "local"

    def check_group(self, group: Group, buffers) -> None:
        super().check_group(group, buffers)
        if group.size != 1:
            raise ValueError(f"backend='local' needs a group of one rank, got a group of {group.size} ranks")

    def dispatch(self, x_TH, topk_idx_TK, num_experts, group, expert_alignment, buffers, payload=None):
        E = check_dispatch_args(x_TH, topk_idx_TK, num_experts, 1, expert_alignment)
        plan = layout.plan_routing(topk_idx_TK, E, 1)
        # One rank receives what it sends: the send counts are the received ones.
        splits_S = layout.read_splits(plan.send_meta, plan.send_meta, expert_alignment)
        return dispatch_route(x_TH, plan, plan.send_meta, splits_S, expert_alignment, LOCAL, payload)


