"""Per-step memory samples into the process-wide tracker (``memory_profiling`` feature, or
inside ``memory_tracking()``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtrace.measure.snapshots import tracker
from torchtrace.probes.base import Probe
from torchtrace.probes.leaks import heap_gap, timed_heap_sample
from torchtrace.record.step import StepRecord

if TYPE_CHECKING:
    from torchtrace.levels import Features
    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope

_TRACKER = tracker()


TRACKING_HEAP_BUDGET = 0.05
"""Inside ``memory_tracking()`` heap samples take at most this share of the step time (every
step while a sample costs under ``probes.leaks.HEAP_FREE_S``)."""
TRACKING_MAX_GAP = 4
"""And at least one heap sample every this many steps, however costly: the user asked for the
tracking, and the leak rule needs ``growth.MIN_SAMPLES`` samples in a stretch of a quarter
window (8 steps by default) to a whole one."""


class MemoryProbe(Probe[None]):
    """Adds the step's memory sample to :func:`torchtrace.measure.snapshots.tracker`.

    Inside ``memory_tracking()`` a sample also holds ``heap_in_use_bytes`` (None on steps the
    budget skips): the leak rule judges the heap, which unlike RSS falls when memory is freed.
    """

    name = "memory_samples"
    component = "memory"

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.heap_wait = 0  # steps until the next heap sample

    def wanted(self, features: Features) -> bool:
        """With the ``memory_profiling`` feature, or inside ``memory_tracking()`` (which asks the
        probes again as it opens and closes)."""
        return features.memory_profiling or _TRACKER.active

    def finish(self, scope: StepScope, state: None, record: StepRecord, values: list[float] | None) -> None:
        if (scope.features is not None and scope.features.memory_profiling) or _TRACKER.active:
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
        heap, cost = timed_heap_sample()
        self.heap_wait = heap_gap(cost, step_s, TRACKING_HEAP_BUDGET, TRACKING_MAX_GAP) - 1
        return heap
