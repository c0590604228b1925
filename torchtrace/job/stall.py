"""How long the training thread has made no progress, counted on the monotonic clock.

The phase marks stamp progress with the wall clock (``time.time()``), because readers in other
processes and on other hosts (``torchtrace why``, the culprit rule) compare the stamps. But a
wall clock can step: NTP's correction, a virtual machine resumed or migrated. Read as
``time.time() - progress``, a step of the clock 40 s forward was a 40 s stall: a hang flagged
on a healthy job (and under ``on_hang="abort"``, the job ended), ``torchtrace_stalled_seconds``
past the alert's threshold, and a learnt pause that raised the adaptive timeout tenfold. A step
backward hid a real hang for as long.

:class:`StallClock` counts the stall on ``time.monotonic()`` instead. The watchdog's tick shows
it each progress stamp it finds (:meth:`StallClock.look`); the time between the progress and
that tick is taken from the wall clock, but never more than the time since the tick before
(the stamp was not there then) and never less than none. A scrape between two ticks reads it
without moving it (:meth:`StallClock.now`).

>>> clock = StallClock()
>>> clock.look(100.0, wall_now=101.0, mono_now=5001.0)       # progress 1 s ago
1.0
>>> clock.look(100.0, wall_now=3702.0, mono_now=5002.0)      # the wall clock stepped an hour
2.0
>>> clock.look(3702.5, wall_now=3703.0, mono_now=5003.0)     # progress again
0.5
"""

from __future__ import annotations

import time
from typing import Callable


class StallClock:
    """The stall since a progress stamp, on the monotonic clock (see the module docstring).

    One thread looks (the watchdog's); any thread may read :meth:`now`. What it keeps is one
    tuple, replaced whole, so a reader never sees half of an update.
    """

    def __init__(self, wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic) -> None:
        self.wall, self.mono = wall, mono
        # (the progress stamp last seen, its time on the monotonic clock, the last look's)
        self._seen: tuple[float | None, float, float | None] = (None, 0.0, None)

    def look(self, stamp: float, wall_now: float, mono_now: float) -> float:
        """The stall at a tick of the watchdog, which saw ``stamp`` as the last progress."""
        seen, since, looked = self._seen
        if stamp != seen:
            since = mono_now - ago(stamp, wall_now, mono_now, looked)
        self._seen = (stamp, since, mono_now)
        return mono_now - since

    def now(self, stamp: float) -> float:
        """The stall now (a scrape, a summary), from any thread, without moving the clock."""
        seen, since, looked = self._seen
        mono_now = self.mono()
        if stamp != seen:  # progress since the last tick (or no tick yet)
            return ago(stamp, self.wall(), mono_now, looked)
        return mono_now - since


def ago(stamp: float, wall_now: float, mono_now: float, looked: float | None) -> float:
    """How long ago something stamped ``stamp`` on the wall clock happened, within what the
    monotonic clock allows: at most the time since ``looked`` (the last look, which did not
    see it; None: no look yet), at least none."""
    seconds = max(wall_now - stamp, 0.0)
    return min(seconds, mono_now - looked) if looked is not None else seconds


__all__ = ["StallClock", "ago"]
