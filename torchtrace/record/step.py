"""StepRecord: everything torchtrace learned about one operation call, as host values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchtrace.semconv import NONFINITE_KINDS


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


@dataclass
class StepRecord:
    """One step's health, read to the host. Built by the step scope, finished by the recorder."""

    operation: str
    step: int
    level: str
    start_unix_ns: int
    end_unix_ns: int = 0
    duration_s: float = 0.0
    loss: float | None = None
    grad_norm: float | None = None
    grad_norm_scope: str = "local"
    grad_names: list[str] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grad_nonfinite_params: list[str] = field(default_factory=list)
    grad_exploded_params: list[str] = field(default_factory=list)
    grad_vanished_params: list[str] = field(default_factory=list)
    param_checked: bool = False  # ADVANCED: parameters were checked (every param_check_interval steps, bad steps)
    param_nonfinite_params: list[str] = field(default_factory=list)
    update_ratio: float | None = None  # ADVANCED, every update_ratio_interval steps
    update_ratio_max: float | None = None
    update_ratio_max_param: str | None = None
    update_ratios: list[float] = field(default_factory=list)  # per tensor, in param_names order
    memory: dict[str, int | None] = field(default_factory=dict)
    anomalies: list[Anomaly] = field(default_factory=list)
    exception_type: str | None = None
    skipped: bool = False
    trace_id: str | None = None
    span_id: str | None = None
    overhead_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def anomaly_kinds(self) -> list[str]:
        seen: list[str] = []
        for a in self.anomalies:
            if a.kind not in seen:
                seen.append(a.kind)
        return seen

    @property
    def nonfinite(self) -> bool:
        return any(a.kind in NONFINITE_KINDS for a in self.anomalies)

    def summary(self) -> dict[str, Any]:
        """A compact, JSON-ready view (no per-parameter lists beyond the anomaly names)."""
        return {
            "operation": self.operation,
            "step": self.step,
            "start_unix_ns": self.start_unix_ns,
            "duration_s": self.duration_s,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "grad_nonfinite_params": self.grad_nonfinite_params,
            "update_ratio": self.update_ratio,
            "anomalies": [a.kind for a in self.anomalies],
            "memory": self.memory,
            "exception_type": self.exception_type,
            "skipped": self.skipped,
            "trace_id": self.trace_id,
        }
