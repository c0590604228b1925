"""Stragglers: every ``rank_skew_interval`` steps, each rank's mean step time is gathered and the
skew (slowest rank over the median rank) exported as ``torchtrace_rank_step_skew``."""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
from prometheus_client import Gauge

from torchtrace import current, semconv
from torchtrace.distributed import collectives
from torchtrace.record import readout


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

    >>> skew([1.0, 1.0, 3.0])
    3.0
    """
    med = statistics.median(times)
    if med <= 0:
        return 1.0
    return max(times) / med


class StragglerProbe:
    """Per outermost operation, the mean step time over ``interval`` steps is gathered from
    every rank and the skew (slowest over median) exported as ``torchtrace_rank_step_skew``.

    The gather happens at the end of the step every rank reaches in the same order (its
    ``interval``-th outermost call of that operation).
    """

    def __init__(self, rt, interval: int) -> None:
        self.rt = rt
        self.interval = interval
        self._sum: collections.Counter[str] = collections.Counter()
        self._n: collections.Counter[str] = collections.Counter()
        self.last: dict[str, Any] | None = None
        self.step_seconds = Gauge(semconv.M_RANK_STEP_SECONDS,
                                  "This rank's mean step time over the last skew window, in seconds.",
                                  list(semconv.COMMON_LABELS) + ["operation"], registry=rt.metrics.registry)

    def enter(self, scope) -> None:
        return None

    def exit(self, scope, exc) -> None:
        if current.step() is not None:  # nested operation: only outermost steps count
            return
        op = scope.name
        self._sum[op] += time.perf_counter() - scope._t0
        self._n[op] += 1
        if self._n[op] < self.interval:
            return
        mean = self._sum[op] / self._n[op]
        self._sum[op] = 0.0
        self._n[op] = 0
        m = self.rt.metrics
        self.step_seconds.labels(m.run_id, m.rank, m.operation(op)).set(mean)
        times = gather_step_times(mean)
        if not times:
            return
        value = skew(times)
        m.set_rank_skew(value)
        slowest = max(range(len(times)), key=times.__getitem__)
        self.last = {"operation": op, "step": scope.step, "skew": value, "slowest_rank": slowest,
                     "step_seconds_by_rank": list(times)}
        scope._span.set_attributes({semconv.RANK_STEP_SKEW: value, semconv.RANK_SLOWEST: slowest})

    def finalize(self, scope, record, span) -> None:
        return None
