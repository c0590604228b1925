"""Bounded history: the event timeline and recent step records, plus running totals."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from torchtrace.record.step import StepRecord

NAME_CHARS = 512
"""Characters of names one list in a retained step or event keeps (whole names, the first
always), and characters of a message or ``detail`` text. Past it, names are left out and
counted in the list's ``<key>_omitted``, and a text ends with how much was cut. With 32 names
at most per list, short names (``blocks.12.weight``) fit whole; long ones cost the same budget,
so a step summary stays under about 1.4 KB and an anomaly event under about 2.5 KB whatever
the model's names: the report grows with the steps it keeps, not the model."""
_TEXT_KEYS = ("message", "detail")


def bounded_names(names: list, budget: int = NAME_CHARS) -> list:
    """The first names of ``names`` that fit ``budget`` characters together (at least one).

    >>> [len(n) for n in bounded_names(["a" * 300, "b" * 300, "c"])]
    [300]
    """
    kept: list = []
    used = 0
    for name in names:
        used += len(name)
        if kept and used > budget:
            break
        kept.append(name)
    return kept


def bounded_text(text: str, budget: int = NAME_CHARS) -> str:
    """``text`` cut to ``budget`` characters, saying how many were left out."""
    if len(text) <= budget:
        return text
    return f"{text[:budget]}... ({len(text) - budget} characters left out)"


def bounded_entry(value: dict) -> dict:
    """A step summary or event data with its name lists and texts within :data:`NAME_CHARS`.

    A list of strings keeps what fits and adds what it left to ``<key>_omitted``; the
    ``message`` and ``detail`` texts are cut; nested dicts are bounded the same way.

    >>> bounded_entry({"params": ["x" * 400, "y" * 400], "params_omitted": 3})["params_omitted"]
    4
    """
    out = dict(value)
    for key, item in value.items():
        if isinstance(item, dict):
            out[key] = bounded_entry(item)
        elif isinstance(item, str) and key in _TEXT_KEYS:
            out[key] = bounded_text(item)
        elif isinstance(item, list) and item and all(isinstance(n, str) for n in item):
            kept = bounded_names(item)
            if len(kept) < len(item):
                out[key] = kept
                earlier = value.get(key + "_omitted")
                out[key + "_omitted"] = len(item) - len(kept) + (earlier if isinstance(earlier, int) else 0)
    return out


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
            event = DebugEvent(time.time(), event_type, bounded_text(message), bounded_entry(data or {}), self._seq)
            self._events.append(event)
            self.totals["events"] += 1
            return event

    def add_step(self, record: StepRecord) -> None:
        with self._lock:
            summary = record.summary()
            # Only a step with anomalies names anything (its non-finite tensors): a healthy
            # step's summary has nothing to bound, and bounding scanned every key every step.
            self._steps.append(bounded_entry(summary) if record.anomalies or record.grad_nonfinite_params else summary)
            self.totals["steps"] += 1
            self.operations[record.operation] += 1
            if record.anomalies:
                self.totals["anomaly_steps"] += 1
            if record.nonfinite:
                self.totals["nonfinite_steps"] += 1
            if record.skipped:
                self.totals["skipped_steps"] += 1
            if record.scaler_overflow:
                self.totals["scaler_overflow_steps"] += 1
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

    def continued(self, maxlen: int) -> History:
        """A history of ``maxlen`` entries that goes on from this one: its events and steps (the
        newest that fit), totals and sequence numbers.

        >>> h = History(maxlen=3)
        >>> for i in range(3): _ = h.add_event("note", f"n{i}")
        >>> later = h.continued(maxlen=2)
        >>> [e.message for e in later.events()], later.add_event("note", "n3").seq
        (['n1', 'n2'], 4)
        """
        later = History(maxlen)
        with self._lock:
            later._events.extend(self._events)
            later._steps.extend(self._steps)
            later._seq = self._seq
            later.totals.update(self.totals)
            later.anomaly_counts.update(self.anomaly_counts)
            later.operations.update(self.operations)
            later.last_record = self.last_record
            later.first_step_unix = self.first_step_unix
        return later
