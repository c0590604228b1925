"""Label budgets: every metric label takes values from a closed set, or a capped one."""

from __future__ import annotations

import threading
from typing import Iterable

MAX_LABEL_VALUES = 64
MAX_DEVICE_VALUES = 16
OVERFLOW = "__overflow__"


class LabelBudget:
    """Admits at most ``limit`` distinct values for one label; the rest become OVERFLOW.

    >>> budget = LabelBudget(limit=1)
    >>> budget("train_step"), budget("eval_step")
    ('train_step', '__overflow__')
    """

    def __init__(self, limit: int = MAX_LABEL_VALUES, allowed: Iterable[str] | None = None) -> None:
        self.limit = limit
        self.allowed = frozenset(allowed) if allowed is not None else None
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self.overflowed = 0

    def __call__(self, value: str) -> str:
        if self.allowed is not None:
            return value if value in self.allowed else OVERFLOW
        if value in self._seen:
            return value
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) >= self.limit:
                self.overflowed += 1
                return OVERFLOW
            self._seen.add(value)
            return value
