"""Pacing of the requests the telemetry server serves.

The server paces connections (``max_accept_rate``), but not the requests on a kept-alive
connection: twenty clients that pipelined 200 ``GET /metrics`` each and never read had
twenty threads rendering the registry at once, taking the GIL in turn, and a 1 ms training
step waited up to 0.6 s. Here routes run one at a time, and a request's CPU time pushes the
next route's start back so that serving takes at most :data:`BUSY_SHARE` of the time.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

BUSY_SHARE = 0.2
"""Most of the wall time the server's threads spend serving requests (their CPU time, the
GIL time the training thread may wait for). A scrape of a few milliseconds every 100 ms,
or the live page's polls, use a few percent and never wait."""


class RequestPacer:
    """One route at a time (:meth:`turn`); each request's CPU time (:meth:`charge`) delays the
    next turn by ``cost * (1 / share - 1)``."""

    def __init__(self, share: float = BUSY_SHARE) -> None:
        self.share = share
        self._turn = threading.Lock()
        self._clock = threading.Lock()
        self._next = 0.0
        self.waited_s = 0.0

    @contextmanager
    def turn(self) -> Iterator[None]:
        with self._turn:
            with self._clock:
                wait = self._next - time.monotonic()
            if wait > 0:
                self.waited_s += wait
                time.sleep(wait)  # without the GIL; later requests queue on the lock
            yield

    def charge(self, cpu_s: float) -> None:
        """Add one request's CPU seconds (reading, routing, writing) to the server's account."""
        if cpu_s <= 0:
            return
        with self._clock:
            self._next = max(self._next, time.monotonic()) + cpu_s * (1.0 / self.share - 1.0)
