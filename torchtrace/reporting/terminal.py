"""``torchtrace report RUN_DIR``: a plain-text summary of a finished run for the terminal."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from torchtrace.reporting.forensic_text import forensic_cause
from torchtrace.reporting.jobview import job_lines, job_of
from torchtrace.reporting.runfiles import load_run
from torchtrace.reporting.summary import (
    finite,
    main_operation,
    seconds_text,
    throughput_rows,
    training_summary_from_steps,
)

_BARS = "▁▂▃▄▅▆▇█"
MAX_ANOMALY_LINES = 20


def sparkline(values: list[float | None], width: int = 48) -> str:
    """Unicode bars for ``values`` (resampled to ``width``); non-finite values show as ``!``.

    >>> sparkline([0.0, 1.0, float("nan")], width=3)
    '▁█!'
    """
    if not values:
        return ""
    if len(values) > width:
        values = [values[int(i * len(values) / width)] for i in range(width)]
    ok = finite(values)
    lo, hi = (min(ok), max(ok)) if ok else (0.0, 1.0)
    span = (hi - lo) or 1.0
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        elif not math.isfinite(v):
            out.append("!")
        else:
            out.append(_BARS[min(len(_BARS) - 1, int((v - lo) / span * (len(_BARS) - 1) + 0.5))])
    return "".join(out)


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.4g}"
    return str(v)


def _mib(v: object) -> str:
    return f"{v / 2**20:.1f} MiB" if isinstance(v, (int, float)) else "-"


def forensic_sentence(report: dict[str, Any]) -> str:
    """One forensic report in a line: its step and operation, then :func:`forensic_cause`.

    >>> forensic_sentence({"step": 7, "operation": "train_step", "cause": "forward", "module": "norm",
    ...                    "module_type": "InputNorm", "outputs": {"nan_count": 64, "inf_count": 0}})
    'step 7 train_step: forward: born in norm (InputNorm); input finite, output 64 NaN/Inf'
    """
    return f"step {report.get('step')} {report.get('operation')}: {forensic_cause(report)}"


def _forensic_lines(reports: list[dict[str, Any]]) -> list[str]:
    if not reports:
        return []
    lines = [f"  forensic reports: {len(reports)} (one per replayed step; the HTML report has them in full)"]
    lines += [f"    {forensic_sentence(r)}" for r in reports[:MAX_ANOMALY_LINES]]
    if len(reports) > MAX_ANOMALY_LINES:
        lines.append(f"    ... {len(reports) - MAX_ANOMALY_LINES} more")
    return lines


def terminal_report(run_dir: str | Path, rank: int | None = None) -> str:
    """The run's summary as text: totals, series with sparklines, anomalies, telemetry health.

    Raises:
        FileNotFoundError: ``run_dir`` is not a torchtrace run directory.
    """
    run = load_run(run_dir, rank)
    summary = run.summary
    lines = _header_lines(summary, run.steps, run.run_dir)
    lines += [f"  note: {note}" for note in run.notes]
    lines += job_lines(*job_of(run.run_dir))
    label, shown = _main_steps(run.steps)
    lines += _step_time_lines(shown, label)
    lines += _series_lines(shown, label)
    lines += _memory_lines(run.steps)
    lines += [f"  {label}: {text}" for label, text in throughput_rows(summary.get("throughput") or {})]
    lines += _anomaly_lines(run.steps, run.events)
    lines.extend(_forensic_lines(run.forensics))
    lines += _telemetry_lines(summary.get("telemetry") or {})
    for problem in run.problems:
        lines.append(f"  warning: {problem}")
    lines.append(f"  files: {run.run_dir}")
    return "\n".join(lines) + "\n"


def _header_lines(s: dict[str, Any], steps: list[dict[str, Any]], run_dir: Path) -> list[str]:
    """The run's identity, its step count and wall time."""
    lines = [f"torchtrace run {s.get('run_id', run_dir.name)}"
             f"  service {s.get('service_name', '?')}  rank {s.get('rank', 0)}/{s.get('world_size', 1)}"
             f"  level {s.get('level', '?')}"]
    ops = s.get("operations") or {}
    wall = None
    if steps and steps[-1].get("duration_s") is not None:
        wall = (steps[-1]["start_unix_ns"] - steps[0]["start_unix_ns"]) / 1e9 + steps[-1]["duration_s"]
    lines.append(f"  steps: {len(steps)}"
                 + (f" ({', '.join(f'{k} {v}' for k, v in sorted(ops.items()))})" if ops else "")
                 + (f" over {seconds_text(wall)}" if wall is not None else ""))
    return lines


def _main_steps(steps: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """The steps of the main operation (:func:`main_operation`), and the label suffix that names
    it (empty when the run has one operation): evaluation losses and a checkpoint's time are not
    training's."""
    main = main_operation(steps)
    if len({st.get("operation") for st in steps}) <= 1:
        return "", steps
    return f" {main}", [st for st in steps if st.get("operation") == main]


def _step_time_lines(steps: list[dict[str, Any]], label: str) -> list[str]:
    """The step-time median, p95 and max of ``steps``."""
    durations = finite([st.get("duration_s") for st in steps])
    if not durations:
        return []
    q = sorted(durations)
    p95 = q[min(len(q) - 1, int(0.95 * len(q)))]
    return [f"  step time{label}: median {statistics.median(q) * 1e3:.2f} ms, p95 {p95 * 1e3:.2f} ms, "
            f"max {q[-1] * 1e3:.2f} ms"]


def _series_lines(steps: list[dict[str, Any]], label: str = "") -> list[str]:
    """Loss and gradient norm (first, last, range, non-finite count, sparkline)."""
    lines: list[str] = []
    for name, key in (("loss", "loss"), ("grad norm", "grad_norm")):
        series = [st.get(key) for st in steps]
        ok = finite(series)
        if not ok and not any(v is not None for v in series):
            continue
        bad = sum(1 for v in series if v is not None and not math.isfinite(v))
        first = next((v for v in series if v is not None), None)
        last = next((v for v in reversed(series) if v is not None), None)
        text = f"  {name}{label}: first {_fmt(first)}, last {_fmt(last)}"
        if ok:
            text += f", min {_fmt(min(ok))}, max {_fmt(max(ok))}"
        if bad:
            text += f", non-finite at {bad} step(s)"
        lines.append(text)
        lines.append(f"    {sparkline(series)}")
    return lines


def _memory_lines(steps: list[dict[str, Any]]) -> list[str]:
    """The process's RSS over every step, whatever its operation."""
    rss_ok = finite([st.get("memory", {}).get("rss_bytes") for st in steps])
    if not rss_ok:
        return []
    return [f"  memory (rss): first {_mib(rss_ok[0])}, last {_mib(rss_ok[-1])}, max {_mib(max(rss_ok))}"]


def _anomaly_lines(steps: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[str]:
    """The anomaly totals by kind, the updates skipped (by the guard, by the loss scaler), and the
    first anomaly events."""
    tr = training_summary_from_steps(steps)
    lines = [f"  anomalies: {tr['anomaly_steps']} step(s), rate {tr['anomaly_rate'] * 100:.2f} %"
             + (": " + ", ".join(f"{k} {v}" for k, v in sorted(tr["anomalies_by_kind"].items()))
                if tr["anomalies_by_kind"] else "")]
    for key, label in (("skipped", "skipped updates"), ("scaler_overflow", "skipped by the loss scaler")):
        numbers = [st.get("step") for st in steps if st.get(key)]
        if numbers:
            shown = (", ".join(str(x) for x in numbers[:MAX_ANOMALY_LINES])
                     + (" ..." if len(numbers) > MAX_ANOMALY_LINES else ""))
            lines.append(f"  {label}: {len(numbers)} (step {shown})")
    anomaly_events = [e for e in events if e.get("type") == "anomaly"]
    for e in anomaly_events[:MAX_ANOMALY_LINES]:
        d = e.get("data") or {}
        detail = d.get("detail") or e.get("message")
        lines.append(f"    step {d.get('step')} {d.get('operation')}: {d.get('kind')}: {detail}")
    if len(anomaly_events) > MAX_ANOMALY_LINES:
        lines.append(f"    ... {len(anomaly_events) - MAX_ANOMALY_LINES} more")
    return lines


def sink_summary(tel: dict[str, Any]) -> str:
    """Spans exported and dropped per sink ("file: 50 exported; otlp_grpc: 0 exported, 50 dropped
    (export_failed 10, shutdown 40)"): a sum over the sinks would count each span once per sink.
    Reports without per-sink books give the totals."""
    sinks = tel.get("span_exporters")
    if not sinks:
        dropped = sum((tel.get("spans_dropped") or {}).values())
        return f"{tel.get('spans_exported', 0)} spans exported, {dropped} dropped"
    parts = []
    for sink in sinks:
        by_reason = sink.get("dropped") or {}
        text = f"{sink.get('exporter')}: {sink.get('exported', 0)} exported"
        if by_reason:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items()))
            text += f", {sum(by_reason.values())} dropped ({reasons})"
        parts.append(text)
    return "; ".join(parts)


def _telemetry_lines(tel: dict[str, Any]) -> list[str]:
    """Spans exported and dropped per sink, and torchtrace's own errors; nothing without telemetry."""
    if not tel:
        return []
    errors = tel.get("internal_errors") or {}
    return [f"  telemetry: spans {sink_summary(tel)}; internal errors "
            + (", ".join(f"{k} {v}" for k, v in sorted(errors.items())) if errors else "none")]
