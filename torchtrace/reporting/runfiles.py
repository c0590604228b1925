"""Reading a finished run's directory (``report.json`` and ``spans.jsonl``) for the reports.

Steps come from the spans file when there is one (it holds every step, the report only the
last ``history_size``); anomalies come from the spans' anomaly events, joined with the
report's timeline for their data. A forensic replay is told of up to three times (the
report's ``forensics`` section, its timeline, and the step span's ``torchtrace.forensics``
event); :attr:`RunData.forensics` holds it once, and the timeline holds one event per replay.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtrace import semconv
from torchtrace.files import from_strict
from torchtrace.job.identity import ATTEMPT_PREFIX
from torchtrace.reporting.summary import operation_counts, step_totals, training_summary_from_steps

MAX_CHART_STEPS = 5000
"""Steps embedded in the HTML report at most: longer runs are thinned evenly, anomalous steps kept."""


@dataclass
class RunData:
    """What the reports show about one run (one rank)."""

    run_dir: Path
    report: dict[str, Any] | None
    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    total_steps: int = 0
    problems: list[str] = field(default_factory=list)
    from_spans: bool = False  # the steps were read from the spans file (every step), not the report's last ones
    black_box: dict[str, Any] | None = None  # the rank's state.json (the job's black box), when readable

    @property
    def finished(self) -> bool:
        """The run's report was written at shutdown (``finished_unix``)."""
        return "finished_unix" in (self.report or {})

    @property
    def summary(self) -> dict[str, Any]:
        """The report's summary, its step counts (``totals``, ``operations``,
        ``anomalies_by_kind``) counted from the steps read when they come from the spans file:
        every figure of a report then counts the same steps (report.json's own counts restart
        at a ``POST /debug/clear``; :attr:`notes` says so)."""
        if self.report is None:
            out: dict[str, Any] = {"run_id": self.run_dir.name}
        else:
            out = {k: v for k, v in self.report.items() if k not in ("steps", "events", "settings")}
        if self.from_spans or self.report is None:
            found = out.get("totals")
            out["totals"] = {**(found if isinstance(found, dict) else {}), **step_totals(self.steps)}
            out["operations"] = operation_counts(self.steps)
            out["anomalies_by_kind"] = training_summary_from_steps(self.steps)["anomalies_by_kind"]
        if "throughput" not in out:
            ledger = black_box_goodput(self.black_box)
            if ledger is not None:
                out["throughput"] = ledger
        return out

    @property
    def notes(self) -> list[str]:
        """What the reader should know about where the counts come from: report.json counting
        other steps than the spans file (a cleared history, dropped spans)."""
        note = _count_note(self)
        return [note] if note else []

    @property
    def settings(self) -> dict[str, Any] | None:
        return (self.report or {}).get("settings")

    @property
    def forensics(self) -> list[dict[str, Any]]:
        """One forensic report per replayed step, in time order."""
        return [e["data"] for e in self.events if e.get("type") == "forensics"]




def _rank_file(run_dir: Path, stem: str, suffix: str, rank: int | None) -> Path | None:
    if rank is None:
        plain = run_dir / f"{stem}{suffix}"
        if plain.exists():
            return plain
        ranked = sorted(run_dir.glob(f"{stem}.rank*{suffix}"))
        return ranked[0] if ranked else None
    for name in (f"{stem}.rank{rank}{suffix}",) + ((f"{stem}{suffix}",) if rank == 0 else ()):
        if (run_dir / name).exists():
            return run_dir / name
    return None


def _step_from_span(span: dict[str, Any]) -> dict[str, Any] | None:
    attrs = span.get("attributes") or {}
    if semconv.STEP not in attrs:
        return None
    start, end = span.get("start_unix_ns") or 0, span.get("end_unix_ns") or 0
    memory: dict[str, Any] = {}
    if attrs.get(semconv.MEMORY_RSS_BYTES) is not None:
        memory["rss_bytes"] = attrs[semconv.MEMORY_RSS_BYTES]
    if attrs.get(semconv.MEMORY_CUDA_ALLOCATED_BYTES) is not None:
        memory["cuda_allocated_bytes"] = attrs[semconv.MEMORY_CUDA_ALLOCATED_BYTES]
    anomalies = []
    for event in span.get("events") or []:
        if event.get("name") == semconv.EVENT_ANOMALY:
            ea = event.get("attributes") or {}
            anomalies.append({"kind": ea.get(semconv.EVENT_ANOMALY_KIND),
                              "detail": ea.get(semconv.EVENT_ANOMALY_DETAIL),
                              "time_unix_ns": event.get("time_unix_ns")})
    forensics = [_forensic_from_event(e) for e in span.get("events") or [] if e.get("name") == semconv.EVENT_FORENSICS]
    return {
        "operation": attrs.get(semconv.OPERATION, span.get("name")),
        "kind": attrs.get(semconv.OPERATION_KIND, "train"),
        "step": attrs.get(semconv.STEP),
        "start_unix_ns": start,
        "duration_s": (end - start) / 1e9 if end and start else None,
        "loss": from_strict(attrs.get(semconv.LOSS)),
        "grad_norm": from_strict(attrs.get(semconv.GRAD_NORM)),
        "memory": memory,
        "samples": attrs.get(semconv.SAMPLES),
        "tokens": attrs.get(semconv.TOKENS),
        "data_wait_s": from_strict(attrs.get(semconv.DATA_WAIT_S)),
        "anomalies": [a["kind"] for a in anomalies],
        "skipped": bool(attrs.get(semconv.STEP_SKIPPED, False)),
        "scaler_overflow": bool(attrs.get(semconv.STEP_SCALER_OVERFLOW, False)),
        "failed": any(e.get("name") == "exception" for e in span.get("events") or []),
        "_anomaly_events": anomalies,
        "_forensics": forensics,
        "trace_id": span.get("trace_id"),
        "status": span.get("status"),
    }


def _forensic_from_event(event: dict[str, Any]) -> dict[str, Any]:
    """A span's forensics event back into the report dict it was flattened from."""
    report: dict[str, Any] = {}
    for name, value in (event.get("attributes") or {}).items():
        key = name[len(semconv.FORENSICS_PREFIX):] if name.startswith(semconv.FORENSICS_PREFIX) else name
        if isinstance(value, str) and value[:1] in "[{":
            try:
                value = json.loads(value)
            except ValueError:
                pass  # capped JSON: keep the text
        report[key] = value
    report["_time_unix_ns"] = event.get("time_unix_ns")
    return report


def _forensic_key(report: dict[str, Any]) -> tuple[Any, Any]:
    return report.get("operation"), report.get("step")


def load_run(run_dir: str | Path, rank: int | None = None) -> RunData:
    """Read a run directory. Missing or damaged files are noted in ``problems``, not raised.

    Raises:
        FileNotFoundError: the directory holds neither a report nor a spans file.
    """
    path = Path(run_dir)
    report_file = _rank_file(path, "report", ".json", rank)
    spans_file = _rank_file(path, "spans", ".jsonl", rank)
    if report_file is None and spans_file is None:
        raise FileNotFoundError(f"{path}: no report.json or spans.jsonl (is this a torchtrace run directory?)")
    data = RunData(path, None)
    if report_file is not None:
        try:
            data.report = json.loads(report_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            data.problems.append(f"{report_file.name}: unreadable ({type(exc).__name__})")
    if spans_file is not None:
        bad = 0
        with open(spans_file, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    step = _step_from_span(json.loads(line))
                except ValueError:
                    bad += 1
                    continue
                if step is not None:
                    data.steps.append(step)
        if bad:
            data.problems.append(f"{spans_file.name}: {bad} unreadable line(s) skipped")
        data.steps.sort(key=lambda s: s["start_unix_ns"])
        data.from_spans = True
    elif data.report is not None:
        data.steps = [dict(s) for s in data.report.get("steps", [])]
    data.total_steps = len(data.steps)
    data.black_box = _read_black_box(path, rank)
    data.events = _events(data)
    return data


def _read_black_box(path: Path, rank: int | None) -> dict[str, Any] | None:
    """The rank's black box (``state.json``, ``state.rankN.json``), or None."""
    found = _rank_file(path, "state", ".json", rank)
    if found is None:
        return None
    try:
        state = json.loads(found.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _events(data: RunData) -> list[dict[str, Any]]:
    """The timeline: the report's events, plus anomaly and forensic events only the spans hold.

    Forensic reports are kept once per (operation, step), the report's own copy first.
    """
    report = data.report or {}
    report_events = list(report.get("events", []))
    seen = {(e.get("data", {}).get("step"), e.get("data", {}).get("operation"), e.get("data", {}).get("kind"))
            for e in report_events if e.get("type") == "anomaly"}
    replayed = {_forensic_key(e.get("data") or {}) for e in report_events if e.get("type") == "forensics"}
    extra: list[dict[str, Any]] = []
    for f in (report.get("forensics") or {}).get("reports") or []:  # older than the timeline's window
        if _forensic_key(f) not in replayed:
            replayed.add(_forensic_key(f))
            extra.append({"seq": None, "timestamp": _step_time(data, f), "type": "forensics",
                          "message": "forensic report", "data": f})
    for s in data.steps:
        for a in s.pop("_anomaly_events", []):
            key = (s["step"], s["operation"], a["kind"])
            if key in seen:
                continue
            seen.add(key)
            extra.append({"seq": None, "timestamp": (a.get("time_unix_ns") or s["start_unix_ns"]) / 1e9,
                          "type": "anomaly", "message": a.get("detail") or "",
                          "data": {"kind": a["kind"], "detail": a.get("detail"), "step": s["step"],
                                   "operation": s["operation"]}})
        for f in s.pop("_forensics", []):
            when = f.pop("_time_unix_ns", None) or s["start_unix_ns"]
            f.setdefault("step", s["step"])
            f.setdefault("operation", s["operation"])
            if _forensic_key(f) in replayed:
                continue
            replayed.add(_forensic_key(f))
            extra.append({"seq": None, "timestamp": when / 1e9, "type": "forensics",
                          "message": "forensic report", "data": f})
    events = extra + report_events
    events.sort(key=lambda e: e.get("timestamp") or 0)
    return events


def black_box_goodput(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """A run without a report (killed, or still running): the goodput ledger its black box
    holds (``wall_s``, ``productive_s``, ``badput_s``, refreshed at each write), as the
    report's ``throughput`` section would give it, and ``counted`` saying up to when.

    >>> black_box_goodput({"wall_s": 4.0, "productive_s": 1.0, "badput_s": {"startup": 3.0}, "time": 0})["counted"]
    "up to the black box's last write (state.json, 1970-01-01 00:00:00 UTC): the run wrote no report"
    """
    if not state:
        return None
    wall, productive, badput = state.get("wall_s"), state.get("productive_s"), state.get("badput_s")
    if not isinstance(wall, (int, float)) or not isinstance(productive, (int, float)) or not isinstance(badput, dict):
        return None
    written = state.get("time")
    when = (time.strftime(", %Y-%m-%d %H:%M:%S UTC", time.gmtime(written))
            if isinstance(written, (int, float)) else "")
    return {"wall_s": wall, "productive_s": productive, "badput_s": badput,
            "goodput_ratio": productive / wall if wall > 0 else None,
            "counted": f"up to the black box's last write (state.json{when}): the run wrote no report"}


def _count_note(data: RunData) -> str | None:
    """A sentence when report.json counted a different number of steps than the spans file
    holds: after ``POST /debug/clear`` its totals and timeline start at the clear (the spans
    file keeps every step); with spans dropped the file holds fewer."""
    totals = (data.report or {}).get("totals")
    counted = totals.get("steps") if isinstance(totals, dict) else None
    held = len(data.steps)
    if not data.from_spans or not isinstance(counted, int) or counted == held:
        return None
    if counted > held:
        return (f"report.json counts {counted} steps, spans.jsonl holds {held} (spans dropped: see telemetry); "
                "this report counts the steps in spans.jsonl")
    cleared = [e for e in data.events if e.get("type") == "history_cleared"]
    when = cleared[-1].get("timestamp") if cleared else None
    first = next((s for s in data.steps if isinstance(when, (int, float)) and s["start_unix_ns"] / 1e9 >= when), None)
    where = f" before step {first['step']} of {first['operation']}" if first is not None else ""
    return (f"the debug history was cleared (POST /debug/clear){where}: report.json's totals and timeline count "
            f"from there ({counted} steps); this report counts all {held} steps in spans.jsonl")


def _step_time(data: RunData, report: dict[str, Any]) -> float:
    for s in data.steps:
        if (s.get("operation"), s.get("step")) == _forensic_key(report):
            return s["start_unix_ns"] / 1e9
    return 0.0


def chart_steps(steps: list[dict[str, Any]], limit: int = MAX_CHART_STEPS) -> list[dict[str, Any]]:
    """At most ``limit`` steps (and the kept ones below), evenly thinned, always keeping the
    anomalous ones and each operation's last (the report's "last loss" and "last grad norm"
    read the charted operation's last step: thinned without it, a run of 6000 steps said its
    last loss was step 5998's)."""
    if len(steps) <= limit:
        return steps
    stride = len(steps) / limit
    last_of = {s.get("operation"): i for i, s in enumerate(steps)}
    keep = {int(i * stride) for i in range(limit - len(last_of))} | set(last_of.values())
    return [s for i, s in enumerate(steps) if i in keep or s.get("anomalies")]


def is_run_dir(path: Path) -> bool:
    """True when ``path`` holds a run's report or spans file (any rank's)."""
    return path.is_dir() and (_rank_file(path, "report", ".json", None) is not None
                              or _rank_file(path, "spans", ".jsonl", None) is not None)


@dataclass(frozen=True)
class RunListing:
    """One run found in a folder of runs, for ``torchtrace report FOLDER``."""

    path: Path
    started_unix: float  # from its report; without one, its spans file's last change
    steps: int | None  # None: no readable report (still running, or ended without shutdown)
    anomaly_steps: int | None
    finished: bool
    cleared: bool = False  # report.json's counts start at a POST /debug/clear


def find_runs(folder: Path, depth: int = 2) -> list[RunListing]:
    """The run directories inside ``folder``, up to ``depth`` levels down (``run_dir/<run_id>``,
    and a job's ``<job>/<attempt>``), and in each run directory its job's later attempts
    (``<run_id>/attempt-N``), oldest first.

    >>> find_runs(Path("/nonexistent"))
    []
    """
    found: list[RunListing] = []
    try:
        children = sorted(p for p in folder.iterdir() if p.is_dir())
    except OSError:
        return found
    for child in children:
        if is_run_dir(child):
            found.append(_listing(child))
            # A restarted job's later attempts lie inside its run directory (attempt-N/).
            found.extend(_listing(a) for a in sorted(child.glob(f"{ATTEMPT_PREFIX}*")) if is_run_dir(a))
        elif depth > 1:
            found.extend(find_runs(child, depth - 1))
    return sorted(found, key=lambda run: (run.started_unix, str(run.path)))


def _listing(path: Path) -> RunListing:
    report_file = _rank_file(path, "report", ".json", None)
    report: dict[str, Any] = {}
    if report_file is not None:
        try:
            report = json.loads(report_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            report = {}
    found = report.get("totals")
    totals: dict[str, Any] = found if isinstance(found, dict) else {}
    started = report.get("started_unix")
    if not isinstance(started, (int, float)):
        newest = report_file or _rank_file(path, "spans", ".jsonl", None)
        started = newest.stat().st_mtime if newest is not None else 0.0
    steps = totals.get("steps")
    return RunListing(path, float(started), steps if isinstance(steps, int) else None,
                      totals.get("anomaly_steps") if isinstance(totals.get("anomaly_steps"), int) else None,
                      "finished_unix" in report, _cleared(report))


def _cleared(report: dict[str, Any]) -> bool:
    """The report's timeline begins with a clear of the history: its counts start there."""
    return any(isinstance(e, dict) and e.get("type") == "history_cleared" for e in report.get("events") or [])
