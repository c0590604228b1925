"""The job's whole story: every attempt, how each ended, and where the job's time went.

:func:`job_story` reads the black boxes of a run directory (every rank of every attempt, see
:mod:`torchtrace.job.identity` for the layout) and gives the ``job`` section of
``report.json`` (and of ``torchtrace why``):

- ``attempts``: per attempt ``attempt``, ``ended`` (completed, exception, preempted, killed,
  hang, unknown; None while it runs; ``hang`` too when every rank that ended did so stuck in a
  hang its watchdog had flagged, or at a collective a peer never reached (see
  :func:`~torchtrace.job.ending.stuck_at_a_collective`), ``detail`` saying how they ended), ``detail``,
  ``last_step`` (rank 0's), ``start`` (its first process's start), ``configured``, ``end`` (unix
  seconds), ``cause`` (the rank that ended first, and how) and ``ranks`` (each rank's ending;
  ``consequence`` marks a rank that ended after the cause: usually the launcher's SIGTERM, not
  a cause of its own);
- ``goodput``: productive step time over the job's wall time (the first attempt's process
  start to the last attempt's end, or now), all attempts;
- ``badput``: seconds by kind: each attempt's own kinds (startup, data_wait, checkpoint ...),
  summed, plus ``restart`` (an attempt's end to the next attempt's ``configure()``, process
  start included), ``lost_progress`` (from an attempt's last checkpoint save to its last step
  finished: the steps the next attempt repeats), ``compile`` (an attempt's first step beyond
  its usual step time) and ``hang`` (a hung attempt's last step that finished to its end, by its
  abort, the collective's own timeout or its launcher tearing it down while stuck, and the stall of
  each step that came out of a hang under ``on_hang="record"``, from its last progress to its end).

What it rests on, and so its limits: a killed rank's end is its last heartbeat (the black box
is rewritten every :data:`~torchtrace.step.setup.BLACK_BOX_PERIOD_S`), so the restart gap after
a SIGKILL may be that much longer than it was; an attempt's own numbers come from rank 0's
black box; lost progress counts from the last save of the attempt, which assumes the next
attempt resumes from it (one that resumes from an older checkpoint repeats more).

>>> job_story("/nonexistent")["attempts"]
[]
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping

from torchtrace import semconv
from torchtrace.job.ending import end_time, how_ended, hung_to_the_end, last_seen, stuck_at_a_collective
from torchtrace.job.state import read_states

_ABNORMAL = ("killed", "exception", "hang", "unknown")


def job_story(path: str | os.PathLike[str], now: float | None = None) -> dict[str, Any]:
    """The ``job`` section for the run directory ``path`` (or a directory of runs: the job of
    the newest black box). See the module docstring for the keys."""
    return story_of(read_states(path), now)


def story_of(states: list[dict[str, Any]], now: float | None = None) -> dict[str, Any]:
    """:func:`job_story` from black boxes already read (``read_states``, or one in memory)."""
    if not states:
        return {"job_id": None, "attempts": [], "goodput": None, "wall_s": 0.0, "productive_s": 0.0,
                "badput": dict.fromkeys(semconv.JOB_BADPUT_KINDS, 0.0)}
    job_id = jobs_of(states)[0]
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for state in states:
        if state.get("job_id") == job_id:
            by_attempt.setdefault(_int(state.get("attempt")), []).append(state)
    now = time.time() if now is None else now
    last = max(by_attempt)
    attempts = [_attempt(n, ranks, n < last, now) for n, ranks in sorted(by_attempt.items())]
    return {"job_id": job_id, **_accounts(attempts, now)}


def jobs_of(states: list[dict[str, Any]]) -> list[Any]:
    """The job ids of black boxes ``states`` (a directory of runs holds several), the newest job
    first: the one whose latest box started last.

    >>> jobs_of([{"job_id": "a", "started": 1.0}, {"job_id": "b", "started": 2.0}, {"job_id": "a", "started": 0.5}])
    ['b', 'a']
    """
    started: dict[Any, float] = {}
    for state in states:
        job = state.get("job_id")
        started[job] = max(started.get(job, float("-inf")), _num(state.get("started")))
    return sorted(started, key=lambda job: started[job], reverse=True)


def _attempt(number: int, states: list[dict[str, Any]], superseded: bool, now: float) -> dict[str, Any]:
    ranks = []
    # When each rank was last known alive: a SIGKILLed rank's end is an estimate (half a writer
    # period after its last heartbeat), but it certainly ended after its last heartbeat.
    seen: dict[int, float] = {}
    for state in sorted(states, key=lambda s: _int(s.get("rank"))):
        ended, detail = how_ended(state, superseded, now)
        ranks.append({"rank": _int(state.get("rank")), "ended": ended, "detail": detail,
                      "last_step": state.get("step"), "end": end_time(state) if ended else None,
                      "pid": state.get("pid")})
        seen[_int(state.get("rank"))] = last_seen(state)
    over = [r for r in ranks if r["ended"] is not None]
    abnormal = [r for r in over if r["ended"] in _ABNORMAL]
    # The cause is the rank that ended first, each ordered by when it was last seen alive: a
    # killed rank's end is not known, only that it came after its last heartbeat, and a rank
    # that raised because a peer vanished raised after that peer's last heartbeat.
    cause = min(abnormal or over, key=lambda r: seen[_int(r["rank"])], default=None)
    if cause is not None:
        # A rank that ended after the cause was last seen alive ended because of it (the
        # launcher's SIGTERM, or a collective that failed), unless it completed.
        for r in over:
            r["consequence"] = (r is not cause and _num(r["end"]) >= seen[_int(cause["rank"])]
                                and r["ended"] != "completed")
    finished = cause is not None and (bool(abnormal) or len(over) == len(ranks))
    ended = detail = None
    if finished and cause is not None:
        ended = str(cause["ended"])
        detail = str(cause["detail"]) if cause["detail"] is not None else None
    by_rank = {_int(s.get("rank")): s for s in states}
    at_a_collective = stuck_at_a_collective(states)
    if ended not in (None, "completed", "hang") and all(
            hung_to_the_end(by_rank[_int(r["rank"])]) or _int(r["rank"]) in at_a_collective for r in over):
        # Every rank ended stuck in a hang its watchdog had flagged: its launcher or scheduler
        # tore the hung job down (or the collective's own timeout ended it). Or a collective's
        # timeout, shorter than the hang timeout, ended a wait for a peer stuck elsewhere. The
        # hang ended it.
        ended, detail = "hang", f"stuck, then {ended}" + (f" ({detail})" if ended == "preempted" and detail else "")
    lead = states[0] if _int(states[0].get("rank")) == 0 else min(states, key=lambda s: _int(s.get("rank")))
    started = [_num(s["process_started"] if s.get("process_started") is not None else s.get("started"))
               for s in states]
    steps = [r["last_step"] for r in ranks if isinstance(r["last_step"], int)]
    return {
        "attempt": number,
        "ended": ended,
        "detail": detail,
        # (rank 0's, as the attempt's other numbers: a killed cause's box is up to a writer period old)
        "last_step": lead["step"] if isinstance(lead.get("step"), int) else max(steps, default=None),
        "start": min(started),
        "configured": min(_num(s.get("started")) for s in states),
        "end": max(_num(r["end"]) for r in over) if finished else None,
        "cause": {k: cause[k] for k in ("rank", "ended", "detail", "last_step", "end")} if finished and cause else None,
        "ranks": ranks,
        "world_size": lead.get("world_size"),
        "checkpoint_step": lead.get("checkpoint_step"),
        "checkpoint_seconds": lead.get("checkpoint_seconds") or {},
        "_lead": lead,
    }


def _accounts(attempts: list[dict[str, Any]], now: float) -> dict[str, Any]:
    """Goodput and badput over the attempts (and each attempt's share), in seconds."""
    badput: dict[str, float] = dict.fromkeys(semconv.JOB_BADPUT_KINDS, 0.0)
    productive = 0.0
    for i, attempt in enumerate(attempts):
        lead = attempt.pop("_lead")
        own = {k: float(v) for k, v in (lead.get("badput_s") or {}).items() if isinstance(v, (int, float))}
        mine = _num(lead.get("productive_s"))
        compile_s = max(0.0, _num(lead.get("first_step_seconds")) - _num(lead.get("step_seconds"))) \
            if lead.get("first_step_seconds") is not None and lead.get("step_seconds") is not None else 0.0
        later = attempts[i + 1] if i + 1 < len(attempts) else None
        lost_s = lost_productive = 0.0
        restart = 0.0
        interrupted = _interrupted(lead, attempt)
        attempt["interrupted_step"] = _step_in(lead) if interrupted is not None else None
        if later is not None:
            # (a step the attempt's end interrupted is repeated too: lost up to that end)
            lost_s, lost_productive = _lost(lead, lead.get("step_time") if interrupted is None else attempt["end"])
            if interrupted is not None:  # (its last write counted the step so far as data wait)
                _take_back(own, max(0.0, last_seen(lead) - interrupted))
            if attempt["end"] is not None:
                restart = max(0.0, later["configured"] - attempt["end"])
        # A hung attempt's last step to its abort, and the stalls of steps that came out of a
        # hang (counted productive by the attempt's own goodput: taken out of it here).
        recovered = _num(lead.get("hang_recovered_s"))
        hang = recovered
        if attempt["end"] is not None and attempt["ended"] == "hang":
            stuck_since = _last_finished(lead) or attempt["configured"]
            hang += max(0.0, attempt["end"] - stuck_since)
            _take_back(own, max(0.0, last_seen(lead) - stuck_since))
        if i == 0:
            own["startup"] = own.get("startup", 0.0) + max(0.0, attempt["configured"] - attempt["start"])
        attempt["productive_s"] = max(0.0, mine - lost_productive - compile_s - recovered)
        attempt["lost_progress_s"] = lost_s
        attempt["lost_steps"] = _lost_steps(lead) if later is not None else 0
        attempt["restart_s"] = restart
        productive += attempt["productive_s"]
        for kind, value in own.items():
            badput[kind] = badput.get(kind, 0.0) + value
        badput["restart"] += restart
        badput["lost_progress"] += lost_s
        badput["compile"] += compile_s
        badput["hang"] += hang
    first, last = attempts[0], attempts[-1]
    wall = max(0.0, (last["end"] if last["end"] is not None else now) - first["start"])
    return {"attempts": attempts, "wall_s": wall, "productive_s": productive,
            "goodput": productive / wall if wall > 0 else None, "badput": badput}


def _last_finished(lead: Mapping[str, Any]) -> float:
    """When the lead rank's last step that finished well ended (0.0 before any): a hung rank is
    stuck since then. A step that raised (a collective's own timeout ending the hang) is the
    box's last step but did not finish: the hang began before it (as
    :func:`~torchtrace.job.ending.hung_to_the_end` reads it)."""
    return _num(lead.get("finished_time", lead.get("step_time")))


def _take_back(own: dict[str, float], stretch: float) -> None:
    """Take ``stretch`` seconds, booked as the hang's, out of the lead rank's own badput: its
    last write counted the time since its last finished step as ``other`` (a run's end, and a
    step that raised), ``data_wait`` (written while it ran) and, only for what is left (a box
    written before a step that raised was ``other``), ``skipped_step``: a step the guard or a
    scaler skipped finishes, so none is in that stretch."""
    for kind in ("other", "data_wait", "skipped_step"):
        taken = min(stretch, own.get(kind, 0.0))
        if taken > 0:
            own[kind] -= taken
            stretch -= taken


def _interrupted(lead: Mapping[str, Any], attempt: Mapping[str, Any]) -> float | None:
    """When the step that the attempt's end interrupted began (a SIGKILL or a SIGTERM in the
    middle of a step: the black box's ``step_start``); None where it ended between steps, or
    ended hung (the hang books that stretch)."""
    began = lead.get("step_start")
    if attempt["end"] is None or attempt["ended"] == "hang" or not isinstance(began, (int, float)):
        return None
    return float(began)


def _step_in(lead: Mapping[str, Any]) -> int | None:
    """The number of the step the end interrupted: the one open at the last write (a SIGKILL),
    or the one open when a signal's shutdown stopped the marks."""
    for key in ("current_step", "interrupted_step"):
        step = lead.get(key)
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    return None


def _lost(lead: Mapping[str, Any], until: object) -> tuple[float, float]:
    """(wall seconds, productive seconds) from the last checkpoint save to ``until``: the last
    step finished, or the attempt's end where that interrupted a step."""
    if not isinstance(until, (int, float)):
        return 0.0, 0.0
    if lead.get("checkpoint_time") is not None:
        since = _num(lead.get("checkpoint_time"))
        productive = _num(lead.get("productive_s")) - _num(lead.get("checkpoint_productive_s"))
    else:
        first = lead.get("first_step_start")
        if first is None:  # (no step finished: the interrupted one was the first)
            first = lead.get("step_start")
        since = _num(first if first is not None else lead.get("started"))
        productive = _num(lead.get("productive_s"))
    return max(0.0, until - since), max(0.0, productive)


def _lost_steps(lead: Mapping[str, Any]) -> int:
    step, saved, first = lead.get("step"), lead.get("checkpoint_step"), lead.get("first_step")
    if not isinstance(step, int):
        return 0
    if isinstance(saved, int):
        return max(0, step - saved)
    return step - first + 1 if isinstance(first, int) else 0


def _num(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
