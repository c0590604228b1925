"""Per-step memory samples into the process-wide tracker (``memory_profiling`` feature, or
inside ``memory_tracking()``)."""

from __future__ import annotations

from torchtrace.measure.snapshots import tracker

_TRACKER = tracker()


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
