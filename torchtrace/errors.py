"""Exceptions torchtrace raises on purpose, and the guard for its own failures."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

logger = logging.getLogger("torchtrace")


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
