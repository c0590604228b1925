"""Memory over a run: per-step samples, snapshots and their comparison, tracked tensors,
and the leak detector probe that turns a sustained slope into a ``memory_leak`` anomaly.

>>> import torch, torchtrace as tt
>>> a = tt.take_memory_snapshot("before")
>>> keep = torch.zeros(1024, 1024)
>>> b = tt.take_memory_snapshot("after")
>>> b.compare(a)["rss_bytes"] is not None
True
"""

from __future__ import annotations

import collections
import contextlib
import gc
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from torchtrace import semconv
from torchtrace.forensics import leaks
from torchtrace.measure import memory as mem_measure
from torchtrace.record.step import Anomaly

HEAP_FREE_S = 100e-6  # a heap sample this cheap is taken every step
HEAP_BUDGET = 0.005  # otherwise at most this share of the step time goes to heap samples
HEAP_MAX_GAP = 64  # and at least one sample every this many steps


# ---------------------------------------------------------------- snapshots
@dataclass
class MemorySnapshot:
    """Memory at one moment: process RSS, CUDA counters, tracked tensors, optionally a tensor census."""

    name: str
    unix_time: float
    memory: dict[str, int | None]
    tracked: dict[str, int | None] = field(default_factory=dict)  # name -> bytes, None once freed
    census: dict[tuple, list] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "unix_time": self.unix_time, "memory": dict(self.memory),
               "tracked": dict(self.tracked)}
        if self.census is not None:
            out["tensor_groups"] = len(self.census)
            out["tensor_count"] = sum(g[0] for g in self.census.values())
            out["tensor_bytes"] = sum(g[1] for g in self.census.values())
        return out

    def compare(self, earlier: "MemorySnapshot") -> dict[str, Any]:
        """This snapshot minus ``earlier``: memory deltas, tracked tensors freed/new, growing tensor groups."""
        return compare(earlier, self)


def compare(before: MemorySnapshot, after: MemorySnapshot) -> dict[str, Any]:
    """Differences from ``before`` to ``after`` (bytes; None where either side lacks the value)."""
    deltas: dict[str, int | None] = {}
    for key in set(before.memory) | set(after.memory):
        a, b = before.memory.get(key), after.memory.get(key)
        deltas[key] = (b - a) if a is not None and b is not None else None
    out: dict[str, Any] = dict(deltas)
    out["from"] = before.name
    out["to"] = after.name
    out["seconds"] = after.unix_time - before.unix_time
    out["tracked_freed"] = sorted(n for n, v in after.tracked.items() if v is None and before.tracked.get(n) is not None)
    out["tracked_new"] = sorted(n for n in after.tracked if n not in before.tracked)
    if before.census is not None and after.census is not None:
        out["growing_tensors"] = leaks.census_growth(before.census, after.census, 1)[:leaks.MAX_REPORTED]
    return out


class _Tracked:
    __slots__ = ("ref", "nbytes", "shape", "dtype", "device", "freed_unix")

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)
        self.nbytes = t.numel() * t.element_size()
        self.shape = list(t.shape)
        self.dtype = str(t.dtype).replace("torch.", "")
        self.device = str(t.device)
        self.freed_unix: float | None = None


class MemoryTracker:
    """Per-step memory samples (bounded), named snapshots and weakly tracked tensors.

    >>> tracker = MemoryTracker()
    >>> t = torch.ones(4); tracker.track_tensor(t, "ones")
    >>> tracker.tracked()["ones"]["alive"]
    True
    """

    def __init__(self, max_samples: int = 10000, max_snapshots: int = 100) -> None:
        self.samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_samples)
        self.snapshots: collections.OrderedDict[str, MemorySnapshot] = collections.OrderedDict()
        self.max_snapshots = max_snapshots
        self._tracked: dict[str, _Tracked] = {}
        self.active = False

    def add_sample(self, step: int, operation: str, memory: dict[str, Any]) -> None:
        self.samples.append({"step": step, "operation": operation, **memory})

    def track_tensor(self, t: torch.Tensor, name: str) -> None:
        """Watch ``t`` through a weak reference: tracking never keeps it alive."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"track_tensor expects a tensor, got {type(t).__name__}")
        entry = _Tracked(t)

        def _freed(_ref, entry=entry):
            entry.freed_unix = time.time()

        entry.ref = weakref.ref(t, _freed)
        self._tracked[name] = entry

    def tracked(self) -> dict[str, dict[str, Any]]:
        return {name: {"alive": e.ref() is not None, "bytes": e.nbytes, "shape": e.shape, "dtype": e.dtype,
                       "device": e.device, "freed_unix": e.freed_unix} for name, e in self._tracked.items()}

    def take_snapshot(self, name: str | None = None, census: bool = False) -> MemorySnapshot:
        name = name or f"snapshot_{len(self.snapshots)}"
        snap = MemorySnapshot(name=name, unix_time=time.time(), memory=mem_measure.sample().as_dict(),
                              tracked={n: (e.nbytes if e.ref() is not None else None) for n, e in self._tracked.items()},
                              census=leaks.tensor_census() if census else None)
        self.snapshots[name] = snap
        while len(self.snapshots) > self.max_snapshots:
            self.snapshots.popitem(last=False)
        return snap

    def summary(self) -> dict[str, Any]:
        rss = [s["rss_bytes"] for s in self.samples if s.get("rss_bytes") is not None]
        out: dict[str, Any] = {"samples": len(self.samples), "snapshots": list(self.snapshots),
                               "tracked": self.tracked()}
        if rss:
            out["rss_first"] = rss[0]
            out["rss_last"] = rss[-1]
            out["rss_max"] = max(rss)
        cuda = [s["cuda_peak_allocated_bytes"] for s in self.samples if s.get("cuda_peak_allocated_bytes") is not None]
        if cuda:
            out["cuda_peak_allocated_max"] = max(cuda)
        return out


_TRACKER = MemoryTracker()


def tracker() -> MemoryTracker:
    """The process-wide tracker the module-level functions use."""
    return _TRACKER


def take_memory_snapshot(name: str | None = None, census: bool = False) -> MemorySnapshot:
    """A named snapshot of memory now; ``census=True`` also groups the live tensors (slow)."""
    return _TRACKER.take_snapshot(name, census)


def track_tensor(t: torch.Tensor, name: str) -> None:
    """Watch a tensor by weak reference; snapshots and reports say whether it is still alive."""
    _TRACKER.track_tensor(t, name)


def clear_memory() -> dict[str, int | None]:
    """Collect garbage and return cached CUDA blocks to the driver; returns bytes released per counter."""
    before = mem_measure.sample()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    after = mem_measure.sample()
    out = {"rss_bytes": before.rss - after.rss}
    if before.cuda_reserved is not None and after.cuda_reserved is not None:
        out["cuda_reserved_bytes"] = before.cuda_reserved - after.cuda_reserved
        out["cuda_allocated_bytes"] = before.cuda_allocated - after.cuda_allocated
    return out


@contextlib.contextmanager
def memory_tracking(tracker_: MemoryTracker | None = None) -> Iterator[MemoryTracker]:
    """Record a memory sample for every instrumented step inside the block.

    ``DebugMode.MEMORY_PROFILING`` does the same for the whole run. Snapshots ``start`` and
    ``end`` are taken around the block.
    """
    trk = tracker_ or _TRACKER
    was = trk.active
    trk.active = True
    trk.take_snapshot("start")
    try:
        yield trk
    finally:
        trk.take_snapshot("end")
        trk.active = was


# ---------------------------------------------------------------- the probes
class MemoryProbe:
    """Per-step samples into the tracker (memory_profiling feature or inside ``memory_tracking()``)."""

    def __init__(self, runtime) -> None:
        self.rt = runtime

    def enter(self, scope) -> None:
        return None

    def exit(self, scope, exc) -> None:
        return None

    def finalize(self, scope, record, span) -> None:
        feats = scope._features if scope is not None else self.rt.features
        if feats.memory_profiling or _TRACKER.active:
            _TRACKER.add_sample(record.step, record.operation, record.memory)


class LeakProbe:
    """The leak detector: robust slope per device each step; an investigation when it is sustained.

    Cheap per step (host floats only). After a sustained slope, the slow path runs for
    ``confirm_steps`` steps and then a ``memory_leak`` anomaly is added with the report; the
    slope windows then start afresh.
    """

    def __init__(self, runtime, use_tracemalloc: bool = True) -> None:
        self.rt = runtime
        s = runtime.settings
        self.window = max(int(getattr(s, "leak_window", leaks.DEFAULT_WINDOW)), 4)
        self.threshold = float(getattr(s, "leak_threshold_bytes", leaks.DEFAULT_THRESHOLD))
        self.confirm_steps = int(getattr(s, "leak_confirm_steps", leaks.DEFAULT_CONFIRM_STEPS))
        self.use_tracemalloc = use_tracemalloc
        self.trackers: dict[str, leaks.GrowthTracker] = {}
        self.investigation: leaks.Investigation | None = None
        self.investigated_device: str | None = None
        self.unattributed = 0
        self.reports: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
        self.flagged = 0
        self.investigations = 0  # slow paths started (each runs confirm_steps steps)
        self.heap_every = 1  # the CPU heap is sampled every this many steps (see _sample_heap)
        self._heap_wait = 0
        self._heap_cost: float | None = None  # seconds per mallinfo2 call, smoothed
        self._step_s: float | None = None  # step wall time, smoothed
        self._heap_available = True
        runtime.report_sections["memory_leaks"] = self.section

    def configure(self, window: int | None = None, threshold: float | None = None,
                  confirm_steps: int | None = None) -> None:
        if window is not None:
            self.window = window
        if threshold is not None:
            self.threshold = float(threshold)
        if confirm_steps is not None:
            self.confirm_steps = confirm_steps
        self.trackers.clear()

    def section(self) -> dict[str, Any]:
        return {"flagged": self.flagged, "investigations": self.investigations, "threshold_bytes_per_step": self.threshold, "window": self.window,
                "heap_sampled_every_steps": self.heap_every,
                "slopes": {d: t.slope for d, t in self.trackers.items()}, "reports": list(self.reports)}

    def enter(self, scope) -> None:
        return None

    def exit(self, scope, exc) -> None:
        return None

    def on_level(self, features) -> None:
        """The level changed: without the leak detector, an investigation in progress (and the
        tracemalloc it started, which slows every allocation) ends now, not at the next
        recorded step (at OFF there is none)."""
        if not features.leak_detector and self.investigation is not None:
            self.investigation.stop()
            self.investigation = None

    def _sample_heap(self, step_s: float) -> int | None:
        """The CPU heap in use, on the steps it is sampled; None on the others.

        glibc's ``mallinfo2`` walks the allocator's free lists, so its cost grows with
        fragmentation: a few microseconds in a fresh process, over a millisecond after heavy
        churn. It runs every step while it costs under ``HEAP_FREE_S``; past that, every N steps
        with N chosen so it takes at most ``HEAP_BUDGET`` of the step time (N at most
        ``HEAP_MAX_GAP``). The slope stays in bytes per step, as the samples carry their steps.
        """
        self._step_s = step_s if self._step_s is None else 0.8 * self._step_s + 0.2 * step_s
        if self._heap_wait > 0:
            self._heap_wait -= 1
            return None
        if self._heap_cost is None:
            mem_measure.heap_in_use_bytes()  # the first call loads the C library: not a sample's cost
        t0 = time.perf_counter()
        heap = mem_measure.heap_in_use_bytes()
        cost = time.perf_counter() - t0
        if heap is None:
            self._heap_available = False
            return None
        self._heap_cost = cost if self._heap_cost is None else 0.7 * self._heap_cost + 0.3 * cost
        if self._heap_cost <= HEAP_FREE_S:
            gap = 1
        else:
            gap = min(HEAP_MAX_GAP, max(1, math.ceil(self._heap_cost / (HEAP_BUDGET * max(self._step_s, 1e-6)))))
        self.heap_every = gap
        self._heap_wait = gap - 1
        return heap

    def _tracker(self, device: str) -> leaks.GrowthTracker:
        t = self.trackers.get(device)
        if t is None:
            t = self.trackers[device] = leaks.GrowthTracker(self.window, self.threshold)
        return t

    def finalize(self, scope, record, span) -> None:
        feats = scope._features if scope is not None else self.rt.features
        if not feats.leak_detector:
            if self.investigation is not None:
                self.investigation.stop()
                self.investigation = None
            return
        mem = record.memory
        points = []
        if mem.get("cuda_allocated_bytes") is not None:
            points.append((mem.get("device") or "cuda", mem["cuda_allocated_bytes"]))
        heap = self._sample_heap(record.duration_s)
        if heap is not None:
            points.append(("cpu", heap))
        elif not self._heap_available and mem.get("rss_bytes") is not None:
            points.append(("cpu", mem["rss_bytes"]))  # no glibc: RSS, already sampled
        worst = None
        for device, value in points:
            tr = self._tracker(device)
            slope = tr.add(record.step, value)
            if slope is not None:
                self.rt.metrics.set_memory_growth(device, slope)
                if device == points[0][0]:
                    span.set_attribute(semconv.MEMORY_GROWTH_BYTES_PER_STEP, slope)
                if tr.sustained() and worst is None:
                    worst = (device, tr)
        if not points:  # the heap was not sampled this step: the span carries the last slope
            tr = self.trackers.get("cpu")
            if tr is not None and tr.slope is not None:
                span.set_attribute(semconv.MEMORY_GROWTH_BYTES_PER_STEP, tr.slope)
        if self.investigation is not None:
            self.investigation.steps += 1
            if self.investigation.steps >= self.confirm_steps:
                self._conclude(record, span)
            return
        if worst is not None:
            self.investigated_device = worst[0]
            self.investigations += 1
            self.investigation = leaks.Investigation.begin(record.step, use_tracemalloc=self.use_tracemalloc)

    def _conclude(self, record, span) -> None:
        """Flag when the slow path accounts for the growth, or when growth nothing accounts for
        is seen in two windows in a row (a leak outside tensors and Python objects)."""
        inv, self.investigation = self.investigation, None
        report = inv.finish(record.step)
        device = self.investigated_device or "cpu"
        tr = self.trackers.get(device)
        slope = tr.slope if tr is not None else None
        for t in self.trackers.values():
            t.reset()  # a fresh window, free of the slow path's own allocations
        if slope is None or slope <= self.threshold:
            self.unattributed = 0
            return
        steps = max(report["end_step"] - report["start_step"], 1)
        if leaks.attributed_bytes(report) < 0.25 * slope * steps:
            self.unattributed += 1
            if self.unattributed < 2:
                return
            report["unattributed"] = True
        self.unattributed = 0
        report["device"] = device
        report["bytes_per_step"] = slope
        self.reports.append(report)
        self.flagged += 1
        detail = leaks.leak_detail(device, slope, report)
        record.anomalies.append(Anomaly(semconv.MEMORY_LEAK, detail, record.step, record.operation,
                                        {"device": device, "bytes_per_step": slope}))
        attrs: dict[str, Any] = {semconv.EVENT_ANOMALY_DETAIL: detail[:semconv.MAX_ATTRIBUTE_LENGTH],
                                 semconv.MEMORY_GROWTH_BYTES_PER_STEP: slope}
        if report.get("tensors"):
            attrs[semconv.MEMORY_LEAK_TENSORS] = [leaks.describe_group(g)[:200] for g in report["tensors"]]
        sites = (report.get("cuda_sites") or []) + (report.get("sites") or [])
        if sites:
            attrs[semconv.MEMORY_LEAK_SITES] = [f"{s['site']} +{s['bytes']}B"[:200] for s in sites[:leaks.MAX_REPORTED]]
        span.add_event(semconv.EVENT_MEMORY_LEAK, attrs)

    def close(self) -> None:
        if self.investigation is not None:
            self.investigation.stop()
            self.investigation = None
