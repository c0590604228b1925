"""The leak detector probe: a robust memory slope per device each step, an investigation when
it is sustained, and a ``memory_leak`` anomaly with the report."""

from __future__ import annotations

import collections
import math
import time
from typing import Any

from torchtrace import semconv
from torchtrace.measure import census
from torchtrace.measure import memory as mem_measure
from torchtrace.probes.base import Probe
from torchtrace.record import growth
from torchtrace.record.step import Anomaly

HEAP_FREE_S = 100e-6  # a heap sample this cheap is taken every step
HEAP_BUDGET = 0.005  # otherwise at most this share of the step time goes to heap samples
HEAP_MAX_GAP = 64  # and at least one sample every this many steps


class LeakProbe(Probe):
    """The leak detector: robust slope per device each step; an investigation when it is sustained.

    Cheap per step (host floats only). After a sustained slope, the slow path runs for
    ``confirm_steps`` steps and then a ``memory_leak`` anomaly is added with the report; the
    slope windows then start afresh. The slope goes to ``record.memory_growth``; the report of a
    flagged leak to ``record.leak``.
    """

    name = "memory_leaks"
    component = "memory"

    def __init__(self, runtime, use_tracemalloc: bool = True) -> None:
        self.rt = runtime
        s = runtime.settings
        self.window = max(int(getattr(s, "leak_window", growth.DEFAULT_WINDOW)), 4)
        self.threshold = float(getattr(s, "leak_threshold_bytes", growth.DEFAULT_THRESHOLD))
        self.confirm_steps = int(getattr(s, "leak_confirm_steps", census.DEFAULT_CONFIRM_STEPS))
        self.use_tracemalloc = use_tracemalloc
        self.trackers: dict[str, growth.GrowthTracker] = {}
        self.investigation: census.Investigation | None = None
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

    def _tracker(self, device: str) -> growth.GrowthTracker:
        t = self.trackers.get(device)
        if t is None:
            t = self.trackers[device] = growth.GrowthTracker(self.window, self.threshold)
        return t

    def finish(self, scope, state, record, values) -> None:
        if not scope.features.leak_detector:
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
                if record.memory_slopes is None:
                    record.memory_slopes = {}
                record.memory_slopes[device] = slope
                if device == points[0][0]:
                    record.memory_growth = slope
                if tr.sustained() and worst is None:
                    worst = (device, tr)
        if not points:  # the heap was not sampled this step: the span carries the last slope
            tr = self.trackers.get("cpu")
            if tr is not None and tr.slope is not None:
                record.memory_growth = tr.slope
        if self.investigation is not None:
            self.investigation.steps += 1
            if self.investigation.steps >= self.confirm_steps:
                self._conclude(record)
            return
        if worst is not None:
            self.investigated_device = worst[0]
            self.investigations += 1
            self.investigation = census.Investigation.begin(record.step, use_tracemalloc=self.use_tracemalloc)

    def _conclude(self, record) -> None:
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
        if census.attributed_bytes(report) < 0.25 * slope * steps:
            self.unattributed += 1
            if self.unattributed < 2:
                return
            report["unattributed"] = True
        self.unattributed = 0
        report["device"] = device
        report["bytes_per_step"] = slope
        self.reports.append(report)
        self.flagged += 1
        detail = census.leak_detail(device, slope, report)
        record.anomalies.append(Anomaly(semconv.MEMORY_LEAK, detail, record.step, record.operation,
                                        {"device": device, "bytes_per_step": slope}))
        sites = (report.get("cuda_sites") or []) + (report.get("sites") or [])
        record.leak = {"detail": detail, "bytes_per_step": slope, "device": device,
                       "tensor_lines": [census.describe_group(g)[:200] for g in report.get("tensors") or []],
                       "site_lines": [f"{s['site']} +{s['bytes']}B"[:200] for s in sites[:census.MAX_REPORTED]]}

    def close(self) -> None:
        if self.investigation is not None:
            self.investigation.stop()
            self.investigation = None
