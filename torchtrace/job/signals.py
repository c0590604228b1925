"""SIGTERM, SIGINT and SIGHUP: save what the process knows, then end as it would have.

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
import time
from types import FrameType
from typing import Any, Callable, Optional, Union

logger = logging.getLogger(__name__)

# A callable(signum, frame), signal.SIG_DFL, signal.SIG_IGN, or None (a handler set from C).
Handler = Union[Callable[[int, Optional[FrameType]], Any], int, signal.Handlers, None]

SIGNALS = tuple(sig for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)) if sig is not None)
"""The signals that mean "stop": the end they cause is recorded as ``preempted``. SIGHUP is the
hangup of a terminal that closed (an ssh session lost without nohup or tmux); under ``nohup``
it is ignored, and stays ignored."""


def start_thread(target: Callable[..., object], name: str, *args: object, **kwargs: object) -> threading.Thread:
    """Start a daemon thread of torchtrace's that runs ``target(*args, **kwargs)`` with the stop
    signals (:data:`SIGNALS`) blocked; return it.

    The kernel gives a signal sent to the process to any of its threads that does not block it,
    and Python runs the handler on the main thread, at its next bytecode. Blocked in
    torchtrace's threads (and in those they start), a stop signal goes to a thread of the
    application's, in most processes the main thread, whose wait in C it interrupts; taken by
    a thread of torchtrace's, it would interrupt nothing, and a main thread waiting with no
    timeout would leave the handler to :class:`StuckSignalWatch`.
    """
    thread = threading.Thread(target=_without_stop_signals, args=(target, args, kwargs), name=name, daemon=True)
    thread.start()
    return thread


def _without_stop_signals(target: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    if hasattr(signal, "pthread_sigmask"):  # (POSIX only)
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    target(*args, **kwargs)


NUDGE_AFTER_S = 0.5
"""How long a stop signal may wait for its Python handler before :class:`StuckSignalWatch`
sends it to the main thread again."""

NUDGE_EVERY_S = 5.0
"""At most one such nudge in this long: a main thread that no signal interrupts is nudged no faster."""


class StuckSignalWatch:
    """Sends a stop signal to the main thread again when its Python handler did not run.

    CPython's C-level handler only notes a signal; the Python handler runs on the main thread at
    its next bytecode. A signal noted as the main thread was about to wait in C with no timeout
    wakes nothing: a ``multiprocessing.Pool`` worker that asks for its next task (the queue's
    lock: tried once without blocking, then waited for, the GIL handed to another thread between
    the two) as the pool's ``terminate()`` sends SIGTERM waited for good, and so did the pool.
    Python writes each signal it notes to the wakeup file descriptor
    (``signal.set_wakeup_fd``); a thread of torchtrace's reads it, and where the guard's handler
    did not run within :data:`NUDGE_AFTER_S`, sends the signal to the main thread, whose wait
    it interrupts. Python runs a handler once for signals noted together: the handler runs once.

    An application that set a wakeup fd of its own (an asyncio event loop with signal handlers)
    keeps it, and goes without this watch. A forked child does not inherit it.
    """

    def __init__(self, guard: SignalGuard) -> None:
        self.guard = guard
        self._write: int | None = None
        self._read: int | None = None
        self._stopping = False
        self._nudged_at = -NUDGE_EVERY_S

    def start(self) -> bool:
        """On the main thread: take the wakeup fd and start the reading thread; False where an
        application holds the wakeup fd or it cannot be set."""
        global _watch
        if not hasattr(signal, "pthread_kill"):  # (POSIX only)
            return False
        if _watch is not None:  # one left by a guard given back off the main thread
            _watch.stop()
        read, write = os.pipe()
        os.set_blocking(write, False)  # (a full pipe drops a byte; the signal handler never waits)
        try:
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = None
        if previous != -1:
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            return False
        self._read, self._write, _watch = read, write, self
        start_thread(self._run, "torchtrace-signal-watch", read)
        return True

    def stop(self) -> None:
        """On the main thread: the wakeup fd given back (to none, or to whoever took it since)
        and the reading thread ended."""
        global _watch
        write, self._write = self._write, None
        if write is None:
            return
        if _watch is self:
            _watch = None
        current = signal.set_wakeup_fd(-1)
        if current != write:
            signal.set_wakeup_fd(current)
        self._stopping = True
        try:
            os.write(write, b"\0")  # (wakes the reading thread, which sees it is stopping)
        except OSError:
            pass
        os.close(write)

    def _run(self, read: int) -> None:
        try:
            while not self._stopping:
                data = os.read(read, 64)
                if not data:
                    return
                stops = [signum for signum in data if signum in SIGNALS]
                if stops and not self._stopping:
                    self._nudge_if_unhandled(stops[-1], time.monotonic())
        except OSError:
            pass
        finally:
            self._read = None
            os.close(read)

    def _nudge_if_unhandled(self, signum: int, read_at: float) -> None:
        time.sleep(NUDGE_AFTER_S)
        if self.guard.handled_at >= read_at - NUDGE_AFTER_S or self._stopping:
            return  # the handler ran (before this thread read the signal, or since)
        if time.monotonic() - self._nudged_at < NUDGE_EVERY_S:
            return
        self._nudged_at = time.monotonic()
        main = threading.main_thread().ident
        if main is not None:
            logger.debug("torchtrace: %s's handler did not run in %.1f s: the main thread waits in C; sent again",
                         signal.Signals(signum).name, NUDGE_AFTER_S)
            signal.pthread_kill(main, signum)

    # The wakeup fd is the process's, and a forked child would inherit it, writing the signals
    # it notes into the parent's pipe: it is unset while the main thread forks, and in the child.
    def before_fork(self) -> bool:
        if self._write is None or threading.current_thread() is not threading.main_thread():
            return False
        current = signal.set_wakeup_fd(-1)
        if current != self._write:  # an application's since (an asyncio loop's): left as it is
            signal.set_wakeup_fd(current)
            return False
        return True

    def after_fork_in_parent(self) -> None:
        if self._write is not None:
            signal.set_wakeup_fd(self._write)

    def after_fork_in_child(self) -> None:
        """The wakeup fd unset (a child of a fork from another thread inherited it) and the
        pipe's ends closed: a child sets a watch of its own up when it is configured."""
        global _watch
        current = signal.set_wakeup_fd(-1)
        if current not in (-1, self._write):  # an application's: left as it is
            signal.set_wakeup_fd(current)
        for fd in (self._write, self._read):
            if fd is not None:
                os.close(fd)
        self._write = self._read = _watch = None


_watch: StuckSignalWatch | None = None
"""The watch of this process, while one runs."""
_unset_for_fork = False


def _before_fork() -> None:
    global _unset_for_fork
    _unset_for_fork = _watch is not None and _watch.before_fork()


def _after_fork_in_parent() -> None:
    if _unset_for_fork and _watch is not None:
        _watch.after_fork_in_parent()


def _after_fork_in_child() -> None:
    if _watch is not None:
        _watch.after_fork_in_child()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


class SignalGuard:
    """torchtrace's handlers of the stop signals (:data:`SIGNALS`), chained to the application's.

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
        self.handled_at = -NUDGE_AFTER_S  # (time.monotonic) the last entry of the handler
        self.watch = StuckSignalWatch(self)
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
            self.watch.start()
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
        self.watch.stop()
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
        self.handled_at = time.monotonic()
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
