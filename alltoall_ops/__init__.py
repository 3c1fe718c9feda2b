"""alltoall_ops: torch.compile-first all-to-all ops for MoE expert parallelism.

Importing the package registers every op under ``torch.ops.alltoall_ops``. Events worth knowing
(buffer creation and sizes, the backend chosen, kernels vs torch ops, the Triton interpreter on
machines without CUDA) go to ``logging.getLogger("alltoall_ops")``.
"""

# NB: the kernel loader first: without CUDA it enables Triton's interpreter before anything
# imports triton (see alltoall_ops/kernels/loader.py for why it must be process-wide).
from .kernels import loader as _loader  # noqa: F401  (isort: skip)
# NB: the package's source hash in torch.compile's cache keys: an upgrade never loads another
# version's compiled graphs (alltoall_ops/_cache_key.py).
from . import _cache_key  # noqa: F401  (isort: skip)

from . import errors
from .api import combine, dispatch, dispatch_layout, exchange_counts
from .backends import DispatchHandle
from .backends.symm_mem import SymmBuffers, UlyssesBuffers
from .checkpoint import sac_policy
from .comm import communication_ops, get_timeout, set_timeout
from .groups import warmup
from .hierarchical import hierarchical_dispatch
from .overlap import wait, wait_add
from .ulysses import head_to_seq, seq_to_head, ulysses_attention

__version__ = "0.1.0"

__all__ = ["DispatchHandle", "SymmBuffers", "UlyssesBuffers", "__version__", "combine", "communication_ops",
           "dispatch", "dispatch_layout", "errors", "hierarchical_dispatch", "exchange_counts", "get_timeout",
           "head_to_seq", "sac_policy", "seq_to_head", "set_timeout", "ulysses_attention", "wait", "wait_add",
           "warmup"]
