"""The forensics probe: remembers how to replay each step, replays the one that went wrong,
and turns the result into a span event, a report section, a log record and a metric.

Also the guard's follow-ups that need the host record: ``max_consecutive_bad_steps``, the
``raise`` policy for steps without an optimizer, GradScaler overflow steps, and OOM.
"""

from __future__ import annotations

import collections
import json
import logging
import math
from typing import Any

import torch

from torchtrace import semconv
from torchtrace.errors import NonFiniteError
from torchtrace.forensics import oom, replay
from torchtrace.measure.loss import extract_loss
from torchtrace.record.step import Anomaly

logger = logging.getLogger("torchtrace.forensics")

MAX_REPORTS_KEPT = 20


class ForensicsProbe:
    """Registered on every runtime by ``configure()``; see docs/forensics.md."""

    def __init__(self, rt) -> None:
        self.rt = rt
        self.replays = 0
        self.skipped_budget = 0
        self.reports: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_REPORTS_KEPT)
        self.ooms: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_REPORTS_KEPT)

    # ------------------------------------------------------------ policy helpers
    def enabled_for(self, scope) -> bool:
        return bool(self.rt.settings.forensics and scope._features.forensics
                    and scope.extras.get("replay") is not None)

    def budget_left(self) -> bool:
        return self.replays < self.rt.settings.forensics_max_replays

    def decide_early(self, scope, params) -> bool:
        """Read the gradient norms in the optimizer pre-hook under ``warn`` too?

        Only where that read is free (gradients on the CPU): then a replay sees the
        parameters before the update. On an accelerator the read waits for the record.
        """
        if not (self.enabled_for(scope) and self.budget_left()):
            return False
        stats = scope._grad_stats
        return stats is not None and stats.total.device.type == "cpu"

    # ------------------------------------------------------------ probe interface
    def enter(self, scope) -> None:
        if self.enabled_for(scope) and self.budget_left():
            scope.extras["forensics_rng"] = replay.capture_rng()

    def exit(self, scope, exc: BaseException | None) -> None:
        if exc is not None and oom.is_oom(exc):
            info = oom.handle(self.rt, scope, exc)
            self.ooms.append(info)
            scope.extras["oom"] = info
            if self.rt.settings.guard == "skip":
                scope.extras["suppress"] = True

    def on_nonfinite(self, scope, params_updated: bool = False) -> dict[str, Any] | None:
        """Replay the step now (the caller guarantees the parameters are as the step saw them)."""
        if "forensics_report" in scope.extras or scope.extras.get("forensics_tried"):
            return scope.extras.get("forensics_report")
        scope.extras["forensics_tried"] = True
        if not self.enabled_for(scope):
            return None
        if not self.budget_left():
            self.skipped_budget += 1
            return None
        if scope.model is None:
            return None
        self.replays += 1
        opts, scalers = scope.extras.get("replay_owners", ([], []))
        opts = list(opts)
        if scope.optimizer is not None and scope.optimizer not in opts:
            opts.append(scope.optimizer)
        scaler = scope.extras.get("scaler")
        scalers = list(scalers) + ([scaler] if scaler is not None and scaler not in scalers else [])
        self.rt.replaying = True
        try:
            report = replay.replay(scope.model, scope.extras["replay"], scope.extras.get("forensics_rng"), opts,
                                   scalers, extract_loss)
        finally:
            self.rt.replaying = False
        report.update(step=scope.step, operation=scope.name, rank=self.rt.identity.rank,
                      params_updated=params_updated, replay_number=self.replays)
        scope.extras["forensics_report"] = report
        return report

    def finalize(self, scope, record, span) -> None:
        if scope is None:
            return
        rt = self.rt
        self._scaler_overflow(scope, record)
        if record.nonfinite and "forensics_report" not in scope.extras:
            updated = bool(scope._hook_fired and not scope._skipped)
            try:
                self.on_nonfinite(scope, params_updated=updated)
            except Exception as exc:
                rt.errors.report("forensics", exc)
        report = scope.extras.get("forensics_report")
        if report is not None:
            self._publish(scope, record, span, report)
        info = scope.extras.get("oom")
        if info is not None:
            record.anomalies.append(Anomaly(semconv.OOM, info["detail"], record.step, record.operation, info))
            record.skipped = record.skipped or bool(scope.extras.get("suppress"))
            span.add_event(semconv.EVENT_OOM, _flat(info))
        for key in ("forensics_rng", "replay", "replay_owners"):  # keep no tensors alive past the step
            scope.extras.pop(key, None)
        # Guard follow-ups that need the host record.
        if record.nonfinite and scope.extras.get("raise") is None:
            limit = rt.settings.max_consecutive_bad_steps
            run = rt.consecutive_bad + 1
            if limit is not None and run >= limit:
                scope.extras["raise"] = NonFiniteError(
                    f"{run} consecutive non-finite steps (limit {limit}) at step {record.step} of {record.operation}",
                    step=record.step, kinds=record.anomaly_kinds, report=report)
            elif rt.settings.guard == "raise" and scope._raise is None:
                scope.extras["raise"] = NonFiniteError(
                    f"non-finite step {record.step} of {record.operation}: {', '.join(record.anomaly_kinds)}",
                    step=record.step, kinds=record.anomaly_kinds, report=report)
        if scope._raise is not None and report is not None and scope._raise.report is None:
            scope._raise.report = report

    # ------------------------------------------------------------ helpers
    def _scaler_overflow(self, scope, record) -> None:
        """With a GradScaler, Inf/NaN gradients under a finite loss are the scaler's business."""
        if scope.extras.get("scaler") is None and not scope.extras.get("replay_owners", ([], []))[1]:
            return
        if record.loss is not None and not math.isfinite(record.loss):
            return
        before = len(record.anomalies)
        record.anomalies = [a for a in record.anomalies if a.kind != semconv.NONFINITE_GRAD]
        if len(record.anomalies) != before:
            record.extra["scaler_overflow"] = True

    def _publish(self, scope, record, span, report: dict[str, Any]) -> None:
        rt = self.rt
        kind = report.get("kind")
        if kind and kind not in record.anomaly_kinds:
            record.anomalies.append(Anomaly(kind, _sentence(report), record.step, record.operation,
                                            {"module": report.get("module"), "cause": report.get("cause")}))
        record.extra["forensics"] = report
        self.reports.append(report)
        span.add_event(semconv.EVENT_FORENSICS, _flat(report))
        rt.history.add_event("forensics", _sentence(report), report)
        logger.error("torchtrace forensics: %s", _sentence(report))

    def section(self) -> dict[str, Any]:
        return {"replays": self.replays, "budget": self.rt.settings.forensics_max_replays,
                "skipped_over_budget": self.skipped_budget, "reports": list(self.reports),
                "ooms": list(self.ooms)}


def _sentence(report: dict[str, Any]) -> str:
    where = report.get("module")
    where = "<model root>" if where == "" else where
    text = (f"step {report.get('step')} of {report.get('operation')} (rank {report.get('rank')}): "
            f"{report.get('cause')} non-finite value born in {where}")
    if report.get("module_type"):
        text += f" ({report['module_type']})"
    if report.get("op"):
        text += f", backward op {report['op']}"
    if report.get("overflow"):
        text += ", overflow"
    return text


def _flat(report: dict[str, Any]) -> dict[str, Any]:
    """Span-event attributes: scalars as they are, nested values as capped JSON."""
    out: dict[str, Any] = {}
    for key, value in report.items():
        name = semconv.FORENSICS_PREFIX + key
        if value is None:
            continue
        if isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
            out[name] = value[: semconv.MAX_ATTRIBUTE_LENGTH] if isinstance(value, str) else value
        else:
            out[name] = json.dumps(value, default=str)[: semconv.MAX_ATTRIBUTE_LENGTH]
    return out


def install(rt) -> ForensicsProbe:
    probe = ForensicsProbe(rt)
    rt.probes.append(probe)
    rt.report_sections["forensics"] = probe.section
    rt.forensics = probe
    return probe
