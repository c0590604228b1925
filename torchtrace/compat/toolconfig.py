"""Seed 002's ``PyTorchDebugConfig``: which debugging tool families are on, and their thresholds.

Every field has an effect (docs/seed-api.md lists them) or a bad value raises at construction.

>>> PyTorchDebugConfig(enable_profiling=True).enable_profiling
True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torchtrace.compat.settings import ANOMALY_MODES, flag, positive
from torchtrace.config import DEFAULT_GRAD_EXPLOSION_THRESHOLD, DEFAULT_GRAD_VANISHING_THRESHOLD


@dataclass
class PyTorchDebugConfig:
    """Switches of :class:`~torchtrace.compat.PyTorchDebugManager`'s tools.

    Attributes:
        enable_autograd_anomaly: ``anomaly_detector.detect_anomaly()`` turns autograd anomaly
            detection on (off: the block runs untouched). ``anomaly_mode``: detect, warn, raise.
        enable_gradient_debugging: ``gradient_debugger.check_gradients`` / ``analyze_gradient_flow``
            measure (off: they return ``enabled=False`` without reading anything).
        gradient_norm_threshold / gradient_vanishing_threshold: the global-norm bounds (the one
            default per threshold).
        gradient_clip_threshold: when set, a gradient check that finds an explosion clips the
            gradients to this norm (the seed's "clipping when anomalies are detected"); None
            (default) never changes your gradients.
        enable_memory_debugging: memory snapshots and tensor tracking (off: no-ops).
        track_tensor_memory: ``memory_debugger.track_tensor`` watches tensors (off: no-op).
        memory_snapshot_frequency: ``training_debugger.debug_training_step`` takes a snapshot
            every this many steps (0: never).
        enable_model_debugging: ``model_debugger.inspect_model`` inspects (off: ``enabled=False``).
        enable_training_debugging: ``training_debugger.debug_training_step`` records layer and
            gradient statistics (off: it runs the step plainly and records the loss only).
        enable_profiling: ``PyTorchDebugManager.profiling()`` profiles (off: no-op).

    Raises:
        ValueError: a field with a bad value, naming it and the accepted values.
    """

    enable_autograd_anomaly: bool = True
    anomaly_mode: str = "detect"
    enable_gradient_debugging: bool = True
    gradient_norm_threshold: float = DEFAULT_GRAD_EXPLOSION_THRESHOLD
    gradient_vanishing_threshold: float = DEFAULT_GRAD_VANISHING_THRESHOLD
    gradient_clip_threshold: float | None = None
    enable_memory_debugging: bool = True
    track_tensor_memory: bool = True
    memory_snapshot_frequency: int = 10
    enable_model_debugging: bool = True
    enable_training_debugging: bool = True
    enable_profiling: bool = False

    def __post_init__(self) -> None:
        for name in ("enable_autograd_anomaly", "enable_gradient_debugging", "enable_memory_debugging",
                     "track_tensor_memory", "enable_model_debugging", "enable_training_debugging",
                     "enable_profiling"):
            flag(getattr(self, name), name)
        if self.anomaly_mode not in ANOMALY_MODES:
            raise ValueError(f"anomaly_mode={self.anomaly_mode!r} is not valid; accepted values: "
                             f"{', '.join(ANOMALY_MODES)}")
        self.gradient_norm_threshold = positive(self.gradient_norm_threshold, "gradient_norm_threshold")
        self.gradient_vanishing_threshold = positive(self.gradient_vanishing_threshold,
                                                     "gradient_vanishing_threshold")
        if self.gradient_clip_threshold is not None:
            self.gradient_clip_threshold = positive(self.gradient_clip_threshold, "gradient_clip_threshold")
        f = self.memory_snapshot_frequency
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise ValueError(f"memory_snapshot_frequency={f!r} is not valid; accepted values: an integer >= 0")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


__all__ = ["PyTorchDebugConfig"]
