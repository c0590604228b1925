"""SIGTERM and SIGINT: save what the process knows, then end as it would have.

A preemption (Kubernetes, Slurm, a launcher tearing a job down) is a SIGTERM. Python's default
action ends the process at once: no ``atexit``, no exporter flush. :class:`SignalGuard`
installs a handler that first runs ``on_signal`` (torchtrace records ``preempted``, flushes
finished spans and writes the report, within a deadline), then does what would have happened
without torchtrace:

- the application's own handler, set before ``configure()`` or after it, is called;
- with no handler (the default action), the default is restored and the signal raised
  again, so the process ends by that signal, with the exit status a launcher expects;
- a signal the application ignores (``SIG_IGN``) is left alone: no handler is installed.

An application (or Lightning's SLURM connector) that calls ``signal.signal`` after
``configure()`` replaces torchtrace's handler. To keep chaining, :class:`SignalGuard` wraps
``signal.signal`` and ``signal.getsignal`` while installed: the application's handler becomes
the one torchtrace calls after its own work, and ``getsignal`` returns it. Code that bound
``signal.signal`` to a name of its own before ``configure()`` (``from signal import signal``)
goes around the wrapper and replaces torchtrace's handler; then that code's handler runs alone.

Only the main thread can install a handler: :meth:`SignalGuard.install` from another thread
logs a warning that says so and installs nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any, Callable, Optional, Union

logger = logging.getLogger(__name__)

# A callable(signum, frame), signal.SIG_DFL, signal.SIG_IGN, or None (a handler set from C).
Handler = Union[Callable[[int, Optional[FrameType]], Any], int, signal.Handlers, None]

SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that mean "stop": the end they cause is recorded as ``preempted``."""


def start_thread(target: Callable[..., object], name: str, *args: object, **kwargs: object) -> threading.Thread:
    """Start a daemon thread of torchtrace's that runs ``target(*args, **kwargs)`` with the stop
    signals (:data:`SIGNALS`) blocked; return it.

    The kernel gives a signal sent to the process to any of its threads that does not block
    it, and Python runs the handler on the main thread, at its next bytecode. Had one of
    torchtrace's threads taken the signal while the main thread waited in C with no timeout
    (for the lock of a ``multiprocessing`` queue), the handler would wait for good: a
    ``multiprocessing.Pool`` worker that SIGTERM did not end, and a pool's ``terminate()``
    waiting for it. Blocked in torchtrace's threads (and in those they start), the signal goes
    to a thread of the application's, in most processes the main thread, whose wait it ends.
    """
    thread = threading.Thread(target=_without_stop_signals, args=(target, args, kwargs), name=name, daemon=True)
    thread.start()
    return thread


def _without_stop_signals(target: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    if hasattr(signal, "pthread_sigmask"):  # (POSIX only)
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    target(*args, **kwargs)


class SignalGuard:
    """torchtrace's SIGTERM/SIGINT handlers, chained to the application's.

    Args:
        on_signal: called first, on the main thread, with the signal number and whether the
            process is about to end by it (no application handler to call after).

    >>> guard = SignalGuard(lambda signum, terminal: None)
    >>> installed = guard.install()
    >>> guard.restore()
    """

    def __init__(self, on_signal: Callable[[int, bool], None]) -> None:
        self.on_signal = on_signal
        self.chained: dict[int, Handler] = {}
        self.received: list[int] = []
        self.pid = os.getpid()
        self.holding = False  # torchtrace is shutting down (see hold)
        self.held: int | None = None  # the signal held until the shutdown ends
        self._real_signal = signal.signal
        self._real_getsignal = signal.getsignal

    def install(self) -> list[str]:
        """Install the handlers; returns the names of the signals now handled."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("torchtrace: configure() ran outside the main thread, where Python cannot install signal "
                           "handlers: a SIGTERM (a preemption) will end this process without flushing its spans or "
                           "writing its report; call configure() from the main thread")
            return []
        for signum in SIGNALS:
            previous = self._real_getsignal(signum)
            if previous is signal.SIG_IGN:
                continue
            try:
                self._real_signal(signum, self._handle)
            except (ValueError, OSError) as exc:
                logger.warning("torchtrace: no handler for %s (%s): a preemption will lose unflushed spans",
                               signal.Signals(signum).name, exc)
                continue
            self.chained[signum] = previous
        if self.chained:
            signal.signal = self._signal
            signal.getsignal = self._getsignal
        return [signal.Signals(s).name for s in self.chained]

    def hold(self) -> None:
        """torchtrace shuts down from now until :meth:`restore`: a signal that would end the
        process then (no application handler) takes effect at that restore, so the shutdown's
        report and black box are whole. The shutdown keeps its own deadline.

        (A worker of a ``multiprocessing.Pool`` that ends with the pool's ``with`` block gets
        the pool's SIGTERM while it shuts torchtrace down, having seen the end of its tasks.)
        """
        self.holding = True

    def restore(self) -> None:
        """Give every signal back the handler the application set last (main thread only); then
        a signal held since :meth:`hold` takes effect (by that handler: the default ends the process)."""
        try:
            self._restore_handlers()
        finally:
            self.holding = False
            signum, self.held = self.held, None
            if signum is not None:
                signal.raise_signal(signum)  # (to this thread: the default ends the process before it returns)

    def _restore_handlers(self) -> None:
        if signal.signal == self._signal:
            signal.signal = self._real_signal
        if signal.getsignal == self._getsignal:
            signal.getsignal = self._real_getsignal
        chained, self.chained = self.chained, {}
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in chained.items():
            try:
                if self._real_getsignal(signum) == self._handle:
                    self._real_signal(signum, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, OSError, TypeError):
                pass

    def _signal(self, signalnum: int, handler: Handler) -> Handler:
        """``signal.signal`` while installed: an application's handler for a signal torchtrace
        handles is chained after torchtrace's, not put in its place."""
        if signalnum in self.chained and threading.current_thread() is threading.main_thread():
            previous, self.chained[signalnum] = self.chained[signalnum], handler
            return previous
        return self._real_signal(signalnum, handler)

    def _getsignal(self, signalnum: int) -> Handler:
        if signalnum in self.chained:
            return self.chained[signalnum]
        return self._real_getsignal(signalnum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        chained = self.chained.get(signum, signal.SIG_DFL)
        if chained is signal.SIG_IGN:
            return
        self.received.append(signum)
        # (read before on_signal: a shutdown that on_signal starts itself ends the process on time)
        held = self.holding and os.getpid() == self.pid
        handler = chained if callable(chained) else None
        terminal = handler is None
        # A forked child (a DataLoader worker) inherits the handler, not the run: it only chains.
        if os.getpid() == self.pid:
            try:
                self.on_signal(signum, terminal)
            except Exception:  # the signal's own effect must happen whatever torchtrace's work did
                logger.debug("torchtrace's %s work failed", signum, exc_info=True)
        if handler is not None:
            handler(signum, frame)
            return
        if held:
            self.held = signum
            return
        # The default action: restore it and raise the signal again, so the process ends by it.
        self._real_signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
