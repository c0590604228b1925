"""Terminal output for the CLI: event lines and a one-line progress bar that never mix.

In a terminal the bar is redrawn in place; an event line (or a log record) first clears the
bar's line, is written whole, and the bar is drawn again under it. In a pipe there is no bar:
:meth:`Console.progress` writes nothing and the caller prints a plain line now and then.
Every line is flushed when written, so events show when they happen, in a pipe too.

>>> import io
>>> c = Console(io.StringIO(), bar=False)
>>> c.line("step 3: something happened")
>>> c.out.getvalue()
'step 3: something happened\\n'
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from typing import IO, Iterator

CLEAR_LINE = "\r\x1b[K"


def is_terminal(stream: IO[str]) -> bool:
    """True when ``stream`` is an interactive terminal (where a redrawn bar makes sense)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def bar_text(done: int, total: int, width: int = 30) -> str:
    """``[#####.....] 5/10``.

    >>> bar_text(5, 10, width=10)
    '[#####.....] 5/10'
    """
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


class Console:
    """Serialises event lines and the progress bar onto one stream (thread-safe)."""

    def __init__(self, out: IO[str], bar: bool, min_interval_s: float = 0.05) -> None:
        self.out = out
        self.bar = bar
        self.min_interval_s = min_interval_s
        self._bar = ""  # the bar as last drawn; "" when none is on screen
        self._drawn_at = -math.inf
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        """Write ``text`` as whole lines above the bar."""
        with self._lock:
            if self._bar:
                self.out.write(CLEAR_LINE)
            self.out.write(text + "\n")
            if self._bar:
                self.out.write(self._bar)
            self.out.flush()

    def progress(self, text: str, force: bool = False) -> None:
        """Redraw the bar as ``text`` (terminals only; a no-op in a pipe).

        At most every ``min_interval_s`` unless ``force``; an event line drawn meanwhile
        redraws the newest text.
        """
        if not self.bar:
            return
        with self._lock:
            self._bar = text
            now = time.monotonic()
            if force or now - self._drawn_at >= self.min_interval_s:
                self._drawn_at = now
                self.out.write(CLEAR_LINE + text)
                self.out.flush()

    def end_progress(self) -> None:
        """Leave the last bar on screen and move below it."""
        with self._lock:
            if self._bar:
                self.out.write("\n")
                self.out.flush()
            self._bar = ""


class ConsoleHandler(logging.Handler):
    """A logging handler that writes records through a :class:`Console`."""

    def __init__(self, console: Console, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.console = console
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.line(self.format(record))
        except Exception:  # a broken stream must not break the program logging to it
            self.handleError(record)


@contextlib.contextmanager
def logs_through(console: Console, logger_name: str = "torchtrace") -> Iterator[ConsoleHandler]:
    """Route ``logger_name``'s records (WARNING and up) through ``console`` while the block runs.

    The logger stops propagating meanwhile, so the same record is not also written, bar-blind,
    by a handler on the root logger.
    """
    log = logging.getLogger(logger_name)
    handler = ConsoleHandler(console)
    old_propagate, old_level = log.propagate, log.level
    log.addHandler(handler)
    log.propagate = False
    if log.level == logging.NOTSET or log.level > logging.WARNING:
        log.setLevel(logging.WARNING)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.propagate = old_propagate
        log.setLevel(old_level)
