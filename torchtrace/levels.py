"""Debug levels, debug modes and optimization modes, and what each turns on."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass


class _ParseEnum(str, enum.Enum):
    """A string enum that parses itself case-insensitively with a helpful error."""

    @classmethod
    def parse(cls, value: "str | _ParseEnum", setting: str):
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for member in cls:
                if member.value == key or member.name.lower() == key:
                    return member
        accepted = ", ".join(m.value for m in cls)
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: {accepted}")


class DebugLevel(_ParseEnum):
    """How much torchtrace measures on every step.

    >>> DebugLevel.parse("advanced", "level")
    <DebugLevel.ADVANCED: 'advanced'>
    """

    OFF = "off"
    BASIC = "basic"
    ADVANCED = "advanced"
    EXTREME = "extreme"


class DebugMode(_ParseEnum):
    """One family of checks turned on on top of a level (the seeds' debug modes)."""

    NONE = "none"
    ANOMALY_DETECTION = "anomaly_detection"
    PROFILING = "profiling"
    MEMORY_PROFILING = "memory_profiling"
    GRADIENT_CHECKING = "gradient_checking"
    FULL_DEBUG = "full_debug"


class OptimizationMode(_ParseEnum):
    """What ``optimize_model`` applies."""

    NONE = "none"
    AMP = "amp"
    COMPILATION = "compilation"
    MEMORY_EFFICIENT = "memory_efficient"
    FULL_OPTIMIZATION = "full_optimization"


@dataclass(frozen=True)
class Features:
    """The per-step measurements a level and mode switch on."""

    enabled: bool = True
    grad_stats: bool = True  # global norm, per-tensor norms, non-finite count
    param_stats: bool = False  # per-parameter finiteness and norms, update ratio
    cuda_memory: bool = True  # allocator counters: host-side, no synchronisation
    leak_detector: bool = False
    activations: bool = False  # per-layer output statistics every step
    anomaly_mode: bool = False  # torch.autograd.detect_anomaly around the operation
    profiling: bool = False
    memory_profiling: bool = False
    forensics: bool = True  # replay a non-finite step to find the producing module
    throughput: bool = True  # batch size, FLOPs per input shape, learning rate, phases, goodput

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def for_level(level: DebugLevel, mode: DebugMode = DebugMode.NONE, throughput: bool = True) -> "Features":
        """The features of ``level`` and ``mode``: one object per combination, so that the probe
        lists made for a step's features (``ProbeSet``) serve every step with the same ones."""
        if level is DebugLevel.OFF:
            return Features(enabled=False, grad_stats=False, cuda_memory=False, forensics=False, throughput=False)
        adv = level in (DebugLevel.ADVANCED, DebugLevel.EXTREME)
        full = mode is DebugMode.FULL_DEBUG
        return Features(
            grad_stats=True,
            param_stats=adv or full or mode is DebugMode.GRADIENT_CHECKING,
            leak_detector=adv or full or mode is DebugMode.MEMORY_PROFILING,
            activations=level is DebugLevel.EXTREME,
            anomaly_mode=full or mode is DebugMode.ANOMALY_DETECTION,
            profiling=full or mode is DebugMode.PROFILING,
            memory_profiling=full or mode is DebugMode.MEMORY_PROFILING,
            throughput=throughput,
        )


def debug_mode_setting(value: object) -> tuple[bool | None, DebugMode | None]:
    """``debug_mode=`` by type: a bool (seed 000) or a DebugMode / its name (seed 003).
    Returns (on, mode); ``DebugMode.NONE`` ("no debugging") is ``debug_mode=False``.

    >>> debug_mode_setting(True), debug_mode_setting("anomaly_detection")
    ((True, None), (True, <DebugMode.ANOMALY_DETECTION: 'anomaly_detection'>))
    """
    if value is None:
        return None, None
    if isinstance(value, bool):
        return value, None
    if isinstance(value, (DebugMode, str)):
        mode = DebugMode.parse(value, "debug_mode")
        return mode is not DebugMode.NONE, mode
    raise ValueError(f"debug_mode={value!r} is not valid; accepted values: True, False, or a DebugMode "
                     f"({', '.join(m.value for m in DebugMode)})")
