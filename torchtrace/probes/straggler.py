"""Stragglers: every ``rank_skew_interval`` steps, each rank's mean time of its own in the step
is gathered and the skew (slowest rank over the median rank, the lower middle one when the
world size is even) exported as ``torchtrace_rank_step_skew``.

A rank's own time in a step is not its wall time: under synchronous data parallelism the
fast ranks wait for the slow one inside the backward (DDP's bucket all-reduce), and every
rank's step lasts as long as the slowest one's. What a rank reaches on its own is the moment
it enters the step's gradient collectives: its own time is the time from the step's start to
the last collective it created before its backward ended (the optimizer's start; the step's
end without an optimizer mark), taken from PyTorch's flight recorder
(:mod:`torchtrace.distributed.flight`), torchtrace's own collectives left out. A step that
entered no collective waited for no rank: its own time is its wall time. So is every step
where no recorder runs (switched off, a torch without a dump).
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from torchtrace import current
from torchtrace.distributed import collectives, flight
from torchtrace.probes.base import Probe
from torchtrace.record import readout
from torchtrace.record.goodput_types import TRAIN
from torchtrace.record.step import StepRecord

if TYPE_CHECKING:
    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope


class StepSpan(NamedTuple):
    """One step of the window: its start and the end of its backward (``time.time_ns()``), its wall time."""

    start_ns: int
    backward_end_ns: int
    wall_s: float


def held_since_ns(entries: Sequence[dict[str, Any]]) -> int:
    """Since when the recorder holds every collective of this process: 0 when it dropped none
    (its oldest entry is the first, ``record_id`` 0, or it holds none), else the oldest
    entry's creation time.

    >>> held_since_ns([{"record_id": 0, "time_created_ns": 5}]), held_since_ns([{"record_id": 9, "time_created_ns": 5}])
    (0, 5)
    """
    if not entries:
        return 0
    oldest = min(entries, key=lambda e: e.get("record_id", 0))
    return 0 if oldest.get("record_id", 0) == 0 else int(oldest.get("time_created_ns", 0))


def own_step_seconds(created_ns: Sequence[int], held_since: int, step: StepSpan) -> float | None:
    """A step's own time from the creation times of the collectives this rank entered (not
    torchtrace's): from its start to the last one created before its backward ended; its wall
    time when it entered none; None when the recorder no longer holds the step's collectives
    (it started before ``held_since``, see :func:`held_since_ns`).

    >>> step = StepSpan(start_ns=0, backward_end_ns=90_000_000, wall_s=0.1)
    >>> own_step_seconds([2_000_000, 60_000_000, 95_000_000], 0, step)  # the last before 90 ms
    0.06
    >>> own_step_seconds([], 0, step)  # no collective: no wait
    0.1
    >>> own_step_seconds([], 1, step) is None  # older than what the recorder holds
    True
    """
    inside = [t for t in created_ns if step.start_ns <= t <= step.backward_end_ns]
    if inside:
        return (max(inside) - step.start_ns) / 1e9
    if step.start_ns >= held_since:
        return step.wall_s
    return None


def own_mean_seconds(entries: Sequence[dict[str, Any]] | None, steps: Sequence[StepSpan]) -> float:
    """The mean own time of ``steps`` (:func:`own_step_seconds`) over those the recorder's
    ``entries`` tell; their mean wall time without entries (no recorder) or where they tell none."""
    wall = sum(s.wall_s for s in steps) / len(steps)
    if entries is None:
        return wall
    first = steps[0].start_ns
    theirs = collectives.spans_since(first)
    created = [int(e["time_created_ns"]) for e in entries if e.get("time_created_ns", 0) >= first]
    created = [t for t in created if not collectives.issued_by_torchtrace(t, theirs)]
    held_since = held_since_ns(entries)
    known = [t for t in (own_step_seconds(created, held_since, s) for s in steps) if t is not None]
    return sum(known) / len(known) if known else wall


def gather_step_times(own_s: float, wall_s: float) -> tuple[list[float], list[float]] | None:
    """Every rank's ``own_s`` and ``wall_s`` (one ``all_reduce`` of two world-sized vectors), or None."""
    if not collectives.collectives_available():
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    t = torch.zeros(2 * world, dtype=torch.float64, device=collectives.device())
    t[rank], t[world + rank] = own_s, wall_s
    collectives.run("skew", lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM))
    both = readout.read(t)
    return both[:world], both[world:]


def skew(times: Sequence[float]) -> float:
    """Slowest rank's time over the median rank's (1.0 when all are equal).

    The median rank is a rank: with an even world size, the lower of the two middle ones
    (``statistics.median_low``; with two ranks, the faster). The mean of the two middle ranks
    would cap two ranks' skew below 2 whatever the imbalance.

    >>> skew([1.0, 1.0, 3.0])
    3.0
    >>> skew([1.0, 3.0])
    3.0
    """
    med = statistics.median_low(times)
    if med <= 0:
        return 1.0
    return max(times) / med


class _State:
    __slots__ = ("skew", "mean", "start_ns")

    def __init__(self) -> None:
        self.skew: tuple[float, int] | None = None
        self.mean: tuple[str, float] | None = None
        self.start_ns = time.time_ns()


def step_span(scope: StepScope, state: _State | None) -> StepSpan:
    """The ending step's :class:`StepSpan`. Its backward ended where the phase clock marked the
    optimizer's start, else now (the step's end). (A step the probe kept no state for started
    its wall time ago.)"""
    now_ns, now = time.time_ns(), time.perf_counter()
    clock = scope.throughput.clock if scope.throughput is not None else None
    began = clock.optimizer_host if clock is not None else None
    end_ns = now_ns if began is None else now_ns - round((now - began) * 1e9)
    start_ns = state.start_ns if state is not None else now_ns - round(scope.duration_s * 1e9)
    return StepSpan(start_ns, end_ns, scope.duration_s)


class StragglerProbe(Probe[_State]):
    """Per outermost training operation (the steps every rank runs alike: an evaluation or a
    checkpoint may run on rank 0 alone), each rank's mean own time in the step (see the module
    docstring) over ``interval`` steps is gathered from every rank with its mean wall time; the
    skew of the own times (slowest over median) goes to ``record.rank_skew`` and from there to
    ``torchtrace_rank_step_skew`` and the span, the rank's mean wall time to
    ``torchtrace_rank_step_seconds``. The recorder is read once per gather.

    The gather happens at the end of the step every rank reaches in the same order (its
    ``interval``-th outermost call of that operation), before the step's record is handed
    over: a record may be finished later on a GPU, at a moment that differs between ranks.
    """

    name = "rank_skew"
    component = "distributed"

    def __init__(self, rt: Runtime, interval: int | None) -> None:
        self.rt = rt
        self.interval = interval
        self._steps: collections.defaultdict[str, list[StepSpan]] = collections.defaultdict(list)
        self.last: dict[str, Any] | None = None

    def enter(self, scope: StepScope) -> _State:
        return _State()

    def exit(self, scope: StepScope, state: _State | None, exc: BaseException | None) -> None:
        if self.interval is None:  # the ranks agreed on no skew check (torchtrace.step.agreement)
            return None
        if current.step() is not None:  # nested operation: only outermost steps count
            return None
        if scope.kind != TRAIN:  # an evaluation or a checkpoint may run on rank 0 alone
            return None
        op = scope.name
        steps = self._steps[op]
        steps.append(step_span(scope, state))
        if len(steps) < self.interval:
            return None
        del self._steps[op]
        wall = sum(s.wall_s for s in steps) / len(steps)
        if state is not None:
            state.mean = (op, wall)
        gathered = gather_step_times(own_mean_seconds(flight.entries(), steps), wall)
        if not gathered:
            return None
        own, walls = gathered
        value = skew(own)
        slowest = max(range(len(own)), key=own.__getitem__)
        self.last = {"operation": op, "step": scope.step, "skew": value, "slowest_rank": slowest,
                     "own_seconds_by_rank": own, "step_seconds_by_rank": walls}
        if state is not None:
            state.skew = (value, slowest)
        return None

    def finish(self, scope: StepScope, state: _State | None, record: StepRecord, values: list[float] | None) -> None:
        if state is None:
            return
        if state.mean is not None:
            record.rank_step_seconds = state.mean[1]
        record.rank_skew = state.skew

    def section(self) -> dict[str, Any] | None:
        return self.last
