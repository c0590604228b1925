"""Each rank's black box: a small JSON file that says where the rank is and how it ended.

One file per rank and attempt, beside the rank's ``spans.jsonl``. It is rewritten whole (a
temporary file renamed over the old one), so a reader sees the last complete version and
never a torn one, also after the process was SIGKILLed. The training thread only stores into
:attr:`RankState.fields` (a dict update: no I/O, no lock); a background thread, a signal
handler and shutdown call :meth:`RankState.write`.

The fields, all optional for a reader (a file from an older attempt may lack some):

========================  =============================================================
``pid``, ``rank``,        who wrote the file
``world_size``,
``job_id``, ``attempt``,
``run_id``, ``started``
``time``                  unix time of the write: the rank's heartbeat
``current_step``          the step in progress (entered, not yet finished)
``step``, ``step_time``   the last step finished and when (unix time)
``phase``,                what the training thread is doing now and since when
``phase_since``
``collective_seq``,       the collectives this rank entered: count, the last one's op
``collective_op``,        and group
``collective_group``
``rss_bytes``,            memory when last sampled
``cuda_allocated_bytes``,
``memory_limit_bytes``
``loss``,                 the last step's loss and anomaly kinds
``last_anomaly``
``checkpoint_step``       the step of the last checkpoint saved
``ended``                 None while running; ``completed``, ``exception``,
                          ``preempted`` or ``hang`` when the process said how it ended
``end_detail``,           what ended it (the exception's type, the signal) and when
``end_time``
``progress``,             the hang watchdog's view (:mod:`torchtrace.job.progress`): the
``step_kind``,            last progress (unix time), the open step's kind, steps finished,
``steps_done``,           the training thread's ident
``thread``
``collective_active``     the last collective the flight recorder holds is in flight
``hang_timeout_s``        the watchdog's hang timeout now
``hang``, ``hangs``       the last hang found (since, detected, step, phase, stalled_s,
                          timeout_s, where, source) and how many
``culprit_ranks``         the ranks the last hang blamed
``hang_recovered_s``      seconds training steps spent stalled in hangs they came out of
                          (``on_hang="record"``), taken out of productive time by the job story
``peers_gone``            ranks of this attempt whose process this rank saw gone
``end_step``              the step in progress when an exception ended the process
``step_start``            when the open step began (unix time); kept at the end: the start of
``interrupted_step``      the step a signal interrupted, and its number (lost progress in the
                          job's story)
``host``,                 the host (a pid is checked only on the same host), and when the
                          process started (unix time, from /proc):
``process_started``       an attempt's restart badput begins at its process's start
``cgroup``                the memory cgroup at start: ``version``, ``path``, ``oom_kills``
                          (the kernel's count then: a later reader compares it with now's)
``first_step``,           the first training step finished, its seconds and start, the
``first_step_seconds``,   count finished and the mean seconds of those after the first
``first_step_start``,     (compile badput: the first's excess)
``steps_finished``,
``step_seconds``
``checkpoint_time``,      when the last save ended (unix time), the attempt's productive
``checkpoint_produ...``   seconds then (``checkpoint_productive_s``), and save/load
``checkpoint_seconds``    seconds so far by kind
``wall_s``,               this attempt's goodput ledger: wall, productive and badput
``productive_s``,         seconds by kind (refreshed by the writer thread)
``badput_s``
========================  =============================================================

>>> import tempfile
>>> from pathlib import Path
>>> box = RankState(Path(tempfile.mkdtemp()) / "state.json", {"rank": 0, "attempt": 0})
>>> box.fields.update(step=12, phase="forward")
>>> box.write()
True
>>> [s["step"] for s in read_states(box.path.parent)]
[12]
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from torchtrace import files
from torchtrace.job.signals import start_thread

logger = logging.getLogger(__name__)

RUN_PROGRESS = ("step", "step_time", "loss", "last_anomaly", "first_step", "first_step_seconds", "first_step_start",
                "steps_finished", "step_seconds", "checkpoint_step", "checkpoint_time", "checkpoint_productive_s",
                "checkpoint_seconds", "hang", "hangs", "hang_recovered_s")
"""The fields that hold what the attempt has done so far: the runtime of a second ``configure()``
of the same run id in one process (the same attempt) starts its black box with them."""

STATE_GLOB = "state*.json"
"""The black boxes' file names: ``state.json``, ``state.rank3.json`` and any attempt suffix."""


class RankState:
    """This rank's black box.

    Args:
        path: the file; None keeps the fields in memory only (``write_files=False``).
        fields: what is known at configure time (rank, attempt, pid ...).
    """

    def __init__(self, path: Path | None, fields: dict[str, Any] | None = None) -> None:
        self.path = path
        self.fields: dict[str, Any] = {"pid": os.getpid(), "started": time.time(), "ended": None}
        self.fields.update(fields or {})
        self.writes = 0
        self.refresh: Callable[[dict[str, Any]], None] | None = None  # updates fields before each write
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # One write at a time, copy and rename together: the writer thread's copy of the fields
        # never lands after a later write's (a last look at the peers at exit). Reentrant: a
        # signal handler may write on a thread that was writing.
        self._writing = threading.RLock()

    def start(self, period_s: float) -> None:
        """Rewrite the file every ``period_s`` seconds on a daemon thread until :meth:`stop`."""
        if self.path is None or self._thread is not None:
            return
        self._thread = start_thread(self._run, "torchtrace-blackbox", period_s)

    def stop(self, timeout_s: float = 1.0) -> None:
        """End the writer thread (waiting at most ``timeout_s``); the file stays as last written."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            self.write()

    def write(self, refresh: bool = True) -> bool:
        """Rewrite the file now from the current fields; False when it could not be written.

        ``refresh``: call :attr:`refresh` first (not from a signal handler: it may take locks
        the interrupted thread holds).

        Safe from any thread and from a signal handler on the main thread: it copies the
        fields first, and an error is logged at DEBUG and swallowed (the black box must never
        break the job).
        """
        # A forked child (a DataLoader worker) must not overwrite its parent's black box.
        if self.path is None or os.getpid() != self.fields["pid"]:
            return False
        if refresh and self.refresh is not None:
            try:
                self.refresh(self.fields)
            except Exception as exc:
                logger.debug("black box refresh failed: %s", exc)
        with self._writing:
            snapshot = dict(self.fields)
            snapshot["time"] = time.time()
            try:
                # No fsync: the rename makes it whole for readers after a SIGKILL; a machine crash
                # is what it does not survive, and an fsync twice a second cost 10 ms a write here.
                # Compact: indenting took Python's slow encoder, about half the write's CPU time.
                files.write_json_atomic(self.path, snapshot, durable=False, indent=None)
            except Exception as exc:  # whatever failed, the black box must never break the job
                logger.debug("black box %s not written: %s", self.path, exc)
                return False
            self.writes += 1
            return True


def sibling(state_file: str | os.PathLike[str], stem: str, suffix: str) -> Path:
    """A rank's other file beside its black box: ``hang.rank3.json`` beside ``state.rank3.json``."""
    path = Path(state_file)
    return path.with_name(stem + path.name[len("state"):-len(".json")] + suffix)


def read_states(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every black box under ``path`` (the directory and its subdirectories, two levels deep),
    each with ``file`` added; unreadable or partial files are left out. Sorted by attempt,
    then rank."""
    root = Path(path)
    found: list[dict[str, Any]] = []
    for pattern in (STATE_GLOB, f"*/{STATE_GLOB}", f"*/*/{STATE_GLOB}"):
        for file in sorted(root.glob(pattern)):
            try:
                value = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(value, dict):
                value["file"] = str(file)
                found.append(value)
    found.sort(key=lambda s: (_int(s.get("attempt")), _int(s.get("rank"))))
    return found


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0
