"""Per-step memory samples into the process-wide tracker (``memory_profiling`` feature, or
inside ``memory_tracking()``)."""

from __future__ import annotations

from typing import Any

from torchtrace.measure import memory as mem_measure
from torchtrace.measure.snapshots import tracker
from torchtrace.probes.base import Probe
from torchtrace.record.step import StepRecord

_TRACKER = tracker()


class MemoryProbe(Probe):
    """Adds the step's memory sample to :func:`torchtrace.measure.snapshots.tracker`."""

    name = "memory_samples"
    component = "memory"

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime

    def finish(self, scope: Any, state: Any, record: StepRecord, values: list[float] | None) -> None:
        if scope.features.memory_profiling or _TRACKER.active:
            sample = record.memory
            if _TRACKER.active:
                # A memory_tracking() block judges leaks on the heap in use: unlike RSS it falls
                # when memory is freed, so malloc keeping pages is not growth.
                sample = {**(sample or {}), "heap_in_use_bytes": mem_measure.heap_in_use_bytes()}
            _TRACKER.add_sample(record.step, record.operation, sample)
