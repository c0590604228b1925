"""StepRecord: everything torchtrace learned about one operation call, as host values.

The step scope fills the timing and the measurements, the rules add anomalies, the probes
add their findings to typed fields, and ``torchtrace.export`` turns the finished record into
span attributes, events, metrics and file lines. Name lists can be as long as the model has
tensors; everything that leaves the record for a report, an API response or an event is
capped (:data:`MAX_NAMES`), with the number left out stated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from torchtrace.semconv import MAX_NAMES_PER_ATTRIBUTE, NONFINITE_KINDS

MAX_NAMES = MAX_NAMES_PER_ATTRIBUTE
"""Names of tensors kept in a summary, an event or an anomaly's data; the rest are counted."""
MAX_NAME_LENGTH = 200


def capped(names: Sequence[str], limit: int = MAX_NAMES) -> list[str]:
    """The first ``limit`` names, each cut to :data:`MAX_NAME_LENGTH` characters.

    >>> capped(["a" * 300, "b"], limit=1)[0] == "a" * 200
    True
    """
    return [n[:MAX_NAME_LENGTH] for n in names[:limit]]


@dataclass
class Anomaly:
    """One detected problem. ``kind`` is from :data:`torchtrace.semconv.ANOMALY_KINDS_ALL`."""

    kind: str
    detail: str
    step: int | None = None
    operation: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "detail": self.detail, "step": self.step,
                "operation": self.operation, "data": self.data}


@dataclass(slots=True)
class StepRecord:
    """One step's health, read to the host. Built by the step scope, finished by the runtime."""

    operation: str
    step: int
    level: str
    start_unix_ns: int
    end_unix_ns: int = 0
    duration_s: float = 0.0
    loss: float | None = None
    grad_norm: float | None = None
    grad_norm_scope: str = "local"
    grad_names: Sequence[str] = ()
    grad_norms: Sequence[float] = ()
    grad_nonfinite_params: list[str] = field(default_factory=list)
    grad_exploded_params: list[str] = field(default_factory=list)
    grad_vanished_params: list[str] = field(default_factory=list)
    param_checked: bool = False  # ADVANCED: parameters were checked (every param_check_interval steps, bad steps)
    param_nonfinite_params: list[str] = field(default_factory=list)
    update_ratio: float | None = None  # ADVANCED, every update_ratio_interval steps
    update_ratio_max: float | None = None
    update_ratio_max_param: str | None = None
    update_ratios: list[float] = field(default_factory=list)  # per tensor, in param_names order
    memory: dict[str, Any] = field(default_factory=dict)
    anomalies: list[Anomaly] = field(default_factory=list)
    exception_type: str | None = None
    skipped: bool = False  # the guard skipped the optimizer update
    guard_peer_nonfinite: bool = False  # the guard acted because another rank was non-finite
    trace_id: str | None = None
    span_id: str | None = None
    overhead_s: float = 0.0
    # Probes' findings (None: the probe had nothing to say this step).
    activations: list[dict[str, Any]] | None = None  # EXTREME: one row per hooked layer call
    forensics: dict[str, Any] | None = None  # the replay's report
    oom: dict[str, Any] | None = None  # out of memory inside the step
    scaler_overflow: bool = False  # a GradScaler overflow step (not an anomaly)
    memory_growth: float | None = None  # leak detector's slope, bytes per step (the step's device)
    memory_slopes: dict[str, float] | None = None  # the slopes of every device sampled this step
    leak: dict[str, Any] | None = None  # the leak report, on the step a leak was flagged
    profile: dict[str, Any] | None = None  # the profiler window holding this step
    rank_skew: tuple[float, int] | None = None  # (skew, slowest rank), every rank_skew_interval steps
    rank_step_seconds: float | None = None  # this rank's mean step time over the last skew window
    # Throughput and goodput.
    samples: int | None = None
    tokens: int | None = None
    flops: float | None = None  # model FLOPs of the step (forward + backward)
    flops_counted: bool = False  # this step ran under the FLOP counter: its time is not throughput
    lr: list[float] | None = None  # learning rate per parameter group
    data_wait_s: float | None = None
    phases: dict[str, float] | None = None  # forward, backward, optimizer seconds
    kind: str = "train"  # train, evaluation, checkpoint, other (badput accounting)

    @property
    def anomaly_kinds(self) -> list[str]:
        seen: list[str] = []
        for a in self.anomalies:
            if a.kind not in seen:
                seen.append(a.kind)
        return seen

    @property
    def nonfinite(self) -> bool:
        anomalies = self.anomalies
        return bool(anomalies) and any(a.kind in NONFINITE_KINDS for a in anomalies)

    @property
    def progressed(self) -> bool:
        """The step's update was applied and finite, and the step ended without an exception:
        training progress (goodput's productive time, for a ``train`` step). A NaN update applied
        under ``warn`` is not progress."""
        return not (self.skipped or self.scaler_overflow or self.nonfinite) and self.exception_type is None

    def summary(self) -> dict[str, Any]:
        """A compact, JSON-ready view, bounded in size whatever the model (names capped).

        Every step pays for this (the history keeps it): the name lists and anomaly kinds of a
        healthy step are empty lists without a call."""
        bad = self.grad_nonfinite_params
        out = {
            "operation": self.operation,
            "kind": self.kind,
            "step": self.step,
            "start_unix_ns": self.start_unix_ns,
            "duration_s": self.duration_s,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "grad_nonfinite_count": len(bad),
            "grad_nonfinite_params": capped(bad) if bad else [],
            "grad_nonfinite_params_omitted": max(0, len(bad) - MAX_NAMES),
            "update_ratio": self.update_ratio,
            "anomalies": self.anomaly_kinds if self.anomalies else [],
            "memory": self.memory,
            "exception_type": self.exception_type,
            "skipped": self.skipped,
            "trace_id": self.trace_id,
        }
        if self.scaler_overflow:
            out["scaler_overflow"] = True
        if self.samples is not None:
            out["samples"] = self.samples
        if self.tokens is not None:
            out["tokens"] = self.tokens
        if self.flops is not None:
            out["flops"] = self.flops
        if self.data_wait_s is not None:
            out["data_wait_s"] = self.data_wait_s
        if self.phases:
            out["phases"] = self.phases
        return out
