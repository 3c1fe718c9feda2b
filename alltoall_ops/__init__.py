"""alltoall_ops: torch.compile-first all-to-all ops for MoE expert parallelism.

Importing the package registers every op under ``torch.ops.alltoall_ops``.
"""

from . import errors
from .api import DispatchHandle, combine, dispatch, exchange_counts
from .checkpoint import sac_policy
from .comm import get_timeout, set_timeout
from .groups import warmup
from .ops import communication_ops
from .symm_mem import SymmBuffers
from .ulysses import head_to_seq, seq_to_head, ulysses_attention

__all__ = ["DispatchHandle", "SymmBuffers", "combine", "communication_ops", "dispatch", "errors", "exchange_counts",
           "get_timeout", "head_to_seq", "sac_policy", "seq_to_head", "set_timeout", "ulysses_attention", "warmup"]
