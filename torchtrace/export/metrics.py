"""Prometheus metrics on a private registry, with the names and labels of the contract.

Every series carries ``run_id`` and ``rank``. Other labels come from closed sets, and the
one open label (``operation``, named by the user's code) is capped: past
:data:`MAX_LABEL_VALUES` distinct values new ones are folded into ``__overflow__``.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from torchtrace import semconv
from torchtrace.record.step import StepRecord

MAX_LABEL_VALUES = 64
MAX_DEVICE_VALUES = 16
OVERFLOW = "__overflow__"


def _base(name: str) -> str:
    """prometheus_client appends ``_total`` to counters itself."""
    return name[: -len("_total")] if name.endswith("_total") else name


class LabelBudget:
    """Admits at most ``limit`` distinct values for one label; the rest become OVERFLOW."""

    def __init__(self, limit: int = MAX_LABEL_VALUES, allowed: Iterable[str] | None = None) -> None:
        self.limit = limit
        self.allowed = frozenset(allowed) if allowed is not None else None
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self.overflowed = 0

    def __call__(self, value: str) -> str:
        if self.allowed is not None:
            return value if value in self.allowed else OVERFLOW
        if value in self._seen:
            return value
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) >= self.limit:
                self.overflowed += 1
                return OVERFLOW
            self._seen.add(value)
            return value


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
        self.steps = Counter(_base(semconv.M_STEPS), "Steps completed.", common + ["operation"], registry=r)
        self.step_duration = Histogram(
            semconv.M_STEP_DURATION, "Step wall time in seconds; exemplars carry the trace id.",
            common + ["operation"], buckets=semconv.STEP_DURATION_BUCKETS, registry=r)
        self.loss = Gauge(semconv.M_LOSS, "Loss of the last step (NaN when it was NaN).", common + ["operation"], registry=r)
        self.grad_norm = Gauge(semconv.M_GRAD_NORM, "Global L2 gradient norm of the last step, before clipping.",
                               common + ["operation"], registry=r)
        self.grad_nonfinite = Gauge(semconv.M_GRAD_NONFINITE,
                                    "Parameter tensors whose gradient held NaN/Inf in the last step.",
                                    common + ["operation"], registry=r)
        self.anomalies = Counter(_base(semconv.M_ANOMALIES), "Anomalies detected, by kind.",
                                 common + ["operation", "kind"], registry=r)
        self.skipped = Counter(_base(semconv.M_SKIPPED), "Optimizer updates skipped by the guard.",
                               common + ["operation"], registry=r)
        self.memory = Gauge(semconv.M_MEMORY, "Memory in bytes, by device and kind.", common + ["device", "kind"], registry=r)
        self.memory_growth = Gauge(semconv.M_MEMORY_GROWTH, "Leak detector's memory slope in bytes per step.",
                                   common + ["device"], registry=r)
        self.last_step = Gauge(semconv.M_LAST_STEP_TS, "Unix time of the last completed step.",
                               common + ["operation"], registry=r)
        self.spans_dropped = Counter(_base(semconv.M_SPANS_DROPPED), "Spans lost by the exporter, by reason.",
                                     common + ["reason"], registry=r)
        self.internal_errors = Counter(_base(semconv.M_INTERNAL_ERRORS), "torchtrace's own failures, caught and counted.",
                                       common + ["component"], registry=r)
        self.rank_skew = Gauge(semconv.M_RANK_SKEW, "Slowest rank's step time over the median rank's.", common, registry=r)
        self.rank_step_seconds = Gauge(semconv.M_RANK_STEP_SECONDS,
                                       "This rank's mean step time over the last skew window, in seconds.",
                                       common + ["operation"], registry=r)
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
        self._overhead_child = self.overhead.labels(run_id, self.rank)
        self._rss = self.memory.labels(run_id, self.rank, "cpu", "rss")
        self._op_children: dict[str, tuple] = {}
        for component in semconv.COMPONENTS:
            self.internal_errors.labels(run_id, self.rank, component)
        self._known_ops: set[str] = set()

        # benchmark_optimizations (added): one series per OptimizationMode.
        self.opt_mode = LabelBudget(allowed=semconv.OPTIMIZATION_MODES)
        self.opt_step_seconds = Gauge(semconv.M_OPT_STEP_SECONDS, "Median step time of the last benchmark, by mode.",
                                      common + ["mode"], registry=r)
        self.opt_speedup = Gauge(semconv.M_OPT_SPEEDUP, "NONE's median step time over this mode's; below 1 is slower.",
                                 common + ["mode"], registry=r)
        self.opt_memory = Gauge(semconv.M_OPT_MEMORY, "Memory measured by the last benchmark, by mode, in bytes.",
                                common + ["mode"], registry=r)


    def _first_seen(self, op: str) -> None:
        """Create an operation's counters at zero, so ``increase()`` sees their first step."""
        self._known_ops.add(op)
        for kind in semconv.ANOMALY_KINDS_ALL:
            self.anomalies.labels(self.run_id, self.rank, op, kind)
        self.skipped.labels(self.run_id, self.rank, op)

    def set_level(self, level: str) -> None:
        if level == self._level:
            return
        try:
            self.build_info.remove(self.run_id, self.rank, self._version, self._level)
        except KeyError:
            pass
        self._level = level
        self.build_info.labels(self.run_id, self.rank, self._version, level).set(1)

    def _children(self, operation: str) -> tuple:
        """The per-operation series, resolved once per operation instead of ``.labels()`` per step."""
        kids = self._op_children.get(operation)
        if kids is None:
            lv = (self.run_id, self.rank, self.operation(operation))
            if lv[2] not in self._known_ops:
                self._first_seen(lv[2])
            kids = (self.steps.labels(*lv), self.step_duration.labels(*lv), self.loss.labels(*lv),
                    self.grad_norm.labels(*lv), self.grad_nonfinite.labels(*lv), self.last_step.labels(*lv), lv)
            if len(self._op_children) < 4 * MAX_LABEL_VALUES:  # operation names past the budget fold anyway
                self._op_children[operation] = kids
        return kids

    def observe_step(self, record: StepRecord) -> None:
        """Update the step instruments from a finished record."""
        steps, duration, loss, grad_norm, grad_nonfinite, last_step, lv = self._children(record.operation)
        steps.inc()
        exemplar = {"trace_id": record.trace_id} if record.trace_id else None
        duration.observe(record.duration_s, exemplar=exemplar)
        if record.loss is not None:
            loss.set(record.loss)
        if record.grad_norm is not None:
            grad_norm.set(record.grad_norm)
            grad_nonfinite.set(len(record.grad_nonfinite_params))
        if record.anomalies:
            for kind in record.anomaly_kinds:
                self.anomalies.labels(*lv, self.kind(kind)).inc()
        if record.skipped:
            self.skipped.labels(*lv).inc()
        last_step.set(record.end_unix_ns / 1e9 if record.end_unix_ns else time.time())
        if record.rank_step_seconds is not None:
            self.rank_step_seconds.labels(*lv).set(record.rank_step_seconds)
        if record.rank_skew is not None:
            self.set_rank_skew(record.rank_skew[0])
        if record.memory_slopes:
            for device, slope in record.memory_slopes.items():
                self.set_memory_growth(device, slope)
        mem = record.memory
        if mem.get("rss_bytes") is not None:
            self._rss.set(mem["rss_bytes"])
        if mem.get("cuda_allocated_bytes") is None and mem.get("cuda_reserved_bytes") is None:
            return  # no CUDA counters in this record (a CPU step)
        device = self.device(str(mem.get("device") or "cuda"))
        for key, kind in (("cuda_allocated_bytes", "allocated"), ("cuda_reserved_bytes", "reserved"),
                          ("cuda_peak_allocated_bytes", "peak_allocated")):
            if mem.get(key) is not None:
                self.memory.labels(self.run_id, self.rank, device, kind).set(mem[key])

    def series_caps(self) -> dict[str, int]:
        """The most label sets each metric family can hold in this process (overflow included).

        ``run_id`` and ``rank`` are fixed per process, so only the other labels count.
        """
        ops = MAX_LABEL_VALUES + 1
        kinds = len(semconv.ANOMALY_KINDS_ALL) + 1
        devices = MAX_DEVICE_VALUES + 1
        return {
            _base(semconv.M_STEPS): ops,
            semconv.M_STEP_DURATION: ops,
            semconv.M_LOSS: ops,
            semconv.M_GRAD_NORM: ops,
            semconv.M_GRAD_NONFINITE: ops,
            _base(semconv.M_ANOMALIES): ops * kinds,
            _base(semconv.M_SKIPPED): ops,
            semconv.M_MEMORY: 1 + devices * (len(semconv.MEMORY_KINDS) - 1),
            semconv.M_MEMORY_GROWTH: devices,
            semconv.M_LAST_STEP_TS: ops,
            _base(semconv.M_SPANS_DROPPED): len(semconv.DROP_REASONS) + 1,
            _base(semconv.M_INTERNAL_ERRORS): len(semconv.COMPONENTS) + 1,
            semconv.M_RANK_SKEW: 1,
            _base(semconv.M_OVERHEAD): 1,
            semconv.M_BUILD_INFO: 1,
        }

    def count_anomaly(self, operation: str, kind: str, n: int = 1) -> None:
        self.anomalies.labels(self.run_id, self.rank, self.operation(operation), self.kind(kind)).inc(n)

    def drop_spans(self, reason: str, n: int) -> None:
        self.spans_dropped.labels(self.run_id, self.rank, self.reason(reason)).inc(n)

    def internal_error(self, component: str) -> None:
        self.internal_errors.labels(self.run_id, self.rank, self.component(component)).inc()

    def add_overhead(self, seconds: float) -> None:
        self._overhead_child.inc(seconds)

    def set_memory_growth(self, device: str, bytes_per_step: float) -> None:
        self.memory_growth.labels(self.run_id, self.rank, self.device(str(device))).set(bytes_per_step)

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
