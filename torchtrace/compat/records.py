"""Seed 003's per-operation and per-optimization records (``debugger.debug_metrics`` and
``debugger.optimization_metrics``), with attribute access as the seed prints them.

>>> m = DebugMetrics(mode=DebugMode.FULL_DEBUG, operation="step", execution_time=0.5, memory_usage=100.0)
>>> f"{m.mode.value} {m.execution_time:.1f}s {m.memory_usage:.1f}MB"
'full_debug 0.5s 100.0MB'
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torchtrace.levels import DebugMode, OptimizationMode


@dataclass
class DebugMetrics:
    """One ``debug_context`` block: its mode, wall time (s), process memory at its end (MB),
    CUDA memory allocated at its end (MB, None without CUDA) and the gradient anomalies the
    checks inside it found (sentences)."""

    mode: DebugMode
    operation: str
    execution_time: float = 0.0
    memory_usage: float = 0.0
    gpu_memory: float | None = None
    gradient_anomalies: list[str] = field(default_factory=list)
    error: str | None = None
    timestamp: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "operation": self.operation, "execution_time": self.execution_time,
                "memory_usage": self.memory_usage, "gpu_memory": self.gpu_memory,
                "gradient_anomalies": list(self.gradient_anomalies), "error": self.error, "timestamp": self.timestamp}


@dataclass
class OptimizationMetrics:
    """One optimization: its mode, the seconds it took, the measured speedup factor and memory
    saving against no optimization (None where not measured), and whether AMP is on."""

    mode: OptimizationMode
    execution_time: float
    speedup_factor: float | None = None
    memory_savings: float | None = None
    amp_enabled: bool = False
    applied: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    operation: str = "optimize_model"
    timestamp: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "execution_time": self.execution_time, "speedup_factor": self.speedup_factor,
                "memory_savings": self.memory_savings, "amp_enabled": self.amp_enabled, "applied": list(self.applied),
                "skipped": dict(self.skipped), "operation": self.operation, "timestamp": self.timestamp}


__all__ = ["DebugMetrics", "OptimizationMetrics"]
