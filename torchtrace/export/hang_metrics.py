"""The hang series, built from the black box's fields when ``/metrics`` is scraped.

``torchtrace_stalled_seconds`` is computed at scrape time (the time since the training thread
last made progress; 0 while idle, before the first step and after shutdown), so it keeps
growing while the training thread is stuck, as long as the scrape itself can run (a thread
that holds the GIL stops the HTTP server too: the target then stops answering, which
``TorchtraceTargetDown`` covers). It is counted on the monotonic clock when the watchdog's
:class:`~torchtrace.job.stall.StallClock` is given (a wall clock that steps is no stall).
``torchtrace_hang_timeout_seconds`` is the watchdog's current timeout, so an alert rule can
compare the two per rank.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from torchtrace import semconv


class HangMetrics:
    """A prometheus_client collector over ``fields`` (a dict other threads store into).

    >>> m = HangMetrics("r", "0", lambda: {"phase": "forward", "progress": time.time() - 5, "hangs": 1})
    >>> sorted(f.name for f in m.collect())[:2]
    ['torchtrace_collectives', 'torchtrace_hang_timeout_seconds']
    """

    def __init__(self, run_id: str, rank: str, fields: Callable[[], dict[str, Any]],
                 stalled: Callable[[float], float] | None = None) -> None:
        self.base = [run_id, rank]
        self.fields = fields
        # seconds since a progress stamp (StallClock.now); else by the wall clock
        self.stalled = stalled if stalled is not None else _by_wall_clock

    def collect(self) -> Iterator[Metric]:
        f = self.fields()
        labels = list(semconv.COMMON_LABELS)
        phase = f.get("phase") or "idle"
        if f.get("collective_active") and phase != "idle":
            phase = "collective"
        since = f.get("progress")
        stalled = self.stalled(since) if phase != "idle" and isinstance(since, (int, float)) else 0.0
        g = GaugeMetricFamily(semconv.M_STALLED_SECONDS, "Seconds since the training thread last made progress.",
                              labels=labels)
        g.add_metric(self.base, max(stalled, 0.0))
        yield g
        timeout = f.get("hang_timeout_s")
        t = GaugeMetricFamily(semconv.M_HANG_TIMEOUT, "The hang timeout now: no progress for longer is a hang.",
                              labels=labels)
        if isinstance(timeout, (int, float)):
            t.add_metric(self.base, float(timeout))
        yield t
        c = CounterMetricFamily(semconv.M_HANGS[: -len("_total")], "Hangs detected (no progress beyond the timeout).",
                                labels=labels)
        c.add_metric(self.base, float(f.get("hangs") or 0))
        yield c
        p = GaugeMetricFamily(semconv.M_PHASE, "1 for what the training thread is doing now.",
                              labels=labels + ["phase"])
        for name in semconv.TRAINING_PHASES:
            p.add_metric(self.base + [name], 1.0 if name == phase else 0.0)
        yield p
        n = CounterMetricFamily(semconv.M_COLLECTIVES[: -len("_total")], "Collectives this rank has entered.",
                                labels=labels)
        n.add_metric(self.base, float(f.get("collective_seq") or 0))
        yield n

    def series_caps(self) -> dict[str, int]:
        return {semconv.M_STALLED_SECONDS: 1, semconv.M_HANG_TIMEOUT: 1, semconv.M_HANGS[: -len("_total")]: 1,
                semconv.M_PHASE: len(semconv.TRAINING_PHASES), semconv.M_COLLECTIVES[: -len("_total")]: 1}


def _by_wall_clock(since: float) -> float:
    """Seconds since the wall-clock stamp ``since``."""
    return time.time() - since
