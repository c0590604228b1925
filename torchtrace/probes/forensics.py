"""The forensics probe: remembers how to replay each step, replays the one that went wrong, and
puts the report on the record (``record.forensics``: export makes it a span event, the history
an event, the log a line). Also out-of-memory records, and GradScaler overflow steps.

The replay budget (``forensics_max_replays``) is spent per *incident*, not per step: a run of
consecutive non-finite steps is one incident (under ``guard="warn"`` a NaN update leaves every
later step non-finite for the same reason), so only its first step is replayed, and a later,
distinct incident after recovery gets its own replay.
"""

from __future__ import annotations

import collections
import math
import time
from typing import TYPE_CHECKING, Any, Callable

from torchtrace import semconv
from torchtrace.errors import get_logger
from torchtrace.forensics import analysis, isolation, oom, replay
from torchtrace.measure.loss import extract_loss
from torchtrace.measure.scaler import scaler_enabled
from torchtrace.probes.base import Probe
from torchtrace.record.step import Anomaly, StepRecord

if TYPE_CHECKING:
    import torch

    from torchtrace.measure.gradients import GradStats
    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope

logger = get_logger("torchtrace.forensics")

MAX_REPORTS_KEPT = 20


class _State:
    __slots__ = ("rng", "tried", "report", "oom")

    def __init__(self) -> None:
        # The CPU and CUDA generator states as the step began (isolation.capture_rng).
        self.rng: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None
        self.tried = False
        self.report: dict[str, Any] | None = None
        self.oom: dict[str, Any] | None = None


class ForensicsProbe(Probe[_State]):
    """Registered on every runtime by ``configure()``; see docs/forensics.md."""

    name = "forensics"
    component = "forensics"

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.replays = 0
        self.incidents = 0
        self.skipped_budget = 0
        self.incident_steps = 0  # non-finite steps inside an incident that was already replayed
        self.in_incident = False
        self.incident_replayed = False  # the current incident's first step was replayed
        self.reports: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_REPORTS_KEPT)
        self.ooms: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_REPORTS_KEPT)

    # ------------------------------------------------------------ policy helpers
    def replayable(self, scope: StepScope) -> bool:
        return bool(self.rt.settings.forensics and scope.features is not None and scope.features.forensics
                    and (scope.forensics.replay is not None or scope.forensics.function is not None))

    def budget_left(self) -> bool:
        return self.replays < self.rt.settings.forensics_max_replays

    def wants_early_look(self, scope: StepScope, stats: GradStats) -> bool:
        """Read the gradient norms in the optimizer hook under ``warn`` too? Only where that read is
        free (gradients on the CPU): a replay then sees the parameters before the update."""
        return (not self.in_incident and self.replayable(scope) and self.budget_left()
                and stats.norms.device.type == "cpu")

    # ------------------------------------------------------------ step hooks
    def enter(self, scope: StepScope) -> _State | None:
        if scope.features is None or not scope.features.forensics:
            return None
        state = _State()
        if not self.in_incident and self.replayable(scope) and self.budget_left():
            state.rng = isolation.capture_rng()
        return state

    def exit(self, scope: StepScope, state: _State | None, exc: BaseException | None) -> None:
        if exc is not None and state is not None and oom.is_oom(exc):
            info = oom.handle(self.rt, scope, exc)
            self.ooms.append(info)
            state.oom = info
            if info["action"] == "skipped":
                scope.suppress = True
        return None

    def replay_now(self, scope: StepScope, params_updated: bool) -> dict[str, Any] | None:
        """Replay the step now (the caller guarantees the parameters are as the step saw them, or
        says they were updated). Once per step; once per incident."""
        state = scope.state_of(self)
        if state is None or state.tried:
            return state.report if state is not None else None
        state.tried = True
        if self.in_incident:
            if self.incident_replayed:
                self.incident_steps += 1
            return None
        if not self.replayable(scope):
            if self.rt.settings.forensics and scope.features is not None and scope.features.forensics:
                self.rt.warn_once(("replay", scope.name),
                                  "torchtrace: step %s of %s is non-finite; to find the module that produced it, "
                                  "give debug_context a replay= callable (the step's forward and loss again) or "
                                  "use @debug_operation, which replays by itself (docs/forensics.md)",
                                  scope.step, scope.name)
            return None
        if not self.budget_left():
            self.skipped_budget += 1
            return None
        run = scope.replayer()
        if scope.model is None or run is None:
            return None
        state.report = self._replay(scope, state, scope.model, run, params_updated)
        return state.report

    def _replay(self, scope: StepScope, state: _State, model: torch.nn.Module, run: Callable[[], Any],
                params_updated: bool) -> dict[str, Any]:
        self.replays += 1
        self.incidents += 1
        opts, scalers = isolation.side_effect_owners(scope)
        rt = self.rt
        rt.replaying = True
        t0 = time.perf_counter()
        try:
            args, kwargs = scope.inputs if scope.inputs is not None else ((), {})
            report = replay.replay(model, run, state.rng, opts, scalers, extract_loss,
                                   others=(*args, *kwargs.values()))
        finally:
            rt.replaying = False
            rt.throughput.ledger.add_forensics(t0, time.perf_counter())  # badput: forensics
        if report.get("cause") == "loss" and getattr(scope.forensics.replay, "__torchtrace_model_code__", False):
            # The loss came from the model's own method (Lightning's training_step): its code, not
            # a loss function outside the model, made the value.
            report.update(cause="forward", kind=analysis.CAUSE_KIND["forward"], module="",
                          module_type=type(model).__name__)
        report.update(step=scope.step, operation=scope.name, rank=rt.identity.rank, params_updated=params_updated,
                      replay_number=self.replays)
        return report

    def share_origin(self, scope: StepScope, report: dict[str, Any] | None) -> dict[str, Any] | None:
        """Every rank learns where the non-finite value was born: one ``all_gather_object`` of
        each rank's finding (its own report's cause and module, when the replay found the
        origin on that rank). Called by every rank at the same point (the guard agreed the step
        is bad), so the collective never waits for a rank that does not come. Returns the report
        with ``origin_rank``, ``origin_cause`` and ``origin_module``; a rank without a report
        (its own gradients were finite) gets none: its span says ``guard.peer_nonfinite``."""
        import torch.distributed as dist

        from torchtrace.distributed import collectives

        if not self.rt.settings.forensics or not collectives.collectives_available():
            return report
        mine = None
        if report is not None and report.get("cause") not in (None, "unknown", "peer"):
            mine = {"rank": self.rt.identity.rank, "cause": report.get("cause"), "module": report.get("module"),
                    "module_type": report.get("module_type")}
        found: list[Any] = [None] * dist.get_world_size()
        collectives.run("forensics", lambda: dist.all_gather_object(found, mine))
        origin = next((f for f in found if f is not None), None)
        if origin is None or report is None:  # (a rank whose own gradients were finite keeps no report)
            return report
        report.update(origin_rank=origin["rank"], origin_cause=origin["cause"], origin_module=origin["module"],
                      origin_module_type=origin["module_type"])
        if origin["rank"] != self.rt.identity.rank and replay.found_all_finite(report):
            # Its replay found this rank's side finite, a peer found the origin: the non-finite
            # gradients came from there (DDP given as ``model=ddp.module``, a hand-written all-reduce).
            report.update(cause="peer", kind=analysis.CAUSE_KIND["peer"])
        return report

    def finish(self, scope: StepScope, state: _State | None, record: StepRecord, values: list[float] | None) -> None:
        if state is None:
            return
        self._scaler_overflow(scope, record)
        if record.nonfinite and not state.tried:
            check = scope.gradients
            updated = bool(check is not None and check.fired and not check.skipped)
            self.replay_now(scope, params_updated=updated)
        if state.report is not None:
            self._publish(record, state.report)
        if state.oom is not None:
            info = state.oom
            record.anomalies.append(Anomaly(semconv.OOM, info["detail"], record.step, record.operation, info))
            record.skipped = record.skipped or info["action"] == "skipped"
            record.oom = info
        if record.nonfinite and not self.in_incident:
            self.incident_replayed = state.report is not None
        self.in_incident = record.nonfinite
        state.rng = None  # keep no tensors alive past the step

    # ------------------------------------------------------------ helpers
    def _scaler_overflow(self, scope: StepScope, record: StepRecord) -> None:
        """With a GradScaler, Inf/NaN gradients under a finite loss are the scaler's business."""
        if not any(a.kind == semconv.NONFINITE_GRAD for a in record.anomalies):
            return
        if record.loss is not None and not math.isfinite(record.loss):
            return
        scalers = [scope.scaler, *isolation.side_effect_owners(scope)[1]]
        if not any(scaler_enabled(s) for s in scalers):  # GradScaler(enabled=False) is no scaler
            return
        before = len(record.anomalies)
        record.anomalies = [a for a in record.anomalies if a.kind != semconv.NONFINITE_GRAD]
        if len(record.anomalies) != before:
            record.scaler_overflow = True

    def _publish(self, record: StepRecord, report: dict[str, Any]) -> None:
        kind = report.get("kind")
        text = sentence(report)
        if kind and kind not in record.anomaly_kinds:
            # The anomaly's own detail: its step and operation are said where it is shown.
            record.anomalies.append(Anomaly(kind, sentence(report, where_only=True), record.step, record.operation,
                                            {"module": report.get("module"), "cause": report.get("cause")}))
        record.forensics = report
        self.reports.append(report)
        self.rt.history.add_event("forensics", text, report)
        logger.error("torchtrace forensics: %s", text)

    def section(self) -> dict[str, Any]:
        return {"replays": self.replays, "incidents": self.incidents, "budget": self.rt.settings.forensics_max_replays,
                "skipped_over_budget": self.skipped_budget, "steps_in_replayed_incidents": self.incident_steps,
                "reports": list(self.reports), "ooms": list(self.ooms)}


def sentence(report: dict[str, Any], where_only: bool = False) -> str:
    """One line saying where the non-finite value was born (``where_only``: without the step,
    operation and rank it begins with)."""
    where = report.get("module")
    cause = report.get("cause")
    head = "" if where_only else f"step {report.get('step')} of {report.get('operation')} (rank {report.get('rank')}): "
    if cause == "input":
        target = "the model" if where in ("", None) else where
        text = head + f"non-finite value in the input of {target}"
    elif cause == "peer":
        text = head + "non-finite gradients arrived from another rank in the gradient all-reduce"
        if report.get("origin_rank") is not None:
            text += (f": born on rank {report['origin_rank']} in "
                     f"{report.get('origin_module') or 'the model'} ({report.get('origin_cause')})")
        else:
            text += f" from another rank ({report.get('tried')})"
        return text
    elif cause == "parameter" and report.get("found_in"):
        found, biggest = report["found_in"], report["extreme_params"][0]
        place = "the model's own forward" if found.get("module") == "" else found.get("module")
        return (head + f"parameter {biggest['name']} is finite but extreme (|value| up to {biggest['max_abs']:.3g}): "
                f"{found['cause']} non-finite value downstream, in {place}")
    elif cause == "unknown" and report.get("carried_over"):
        carried = report["carried_over"]
        return (head + f"non-finite gradients from before this step ({len(carried)}, first {carried[0]}): "
                "accumulated by an earlier step since the last update, whose report names the origin; "
                "this step's own replay was finite")
    elif where is None:
        # Nothing named: say what the replay did instead of a module.
        text = head + f"{cause} non-finite value, origin not found: {report.get('tried') or 'no replay ran'}"
    else:
        where = "the model's own forward" if where == "" else where
        text = head + f"{cause} non-finite value born in {where}"
    if report.get("module_type"):
        text += f" ({report['module_type']})"
    if report.get("op"):
        text += f", backward op {report['op']}"
    if report.get("overflow"):
        text += ", overflow"
    return text
