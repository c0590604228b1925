"""The seed debuggers' event timeline and the loggers it writes to.

Each event is kept in a bounded :class:`~torchtrace.record.history.History` and sent to every
sink at its level. A sink is a ``logging.Logger``, a seed-style logger (``log_info`` /
``log_warning`` / ``log_error``, as seeds 000 and 001 use), or an object with
``log_training_event(event_type, message, level=..., **data)`` (seed 003's training logger).
A sink that fails is logged once and never breaks the caller.

>>> t = Timeline(max_events=10)
>>> _ = t.log("gradient_explosion", "gradient norm 15.5 over 1.0", {"gradient_norm": 15.5, "threshold": 1.0})
>>> t.events()[0]["event_type"], t.events()[0]["type"]
('gradient_explosion', 'gradient_explosion')
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Callable

from torchtrace.errors import get_logger
from torchtrace.record.history import DebugEvent, History

logger = get_logger("torchtrace.debugger")

ANOMALY_EVENTS = frozenset({
    "nonfinite_gradient", "gradient_explosion", "gradient_vanishing", "tensor_anomaly", "parameter_anomaly",
    "autograd_anomaly", "activation_anomaly", "memory_leak", "loss_anomaly", "loss_spike", "diffusion_anomaly",
})
"""Event types that count as anomalies in ``total_anomalies``."""


def iso(unix: float) -> str:
    """``2024-01-01T12:00:00.123456`` (local time), the seeds' timestamp format."""
    return datetime.datetime.fromtimestamp(unix).isoformat()


def event_dict(e: DebugEvent) -> dict[str, Any]:
    """An event with the seeds' keys: ``timestamp`` (ISO text), ``event_type`` (and ``type``),
    ``message``, ``data``; plus ``seq`` and ``unix_time``."""
    out = e.as_dict()
    out["event_type"] = e.event_type
    out["unix_time"] = e.timestamp
    out["timestamp"] = iso(e.timestamp)
    return out


def _seed_style(obj: Any, level: int, text: str) -> None:
    if level >= logging.ERROR:
        obj.log_error(text)
    elif level >= logging.WARNING:
        obj.log_warning(text)
    elif level >= logging.INFO:
        obj.log_info(text)
    elif callable(getattr(obj, "log_debug", None)):
        obj.log_debug(text)


def make_sink(obj: Any, setting: str = "logger") -> Callable[[int, str, str, dict[str, Any]], None]:
    """A function ``(level, event_type, message, data)`` writing to ``obj``.

    Raises:
        TypeError: ``obj`` is none of the accepted kinds; the message names ``setting``.
    """
    if isinstance(obj, (logging.Logger, logging.LoggerAdapter)):
        return lambda level, kind, message, data: obj.log(level, "%s: %s", kind, message)
    if all(callable(getattr(obj, n, None)) for n in ("log_info", "log_warning", "log_error")):
        return lambda level, kind, message, data: _seed_style(obj, level, f"Debug event: {message}")
    if callable(getattr(obj, "log_training_event", None)):
        def training_event(level: int, kind: str, message: str, data: dict[str, Any]) -> None:
            if level >= logging.INFO:  # a product's training log gets no debug chatter
                obj.log_training_event(kind, message, level=logging.getLevelName(level), data=data)
        return training_event
    raise TypeError(f"{setting}= must be a logging.Logger, an object with log_info/log_warning/log_error, or one "
                    f"with log_training_event; got {type(obj).__name__}")


class Timeline:
    """Bounded events, written to sinks; counts by type survive the bound."""

    def __init__(self, max_events: int = 1000, sinks: list[Callable[..., None]] | None = None) -> None:
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events <= 0:
            raise ValueError(f"max_events={max_events!r} is not valid; accepted values: a positive integer")
        self.history = History(max_events)
        self.sinks = list(sinks) if sinks else [make_sink(logger)]
        self.by_type: dict[str, int] = {}
        self._failed: set[int] = set()

    def log(self, event_type: str, message: str, data: dict[str, Any] | None = None,
            level: int = logging.INFO) -> DebugEvent:
        event = self.history.add_event(event_type, message, data)
        self.by_type[event_type] = self.by_type.get(event_type, 0) + 1
        for i, sink in enumerate(self.sinks):
            try:
                sink(level, event_type, message, event.data)
            except Exception as exc:  # a user's logger must never break the debugger's caller
                if i not in self._failed:
                    self._failed.add(i)
                    logger.warning("debug event sink %s failed (%s: %s); its further failures are not logged",
                                   i, type(exc).__name__, exc)
        return event

    def events(self) -> list[dict[str, Any]]:
        return [event_dict(e) for e in self.history.events()]

    @property
    def total(self) -> int:
        return self.history.totals["events"]

    def anomalies(self) -> int:
        return sum(n for kind, n in self.by_type.items() if kind in ANOMALY_EVENTS)

    def clear(self) -> None:
        self.history.clear()
        self.by_type.clear()


__all__ = ["ANOMALY_EVENTS", "Timeline", "event_dict", "iso", "make_sink"]
