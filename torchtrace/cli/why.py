"""``torchtrace why PATH [--json]``: what happened to this job, from its run directory.

It reads only files (each rank's black box ``state*.json``, the watchdog's ``hang*.json`` and
``stacks*.txt``), so it answers while the job is still hung and after it is gone, for one
rank or many. It prints the verdict (healthy, running, hang, died, completed, preempted,
ended), the culprit ranks and each rank's step, phase and stack (the user's frames first).

>>> import tempfile
>>> report = why(tempfile.mkdtemp())
>>> report["verdict"], report["culprit_ranks"]
('running', [])
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from torchtrace.job import culprit, stacks
from torchtrace.job.ending import crash_dump, hung_to_the_end, last_step_raised
from torchtrace.job.state import read_states, sibling
from torchtrace.job.story import jobs_of, story_of


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _stack_of(state: dict[str, Any], condition: str) -> tuple[list[dict[str, Any]], str | None, list[dict[str, Any]]]:
    """The stuck rank's training-thread stack and its source, and its DataLoader workers'
    (``{"pid", "where"}``, asked for at a hang in data_wait): the watchdog's hang file for the
    stall it recorded, else faulthandler's dump written during this stall (a rank whose
    heartbeat stopped: the GIL was held), else none. A rank that progresses has none; one that
    ended stuck in a hang (its launcher's SIGTERM, the collective's own timeout) has the hang's,
    and one that crashed (faulthandler's dump of its fatal error) the crash's."""
    file = state.get("file")
    ended_stuck = condition.startswith("ended:") and hung_to_the_end(state)
    if not file or (condition not in ("hung", "silent", "gone", "ended:hang") and not ended_stuck):
        return [], None, []
    crash = crash_dump(state) if condition == "gone" else None
    if crash is not None:
        threads = stacks.parse_faulthandler(crash, state.get("thread"))
        return (threads[0]["stack"], "crash", []) if threads else ([], None, [])
    # (the end of a rank that ended stuck moved its progress on: the hang's start is in its box)
    since = state["hang"].get("since") if ended_stuck else state.get("progress")
    hang = _read_json(sibling(file, "hang", ".json"))
    if hang is not None and hang.get("since") == since and hang.get("source") == "watchdog":
        return list(hang.get("stack") or []), "watchdog", _workers_of(hang)
    dump = sibling(file, "stacks", ".txt")
    try:
        fresh = not isinstance(since, (int, float)) or dump.stat().st_mtime >= since
        text = dump.read_text(encoding="utf-8", errors="replace") if fresh else ""
    except OSError:
        text = ""
    if "Timeout (" in text:
        threads = stacks.parse_faulthandler(text, state.get("thread"))
        training = next((t for t in threads if t["training"]), threads[0] if threads else None)
        if training is not None:
            return training["stack"], "faulthandler", []
    if hang is not None and hang.get("since") == since:
        return list(hang.get("stack") or []), str(hang.get("source")), _workers_of(hang)
    return [], None, []


def _workers_of(hang: dict[str, Any]) -> list[dict[str, Any]]:
    """The rank's DataLoader workers the hang asked, each where it was."""
    return [{"pid": w.get("pid"), "where": stacks.where(w.get("where"))} for w in hang.get("workers") or []
            if isinstance(w, dict)]


def _rank_view(state: dict[str, Any], condition: str, now: float) -> dict[str, Any]:
    stack, source, workers = _stack_of(state, condition)
    progress = state.get("progress")
    live = state.get("ended") is None and condition not in ("gone",)
    stalled = (now if live else (state.get("time") or now)) - progress if isinstance(progress, (int, float)) else None
    phase = state.get("phase")
    if state.get("collective_active") and phase not in (None, "idle"):
        phase = "collective"
    return {
        "rank": state.get("rank"), "attempt": state.get("attempt"), "pid": state.get("pid"),
        "host": state.get("host"), "condition": condition,
        "step": state.get("current_step") if state.get("current_step") is not None else state.get("step"),
        "in_step": state.get("current_step") is not None, "last_finished_step": state.get("step"),
        "step_raised": state.get("current_step") is None and last_step_raised(state),
        "phase": phase, "stalled_s": round(stalled, 1) if stalled is not None and phase != "idle" else 0.0,
        "heartbeat_age_s": round(now - state["time"], 1) if isinstance(state.get("time"), (int, float)) else None,
        "hang_timeout_s": state.get("hang_timeout_s"),
        # (a rank that completed is in no collective: the flight recorder's last look may say otherwise)
        "collective": {"seq": state.get("collective_seq"), "op": state.get("collective_op"),
                       "group": state.get("collective_group"),
                       "active": bool(state.get("collective_active")) and state.get("ended") != "completed"},
        "ended": state.get("ended"), "end_detail": state.get("end_detail"),
        "where": stacks.where(stack[0]) if stack else None,
        "stack": [stacks.where(f) + ("" if f.get("user") else " [library]") for f in stack],
        "stack_source": source, "workers": workers, "file": state.get("file"),
    }


def why(path: str | os.PathLike[str], now: float | None = None) -> dict[str, Any]:
    """The verdict on the job whose run directory is ``path``; of a directory of runs (the
    ``run_dir``), its newest job's (``jobs``: every job found, the one read first)."""
    now = time.time() if now is None else now
    states = read_states(path)
    jobs = jobs_of(states)
    if len(jobs) > 1:
        states = [s for s in states if s.get("job_id") == jobs[0]]
    verdict = culprit.judge(states, now)
    boxes = culprit.latest_attempt(states)
    ranks = [_rank_view(s, verdict["conditions"][s["rank"]], now) for s in boxes]
    return {"path": str(path), "verdict": verdict["verdict"], "culprit_ranks": verdict["culprit_ranks"],
            "reason": verdict["reason"], "ranks": ranks, "job": story_of(states, now), "jobs": jobs}


def render(report: dict[str, Any]) -> str:
    """The report as text: verdict, culprits, then each rank (culprits first)."""
    lines = []
    jobs = report.get("jobs") or []
    if len(jobs) > 1:
        others = ", ".join(str(j) for j in jobs[1:6]) + (f" and {len(jobs) - 6} more" if len(jobs) > 6 else "")
        lines.append(f"job {jobs[0]}, the newest of {len(jobs)} under {report['path']} (also: {others}); "
                     f"give its directory to read one other")
    lines.append(f"verdict: {report['verdict']}" + (f" ({report['reason']})" if report["reason"] else ""))
    blamed = report["culprit_ranks"]
    lines.append("culprit ranks: " + (", ".join(str(r) for r in blamed) if blamed else "none"))
    for r in sorted(report["ranks"], key=lambda r: (r["rank"] not in blamed, r["rank"] or 0)):
        c = r["collective"]
        coll = "".join((f", collective #{c['seq']}", f" {c['op']}" if c["op"] else "",
                        f" ({c['group']})" if c["group"] else "", " in progress" if c["active"] else "")) \
            if c.get("seq") else ""
        step = f"step {r['step']} ({_step_state(r)})" if r["step"] is not None else "no step yet"
        if r["ended"]:  # (how it ended says it all: no phase, no stall)
            detail = f" ({r['end_detail']})" if r["end_detail"] else ""
            state = f"ended {r['ended']}{detail}, {step}{coll}"
        else:
            state = f"{r['condition']}, {step}, phase {r['phase']}, no progress for {r['stalled_s']} s{coll}"
        lines.append(f"rank {r['rank']}{' [culprit]' if r['rank'] in blamed else ''}: {state}")
        for frame in r["stack"][:12]:
            lines.append(f"    {frame}")
        for worker in r.get("workers") or []:
            lines.append(f"  DataLoader worker {worker['pid']}: {worker['where']}")
    for a in report["job"]["attempts"]:
        detail = f" ({a['detail']})" if a.get("detail") else ""
        first = a.get("cause") or {}
        by = f", rank {first['rank']} first" if (a.get("world_size") or 1) > 1 and first else ""
        cut = f", step {a['interrupted_step']} interrupted" if a.get("interrupted_step") is not None else ""
        lines.append(f"attempt {a['attempt']}: ended {a['ended'] or 'not yet'}{detail}{by}, last step {a['last_step']}"
                     + cut + _checkpoint(a))
    return "\n".join(lines)


def _step_state(rank: dict[str, Any]) -> str:
    """``in progress``, ``raised`` or ``finished``: the state of the step a rank's line names."""
    if rank["in_step"]:
        return "in progress"
    return "raised" if rank.get("step_raised") else "finished"


def _checkpoint(attempt: dict) -> str:
    """Where an attempt that ended other than completed would be resumed from: its last
    checkpoint save (rank 0's), or none seen."""
    if attempt["ended"] in (None, "completed"):
        return ""
    saved = attempt.get("checkpoint_step")
    return f", last checkpoint at step {saved}" if saved is not None else ", no checkpoint saved that torchtrace saw"


def run(args: argparse.Namespace) -> int:
    if not Path(args.path).exists():
        raise ValueError(f"PATH={args.path!r} does not exist; give a run directory")
    report = why(args.path)
    if not report["ranks"]:
        raise ValueError(f"PATH={args.path!r} holds no black box (state.rank*.json, up to two folders down): "
                         "not a run directory, or a job that has not configured torchtrace yet")
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render(report))
    return 0


def add_subcommand(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("why", help="what happened to this job: verdict, culprit ranks, where each rank is",
                              description="Read a run directory's black boxes: the verdict (healthy, running, hang, "
                                          "died, completed, preempted, ended), the culprit ranks, each rank's step, "
                                          "phase and stack.")
    p.add_argument("path", help="a run directory (<run_dir>/<run_id>), or the run_dir holding several: its newest job")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.Namespace(path=sys.argv[1], json="--json" in sys.argv)))
