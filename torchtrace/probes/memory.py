"""Per-step memory samples into the process-wide tracker (``memory_profiling`` feature, or
inside ``memory_tracking()``)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from torchtrace.measure import memory as mem_measure
from torchtrace.measure.snapshots import tracker
from torchtrace.probes.base import Probe
from torchtrace.probes.leaks import HEAP_FREE_S
from torchtrace.record.step import StepRecord

if TYPE_CHECKING:
    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope

_TRACKER = tracker()


TRACKING_HEAP_BUDGET = 0.05
"""Inside ``memory_tracking()`` heap samples take at most this share of the step time (every
step while a sample costs under ``probes.leaks.HEAP_FREE_S``)."""


class MemoryProbe(Probe):
    """Adds the step's memory sample to :func:`torchtrace.measure.snapshots.tracker`.

    Inside ``memory_tracking()`` a sample also holds ``heap_in_use_bytes`` (None on steps the
    budget skips): the leak rule judges the heap, which unlike RSS falls when memory is freed.
    """

    name = "memory_samples"
    component = "memory"

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.heap_wait = 0  # steps until the next heap sample

    def finish(self, scope: StepScope, state: Any, record: StepRecord, values: list[float] | None) -> None:
        if scope.features.memory_profiling or _TRACKER.active:
            sample = record.memory
            if _TRACKER.active:
                sample = {**(sample or {}), "heap_in_use_bytes": self._heap(record.duration_s)}
            _TRACKER.add_sample(record.step, record.operation, sample)

    def _heap(self, step_s: float) -> int | None:
        """The heap in use, or None on a step the budget skips (``mallinfo2`` walks the heap:
        from microseconds to milliseconds on a heap of many chunks)."""
        if self.heap_wait > 0:
            self.heap_wait -= 1
            return None
        t0 = time.perf_counter()
        heap = mem_measure.heap_in_use_bytes()
        cost = time.perf_counter() - t0
        gap = 1 if cost <= HEAP_FREE_S else math.ceil(cost / (TRACKING_HEAP_BUDGET * max(step_s, 1e-6)))
        self.heap_wait = gap - 1
        return heap
