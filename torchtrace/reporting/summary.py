"""Training-monitor numbers (steps, anomaly rates by kind) from a list of step summaries."""

from __future__ import annotations

import collections
import math
from typing import Any

_LOSS_KINDS = frozenset({"nonfinite_loss", "loss_spike"})


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


def finite(values: list[Any]) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
