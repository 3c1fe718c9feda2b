"""What the kernels access in Triton's interpreter (CPU tests): a race check, and the bytes they store.

The interpreter runs a launch's programs one after another, and each block operation of a
program as one numpy operation, so a kernel whose result depends on the order of its programs,
or of the threads of one program, still computes the right thing there. On a GPU the programs
of a launch run at once, in any order, and the threads of a program too, ordered only by
``tl.debug_barrier``. :func:`record_races` records, for every launch inside it, the element
addresses each program loads and stores (masked-in lanes only; atomics aside: they are the
ordered way to share) and reports two kinds of race:

- **between programs**: an address that one program stores and another loads or stores;
- **within a program**: an address that one program both loads and stores between two of its
  barriers, which on a GPU different threads may do in either order (a replicated value is
  loaded by every thread holding a copy and stored by one of them).

:func:`record_races_between` checks the launches of several ranks (simulated peers, one thread
each) against each other: on GPUs, the kernels each rank queues between the same two barriers
of the group run at the same time, so an address of the shared memory that one rank stores
and another loads or stores there is a race, whatever order the threads queued them in (the
bug of an op that writes a peer's stage before every peer is done reading it).

The second kind is the bug that made the symm_mem copy-out (now ``pull_rows``) drop rows on the
H200 under an SM budget (its programs read each row's tag and reset it to -1 with no barrier
between). :func:`record_stored_bytes` counts what each kernel writes (the bytes a dispatch moves,
issue 38). Both use the interpreter's builder (``triton.runtime.interpreter``:
``create_masked_load`` / ``create_masked_store`` / ``create_barrier`` and the launch's
``GridExecutor``); a Triton whose interpreter lacks them makes them raise instead of checking
nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Hashable, Iterator, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Race:
    """One race of one launch: ``kind`` 'between programs' or 'within a program', the kernel,
    how many addresses, and the first program ids involved."""

    kernel: str
    kind: str
    addresses: int
    programs: tuple

    def __str__(self) -> str:
        programs = f" (programs {self.programs})" if self.programs else ""
        return f"{self.kernel}: {self.addresses} addresses {self.kind}{programs}"


class _Launch:
    """The accesses of one launch: per program, its loads and stores since its last barrier."""

    def __init__(self, kernel: str):
        self.kernel = kernel
        self.program: tuple = (0, 0, 0)
        self.loads: list[np.ndarray] = []
        self.stores: list[np.ndarray] = []
        self.all_loads: list[tuple[tuple, np.ndarray]] = []
        self.all_stores: list[tuple[tuple, np.ndarray]] = []
        self.races: list[Race] = []

    def access(self, store: bool, ptrs: np.ndarray, mask: np.ndarray, itemsize: int) -> None:
        addrs = np.asarray(ptrs)[_lanes(ptrs, mask)]
        (self.stores if store else self.loads).append(addrs.astype(np.uint64).ravel())

    def barrier(self) -> None:
        """End of a barrier interval of the current program: its loads and stores meet here."""
        loads, stores = _cat(self.loads), _cat(self.stores)
        both = np.intersect1d(loads, stores)
        if both.size:
            self.races.append(Race(self.kernel, "within a program (loaded and stored, no barrier between)",
                                   int(both.size), (self.program,)))
        self.all_loads.append((self.program, loads))
        self.all_stores.append((self.program, stores))
        self.loads, self.stores = [], []

    def start_program(self, program: tuple) -> None:
        self.barrier()
        self.program = program

    def finish(self) -> list[Race]:
        self.barrier()
        stores, loads = _by_program(self.all_stores), _by_program(self.all_loads)
        programs = [p for p, a in stores.items() if a.size]
        if programs:
            s_addr = np.concatenate([stores[p] for p in programs])
            s_prog = np.concatenate([np.full(stores[p].size, i) for i, p in enumerate(programs)])
            order = np.argsort(s_addr, kind="stable")
            s_addr, s_prog = s_addr[order], s_prog[order]
            twice = (s_addr[1:] == s_addr[:-1]) & (s_prog[1:] != s_prog[:-1])
            if twice.any():
                i = int(np.nonzero(twice)[0][0])
                self._between(int(twice.sum()), programs[s_prog[i]], programs[s_prog[i + 1]])
            for program, addrs in loads.items():
                at = np.clip(np.searchsorted(s_addr, addrs), 0, s_addr.size - 1)
                own = programs.index(program) if program in stores and stores[program].size else -1
                hit = (s_addr[at] == addrs) & (s_prog[at] != own)
                if hit.any():
                    self._between(int(hit.sum()), program, programs[s_prog[at[np.nonzero(hit)[0][0]]]])
        return self.races

    def _between(self, n: int, first: tuple, second: tuple) -> None:
        self.races.append(Race(self.kernel, "between programs (stored by one, read or stored by another)", n,
                               (first, second)))


def _lanes(ptrs: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The masked-in lanes of an access, as a boolean array of the pointers' shape."""
    return np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs))


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.uint64)


def _by_program(intervals: list[tuple[tuple, np.ndarray]]) -> dict[tuple, np.ndarray]:
    """(program, addresses) of each barrier interval -> each program's distinct addresses (its
    intervals are ordered among themselves by its barriers: only other programs can race)."""
    out: dict[tuple, list[np.ndarray]] = {}
    for program, addrs in intervals:
        out.setdefault(program, []).append(addrs)
    return {p: np.unique(_cat(a)) for p, a in out.items()}


class _RankLaunch:
    """The distinct addresses one launch of one rank loads and stores (atomics aside), with the
    rank and the barrier interval (epoch) it was queued in."""

    def __init__(self, kernel: str, rank: Hashable, epoch: int):
        self.kernel, self.rank, self.epoch = kernel, rank, epoch
        self.loads: list[np.ndarray] = []
        self.stores: list[np.ndarray] = []

    def access(self, store: bool, ptrs: np.ndarray, mask: np.ndarray, itemsize: int) -> None:
        addrs = np.asarray(ptrs)[_lanes(ptrs, mask)].astype(np.uint64).ravel()
        (self.stores if store else self.loads).append(addrs)

    def barrier(self) -> None:
        pass

    def start_program(self, program: tuple) -> None:
        pass

    def within(self, ranges: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(loads, stores): the distinct addresses in any [start, end) of ``ranges``."""
        def inside(addrs: np.ndarray) -> np.ndarray:
            keep = np.zeros(addrs.shape, dtype=bool)
            for start, end in ranges:
                keep |= (addrs >= start) & (addrs < end)
            return addrs[keep]
        return inside(np.unique(_cat(self.loads))), inside(np.unique(_cat(self.stores)))


def _races_between_ranks(launches: list[_RankLaunch], ranges: Sequence[tuple[int, int]]) -> list[Race]:
    """Each pair of launches of different ranks in one epoch where one stores an address in
    ``ranges`` that the other loads or stores."""
    races: list[Race] = []
    accessed = [(launch, *launch.within(ranges)) for launch in launches]
    for i, (a, _, a_stores) in enumerate(accessed):
        for j, (b, b_loads, b_stores) in enumerate(accessed):
            if a.rank == b.rank or a.epoch != b.epoch:
                continue
            for n, what in ((np.intersect1d(a_stores, b_loads).size, "read"),
                            (np.intersect1d(a_stores, b_stores).size if i < j else 0, "stored")):
                if n:
                    races.append(Race(f"{a.kernel} ({a.rank}) / {b.kernel} ({b.rank})",
                                      f"between ranks after {a.epoch} barriers (stored by one, {what} by the other)",
                                      n, ()))
    return races


class _StoredBytes:
    """The bytes one launch stores (masked-in lanes times the element size; atomics aside)."""

    def __init__(self, kernel: str):
        self.kernel, self.bytes = kernel, 0

    def access(self, store: bool, ptrs: np.ndarray, mask: np.ndarray, itemsize: int) -> None:
        if store:
            self.bytes += int(_lanes(ptrs, mask).sum()) * itemsize

    def barrier(self) -> None:
        pass

    def start_program(self, program: tuple) -> None:
        pass


_LAUNCHING = threading.local()


def in_recorded_launch() -> bool:
    """Whether this thread is inside a recorded interpreted launch (whose torch ops, the
    interpreter's copies of the arguments, are not the kernel's work)."""
    return getattr(_LAUNCHING, "active", False)


@contextlib.contextmanager
def _interpreted_accesses(new_launch: Callable[[str], Any], finish: Callable[[Any], None]) -> Iterator[None]:
    """Inside: each interpreted launch gets a recorder ``new_launch(kernel name)``, which sees its
    masked loads and stores (``access(store, ptrs, mask, itemsize)``; atomics aside), barriers
    and program starts; ``finish(recorder)`` at the launch's end."""
    from triton.runtime import interpreter as ti

    builder, executor = ti.interpreter_builder, ti.GridExecutor
    names = ("create_masked_load", "create_masked_store", "create_barrier", "set_grid_idx",
             "create_atomic_load", "create_atomic_store")
    missing = [n for n in names if not hasattr(builder, n)]
    if missing:
        raise RuntimeError(f"kernels.races: this Triton's interpreter has no {missing}; the check cannot run")
    launches: list = []
    atomic = [False]
    if any(n in vars(builder) for n in names):
        raise RuntimeError("kernels.races: already recording (recorders do not nest)")
    original = {n: getattr(builder, n) for n in names}
    original_call = executor.__call__

    def masked_load(ptrs, mask, other, cache_policy, is_volatile):
        if launches and not atomic[0]:
            launches[-1].access(False, ptrs.data, mask.data, 0)
        return original["create_masked_load"](ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(ptrs, value, mask, cache_policy):
        if launches and not atomic[0]:
            launches[-1].access(True, ptrs.data, mask.data, np.asarray(value.data).itemsize)
        return original["create_masked_store"](ptrs, value, mask, cache_policy)

    def barrier():
        if launches:
            launches[-1].barrier()
        return original["create_barrier"]()

    def set_grid_idx(x, y, z):
        if launches:
            launches[-1].start_program((x, y, z))
        return original["set_grid_idx"](x, y, z)

    def as_atomic(name):
        def op(*args, **kwargs):
            atomic[0] = True
            try:
                return original[name](*args, **kwargs)
            finally:
                atomic[0] = False
        return op

    def call(self, *args, **kwargs):
        launches.append(new_launch(getattr(self.fn, "__name__", str(self.fn))))
        _LAUNCHING.active = True
        try:
            return original_call(self, *args, **kwargs)
        finally:
            _LAUNCHING.active = False
            finish(launches.pop())

    patches = dict(create_masked_load=masked_load, create_masked_store=masked_store, create_barrier=barrier,
                   set_grid_idx=set_grid_idx, create_atomic_load=as_atomic("create_atomic_load"),
                   create_atomic_store=as_atomic("create_atomic_store"))
    for n, fn in patches.items():
        setattr(builder, n, fn)
    executor.__call__ = call
    try:
        yield
    finally:
        for n in patches:
            delattr(builder, n)  # the class's methods again
        executor.__call__ = original_call


@contextlib.contextmanager
def record_races() -> Iterator[list[Race]]:
    """Inside: every interpreted launch is checked for races; the list (yielded) collects them.

    >>> with record_races() as races:
    ...     launcher(...)          # any launches of interpreted Triton kernels
    >>> assert not races, races
    """
    races: list[Race] = []
    with _interpreted_accesses(_Launch, lambda launch: races.extend(launch.finish())):
        yield races


@contextlib.contextmanager
def record_stored_bytes() -> Iterator[dict[str, int]]:
    """Inside: the bytes each interpreted kernel stores (masked-in lanes; atomics aside), summed
    by kernel name into the yielded dict, over every thread's launches."""
    stored: dict[str, int] = {}

    def finish(launch: _StoredBytes) -> None:
        stored[launch.kernel] = stored.get(launch.kernel, 0) + launch.bytes

    with _interpreted_accesses(_StoredBytes, finish):
        yield stored


@contextlib.contextmanager
def record_races_between(rank_and_epoch: Callable[[], tuple[Hashable, int]],
                         shared: Sequence[tuple[int, int]]) -> Iterator[list[Race]]:
    """Inside: every interpreted launch is labelled with ``rank_and_epoch()`` when it starts (the
    rank whose thread queues it, and how many of the group's barriers that rank has passed); on
    exit the yielded list gets the races between ranks (module docstring) on the addresses in
    the ``shared`` ranges [start, end) (every rank's segment: a tensor freed by one rank and
    allocated again by another is not shared memory)."""
    races: list[Race] = []
    launches: list[_RankLaunch] = []
    with _interpreted_accesses(lambda kernel: _RankLaunch(kernel, *rank_and_epoch()), launches.append):
        yield races
    races.extend(_races_between_ranks(launches, shared))
