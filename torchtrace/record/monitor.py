"""TrainingMonitor: per-step loss and gradient checks with a rolling loss-spike detector.

For code that does not use ``debug_operation``: call :meth:`TrainingMonitor.monitor_training_step`
after ``backward()``. Each call reads the loss and the global gradient norm to the host once.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

from torchtrace import current, semconv
from torchtrace.config import DEFAULT_GRAD_EXPLOSION_THRESHOLD, DEFAULT_GRAD_VANISHING_THRESHOLD
from torchtrace.errors import get_logger
from torchtrace.measure import gradients as grad_measure
from torchtrace.record import readout

logger = get_logger("torchtrace.monitor")


class TrainingMonitor:
    """Counts anomalous steps: non-finite or spiking loss, exploding or vanishing gradients.

    Args:
        window: how many recent finite losses the spike detector compares against.
        spike_factor: a loss above ``mean + spike_factor * std`` of the window is a spike
            (the std is floored at ``1e-3 * |mean| + 1e-12`` so a flat window still works).
        min_history: losses needed in the window before spikes are judged.
        explosion_threshold / vanishing_threshold: global gradient norm bounds (defaults:
            :data:`torchtrace.config.DEFAULT_GRAD_EXPLOSION_THRESHOLD` and
            :data:`~torchtrace.config.DEFAULT_GRAD_VANISHING_THRESHOLD`).

    Summary keys (:meth:`get_training_summary`): ``total_steps``, ``anomaly_steps`` (steps
    with at least one anomaly), ``gradient_explosions`` (finite norm above the threshold),
    ``gradient_vanishing`` (finite norm below the threshold), ``nonfinite_gradients`` (a NaN
    or Inf gradient: never counted as an explosion), ``loss_anomalies`` (non-finite loss or
    spike), ``loss_spikes``, and their rates (count / total_steps): ``anomaly_rate``,
    ``gradient_explosion_rate``, ``gradient_vanishing_rate``, ``nonfinite_gradient_rate``,
    ``loss_anomaly_rate``, ``loss_spike_rate``.

    >>> import torch, torchtrace as tt
    >>> mon = tt.TrainingMonitor(window=10)
    >>> model = torch.nn.Linear(2, 1); loss = model(torch.ones(1, 2)).sum(); loss.backward()
    >>> mon.monitor_training_step(model, loss, step=0)["anomalies"]
    []
    >>> mon.get_training_summary()["total_steps"]
    1
    """

    def __init__(self, window: int = 50, spike_factor: float = 3.0, min_history: int = 5,
                 explosion_threshold: float = DEFAULT_GRAD_EXPLOSION_THRESHOLD,
                 vanishing_threshold: float = DEFAULT_GRAD_VANISHING_THRESHOLD) -> None:
        name: str
        value: float
        for name, value in (("window", window), ("min_history", min_history)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} is not valid; accepted values: a positive integer")
        for name, value in (("spike_factor", spike_factor), ("explosion_threshold", explosion_threshold),
                            ("vanishing_threshold", vanishing_threshold)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name}={value!r} is not valid; accepted values: a positive finite number")
        self.window = window
        self.spike_factor = float(spike_factor)
        self.min_history = min_history
        self.explosion_threshold = float(explosion_threshold)
        self.vanishing_threshold = float(vanishing_threshold)
        self.reset()

    def reset(self) -> None:
        self.losses: collections.deque[float] = collections.deque(maxlen=self.window)
        self.counts: collections.Counter[str] = collections.Counter()
        self.last: dict[str, Any] | None = None

    # ------------------------------------------------------------ per step
    def monitor_training_step(self, model: torch.nn.Module | None, loss: object,
                              step: int | None = None) -> dict[str, Any]:
        """Check one step (after ``backward()``); returns the step's numbers and anomaly kinds."""
        pieces = []
        if isinstance(loss, torch.Tensor):
            pieces.append(loss.detach().reshape(-1)[:1].to(torch.float64).cpu())
        stats = grad_measure.gradient_norms(grad_measure.named_params(model)) if model is not None else None
        if stats is not None:
            pieces.append(stats.total.reshape(1).to(torch.float64).cpu())
        values = readout.read(torch.cat(pieces)) if pieces else []
        if isinstance(loss, torch.Tensor):
            loss_value: float | None = values[0]
            values = values[1:]
        else:
            loss_value = float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None
        grad_norm = values[0] if stats is not None else None
        return self.record_step(loss_value, grad_norm, step)

    def record_step(self, loss_value: float | None, grad_norm: float | None, step: int | None = None) -> dict[str, Any]:
        """Judge and count one step from numbers already on the host (no read)."""
        step = self.counts["total_steps"] if step is None else step
        anomalies = self._judge(loss_value, grad_norm)
        self.counts["total_steps"] += 1
        if anomalies:
            self.counts["anomaly_steps"] += 1
        self.last = {"step": step, "loss": loss_value, "grad_norm": grad_norm, "anomalies": anomalies}
        if anomalies:
            self._report(anomalies, step, loss_value, grad_norm)
        return dict(self.last)

    def _report(self, kinds: list[str], step: int, loss: float | None, grad_norm: float | None) -> None:
        """Where a step's anomalies go: the configured run (a subclass inside a step counts less)."""
        record_anomalies(kinds, step, loss, grad_norm)

    def _judge(self, loss: float | None, grad_norm: float | None) -> list[str]:
        kinds: list[str] = []
        if loss is not None:
            if not math.isfinite(loss):
                kinds.append(semconv.NONFINITE_LOSS)
                self.counts["loss_anomalies"] += 1
            else:
                if self._is_spike(loss):
                    kinds.append(semconv.LOSS_SPIKE)
                    self.counts["loss_anomalies"] += 1
                    self.counts["loss_spikes"] += 1
                self.losses.append(loss)
        if grad_norm is not None:
            if not math.isfinite(grad_norm):
                kinds.append(semconv.NONFINITE_GRAD)
                self.counts["nonfinite_gradients"] += 1
            elif grad_norm > self.explosion_threshold:
                kinds.append(semconv.GRAD_EXPLOSION)
                self.counts["gradient_explosions"] += 1
            elif grad_norm < self.vanishing_threshold:
                kinds.append(semconv.GRAD_VANISHING)
                self.counts["gradient_vanishing"] += 1
        return kinds

    def _is_spike(self, loss: float) -> bool:
        n = len(self.losses)
        if n < self.min_history:
            return False
        mean = math.fsum(self.losses) / n
        var = math.fsum((v - mean) ** 2 for v in self.losses) / max(n - 1, 1)
        floor = 1e-3 * abs(mean) + 1e-12
        return loss > mean + self.spike_factor * max(math.sqrt(var), floor)

    # ------------------------------------------------------------ summary and state
    def get_training_summary(self) -> dict[str, Any]:
        """Counts and rates (count / total_steps; 0.0 before the first step)."""
        total = self.counts["total_steps"]
        out: dict[str, Any] = {"total_steps": total}
        for key, rate in _RATES:
            out[key] = self.counts[key]
            out[rate] = self.counts[key] / total if total else 0.0
        out["recent_loss_mean"] = math.fsum(self.losses) / len(self.losses) if self.losses else None
        out["last_step"] = self.last
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "counts": dict(self.counts), "last": self.last,
                "config": {"window": self.window, "spike_factor": self.spike_factor, "min_history": self.min_history,
                           "explosion_threshold": self.explosion_threshold,
                           "vanishing_threshold": self.vanishing_threshold}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cfg = state.get("config", {})
        self.window = cfg.get("window", self.window)
        self.spike_factor = cfg.get("spike_factor", self.spike_factor)
        self.min_history = cfg.get("min_history", self.min_history)
        self.explosion_threshold = cfg.get("explosion_threshold", self.explosion_threshold)
        self.vanishing_threshold = cfg.get("vanishing_threshold", self.vanishing_threshold)
        self.losses = collections.deque(state.get("losses", []), maxlen=self.window)
        self.counts = collections.Counter(state.get("counts", {}))
        self.last = state.get("last")


_RATES = (("anomaly_steps", "anomaly_rate"), ("gradient_explosions", "gradient_explosion_rate"),
          ("gradient_vanishing", "gradient_vanishing_rate"), ("nonfinite_gradients", "nonfinite_gradient_rate"),
          ("loss_anomalies", "loss_anomaly_rate"), ("loss_spikes", "loss_spike_rate"))


def record_anomalies(kinds: list[str], step: int | None, loss: float | None, grad_norm: float | None,
                     operation: str = "training_monitor", data: dict[str, Any] | None = None,
                     count: bool = True) -> None:
    """Record anomalies on the configured runtime: the log, the counter
    ``torchtrace_anomalies_total{operation, kind}`` (unless ``count`` is False) and an
    ``anomaly`` event in the run history.

    ``count=False`` is for a check made inside an open step whose own record counts the same
    kinds (the loss and gradients it was given), so that no anomaly is counted twice."""
    rt = current.runtime(create=False)
    for kind in kinds:
        logger.warning("step %s: %s (loss %s, grad norm %s)", step, kind, loss, grad_norm)
    if rt is None:
        return
    try:
        for kind in kinds:
            if count:
                rt.metrics.count_anomaly(operation, kind)
            event = {"kind": kind, "step": step, "operation": operation, "loss": _json(loss),
                     "grad_norm": _json(grad_norm)}
            event.update(data or {})
            rt.history.add_event("anomaly", f"{kind} at step {step}", event)
    except Exception as exc:
        rt.errors.report("record", exc)


def _json(v: float | None) -> float | str | None:
    return v if v is None or math.isfinite(v) else str(v)
