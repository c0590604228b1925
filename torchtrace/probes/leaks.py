"""The leak detector probe: a robust memory slope per device each step, an investigation when
it is sustained, and a ``memory_leak`` anomaly with the report."""

from __future__ import annotations

import collections
import gc
import math
import time
from typing import TYPE_CHECKING, Any

import torch

from torchtrace import semconv
from torchtrace.measure import census
from torchtrace.measure import memory as mem_measure
from torchtrace.probes.base import Probe
from torchtrace.record import growth
from torchtrace.record.step import Anomaly

if TYPE_CHECKING:
    from torchtrace.levels import Features
    from torchtrace.record.step import StepRecord
    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope

HEAP_FREE_S = 100e-6  # a heap sample this cheap is taken every step
HEAP_BUDGET = 0.005  # otherwise at most this share of the step time goes to heap samples
HEAP_MAX_GAP = 64  # and at least one sample every this many steps
EXTRA_SAMPLES = 2 * growth.MIN_SAMPLES  # out-of-turn heap samples between two regular ones, at most
BACKOFF_MAX = 5  # a growth that stays is investigated again after window * 2**k steps, k <= this


def heap_gap(cost_s: float, step_s: float, budget: float | None = None, max_gap: int | None = None) -> int:
    """Steps between two CPU heap samples: 1 while a sample costs under ``HEAP_FREE_S``, else
    the fewest steps that keep samples under ``budget`` (``HEAP_BUDGET``) of the step time, at
    most ``max_gap`` (``HEAP_MAX_GAP``).

    >>> heap_gap(20e-6, 0.01), heap_gap(1e-3, 0.03), heap_gap(1.5e-3, 0.001)
    (1, 7, 64)
    """
    budget = HEAP_BUDGET if budget is None else budget
    max_gap = HEAP_MAX_GAP if max_gap is None else max_gap
    if cost_s <= HEAP_FREE_S:
        return 1
    return min(max_gap, max(1, math.ceil(cost_s / (budget * max(step_s, 1e-6)))))


def timed_heap_sample() -> tuple[int | None, float]:
    """The heap in use and what reading it cost, in this thread's CPU seconds: a thread
    descheduled during the read (a busy machine) is not charged for the wait, so one slow
    wall-clock read does not stretch the gap to the next sample."""
    t0 = time.thread_time()
    heap = mem_measure.heap_in_use_bytes()
    return heap, time.thread_time() - t0


def reachable_bytes(device: str) -> int | None:
    """Memory in use on ``device`` after a full garbage collection: what live objects hold,
    without the reference cycles nothing reaches any more (a loop under ``gc.disable()`` that
    collects every N steps, or cycles waiting for the oldest generation). The CPU heap in use
    (RSS without glibc, which a collection rarely lowers), or the CUDA allocator's count.
    Costs a full collection: about what a census costs (see docs/profiling.md)."""
    gc.collect()
    if not device.startswith("cpu"):
        try:
            return int(torch.cuda.memory_allocated(device))
        except Exception:
            return None
    heap = mem_measure.heap_in_use_bytes()
    return heap if heap is not None else mem_measure.rss_bytes()


def checkpoints(confirm_steps: int) -> set[int]:
    """Confirmation steps, besides its first and last, at which the reachable memory is
    measured: three quarters (6 of the default 8), so the last quarter must grow too. Each
    measure is a full collection, about a census's cost: one is enough.

    >>> sorted(checkpoints(8)), sorted(checkpoints(4)), sorted(checkpoints(1))
    ([6], [3], [])
    """
    return {k for k in (3 * confirm_steps // 4,) if 0 < k < confirm_steps}


class LeakProbe(Probe[None]):
    """The leak detector: robust slope per device each step; an investigation when it is sustained.

    Cheap per step (host floats only). Samples are placed on the probe's own count of recorded
    steps (every operation's), so interleaved operations with their own step numbers share one
    axis. When a device's growth is suspected the CPU heap is sampled every
    ``GrowthTracker.stride()`` steps (1 to a few) until the rule in
    :mod:`torchtrace.record.growth` settles it, with at most ``EXTRA_SAMPLES`` out-of-turn
    samples between two regular ones; a sustained slope starts the slow path
    for ``confirm_steps`` steps, at whose start, middle and end the memory left after a full
    garbage collection is measured (``reachable_bytes``); when that growth goes on
    (``growth.goes_on``) a ``memory_leak`` anomaly is added with the report, the
    slope windows start afresh, and the next investigation waits ``window * 2**k`` steps
    (k counts investigations in a row, up to ``BACKOFF_MAX``; it falls back to 0 after a calm
    window). The slope goes to ``record.memory_growth``; the report of a flagged leak to
    ``record.leak``.
    """

    name = "memory_leaks"
    component = "memory"

    def __init__(self, runtime: Runtime, use_tracemalloc: bool = True) -> None:
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
        self.ticks = 0  # steps this probe has recorded: the x axis of every slope
        self.heap_every = 1  # the CPU heap is sampled every this many steps (see _sample_heap)
        self.heap_extra_samples = 0  # samples taken before their turn because growth was suspected
        self._heap_wait = 0
        self._heap_cost: float | None = None  # seconds per mallinfo2 call, smoothed
        self._step_s: float | None = None  # step wall time, smoothed
        self._heap_available = True
        self._extra_run = 0  # out-of-turn samples since the last regular one
        self._rss_ref: tuple[int, int] | None = None  # (tick, resident bytes) at the last heap sample
        self._heap_due: int | None = None  # tick from which the CPU tracker wants a sample out of turn
        self._quiet_until = 0  # no investigation starts before this tick
        self._backoff = 0
        self._retried = False  # the last wait was skipped for a paused growth

    def configure(self, window: int | None = None, threshold: float | None = None,
                  confirm_steps: int | None = None) -> None:
        if window is not None:
            self.window = window
        if threshold is not None:
            self.threshold = float(threshold)
        if confirm_steps is not None:
            self.confirm_steps = confirm_steps
        self.trackers.clear()
        self._heap_due = self._rss_ref = None

    def section(self) -> dict[str, Any]:
        return {"flagged": self.flagged, "investigations": self.investigations,
                "threshold_bytes_per_step": self.threshold, "window": self.window,
                "heap_sampled_every_steps": self.heap_every, "heap_extra_samples": self.heap_extra_samples,
                "slopes": {d: t.slope for d, t in self.trackers.items()}, "reports": list(self.reports)}

    def wanted(self, features: Features) -> bool:
        return features.leak_detector

    def on_level(self, features: Features) -> None:
        """The level changed: without the leak detector, an investigation in progress (and the
        tracemalloc it started, which slows every allocation) ends now, not at the next
        recorded step (at OFF there is none)."""
        if not features.leak_detector and self.investigation is not None:
            self.investigation.stop()
            self.investigation = None

    def _sample_heap(self, step_s: float, extra: bool = False) -> int | None:
        """The CPU heap in use, on the steps it is sampled; None on the others.

        glibc's ``mallinfo2`` walks the allocator's free lists, so its cost grows with
        fragmentation: a few microseconds in a fresh process, over a millisecond after heavy
        churn. It runs every ``heap_gap(cost, step time)`` steps, and also now when ``extra``
        (growth is suspected: the slope needs samples sooner than the budget gives). The
        slope stays in bytes per step, as the samples carry their steps.
        """
        self._step_s = step_s if self._step_s is None else 0.8 * self._step_s + 0.2 * step_s
        if self._heap_wait > 0 and not extra:
            self._heap_wait -= 1
            return None
        if self._heap_wait > 0:
            self._extra_run += 1
            self.heap_extra_samples += 1
        else:
            self._extra_run = 0
        if self._heap_cost is None:
            mem_measure.heap_in_use_bytes()  # the first call loads the C library: not a sample's cost
        heap, cost = timed_heap_sample()
        if heap is None:
            self._heap_available = False
            return None
        self._heap_cost = cost if self._heap_cost is None else 0.7 * self._heap_cost + 0.3 * cost
        self.heap_every = heap_gap(self._heap_cost, self._step_s)
        self._heap_wait = self.heap_every - 1
        return heap

    def _tracker(self, device: str) -> growth.GrowthTracker:
        t = self.trackers.get(device)
        if t is None:
            t = self.trackers[device] = growth.GrowthTracker(self.window, self.threshold)
        return t

    def _wants_heap(self, tick: int, rss: int | None) -> bool:
        """Sample the heap out of turn: no investigation is running or due to wait, fewer than
        ``EXTRA_SAMPLES`` were taken out of turn since the last regular sample, and the CPU
        tracker needs its first sample after the warm-up or suspects growth, or the resident
        size (read every step anyway) rose since the last heap sample by a quarter window's
        evidence, faster than the threshold."""
        if self.investigation is not None or tick < self._quiet_until or self._extra_run >= EXTRA_SAMPLES:
            return False
        due = self._heap_due  # planned when the last CPU sample was added: a few comparisons a step
        if due is not None and tick >= due:
            return True
        ref = self._rss_ref
        if rss is None or ref is None:
            return False
        rose = rss - ref[1]
        return rose >= 0.25 * self.threshold * self.window and rose > self.threshold * (tick - ref[0])

    def finish(self, scope: StepScope, state: None, record: StepRecord, values: list[float] | None) -> None:
        tick = self.ticks
        self.ticks += 1
        if self.investigation is None and self._backoff and tick > self._quiet_until + self.window:
            self._backoff = 0  # a calm window after the wait: the next growth is a new one
        mem = record.memory
        points = []
        if mem.get("cuda_allocated_bytes") is not None:
            points.append((mem.get("device") or "cuda", mem["cuda_allocated_bytes"]))
        rss = mem.get("rss_bytes")
        heap = self._sample_heap(record.duration_s, self._heap_available and self._wants_heap(tick, rss))
        if heap is not None:
            points.append(("cpu", heap))
        elif not self._heap_available and mem.get("rss_bytes") is not None:
            points.append(("cpu", mem["rss_bytes"]))  # no glibc: RSS, already sampled
        worst = None
        for device, value in points:
            tr = self._tracker(device)
            slope = tr.add(tick, value, refresh=self.investigation is None)
            if device == "cpu" and heap is not None:
                self._heap_due = tr.sample_due()
                self._rss_ref = (tick, rss) if rss is not None and not tr.in_warmup(tick) else None
            if slope is not None:
                if record.memory_slopes is None:
                    record.memory_slopes = {}
                record.memory_slopes[device] = slope
                if device == points[0][0]:
                    record.memory_growth = slope
                if worst is None and self.investigation is None and tick >= self._quiet_until and tr.sustained():
                    worst = (device, tr)
        if not points:  # the heap was not sampled this step: the span carries the last slope
            cpu = self.trackers.get("cpu")
            if cpu is not None and cpu.slope is not None:
                record.memory_growth = cpu.slope
        if self.investigation is not None:
            self._confirm_step(record)
            return
        if worst is not None:
            self._investigate(worst[0], record)

    def _investigate(self, device: str, record: StepRecord) -> None:
        """Start the slow path; garbage is collected first, so the census and the measure of
        where the confirmation starts count only what is reachable."""
        self.investigated_device = device
        self.investigations += 1
        start = reachable_bytes(device)
        self.investigation = census.Investigation.begin(record.step, use_tracemalloc=self.use_tracemalloc)
        self.investigation.extra["reachable"] = {0: start}

    def _confirm_step(self, record: StepRecord) -> None:
        """One confirmation step: the reachable memory is measured at three quarters
        (``checkpoints``), and the investigation concluded at the end."""
        inv = self.investigation
        if inv is None:
            return
        inv.steps += 1
        if inv.steps >= self.confirm_steps:
            self._conclude(record)
        elif inv.steps in checkpoints(self.confirm_steps):
            inv.extra["reachable"][inv.steps] = reachable_bytes(self.investigated_device or "cpu")

    def _reachable_growth(self, inv: census.Investigation, device: str) -> tuple[bool, float | None]:
        """Whether the reachable memory grew through the confirmation steps
        (``growth.goes_on``), and its rate in bytes per step; (True, None) when it could not be
        measured (the tracker's slope decides alone)."""
        points = dict(inv.extra.get("reachable") or {})
        points[inv.steps] = reachable_bytes(device)
        if 0 not in points or any(v is None for v in points.values()) or inv.steps <= 0:
            return True, None
        ordered = sorted(points.items())
        return growth.goes_on(ordered, self.threshold), (ordered[-1][1] - ordered[0][1]) / inv.steps

    def _wait_after(self, paused: bool) -> None:
        """The wait before the next investigation: ``window * 2**k`` steps, or none once when
        the reachable memory did not go on growing through the confirmation (a leak that
        pauses, as when evaluation steps come between training steps, may pause during the
        confirmation, or the whole confirmation may fall in the pause: it is looked at again
        as soon as its fresh window has the evidence; a growth that stopped never has it)."""
        if paused and not self._retried:
            self._retried = True
            self._quiet_until = self.ticks
            return
        self._retried = False
        self._quiet_until = self.ticks + self.window * 2 ** self._backoff
        self._backoff = min(self._backoff + 1, BACKOFF_MAX)

    def _conclude(self, record: StepRecord) -> None:
        """Flag when the growth goes on through the confirmation steps (reachable memory, after
        a collection) and the slow path accounts for it, or when growth nothing accounts for
        is seen in two windows in a row (a leak outside tensors and Python objects)."""
        inv, self.investigation = self.investigation, None
        if inv is None:
            return
        device = self.investigated_device or "cpu"
        goes_on, reachable_rate = self._reachable_growth(inv, device)  # collects before the census below
        report = inv.finish(record.step, steps=inv.steps)
        tr = self.trackers.get(device)
        slope = reachable_rate if reachable_rate is not None else tr.rate() if tr is not None else None
        for t in self.trackers.values():
            t.reset()  # a fresh window, free of the slow path's own allocations
        self._heap_due = self.ticks  # and a first sample for it as soon as the wait allows
        self._wait_after(paused=not goes_on)
        if slope is None or slope <= self.threshold or not goes_on:
            self.unattributed = 0
            return
        if census.attributed_bytes(report) < 0.25 * slope * report["steps"]:
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
