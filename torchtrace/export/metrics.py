"""Prometheus metrics on a private registry, with the names and labels of the contract.

Every series carries ``run_id`` and ``rank``. Other labels come from closed sets, and the
one open label (``operation``, named by the user's code) is capped: past
:data:`MAX_LABEL_VALUES` distinct values new ones are folded into ``__overflow__``.

The per-step series (:mod:`torchtrace.export.step_metrics`) are plain numbers updated from each
finished record and turned into metric families only when ``/metrics`` is scraped; the
run-level ones below (drops, internal errors, overhead, build info, rank skew, benchmarks)
are prometheus_client instruments.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, values
from prometheus_client import Counter as _Counter
from prometheus_client import Gauge as _Gauge

from torchtrace import semconv
from torchtrace.export.labels import MAX_DEVICE_VALUES, MAX_LABEL_VALUES, OVERFLOW, LabelBudget
from torchtrace.export.step_metrics import StepMetrics
from torchtrace.record.step import StepRecord

__all__ = ["MAX_DEVICE_VALUES", "MAX_LABEL_VALUES", "OVERFLOW", "LabelBudget", "Metrics"]


class Counter(_Counter):
    """A counter whose values live in this process, always.

    With ``PROMETHEUS_MULTIPROC_DIR`` set (for the application's own multiprocess metrics),
    prometheus_client would keep every value in a file of that directory, where the
    application's ``MultiProcessCollector`` serves it: torchtrace's registry is private.
    """

    def _metric_init(self) -> None:
        try:
            self._value = values.MutexValue(self._type, self._name, self._name + "_total", self._labelnames,
                                            self._labelvalues, self._documentation)
        except (AttributeError, TypeError):  # another prometheus_client's internals: its own way
            super()._metric_init()
            return
        self._created = time.time()


class Gauge(_Gauge):
    """A gauge whose values live in this process, always (see :class:`Counter`)."""

    def _metric_init(self) -> None:
        try:
            self._value = values.MutexValue(self._type, self._name, self._name, self._labelnames,
                                            self._labelvalues, self._documentation)
        except (AttributeError, TypeError):  # (as Counter's)
            super()._metric_init()


def _base(name: str) -> str:
    """prometheus_client appends ``_total`` to counters itself."""
    return name[: -len("_total")] if name.endswith("_total") else name


class Metrics:
    """The contract's instruments, bound to one run's ``run_id`` and ``rank``."""

    def __init__(self, run_id: str, rank: int, version: str, level: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.run_id = run_id
        self.rank = str(rank)
        common = list(semconv.COMMON_LABELS)
        r = self.registry
        self.operation = LabelBudget()
        self.kind = LabelBudget(allowed=semconv.ANOMALY_KINDS_ALL)
        self.component = LabelBudget(allowed=semconv.COMPONENTS)
        self.reason = LabelBudget(allowed=semconv.DROP_REASONS)
        self.device = LabelBudget(MAX_DEVICE_VALUES)
        self.steps = StepMetrics(run_id, self.rank, self.operation, self.kind, self.device)
        r.register(self.steps)
        self.spans_dropped = Counter(_base(semconv.M_SPANS_DROPPED), "Spans lost by the exporter, by reason.",
                                     common + ["reason"], registry=r)
        self.internal_errors = Counter(_base(semconv.M_INTERNAL_ERRORS),
                                       "torchtrace's own failures, caught and counted.",
                                       common + ["component"], registry=r)
        self.rank_skew = Gauge(semconv.M_RANK_SKEW, "Slowest rank's own step time (up to its backward's last "
                               "collective) over the median rank's.", common, registry=r)
        self.overhead = Counter(_base(semconv.M_OVERHEAD), "Seconds spent inside torchtrace on the training thread.",
                                common, registry=r)
        self.build_info = Gauge(semconv.M_BUILD_INFO, "Always 1; labels name the version and level.",
                                common + ["version", "level"], registry=r)
        self._version = version
        self._level = level
        self.build_info.labels(run_id, self.rank, version, level).set(1)
        # Pre-create the zero series that alerts and dashboards rely on.
        for reason in semconv.DROP_REASONS:
            self.spans_dropped.labels(run_id, self.rank, reason)
        for component in semconv.COMPONENTS:
            self.internal_errors.labels(run_id, self.rank, component)
        self._overhead_child = self.overhead.labels(run_id, self.rank)

        # benchmark_optimizations: one series per OptimizationMode.
        self.opt_mode = LabelBudget(allowed=semconv.OPTIMIZATION_MODES)
        self.opt_step_seconds = Gauge(semconv.M_OPT_STEP_SECONDS, "Median step time of the last benchmark, by mode.",
                                      common + ["mode"], registry=r)
        self.opt_speedup = Gauge(semconv.M_OPT_SPEEDUP, "NONE's median step time over this mode's; below 1 is slower.",
                                 common + ["mode"], registry=r)
        self.opt_memory = Gauge(semconv.M_OPT_MEMORY, "Memory measured by the last benchmark, by mode, in bytes.",
                                common + ["mode"], registry=r)

    def set_level(self, level: str) -> None:
        if level == self._level:
            return
        try:
            self.build_info.remove(self.run_id, self.rank, self._version, self._level)
        except KeyError:
            pass
        self._level = level
        self.build_info.labels(self.run_id, self.rank, self._version, level).set(1)

    def observe_step(self, record: StepRecord) -> None:
        """Update the step series from a finished record (plain numbers; families are built at scrape)."""
        self.steps.observe(record)
        if record.rank_skew is not None:
            self.set_rank_skew(record.rank_skew[0])

    def series_caps(self) -> dict[str, int]:
        """The most label sets each metric family can hold in this process (overflow included).

        ``run_id`` and ``rank`` are fixed per process, so only the other labels count.
        """
        caps = self.steps.series_caps()
        caps.update({
            _base(semconv.M_SPANS_DROPPED): len(semconv.DROP_REASONS) + 1,
            _base(semconv.M_INTERNAL_ERRORS): len(semconv.COMPONENTS) + 1,
            semconv.M_RANK_SKEW: 1,
            _base(semconv.M_OVERHEAD): 1,
            semconv.M_BUILD_INFO: 1,
        })
        return caps

    def count_anomaly(self, operation: str, kind: str, n: int = 1) -> None:
        """Count an anomaly found outside a step's record (a monitor, an input check)."""
        self.steps.count_anomaly(operation, kind, n)

    def drop_spans(self, reason: str, n: int) -> None:
        self.spans_dropped.labels(self.run_id, self.rank, self.reason(reason)).inc(n)

    def internal_error(self, component: str) -> None:
        self.internal_errors.labels(self.run_id, self.rank, self.component(component)).inc()

    def add_overhead(self, seconds: float) -> None:
        self._overhead_child.inc(seconds)

    def set_rank_skew(self, skew: float) -> None:
        self.rank_skew.labels(self.run_id, self.rank).set(skew)

    def set_optimization(self, mode: str, median_s: float | None, speedup: float | None,
                         memory_bytes: float | None) -> None:
        """Publish one benchmarked mode; a value that was not measured leaves its series alone."""
        lv = (self.run_id, self.rank, self.opt_mode(mode))
        if median_s is not None:
            self.opt_step_seconds.labels(*lv).set(median_s)
        if speedup is not None:
            self.opt_speedup.labels(*lv).set(speedup)
        if memory_bytes is not None:
            self.opt_memory.labels(*lv).set(memory_bytes)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """A sample's value as ``/metrics`` would show it (for tests and the report)."""
        return self.registry.get_sample_value(name, {"run_id": self.run_id, "rank": self.rank, **(labels or {})})
