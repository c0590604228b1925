"""Anomaly rules: when a step's numbers are a problem. Host values in, anomalies out."""

from __future__ import annotations

import math
import re
from typing import Sequence

from torchtrace import semconv
from torchtrace.record.step import MAX_NAMES, Anomaly, StepRecord, capped


def _cap(names: Sequence[str]) -> list[str]:
    return capped(names)


def _left_out(names: Sequence[str]) -> int:
    return max(0, len(names) - MAX_NAMES)


# Names said in an anomaly's one-line detail (logged on every diverged step); the anomaly's
# data keeps up to MAX_NAMES of them.
NAMES_IN_DETAIL = 5


def _said(names: Sequence[str]) -> str:
    """The first few names, then how many more: ``a, b, c, d, e and 75 more``."""
    shown = list(names[:NAMES_IN_DETAIL])
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def evaluate_gradients(
    record: StepRecord,
    names: Sequence[str],
    norms: Sequence[float],
    total: float | None,
    explosion_threshold: float,
    vanishing_threshold: float,
    per_parameter: bool,
    overflow_only: Sequence[str] = (),
) -> None:
    """Fill the record's gradient fields and append gradient anomalies.

    ``total`` is the float64 L2 norm of ``norms`` (:func:`torchtrace.measure.gradients.global_norm`).

    ``overflow_only`` names tensors whose norm overflowed although every element is finite.
    """
    record.grad_names = list(names)
    record.grad_norms = list(norms)
    record.grad_norm = total
    # ``total`` is the L2 norm of ``norms`` in float64: finite exactly when every tensor's norm
    # is (an overflowing square makes it infinite too), so a finite total needs no scan.
    finite_total = total is not None and math.isfinite(total)
    bad = [] if finite_total else [n for n, v in zip(names, norms) if not math.isfinite(v)]
    record.grad_nonfinite_params = bad
    if bad:
        real = [n for n in bad if n not in overflow_only]
        detail = f"{len(bad)} gradient tensor(s) non-finite: {_said(bad)}"
        if overflow_only:
            detail += f" (norm overflow with finite elements: {_said(overflow_only)})"
        record.anomalies.append(Anomaly(semconv.NONFINITE_GRAD, detail, record.step, record.operation,
                                        {"count": len(bad), "params": _cap(bad), "params_omitted": _left_out(bad),
                                         "with_nonfinite_elements": _cap(real)}))
        return
    if total is not None and names:
        _size_rules(record, names, norms, total, explosion_threshold, vanishing_threshold, per_parameter)


def _size_rules(record: StepRecord, names: Sequence[str], norms: Sequence[float], total: float,
                explosion_threshold: float, vanishing_threshold: float, per_parameter: bool) -> None:
    """Explosion and vanishing of finite gradients: the global norm, and per tensor at ADVANCED."""
    if per_parameter:
        # No tensor's norm exceeds the global norm, so a global norm under the threshold needs no scan.
        exploded = [n for n, v in zip(names, norms) if v > explosion_threshold] if total > explosion_threshold else []
        vanished = [n for n, v in zip(names, norms) if v < vanishing_threshold]
    else:
        exploded = []
        vanished = []
    record.grad_exploded_params = exploded
    record.grad_vanished_params = vanished
    if total > explosion_threshold or exploded:
        record.anomalies.append(Anomaly(
            semconv.GRAD_EXPLOSION,
            f"gradient norm {total:.4g} over threshold {explosion_threshold:.4g}"
            + (f"; tensors over it: {_said(exploded)}" if exploded else ""),
            record.step, record.operation,
            {"grad_norm": total, "threshold": explosion_threshold, "params": _cap(exploded)},
        ))
    # A few tensors with tiny gradients (biases of dead units, embeddings of rare tokens) are
    # normal: their names go on the span (grad.vanished_params), and the anomaly is raised when
    # the global norm itself vanishes. (Explosion needs no such rule: a tensor over the
    # threshold puts the global norm over it too.)
    if total < vanishing_threshold:
        record.anomalies.append(Anomaly(
            semconv.GRAD_VANISHING,
            f"gradient norm {total:.4g} under threshold {vanishing_threshold:.4g}",
            record.step, record.operation,
            {"grad_norm": total, "threshold": vanishing_threshold, "params": _cap(vanished)},
        ))


def evaluate_loss(record: StepRecord) -> None:
    if record.loss is not None and not math.isfinite(record.loss):
        record.anomalies.append(Anomaly(semconv.NONFINITE_LOSS, f"loss is {record.loss}", record.step,
                                        record.operation, {"loss": record.loss}))


def evaluate_parameters(record: StepRecord, names: Sequence[str], norms: Sequence[float]) -> None:
    bad = [n for n, v in zip(names, norms) if not math.isfinite(v)]
    record.param_nonfinite_params = bad
    if bad:
        record.anomalies.append(Anomaly(
            semconv.NONFINITE_PARAM, f"{len(bad)} parameter tensor(s) non-finite: {_said(bad)}",
            record.step, record.operation, {"count": len(bad), "params": _cap(bad)}))


def evaluate_updates(record: StepRecord, names: Sequence[str], update_norms: Sequence[float],
                     param_norms: Sequence[float]) -> None:
    """Update-to-weight ratios: per tensor ||p_after - p_before|| / ||p_after||, and overall.

    A zero parameter gives NaN (no ratio), a non-finite one too; the overall ratio sums
    squares over the finite tensors.
    """
    ratios = [u / p if p > 0 and math.isfinite(p) and math.isfinite(u) else float("nan")
              for u, p in zip(update_norms, param_norms)]
    record.update_ratios = ratios
    good = [(u, p) for u, p in zip(update_norms, param_norms) if math.isfinite(u) and math.isfinite(p)]
    den = math.sqrt(sum(p * p for _, p in good))
    record.update_ratio = math.sqrt(sum(u * u for u, _ in good)) / den if den > 0 else None
    best = max(((r, n) for r, n in zip(ratios, names) if not math.isnan(r)), default=None)
    if best is not None:
        record.update_ratio_max, record.update_ratio_max_param = best


_ANOMALY_OP = re.compile(r"Function '([^']+)' returned (nan|inf)", re.IGNORECASE)


def evaluate_exception(record: StepRecord, exc: BaseException, anomaly_mode: bool) -> None:
    """A step that failed under ``detect_anomaly`` (DebugMode.ANOMALY_DETECTION): the failure is a
    ``nonfinite_grad`` anomaly naming the backward op, not only an exception."""
    if not anomaly_mode or not isinstance(exc, RuntimeError):
        return
    match = _ANOMALY_OP.search(str(exc))
    if match is None:
        return
    op = match.group(1)
    record.anomalies.append(Anomaly(semconv.NONFINITE_GRAD, f"autograd anomaly: backward op {op} returned "
                                    f"{match.group(2).lower()} values", record.step, record.operation,
                                    {"op": op, "source": "detect_anomaly"}))
