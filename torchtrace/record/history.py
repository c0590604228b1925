"""Bounded history: the event timeline and recent step records, plus running totals."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from torchtrace.record.step import StepRecord


@dataclass
class DebugEvent:
    """One entry of the timeline: the seeds' (timestamp, type, message, data)."""

    timestamp: float
    event_type: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)
    seq: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "timestamp": self.timestamp, "type": self.event_type,
                "event_type": self.event_type, "message": self.message, "data": self.data}


class History:
    """Bounded, thread-safe store of events and step summaries with totals that never drop.

    >>> h = History(maxlen=2)
    >>> for i in range(3): _ = h.add_event("note", f"n{i}")
    >>> [e.message for e in h.events()], h.totals["events"]
    (['n1', 'n2'], 3)
    """

    def __init__(self, maxlen: int = 1000) -> None:
        self._lock = threading.Lock()
        self._events: collections.deque[DebugEvent] = collections.deque(maxlen=maxlen)
        self._steps: collections.deque[dict[str, Any]] = collections.deque(maxlen=maxlen)
        self._seq = 0
        self.totals: collections.Counter[str] = collections.Counter()
        self.anomaly_counts: collections.Counter[str] = collections.Counter()
        self.operations: collections.Counter[str] = collections.Counter()
        self.last_record: StepRecord | None = None
        self.first_step_unix: float | None = None

    def add_event(self, event_type: str, message: str, data: dict[str, Any] | None = None) -> DebugEvent:
        with self._lock:
            self._seq += 1
            event = DebugEvent(time.time(), event_type, message, dict(data or {}), self._seq)
            self._events.append(event)
            self.totals["events"] += 1
            return event

    def add_step(self, record: StepRecord) -> None:
        with self._lock:
            self._steps.append(record.summary())
            self.totals["steps"] += 1
            self.operations[record.operation] += 1
            if record.anomalies:
                self.totals["anomaly_steps"] += 1
            if record.nonfinite:
                self.totals["nonfinite_steps"] += 1
            if record.skipped:
                self.totals["skipped_steps"] += 1
            if record.exception_type:
                self.totals["failed_steps"] += 1
            for kind in record.anomaly_kinds:
                self.anomaly_counts[kind] += 1
            self.last_record = record
            if self.first_step_unix is None:
                self.first_step_unix = record.start_unix_ns / 1e9

    def events(self, since: int = 0) -> list[DebugEvent]:
        with self._lock:
            return [e for e in self._events if e.seq > since]

    def steps(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._steps)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
            self._steps.clear()
            self.totals.clear()
            self.anomaly_counts.clear()
            self.operations.clear()
            self.last_record = None
            self.first_step_unix = None
