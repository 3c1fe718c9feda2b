"""The ``symm_mem`` backend: dispatch / combine through peer-addressable buffers and Triton
kernels, with no host sync, so a dispatch + combine step captures in a CUDA graph.

Every rank holds one :class:`SymmBuffers` (created collectively, once). Its segment, which every
peer can write, holds four regions; a (4, W) int64 *pointer table* on the device gives each
region's address on every rank, and the kernels write peers' regions through it:

    recv  (C, H)        rows dispatched to this rank, expert-major (written by the senders)
    tags  (C,)  int64   source code ``src_rank * N_max + send_position`` of each received row, -1 none
    ret   (N_max, H)    this rank's slots coming back from combine, in send order
    meta  (W, L) int64  row s: rank s's counts per global expert, its routing status, its N

One call of an op (``entry barrier; write peers; barrier; read own buffers into fresh
tensors``) leaves nothing behind that a later call could overwrite: every returned tensor is a
copy, so any number of layers may share one ``SymmBuffers``, in any order, with autograd,
recomputation and selective checkpointing.

Allocators, one op code: CUDA symmetric memory (``torch.distributed._symmetric_memory``, one
process per GPU, barriers are a signal-pad kernel); a CPU stand-in (a shared-memory segment per
rank mapped by every peer, Triton's interpreter, barriers through the process group); simulated
peers in one process (all ranks' segments on one device, one thread per rank; barriers order
the threads, the device runs their work in order on one stream); one rank (no peers).

Capacity rule: ``C = W * max_tokens_per_rank * top_k + e * (expert_alignment - 1)`` rows by
default: the most a rank can receive (every slot of every rank routed to it, each local
expert's group padded). ``capacity=`` may set a smaller C; more rows than C is *overflow*.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import threading
import uuid
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from . import layout
from ._compat import OpaqueBase, is_compiling, register_reference_type
from .groups import LOCAL, Group, process_group, resolve_group
from .ops import accumulation_dtype, comm_op
from .validation import check_combine_args, check_dispatch_args

RECV, TAGS, RET, META = range(4)
"""Rows of the pointer table: the regions of a segment."""

META_EXTRA = layout.STATUS_COLUMNS + 1
"""Columns of a metadata row after the E counts: the routing status, then N = T * K."""

_REGION_ALIGN = 256
OVERFLOW_MODES = ("error", "drop")


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


# --------------------------------------------------------------------------------------------
# Kernels (Triton is optional)

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
        from . import kernels as module

        if module.interpreting() and not _interpreted(triton.language.cdiv):
            raise RuntimeError(
                "backend='symm_mem' runs its kernels in Triton's interpreter here (no CUDA), but triton "
                "was imported before TRITON_INTERPRET=1 was set; set it in the environment, or import "
                "alltoall_ops before anything imports triton"
            )
        _KERNELS = module
    return _KERNELS


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


# --------------------------------------------------------------------------------------------
# Allocators: memory every rank of a group can write


class _Segments:
    """This rank's segment (``local``, uint8) and every rank's segment base (``bases``)."""

    local: torch.Tensor
    bases: list[int]

    def barrier(self) -> None:
        """Return once every rank has reached the barrier (in device order for device work)."""

    def setup_barrier(self) -> None:
        """A host-level barrier for set-up, before any op runs."""
        self.barrier()


class _LocalSegments(_Segments):
    """One rank: plain device memory, nothing to wait for."""

    def __init__(self, nbytes: int, device: torch.device):
        self.local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.bases = [self.local.data_ptr()]


class _SharedMemorySegments(_Segments):
    """CPU stand-in for symmetric memory: each rank creates a file-backed shared mapping
    (``/dev/shm`` where it exists), every peer maps it, and the file is unlinked once all have.
    Barriers go through the process group."""

    def __init__(self, nbytes: int, group: Group):
        self._pg = process_group(group.name)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        name = os.path.join(folder, f"alltoall_ops_{uuid.uuid4().hex}_{group.rank}")
        self.local = torch.from_file(name, shared=True, size=nbytes, dtype=torch.uint8)
        self.local.zero_()
        names: list[Any] = [None] * group.size
        try:
            dist.all_gather_object(names, name, group=self._pg)
            self._peers = [
                self.local if r == group.rank
                else torch.from_file(names[r], shared=True, size=nbytes, dtype=torch.uint8)
                for r in range(group.size)
            ]
            dist.barrier(group=self._pg)  # every peer has mapped every file
        finally:
            os.unlink(name)
        self.bases = [t.data_ptr() for t in self._peers]

    def barrier(self) -> None:
        dist.barrier(group=self._pg)


class _CudaSymmetricSegments(_Segments):
    """CUDA symmetric memory (one process per GPU): ``empty`` + ``rendezvous``; barriers are a
    kernel on the signal pads."""

    def __init__(self, nbytes: int, group: Group, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required on torch 2.11
            symm_mem.enable_symm_mem_for_group(group.name)
        self._rank = group.rank
        self._pg = process_group(group.name)
        self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.local.zero_()
        self._handle = symm_mem.rendezvous(self.local, group.name)
        self.bases = list(self._handle.buffer_ptrs)
        self.pads_table = torch.tensor(list(self._handle.signal_pad_ptrs), dtype=torch.int64, device=device)

    def barrier(self) -> None:
        kernels().barrier(self.pads_table, self._rank)

    def setup_barrier(self) -> None:
        torch.cuda.synchronize(self.local.device)
        dist.barrier(group=self._pg)


class _SimulatedSegments(_Segments):
    """Simulated peers: every rank's segment on one device of one process, one thread per rank.

    The barrier is a thread barrier: every thread has queued its work before any goes on, and
    one device stream runs queued work in order, so no host-device sync is needed (CUDA graph
    capture works when every thread queues onto the capturing stream)."""

    def __init__(self, local: torch.Tensor, bases: list[int], barrier: threading.Barrier):
        self.local, self.bases = local, bases
        self._barrier = barrier

    def barrier(self) -> None:
        self._barrier.wait()

    def setup_barrier(self) -> None:
        pass  # all segments are set up by one thread

    def abort(self) -> None:
        self._barrier.abort()


# --------------------------------------------------------------------------------------------
# SymmBuffers


@dataclasses.dataclass(frozen=True)
class _Config:
    rank: int
    world_size: int
    group_name: str
    max_tokens_per_rank: int
    hidden: int
    top_k: int
    num_experts: int
    expert_alignment: int
    capacity: int
    overflow: str
    dtype: torch.dtype
    device: torch.device

    @property
    def shared(self) -> tuple:
        """What every rank must agree on."""
        return (self.world_size, self.max_tokens_per_rank, self.hidden, self.top_k, self.num_experts,
                self.expert_alignment, self.capacity, self.overflow, str(self.dtype), self.device.type)

    def region_offsets(self) -> tuple[list[int], int]:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        N_max = self.max_tokens_per_rank * self.top_k
        meta_cols = self.num_experts + META_EXTRA
        sizes = [self.capacity * self.hidden * itemsize, self.capacity * 8,
                 N_max * self.hidden * itemsize, self.world_size * meta_cols * 8]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += _round_up(max(size, 1), _REGION_ALIGN)
        return offsets, total


def _default_device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _make_config(
    rank: int, world_size: int, group_name: str, max_tokens_per_rank: int, hidden: int, top_k: int,
    num_experts: int, dtype: torch.dtype, device: torch.device, expert_alignment: int,
    capacity: Optional[int], overflow: str,
) -> _Config:
    for name, value in (("max_tokens_per_rank", max_tokens_per_rank), ("hidden", hidden),
                        ("top_k", top_k), ("num_experts", num_experts),
                        ("expert_alignment", expert_alignment)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if num_experts % world_size:
        raise ValueError(f"num_experts: expected a multiple of the group size {world_size}, got {num_experts}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow: expected one of {OVERFLOW_MODES}, got {overflow!r}")
    e = num_experts // world_size
    worst = world_size * max_tokens_per_rank * top_k + e * (expert_alignment - 1)
    if capacity is None:
        capacity = worst
    elif isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity: expected a positive int or None, got {capacity!r}")
    return _Config(rank, world_size, group_name, max_tokens_per_rank, hidden, top_k, num_experts,
                   expert_alignment, capacity, overflow, dtype, device)


class SymmBuffers(OpaqueBase):
    """Receive buffers, tags, returned rows, metadata and pointer tables for ``backend="symm_mem"``.

    Collective: every rank of ``group`` creates it with the same arguments, once, and passes it
    as ``buffers=`` to :func:`alltoall_ops.dispatch`. Under torch.compile it is one graph input
    (an opaque reference), and its sizes are compile-time constants.

    Args:
        max_tokens_per_rank: T_max, the most tokens any rank dispatches in one call.
        hidden: H. top_k: K, the most slots per token. num_experts: E, divisible by W.
        dtype: of x and the expert outputs. device: cuda (default when there is one) or cpu.
        group: ProcessGroup, 1-D DeviceMesh or None (default group; one rank without one).
        expert_alignment: the largest ``expert_alignment`` dispatch will be called with (for C).
        capacity: C, rows of ``routed``; default ``W * T_max * K + e * (expert_alignment - 1)``,
            which no routing can exceed.
        overflow: "error" (a routing that needs more than C rows on some rank raises on every
            rank) or "drop" (rows past C are not delivered, counted in ``handle.dropped``).
        allocator: "auto" (CUDA symmetric memory for W > 1 on cuda, a shared-memory stand-in on
            the CPU, plain memory for one rank) or "symmetric" (torch symmetric memory even for
            one rank: a check of that path on a one-GPU host).

    Example::

        bufs = SymmBuffers(max_tokens_per_rank=4096, hidden=7168, top_k=8, num_experts=256,
                           dtype=torch.bfloat16, device="cuda")
        routed, tokens_per_expert, handle = dispatch(x, topk_idx, num_experts=256,
                                                     backend="symm_mem", buffers=bufs)
    """

    def __init__(
        self,
        max_tokens_per_rank: int,
        hidden: int,
        top_k: int,
        num_experts: int,
        dtype: torch.dtype = torch.bfloat16,
        device: Any = None,
        group: Any = None,
        *,
        expert_alignment: int = 1,
        capacity: Optional[int] = None,
        overflow: str = "error",
        allocator: str = "auto",
    ):
        if allocator not in ("auto", "symmetric"):
            raise ValueError(f"allocator: expected 'auto' or 'symmetric', got {allocator!r}")
        grp = resolve_group(group)
        device = _default_device(device)
        cfg = _make_config(grp.rank, grp.size, grp.name, max_tokens_per_rank, hidden, top_k,
                           num_experts, dtype, device, expert_alignment, capacity, overflow)
        _check_kernels_run_on(device)
        if grp.size > 1:
            _check_same_config(cfg, grp)
        _, nbytes = cfg.region_offsets()
        if allocator == "symmetric" and device.type != "cuda":
            raise ValueError("allocator='symmetric' (torch symmetric memory) needs a cuda device")
        if grp.size == 1 and allocator == "auto":
            segments: _Segments = _LocalSegments(nbytes, device)
        elif device.type == "cpu":
            segments = _SharedMemorySegments(nbytes, grp)
        else:
            segments = _CudaSymmetricSegments(nbytes, grp, device)
        self._setup(cfg, segments)

    @classmethod
    def simulated(
        cls,
        world_size: int,
        max_tokens_per_rank: int,
        hidden: int,
        top_k: int,
        num_experts: int,
        dtype: torch.dtype = torch.bfloat16,
        device: Any = None,
        *,
        expert_alignment: int = 1,
        capacity: Optional[int] = None,
        overflow: str = "error",
        timeout: float = 120.0,
    ) -> list["SymmBuffers"]:
        """Buffers of ``world_size`` simulated ranks in this process, on one device: run rank r's
        calls with ``buffers[r]`` in its own thread (see :func:`run_simulated`)."""
        device = _default_device(device)
        _check_kernels_run_on(device)
        name = f"simulated-{uuid.uuid4().hex[:8]}"
        cfgs = [
            _make_config(r, world_size, name, max_tokens_per_rank, hidden, top_k, num_experts,
                         dtype, device, expert_alignment, capacity, overflow)
            for r in range(world_size)
        ]
        nbytes = cfgs[0].region_offsets()[1]
        locals_ = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world_size)]
        bases = [t.data_ptr() for t in locals_]
        barrier = threading.Barrier(world_size, timeout=timeout)
        out = []
        for cfg, local in zip(cfgs, locals_):
            bufs = cls.__new__(cls)
            bufs._setup(cfg, _SimulatedSegments(local, bases, barrier))
            out.append(bufs)
        return out

    def _setup(self, cfg: _Config, segments: _Segments) -> None:
        self._cfg = cfg
        self._segments = segments
        for field in dataclasses.fields(cfg):
            setattr(self, field.name, getattr(cfg, field.name))
        self.num_local_experts = cfg.num_experts // cfg.world_size
        self.max_slots = cfg.max_tokens_per_rank * cfg.top_k  # N_max
        self.meta_columns = cfg.num_experts + META_EXTRA  # L
        offsets, _ = cfg.region_offsets()
        C, H, W = cfg.capacity, cfg.hidden, cfg.world_size

        def region(i: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            n = 1
            for s in shape:
                n *= s
            itemsize = torch.empty((), dtype=dtype).element_size()
            return segments.local[offsets[i] : offsets[i] + n * itemsize].view(dtype).view(shape)

        self.recv = region(RECV, cfg.dtype, (C, H))
        self.tags = region(TAGS, torch.int64, (C,))
        self.ret = region(RET, cfg.dtype, (self.max_slots, H))
        self.meta = region(META, torch.int64, (W, self.meta_columns))
        self.tags.fill_(-1)
        self.table = torch.tensor(
            [[base + off for base in segments.bases] for off in offsets], dtype=torch.int64, device=cfg.device
        )  # (4, W)
        segments.setup_barrier()  # every rank's tags are -1 before any peer writes

    # NB: a handle to memory that peers write: a copy would read buffers nobody writes. Graph
    # modules deep-copy their attributes (seen with AOTAutograd's dynamic-shape path), so copies
    # are the object itself.
    def __copy__(self) -> "SymmBuffers":
        return self

    def __deepcopy__(self, memo: dict) -> "SymmBuffers":
        return self

    # NB: torch pickles an opaque graph input. The compile caches hash it (their pickler turns
    # every tensor attribute into a Python list: seconds to minutes and many GB for a large
    # segment, and a cache key that depends on the buffers' contents), and torch 2.11's inductor
    # writes ``pickle.loads(<the object's bytes>)`` into the generated module (a GB-sized literal
    # that then fails to import). The compiled code depends on the configuration only: pickle
    # that, never the memory; a loaded copy would be memory no peer writes, so loading raises.
    def __reduce__(self) -> tuple:
        return _load_pickled_buffers, (self._guard_key(),)

    # Host-side helpers, used inside the ops only.
    def _barrier(self) -> None:
        self._segments.barrier()

    def _guard_key(self) -> list:
        return [self.rank, *self._cfg.shared, self.group_name]

    def __repr__(self) -> str:
        return (f"SymmBuffers(rank={self.rank}, world_size={self.world_size}, T_max={self.max_tokens_per_rank}, "
                f"H={self.hidden}, K={self.top_k}, E={self.num_experts}, C={self.capacity}, "
                f"dtype={self.dtype}, device={self.device}, overflow={self.overflow!r})")


_CONSTANT_MEMBERS = (
    "rank", "world_size", "group_name", "max_tokens_per_rank", "hidden", "top_k", "num_experts",
    "expert_alignment", "capacity", "overflow", "dtype", "device", "num_local_experts", "max_slots",
    "meta_columns",
)
register_reference_type(SymmBuffers, constant_members=_CONSTANT_MEMBERS, guard_fn=SymmBuffers._guard_key)


def _load_pickled_buffers(key: list) -> SymmBuffers:
    raise RuntimeError(
        f"SymmBuffers cannot be unpickled (pickled: rank, W, T_max, H, K, E, alignment, C, overflow, "
        f"dtype, device type, group = {key}): they are memory that the group's peers write; create "
        "them collectively with alltoall_ops.SymmBuffers(...) in the process that uses them"
    )


def _check_same_config(cfg: _Config, grp: Group) -> None:
    """Every rank must create its buffers with the same sizes (one all-gather, at set-up)."""
    configs: list[Any] = [None] * grp.size
    dist.all_gather_object(configs, cfg.shared, group=process_group(grp.name))
    if any(c != configs[0] for c in configs):
        raise ValueError(
            "SymmBuffers: every rank must pass the same sizes; got (W, T_max, H, K, E, alignment, "
            f"C, overflow, dtype, device type) = {configs}"
        )


def run_simulated(fn: Callable[[int, SymmBuffers], Any], buffers: Sequence[SymmBuffers],
                  stream: Optional[torch.cuda.Stream] = None) -> list[Any]:
    """Run ``fn(rank, buffers[rank])`` for every simulated rank, one thread each; return the results
    by rank. If a rank raises, the others' barriers break and the first error is re-raised.
    stream: a CUDA stream every thread queues its work on (e.g. a graph-capture stream)."""
    results: list[Any] = [None] * len(buffers)
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        try:
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with ctx:
                results[rank] = fn(rank, buffers[rank])
        except BaseException as exc:
            errors.append((rank, exc))
            buffers[rank]._segments.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(buffers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        primary = [e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)] or errors
        rank, exc = min(primary, key=lambda e: e[0])
        raise RuntimeError(f"simulated rank {rank} raised {type(exc).__name__}: {exc}") from exc
    return results


# --------------------------------------------------------------------------------------------
# Checks on the exchanged metadata (every rank sees the same metadata, so all agree)


def _fail(ok: torch.Tensor, message: Callable[[], str]) -> None:
    """Raise ``ValueError(message())`` where ``ok`` is False. CPU: at once. CUDA: no host sync, a
    device-side assert (``torch._assert_async``) that surfaces at the next synchronisation."""
    if ok.device.type == "cpu":
        if not bool(ok):
            raise ValueError(message())
    else:
        torch._assert_async(ok, "alltoall_ops symm_mem: routing check failed (bad expert ids, "
                                "T * K above the buffers' max_tokens_per_rank * top_k, or overflow)")


def _check_meta(meta: torch.Tensor, bufs: SymmBuffers, expert_alignment: int) -> None:
    E, W, C = bufs.num_experts, bufs.world_size, bufs.capacity
    counts, status, n_slots = meta[:, :E], meta[:, E : E + layout.STATUS_COLUMNS], meta[:, -1]

    def bad_ids() -> str:
        s = int(torch.nonzero(status[:, 0] > 0)[0])
        num_bad, lo, hi = status[s].tolist()
        return (f"topk_idx on rank {s} of the group holds {num_bad} expert id(s) outside "
                f"[-1, {E}) (min {lo}, max {hi}); expected -1 or a global expert id")

    _fail((status[:, 0] == 0).all(), bad_ids)

    def too_many_slots() -> str:
        s = int(torch.nonzero(n_slots > bufs.max_slots)[0])
        return (f"rank {s} dispatched T * K = {int(n_slots[s])} slots, more than the buffers' "
                f"max_tokens_per_rank * top_k = {bufs.max_slots}; create SymmBuffers with a larger "
                f"max_tokens_per_rank")

    _fail((n_slots <= bufs.max_slots).all(), too_many_slots)
    if bufs.overflow == "drop":
        return
    padded = (counts.sum(0) + expert_alignment - 1) // expert_alignment * expert_alignment  # (E,)
    needed = padded.view(W, -1).sum(1)  # (W,) rows each rank must receive

    def overflow() -> str:
        r = int(torch.nonzero(needed > C)[0])
        return (f"symm_mem dispatch overflow: rank {r} must receive {int(needed[r])} rows "
                f"(expert_alignment={expert_alignment}) but the buffers' capacity is C = {C}; "
                f"create SymmBuffers with a larger capacity (default: the worst case), or with "
                f"overflow='drop' to drop the rows past C and count them")

    _fail((needed <= C).all(), overflow)


# --------------------------------------------------------------------------------------------
# Routing on the device (plain tensor maths, traced by torch.compile)


@dataclasses.dataclass(frozen=True)
class SymmRoute:
    """send_dst: (N,) int64, destination code ``rank * C + row`` of each send position, -1 where
    nothing is sent (a dropped slot, or a row past capacity); tokens_per_expert: (e,) rows of
    ``routed`` per local expert (padding included, cut at C); dropped: (W,) valid slots that
    did not fit in each rank's capacity."""

    send_dst: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor


def route(meta: torch.Tensor, topk_idx: torch.Tensor, order: torch.Tensor, bufs: SymmBuffers,
          expert_alignment: int) -> SymmRoute:
    """Where every send position of this rank lands, from the exchanged metadata (W, L).

    Destination row of the i-th slot for global expert g (owned by rank r = g // e):
    ``expert_start_r[g] + rows of g from lower source ranks + (i - first position of g here)``,
    which is the collective backend's expert-major, source-rank, send-order layout."""
    W, E, e, C = bufs.world_size, bufs.num_experts, bufs.num_local_experts, bufs.capacity
    A = expert_alignment
    counts = meta[:, :E]  # (W, E) counts[s, g]: slots rank s sends to expert g
    padded = ((counts.sum(0) + A - 1) // A * A).view(W, e)  # (W, e) group sizes on each owner
    expert_start = (padded.cumsum(1) - padded).view(E)  # (E,) first row of g's group on its owner
    earlier = counts.cumsum(0) - counts  # (W, E) rows of g from lower source ranks
    block_start = expert_start + earlier  # (W, E) first row of block (s, g) on g's owner
    mine = counts[bufs.rank]
    first_pos = mine.cumsum(0) - mine  # (E,) first send position of expert g on this rank
    N = order.shape[0]
    positions = torch.arange(N, device=order.device)
    g = topk_idx.reshape(-1).to(torch.int64).index_select(0, order)  # (N,) expert at each position
    valid = (g >= 0) & (g < E) & (positions < bufs.max_slots)
    g = g.clamp(0, E - 1)
    row = block_start[bufs.rank].index_select(0, g) + positions - first_pos.index_select(0, g)
    send_dst = torch.where(valid & (row < C), (g // e) * C + row, torch.full_like(row, -1))
    own_start = expert_start.view(W, e)[bufs.rank]
    tokens_per_expert = torch.minimum(padded[bufs.rank], (C - own_start).clamp(min=0))  # (e,)
    past = (block_start + counts - C).clamp(min=0)  # (W, E) rows of block (s, g) past C
    dropped = torch.minimum(past, counts).sum(0).view(W, e).sum(1)  # (W,)
    return SymmRoute(send_dst, tokens_per_expert, dropped)


# --------------------------------------------------------------------------------------------
# Ops. Each: entry barrier (peers are done reading what we will overwrite), kernel writes into
# peers' buffers, barrier (all writes landed), copy out of our own buffers into fresh tensors.


@comm_op("symm_exchange_meta")
def symm_exchange_meta_op(send_row: torch.Tensor, buffers: SymmBuffers, expert_alignment: int) -> torch.Tensor:
    """(L,) int64 metadata row of this rank -> (W, L), row s from rank s (an all-gather).

    Checks every rank's row (expert ids, T * K, and without overflow='drop' the capacity) and
    raises on all ranks alike."""
    k = kernels()
    buffers._barrier()
    k.put_meta(send_row.contiguous(), buffers.table[META], buffers.rank)
    buffers._barrier()
    meta = buffers.meta.clone()
    _check_meta(meta, buffers, expert_alignment)
    return meta


@symm_exchange_meta_op.register_fake
def _(send_row, buffers, expert_alignment):
    # NB: one row from each of the W ranks.
    return send_row.new_empty(buffers.world_size, send_row.shape[0])


@comm_op("symm_dispatch")
def symm_dispatch_op(
    x: torch.Tensor,
    scale: Optional[torch.Tensor],
    order: torch.Tensor,
    position: torch.Tensor,
    send_dst: torch.Tensor,
    buffers: SymmBuffers,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H) rows -> routed (C, H), row_src (C,) int64.

    Send position i carries row ``x[order[i] // K]`` (times ``scale.flat[order[i]]`` in fp32,
    rounded once) to ``send_dst[i]``. routed: rows received, zero where none; row_src: each
    row's source code (``rank * N_max + position``), -1 where none. position (T, K) is kept for
    the backward."""
    k = kernels()
    K = position.shape[1]
    acc = accumulation_dtype(x.dtype, *(() if scale is None else (scale.dtype,)))
    buffers._barrier()
    k.put_rows(
        x.contiguous(), send_dst, buffers.capacity, buffers.table[RECV],
        order=order, top_k=K, scale=None if scale is None else scale.contiguous(),
        tags_table=buffers.table[TAGS], tag_base=buffers.rank * buffers.max_slots, acc_dtype=acc,
    )
    buffers._barrier()
    routed = x.new_empty(buffers.capacity, x.shape[1])
    row_src = torch.empty(buffers.capacity, dtype=torch.int64, device=x.device)
    k.dispatch_copy_out(buffers.recv, buffers.tags, routed, row_src)
    return routed, row_src


@symm_dispatch_op.register_fake
def _(x, scale, order, position, send_dst, buffers):
    # NB: fixed capacity C, so no data-dependent size: the graph never waits for the counts.
    C = buffers.capacity
    return x.new_empty(C, x.shape[1]), x.new_empty(C, dtype=torch.int64)


def _symm_dispatch_setup_context(ctx, inputs, output):
    _, _, ctx.order, ctx.position, _, ctx.buffers = inputs
    ctx.save_for_backward(inputs[4], output[1])  # send_dst, row_src


def _symm_dispatch_backward(ctx, grad_routed, _grad_row_src):
    # The adjoint of dispatch is combine with unit weights.
    send_dst, row_src = ctx.saved_tensors
    grad_x, _ = symm_combine_op(
        grad_routed, None, ctx.order, ctx.position, send_dst, row_src, ctx.buffers, False
    )
    return grad_x, None, None, None, None, None


symm_dispatch_op.register_autograd(_symm_dispatch_backward, setup_context=_symm_dispatch_setup_context)


@comm_op("symm_combine")
def symm_combine_op(
    expert_out: torch.Tensor,
    weights: Optional[torch.Tensor],
    order: torch.Tensor,
    position: torch.Tensor,
    send_dst: torch.Tensor,
    row_src: torch.Tensor,
    buffers: SymmBuffers,
    save_returned: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, H) expert outputs in dispatch order -> y (T, H), returned (N, H) or (0, H).

    Row d goes back to its source (``row_src[d]``); then y[t] = sum_k weights[t, k] *
    row of slot (t, k), in k order, accumulated in fp32 (fp64) and rounded once. returned:
    every slot's row in send order (zero for unsent slots), when ``save_returned``, for the
    weights' gradient. order is kept for the backward."""
    k = kernels()
    T, K = position.shape
    buffers._barrier()
    k.put_rows(expert_out.contiguous(), row_src, buffers.max_slots, buffers.table[RET])
    buffers._barrier()
    H = expert_out.shape[1]
    y = expert_out.new_empty(T, H)
    returned = expert_out.new_empty(T * K if save_returned else 0, H)
    acc = accumulation_dtype(expert_out.dtype, *(() if weights is None else (weights.dtype,)))
    k.combine_reduce(
        buffers.ret, position, send_dst, None if weights is None else weights.contiguous(), y,
        returned if save_returned else None, acc,
    )
    return y, returned


@symm_combine_op.register_fake
def _(expert_out, weights, order, position, send_dst, row_src, buffers, save_returned):
    # NB: static shapes: T and K from position.
    T, K = position.shape
    H = expert_out.shape[1]
    return expert_out.new_empty(T, H), expert_out.new_empty(T * K if save_returned else 0, H)


def _symm_combine_setup_context(ctx, inputs, output):
    _, weights, ctx.order, ctx.position, _, _, ctx.buffers, save_returned = inputs
    ctx.save_for_backward(weights, inputs[4], output[1] if save_returned else None)
    ctx.mark_non_differentiable(output[1])  # an auxiliary output, kept for the weights' gradient


def _symm_combine_backward(ctx, grad_y, _grad_returned):
    weights, send_dst, returned = ctx.saved_tensors
    grad_expert_out = grad_weights = None
    if ctx.needs_input_grad[0]:
        # The adjoint of combine is dispatch with each slot's row scaled by its weight.
        grad_expert_out, _ = symm_dispatch_op(grad_y, weights, ctx.order, ctx.position, send_dst, ctx.buffers)
    if ctx.needs_input_grad[1]:
        if returned is None:
            raise RuntimeError(
                "symm_combine: topk_weights need a gradient, but the op was called with "
                "save_returned=False; alltoall_ops.combine sets it when the weights require grad"
            )
        grad_weights = symm_weight_grad_op(grad_y, returned, ctx.position, weights)
    return grad_expert_out, grad_weights, None, None, None, None, None, None


symm_combine_op.register_autograd(_symm_combine_backward, setup_context=_symm_combine_setup_context)


@torch.library.custom_op("alltoall_ops::symm_weight_grad", mutates_args=())
def symm_weight_grad_op(
    grad_y: torch.Tensor, returned: torch.Tensor, position: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """grad_w (T, K) = <grad_y[t], returned[position[t, k]]> in fp32 (fp64), in weights' dtype.
    Local: no communication."""
    grad_w = torch.empty(position.shape, dtype=weights.dtype, device=grad_y.device)
    acc = accumulation_dtype(returned.dtype, weights.dtype, grad_y.dtype)
    kernels().combine_weight_grad(grad_y.contiguous(), returned, position, grad_w, acc)
    return grad_w


@symm_weight_grad_op.register_fake
def _(grad_y, returned, position, weights):
    return weights.new_empty(position.shape)


# --------------------------------------------------------------------------------------------
# Public entry points (called by alltoall_ops.dispatch / combine)


@dataclasses.dataclass(frozen=True)
class SymmDispatchHandle(layout.SlotShape):
    """What ``combine`` needs to undo one symm_mem ``dispatch``; tensors, ints and the buffers.

    order (N,), position (T, K): this rank's send order; meta (W, L): every rank's counts;
    send_dst (N,): destination of each send position; row_src (C,): source of each routed row;
    dropped (W,): slots past each rank's capacity (overflow='drop'); num_rows: C."""

    order: torch.Tensor
    position: torch.Tensor
    meta: torch.Tensor
    send_dst: torch.Tensor
    row_src: torch.Tensor
    dropped: torch.Tensor
    buffers: SymmBuffers
    num_rows: int
    expert_alignment: int


_AUTO_BUFFERS: dict[tuple, SymmBuffers] = {}


def _max_over_ranks(value: int, grp: Group, device: torch.device) -> int:
    """Host sync: the largest ``value`` over the group (one small all-reduce)."""
    if grp.size == 1:
        return value
    pg = process_group(grp.name)
    on = device if dist.get_backend(pg) != "gloo" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    return int(t)


def cached_buffers(x: torch.Tensor, top_k: int, num_experts: int, grp: Group, expert_alignment: int) -> SymmBuffers:
    """Eager convenience: buffers cached per (group, H, dtype, device), created sized from the
    largest T over the ranks and re-created larger when a call needs more. Collective; costs one
    small all-reduce per call (a host sync), which is why compiled code must pass ``buffers=``."""
    if is_compiling():
        raise RuntimeError(
            "dispatch(backend='symm_mem') under torch.compile needs buffers=: create "
            "alltoall_ops.SymmBuffers(max_tokens_per_rank=..., hidden=..., top_k=..., num_experts=..., "
            "dtype=..., device=..., group=...) once, outside the compiled region, and pass it in"
        )
    T, H = x.shape
    t_max = _max_over_ranks(T, grp, x.device)
    key = (grp.name, H, x.dtype, x.device)
    bufs = _AUTO_BUFFERS.get(key)
    if (bufs is None or bufs.max_tokens_per_rank < t_max or bufs.top_k < top_k
            or bufs.num_experts != num_experts or bufs.expert_alignment < expert_alignment):
        t_max = max(t_max, 1, bufs.max_tokens_per_rank if bufs is not None else 1)
        group = None if grp.name == LOCAL else process_group(grp.name)
        bufs = SymmBuffers(t_max, H, top_k, num_experts, x.dtype, x.device, group,
                           expert_alignment=expert_alignment)
        _AUTO_BUFFERS[key] = bufs
    return bufs


def _check_buffers_fit(
    bufs: SymmBuffers, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, group: Any
) -> None:
    """Static checks (shapes, dtypes: the same on every rank of an SPMD program)."""
    if group is not None and resolve_group(group).name != bufs.group_name:
        raise ValueError(
            f"group: the buffers were created for group {bufs.group_name!r}, got group "
            f"{resolve_group(group).name!r}; pass group=None or the buffers' group"
        )
    if x.dtype != bufs.dtype or x.shape[1] != bufs.hidden or x.device != bufs.device:
        raise ValueError(
            f"x: the buffers hold {bufs.dtype} rows of H = {bufs.hidden} on {bufs.device}, got "
            f"{x.dtype} of shape {tuple(x.shape)} on {x.device}"
        )
    if topk_idx.shape[1] > bufs.top_k:
        raise ValueError(f"topk_idx: the buffers were sized for top_k = {bufs.top_k}, got K = {topk_idx.shape[1]}")
    if num_experts != bufs.num_experts:
        raise ValueError(f"num_experts: the buffers were created for E = {bufs.num_experts}, got {num_experts}")


def dispatch(
    x: torch.Tensor, topk_idx: torch.Tensor, *, num_experts: int, group: Any, expert_alignment: int,
    buffers: Optional[SymmBuffers],
) -> tuple[torch.Tensor, torch.Tensor, SymmDispatchHandle]:
    """``alltoall_ops.dispatch(..., backend="symm_mem")``: routed (C, H), tokens_per_expert (e,),
    handle. The first ``tokens_per_expert.sum()`` rows of routed are the collective backend's
    routed rows; the rest are zero."""
    if buffers is not None and not isinstance(buffers, SymmBuffers):
        raise TypeError(f"buffers: expected alltoall_ops.SymmBuffers, got {type(buffers).__name__}")
    if buffers is None:
        grp = resolve_group(group)
        check_dispatch_args(x, topk_idx, num_experts, grp.size, expert_alignment)
        buffers = cached_buffers(x, topk_idx.shape[1], num_experts, grp, expert_alignment)
    else:
        check_dispatch_args(x, topk_idx, num_experts, buffers.world_size, expert_alignment)
    _check_buffers_fit(buffers, x, topk_idx, num_experts, group)
    W, e = buffers.world_size, buffers.num_local_experts
    plan = layout.plan_routing(topk_idx, num_experts, W)
    n_slots = torch.full((1,), topk_idx.numel(), dtype=torch.int64, device=x.device)
    send_row = torch.cat([plan.send_meta[:, :e].reshape(-1), plan.send_meta[0, e:], n_slots])  # (L,)
    meta = symm_exchange_meta_op(send_row, buffers, expert_alignment)
    r = route(meta, topk_idx, plan.order, buffers, expert_alignment)
    routed, row_src = symm_dispatch_op(x, None, plan.order, plan.position, r.send_dst, buffers)
    handle = SymmDispatchHandle(plan.order, plan.position, meta, r.send_dst, row_src, r.dropped,
                                buffers, buffers.capacity, expert_alignment)
    return routed, r.tokens_per_expert, handle


def combine(expert_out: torch.Tensor, handle: SymmDispatchHandle, topk_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``alltoall_ops.combine`` for a symm_mem handle: y (T, H); rows of expert_out that
    dispatch did not fill are ignored."""
    check_combine_args(expert_out, handle, topk_weights)
    bufs = handle.buffers
    if tuple(expert_out.shape) != (bufs.capacity, bufs.hidden) or expert_out.dtype != bufs.dtype:
        raise ValueError(
            f"expert_out: expected the {bufs.dtype} shape (C, H) = ({bufs.capacity}, {bufs.hidden}) of "
            f"routed, got {expert_out.dtype} of shape {tuple(expert_out.shape)}"
        )
    save_returned = topk_weights is not None and topk_weights.requires_grad and torch.is_grad_enabled()
    y, _ = symm_combine_op(expert_out, topk_weights, handle.order, handle.position, handle.send_dst,
                           handle.row_src, bufs, save_returned)
    return y
