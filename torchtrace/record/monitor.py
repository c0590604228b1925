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
from torchtrace.measure.loss import classify_loss
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
        self._spike: tuple[float, float, int] | None = None  # the last step's spike rule: (mean, std, window)

    # ------------------------------------------------------------ per step
    def monitor_training_step(self, model: torch.nn.Module | None, loss: object,
                              step: int | None = None) -> dict[str, Any]:
        """Check one step (after ``backward()``); returns the step's numbers and anomaly kinds.
        The loss is judged as the core step judges it (:func:`torchtrace.measure.loss.classify_loss`):
        a per-sample loss is not read (None, the core's sentence logged once), never its first
        element."""
        pieces = []
        judged = classify_loss(loss) if loss is not None else None
        if judged is not None and judged.tensor is not None:
            pieces.append(judged.tensor.detach().reshape(1).to(torch.float64).cpu())
        elif judged is not None and judged.problem is not None and isinstance(loss, torch.Tensor):
            rt = current.runtime(create=False)
            if rt is not None:
                rt.warn_once(("monitor-loss", judged.problem), "torchtrace: the loss was not read: %s", judged.problem)
            else:
                logger.warning("torchtrace: the loss was not read: %s", judged.problem)
        stats = grad_measure.gradient_norms(grad_measure.named_params(model)) if model is not None else None
        if stats is not None:
            pieces.append(stats.total.reshape(1).to(torch.float64).cpu())
        share_with_open_step(model, loss)
        values = readout.read(torch.cat(pieces)) if pieces else []
        loss_value: float | None = None
        if judged is not None and judged.tensor is not None:
            loss_value = values[0]
            values = values[1:]
        elif judged is not None:
            loss_value = judged.number
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
        """Where a step's anomalies go: inside an open torchtrace step, that step's record
        (:func:`report_to_open_step`); outside one, the run, under ``training_monitor``."""
        details = {k: self.describe(k, loss, grad_norm) for k in kinds}
        if not report_to_open_step(kinds, details, step, loss, grad_norm):
            record_anomalies(kinds, step, loss, grad_norm, details=details)

    def describe(self, kind: str, loss: float | None, grad_norm: float | None) -> str:
        """An anomaly the last step judged, in words with its numbers: the loss and the spike
        threshold it passed (mean + spike_factor x std of the window), the gradient norm and
        the bound it crossed."""
        if kind == semconv.LOSS_SPIKE and self._spike is not None and loss is not None:
            mean, std, n = self._spike
            return (f"loss {loss:.4g} above the spike threshold {mean + self.spike_factor * std:.4g} "
                    f"(mean {mean:.4g} + {self.spike_factor:g} x std {std:.4g} of the last {n} losses)")
        if kind == semconv.GRAD_EXPLOSION and grad_norm is not None:
            return f"gradient norm {grad_norm:.4g} above {self.explosion_threshold:.4g}"
        if kind == semconv.GRAD_VANISHING and grad_norm is not None:
            return f"gradient norm {grad_norm:.4g} below {self.vanishing_threshold:.4g}"
        if kind == semconv.NONFINITE_LOSS:
            return f"loss is {loss}"
        if kind == semconv.NONFINITE_GRAD:
            return f"gradient norm is {grad_norm}"
        return kind

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
        self._spike = None
        if n < self.min_history:
            return False
        mean = math.fsum(self.losses) / n
        var = math.fsum((v - mean) ** 2 for v in self.losses) / max(n - 1, 1)
        floor = 1e-3 * abs(mean) + 1e-12
        std = max(math.sqrt(var), floor)
        self._spike = (mean, std, n)
        return loss > mean + self.spike_factor * std

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


STEP_JUDGED_KINDS = frozenset({semconv.NONFINITE_LOSS, semconv.NONFINITE_GRAD, semconv.GRAD_EXPLOSION,
                               semconv.GRAD_VANISHING})
"""Kinds a torchtrace step's own record judges from the loss and gradients it holds: a check
made inside the step leaves them to it (they would be counted twice)."""


def _open_step() -> Any:
    """The torchtrace step open on this thread and recording, or None."""
    scope = current.step()
    return scope if scope is not None and getattr(scope, "active", False) else None


def share_with_open_step(model: torch.nn.Module | None, loss: object) -> None:
    """Give the open step (if any) the model whose gradients a check read and the loss, where it
    lacks them: its record then judges the kinds of :data:`STEP_JUDGED_KINDS` itself."""
    scope = _open_step()
    if scope is None:
        return
    try:
        if model is not None and scope.model is None:
            scope.model = model
        if loss is not None and not scope.has_loss:
            scope.record_loss(loss)
    except Exception as exc:  # torchtrace's own failure never reaches the caller
        rt = current.runtime(create=False)
        if rt is not None:
            rt.errors.report("record", exc)


def report_to_open_step(kinds: list[str], details: dict[str, str], step: int | None, loss: float | None,
                        grad_norm: float | None) -> bool:
    """Anomalies a check found inside an open step are the step's: the kinds the step judges
    itself are logged as history events marked ``in_step`` and not counted again; the others (a
    loss spike) are added to the step's record (its span, counters and history). False when no
    step is open."""
    scope = _open_step()
    if scope is None:
        return False
    own = [k for k in kinds if k in STEP_JUDGED_KINDS]
    if own:
        record_anomalies(own, step, loss, grad_norm, data={"in_step": True}, count=False, details=details)
    try:
        for kind in kinds:
            if kind not in STEP_JUDGED_KINDS:
                scope.add_anomaly(kind, details.get(kind, kind),
                                  {"source": "training_monitor", "loss": _json(loss), "grad_norm": _json(grad_norm)})
    except Exception as exc:  # torchtrace's own failure never reaches the caller
        rt = current.runtime(create=False)
        if rt is not None:
            rt.errors.report("record", exc)
    return True


def record_anomalies(kinds: list[str], step: int | None, loss: float | None, grad_norm: float | None,
                     operation: str = "training_monitor", data: dict[str, Any] | None = None,
                     count: bool = True, details: dict[str, str] | None = None) -> None:
    """Record anomalies on the configured runtime: the log, the counter
    ``torchtrace_anomalies_total{operation, kind}`` (unless ``count`` is False) and an
    ``anomaly`` event in the run history, whose message is ``details[kind]`` when given.

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
            detail = (details or {}).get(kind) or f"{kind} at step {step}"
            if details and kind in details:
                event["detail"] = detail
            rt.history.add_event("anomaly", detail, event)
    except Exception as exc:
        rt.errors.report("record", exc)


def _json(v: float | None) -> float | str | None:
    return v if v is None or math.isfinite(v) else str(v)
