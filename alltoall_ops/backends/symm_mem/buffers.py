"""``SymmBuffers`` (an opaque value type), its configuration, and ``run_simulated``."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import uuid
from typing import Any, Callable, Optional, Sequence

import torch

from ... import fp8, layout
from ..._compat import OpaqueBase, register_value_type
from ...payload import PLAIN, Format, format_of
from ...comm import get_timeout
from ...groups import LOCAL, resolve_group
from ...kernels.loader import check_kernels_run_on
from ...kernels.region import TAG_COLUMNS
from ...validation import check_num_experts, positive_int
from .segments import _Segments, address_table, check_same_sizes, make_segments, simulated_segments

logger = logging.getLogger(__name__)

TAGS, ROWS, META = range(3)
"""The regions of a segment, each with its address table (``SymmBuffers.tables``)."""

N_SLOTS, ALIGNMENT, FAILED, CALL = range(layout.STATUS_COLUMNS, layout.STATUS_COLUMNS + 4)
META_EXTRA = layout.STATUS_COLUMNS + 4
"""Columns of a metadata row after the E counts: the routing status, then N = T * K, the
dispatch's expert_alignment, a failure flag (the rank rejected its arguments) and the
buffers' call number (ranks out of step see different ones)."""

_REGION_ALIGN = 256
OVERFLOW_MODES = ("error", "drop")


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
    payload_dtype: Optional[torch.dtype] = None
    num_sms: Optional[int] = None  # this rank's SM budget (not agreed: it changes no result)

    @property
    def shared(self) -> tuple:
        """What every rank must agree on."""
        return (self.world_size, self.max_tokens_per_rank, self.hidden, self.top_k, self.num_experts,
                self.expert_alignment, self.capacity, self.overflow, str(self.dtype), self.device.type,
                str(self.payload_dtype))

    def region_offsets(self) -> tuple[list[int], int]:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        N_max = self.max_tokens_per_rank * self.top_k
        meta_cols = self.num_experts + META_EXTRA
        # NB: ROWS holds N_max rows of ``dtype`` (combine's returned rows; the stage of a dispatch
        # of combine's gradient, as N "tokens" in double backward) or T_max wire rows (the stage of
        # an fp8 dispatch).
        wire_bytes = format_of(self.payload_dtype).wire_bytes(self.hidden, self.dtype)
        rows_bytes = max(N_max * self.hidden * itemsize, self.max_tokens_per_rank * wire_bytes)
        sizes = [(1 + N_max) * TAG_COLUMNS * 8, rows_bytes, self.world_size * meta_cols * 8]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += layout.round_up(max(size, 1), _REGION_ALIGN)
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
    capacity: Optional[int], overflow: str, payload_dtype: Optional[torch.dtype] = None,
    num_sms: Optional[int] = None,
) -> _Config:
    max_tokens_per_rank = positive_int("max_tokens_per_rank", max_tokens_per_rank)
    hidden, top_k = positive_int("hidden", hidden), positive_int("top_k", top_k)
    num_experts = check_num_experts(num_experts, world_size)
    expert_alignment = positive_int("expert_alignment", expert_alignment)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow: expected one of {OVERFLOW_MODES}, got {overflow!r}")
    fp8.check_payload_dtype(payload_dtype)
    if payload_dtype is not None:
        fp8.check_hidden("hidden", hidden)
    e = num_experts // world_size
    worst = world_size * max_tokens_per_rank * top_k + e * (expert_alignment - 1)
    if capacity is None:
        capacity = worst
    else:
        capacity = positive_int("capacity", capacity)
    num_sms = None if num_sms is None else positive_int("num_sms", num_sms)
    return _Config(rank, world_size, group_name, max_tokens_per_rank, hidden, top_k, num_experts,
                   expert_alignment, capacity, overflow, dtype, device, payload_dtype, num_sms)


class PeerBuffers(OpaqueBase):
    """What every buffers type over a segment that the group's peers write shares (``SymmBuffers``,
    ``UlyssesBuffers``): an opaque value type, equal only to itself, named in compiled code by a
    key, never copied, never pickled. A subclass sets ``_segments`` and ``_config_key`` (its
    configuration, which ``_CONFIG_FIELDS`` names, then the addresses compiled code may hold:
    ``_Segments.compiled_addresses``) and registers itself with ``register_value_type``."""

    _segments: _Segments
    _config_key: tuple
    _CONFIG_FIELDS = ""
    _key: Optional[int] = None  # in _COMPILED, once compiled code names these buffers

    # NB: an opaque value type (torch.compile embeds it as a constant, guarded on ``==``): equal
    # only to itself, so two buffers never share one compiled graph (nor its recorded CUDA graph,
    # which replays fixed addresses). The generated code names it by a key in _COMPILED, with
    # its configuration, which the compile caches hash: a cached graph is reused only for
    # buffers of the same configuration, and the lookup checks it.
    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        with _COMPILED_LOCK:
            if self._key is None:
                self._key = len(_COMPILED)
                _COMPILED[self._key] = self
        name = type(self).__name__
        return (f"{name}._compiled({self._key}, {self._config_key!r}, inlined={self._segments.device_ordered})",
                {name: type(self)})

    @classmethod
    def _compiled(cls, key: int, config_key: tuple, inlined: bool = False) -> "PeerBuffers":
        """The buffers that compiled code names (see ``__fx_repr__``). ``inlined``: whether their
        ops were inlined when the code was traced (``ALLTOALL_OPS_INLINE_SYMMETRIC`` is read
        then, after the compile caches computed their key from this repr): only part of the key,
        so that a graph traced with the switch off is never served with it on, or the reverse."""
        bufs = _COMPILED.get(key)
        if not isinstance(bufs, cls) or bufs._config_key != config_key:
            raise RuntimeError(
                f"compiled code names {cls.__name__} #{key} with ({cls._CONFIG_FIELDS}, addresses) = "
                f"{config_key}, but this process holds {'no such buffers' if bufs is None else bufs._config_key} "
                "(code from another process's compile cache?)"
            )
        return bufs

    # NB: a handle to memory that peers write: a copy would read buffers nobody writes. Graph
    # modules deep-copy their attributes (seen with AOTAutograd's dynamic-shape path), so copies
    # are the object itself.
    def __copy__(self) -> "PeerBuffers":
        return self

    def __deepcopy__(self, memo: dict) -> "PeerBuffers":
        return self

    # NB: torch's compile caches pickle what they hash; torch 2.11's inductor wrote
    # ``pickle.loads(<the object's bytes>)`` into the generated module for an opaque graph input
    # (a GB-sized literal for a large segment, which then failed to import). Pickle the
    # configuration, never the memory; a loaded copy would be memory no peer writes, so loading
    # raises.
    def __reduce__(self) -> tuple:
        return _load_pickled_buffers, (type(self).__name__, self._CONFIG_FIELDS,
                                       [*self._config_key, self._segments.device_ordered])


class SymmBuffers(PeerBuffers):
    """Receive buffers, tags, returned rows, metadata and pointer tables for ``backend="symm_mem"``.

    Collective: every rank of ``group`` creates it with the same arguments, once, and passes it
    as ``buffers=`` to :func:`alltoall_ops.dispatch`. Under torch.compile it is a constant of the
    graph (an opaque value type, equal only to itself), never a graph input, so
    ``mode="reduce-overhead"`` captures the layer: each distinct ``SymmBuffers`` compiles once,
    and buffers embedded in compiled code are held for the life of the process (a recorded CUDA
    graph keeps the addresses of their memory).

    Args:
        max_tokens_per_rank: T_max, the most tokens any rank dispatches in one call.
        hidden: H. top_k: K, the most slots per token. num_experts: E, divisible by W.
        dtype: of x and the expert outputs (with an fp8 payload: of the expert outputs, and of
            the rows dequantized with ``dequantize=True``). device: cuda (default when there is
            one) or cpu.
        group: ProcessGroup, 1-D DeviceMesh or None (default group; one rank without one).
        expert_alignment: the largest ``expert_alignment`` dispatch will be called with (for C).
        capacity: C, rows of ``routed``; default ``W * T_max * K + e * (expert_alignment - 1)``,
            which no routing can exceed.
        overflow: "error" (a routing that needs more than C rows on some rank raises on every
            rank) or "drop" (rows past C are not delivered, counted in ``handle.dropped_W``).
        allocator: "auto" (CUDA symmetric memory for W > 1 on cuda, a shared-memory stand-in on
            the CPU, plain memory for one rank) or "symmetric" (that memory, and the ops' path
            with peers: barriers, the metadata put, tags and stages, even for one rank, in a
            process group of one: a check of that path on one GPU or CPU process).
        timeout: seconds a barrier waits for its peers (default: the library's deadline,
            :func:`alltoall_ops.set_timeout`). Past it the CPU stand-in raises
            :class:`alltoall_ops.errors.CollectiveTimeout`; the CUDA barrier kernel fails a device-side
            assert (a CUDA error at the next sync; the context is then unusable).
        payload_dtype: None, or ``torch.float8_e4m3fn`` for dispatches with an fp8 payload
            (``dispatch(..., payload_dtype=torch.float8_e4m3fn)`` or ``x=(values, scales)``; H
            divisible by 128): the receive region then holds packed wire rows of
            ``fp8.packed_width(H)`` bytes (``payload.FP8Format``). Such buffers serve fp8 dispatches
            only.
        num_sms: None (no cap, the default) or the SM budget of the kernels that dispatch and
            combine launch on these buffers (DeepEP's ``Buffer.set_num_sms``), so that a GEMM on
            another stream keeps the other SMs: each such launch runs at most ``num_sms``
            programs (one program per SM; each strides over its row blocks), the one-program
            barrier and metadata kernels aside. Results are the same for every budget. A
            setting of this rank only: ranks may differ.

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
        timeout: Optional[float] = None,
        payload_dtype: Optional[torch.dtype] = None,
        num_sms: Optional[int] = None,
    ):
        if allocator not in ("auto", "symmetric"):
            raise ValueError(f"allocator: expected 'auto' or 'symmetric', got {allocator!r}")
        grp = resolve_group(group)
        device = _default_device(device)
        cfg = _make_config(grp.rank, grp.size, grp.name, max_tokens_per_rank, hidden, top_k,
                           num_experts, dtype, device, expert_alignment, capacity, overflow, payload_dtype,
                           num_sms)
        check_kernels_run_on(device)
        if grp.size > 1:
            check_same_sizes("SymmBuffers", "W, T_max, H, K, E, alignment, C, overflow, dtype, device type, "
                             "payload dtype", cfg.shared, grp.name)
        _, nbytes = cfg.region_offsets()
        if allocator == "symmetric" and grp.name == LOCAL:
            raise ValueError("allocator='symmetric': the memory peers can reach needs a process group, even of "
                             "one rank; pass group= (or initialise torch.distributed)")
        timeout = get_timeout() if timeout is None else timeout
        segments = make_segments(nbytes, grp, device, timeout, symmetric=allocator == "symmetric")
        self._setup(cfg, segments, peer_path=grp.size > 1 or allocator == "symmetric")

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
        payload_dtype: Optional[torch.dtype] = None,
        num_sms: Optional[int] = None,
    ) -> list["SymmBuffers"]:
        """Buffers of ``world_size`` simulated ranks in this process, on one device: run rank r's
        calls with ``buffers[r]`` in its own thread (see :func:`run_simulated`)."""
        device = _default_device(device)
        check_kernels_run_on(device)
        name = f"simulated-{uuid.uuid4().hex[:8]}"
        cfgs = [
            _make_config(r, world_size, name, max_tokens_per_rank, hidden, top_k, num_experts,
                         dtype, device, expert_alignment, capacity, overflow, payload_dtype, num_sms)
            for r in range(world_size)
        ]
        segments = simulated_segments(world_size, cfgs[0].region_offsets()[1], device, timeout)
        out = []
        for cfg, seg in zip(cfgs, segments):
            bufs = cls.__new__(cls)
            bufs._setup(cfg, seg, peer_path=world_size > 1)
            out.append(bufs)
        return out

    _CONFIG_FIELDS = ("rank, W, T_max, H, K, E, alignment, C, overflow, dtype, device type, payload dtype, group, "
                      "num_sms")

    def _setup(self, cfg: _Config, segments: _Segments, peer_path: bool) -> None:
        self._cfg = cfg
        self._segments = segments
        # whether the ops exchange through the segments as with peers (barriers, the metadata put,
        # tags, stages): W > 1, or allocator='symmetric'; else (one rank) they read the rows where
        # they are (the placement's row map, no barrier)
        self.peer_path = peer_path
        self._own_error: Optional[str] = None  # this rank's argument error, while it tells its peers
        # what the T * K error tells the caller to do; whoever makes the buffers for it may say it its way
        self.max_tokens_hint = "create SymmBuffers with a larger max_tokens_per_rank"
        # NB: with every address compiled code with symm_mem's ops inlined holds as a constant (the
        # address tables, the barrier's pads and counter): AOTAutograd's cache keys a graph on this
        # repr, not on the constants (a hit in another process would run on that one's addresses).
        self._config_key = (cfg.rank, *cfg.shared, cfg.group_name, cfg.num_sms, segments.compiled_addresses())
        for field in dataclasses.fields(cfg):
            setattr(self, field.name, getattr(cfg, field.name))
        self.num_local_experts = cfg.num_experts // cfg.world_size
        self.max_slots = cfg.max_tokens_per_rank * cfg.top_k  # N_max
        self.meta_columns = cfg.num_experts + META_EXTRA  # L
        offsets, segment_bytes = cfg.region_offsets()
        H, W = cfg.hidden, cfg.world_size

        def region(i: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            n = 1
            for s in shape:
                n *= s
            itemsize = torch.empty((), dtype=dtype).element_size()
            return segments.local[offsets[i] : offsets[i] + n * itemsize].view(dtype).view(shape)

        self.tags = region(TAGS, torch.int64, (1 + self.max_slots, TAG_COLUMNS))  # a header, then a tag a slot
        self.rows = region(ROWS, cfg.dtype, (self.max_slots, H))  # returned rows, or a dispatch's stage
        self.meta = region(META, torch.int64, (W, self.meta_columns))
        # (1, W) int64 base addresses of region i (TAGS, ROWS, META) on every rank; immutable.
        # NB: one tensor per region, so that compiled code holds each as a constant and indexes
        # none of them with a torch op (inductor would fold it on the real tensor); 2-D, since
        # inductor writes a 1-D constant of up to 8 elements into its code as literals, made
        # into a fresh tensor by a kernel of its own at every use.
        self.tables = tuple(address_table([base + off for base in segments.bases], cfg.device) for off in offsets)
        segments.setup_barrier()  # every rank's segment exists before any peer reaches it
        logger.info("%r: %.1f MiB per rank (%s)", self, segment_bytes / 2**20, type(segments).__name__)

    def __repr__(self) -> str:
        return (f"SymmBuffers(rank={self.rank}, world_size={self.world_size}, T_max={self.max_tokens_per_rank}, "
                f"H={self.hidden}, K={self.top_k}, E={self.num_experts}, C={self.capacity}, "
                f"dtype={self.dtype}, device={self.device}, overflow={self.overflow!r}"
                + ("" if self.payload_dtype is None else f", payload_dtype={self.payload_dtype}")
                + ("" if self.num_sms is None else f", num_sms={self.num_sms}") + ")")


_CONSTANT_MEMBERS = (
    "rank", "world_size", "group_name", "max_tokens_per_rank", "hidden", "top_k", "num_experts",
    "expert_alignment", "capacity", "overflow", "dtype", "device", "num_local_experts", "max_slots",
    "meta_columns", "payload_dtype", "num_sms",
)
register_value_type(SymmBuffers, constant_members=_CONSTANT_MEMBERS)

_COMPILED: dict[int, PeerBuffers] = {}
"""Buffers that compiled code names, by key: held for the process."""
_COMPILED_LOCK = threading.Lock()


def _load_pickled_buffers(type_name: str, fields: str, key: list) -> PeerBuffers:
    raise RuntimeError(
        f"{type_name} cannot be unpickled (pickled: {fields}, addresses, inlined = {key}): they are memory that "
        f"the group's peers write; create them collectively with alltoall_ops.{type_name}(...) in the process "
        "that uses them"
    )


def check_payload(bufs: SymmBuffers, fmt: Format) -> None:
    """Raise unless ``bufs`` serve dispatches of the payload format ``fmt``: buffers created with
    a ``payload_dtype`` hold its wire rows and serve that format only."""
    own = format_of(bufs.payload_dtype)
    if fmt is own:
        return
    if fmt is not PLAIN:
        raise ValueError(
            f"payload_dtype: an {fmt.name} dispatch needs buffers created with payload_dtype={fmt.payload_dtype}: the "
            f"buffers hold no {fmt.name} wire rows (created with payload_dtype={bufs.payload_dtype})"
        )
    raise ValueError(
        f"payload_dtype: the buffers were created with payload_dtype={bufs.payload_dtype} and serve "
        f"{own.name} dispatches only: pass payload_dtype={bufs.payload_dtype} (or x=(values, scales)), "
        f"or use buffers created without payload_dtype"
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

    threads = [threading.Thread(target=body, args=(r,), name=f"simulated rank {r}") for r in range(len(buffers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        primary = [e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)] or errors
        rank, exc = min(primary, key=lambda e: e[0])
        raise RuntimeError(f"simulated rank {rank} raised {type(exc).__name__}: {exc}") from exc
    return results
