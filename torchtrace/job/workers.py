"""Where a rank's DataLoader workers are when the rank hangs waiting for its data.

A training thread stuck in ``data_wait`` shows the DataLoader's queue, not the line that
hangs: that line is in a worker process (a read from a network file system or an object store
that never returns, a lock the fork copied while another thread held it). Each child forked
while the rank's hang watchdog runs registers faulthandler on :data:`SIGNAL`, writing into a
file its parent opened before the fork (the rank's ``workers*.txt``), and announces itself
there: its pid and start time. When the watchdog finds a hang in ``data_wait``, it asks each
announced child that is still its own (same parent, same start time) and still catches the
signal (``SigCgt`` in ``/proc``: an ``exec`` since the fork resets it), one at a time, and
reads the stack each one appends.

Linux only (a real-time signal, ``/proc``), and only children made by ``fork``: the
DataLoader's default on Linux before Python 3.14. A worker started by ``spawn`` or
``forkserver`` never registers, and is never signalled.

When the watchdog aborts the rank (``on_hang="abort"``), :func:`end_daemonic_children` ends its
DataLoader workers, as the interpreter's exit would have.

>>> _announced("torchtrace worker 41 7\\nCurrent thread 0x1 (most recent call first):\\ntorchtrace worker 42 9\\n")
{41: 7, 42: 9}
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import re
import signal
import time
from pathlib import Path
from typing import Any, BinaryIO

from torchtrace.errors import get_logger
from torchtrace.job import stacks
from torchtrace.job.identity import proc_stat

logger = get_logger("torchtrace")

SIGNAL: int | None = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") else None
"""The signal a registered child dumps its stacks on: a real-time one, which applications
leave alone (SIGUSR1 and SIGUSR2 are taken by schedulers and by applications)."""

MAX_WORKERS = 16
"""Children asked at one hang, at most."""

WAIT_S = 2.0
"""Seconds one hang's asking may take in all."""

_LINE = re.compile(r"^torchtrace worker (\d+) (\d+)$", re.MULTILINE)
_BOOTSTRAP = re.compile(r'multiprocessing[/\\]process\.py", line \d+ in _bootstrap$')


def _announced(text: str) -> dict[int, int]:
    """``{pid: start ticks}`` of the children announced in ``text`` (a pid's latest start)."""
    return {int(pid): int(ticks) for pid, ticks in _LINE.findall(text)}


def own_frames(dump: str) -> str:
    """A child's faulthandler dump without the frames it inherited from its parent's fork:
    those outer to ``multiprocessing``'s ``_bootstrap``, which runs the child's own code (the
    parent's loop over the DataLoader is not where the worker is).

    >>> print(own_frames('Current thread 0x1 (most recent call first):\\n'
    ...                  '  File "d.py", line 6 in __getitem__\\n'
    ...                  '  File "/p/multiprocessing/process.py", line 314 in _bootstrap\\n'
    ...                  '  File "t.py", line 12 in <module>'))
    Current thread 0x1 (most recent call first):
      File "d.py", line 6 in __getitem__
      File "/p/multiprocessing/process.py", line 314 in _bootstrap
    """
    kept: list[str] = []
    inherited = False
    for line in dump.splitlines():
        if not line.startswith(" "):  # a thread's head, or the blank line after its frames
            inherited = False
        elif inherited:
            continue
        kept.append(line)
        inherited = inherited or bool(_BOOTSTRAP.search(line))
    return "\n".join(kept)


def _ours(pid: int, ticks: int) -> bool:
    """Whether ``pid`` is still the child that announced itself: this process's child, started
    at ``ticks`` (not a pid the kernel gave again), and not a zombie."""
    fields = proc_stat(pid)
    return (fields is not None and len(fields) > 19 and fields[0] != "Z" and fields[1] == str(os.getpid())
            and fields[19] == str(ticks))


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (``SigCgt``): one that does not
    would be ended by it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


class WorkerStacks:
    """The file the children's dumps go to, and the asking (one per process)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.file: BinaryIO | None = None
        self.owner: int | None = None  # the process that opened the file (the rank)
        self.asked = False  # whether a dump was asked for: the file is kept at the end

    def watch(self, path: Path) -> None:
        """Open ``path`` for the children forked from now on (the hang watchdog's start)."""
        if SIGNAL is None or self.file is not None:
            return
        try:
            self.file = open(path, "ab")  # noqa: SIM115 (kept open: the children's faulthandler writes into it)
        except OSError as exc:
            logger.debug("torchtrace: worker stack file %s not opened: %s", path, exc)
            return
        self.path, self.owner, self.asked = path, os.getpid(), False

    def unwatch(self) -> None:
        """Close the file (the watchdog's stop); a file that holds no stack is removed."""
        file, self.file = self.file, None
        if file is None or os.getpid() != self.owner:
            return
        try:
            file.close()
            if not self.asked and self.path is not None:
                self.path.unlink()
        except OSError:
            pass

    def after_fork_in_child(self) -> None:
        """In a forked child: dump every thread's stack into the file on :data:`SIGNAL`, and
        say so there (the parent asks only children that did)."""
        if self.file is None or SIGNAL is None:
            return
        try:
            faulthandler.register(SIGNAL, file=self.file, all_threads=True, chain=False)
            fields = proc_stat("self")
            if fields is not None and len(fields) > 19:
                os.write(self.file.fileno(), f"torchtrace worker {os.getpid()} {fields[19]}\n".encode())
        except (OSError, ValueError, RuntimeError) as exc:
            logger.debug("torchtrace: a forked child's stacks cannot be asked for: %s", exc)

    def collect(self, training: int | None) -> list[dict[str, Any]]:
        """Each announced child's stack now: ``{"pid", "where", "stack"}`` (the thread that
        forked it first: a DataLoader worker's loop). Waits at most :data:`WAIT_S` in all."""
        if self.path is None or self.file is None or SIGNAL is None or os.getpid() != self.owner:
            return []
        try:
            children = _announced(self.path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            return []
        deadline = time.monotonic() + WAIT_S
        found: list[dict[str, Any]] = []
        for pid, ticks in list(children.items())[-MAX_WORKERS:]:
            if time.monotonic() >= deadline:
                break
            if not _ours(pid, ticks) or not _catches(pid, SIGNAL):
                continue
            text = self._ask(pid, deadline)
            threads = stacks.parse_faulthandler(own_frames(text), training)
            if threads:
                found.append({"pid": pid, "where": threads[0]["where"], "stack": threads[0]["stack"]})
        return found

    def _ask(self, pid: int, deadline: float) -> str:
        """Signal ``pid`` and read what it appends to the file, once it stops growing."""
        assert self.path is not None and SIGNAL is not None
        self.asked = True
        try:
            start = self.path.stat().st_size
            os.kill(pid, SIGNAL)
        except OSError:
            return ""
        size, still = start, 0
        while time.monotonic() < deadline and still < 3:  # settled: three looks 20 ms apart alike
            time.sleep(0.02)
            try:
                now = self.path.stat().st_size
            except OSError:
                return ""
            still = still + 1 if now == size and now > start else 0
            size = now
        try:
            with open(self.path, "rb") as fh:
                fh.seek(start)
                return fh.read(size - start).decode("utf-8", "replace")
        except OSError:
            return ""


def end_daemonic_children() -> None:
    """What the interpreter's exit does and ``os._exit`` skips: end this process's daemonic
    ``multiprocessing`` children (DataLoader workers). A worker stuck in a read would otherwise
    live on after the abort, an orphan holding the rank's pipes, which each restart adds to.
    SIGKILL: a child stuck in C never runs the Python handler a SIGTERM would wait for."""
    try:
        for child in multiprocessing.active_children():
            if child.daemon:
                child.kill()
    except Exception as exc:  # (never in the way of the abort)
        logger.debug("torchtrace: daemonic children not ended: %r", exc)


def format_workers(workers: list[dict[str, Any]]) -> str:
    """The stacks of the rank's forked children (its DataLoader workers), as the stack file shows threads."""
    lines: list[str] = []
    for w in workers:
        lines.append(f"DataLoader worker process {w['pid']}, the user's frames first:")
        lines.extend(f'  File "{f["file"]}", line {f["line"]}, in {f["function"]}'
                     + ("" if f["user"] else "  [library]") for f in w["stack"])
        lines.append("")
    return "\n".join(lines)


WORKERS = WorkerStacks()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=WORKERS.after_fork_in_child)
