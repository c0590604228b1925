"""Exceptions torchtrace raises on purpose, and the guard for its own failures."""

from __future__ import annotations

import logging
import mmap
import multiprocessing
import multiprocessing.synchronize
import threading
import zlib
from typing import Any, Callable, MutableMapping


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

    def process(self, msg: object, kwargs: MutableMapping[str, Any]) -> tuple[object, MutableMapping[str, Any]]:
        return msg, kwargs

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
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

    def makeRecord(self, *args: object, **kwargs: object) -> logging.LogRecord:  # noqa: N802 (logging's name)
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


class OncePerProcessTree:
    """Says "first" once per key across a process and the children it forks.

    A DataLoader's forked workers each inherit their parent's memory: a plain set of keys
    already logged is copied into every worker, and each worker then logs its own first
    time, 600 workers giving 600 "once only" lines. The keys' marks live in one anonymous
    shared page made before the fork, so a mark set by any process is seen by all. A key is
    hashed to one of 32,768 bits: two keys sharing a bit (rare among a few dozen kinds) make
    the second one log never. A lock made before the fork (a semaphore the children share)
    makes reading and setting a mark one step: 20 workers meeting the same key at once log it
    once. Processes started with spawn or forkserver have pages of their own.

    >>> once = OncePerProcessTree()
    >>> once.first(("tracing", "OSError")), once.first(("tracing", "OSError"))
    (True, False)
    """

    _BYTES = 4096

    def __init__(self) -> None:
        self._local: set = set()
        try:
            self._marks: mmap.mmap | None = mmap.mmap(-1, self._BYTES)  # anonymous and shared: kept across fork
        except (OSError, ValueError):  # no shared memory here: once per process only
            self._marks = None
        try:
            # Shared with the processes forked after this.
            self._turn: multiprocessing.synchronize.Lock | None = multiprocessing.Lock()
        except (OSError, ImportError):  # no semaphores here: two processes at one instant may both say "first"
            self._turn = None

    def first(self, key: object) -> bool:
        """True the first time ``key`` is seen in this process tree."""
        if key in self._local:
            return False
        self._local.add(key)
        if self._marks is None:
            return True
        bit = zlib.crc32(repr(key).encode()) % (self._BYTES * 8)
        index, mask = bit // 8, 1 << (bit % 8)
        # A process killed while holding the lock must not stop the others: after 0.2 s, unlocked.
        turn = self._turn
        locked = turn is not None and turn.acquire(timeout=0.2)
        try:
            if self._marks[index] & mask:
                return False
            self._marks[index] |= mask
            return True
        finally:
            if turn is not None and locked:
                turn.release()


class InternalErrors:
    """torchtrace's own failures in the hot path: caught, logged once per kind, counted.

    ``strict=True`` (TORCHTRACE_STRICT=1, torchtrace's own tests) re-raises instead.
    """

    def __init__(self, count: Callable[[str], None] | None = None, strict: bool = False) -> None:
        self._count = count
        self.strict = strict
        self._seen = OncePerProcessTree()
        self._lock = threading.Lock()
        self.total = 0
        self.by_component: dict[str, int] = {}

    def report(self, component: str, exc: BaseException, log: bool = True) -> None:
        """Count ``exc`` under ``component``; log it the first time (``log=False``: the caller
        told the user already, in words of its own)."""
        with self._lock:
            self.total += 1
            self.by_component[component] = self.by_component.get(component, 0) + 1
            first = self._seen.first((component, type(exc).__name__))
        if first and log:
            logger.warning("torchtrace internal error in %s (%s); training continues, further ones are counted",
                           component, type(exc).__name__, exc_info=exc)
        if self._count is not None:
            try:
                self._count(component)
            except Exception:
                pass
        if self.strict:
            raise exc
