"""Training-monitor numbers (steps, anomaly rates by kind) from a list of step summaries."""

from __future__ import annotations

import collections
import math
from typing import Any

from torchtrace import semconv
from torchtrace.files import from_strict

_LOSS_KINDS = frozenset({"nonfinite_loss", "loss_spike"})
_NONFINITE_KINDS = semconv.NONFINITE_KINDS


def training_summary_from_steps(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps, anomalous steps and per-step rates by anomaly kind, from step summaries.

    >>> training_summary_from_steps([{"anomalies": []}, {"anomalies": ["loss_spike"]}])["anomaly_rate"]
    0.5
    """
    n = len(steps)
    by_kind: collections.Counter[str] = collections.Counter()
    anomalous = 0
    for s in steps:
        kinds = set(s.get("anomalies") or [])
        anomalous += bool(kinds)
        by_kind.update(kinds)

    def rate(count: int) -> float:
        return count / n if n else 0.0

    return {
        "source": "steps",
        "total_steps": n,
        "anomaly_steps": anomalous,
        "anomaly_rate": rate(anomalous),
        "anomalies_by_kind": dict(by_kind),
        "rates_by_kind": {k: rate(v) for k, v in sorted(by_kind.items())},
        "loss_anomaly_rate": rate(sum(1 for s in steps if _LOSS_KINDS & set(s.get("anomalies") or []))),
        "explosion_rate": rate(by_kind.get("grad_explosion", 0)),
        "vanishing_rate": rate(by_kind.get("grad_vanishing", 0)),
    }


def step_totals(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's ``totals`` counted from step summaries: steps, anomalous, non-finite, skipped
    (by the guard, by the loss scaler) and failed steps, as the run's history counts them.

    >>> step_totals([{"anomalies": ["nonfinite_loss"], "skipped": True}, {"anomalies": []}])["skipped_steps"]
    1
    """
    return {
        "steps": len(steps),
        "anomaly_steps": sum(1 for s in steps if s.get("anomalies")),
        "nonfinite_steps": sum(1 for s in steps if _NONFINITE_KINDS & set(s.get("anomalies") or [])),
        "skipped_steps": sum(1 for s in steps if s.get("skipped")),
        "scaler_overflow_steps": sum(1 for s in steps if s.get("scaler_overflow")),
        "failed_steps": sum(1 for s in steps if s.get("failed")),
    }


def operation_counts(steps: list[dict[str, Any]]) -> dict[str, int]:
    """Steps by operation, as the report's ``operations`` section counts them."""
    return dict(collections.Counter(str(s.get("operation")) for s in steps))


def main_operation(steps: list[dict[str, Any]]) -> str | None:
    """The operation the charts and the step-time and loss lines show: of the steps of kind
    ``train`` (a step without a kind, from older files, is one), the operation with the most
    steps, a tie going to the one seen first; with no training step, the operation with the
    most steps. The live page's ``ttMainOperation`` is the same rule.

    >>> main_operation([{"operation": "train_step"}] * 3 + [{"operation": "eval_step", "kind": "evaluation"}] * 5)
    'train_step'
    """
    # A step without an operation counts under None, as it always has.
    counts: collections.Counter[str | None] = collections.Counter()
    for s in steps:
        if s.get("kind", "train") == "train":
            counts[s.get("operation")] += 1
    if not counts:
        counts.update(s.get("operation") for s in steps)
    best = max(counts.values(), default=0)
    return next((op for op in counts if counts[op] == best), None)


def finite(values: list[Any]) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


MAX_OPERATION_ROWS = 8  # operations named in the throughput rows


def throughput_rows(section: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's throughput section in words: each operation's rates over its last window
    (labelled ``throughput``, or ``throughput OPERATION`` when there are several), then where
    the wall time went (``goodput``).

    >>> throughput_rows({"operations": {"train_step": {"steps": 20, "samples_per_s": 640.0, "mfu": 0.41}},
    ...                  "goodput_ratio": 0.9, "badput_s": {"data_wait": 1.5, "startup": 0.05}})
    [('throughput', '640 samples/s, MFU 41.0%, over the last 20 steps'), ('goodput', '90% of wall time in applied updates; the rest: data_wait 1.50 s, startup 50 ms')]
    """  # noqa: E501 - a doctest's expected output is one line
    rows = []
    ops = section.get("operations") or {}
    for name, op in sorted(ops.items())[:MAX_OPERATION_ROWS]:
        tokens, samples, flops, mfu = (from_strict(op.get(k))
                                       for k in ("tokens_per_s", "samples_per_s", "flops_per_s", "mfu"))
        parts = []
        if tokens is not None:
            parts.append(_shown(tokens, "{:,.0f}") + " tokens/s")
        if samples is not None:
            parts.append(_shown(samples, "{:,.0f}") + " samples/s")
        elif tokens is None:
            parts.append("no samples/s (no batch in the step's arguments or its model's call: give inputs= "
                         "or record_batch(samples=...))")
        if flops:
            parts.append(flops_text(flops) if math.isfinite(flops) else f"{_shown(flops, '')} FLOP/s")
        if mfu is not None:
            parts.append("MFU " + _shown(mfu, "{:.1%}"))
        elif not flops:
            parts.append("no MFU (no FLOPs: none counted or given for this operation)")
        else:
            parts.append("no MFU (this device's peak is unknown: set peak_flops)")
        rows.append(("throughput" if len(ops) == 1 else f"throughput {name}",
                     f"{', '.join(parts)}, over the last {op.get('steps', 0)} steps"))
    ratio = from_strict(section.get("goodput_ratio"))
    if ratio is not None:
        lost = _badput_text(section.get("badput_s") or {})
        counted = f" ({section['counted']})" if section.get("counted") else ""
        rows.append(("goodput",
                     f"{_shown(ratio, '{:.0%}')} of wall time in applied updates; the rest: {lost}{counted}"))
    return rows


def _badput_text(badput_s: dict[str, Any]) -> str:
    """The badput kinds above zero, largest first: ``data_wait 1.50 s, startup 50 ms`` (or "none")."""
    figures = ((from_strict(v), k) for k, v in badput_s.items())
    badput = sorted(((v, k) for v, k in figures if v is not None and not v <= 0),  # (a NaN is shown, last)
                    key=lambda p: (-math.inf if math.isnan(p[0]) else p[0], p[1]), reverse=True)
    return ", ".join(f"{k} {seconds_text(v) if math.isfinite(v) else _shown(v, '')}" for v, k in badput) or "none"




def _shown(value: float, spec: str) -> str:
    """``value`` formatted by ``spec``; a non-finite one by its strict-JSON name (Infinity, NaN)."""
    if math.isfinite(value):
        return spec.format(value)
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def seconds_text(value: float) -> str:
    """Seconds for a reader: ``1.50 s``, ``50 ms`` below a tenth of a second.

    >>> seconds_text(1.5), seconds_text(0.04), seconds_text(0.0004)
    ('1.50 s', '40 ms', '0.4 ms')
    """
    if value >= 0.1:
        return f"{value:.2f} s"
    return f"{value * 1000:.0f} ms" if value >= 0.001 else f"{value * 1000:.1f} ms"


_FLOP_UNITS = ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s"), (1e3, "kFLOP/s"))


def flops_text(value: float) -> str:
    """FLOP/s in the largest unit that keeps the figure at 1 or more, three significant digits.

    >>> flops_text(3.2e14), flops_text(8.1e6), flops_text(512.0)
    ('320 TFLOP/s', '8.1 MFLOP/s', '512 FLOP/s')
    """
    for scale, unit in _FLOP_UNITS:
        if value >= scale:
            return f"{value / scale:.3g} {unit}" if value / scale < 1000 else f"{value / scale:,.0f} {unit}"
    return f"{value:.3g} FLOP/s"
