"""The seed debuggers' settings, validated at construction, and the rules for their arguments.

Where two seeds give one call different argument shapes, the argument's type and keyword
decide (:func:`check_arguments`); a bad value raises at once, naming the setting and what it
accepts.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from torchtrace.config import DEFAULT_GRAD_EXPLOSION_THRESHOLD, DEFAULT_GRAD_VANISHING_THRESHOLD
from torchtrace.levels import DebugLevel, DebugMode, debug_mode_setting

ANOMALY_MODES = ("detect", "warn", "raise")
ALIASES = {
    "gradient_threshold": "explosion_threshold",  # seed 000: check_gradients(model, gradient_threshold=1.0)
    "gradient_norm_threshold": "explosion_threshold",  # seed 002: PyTorchDebugConfig
    "gradient_vanishing_threshold": "vanishing_threshold",
}
_DEBUG_ONLY = ("enable_anomaly_detection", "enable_profiling")


def positive(value: object, name: str) -> float:
    """A positive finite number, or ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < math.inf:
        raise ValueError(f"{name}={value!r} is not valid; accepted values: a positive finite number")
    return float(value)


def flag(value: object, name: str, optional: bool = False) -> bool | None:
    """A bool (or None when ``optional``), or ``ValueError`` naming ``name``."""
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        accepted = "True, False or None" if optional else "True, False"
        raise ValueError(f"{name}={value!r} is not valid; accepted values: {accepted}")
    return value


@dataclass
class DebugConfig:
    """Per-feature switches and thresholds of a :class:`~torchtrace.compat.PyTorchDebugger`.

    ``debug_mode`` is the switch of the debugging-only features (anomaly detection,
    profiling, layer-by-layer forward/backward statistics); gradient checking and memory
    tracking are monitoring and follow their own switches, as seed 000's "production
    monitoring" example (``debug_mode=False`` with both on) needs. ``enable_anomaly_detection``
    and ``enable_profiling``: ``None`` (default) means available when asked for
    (``with debugger.profiling():``), ``True`` also turns them on for a whole
    :func:`debug_training_session` (and anomaly detection for every ``debug_context``
    block), ``False`` makes the contexts do nothing. Thresholds default to the one default per threshold
    (:data:`torchtrace.config.DEFAULT_GRAD_EXPLOSION_THRESHOLD`, ``..._VANISHING_...``).

    Raises:
        ValueError: from :meth:`validate`, naming the setting and the accepted values, also
            for contradictions (``debug_mode=False`` with ``enable_profiling=True``).

    >>> DebugConfig(level="advanced").validate().level
    <DebugLevel.ADVANCED: 'advanced'>
    """

    level: DebugLevel | str | None = None  # None: the configured run's level
    mode: DebugMode | str = DebugMode.NONE
    debug_mode: bool = True
    enable_anomaly_detection: bool | None = None
    anomaly_mode: str = "detect"
    enable_profiling: bool | None = None
    enable_memory_tracking: bool = True
    enable_gradient_checking: bool = True
    explosion_threshold: float = DEFAULT_GRAD_EXPLOSION_THRESHOLD
    vanishing_threshold: float = DEFAULT_GRAD_VANISHING_THRESHOLD
    clip_on_anomaly: bool = False
    clip_max_norm: float = 1.0
    max_events: int = 1000
    log_dir: str | os.PathLike[str] = "debug_logs"

    def validate(self) -> "DebugConfig":
        if self.level is not None:
            self.level = DebugLevel.parse(self.level, "level")
        mode = self.mode = DebugMode.parse(self.mode, "mode")
        flag(self.debug_mode, "debug_mode")
        if self.anomaly_mode not in ANOMALY_MODES:
            raise ValueError(f"anomaly_mode={self.anomaly_mode!r} is not valid; accepted values: "
                             f"{', '.join(ANOMALY_MODES)}")
        for name in ("explosion_threshold", "vanishing_threshold", "clip_max_norm"):
            setattr(self, name, positive(getattr(self, name), name))
        for name in ("enable_anomaly_detection", "enable_profiling"):
            flag(getattr(self, name), name, optional=True)
        for name in ("enable_memory_tracking", "enable_gradient_checking", "clip_on_anomaly"):
            flag(getattr(self, name), name)
        if isinstance(self.max_events, bool) or not isinstance(self.max_events, int) or self.max_events <= 0:
            raise ValueError(f"max_events={self.max_events!r} is not valid; accepted values: a positive integer")
        if not isinstance(self.log_dir, (str, os.PathLike)) or not str(self.log_dir):
            raise ValueError(f"log_dir={self.log_dir!r} is not valid; accepted values: a directory path")
        self._apply_mode(mode)
        return self

    def _apply_mode(self, m: DebugMode) -> None:
        """A DebugMode turns its families on; ``debug_mode=False`` refuses the debugging ones."""
        full = m is DebugMode.FULL_DEBUG
        implied = {"enable_anomaly_detection": full or m is DebugMode.ANOMALY_DETECTION,
                   "enable_profiling": full or m is DebugMode.PROFILING,
                   "enable_memory_tracking": full or m is DebugMode.MEMORY_PROFILING,
                   "enable_gradient_checking": full or m is DebugMode.GRADIENT_CHECKING}
        if not self.debug_mode:
            if m is not DebugMode.NONE:
                raise ValueError(f"debug_mode=False contradicts mode={m.value!r}; accepted: debug_mode=True "
                                 "with a mode, or debug_mode=False with mode='none'")
            for name in _DEBUG_ONLY:
                if getattr(self, name):
                    raise ValueError(f"{name}=True contradicts debug_mode=False (a debugging feature); "
                                     f"accepted: debug_mode=True, or {name}=False/None")
        for name, on in implied.items():
            if on:
                if getattr(self, name) is False:
                    raise ValueError(f"{name}=False contradicts mode={m.value!r}, which turns it on")
                setattr(self, name, True)

    def as_dict(self) -> dict[str, Any]:
        return {k: (v.value if hasattr(v, "value") else (os.fspath(v) if isinstance(v, os.PathLike) else v))
                for k, v in asdict(self).items()}


def build_config(base: DebugConfig | None, overrides: dict[str, Any]) -> DebugConfig:
    """``base`` (or defaults) with keyword ``overrides`` (seed aliases accepted), validated.

    Raises:
        TypeError: an unknown setting, naming it and listing the known ones.
    """
    config = DebugConfig(**{f.name: getattr(base, f.name) for f in fields(DebugConfig)}) if base else DebugConfig()
    known = {f.name for f in fields(DebugConfig)}
    for key, value in overrides.items():
        target = ALIASES.get(key, key)
        if target not in known:
            raise TypeError(f"unknown debugger setting {key!r}; known: {', '.join(sorted(known | set(ALIASES)))}")
        setattr(config, target, value)
    return config.validate()


def is_logger(obj: object) -> bool:
    """A logging.Logger/LoggerAdapter, or a seed-style logger (log_info/log_warning/log_error)."""
    return isinstance(obj, (logging.Logger, logging.LoggerAdapter)) or any(
        callable(getattr(obj, name, None)) for name in ("log_info", "log_warning", "log_error", "log_training_event"))


def check_arguments(second: object = None, *, gradient_threshold: object = None, threshold: object = None,
                    step: object = None, loss: torch.Tensor | float | None = None
                    ) -> tuple[float | None, int | None, torch.Tensor | float | None]:
    """``check_gradients(model, second, ...)``: which seed's form, by the argument's type and keyword.

    Positional: an ``int`` is the step (seed 002: ``check_gradients(model, step)``), a tensor
    is the loss (seed 003: ``check_gradients(model, loss)``), a float is the threshold (seed
    000's signature). By keyword: ``gradient_threshold=``/``threshold=`` (a positive number),
    ``step=`` (an int), ``loss=`` (a tensor or a number). A tensor or an integer is never
    taken as a threshold positionally; a tensor is refused as a threshold by keyword too.

    Returns ``(threshold or None, step or None, loss or None)``.

    Raises:
        TypeError: a ``bool``, an unsupported type, a tensor given as the threshold, or the
            same thing given twice; the message shows the accepted calls.
    """
    usage = ("accepted: check_gradients(model), (model, step:int), (model, loss:Tensor), "
             "(model, gradient_threshold=float)")
    if gradient_threshold is not None and threshold is not None:
        raise TypeError("check_gradients: give gradient_threshold= or threshold=, not both")
    by_kw = gradient_threshold if gradient_threshold is not None else threshold
    if by_kw is not None and (isinstance(by_kw, (bool, torch.Tensor)) or not isinstance(by_kw, numbers.Real)):
        raise TypeError(f"check_gradients: gradient_threshold={by_kw!r} is not a number; {usage}")
    thr = positive(by_kw, "gradient_threshold") if by_kw is not None else None
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
        raise TypeError(f"check_gradients: step={step!r} is not an integer; {usage}")
    # A numpy integer becomes a Python int, as the positional step does.
    step_number = int(step) if isinstance(step, numbers.Integral) else None
    if second is None:
        return thr, step_number, loss
    if isinstance(second, bool):
        raise TypeError(f"check_gradients: the second argument {second!r} is a bool; {usage}")
    if isinstance(second, torch.Tensor):
        if loss is not None:
            raise TypeError(f"check_gradients: the loss was given twice; {usage}")
        return thr, step_number, second
    if isinstance(second, numbers.Integral):
        if step is not None:
            raise TypeError(f"check_gradients: the step was given twice; {usage}")
        return thr, int(second), loss
    if isinstance(second, numbers.Real):
        if thr is not None:
            raise TypeError(f"check_gradients: the threshold was given twice; {usage}")
        return positive(second, "gradient_threshold"), step_number, loss
    raise TypeError(f"check_gradients: the second argument has type {type(second).__name__}; {usage}")


__all__ = ["ANOMALY_MODES", "DebugConfig", "build_config", "check_arguments", "debug_mode_setting", "flag",
           "is_logger", "positive"]
