"""Exceptions torchtrace raises on purpose, and the guard for its own failures."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable


class _GuardedLogger(logging.Logger):
    """A torchtrace logger: a handler of the application's that raises never raises out of a log call.

    A handler's ``emit`` should catch its own failures (``handleError``); one that does not
    would make torchtrace's log calls raise into the training step or lose its record.
    """

    def handle(self, record: logging.LogRecord) -> None:
        try:
            super().handle(record)
        except Exception:
            pass  # the application's handler failed: nothing of torchtrace's to report it through


_guarded_classes: dict[type, type] = {logging.Logger: _GuardedLogger}


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)``, made to swallow the failures of the handlers it reaches."""
    log = logging.getLogger(name)
    cls = type(log)
    if not isinstance(log, _GuardedLogger):
        guarded = _guarded_classes.get(cls)
        if guarded is None:  # the application's own logger class: the same guard on top of it
            guarded = _guarded_classes[cls] = type("Guarded" + cls.__name__, (_GuardedLogger, cls), {})
        try:
            log.__class__ = guarded
        except TypeError:
            pass
    return log


logger = get_logger("torchtrace")


class NonFiniteError(FloatingPointError):
    """Raised by the ``raise`` guard policy after a non-finite step has been recorded.

    Attributes:
        step: the step number.
        kinds: the anomaly kinds found.
        report: the forensic report, when one was made.
    """

    def __init__(self, message: str, step: int | None = None, kinds: list[str] | None = None,
                 report: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.kinds = kinds or []
        self.report = report


class InternalErrors:
    """torchtrace's own failures in the hot path: caught, logged once per kind, counted.

    ``strict=True`` (TORCHTRACE_STRICT=1, torchtrace's own tests) re-raises instead.
    """

    def __init__(self, count: Callable[[str], None] | None = None, strict: bool = False) -> None:
        self._count = count
        self.strict = strict
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self.total = 0
        self.by_component: dict[str, int] = {}

    def report(self, component: str, exc: BaseException) -> None:
        with self._lock:
            self.total += 1
            self.by_component[component] = self.by_component.get(component, 0) + 1
            key = (component, type(exc).__name__)
            first = key not in self._seen
            self._seen.add(key)
        if first:
            logger.warning("torchtrace internal error in %s (%s); training continues, further ones are counted",
                           component, type(exc).__name__, exc_info=exc)
        if self._count is not None:
            try:
                self._count(component)
            except Exception:
                pass
        if self.strict:
            raise exc
