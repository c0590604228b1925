"""The hang watchdog: one daemon thread per process that notices when the training thread
stops making progress, and records where every thread is.

It reads the black box's fields (stored by :mod:`torchtrace.job.progress`), never takes a
lock the training thread may hold, and never raises: an error in a tick is logged at DEBUG
and the next tick runs. Each tick (every second):

* looks at the other ranks' black boxes for a peer whose process is gone;
* learns the step period from the steps finished since the last tick, and the longest
  pause between two marks it saw end;
* computes the hang timeout (:func:`hang_timeout`) and how long the training thread has
  made no progress;
* re-arms :func:`faulthandler.dump_traceback_later` to fire a little after the hang would
  be due. If this thread cannot run then (the training thread holds the GIL inside a C
  call), faulthandler's own C thread writes every thread's stack into the rank's
  ``stacks*.txt`` without the GIL; the watchdog reads that dump once it runs again;
* past the timeout: records the hang once per stall (:meth:`Watchdog.flag`).

>>> hang_timeout(None, "forward", steps_done=10, recent=[0.01])
30.0
>>> hang_timeout(None, "forward", steps_done=10, recent=[4.0])
40.0
>>> hang_timeout(2.0, "checkpoint", steps_done=10, recent=[0.01])
600.0
"""

from __future__ import annotations

import collections
import faulthandler
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

from torchtrace import files
from torchtrace.job import culprit, progress, stacks
from torchtrace.job.identity import process_alive
from torchtrace.job.signals import start_thread
from torchtrace.job.stall import StallClock, ago
from torchtrace.job.workers import WORKERS, end_daemonic_children, format_workers

logger = logging.getLogger(__name__)

FLOOR_S = 30.0
"""The adaptive timeout is never shorter: steps of milliseconds are flagged after 30 s."""
FACTOR = 10.0
"""The adaptive timeout is this many times the longest recent step period or pause."""
SLOW_S = 600.0
"""The allowance for the first steps (compilation, warm-up) and marked checkpoint/evaluation steps."""
WARMUP_STEPS = 2
"""Steps that must have finished before the adaptive or given timeout applies."""
WINDOW = 100
"""Recent observations the adaptive timeout looks at (about as many seconds)."""
HANG_EXIT_CODE = 124
"""The exit status under ``on_hang="abort"``."""


class _ForkSafeDump:
    """faulthandler's later dump, armed by one watchdog at a time, and never across a fork.

    The dump waits on a C thread that a forked child does not inherit; cancelling it in the
    child (its shutdown, or arming it again) waits for that thread forever. So it is cancelled
    just before a fork and armed again, for the time it had left, in the parent after it; the
    child starts with none. The lock keeps the watchdog's thread from arming it between the
    two.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed_for: float | None = None  # seconds it was last armed for
        self.armed_at = 0.0  # time.monotonic() then
        self.file: BinaryIO | None = None  # where it writes the stacks
        self.exit = False  # whether it ends the process after writing them
        self.paused: float | None = None  # the seconds left when a fork cancelled it

    def arm(self, seconds: float, file: BinaryIO, exit: bool) -> None:
        """Write every thread's stack into ``file`` once, ``seconds`` from now (and then end the
        process when ``exit``), unless armed again or cancelled before."""
        with self.lock:
            faulthandler.dump_traceback_later(seconds, repeat=False, file=file, exit=exit)
            self.armed_for, self.armed_at, self.file, self.exit = seconds, time.monotonic(), file, exit

    def cancel(self) -> None:
        with self.lock:
            if self.armed_for is not None:
                faulthandler.cancel_dump_traceback_later()
                self.armed_for = None

    def before_fork(self) -> None:
        self.lock.acquire()
        if self.armed_for is not None:
            faulthandler.cancel_dump_traceback_later()
            self.paused = max(self.armed_for - (time.monotonic() - self.armed_at), 1.0)
            self.armed_for = None

    def after_fork_in_parent(self) -> None:
        try:
            if self.paused is not None and self.file is not None:
                faulthandler.dump_traceback_later(self.paused, repeat=False, file=self.file, exit=self.exit)
                self.armed_for, self.armed_at = self.paused, time.monotonic()
        except (OSError, ValueError, RuntimeError) as exc:
            logger.debug("torchtrace: faulthandler not armed again after a fork: %s", exc)
        finally:
            self.paused = None
            self.lock.release()

    def after_fork_in_child(self) -> None:
        self.paused = None
        self.file = None
        self.lock.release()


class CrashDump:
    """faulthandler's dump of a fatal error (a segmentation fault, an abort: a C++ check that
    failed, gloo's collective mismatch) into the rank's stack file. A process that crashes runs
    no Python code: its black box says nothing, and without the dump it read as killed, with no
    stack (``torchtrace.job.ending.crash_of`` reads it).

    Only where nothing enabled faulthandler before (the application, ``-X faulthandler``,
    ``PYTHONFAULTHANDLER``: theirs stays as it is), and not in a forked child (a DataLoader
    worker's crash is not this rank's, and the file is its parent's).
    """

    def __init__(self) -> None:
        self.owner: int | None = None  # the process that enabled it

    def enable(self, file: BinaryIO) -> None:
        if faulthandler.is_enabled():
            return
        faulthandler.enable(file=file, all_threads=True)
        self.owner = os.getpid()

    def disable(self) -> None:
        if self.owner is not None:
            faulthandler.disable()
            self.owner = None


_DUMP = _ForkSafeDump()
_CRASH = CrashDump()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_DUMP.before_fork, after_in_parent=_DUMP.after_fork_in_parent,
                        after_in_child=_DUMP.after_fork_in_child)
    os.register_at_fork(after_in_child=_CRASH.disable)


def hang_timeout(given: float | None, phase: str | None, steps_done: int, recent: Iterable[float]) -> float:
    """Seconds without progress that make a hang.

    ``given`` (``hang_timeout_s``) or else ``FACTOR`` times the longest recent step period or
    pause, at least ``FLOOR_S``; at least ``SLOW_S`` before ``WARMUP_STEPS`` steps finished
    and inside a step marked ``kind="checkpoint"`` or ``kind="evaluation"``.
    """
    base = given if given is not None else max(FLOOR_S, FACTOR * max(recent, default=0.0))
    if steps_done < WARMUP_STEPS or phase in progress.SLOW_KINDS:
        return max(base, SLOW_S)
    return base


def _steps_at(finding: dict[str, Any]) -> str:
    """Where in the run a stall is: ``in step 20``, ``after step 19`` (between steps: the data
    source, the loop's own code) or ``before the first step``."""
    if finding.get("step") is not None:
        return f"in step {finding['step']}"
    if finding.get("last_step") is not None:
        return f"after step {finding['last_step']}"
    return "before the first step"


class Watchdog:
    """Watches one process's training thread through its black box's ``fields``.

    Args:
        fields: the black box's fields (:attr:`torchtrace.job.state.RankState.fields`).
        given_timeout_s: ``hang_timeout_s``; None for the adaptive timeout.
        on_hang: ``record`` or ``abort``.
        stack_path: the rank's ``stacks*.txt`` (faulthandler's dump and readable stacks), or None.
        hang_path: the rank's ``hang*.json`` (the last finding), or None.
        workers_path: the rank's ``workers*.txt``: its forked children's stacks, asked for at a
            hang in ``data_wait`` (:mod:`torchtrace.job.workers`), or None.
        peers: reads every rank's black box (the run directory), for the culprit.
        on_finding: called with each finding (telemetry: span, metrics); errors are swallowed.
        on_abort: under ``abort``: write everything and flush, before the process exits.
        period_s: seconds between ticks.
        collectives: the last collective the flight recorder holds
            (:func:`torchtrace.distributed.flight.last_collective`).
        persist: writes the black box now (after a finding, or a peer found gone: this process
            may be ended next, and readers should not wait for the next heartbeat).
    """

    def __init__(self, fields: dict[str, Any], *, given_timeout_s: float | None = None, on_hang: str = "record",
                 stack_path: Path | None = None, hang_path: Path | None = None, workers_path: Path | None = None,
                 peers: Callable[[], list[dict[str, Any]]] | None = None,
                 on_finding: Callable[[dict[str, Any]], None] | None = None,
                 on_abort: Callable[[], None] | None = None, period_s: float = 1.0,
                 collectives: Callable[[], dict[str, Any] | None] | None = None,
                 persist: Callable[[], Any] | None = None) -> None:
        self.fields = fields
        self.given = given_timeout_s
        self.on_hang = on_hang
        self.stack_path = stack_path
        self.hang_path = hang_path
        self.workers_path = workers_path
        self.peers = peers
        self.on_finding = on_finding
        self.on_abort = on_abort
        self.period_s = period_s
        self.collectives = collectives
        self.persist = persist
        self.recent: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.stall = StallClock()  # the stall on the monotonic clock: a wall clock that steps is none
        # Known before the first tick (/metrics may be scraped at once).
        fields["hang_timeout_s"] = hang_timeout(given_timeout_s, fields.get("phase"), 0, ())
        self.findings: collections.deque[dict[str, Any]] = collections.deque(maxlen=8)
        self.unmarked: dict[int, dict[str, Any]] = {}  # step -> finding, for the step's span when it ends
        self._seen_progress: float | None = None
        self._seen_stall = 0.0
        self._seen_phase: str | None = None
        self._seen_steps = 0
        self._seen_step_time: float | None = None
        self._seen_step_mono = 0.0  # when the step of _seen_step_time ended, on the monotonic clock
        self._seen_idles = 0  # tt.idle() calls seen (``idles``): a period across one is no step's
        self._looked: float | None = None  # the monotonic time of the last tick
        self._flagged_since: float | None = None
        self._stack_file: BinaryIO | None = None
        self._opened_by: int | None = None  # the process that opened the stack file
        self._dumped = 0  # bytes of the stack file known (written by us or read back)
        self._armed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = 0

    # ------------------------------------------------------------ life
    def start(self) -> None:
        if self._thread is not None:
            return
        if self.stack_path is not None:
            try:
                self._stack_file = open(self.stack_path, "ab")  # noqa: SIM115 (kept open for faulthandler)
                self._dumped = self._stack_file.tell()
                self._opened_by = os.getpid()
                _CRASH.enable(self._stack_file)
            except OSError as exc:
                logger.debug("torchtrace: stack file %s not opened: %s", self.stack_path, exc)
        if self.workers_path is not None:
            WORKERS.watch(self.workers_path)
        # The first look now, on the configuring thread: it arms faulthandler, so a hang that
        # holds the GIL before the thread's first tick (a first step stuck in C) is dumped too.
        self._look()
        self._thread = start_thread(self._run, "torchtrace-watchdog")

    def stop(self, timeout_s: float = 1.0) -> None:
        """End the thread and disarm faulthandler. The files stay, but for a stack file that
        nothing was ever written to: a run without a hang leaves no empty ``stacks.txt``."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        self._disarm()
        if self.workers_path is not None:
            WORKERS.unwatch()
        if self._stack_file is not None:
            _CRASH.disable()
            try:
                self._stack_file.close()
            except OSError:
                pass
            self._stack_file = None
            self._remove_if_empty()

    def _remove_if_empty(self) -> None:
        """Only by the process that opened the file: a forked child stopping its copy of the
        watchdog must not take away the file its parent's faulthandler writes into."""
        if self.stack_path is None or os.getpid() != self._opened_by:
            return
        try:
            if self.stack_path.stat().st_size == 0:
                self.stack_path.unlink()
        except OSError:  # gone already, or not ours to remove
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._look()

    def _look(self) -> None:
        try:
            self.tick(time.time(), time.monotonic())
        except Exception as exc:  # the watchdog never takes the process down
            logger.debug("torchtrace: watchdog tick failed: %r", exc)

    # ------------------------------------------------------------ one tick
    def tick(self, now: float, mono: float | None = None) -> dict[str, Any] | None:
        """Look once at wall time ``now`` and monotonic time ``mono`` (None: ``now``, a clock
        that never steps); returns the finding when this tick found a hang."""
        self.ticks += 1
        f = self.fields
        mono = now if mono is None else mono
        self._read_collectives(f)
        self._read_dump(now, mono)
        self.check_peers()
        phase, since, steps = f.get("phase"), f.get("progress"), f.get("steps_done") or 0
        stalled = self.stall.look(since, now, mono) if isinstance(since, (int, float)) else 0.0
        self._observe(f, since, steps, stalled, now, mono)
        timeout = hang_timeout(self.given, phase, steps, self.recent)
        f["hang_timeout_s"] = timeout
        # faulthandler is armed from what this tick sees, but the training thread may start a
        # step and get stuck before the next tick: arm with the timeout of a regular step
        # (no warm-up allowance) unless a checkpoint or evaluation step is running now.
        armed = timeout if phase in progress.SLOW_KINDS else hang_timeout(self.given, None, WARMUP_STEPS, self.recent)
        grace = 2 * self.period_s + 1.0
        if phase in (None, "idle") or not isinstance(since, (int, float)):
            self._arm(armed + grace)
            return None
        if self._flagged_since == since:
            return None  # this stall is recorded already; it may still end
        if stalled > timeout:
            return self.flag(now, stalled, timeout)
        self._arm(max(armed - stalled, 0.0) + grace)
        return None

    def _observe(self, f: dict[str, Any], since: float | None, steps: int, stalled: float, now: float,
                 mono: float) -> None:
        """Learn the step period and the pauses that ended since the last tick (outside the
        slow kinds, which have their own allowance). The steps' wall-clock stamps give the
        period, never more than the monotonic clock allows (a wall clock that stepped is no
        slow step): no more than from the step seen before (placed on the monotonic clock by
        its wall-clock age when first seen) to this tick. Steps on either side of a
        :func:`torchtrace.idle` give no period, nor is the pause it ends one: the time idle is
        no step's."""
        step_time = f.get("step_time")
        idled = (f.get("idles") or 0) != self._seen_idles  # a tt.idle() since the last tick
        advanced = steps > self._seen_steps
        if advanced and not idled and isinstance(step_time, (int, float)) and self._seen_step_time is not None:
            elapsed = min(step_time - self._seen_step_time, mono - self._seen_step_mono)
            self.recent.append(max(elapsed, 0.0) / (steps - self._seen_steps))
        if steps != self._seen_steps:
            self._seen_steps, self._seen_step_time = steps, step_time
            if isinstance(step_time, (int, float)):
                self._seen_step_mono = mono - ago(step_time, now, mono, self._looked)
        if idled:
            # The steps this tick saw may straddle the idle: no period from them. The last one
            # starts the next period only if it came after the idle (training runs again).
            self._seen_idles = f.get("idles") or 0
            self._seen_progress = None
            if not advanced or f.get("phase") == "idle":
                self._seen_step_time = None
        if since != self._seen_progress:
            if self._seen_progress is not None and self._seen_phase not in progress.SLOW_KINDS + ("idle",):
                self.recent.append(self._seen_stall)
            self._seen_progress, self._seen_phase = since, f.get("phase")
        self._seen_stall = stalled
        self._looked = mono

    def read_collectives(self) -> None:
        """Read the last collective into the black box's fields now (a tick does so each
        period): the paths that end the process take this last look, so that their final write
        does not keep a collective a tick saw in flight, completed since (a rank that waited in
        its first collective for a peer late to start, then raised before the next tick, read
        as ending stuck in it). Errors are swallowed."""
        try:
            self._read_collectives(self.fields)
        except Exception as exc:
            logger.debug("torchtrace: collectives not read: %r", exc)

    def _read_collectives(self, f: dict[str, Any]) -> None:
        if self.collectives is None:
            return
        last = self.collectives()
        if last is None:
            return
        if last["seq"] >= (f.get("collective_seq") or 0):
            f["collective_seq"] = last["seq"]
            f["collective_op"] = last["op"]
            f["collective_group"] = last["group"]
        f["collective_active"] = last["active"]

    # ------------------------------------------------------------ faulthandler
    def _arm(self, seconds: float) -> None:
        if self._stack_file is None:
            return
        try:
            _DUMP.arm(max(seconds, 1.0), file=self._stack_file, exit=self.on_hang == "abort")
            self._armed = True
        except (OSError, ValueError, RuntimeError) as exc:
            logger.debug("torchtrace: faulthandler not armed: %s", exc)

    def _disarm(self) -> None:
        if self._armed:
            _DUMP.cancel()  # (a no-op in a forked child: its copy was never armed there)
            self._armed = False

    def _read_dump(self, now: float, mono: float) -> None:
        """A dump faulthandler wrote while this thread could not run: record it as a hang."""
        if self.stack_path is None or self._stack_file is None:
            return
        try:
            size = self.stack_path.stat().st_size
        except OSError:
            return
        if size <= self._dumped:
            return
        try:
            with open(self.stack_path, "rb") as fh:
                fh.seek(self._dumped)
                text = fh.read().decode("utf-8", "replace")
        except OSError:
            return
        self._dumped = size
        self._armed = False
        f = self.fields
        threads = stacks.parse_faulthandler(text, f.get("thread"))
        since = f.get("progress")
        stalled = self.stall.look(since, now, mono) if isinstance(since, (int, float)) else 0.0
        timeout = hang_timeout(self.given, f.get("phase"), f.get("steps_done") or 0, self.recent)
        if f.get("phase") in (None, "idle") or stalled <= timeout:
            # The GIL was held past the dump's deadline, but the stall that applies ended (a
            # long first step, a C call that returned): the dump stays in the file, no hang.
            logger.warning("torchtrace: no Python thread could run for a while (the GIL was held); the stacks "
                           "faulthandler wrote then are in %s", self.stack_path)
            return
        self.flag(now, stalled, timeout, threads=threads, source="faulthandler")

    # ------------------------------------------------------------ a hang
    def flag(self, now: float, stalled: float, timeout: float, threads: list[dict[str, Any]] | None = None,
             source: str = "watchdog") -> dict[str, Any]:
        """Record a hang: stacks, the black box, the rank's hang file, telemetry, the log."""
        self._disarm()
        f = self.fields
        since = f.get("progress")
        self._flagged_since = since
        if threads is None:
            threads = stacks.capture(f.get("thread"), skip=threading.get_ident())
        training = next((t for t in threads if t["training"]), threads[0] if threads else None)
        finding: dict[str, Any] = {
            "time": now, "rank": f.get("rank", 0), "step": f.get("current_step"), "last_step": f.get("step"),
            "phase": "collective" if f.get("collective_active") else f.get("phase"),
            "phase_since": f.get("phase_since"), "since": since, "stalled_s": round(stalled, 3),
            "timeout_s": timeout, "source": source,
            "collective": {"seq": f.get("collective_seq"), "op": f.get("collective_op"),
                           "group": f.get("collective_group"), "active": f.get("collective_active")},
            "where": training["where"] if training else None,
            "stack": training["stack"] if training else [], "threads": threads,
        }
        f["hangs"] = (f.get("hangs") or 0) + 1
        f["hang"] = {"since": since, "detected": now, "step": finding["step"], "phase": finding["phase"],
                     "stalled_s": finding["stalled_s"], "timeout_s": timeout, "where": stacks.where(finding["where"]),
                     "source": source}
        finding["peers"] = self._judge_peers(now)
        self.findings.append(finding)
        step = finding["step"]
        if isinstance(step, int):
            self.unmarked[step] = finding
        # The black box first: a reader that waits for the hang file finds the box saying so.
        self._persist()
        if finding["phase"] == "data_wait" and self.workers_path is not None:
            # The line that hangs may be in a DataLoader worker: its stack, asked for (up to
            # 2 s: after the black box says hang, before the hang file).
            finding["workers"] = WORKERS.collect(f.get("thread"))
        self._write(finding, threads)
        if self.on_finding is not None:
            try:
                self.on_finding(finding)
            except Exception as exc:
                logger.debug("torchtrace: hang telemetry failed: %r", exc)
        self._log(finding)
        if self.on_hang == "abort":
            self._abort(finding)
        return finding

    def check_peers(self, persist: bool = True) -> list[int]:
        """The ranks of this attempt whose process is gone without saying how it ended
        (SIGKILL, the OOM killer): kept in ``peers_gone`` and logged once each.

        One read of the run directory's black boxes and of ``/proc`` for each peer on this
        host: it never waits. ``persist``: write the black box when a rank is newly found gone
        (False: the caller writes it next, as the paths that end a process do, see
        :func:`torchtrace.step.job.last_look`).
        """
        if self.peers is None:
            return []
        f = self.fields
        try:
            gone = [s["rank"] for s in self.peers()
                    if isinstance(s.get("rank"), int) and s.get("attempt") == f.get("attempt")
                    and s.get("rank") != f.get("rank") and not s.get("ended") and process_alive(s) is False]
        except Exception as exc:
            logger.debug("torchtrace: peers not read: %r", exc)
            return []
        known = f.get("peers_gone") or []
        new = [r for r in gone if r not in known]
        if new:
            f["peers_gone"] = sorted(set(known) | set(new))
            if persist:
                self._persist()
            start_thread(logger.error, "torchtrace-hang-log",
                         "torchtrace: rank(s) %s of this job are gone: their process no longer exists and never said "
                         "how it ended (SIGKILL, the OOM killer); a collective of rank %s with them will wait in vain",
                         new, f.get("rank"))
        return gone

    def _persist(self) -> None:
        if self.persist is not None:
            try:
                self.persist()
            except Exception as exc:
                logger.debug("torchtrace: black box not written: %r", exc)

    def _judge_peers(self, now: float) -> dict[str, Any] | None:
        if self.peers is None:
            return None
        try:
            states = self.peers()
            # This rank's own fields are newer than its file.
            mine = dict(self.fields, time=now)
            states = [s for s in states if s.get("rank") != mine.get("rank") or s.get("attempt") != mine.get("attempt")]
            verdict = culprit.judge(states + [mine], now)
        except Exception as exc:
            logger.debug("torchtrace: peers not judged: %r", exc)
            return None
        self.fields["culprit_ranks"] = verdict["culprit_ranks"]
        return verdict

    def _write(self, finding: dict[str, Any], threads: list[dict[str, Any]]) -> None:
        if self._stack_file is not None:
            head = (f"\ntorchtrace: hang at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(finding['time']))}: "
                    f"{_steps_at(finding)}, phase {finding['phase']}, no progress for {finding['stalled_s']:.1f} s "
                    f"(timeout {finding['timeout_s']:.1f} s)\n")
            try:
                text = head + stacks.format_threads(threads) + format_workers(finding.get("workers") or [])
                self._stack_file.write(text.encode("utf-8", "replace"))
                self._stack_file.flush()
                self._dumped = self._stack_file.tell()
            except (OSError, ValueError):
                pass
        if self.hang_path is not None:
            try:
                files.write_json_atomic(self.hang_path, finding)
            except (OSError, ValueError) as exc:
                logger.debug("torchtrace: hang file not written: %s", exc)

    def _log(self, finding: dict[str, Any]) -> None:
        peers = finding.get("peers") or {}
        blamed = peers.get("culprit_ranks")
        args = (finding["rank"], finding["stalled_s"], _steps_at(finding), finding["phase"],
                stacks.where(finding["where"]),
                "".join(f"; DataLoader worker {w['pid']} at {stacks.where(w['where'])}"
                        for w in finding.get("workers") or []),
                f"; culprit rank(s) {blamed}: {peers.get('reason')}" if blamed else "",
                self.stack_path or "(no run directory)")
        message = ("torchtrace: training hang on rank %s: no progress for %.1f s %s, phase %s, at %s%s%s; "
                   "every thread's stack: %s")
        # A logging handler's lock may be held by the stuck thread (a blocked stderr): log from
        # a thread of its own, so the watchdog itself never waits on it.
        start_thread(logger.error, "torchtrace-hang-log", message, *args)

    def _abort(self, finding: dict[str, Any]) -> None:
        f = self.fields
        f["ended"], f["end_detail"], f["end_time"] = ("hang", f"no progress for {finding['stalled_s']:.0f} s",
                                                      time.time())
        if self.on_abort is not None:
            try:
                self.on_abort()
            except Exception as exc:
                logger.debug("torchtrace: abort's flush failed: %r", exc)
        if self.workers_path is not None:
            WORKERS.unwatch()  # (os._exit runs no shutdown: a file that holds no stack goes now)
        end_daemonic_children()
        os._exit(HANG_EXIT_CODE)

    # ------------------------------------------------------------ the step's span
    def take(self, step: int) -> dict[str, Any] | None:
        """The finding for ``step`` when it was found hung and has now ended (once)."""
        return self.unmarked.pop(step, None)

    def summary(self) -> dict[str, Any]:
        """For the report and the debug API: the timeout, the stall now, the findings (stacks left out)."""
        f = self.fields
        since = f.get("progress")
        stalled = self.stall.now(since) if isinstance(since, (int, float)) and f.get("phase") != "idle" else 0.0
        return {"timeout_s": f.get("hang_timeout_s"), "given_timeout_s": self.given, "on_hang": self.on_hang,
                "phase": f.get("phase"), "stalled_s": round(stalled, 3), "hangs": f.get("hangs") or 0,
                "last": f.get("hang"), "culprit_ranks": f.get("culprit_ranks"), "stack_file": str(self.stack_path)
                if self.stack_path else None}
