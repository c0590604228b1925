"""The per-step series, kept as plain numbers and built into metric families only at scrape time.

A step updates a handful of counters, a histogram bucket and a few floats under one lock, and
keeps its throughput values as one tuple, added up and bucketed every few hundred steps or at a
scrape (about 2 µs in all); prometheus_client instruments would cost several times that per step, for numbers that
are only read when Prometheus scrapes (every 15 s or so). :class:`StepMetrics` is a
prometheus_client collector registered on the runtime's private registry, so ``/metrics``,
``get_sample_value`` and the OTLP metrics push see it like any other instrument.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Callable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Exemplar

from torchtrace import semconv
from torchtrace.export.labels import MAX_DEVICE_VALUES, MAX_LABEL_VALUES, OVERFLOW, LabelBudget
from torchtrace.record.step import StepRecord

_LR_GROUP_CAP = f"{semconv.MAX_LR_GROUPS}+"
FOLD_EVERY = 64  # data waits and phase times bucketed together (at most; a scrape buckets what there is)
KEEP_STEPS = 4 * FOLD_EVERY  # steps' throughput values kept before they are added up without a scrape
# A record's throughput values (samples, tokens, flops, lr, data wait, phases) when it has none:
# such a step keeps nothing.
_ABSENT = (None,) * 6


def _base(name: str) -> str:
    return name[: -len("_total")] if name.endswith("_total") else name


def _gradients_used(record: StepRecord) -> bool:
    """Whether the step's gradients are the training's, for the gradient gauges: not those of
    a step whose scaled gradients overflowed, which the loss scaler threw away (it skipped the
    update and lowered its scale). Such a step is no ``nonfinite_grad`` anomaly (a scaler
    overflow under a finite loss, docs/forensics.md); its span says ``scaler_overflow``, and the
    gauges keep the last step whose gradients were used, as when the scaler skipped the step
    before torchtrace measured them. A step that kept its ``nonfinite_grad`` (a NaN loss under
    the scaler) still sets them."""
    return not record.scaler_overflow or semconv.NONFINITE_GRAD in record.anomaly_kinds


class _Histogram:
    """Bucket counts, sum and the last exemplar of each bucket (trace id of the step that landed there)."""

    __slots__ = ("bounds", "counts", "total", "exemplars")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.exemplars: list[tuple[str, float, float] | None] = [None] * (len(bounds) + 1)

    def observe(self, value: float, trace_id: str | None = None, now: float = 0.0) -> None:
        i = bisect.bisect_left(self.bounds, value)
        self.counts[i] += 1
        self.total += value
        if trace_id is not None:
            self.exemplars[i] = (trace_id, value, now)

    def observe_all(self, values: list[float]) -> None:
        """Many observations without exemplars (values kept since a scrape), each where
        :meth:`observe` puts it: the first bucket whose bound is not below it."""
        for value in values:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += sum(values)

    def buckets(self) -> list[tuple]:
        out: list[tuple] = []
        running = 0
        for i, bound in enumerate(self.bounds + (float("inf"),)):
            running += self.counts[i]
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            ex = self.exemplars[i]
            if ex is not None:
                out.append((le, running, Exemplar({"trace_id": ex[0]}, ex[1], ex[2])))
            else:
                out.append((le, running))
        return out


class _Operation:
    """Everything one operation label holds."""

    __slots__ = ("label", "created", "steps", "duration", "loss", "grad_norm", "grad_nonfinite", "last_ts",
                 "skipped", "anomalies", "samples", "tokens", "flops", "lr", "data_wait", "phases", "rank_step_seconds",
                 "unfolded", "unbucketed")

    def __init__(self, label: str, kinds: tuple[str, ...]) -> None:
        self.label = label
        self.created = time.time()
        self.steps = 0
        self.duration = _Histogram(semconv.STEP_DURATION_BUCKETS)
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.grad_nonfinite: int | None = None
        self.last_ts: float | None = None
        self.skipped = 0
        self.anomalies = dict.fromkeys(kinds, 0)  # every kind at zero, for alert rules' increase()
        self.samples: int | None = None
        self.tokens: int | None = None
        self.flops: float | None = None
        self.lr: list[float] | None = None
        self.data_wait: _Histogram | None = None
        self.phases: dict[str, _Histogram] | None = None
        self.rank_step_seconds: float | None = None
        self.unfolded: list[tuple] = []  # _THROUGHPUT's values of the steps since the last fold
        self.unbucketed: list[tuple] = []  # (data wait, phases) of the steps with either, not yet bucketed

    def fold(self, scrape: bool = False) -> None:
        """Add up the throughput values kept since the last fold (the lock is held), in step
        order. The data waits and phase times are bucketed FOLD_EVERY steps with either at a
        time, and the rest at a ``scrape``: the batches (so the histograms' float sums) that
        bucketing them as the steps came gave."""
        entries, self.unfolded = self.unfolded, []
        for samples, tokens, flops, lr, wait, phases in entries:
            if samples is not None:
                self.samples = (self.samples or 0) + samples
            if tokens is not None:
                self.tokens = (self.tokens or 0) + tokens
            if flops is not None:
                self.flops = (self.flops or 0.0) + flops
            if lr:
                self.lr = lr  # a record's values are not changed after it is finished
            if wait is not None or phases:
                self.unbucketed.append((wait, phases))
        pending = self.unbucketed
        while len(pending) >= FOLD_EVERY or (scrape and pending):
            self._bucket(pending[:FOLD_EVERY])
            pending = pending[FOLD_EVERY:]
        self.unbucketed = pending

    def _bucket(self, batch: list[tuple]) -> None:
        waits = [wait for wait, _ in batch if wait is not None]
        if waits:
            if self.data_wait is None:
                self.data_wait = _Histogram(semconv.DATA_WAIT_BUCKETS)
            self.data_wait.observe_all(waits)
        runs = [run for _, run in batch if run]
        if runs:
            if self.phases is None:
                self.phases = {p: _Histogram(semconv.DATA_WAIT_BUCKETS) for p in semconv.PHASES}
            for phase, hist in self.phases.items():
                hist.observe_all([run[phase] for run in runs if phase in run])


class StepMetrics:
    """A prometheus_client collector of the step series (see the module docstring)."""

    def __init__(self, run_id: str, rank: str, operation: LabelBudget, kind: LabelBudget, device: LabelBudget) -> None:
        self.run_id = run_id
        self.rank = rank
        self._operation = operation
        self._kind = kind
        self._device = device
        self._kinds = tuple(semconv.ANOMALY_KINDS_ALL)
        self._lock = threading.Lock()
        self._ops: dict[str, _Operation] = {}  # by label value
        self._by_name: dict[str, _Operation] = {}  # by the operation's own name (cache)
        self._memory: dict[tuple[str, str], float] = {}  # (device, kind) -> bytes
        self._growth: dict[str, float] = {}  # device -> bytes per step
        # Asked at scrape: (the goodput ratio now, badput seconds by kind, MFU by operation name).
        self.run_source: Callable[[], tuple[float | None, dict[str, float], dict[str, float]]] | None = None
        self._created = time.time()

    # ------------------------------------------------------------ updates
    def _op(self, name: str) -> _Operation:
        op = self._by_name.get(name)
        if op is None:
            label = self._operation(name)
            op = self._ops.get(label)
            if op is None:
                op = self._ops[label] = _Operation(label, self._kinds)
            if len(self._by_name) < 4 * MAX_LABEL_VALUES:  # names past the budget fold anyway
                self._by_name[name] = op
        return op

    def observe(self, record: StepRecord) -> None:
        """One finished step."""
        end = record.end_unix_ns / 1e9 if record.end_unix_ns else time.time()
        with self._lock:
            op = self._op(record.operation)
            op.steps += 1
            op.duration.observe(record.duration_s, record.trace_id, end)
            op.last_ts = end
            if record.loss is not None:
                op.loss = record.loss
            if record.grad_norm is not None and _gradients_used(record):
                op.grad_norm = record.grad_norm
                op.grad_nonfinite = len(record.grad_nonfinite_params)
            if record.skipped:
                op.skipped += 1
            for anomaly in record.anomalies:
                kind = self._kind(anomaly.kind)
                op.anomalies[kind] = op.anomalies.get(kind, 0) + 1
            self._memory_of(record)
            if record.rank_step_seconds is not None:
                op.rank_step_seconds = record.rank_step_seconds
            values = (record.samples, record.tokens, record.flops, record.lr, record.data_wait_s, record.phases)
            if values != _ABSENT:  # added up and bucketed at the next scrape, or every KEEP_STEPS steps
                op.unfolded.append(values)
                if len(op.unfolded) >= KEEP_STEPS:
                    op.fold()

    def _memory_of(self, record: StepRecord) -> None:
        mem = record.memory
        rss = mem.get("rss_bytes")
        if rss is not None:
            self._memory[("cpu", "rss")] = rss
        if mem.get("cuda_allocated_bytes") is not None:
            device = self._device(str(mem.get("device") or "cuda"))
            for key, kind in (("cuda_allocated_bytes", "allocated"), ("cuda_reserved_bytes", "reserved"),
                              ("cuda_peak_allocated_bytes", "peak_allocated")):
                if mem.get(key) is not None:
                    self._memory[(device, kind)] = mem[key]
        if record.memory_slopes:
            for device, slope in record.memory_slopes.items():
                self._growth[self._device(str(device))] = slope

    def count_anomaly(self, operation: str, kind: str, n: int = 1) -> None:
        with self._lock:
            op = self._op(operation)
            label = self._kind(kind)
            op.anomalies[label] = op.anomalies.get(label, 0) + n

    # ------------------------------------------------------------ scrape
    def describe(self) -> list[Metric]:
        return []  # families are built at collect; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            ops = list(self._ops.values())
            for o in ops:
                if o.unfolded or o.unbucketed:
                    o.fold(scrape=True)
            snapshot = [(o, o.duration.buckets(), o.duration.total, dict(o.anomalies),
                         (o.data_wait.buckets(), o.data_wait.total) if o.data_wait else None,
                         {p: (h.buckets(), h.total) for p, h in o.phases.items()} if o.phases else None,
                         list(o.lr) if o.lr else None) for o in ops]
            memory = dict(self._memory)
            growth = dict(self._growth)
        goodput, badput, mfu = None, dict.fromkeys(semconv.BADPUT_KINDS, 0.0), {}
        if self.run_source is not None:
            try:
                goodput, badput, by_name = self.run_source()
                mfu = {self._operation(name): value for name, value in by_name.items()}
            except Exception:  # a scrape must not fail for it
                pass
        base = [self.run_id, self.rank]
        yield from self._step_families(snapshot, base)
        yield from self._throughput_families(snapshot, base, mfu)
        mem = GaugeMetricFamily(semconv.M_MEMORY, "Memory in bytes, by device and kind.",
                                labels=semconv.COMMON_LABELS + ("device", "kind"))
        for (device, kind), value in memory.items():
            mem.add_metric(base + [device, kind], value)
        yield mem
        g = GaugeMetricFamily(semconv.M_MEMORY_GROWTH, "Leak detector's memory slope in bytes per step.",
                              labels=semconv.COMMON_LABELS + ("device",))
        for device, value in growth.items():
            g.add_metric(base + [device], value)
        yield g
        if goodput is not None:
            ratio = GaugeMetricFamily(semconv.M_GOODPUT, "Productive step time over wall time since configure.",
                                      labels=semconv.COMMON_LABELS)
            ratio.add_metric(base, goodput)
            yield ratio
        bad = CounterMetricFamily(_base(semconv.M_BADPUT), "Seconds not spent on productive steps, by kind.",
                                  labels=semconv.COMMON_LABELS + ("kind",))
        for kind, seconds in badput.items():
            bad.add_metric(base + [kind], seconds, created=self._created)
        yield bad

    def _step_families(self, snapshot: list, base: list[str]) -> Iterator[Metric]:
        labels = semconv.COMMON_LABELS + ("operation",)
        steps = CounterMetricFamily(_base(semconv.M_STEPS), "Steps completed.", labels=labels)
        duration = HistogramMetricFamily(semconv.M_STEP_DURATION,
                                         "Step wall time in seconds; exemplars carry the trace id.", labels=labels)
        loss = GaugeMetricFamily(semconv.M_LOSS, "Loss of the last step (NaN when it was NaN).", labels=labels)
        grad = GaugeMetricFamily(semconv.M_GRAD_NORM, "Global L2 gradient norm, before clipping, of the last step "
                                 "whose gradients were used (not a loss-scaler overflow's).", labels=labels)
        nonfinite = GaugeMetricFamily(semconv.M_GRAD_NONFINITE,
                                      "Parameter tensors whose gradient held NaN/Inf in the last step "
                                      "whose gradients were used.", labels=labels)
        anomalies = CounterMetricFamily(_base(semconv.M_ANOMALIES), "Anomalies detected, by kind.",
                                        labels=labels + ("kind",))
        skipped = CounterMetricFamily(_base(semconv.M_SKIPPED), "Optimizer updates skipped by the guard.",
                                      labels=labels)
        last = GaugeMetricFamily(semconv.M_LAST_STEP_TS, "Unix time of the last completed step.", labels=labels)
        rank_step = GaugeMetricFamily(semconv.M_RANK_STEP_SECONDS,
                                      "This rank's mean step time over the last skew window, in seconds.",
                                      labels=labels)
        for op, buckets, total, kinds, _wait, _phases, _lr in snapshot:
            lv = base + [op.label]
            skipped.add_metric(lv, op.skipped, created=op.created)
            for kind, n in kinds.items():
                anomalies.add_metric(lv + [kind], n, created=op.created)
            if op.steps:
                steps.add_metric(lv, op.steps, created=op.created)
                duration.add_metric(lv, buckets, total)
                last.add_metric(lv, op.last_ts)
            if op.loss is not None:
                loss.add_metric(lv, op.loss)
            if op.grad_norm is not None:
                grad.add_metric(lv, op.grad_norm)
                nonfinite.add_metric(lv, op.grad_nonfinite)
            if op.rank_step_seconds is not None:
                rank_step.add_metric(lv, op.rank_step_seconds)
        yield from (steps, duration, loss, grad, nonfinite, anomalies, skipped, last, rank_step)

    def _throughput_families(self, snapshot: list, base: list[str], by_label: dict[str, float]) -> Iterator[Metric]:
        labels = semconv.COMMON_LABELS + ("operation",)
        samples = CounterMetricFamily(_base(semconv.M_SAMPLES), "Samples processed (batch items).", labels=labels)
        tokens = CounterMetricFamily(_base(semconv.M_TOKENS), "Tokens processed (non-padding where a mask says so).",
                                     labels=labels)
        flops = CounterMetricFamily(_base(semconv.M_FLOPS), "Model FLOPs executed, forward + backward.", labels=labels)
        mfu = GaugeMetricFamily(semconv.M_MFU, "Achieved FLOP/s over peak FLOP/s, last window.", labels=labels)
        lr = GaugeMetricFamily(semconv.M_LEARNING_RATE, "Learning rate of a parameter group.",
                               labels=labels + ("group",))
        wait = HistogramMetricFamily(semconv.M_DATA_WAIT, "Time from the end of one step to the start of the next.",
                                     labels=labels)
        phase = HistogramMetricFamily(semconv.M_STEP_PHASE, "Step phase time (device time on CUDA).",
                                      labels=labels + ("phase",))
        for op, _b, _t, _k, wait_buckets, phases, rates in snapshot:
            lv = base + [op.label]
            if op.samples is not None:
                samples.add_metric(lv, op.samples, created=op.created)
            if op.tokens is not None:
                tokens.add_metric(lv, op.tokens, created=op.created)
            if op.flops is not None:
                flops.add_metric(lv, op.flops, created=op.created)
            if op.label in by_label:
                mfu.add_metric(lv, by_label[op.label])
            if rates:
                for i, rate in enumerate(rates[: semconv.MAX_LR_GROUPS + 1]):
                    lr.add_metric(lv + [str(i) if i < semconv.MAX_LR_GROUPS else _LR_GROUP_CAP], rate)
            if wait_buckets is not None:
                wait.add_metric(lv, *wait_buckets)
            if phases:
                for name, (buckets, total) in phases.items():
                    phase.add_metric(lv + [name], buckets, total)
        yield from (samples, tokens, flops, mfu, lr, wait, phase)

    # ------------------------------------------------------------ caps
    def series_caps(self) -> dict[str, int]:
        ops = MAX_LABEL_VALUES + 1
        kinds = len(semconv.ANOMALY_KINDS_ALL) + 1
        devices = MAX_DEVICE_VALUES + 1
        return {
            _base(semconv.M_STEPS): ops, semconv.M_STEP_DURATION: ops, semconv.M_LOSS: ops, semconv.M_GRAD_NORM: ops,
            semconv.M_GRAD_NONFINITE: ops, _base(semconv.M_ANOMALIES): ops * kinds, _base(semconv.M_SKIPPED): ops,
            semconv.M_MEMORY: 1 + devices * (len(semconv.MEMORY_KINDS) - 1), semconv.M_MEMORY_GROWTH: devices,
            semconv.M_LAST_STEP_TS: ops, semconv.M_RANK_STEP_SECONDS: ops,
            _base(semconv.M_SAMPLES): ops, _base(semconv.M_TOKENS): ops, _base(semconv.M_FLOPS): ops,
            semconv.M_MFU: ops, semconv.M_LEARNING_RATE: ops * (semconv.MAX_LR_GROUPS + 1),
            semconv.M_DATA_WAIT: ops, semconv.M_STEP_PHASE: ops * len(semconv.PHASES), semconv.M_GOODPUT: 1,
            _base(semconv.M_BADPUT): len(semconv.BADPUT_KINDS),
        }


__all__ = ["OVERFLOW", "StepMetrics"]
