"""Stragglers: every ``rank_skew_interval`` steps, each rank's mean step time is gathered and the
skew (slowest rank over the median rank, the lower middle one when the world size is even)
exported as ``torchtrace_rank_step_skew``."""

from __future__ import annotations

import collections
import statistics
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from torchtrace import current
from torchtrace.distributed import collectives
from torchtrace.probes.base import Probe
from torchtrace.record import readout
from torchtrace.record.goodput_types import TRAIN
from torchtrace.record.step import StepRecord

if TYPE_CHECKING:
    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope


def gather_step_times(mean_s: float) -> list[float] | None:
    """Every rank's ``mean_s`` (one ``all_reduce`` of a world-sized vector), or None."""
    if not collectives.collectives_available():
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    t = torch.zeros(world, dtype=torch.float64, device=collectives.device())
    t[rank] = mean_s
    collectives.run("skew", lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM))
    return readout.read(t)


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
    __slots__ = ("skew", "mean")

    def __init__(self) -> None:
        self.skew: tuple[float, int] | None = None
        self.mean: tuple[str, float] | None = None


class StragglerProbe(Probe[_State]):
    """Per outermost training operation (the steps every rank runs alike: an evaluation or a
    checkpoint may run on rank 0 alone), the mean step time over ``interval`` steps is gathered from
    every rank; the skew (slowest over median) goes to ``record.rank_skew`` and from there to
    ``torchtrace_rank_step_skew`` and the span.

    The gather happens at the end of the step every rank reaches in the same order (its
    ``interval``-th outermost call of that operation), before the step's record is handed
    over: a record may be finished later on a GPU, at a moment that differs between ranks.
    """

    name = "rank_skew"
    component = "distributed"

    def __init__(self, rt: Runtime, interval: int | None) -> None:
        self.rt = rt
        self.interval = interval
        self._sum: collections.defaultdict[str, float] = collections.defaultdict(float)
        self._n: collections.Counter[str] = collections.Counter()
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
        self._sum[op] += scope.duration_s
        self._n[op] += 1
        if self._n[op] < self.interval:
            return None
        mean = self._sum[op] / self._n[op]
        self._sum[op] = 0.0
        self._n[op] = 0
        if state is not None:
            state.mean = (op, mean)
        times = gather_step_times(mean)
        if not times:
            return None
        value = skew(times)
        slowest = max(range(len(times)), key=times.__getitem__)
        self.last = {"operation": op, "step": scope.step, "skew": value, "slowest_rank": slowest,
                     "step_seconds_by_rank": list(times)}
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
