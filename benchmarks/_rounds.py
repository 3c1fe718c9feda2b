"""Rows timed in interleaved rounds, for the step benchmarks (``hf_step``, ``titan_step``), and the
kernels of a profiled step (``kernel_times``: ``ulysses``, ``tools/moe_profile.py``).

A row timed once, after the one before it, takes whatever spell the host is in then; rows timed
in rounds (every row once a round, a fresh order each round) share the spells, and the median
over rounds, with each round's ratio to its reference row, shows how much a verdict moves.

Compiled rows are compiled once, before the rounds, each through a function of its own code
object (:func:`own_code`): dynamo keeps compiled code and guards on the code object, so rows
compiled through one shared code object (``torch.compile(model)`` of models of one class) would
share cache entries, checking each other's guards, and a ``torch._dynamo.reset()`` between
rows would throw away the rows compiled before. The rounds run under
``error_on_recompile`` and check dynamo's frame counters: a recompile during timing raises.
"""

from __future__ import annotations

import contextlib
import random
import re
import statistics
import types
from typing import Callable, Iterator, Optional

import torch


def own_code(fn: Callable, tag: str) -> Callable:
    """A copy of function ``fn`` (closure included) with a code object of its own, named after
    ``tag``: ``torch.compile`` of it keeps its compiled code apart from every other copy's."""
    name = re.sub(r"\W", "_", f"{fn.__name__}_{tag}")
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def compiled_frames() -> int:
    """Frames dynamo has compiled so far (``counters["frames"]["total"]``) plus graphs made."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"] + counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def no_recompiles() -> Iterator[None]:
    """Raise on any recompilation inside (``error_on_recompile``), and on any frame compiled
    afresh (a code object seen for the first time is not a recompile)."""
    before = compiled_frames()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    after = compiled_frames()
    if after != before:
        raise RuntimeError(f"dynamo compiled during the timed rounds ({after - before} frames and graphs): "
                           "the timings include compilation")


def interleave(steps: dict[str, Callable[[], object]], rounds: int, time_us: Callable, host_us: Callable,
               label: str = "") -> dict[str, list[tuple[float, float]]]:
    """Per row, (step us, host us) of each round: every round times every row once, in an order
    shuffled afresh each round (seeded by the round), under :func:`no_recompiles`."""
    if rounds < 1:
        raise SystemExit(f"--rounds: expected at least 1, got {rounds}")
    samples: dict[str, list[tuple[float, float]]] = {row: [] for row in steps}
    with no_recompiles():
        for r in range(rounds):
            order = list(steps)
            random.Random(r).shuffle(order)
            for row in order:
                us, host = time_us(steps[row]), host_us(steps[row])
                samples[row].append((us, host))
                print(f"{label}round {r + 1}/{rounds} {row:30s} {us:10.1f} us/step   host {host:10.1f} us",
                      flush=True)
    return samples


def summarize(samples: dict[str, list[tuple[float, float]]], reference: Callable[[str], str]) -> dict[str, dict]:
    """Per row: medians over rounds of the step and host time, and the ratio of each round's
    step time to that round's ``reference(row)`` (median, min, max, every round)."""
    out = {}
    for row, values in samples.items():
        ref = samples[reference(row)]
        ratios = [v[0] / w[0] for v, w in zip(values, ref)]
        out[row] = dict(step_us=round(statistics.median(v[0] for v in values), 1),
                        host_us=round(statistics.median(v[1] for v in values), 1),
                        ratio=round(statistics.median(ratios), 3), ratio_min=round(min(ratios), 3),
                        ratio_max=round(max(ratios), 3),
                        step_us_by_round=[round(v[0], 1) for v in values],
                        host_us_by_round=[round(v[1], 1) for v in values],
                        ratio_by_round=[round(x, 3) for x in ratios])
    return out


def ratio_cells(s: dict) -> str:
    """``| median ratio | min-max |`` cells of a :func:`summarize` row."""
    return f"{s['ratio']:.2f}x | {s['ratio_min']:.2f}-{s['ratio_max']:.2f}x"


def rounds_note(rounds: int, base: str, each: str = "") -> str:
    """The line under a rounds table that says what its cells are: ``base`` the reference row,
    ``each`` what "every row" ranges over (e.g. " of a T")."""
    return (f"Medians over {rounds} rounds (every row{each} once a round, a fresh order each round); vs {base}: "
            f"each round's step time over that round's {base} row (eager or compiled), median and range over "
            "rounds.")


def profile(row: str, step: Callable[[], object], steps: int = 5, row_limit: int = 40,
            sort_by: Optional[str] = None) -> None:
    """Print a ``torch.profiler`` table of ``steps`` steps of one row (after one step outside the
    profiler): CPU activities, and CUDA ones on a GPU, sorted by self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    print(f"\nprofile of {steps} steps of {row} (self CPU time; totals over the {steps} steps):", flush=True)
    print(prof.key_averages().table(sort_by=sort_by or "self_cpu_time_total", row_limit=row_limit), flush=True)


def kernel_times(step: Callable[[], object], steps: int) -> list[tuple[str, float, float]]:
    """(name, launches a step, device us a launch) of each kernel ``step`` runs, over ``steps``
    profiled steps after one outside the profiler (torch.profiler, one GPU)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return [(e.key, e.count / steps, e.device_time_total / e.count) for e in prof.key_averages()
            if getattr(e, "device_time_total", 0) > 0]
