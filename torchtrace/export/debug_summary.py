"""The training summary the debug API serves at ``/debug/training/summary`` by default.

Re-exported by :mod:`torchtrace.export.debug_api`.
"""

from __future__ import annotations

import time
from typing import Any, Callable


def history_training_summary(runtime) -> dict[str, Any]:
    """The training monitor's summary computed from the runtime's history.

    Rates are per completed step: ``anomaly_rate`` = steps with any anomaly / steps;
    ``rates_by_kind[k]`` = steps with anomaly kind ``k`` / steps; the seeds' named rates
    (``loss_anomaly_rate``: nonfinite_loss or loss_spike, ``explosion_rate``,
    ``vanishing_rate``) are included. The ``recent`` block describes the retained window.
    """
    h = runtime.history
    totals = retry_copy(lambda: dict(h.totals))
    by_kind = retry_copy(lambda: dict(h.anomaly_counts))
    steps = totals.get("steps", 0)
    anomaly_steps = totals.get("anomaly_steps", 0)

    def rate(n: int) -> float:
        return n / steps if steps else 0.0

    recent = h.steps()
    losses = [s["loss"] for s in recent if isinstance(s.get("loss"), float) and s["loss"] == s["loss"]
              and abs(s["loss"]) != float("inf")]
    durations = [s["duration_s"] for s in recent if isinstance(s.get("duration_s"), (int, float))]
    return {
        "source": "history",
        "total_steps": steps,
        "anomaly_steps": anomaly_steps,
        "nonfinite_steps": totals.get("nonfinite_steps", 0),
        "skipped_steps": totals.get("skipped_steps", 0),
        "failed_steps": totals.get("failed_steps", 0),
        "anomaly_rate": rate(anomaly_steps),
        "anomalies_by_kind": by_kind,
        "rates_by_kind": {k: rate(v) for k, v in sorted(by_kind.items())},
        "loss_anomaly_rate": rate(by_kind.get("nonfinite_loss", 0) + by_kind.get("loss_spike", 0)),
        "explosion_rate": rate(by_kind.get("grad_explosion", 0)),
        "vanishing_rate": rate(by_kind.get("grad_vanishing", 0)),
        # Seed 001's keys (steps with the kind, and per step); a NaN/Inf gradient is not an explosion.
        "gradient_explosions": by_kind.get("grad_explosion", 0),
        "gradient_vanishing": by_kind.get("grad_vanishing", 0),
        "loss_anomalies": by_kind.get("nonfinite_loss", 0) + by_kind.get("loss_spike", 0),
        "gradient_explosion_rate": rate(by_kind.get("grad_explosion", 0)),
        "gradient_vanishing_rate": rate(by_kind.get("grad_vanishing", 0)),
        "recent": {
            "steps": len(recent),
            "last_loss": recent[-1].get("loss") if recent else None,
            "mean_loss": sum(losses) / len(losses) if losses else None,
            "mean_step_seconds": sum(durations) / len(durations) if durations else None,
        },
        "level": runtime.level.value,
    }


SEED_DIFFUSION_OPERATION = "diffusion"
"""The operation ``DiffusionModelDebugger`` counts its anomalies under (its default name)."""


def seed_debug_summary(runtime) -> dict[str, Any]:
    """Seed 001's ``GET /training-logs/debug/summary``: the run summary (as ``/debug/summary``)
    plus the three sections the seed documents, each with ``total_anomalies`` and
    ``debug_history_length``, computed from the run's history:

    - ``training_debugger``: the run's steps: anomalies judged in steps (one per kind per
      step), the retained step summaries, ``total_steps``, ``anomaly_rate``,
      ``gradient_explosion_rate``;
    - ``diffusion_debugger``: anomalies counted outside steps under the operation
      ``diffusion`` (``DiffusionModelDebugger.monitor_diffusion_step``);
    - ``general_debugger``: every other anomaly found outside a step (``check_gradients``,
      ``check_model_parameters``, ``check_tensor_anomalies``...).

    Outside-step anomalies are ``anomaly`` events without a step's ``detail``; those a check
    shared with an open step (``in_step``) are the step's. Event counts are of the retained
    events (the history's bound), step counts are totals.
    """
    out = retry_copy(runtime.summary)
    training = history_training_summary(runtime)
    outside = [e.data for e in runtime.history.events()
               if e.event_type == "anomaly" and "detail" not in e.data and not e.data.get("in_step")]
    diffusion = [d for d in outside if d.get("operation") == SEED_DIFFUSION_OPERATION]
    general = [d for d in outside if d.get("operation") != SEED_DIFFUSION_OPERATION]
    out["training_debugger"] = {
        "total_anomalies": sum(training["anomalies_by_kind"].values()),
        "debug_history_length": training["recent"]["steps"],
        "total_steps": training["total_steps"],
        "anomaly_rate": training["anomaly_rate"],
        "gradient_explosion_rate": training["gradient_explosion_rate"],
    }
    out["diffusion_debugger"] = {"total_anomalies": len(diffusion), "debug_history_length": len(diffusion)}
    out["general_debugger"] = {"total_anomalies": len(general), "debug_history_length": len(general)}
    return out


def retry_copy(fn: Callable[[], Any], tries: int = 5) -> Any:
    """Copy a structure the training thread may be growing (a dict resize raises RuntimeError).

    >>> retry_copy(lambda: dict({"steps": 3}))
    {'steps': 3}
    """
    for _ in range(tries - 1):
        try:
            return fn()
        except RuntimeError:
            time.sleep(0)
    return fn()

