"""What the demo says: the header, one line per event as it happens, the summary, what next.

Everything here reads torchtrace's own results (the step record, its forensic report, the
runtime's summary); nothing is computed twice. Each NaN story is told once: the narration
names what was non-finite and where the NaN came from, and :func:`told_by_narration` keeps
torchtrace's own log lines about the same thing (the forensics ERROR, the ``nonfinite_*``
WARNINGs) off the demo's console. Other log lines (``grad_explosion``, warnings about the
set-up) still show, whole.
"""

from __future__ import annotations

import logging
import math
import os
import re
import statistics
from typing import Any

from torchtrace import semconv
from torchtrace.cli.console import Console
from torchtrace.reporting.summary import throughput_rows
from torchtrace.reporting.terminal import sink_summary

MEASURED = {
    "off": "nothing: the steps run bare (level off): no spans, no step metrics and no step lines in the run report. "
           "The run directory gets the job's black box (state.json) and a report.json without steps",
    "basic": "the loss; the global and per-tensor gradient norms (one fused pass, one host read); NaN/Inf "
             "in the loss and gradients; step time; process memory",
}
MEASURED["advanced"] = (MEASURED["basic"] + "; per-parameter explosion/vanishing; parameter norms and "
                        "finiteness every 10 steps; the update-to-weight ratio every 50 steps; the leak detector")
MEASURED["extreme"] = MEASURED["advanced"] + "; per-layer activation statistics"
EVENT = "  >> "
# The anomaly kinds the NaN story tells (a NaN or Inf somewhere in the step).
NONFINITE_KINDS = frozenset({semconv.NONFINITE_LOSS, semconv.NONFINITE_GRAD, semconv.NONFINITE_PARAM,
                             semconv.NONFINITE_INPUT, semconv.NONFINITE_OUTPUT})
# torchtrace's anomaly log line: "step 50 train_step: nonfinite_loss: loss is nan".
_ANOMALY_LINE = re.compile(r"step \d+ \S+: (\w+): ")


def told_by_narration(record: logging.LogRecord) -> bool:
    """A logging filter for the demo's console: False for a record whose story the narration
    tells (the forensic replay's report, a non-finite anomaly), True for every other record.

    >>> rec = logging.LogRecord("torchtrace", logging.WARNING, "", 0, "step %s %s: %s: %s", (5, "train_step",
    ...                         "nonfinite_loss", "loss is nan"), None)
    >>> told_by_narration(rec)
    False
    """
    if record.name == "torchtrace.forensics":
        return False
    match = _ANOMALY_LINE.match(record.getMessage())
    return not (match and match.group(1) in NONFINITE_KINDS)


def _wrap(text: str, indent: str, width: int = 96) -> list[str]:
    words, lines, cur = text.split(), [], indent
    for w in words:
        if len(cur) + len(w) + 1 > width and cur.strip():
            lines.append(cur.rstrip())
            cur = indent
        cur += w + " "
    if cur.strip():
        lines.append(cur.rstrip())
    return lines


def _level(settings) -> str:
    return settings.level.value if hasattr(settings.level, "value") else str(settings.level)


def _what_each_step_makes(level: str, throughput: bool) -> str:
    if level == "off":
        return "measured every step: " + MEASURED["off"] + "."
    measured = MEASURED.get(level, MEASURED["basic"])
    if throughput:
        measured += ("; samples, FLOPs (counted once per input shape), learning rate, forward/backward/optimizer "
                     "time, the wait for data and goodput")
    return ("measured every step: " + measured
            + ". Each step is one span (spans.jsonl), Prometheus metrics and a line in the run report.")


def header(console: Console, steps: int, settings, faults, fault_text: dict[str, str],
           page: tuple[str, str | None] | None, result) -> None:
    """What runs, what is measured, what was planted, and where to watch it."""
    if settings is None:  # TORCHTRACE_DISABLED / OTEL_SDK_DISABLED
        console.line(f"torchtrace demo: {steps} training steps; torchtrace is disabled by the environment, "
                     "so nothing is measured")
        return
    level = _level(settings)
    console.line(f"torchtrace demo: {steps} training steps of an 85 k-parameter MLP on synthetic data, "
                 f"level {level}, guard {settings.guard}")
    for line in _wrap(_what_each_step_makes(level, getattr(settings, "throughput", True)), "  "):
        console.line(line)
    for f in sorted(faults, key=lambda f: f.step):
        console.line(f"  planted at step {f.step}: {f.kind} ({fault_text[f.kind]})")
    if page is not None:
        url, token = page
        console.line(f"  live page:  {url}")
        console.line(f"  token:      {token}   (for POST /debug/level/{{level}} and /debug/clear)" if token
                     else "  token:      the debug_token setting")
    if result.metrics_url:
        console.line(f"  metrics:    {result.metrics_url}")
    if result.run_dir:
        now = "state.json" if level == "off" else "spans.jsonl"
        console.line(f"  run files:  {os.path.abspath(result.run_dir)}/ ({now} now, report.json at the end)")
    console.line("")


def after_step(console: Console, i: int, record, state) -> None:
    """Announce what this step did that matters: a forensic report, a skipped update, recovery."""
    if record is None:
        return
    state.step_times.append(record.duration_s)
    loss = record.loss
    if loss is not None:
        state.losses.append(loss)
    report = record.forensics
    if report is not None:
        state.replays += 1
        kinds = [k for k in record.anomaly_kinds if k in NONFINITE_KINDS]
        for line in forensic_lines(report, kinds):
            console.line(line)
    if record.skipped:
        state.skipped += 1
        console.line(f"{EVENT}step {i}: update skipped (guard skip): the weights and AdamW's moments are as "
                     f"before the step")
    elif record.nonfinite and state.bad_since is None:
        console.line(f"{EVENT}step {i}: the non-finite update was applied (guard warn): the weights now hold NaN")
    if not record.nonfinite and loss is not None and math.isfinite(loss) and state.bad_since is None:
        state.last_good = (i, loss)
    if record.nonfinite:
        if state.bad_since is None:
            state.bad_since = i
    elif state.bad_since is not None and loss is not None and math.isfinite(loss):
        before = state.last_good
        then = f" (step {before[0]}, before the fault: {before[1]:.4f})" if before is not None else ""
        console.line(f"{EVENT}step {i}: training recovered: loss {loss:.4f}{then}; updates are applied again")
        state.events.append(f"recovered at step {i}")
        state.bad_since = None


def forensic_lines(report: dict[str, Any], kinds: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The forensic report in words: what was non-finite (``kinds``, the step's non-finite
    anomaly kinds), where the NaN came from, and how that was found.

    The first line is the story in short, never wrapped: the step, the kinds and the cause.
    The lines under it, indented, give the detail and how the replay worked.

    >>> forensic_lines({"step": 7, "cause": "loss", "replay_seconds": 0.01}, ["nonfinite_loss"])[0]
    '  >> step 7: NaN found (nonfinite_loss). Forensic replay: born in the loss computation, outside any module.'
    """
    step, cause = report.get("step"), report.get("cause")
    module, mtype = report.get("module"), report.get("module_type")
    name = f"`{module}` ({mtype})" if mtype else f"`{module}`"
    out = report.get("outputs") or {}
    ins = report.get("inputs") or {}
    bad_out = (out.get("nan_count") or 0) + (out.get("inf_count") or 0)
    bad_in = (ins.get("nan_count") or 0) + (ins.get("inf_count") or 0)
    detail = ""
    if cause == "forward":
        what = f"born in layer {name}"
        detail = f"its input was finite, its output held {bad_out} NaN/Inf value(s)"
    elif cause == "input":
        what = f"it came in with the input batch ({bad_in} NaN/Inf value(s)), before any layer ran"
        detail = "a data problem"
    elif cause == "loss":
        what = "born in the loss computation, outside any module"
    elif cause == "backward":
        op = f", backward op {report['op']}" if report.get("op") else ""
        what = f"born in the backward pass of {name}{op}"
    elif cause == "parameter":
        what = f"a parameter was already non-finite: {', '.join(report.get('nonfinite_params') or [])}"
    else:
        what = "the replay could not localise it"
    ms = 1000 * float(report.get("replay_seconds") or 0.0)
    flagged = f" ({', '.join(sorted(kinds))})" if kinds else ""
    indent = " " * len(EVENT)
    lines = [f"{EVENT}step {step}: NaN found{flagged}. Forensic replay: {what}" + (":" if detail else ".")]
    if detail:
        lines += _wrap(detail + ".", indent)
    return lines + _wrap(f"(The step was run again on the same batch and random state, under hooks on every "
                         f"module, in {ms:.0f} ms; the training result is unchanged.)", indent)


def stopped(console: Console, i: int, why: str) -> None:
    console.line(f"{EVENT}step {i}: {why}")


def summary(console: Console, summary: dict[str, Any], state, settings, steps: int) -> None:
    """The run in a few rows; anomaly kinds on their own row, not under another figure. At
    level off only what the demo counted itself: torchtrace measured nothing."""
    finite = [v for v in state.losses if math.isfinite(v)]
    loss = ("loss", f"{finite[0]:.4f} first, {finite[-1]:.4f} last finite" if finite else "-")
    if settings is not None and _level(settings) == "off":
        rows = [("steps", f"{state.ran} of {steps}, run bare (level off: torchtrace measured none of them)"), loss]
    else:
        rows = _measured_rows(summary, state, steps, loss)
    width = max(len(k) for k, _ in rows)
    console.line("")
    console.line("summary")
    for key, value in rows:
        console.line(f"  {key.ljust(width)}  {value}")


def _measured_rows(summary: dict[str, Any], state, steps: int, loss: tuple[str, str]) -> list[tuple[str, str]]:
    totals = summary.get("totals", {})
    median_ms = 1000 * statistics.median(state.step_times) if state.step_times else 0.0
    kinds = summary.get("anomalies_by_kind", {})
    forensics = summary.get("forensics") or {}
    return [
        ("steps", f"{totals.get('steps', 0)} of {steps}, median {median_ms:.1f} ms per step"
                  + (f"; stopped at step {state.stopped_at}" if state.stopped_at is not None else "")),
        loss,
        ("anomalous steps", str(totals.get("anomaly_steps", 0))),
        ("anomalies by kind", ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "none"),
        ("non-finite steps", str(totals.get("nonfinite_steps", 0))),
        ("forensic replays", f"{forensics.get('replays', state.replays)} (budget {forensics.get('budget', '-')})"),
        ("skipped updates", str(totals.get("skipped_steps", 0))),
        ("spans", sink_summary(summary.get("telemetry") or {})),
        *throughput_rows(summary.get("throughput") or {}),
    ]


def next_steps(console: Console, run_path, command: str, page: tuple[str, str | None] | None) -> None:
    """Where to look next: the HTML report's command and the live page."""
    console.line("")
    console.line("where to look next")
    if run_path is not None:
        console.line(f"  HTML report:  {command} report {os.path.abspath(run_path)} --html report.html")
    if page is not None:
        console.line(f"  live page:    {page[0]} (up while the demo runs; --hold SECONDS keeps it after training)")
