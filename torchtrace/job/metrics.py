"""The job's series on ``/metrics``: its attempt, its goodput over every attempt, and
checkpoint save and load times.

A collector: values are plain numbers updated by the runtime, turned into metric families
when ``/metrics`` is scraped; the job's goodput is read from the black boxes (by ``goodput``,
which the runtime caches) at scrape time only.
"""

from __future__ import annotations

import bisect
import threading
from typing import Callable, Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from torchtrace import semconv


class JobMetrics(Collector):
    """``torchtrace_job_attempt``, ``torchtrace_job_goodput_ratio`` and
    ``torchtrace_checkpoint_seconds{kind}``, labelled with ``run_id`` and ``rank``.

    >>> m = JobMetrics("r1", 0, 2, lambda: 0.5)
    >>> m.observe_checkpoint("save", 3.0)
    >>> sorted(f.name for f in m.collect())
    ['torchtrace_checkpoint_seconds', 'torchtrace_job_attempt', 'torchtrace_job_goodput_ratio']
    """

    def __init__(self, run_id: str, rank: int, attempt: int, goodput: Callable[[], float | None]) -> None:
        self.labels = [run_id, str(rank)]
        self.attempt = attempt
        self.goodput = goodput
        self._lock = threading.Lock()
        self._counts = {kind: [0] * (len(semconv.CHECKPOINT_BUCKETS) + 1) for kind in semconv.CHECKPOINT_KINDS}
        self._sums = dict.fromkeys(semconv.CHECKPOINT_KINDS, 0.0)

    def observe_checkpoint(self, kind: str, seconds: float) -> None:
        """One save or load of ``seconds``."""
        if kind not in self._sums:
            return
        with self._lock:
            self._counts[kind][bisect.bisect_left(semconv.CHECKPOINT_BUCKETS, seconds)] += 1
            self._sums[kind] += seconds

    def describe(self) -> Iterator[Metric]:
        """The families without values: registering must not read the black boxes (the registry
        would call :meth:`collect` to learn the names, and the goodput source would run)."""
        labels = list(semconv.COMMON_LABELS)
        yield GaugeMetricFamily(semconv.M_JOB_ATTEMPT, "", labels=labels)
        yield GaugeMetricFamily(semconv.M_JOB_GOODPUT, "", labels=labels)
        yield HistogramMetricFamily(semconv.M_CHECKPOINT_SECONDS, "", labels=labels + ["kind"])

    def collect(self) -> Iterator[Metric]:
        labels = list(semconv.COMMON_LABELS)
        attempt = GaugeMetricFamily(semconv.M_JOB_ATTEMPT, "Attempt number within the job, 0 for the first.",
                                    labels=labels)
        attempt.add_metric(self.labels, self.attempt)
        yield attempt
        try:
            ratio = self.goodput()
        except Exception:  # a scrape must not fail for it
            ratio = None
        goodput = GaugeMetricFamily(semconv.M_JOB_GOODPUT,
                                    "Productive step time over the job's wall time, all attempts.", labels=labels)
        if ratio is not None:
            goodput.add_metric(self.labels, ratio)
        yield goodput
        hist = HistogramMetricFamily(semconv.M_CHECKPOINT_SECONDS, "Checkpoint save and load time.",
                                     labels=labels + ["kind"])
        with self._lock:
            snapshot = {kind: (list(counts), self._sums[kind]) for kind, counts in self._counts.items()}
        for kind, (counts, total) in snapshot.items():
            buckets, running = [], 0
            for bound, count in zip(list(semconv.CHECKPOINT_BUCKETS) + [float("inf")], counts):
                running += count
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
            hist.add_metric(self.labels + [kind], buckets, total)
        yield hist
