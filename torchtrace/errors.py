"""Exceptions torchtrace raises on purpose, and the guard for its own failures."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable


class GuardedLogger(logging.LoggerAdapter):
    """A torchtrace logger: a handler of the application's that raises never raises out of a log call.

    A handler's ``emit`` should catch its own failures (``handleError``); one that does not
    would make torchtrace's log calls raise into the training step or lose its record. The
    guard wraps the logger; the logger itself (``logging.getLogger(name)``, the application's
    to configure) is left as it is.

    >>> log = get_logger("torchtrace.example")
    >>> log.logger is logging.getLogger("torchtrace.example")
    True
    """

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, None)

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return msg, kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        # The record names the caller of debug(), warning()..., not this method.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
        try:
            self.logger.log(level, msg, *args, **kwargs)
        except Exception:
            pass  # the application's handler failed: nothing of torchtrace's to report it through

    def handle(self, record: logging.LogRecord) -> None:
        """Hand a record made elsewhere (a queue's) to the logger's handlers, guarded likewise."""
        try:
            self.logger.handle(record)
        except Exception:
            pass

    def makeRecord(self, *args: Any, **kwargs: Any) -> logging.LogRecord:  # noqa: N802 (logging's name)
        return self.logger.makeRecord(*args, **kwargs)


def get_logger(name: str) -> GuardedLogger:
    """``logging.getLogger(name)``, guarded against the failures of the handlers it reaches."""
    return GuardedLogger(logging.getLogger(name))


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
