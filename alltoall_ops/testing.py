"""What the tests, the GPU checks (``tools/gpu_*``) and the benchmarks share: a multi-process
harness (W real processes joined in a gloo process group), counters of comm ops and host
traffic, the debug and NaN-fill modes, a short deadline with a late rank, and inputs (``routing``), a small MoE layer
(``moe_step``) and timers (``timer``, ``host_us``).

Example::

    with DistributedPool(world_size=4) as pool:
        results = pool.run(check_something, arg)   # check_something(rank, world_size, arg)

Functions must be importable (module-level) since they travel by reference to spawned
processes. A rank that raises makes ``run`` raise :class:`RankFailures` carrying every failed
rank's traceback; a rank that does not answer in time makes the pool kill its processes and
raise too, naming the silent ranks. Nothing hangs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import queue
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from . import api, comm
from .comm import communication_ops
from .layout import HostSplits, expert_of_rows

GLOO_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class RankError:
    """An exception raised on one rank, as it crossed the process boundary."""

    type_name: str
    message: str
    traceback: str


class RankFailures(RuntimeError):
    """Some ranks raised, timed out or died. ``errors``: rank -> RankError; ``silent``: ranks that
    did not answer (timed out or died)."""

    def __init__(self, errors: dict[int, RankError], silent: list[int]):
        self.errors = errors
        self.silent = silent
        parts = [f"rank {r} raised {e.type_name}: {e.message}\n{e.traceback}" for r, e in sorted(errors.items())]
        if silent:
            parts.append(f"ranks {silent} did not answer in time, or died (killed)")
        super().__init__("\n".join(parts))


def _worker(rank: int, world_size: int, store_port: int, tasks: mp.Queue, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, world_size + 1, is_master=False)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=GLOO_TIMEOUT_S),
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException as exc:  # report everything, including assertion failures
            err = RankError(type(exc).__name__, str(exc), traceback.format_exc())
            results.put((rank, False, err))
    dist.destroy_process_group()
    results.close()
    results.join_thread()  # flush what this rank reported before leaving
    # NB: os._exit skips multiprocessing's exit finalizers, which unlink the semaphores this
    # process made (tqdm's lock, made by torch.fx's Interpreter at a compile): left to the
    # resource tracker, which warns "leaked semaphore objects" at shutdown. Run them first.
    mp_util._run_finalizers()
    os._exit(0)  # skip interpreter teardown (seconds per process with torch loaded)


class DistributedPool:
    """``world_size`` spawned processes in one gloo group, reused across ``run`` calls."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs: list = []

    def __enter__(self) -> "DistributedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        # The parent holds the store so that ports are never guessed.
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True, wait_for_workers=False)
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, self._store.port, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, *args: Any, timeout: float = 180.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return results by rank."""
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        answers: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size and time.monotonic() < deadline:
            try:  # NB: short polls, so that a rank that died is noticed at once
                rank, ok, value = self._results.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
                answers[rank] = (ok, value)
            except queue.Empty:
                if all(not self._procs[r].is_alive() for r in range(self.world_size) if r not in answers):
                    break  # every rank still owing an answer has died
        silent = [r for r in range(self.world_size) if r not in answers]
        errors = {r: v for r, (ok, v) in answers.items() if not ok}
        if silent:
            self.close()  # a silent rank may be stuck in a collective: start afresh next time
        if errors or silent:
            raise RankFailures(errors, silent)
        return [answers[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        if not self._procs:  # never started (or already closed)
            return
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []


class CommOpCounter(TorchDispatchMode):
    """A dispatch mode recording the names of this library's comm ops as they run, a dispatch
    of a quantized payload with its format::

        with CommOpCounter() as counter:
            loss.backward()
        counter.ops  # ['alltoall_ops::dispatch', 'alltoall_ops::combine'] ('alltoall_ops::dispatch(payload=fp8)')
    """

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in communication_ops():
            named = {**dict(zip((a.name for a in func._schema.arguments), args)), **(kwargs or {})}
            payload = named.get("payload", "plain")
            self.ops.append(func.name() + ("" if payload == "plain" else f"(payload={payload})"))
        return func(*args, **(kwargs or {}))



class TorchOpBytes(TorchDispatchMode):
    """A dispatch mode summing the bytes each torch op writes into ``written`` (by op name): its
    fresh outputs and the tensors it mutates, whole; views and ``empty*`` allocations write
    nothing. The package's own ops are entered: their bodies' torch ops are counted, not their
    outputs; inside an interpreted launch that ``bytes_written`` records, nothing (the
    interpreter's copies of the kernel's arguments). A mode is per thread: simulated ranks each
    enter one on a shared counter."""

    _NOTHING_WRITTEN = ("aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                        "aten::new_empty_strided")

    def __init__(self, written: collections.Counter):
        super().__init__()
        self.written = written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from ._compat import _IMPLS
        from .kernels.races import in_recorded_launch

        kwargs = kwargs or {}
        if in_recorded_launch():  # the interpreter's own copies of a kernel's arguments
            return func(*args, **kwargs)
        if func.namespace == "alltoall_ops":
            impl = next(fn for op, fn in _IMPLS.items() if op._opoverload is func)
            with TorchOpBytes(self.written):
                return impl(*args, **kwargs)
        out = func(*args, **kwargs)
        schema = func._schema
        values = (*args, *(kwargs.get(a.name) for a in schema.arguments[len(args):]))
        written = [v for a, v in zip(schema.arguments, values) if a.alias_info is not None and a.alias_info.is_write]
        fresh = schema.name not in self._NOTHING_WRITTEN and all(r.alias_info is None for r in schema.returns)
        if not written and fresh:
            written = list(out) if isinstance(out, (tuple, list)) else [out]
        self.written[schema.name] += sum(t.numel() * t.element_size() for t in written if isinstance(t, torch.Tensor))
        return out


@contextlib.contextmanager
def bytes_written() -> Iterator[collections.Counter]:
    """The bytes a piece of code writes on the CPU, by kernel or torch op name::

        with bytes_written() as written:   # kernels of every thread, torch ops of this one
            dispatch(...)                  # simulated ranks: each thread enters TorchOpBytes(written)
        sum(written.values())

    Kernels (Triton's interpreter): their masked-in stores (``kernels.races.record_stored_bytes``);
    torch ops: as :class:`TorchOpBytes` counts them. The counter is filled at the exit."""
    from .kernels.races import record_stored_bytes

    written: collections.Counter = collections.Counter()
    with record_stored_bytes() as by_kernel, TorchOpBytes(written):
        yield written
    written.update(by_kernel)


_READS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")
_COLLECTIVES = ("all_to_all_single", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast",
                "all_gather_object", "barrier", "send", "recv", "reduce_scatter_tensor")


class HostTraffic:
    """What a step costs besides its kernels, counted while the context is active (eager or
    compiled code)::

        with HostTraffic() as traffic:
            layer(x).sum().backward()
        traffic.reads        # host reads of tensor data (on a GPU each is a device sync)
        traffic.collectives  # Counter of host-issued torch.distributed calls, by name

    A read is a call of ``Tensor.tolist``, ``item``, ``numpy``, ``bool()``, ``int()``, ``float()``
    or ``operator.index`` on a tensor. Reads of the CPU split sizes that the dispatch's one
    device read produced (``layout.HostSplits.of``) are not counted: they never wait for a
    device."""

    def __init__(self):
        self.reads = 0
        self.collectives: collections.Counter = collections.Counter()
        self._host_only = False  # inside HostSplits.of
        self._saved: dict = {}

    def _patch(self, owner, name: str, wrap: Callable) -> None:
        self._saved[(owner, name)] = vars(owner).get(name)  # None: inherited
        setattr(owner, name, wrap(getattr(owner, name)))

    def _read(self, original):
        def read(t, *args, **kwargs):
            self.reads += not self._host_only
            return original(t, *args, **kwargs)
        return read

    def _collective(self, name: str):
        def wrap(original):
            def collective(*args, **kwargs):
                self.collectives[name] += 1
                return original(*args, **kwargs)
            return collective
        return wrap

    def _host_splits(self, original):
        def of(splits_S):
            self._host_only = True
            try:
                return original(splits_S)
            finally:
                self._host_only = False
        return staticmethod(of)

    def __enter__(self) -> "HostTraffic":
        for name in _READS:
            self._patch(torch.Tensor, name, self._read)
        for name in _COLLECTIVES:
            self._patch(dist, name, self._collective(name))
        self._patch(HostSplits, "of", self._host_splits)
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), own in self._saved.items():
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._saved.clear()


@contextlib.contextmanager
def _switch(variable: str, enabled: bool) -> Iterator[None]:
    """The environment's ``variable`` set to "1" (``enabled``) or "0" inside the block, restored after."""
    before = os.environ.get(variable)
    os.environ[variable] = "1" if enabled else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[variable]
        else:
            os.environ[variable] = before


def debug_mode(enabled: bool = True) -> contextlib.AbstractContextManager:
    """``ALLTOALL_OPS_DEBUG=1`` (``enabled``) or ``0`` inside the block (see
    ``alltoall_ops.comm.debug``), restored after."""
    return _switch("ALLTOALL_OPS_DEBUG", enabled)


def inline_symmetric(enabled: bool = True) -> contextlib.AbstractContextManager:
    """``ALLTOALL_OPS_INLINE_SYMMETRIC=1`` (``enabled``) or ``0`` inside the block, restored after:
    graphs traced inside inline symm_mem's ops on CUDA symmetric memory (or keep them calls)."""
    from .backends.symm_mem.segments import INLINE_SYMMETRIC

    return _switch(INLINE_SYMMETRIC, enabled)


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """A default process group of this one process inside the block (NCCL with ``device`` on
    CUDA, gloo on the CPU), destroyed after: what a one-GPU tool or benchmark needs for the
    process-group paths (``all_to_all_single``, ``SymmBuffers(allocator="symmetric")``). An
    existing default group is used as it is, and left alone."""
    if dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", index))
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def deadline(seconds: float, late: bool = False) -> Iterator[None]:
    """The library's deadline (:func:`alltoall_ops.set_timeout`) set to ``seconds`` inside the
    block, restored after. ``late``: this rank enters the block 1.5 x ``seconds`` late, so that
    its peers' waits for it (in the block) pass their deadline first."""
    before = comm.get_timeout()
    comm.set_timeout(seconds)
    try:
        if late:
            time.sleep(1.5 * seconds)
        yield
    finally:
        comm.set_timeout(before)


@contextlib.contextmanager
def nan_unwritten_rows() -> Iterator[list[int]]:
    """Inside the block (this process, every thread), symm_mem's pull (fp8 values dequantized or
    not) pre-fills its outputs with NaN, so the rows it does not write (routed's past
    ``tokens_per_expert.sum()``, fp8 values and scales included, and the same rows of combine's
    backward) hold NaN: expert code that lets them reach a result or a gradient shows it; their
    row_src (not written either) holds 0, a valid source, so a combine that read one would move
    it to slot 0. Yields
    the number of such rows of each pull (a host read per call)::

        with nan_unwritten_rows() as unwritten:
            layer(x).sum().backward()      # y and every gradient free of NaN
        assert min(unwritten) > 0          # the rows were there
    """
    from .kernels import loader

    k = loader.load()
    pull_rows, unwritten = k.pull_rows, []

    def nan_prefilled(tags, num_routed, out, row_src, *, tail=None, **kwargs):
        # uint8 (fp8 wire rows): all ones, NaN as float8_e4m3fn values and as fp32 scale bytes
        for t in (out, tail) if tail is not None else (out,):
            t.fill_(0xFF if t.dtype == torch.uint8 else float("nan"))
        row_src.fill_(0)  # a valid source code: a combine that read a row past num_routed would move it
        pull_rows(tags, num_routed, out, row_src, tail=tail, **kwargs)
        unwritten.append(out.shape[0] - int(num_routed))

    k.pull_rows = nan_prefilled
    try:
        yield unwritten
    finally:
        k.pull_rows = pull_rows


# --- inputs, a layer and timers shared by the tests, the GPU checks and the benchmarks -------


def routing(T: int, K: int, E: int, *, seed: int, device: torch.device | str = "cpu",
            dropped: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random top-k routing: ``topk_idx`` (T, K) int64, K distinct experts per token, and
    ``weights`` (T, K) fp32, their softmax probabilities. ``dropped``: the expected fraction of
    slots set to -1 (routed nowhere; their weights stay)."""
    g = torch.Generator(device=device).manual_seed(seed)
    weights_TK, topk_idx_TK = torch.randn(T, E, device=device, generator=g).softmax(-1).topk(K, dim=-1)
    if dropped:
        topk_idx_TK = topk_idx_TK.masked_fill(torch.rand(T, K, device=device, generator=g) < dropped, -1)
    return topk_idx_TK, weights_TK


def moe_step(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, weights_TK: torch.Tensor,
             expert_w_eHH: torch.Tensor, num_experts: int, **dispatch_kwargs: Any) -> torch.Tensor:
    """A small MoE layer: dispatch, ``tanh(row @ expert_w_eHH[its expert])`` per routed row,
    combine; ``dispatch_kwargs`` go to :func:`alltoall_ops.dispatch` (backend, buffers,
    expert_alignment, ...). The expert matmul runs in fp32 at least, so that a bf16 error
    measures the ops, not bf16 sums. Rows past ``tokens_per_expert.sum()`` (local: zero;
    symm_mem: unspecified, may hold NaN) are masked out of the experts' input and output, so
    that they reach no result and no gradient."""
    routed_RH, tokens_per_expert_e, handle = api.dispatch(x_TH, topk_idx_TK, num_experts=num_experts,
                                                          **dispatch_kwargs)
    e = expert_w_eHH.shape[0]
    expert_of_row_R = expert_of_rows(tokens_per_expert_e, routed_RH.shape[0])  # e past the last group
    valid_R1 = (expert_of_row_R < e)[:, None]
    acc = torch.promote_types(x_TH.dtype, torch.float32)
    w_RHH = expert_w_eHH.to(acc)[expert_of_row_R.clamp(max=e - 1)]
    rows_RH = torch.bmm(torch.where(valid_R1, routed_RH, 0).to(acc).unsqueeze(1), w_RHH).squeeze(1)
    out_RH = torch.where(valid_R1, torch.tanh(rows_RH), 0).to(x_TH.dtype)
    return api.combine(out_RH, handle, weights_TK)


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median microseconds of fn(): CUDA events via ``triton.testing.do_bench`` on a GPU, else
    the wall clock over 5 calls::

        time_us = timer(x.device)
        us = time_us(lambda: a2a.dispatch(x, topk_idx, num_experts=E))
    """
    if device.type == "cuda":
        import triton.testing

        return lambda fn: 1e3 * triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")

    def wall(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e6 * sorted(times)[len(times) // 2]

    return wall


def host_us(fn: Callable[[], object], n: int = 20, warmup: int = 1) -> float:
    """Microseconds of host time to issue one call of fn: ``warmup`` calls and a synchronisation,
    then n calls timed with perf_counter and no synchronisation among them (equal to the call's
    time when host-bound)."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    if cuda:
        torch.cuda.synchronize()
    return us


def simulated_ulysses_attention(buffers: list, qkv: list, upstream: list, is_causal: bool = True,
                                stream: Any = None) -> list:
    """``ulysses_attention`` forward and backward on simulated ranks (``UlyssesBuffers.simulated``),
    phase by phase: every exchange in the ranks' threads, each rank's attention and its backward in
    this thread. (PyTorch's autograd engine runs every backward on a CUDA device in one device
    thread, where simulated ranks' exchanges would wait for each other forever.) The same
    exchanges and attention as the op: q, k, v in one exchange, o back, o's gradient, then q, k and
    v's gradients in one. qkv[r]: rank r's (q, k, v), (B, S/W, heads, D), k and v with heads
    divisible by W; upstream[r]: the gradient of its output; stream: the ranks' stream (a
    capturing one: the whole step in one CUDA graph). Returns per rank
    ``(out, (grad_q, grad_k, grad_v))``."""
    from .backends.symm_mem import run_simulated
    from .ulysses import _sdpa, symm_head_to_seq_op, symm_seq_to_head_op

    heads = [t.shape[2] for t in qkv[0]]

    def exchange(fn: Callable) -> list:
        return run_simulated(fn, buffers, stream=stream)

    gathered = exchange(lambda r, b: symm_seq_to_head_op(list(qkv[r]), b, 1, 2, [], False))
    leaves = [[t.requires_grad_() for t in ts] for ts in gathered]
    local = [_sdpa(*ts, "bshd", is_causal, None) for ts in leaves]
    outs = exchange(lambda r, b: symm_head_to_seq_op([local[r].detach()], b, 1, 2, heads[:1], [], False)[0])
    grad_local = exchange(lambda r, b: symm_seq_to_head_op([upstream[r]], b, 1, 2, [], False)[0])
    local_grads = [torch.autograd.grad(o, ts, g) for o, ts, g in zip(local, leaves, grad_local)]
    grads = exchange(lambda r, b: symm_head_to_seq_op(list(local_grads[r]), b, 1, 2, heads, [], False))
    return list(zip(outs, grads))


@contextlib.contextmanager
def races_between_ranks(buffers: list) -> Iterator[list]:
    """Inside: the interpreted kernels that simulated ranks launch on ``buffers`` (one per rank,
    ``SymmBuffers.simulated`` or ``UlyssesBuffers.simulated``) are checked against each other
    (``kernels.races.record_races_between``): an address of any rank's segment that one rank
    stores and another loads or stores between the same two barriers of the group is a race on
    GPUs, where those kernels run at once. Yields the list of races, filled on exit. CPU only
    (Triton's interpreter)."""
    from .backends.symm_mem.segments import _SimulatedSegments
    from .kernels.races import record_races_between

    passed: collections.Counter = collections.Counter()  # barriers passed, by thread name (one per rank)
    wait = _SimulatedSegments._wait

    def counting(self) -> None:
        wait(self)
        passed[threading.current_thread().name] += 1

    def rank_and_epoch() -> tuple[str, int]:
        name = threading.current_thread().name
        return name, passed[name]

    shared = [(b._segments.local.data_ptr(), b._segments.local.data_ptr() + b._segments.local.numel())
              for b in buffers]
    _SimulatedSegments._wait = counting
    try:
        with record_races_between(rank_and_epoch, shared) as races:
            yield races
    finally:
        _SimulatedSegments._wait = wait


def raised(fn: Callable[[], object]) -> Optional[tuple[str, str]]:
    """What ``fn()`` raised, as ``(type name, message)``, or None where it returned."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what was raised is the result
        return type(exc).__name__, str(exc)
    return None


def simulated_errors(fn: Callable[[int, Any], object], buffers: list) -> list:
    """Run ``fn(rank, buffers[rank])`` on simulated ranks (``run_simulated``) and return what each
    rank raised, by rank (:func:`raised`), so that a test sees every rank's error where
    ``run_simulated`` re-raises the first."""
    from .backends.symm_mem import run_simulated

    return run_simulated(lambda rank, b: raised(lambda: fn(rank, b)), buffers)
