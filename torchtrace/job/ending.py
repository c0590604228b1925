"""How a rank's attempt ended, read from its black box.

A process that ends through torchtrace says so itself in its black box: ``completed``
(``shutdown()`` ran), ``exception`` (an exception reached the top of the main thread; its type,
message and step), ``preempted`` (a SIGTERM, SIGINT or SIGHUP handler ran), ``hang`` (the hang watchdog
aborted it). A SIGKILL runs no code at all, so a black box that says nothing, of a process that
is gone, is read as ``killed``: the cause is inferred, never told. It *crashed* when faulthandler
wrote a fatal error (a segmentation fault, an abort) into the rank's stack file. It is a *host OOM kill* when
the kernel counted an OOM kill in the process's memory cgroup after the process started (the
count saved in the black box at start is compared with the cgroup's count now) and the black
box's last memory sample was near the cgroup's limit. A box that is neither is ``unknown``.

>>> how_ended({"ended": "exception", "end_detail": "ValueError: bad batch"})
('exception', 'ValueError: bad batch')
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from torchtrace.job import cgroup, stacks
from torchtrace.job.identity import process_alive
from torchtrace.job.state import sibling

TOLD = ("completed", "exception", "preempted", "hang")
"""Endings a process records itself."""

NEAR_LIMIT = 0.5
"""Memory at or above this share of the cgroup's limit, in the last sample, is "near the limit":
the sample is up to a writer period old, and memory that ran away within a step was not seen."""

HOST_OOM = "host OOM kill"


STALE_S = 60.0
"""A black box of another host whose heartbeat is older than this is of a process that is gone
(its own host is not asked: it may be unreachable)."""


def how_ended(state: Mapping[str, Any], superseded: bool = False,
              now: float | None = None) -> tuple[str | None, str | None]:
    """``(ended, detail)`` of one rank's black box; ``(None, None)`` while it still runs.

    ``superseded``: a later attempt of the job has started, so this one is over whatever its
    process looks like from here (a process of another host cannot be asked).
    """
    ended = state.get("ended")
    if ended in TOLD:
        return ended, state.get("end_detail")
    if ended is not None:
        return "unknown", f"black box says {ended!r}"
    beat = state.get("time")
    stale = isinstance(beat, (int, float)) and (time.time() if now is None else now) - beat > STALE_S
    if not superseded and not stale and process_alive(state) is not False:
        return None, None
    return "killed", killed_detail(state)


SILENT = "no shutdown and no signal handler ran (SIGKILL, a crash of the interpreter, or os._exit)"
"""What a black box that says nothing tells of its process's end."""


def killed_detail(state: Mapping[str, Any]) -> str:
    """Why a process that said nothing is gone: the fatal error it crashed with, or what the
    cgroup can tell."""
    crash = crash_of(state)
    if crash is not None:
        return f"crashed: {crash}"
    group = state.get("cgroup")
    if not isinstance(group, Mapping) or not group.get("path"):
        return SILENT
    kills = oom_kills_since_start(state)
    if kills is None:
        return f"{SILENT}; the memory cgroup can no longer be read"
    if kills == 0:
        return f"{SILENT}; the kernel counted no OOM kill in the memory cgroup"
    limit, rss = state.get("memory_limit_bytes"), state.get("rss_bytes")
    if isinstance(limit, int) and isinstance(rss, int) and rss >= NEAR_LIMIT * limit:
        return f"{HOST_OOM}: the kernel counted {kills} OOM kill(s) in the memory cgroup, and memory was " \
               f"{rss / limit:.0%} of its limit of {limit} bytes at the last sample"
    return f"the kernel counted {kills} OOM kill(s) in the memory cgroup, but this rank's last memory " \
           f"sample ({rss} bytes) was far from the limit ({limit}): perhaps another process was killed"


def oom_kills_since_start(state: Mapping[str, Any]) -> int | None:
    """How many processes the kernel's OOM killer killed in the rank's memory cgroup since the
    rank started (its black box's ``cgroup`` count then); None when it cannot be told (no
    cgroup recorded, or it can no longer be read)."""
    group = state.get("cgroup")
    if not isinstance(group, Mapping) or not group.get("path"):
        return None
    before = group.get("oom_kills")
    now = cgroup.oom_kills(int(group.get("version") or 0), group["path"])
    if now is None or not isinstance(before, int):
        return None
    return max(now - before, 0)


def oom_note(state: Mapping[str, Any]) -> str:
    """For a process that ends with an exception: ``"; the kernel counted N OOM kill(s) ..."``
    when processes of its memory cgroup were OOM-killed while it ran (a DataLoader worker: its
    parent then gets PyTorch's ``RuntimeError`` that the worker was killed), else ``""``."""
    kills = oom_kills_since_start(state)
    if not kills:
        return ""
    return f"; the kernel counted {kills} OOM kill{'s' if kills > 1 else ''} in the memory cgroup while it ran " \
           "(a DataLoader worker, or another process of the container)"


def end_time(state: Mapping[str, Any]) -> float | None:
    """When the rank ended: the time it recorded, else (a SIGKILL) half a writer period after
    its last heartbeat: it died after that write and before the next one was due."""
    told = state.get("end_time")
    if isinstance(told, (int, float)):
        return float(told)
    beats = [v for v in (state.get("time"), state.get("step_time")) if isinstance(v, (int, float))]
    if not beats:
        return None
    period = state.get("period_s")
    return max(beats) + (period / 2 if isinstance(period, (int, float)) else 0.0)


def last_seen(state: Mapping[str, Any]) -> float:
    """The rank's last sign of life: the time it recorded its end, else its last heartbeat."""
    told = state.get("end_time")
    if isinstance(told, (int, float)):
        return float(told)
    beats = [v for v in (state.get("time"), state.get("step_time")) if isinstance(v, (int, float))]
    return max(beats) if beats else 0.0


def hung_to_the_end(state: Mapping[str, Any]) -> bool:
    """The rank's watchdog flagged a hang and the rank finished no step after that: if it has
    ended, it ended stuck (a launcher tearing the hung job down, the collective's own timeout,
    ``on_hang="abort"``)."""
    hang = state.get("hang")
    flagged = (hang.get("detected") or hang.get("since")) if isinstance(hang, dict) else None
    # A step that raised after the hang (a collective's own timeout) did not finish: only one
    # that ended well tells the rank came out of it.
    finished = state.get("finished_time", state.get("step_time"))
    return isinstance(flagged, (int, float)) and not (isinstance(finished, (int, float)) and finished > flagged)


def last_step_raised(state: Mapping[str, Any]) -> bool:
    """The black box's last step raised: it ended after the last step that finished well (a
    step that raised is the box's ``step`` too, but sets no ``finished_time``).

    >>> last_step_raised({"step": 10, "step_time": 130.0, "finished_time": 100.0})
    True
    """
    reached, finished = state.get("step_time"), state.get("finished_time", state.get("step_time"))
    return isinstance(reached, (int, float)) and isinstance(finished, (int, float)) and reached > finished


def stuck_at_a_collective(states: Sequence[Mapping[str, Any]]) -> set[int]:
    """The ranks of one attempt that ended stuck at a collective that could not complete, flagged
    by no watchdog (a collective's own timeout shorter than the hang timeout): each rank that
    ended with an exception inside a collective (its black box's ``collective_active`` at its
    end) that a peer never reached, and those peers. A peer never reached it when its count of
    collectives is lower and it was seen alive at or after that end (or, told of no end, its
    process still runs): it was stuck elsewhere (its data loading), not dead, so the
    collective's timeout raised, not a peer's death.

    >>> stuck_at_a_collective([
    ...     {"rank": 0, "ended": "exception", "collective_active": True, "collective_seq": 16, "end_time": 10.0},
    ...     {"rank": 1, "ended": "preempted", "collective_seq": 15, "end_time": 11.0}])
    {0, 1}
    """
    stuck: set[int] = set()
    for state in states:
        seq, end = state.get("collective_seq"), state.get("end_time")
        if (state.get("ended") != "exception" or not state.get("collective_active") or not isinstance(seq, int)
                or not isinstance(end, (int, float))):
            continue
        behind = {_rank(peer) for peer in states if peer is not state and isinstance(peer.get("collective_seq"), int)
                  and peer["collective_seq"] < seq and _alive_after(peer, end)}
        if behind:
            stuck |= behind | {_rank(state)}
    return stuck


def _alive_after(state: Mapping[str, Any], moment: float) -> bool:
    """The rank was seen alive at or after ``moment``: its last sign of life, or, told of no
    end, its process still runs (its box is rewritten only every writer period)."""
    return last_seen(state) >= moment or (state.get("ended") is None and process_alive(state) is True)


def _rank(state: Mapping[str, Any]) -> int:
    rank = state.get("rank")
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else 0


def crash_dump(state: Mapping[str, Any]) -> str | None:
    """The text of the rank's stack file when its last dump is the fatal error the process
    crashed with (faulthandler's, :class:`torchtrace.job.watchdog.CrashDump`), written after the
    process started; None for a process that did not crash, or crashed unseen."""
    file = state.get("file")
    if not file:
        return None
    path = sibling(file, "stacks", ".txt")
    try:
        if path.stat().st_mtime < float(state.get("started") or 0.0):
            return None  # (an earlier process's)
        text = path.read_text(encoding="utf-8", errors="replace")
    except (OSError, ValueError):
        return None
    return text if stacks.fatal_error(text) is not None else None


def crash_of(state: Mapping[str, Any]) -> str | None:
    """The fatal error the process crashed with (``Fatal Python error: Segmentation fault``),
    from its :func:`crash_dump`; None for a process that did not crash, or crashed unseen."""
    text = crash_dump(state)
    return stacks.fatal_error(text) if text is not None else None
