"""The job's attempts in the reports: a few lines for the terminal, a timeline for the HTML.

A run directory holds attempt 0's files and, after restarts with the same run id, later
attempts' in ``attempt-N/`` (:mod:`torchtrace.job.identity`). ``torchtrace report`` reads one
attempt (the directory it is given, never a merge of several) and names the others here.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from torchtrace.job.identity import ATTEMPT_PREFIX
from torchtrace.job.story import job_story

_COLOURS = {"completed": "#2e7d32", "preempted": "#f9a825", "killed": "#c62828", "exception": "#c62828",
            "hang": "#6a1b9a", "unknown": "#757575", None: "#1565c0"}


def job_of(run_dir: str | Path) -> tuple[dict[str, Any] | None, int]:
    """``(the job section, the attempt run_dir holds)`` for a run or attempt directory; the
    section is None where no black box was written (a run from before black boxes)."""
    path = Path(run_dir)
    attempt = 0
    if path.name.startswith(ATTEMPT_PREFIX) and path.name[len(ATTEMPT_PREFIX):].isdigit():
        attempt, path = int(path.name[len(ATTEMPT_PREFIX):]), path.parent
    story = job_story(path)
    return (story if story["attempts"] else None), attempt


def _ending(a: dict[str, Any]) -> str:
    if a.get("ended") is None:
        return f"running (step {a.get('last_step')})"
    text = f"{a['ended']} at step {a.get('last_step')}"
    cause = a.get("cause") or {}
    if (a.get("world_size") or 1) > 1 and cause:
        text += f" (rank {cause.get('rank')} first)"
    if a.get("ended") in ("killed", "exception", "unknown") and a.get("detail"):
        text += f": {a['detail']}"
    return text


def attempt_status(job: dict[str, Any] | None, attempt: int, finished: bool) -> str:
    """How the attempt a report shows stands, for the HTML report's header: its ending from the
    job's story when it ended otherwise than completed ("killed at step 40"), else "finished"
    when its report was written at shutdown, else "running (step N)" while its process lives.

    >>> attempt_status({"attempts": [{"attempt": 0, "ended": "killed", "last_step": 40}]}, 0, False)
    'killed at step 40'
    >>> attempt_status(None, 0, False)
    'not finished (no report.json)'
    """
    mine = next((a for a in (job or {}).get("attempts") or [] if a.get("attempt") == attempt), None)
    ended = mine.get("ended") if mine is not None else None
    if mine is not None and ended not in (None, "completed"):
        return f"{ended} at step {mine.get('last_step')}"
    if finished or ended == "completed":
        return "finished"
    if mine is not None:
        return f"running (step {mine.get('last_step')})"
    return "not finished (no report.json)"


def job_lines(job: dict[str, Any] | None, shown: int) -> list[str]:
    """The terminal report's job lines: nothing for a job of one attempt that completed."""
    if not job:
        return []
    attempts = job["attempts"]
    if len(attempts) == 1 and attempts[0].get("ended") in ("completed", None):
        return []
    lines = [f"  job {job.get('job_id')}: {len(attempts)} attempt(s); this report shows attempt {shown} only"]
    for a in attempts:
        where = "." if a["attempt"] == 0 else f"{ATTEMPT_PREFIX}{a['attempt']}/"
        lines.append(f"    attempt {a['attempt']} ({where}): {_ending(a)}")
    goodput = job.get("goodput")
    bad = {k: v for k, v in (job.get("badput") or {}).items() if v and v >= 0.05}
    lines.append("    job goodput " + (f"{goodput * 100:.1f} %" if goodput is not None else "-")
                 + ("; badput " + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(bad.items())) if bad else ""))
    return lines


def job_timeline_html(job: dict[str, Any] | None) -> str:
    """A card with one bar per attempt on the job's time axis, coloured by how it ended."""
    if not job or not job["attempts"]:
        return ""
    attempts = job["attempts"]
    t0 = attempts[0]["start"]
    t1 = max((a["end"] or a["configured"]) for a in attempts)
    span = max(t1 - t0, 1e-9)
    bars = []
    for a in attempts:
        end = a["end"] if a["end"] is not None else t1
        left, width = (a["start"] - t0) / span * 100, max(0.5, (end - a["start"]) / span * 100)
        colour = _COLOURS.get(a.get("ended"), _COLOURS["unknown"])
        label = escape(f"attempt {a['attempt']}: {_ending(a)}")
        bars.append(f"<div class=\"tt-attempt\" title=\"{label}\" style=\"position:absolute;left:{left:.2f}%;"
                    f"width:{width:.2f}%;top:4px;height:22px;background:{colour};border-radius:3px\"></div>")
        bars.append(f"<li><span style=\"color:{colour}\">■</span> {label}</li>")
    goodput = job.get("goodput")
    head = f"Job {escape(str(job.get('job_id')))}: {len(attempts)} attempt(s), goodput " + \
        (f"{goodput * 100:.1f} %" if goodput is not None else "-")
    track = "".join(b for b in bars if b.startswith("<div"))
    items = "".join(b for b in bars if b.startswith("<li"))
    return (f"<section class=\"card wide\" id=\"tt-job\"><h2>{head}</h2>"
            f"<div style=\"position:relative;height:30px;background:#eee;border-radius:3px\">{track}</div>"
            f"<ul class=\"muted\">{items}</ul></section>")
