"""Seed 001's ``TrainingDebugger`` / ``DiffusionModelDebugger`` and seed 002's ``TrainingDebugger``.

Every monitored training step is a torchtrace step (span ``training_step`` or
``debug_training_step``, the step metrics, a report entry); a diffusion step is a
``torchtrace.loop_step`` span event.

>>> import torch
>>> from torchtrace.levels import DebugLevel
>>> dbg = TrainingDebugger(DebugLevel.ADVANCED)
>>> m = torch.nn.Linear(2, 1); loss = m(torch.ones(1, 2)).sum(); loss.backward()
>>> dbg.monitor_training_step(m, loss, 0)["anomalies"]
[]
>>> dbg.get_training_summary()["anomaly_rate"]
0.0
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import torch

from torchtrace import semconv
from torchtrace.compat import checks, steps
from torchtrace.compat.results import Result
from torchtrace.compat.settings import DebugConfig
from torchtrace.compat.timeline import Timeline, make_sink
from torchtrace.compat.toolconfig import PyTorchDebugConfig
from torchtrace.errors import get_logger
from torchtrace.levels import DebugLevel
from torchtrace.measure import memory as mem_measure
from torchtrace.record.monitor import TrainingMonitor
from torchtrace.tools import inspection, memory, pipeline

_logger = get_logger("torchtrace.debugger")

# The monitor's anomaly kinds as the seeds' event types, each of which counts in
# ``total_anomalies`` (:data:`torchtrace.compat.timeline.ANOMALY_EVENTS`).
_EVENT_TYPES = {semconv.GRAD_EXPLOSION: "gradient_explosion", semconv.GRAD_VANISHING: "gradient_vanishing",
                semconv.NONFINITE_GRAD: "nonfinite_gradient", semconv.NONFINITE_LOSS: "loss_anomaly",
                semconv.LOSS_SPIKE: "loss_spike"}


def _split(first: object) -> tuple[DebugLevel | None, PyTorchDebugConfig | DebugConfig | None, int | None]:
    """``(level, config, window)`` from the first positional argument, by type."""
    if first is None:
        return None, None, None
    if isinstance(first, (DebugLevel, str)):
        return DebugLevel.parse(first, "level"), None, None
    if isinstance(first, (PyTorchDebugConfig, DebugConfig)):
        return None, first, None
    if isinstance(first, int) and not isinstance(first, bool):
        return None, None, first
    raise TypeError(f"TrainingDebugger: the first argument must be a DebugLevel, a PyTorchDebugConfig or the "
                    f"window (int); got {type(first).__name__}")


def _first(given: Any, fallback: Any) -> Any:
    """``given`` unless it is None: a 0 the user gave is judged, not replaced by the default."""
    return given if given is not None else fallback


def _thresholds(config: PyTorchDebugConfig | DebugConfig | None) -> tuple[float | None, float | None]:
    if isinstance(config, PyTorchDebugConfig):
        return config.gradient_norm_threshold, config.gradient_vanishing_threshold
    if isinstance(config, DebugConfig):
        return config.explosion_threshold, config.vanishing_threshold
    return None, None


class TrainingDebugger(TrainingMonitor):
    """A training monitor whose steps are torchtrace steps.

    ``TrainingDebugger(DebugLevel.ADVANCED)`` (seed 001), ``TrainingDebugger(PyTorchDebugConfig(...))``
    (seed 002), or :class:`~torchtrace.TrainingMonitor`'s keywords. The level is the level of
    the steps it opens and of its own checks: OFF measures nothing; BASIC judges the loss and
    the global gradient norm (one host read); ADVANCED also names the tensors over/under the
    thresholds and samples memory; EXTREME also keeps every step's result in
    :attr:`step_history`. Anomaly counts and rates: :meth:`get_training_summary`.
    """

    def __init__(self, level: DebugLevel | str | PyTorchDebugConfig | DebugConfig | int | None = None, *,
                 config: PyTorchDebugConfig | DebugConfig | None = None, logger: object = None, window: int = 50,
                 spike_factor: float = 3.0, min_history: int = 5, explosion_threshold: float | None = None,
                 vanishing_threshold: float | None = None, max_events: int = 1000) -> None:
        lvl, cfg, win = _split(level)
        if cfg is not None and config is not None:
            raise TypeError("TrainingDebugger: config was given twice")
        self.config = cfg if cfg is not None else config
        explode, vanish = _thresholds(self.config)
        given = (("explosion_threshold", _first(explosion_threshold, explode)),
                 ("vanishing_threshold", _first(vanishing_threshold, vanish)))
        super().__init__(_first(win, window), spike_factor, min_history,
                         **{k: v for k, v in given if v is not None})  # TrainingMonitor judges each value
        self.level = lvl
        self.timeline = Timeline(max_events, [make_sink(logger if logger is not None else _logger)])
        self.step_history: collections.deque[dict[str, Any]] = collections.deque(maxlen=100_000)
        self._in_step = False
        self._left_at: float | None = None  # when the last monitor-only step was left (perf_counter)

    # ------------------------------------------------------------ seed 001
    def monitor_training_step(self, model: torch.nn.Module | None, loss: object, step: int | None = None) -> Result:
        """Judge one step after ``backward()``: a torchtrace step ``training_step`` records the
        loss and the gradients (its span covers this call); returns the step's numbers and
        anomaly kinds. Loss spikes are judged here only (the step has no spike rule).

        Called outside any step, the time since the previous call (the loop's update, loading,
        forward and backward) is booked as training, not as data wait (:func:`steps.book_loop`)."""
        if self.level is DebugLevel.OFF:
            return Result(step=step, loss=None, grad_norm=None, anomalies=[], enabled=False)
        monitor_only = steps.active_step() is None  # not inside a step the user opened
        if monitor_only:
            steps.book_loop(self._left_at, "training_step")  # the loop since the last call: training
        try:
            with steps.open_step("training_step", model=model, step=step, level=self.level):
                self._in_step = steps.share_with_step(model, loss)
                try:
                    info = Result(super().monitor_training_step(model, loss, step), enabled=True)
                finally:
                    self._in_step = False
        finally:
            if monitor_only:
                self._left_at = time.perf_counter()
        return self._detail(info, model)

    def _report(self, kinds: list[str], step: int, loss: float | None, grad_norm: float | None) -> None:
        steps.report(kinds, "training_step", step=step, loss=loss, grad_norm=grad_norm, in_step=self._in_step)
        for kind in kinds:
            self.timeline.log(_EVENT_TYPES.get(kind, kind), f"{kind} at step {step}",
                              {"kind": kind, "step": step, "loss": str(loss), "grad_norm": str(grad_norm)},
                              logging.WARNING)

    def _detail(self, info: Result, model: torch.nn.Module | None) -> Result:
        if self.level in (DebugLevel.ADVANCED, DebugLevel.EXTREME):
            if model is not None:
                # The tensors the core's rules name (record/rules.py, per tensor as at ADVANCED).
                report = checks.gradient_report(model, self.explosion_threshold, self.vanishing_threshold)
                info["exploded_params"] = report["exploded_params"]
                info["vanished_params"] = report["vanished_params"]
            info["memory"] = mem_measure.sample().as_dict()
        if self.level is DebugLevel.EXTREME:
            self.step_history.append(dict(info))
        return info

    def get_training_summary(self) -> Result:
        """``total_steps``, ``anomaly_steps``, ``gradient_explosions``, ``gradient_vanishing``,
        ``nonfinite_gradients``, ``loss_anomalies``, ``loss_spikes`` and their ``*_rate``s."""
        return Result(super().get_training_summary())

    def get_debug_summary(self) -> Result:
        """Seed 001's debugger summary: ``total_anomalies``, ``debug_history_length`` and the rates."""
        s = self.get_training_summary()
        return Result(total_anomalies=self.timeline.anomalies(), debug_history_length=len(self.timeline.events()),
                      total_steps=s["total_steps"], anomaly_rate=s["anomaly_rate"],
                      gradient_explosion_rate=s["gradient_explosion_rate"], training=s)

    def clear_debug_history(self) -> None:
        """Forget counts, the loss window and the events."""
        self.reset()
        self.timeline.clear()
        self.step_history.clear()

    # ------------------------------------------------------------ seed 002 (and seed 000's order)
    def debug_training_step(self, model: torch.nn.Module, *args: object, **kwargs: object) -> Result:
        """One training step, inspected, as a torchtrace step ``debug_training_step``.

        Seed 002's order ``(model, optimizer, loss_fn, inputs, targets, step)`` and seed 000's
        ``(model, inputs, targets, loss_fn, optimizer)`` are both accepted (told apart by
        where the optimizer is), or keywords. The step's loss and gradient norm also count in
        :meth:`get_training_summary`. With a :class:`PyTorchDebugConfig`: training debugging
        off runs the step plainly; a memory snapshot every ``memory_snapshot_frequency`` steps.
        """
        a = _step_arguments(model, args, kwargs)
        cfg = self.config if isinstance(self.config, PyTorchDebugConfig) else None
        inspect = cfg is None or cfg.enable_training_debugging
        checking = inspect and (cfg is None or cfg.enable_gradient_debugging)
        with steps.open_step("debug_training_step", model=model, optimizer=a["optimizer"], step=a["step"],
                             level=self.level, inputs=(a["inputs"], a["targets"])):
            out = Result(inspection.debug_training_step(
                model, a["inputs"], a["targets"], a["loss_fn"], a["optimizer"], layer_hooks=inspect,
                backward_stats=inspect, on_loss=lambda loss: steps.share_with_step(model, loss),
                before_step=(lambda: self._gradient_check(model, cfg)) if checking else None))
        grads = out.pop("before_step", None)
        out["gradient_check"] = grads
        out["step"] = a["step"]
        if a["optimizer"] is not None and inspect:
            # Seed 002's "Optimizer state analysis", after the update the step made.
            out["optimizer_state"] = Result(inspection.optimizer_state(a["optimizer"]))
        self.record_step(out["loss"], grads["global_norm"] if grads is not None else None, a["step"])
        if cfg is not None and cfg.enable_memory_debugging and cfg.memory_snapshot_frequency and a["step"] is not None \
                and a["step"] % cfg.memory_snapshot_frequency == 0:
            out["memory_snapshot"] = memory.take_memory_snapshot(f"step_{a['step']}").as_dict()
        return out

    def _gradient_check(self, model: torch.nn.Module, cfg: PyTorchDebugConfig | None) -> Result:
        report = checks.gradient_report(model, self.explosion_threshold, self.vanishing_threshold)
        clip = cfg.gradient_clip_threshold if cfg is not None else None
        if clip is not None and report.is_finite() and any(a["kind"] == semconv.GRAD_EXPLOSION
                                                           for a in report["anomalies"]):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            report["clipped_to"] = clip
        return report


def _step_arguments(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    if args and isinstance(args[0], torch.optim.Optimizer):
        names = ("optimizer", "loss_fn", "inputs", "targets", "step")
    else:
        names = ("inputs", "targets", "loss_fn", "optimizer", "step")
    if len(args) > len(names):
        raise TypeError(f"debug_training_step takes at most {len(names) + 1} positional arguments")
    out = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names:
            raise TypeError(f"debug_training_step: unknown argument {key!r}; accepted: model, {', '.join(names)}")
        if key in out:
            raise TypeError(f"debug_training_step: {key} was given twice")
        out[key] = value
    for key in ("inputs", "targets", "loss_fn"):
        if key not in out:
            raise TypeError(f"debug_training_step: missing {key}=")
    out.setdefault("optimizer", None)
    out.setdefault("step", None)
    if not callable(out["loss_fn"]):
        raise TypeError(f"debug_training_step: loss_fn= must be callable, got {type(out['loss_fn']).__name__}")
    return out


class DiffusionModelDebugger:
    """Seed 001's diffusion debugger, for any object holding several modules.

    ``analyze_diffusion_pipeline(pipeline)`` counts parameters per component (attributes that
    are modules, and a diffusers-style ``components`` dict); ``monitor_diffusion_step(pipeline,
    step, latents)`` records the latents' statistics as a ``torchtrace.loop_step`` span event
    (a NaN/Inf counts as ``nonfinite_output``). Level OFF measures nothing; ADVANCED and
    EXTREME add a memory sample to each step's result.
    """

    def __init__(self, level: DebugLevel | str = DebugLevel.BASIC, logger: object = None, name: str = "diffusion",
                 max_events: int = 1000) -> None:
        self.level = DebugLevel.parse(level, "level")
        self.name = name
        self.timeline = Timeline(max_events, [make_sink(logger if logger is not None else _logger)])
        self.steps_monitored = 0
        self.pipelines_analyzed = 0
        self.last_step: Result | None = None

    def analyze_diffusion_pipeline(self, pipeline_obj: object) -> Result:
        """``total_parameters``, ``trainable_parameters``, ``parameter_bytes``, ``component_count``
        and ``components`` (name -> parameters, dtypes, devices, training flag...)."""
        out = Result(pipeline.analyze_pipeline(pipeline_obj))
        out["components"] = {k: Result(v) for k, v in out["components"].items()}
        if out["component_count"] == 0:
            raise TypeError(f"analyze_diffusion_pipeline: {type(pipeline_obj).__name__} holds no nn.Module "
                            "(expected attributes such as unet, vae, text_encoder, or a components dict)")
        self.pipelines_analyzed += 1
        self.timeline.log("pipeline_analyzed", f"{out['component_count']} components, {out['total_parameters']} "
                          "parameters", {"components": list(out["components"])}, logging.DEBUG)
        return out

    def monitor_diffusion_step(self, pipeline_obj: object, step: int, latents: torch.Tensor) -> Result:
        """Statistics of ``latents`` at ``step`` (mean, std, min, max, NaN/Inf counts, ``nonfinite``)."""
        if self.level is DebugLevel.OFF:
            return Result(name=self.name, step=step, nonfinite=False, enabled=False)
        if not isinstance(latents, torch.Tensor):
            raise TypeError(f"monitor_diffusion_step: latents must be a tensor, got {type(latents).__name__}")
        out = Result(pipeline.monitor_loop_step(self.name, step, latents), enabled=True,
                     pipeline=type(pipeline_obj).__name__)
        if self.level in (DebugLevel.ADVANCED, DebugLevel.EXTREME):
            out["memory"] = mem_measure.sample().as_dict()
        self.steps_monitored += 1
        self.last_step = out
        if out["nonfinite"]:
            self.timeline.log("diffusion_anomaly", f"latents hold NaN/Inf at step {step}",
                              {"step": step, "nan_count": out["nan_count"], "inf_count": out["inf_count"]},
                              logging.WARNING)
        return out

    def get_debug_summary(self) -> Result:
        """``total_anomalies``, ``debug_history_length``, ``steps_monitored``, ``pipelines_analyzed``."""
        return Result(total_anomalies=self.timeline.anomalies(), debug_history_length=len(self.timeline.events()),
                      steps_monitored=self.steps_monitored, pipelines_analyzed=self.pipelines_analyzed,
                      last_step=self.last_step)

    def clear_debug_history(self) -> None:
        self.timeline.clear()
        self.steps_monitored = 0
        self.pipelines_analyzed = 0
        self.last_step = None


__all__ = ["DiffusionModelDebugger", "TrainingDebugger"]
