"""Per-step memory samples into the process-wide tracker (``memory_profiling`` feature, or
inside ``memory_tracking()``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchtrace.measure.snapshots import tracker
from torchtrace.probes.base import Probe
from torchtrace.record.step import StepRecord

if TYPE_CHECKING:
    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope

_TRACKER = tracker()


class MemoryProbe(Probe):
    """Adds the step's memory sample to :func:`torchtrace.measure.snapshots.tracker`."""

    name = "memory_samples"
    component = "memory"

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def finish(self, scope: StepScope, state: Any, record: StepRecord, values: list[float] | None) -> None:
        if scope.features.memory_profiling or _TRACKER.active:
            _TRACKER.add_sample(record.step, record.operation, record.memory)
