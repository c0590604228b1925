"""Seed 002's tools: ``AutogradAnomalyDetector``, ``GradientDebugger``, ``PyTorchMemoryDebugger``,
``ModelDebugger`` and the ``PyTorchDebugManager`` holding one of each (and a ``TrainingDebugger``).

Each is a thin facade over the core; each honours its :class:`PyTorchDebugConfig` switch.

>>> import torch
>>> manager = PyTorchDebugManager()
>>> model = torch.nn.Linear(3, 1)
>>> with manager.anomaly_detector.detect_anomaly():
...     model(torch.ones(2, 3)).sum().backward()
>>> manager.gradient_debugger.check_gradients(model)["gradient_anomalies"]
[]
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch

from torchtrace.compat import checks, steps
from torchtrace.compat.results import GradientReport, Result
from torchtrace.compat.settings import check_arguments, positive
from torchtrace.compat.timeline import Timeline, make_sink
from torchtrace.compat.toolconfig import PyTorchDebugConfig
from torchtrace.compat.training import TrainingDebugger
from torchtrace.errors import get_logger
from torchtrace.forensics.anomaly import anomaly_detection
from torchtrace.measure import memory as mem_measure
from torchtrace.measure.snapshots import MemorySnapshot, tracker
from torchtrace.record.growth import DEFAULT_THRESHOLD
from torchtrace.tools import inspection, memory
from torchtrace.tools.profiling import profiling

_logger = get_logger("torchtrace.debugger")


def _config(config: PyTorchDebugConfig | None) -> PyTorchDebugConfig:
    if config is None:
        return PyTorchDebugConfig()
    if not isinstance(config, PyTorchDebugConfig):
        raise TypeError(f"config= must be a PyTorchDebugConfig, got {type(config).__name__}")
    return config


class AutogradAnomalyDetector:
    """``detect_anomaly()``: autograd anomaly detection over a block, in the config's mode
    (detect, warn, raise: raise gives :class:`~torchtrace.NonFiniteError`). Off when
    ``enable_autograd_anomaly=False``. ``anomalies`` lists what was caught."""

    def __init__(self, config: PyTorchDebugConfig | None = None) -> None:
        self.config = _config(config)
        self.anomalies: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def detect_anomaly(self, mode: str | None = None) -> Iterator[None]:
        try:
            with anomaly_detection(mode=mode or self.config.anomaly_mode, enabled=self.config.enable_autograd_anomaly):
                yield
        except Exception as exc:
            self.anomalies.append({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"})
            raise


class GradientDebugger:
    """Gradient checks: ``check_gradients(model[, step])``, ``analyze_gradient_flow(model)``,
    ``clip_gradients(model, max_norm)``. With ``gradient_clip_threshold`` set, a check that finds
    an explosion clips to it."""

    def __init__(self, config: PyTorchDebugConfig | None = None) -> None:
        self.config = _config(config)
        self.history: list[Result] = []
        self.anomaly_count = 0
        self.last_flow: Result | None = None  # the latest analyze_gradient_flow, for the report

    def check_gradients(self, model: torch.nn.Module, second: object = None, **kwargs: Any) -> GradientReport:
        """Seed 002's ``check_gradients(model, step)`` (also the loss/threshold forms)."""
        thr, step, loss = check_arguments(second, **kwargs)
        if not self.config.enable_gradient_debugging:
            return checks.disabled_gradient_report("enable_gradient_debugging=False")
        report = checks.gradient_report(model, thr or self.config.gradient_norm_threshold,
                                        self.config.gradient_vanishing_threshold)
        report["step"] = step
        in_step = steps.share_with_step(model, loss)
        kinds = [a["kind"] for a in report["anomalies"]]
        steps.report(kinds, "check_gradients", step=step, grad_norm=report["global_norm"], in_step=in_step)
        clip = self.config.gradient_clip_threshold
        if clip is not None and report.is_finite() and "grad_explosion" in kinds:
            report["norm_before_clipping"] = report["global_norm"]
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            report["clipped_to"] = clip
        self.anomaly_count += bool(kinds)
        self.history.append(Result({k: v for k, v in report.items() if k not in ("param_stats", "parameter_stats")}))
        del self.history[:-1000]
        return report

    def analyze_gradient_flow(self, model: torch.nn.Module) -> Result:
        if not self.config.enable_gradient_debugging:
            return Result(layers=[], no_gradient=[], zero_gradient=[], enabled=False)
        self.last_flow = checks.gradient_flow(model)
        return self.last_flow

    def clip_gradients(self, model: torch.nn.Module, max_norm: float = 1.0) -> float | None:
        """Clip to ``max_norm`` (an explicit request: done whatever the switches); returns the norm before."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), positive(max_norm, "max_norm"))
        return steps.loss_value(norm)


SNAPSHOT_LEAK_WINDOW = 8
"""Snapshots the leak rule looks back over (as ``PyTorchDebugger.profile_memory``'s calls)."""
SNAPSHOT_LEAK_WARMUP = 4
"""First snapshots the leak rule ignores (optimizer state and caches fill then)."""


class PyTorchMemoryDebugger:
    """``track_tensor``, ``take_memory_snapshot``, ``clear_memory`` over the core memory tools,
    and seed 002's "Detects memory leaks": :meth:`trend` applies the leak detector's rule
    (:func:`torchtrace.tools.memory.sustained_growth`) to the bytes in use at each snapshot."""

    def __init__(self, config: PyTorchDebugConfig | None = None) -> None:
        self.config = _config(config)
        self.snapshots: list[MemorySnapshot] = []
        self.in_use: list[int | None] = []  # heap bytes in use at each snapshot (RSS where glibc's count is missing)
        self.leak_warned = False

    def track_tensor(self, tensor: torch.Tensor, name: str) -> bool:
        """Watch ``tensor`` by weak reference; False (nothing done) when tracking is off."""
        if not (self.config.enable_memory_debugging and self.config.track_tensor_memory):
            return False
        memory.track_tensor(tensor, name)
        return True

    def take_memory_snapshot(self, name: str | None = None, census: bool = False) -> MemorySnapshot | None:
        """A named snapshot (None when memory debugging is off)."""
        if not self.config.enable_memory_debugging:
            return None
        snap = memory.take_memory_snapshot(name, census)
        self.snapshots.append(snap)
        del self.snapshots[:-1000]
        heap = mem_measure.heap_in_use_bytes()
        self.in_use.append(heap if heap is not None else snap.memory["rss_bytes"])
        del self.in_use[:-1000]
        return snap

    def clear_memory(self) -> dict[str, Any]:
        """``gc.collect()`` and CUDA ``empty_cache()`` (an explicit request: always done)."""
        return memory.clear_memory()

    def trend(self) -> Result:
        """RSS from the first to the last snapshot (``rss_change_bytes``), and ``leaks``: a
        sentence when the bytes in use grew by the leak detector's rule (a sustained robust
        slope over the last :data:`SNAPSHOT_LEAK_WINDOW` snapshots; raw growth is not a
        leak), with ``leak_bytes_per_snapshot`` (None without a leak). A leak is logged once."""
        slope = memory.sustained_growth(self.in_use, SNAPSHOT_LEAK_WINDOW, DEFAULT_THRESHOLD, SNAPSHOT_LEAK_WARMUP)
        leaks = [] if slope is None else [
            f"memory in use grew {slope / 2 ** 20:.2f} MB per snapshot over the last {SNAPSHOT_LEAK_WINDOW} "
            "snapshots (the leak detector's rule)"]
        if leaks and not self.leak_warned:
            self.leak_warned = True
            _logger.warning("memory leak: %s", leaks[0])
        change = None
        if len(self.snapshots) >= 2:
            first, last = self.snapshots[0].memory["rss_bytes"], self.snapshots[-1].memory["rss_bytes"]
            if first is not None and last is not None:
                change = last - first
        return Result(snapshots=len(self.snapshots), rss_change_bytes=change, leaks=leaks,
                      leak_bytes_per_snapshot=slope)


class ModelDebugger:
    """``inspect_model(model, input_shape)`` and the seed's ``_validate_model_inputs``."""

    def __init__(self, config: PyTorchDebugConfig | None = None) -> None:
        self.config = _config(config)
        self.inspections: list[Result] = []

    def inspect_model(self, model: torch.nn.Module, input_shape: tuple[int, ...] | list[int] | None = None,
                      **kwargs: Any) -> Result:
        if not self.config.enable_model_debugging:
            return Result(enabled=False)
        out = Result(inspection.inspect_model(model, input_shape, **kwargs), enabled=True)
        params = checks.analyze_parameters(model)
        out["parameter_anomalies"] = params.summary["nonfinite_params"]
        # Seed 002's report: "Model Information: parameter statistics, layer analysis, input validation".
        kept = Result({k: out[k] for k in ("model", "total_parameters", "trainable_parameters")})
        kept["layers"] = out["layers"]
        kept["parameter_anomalies"] = out["parameter_anomalies"]
        kept["input_validation"] = out.get("forward")
        self.inspections.append(kept)
        del self.inspections[:-100]
        return out

    def _validate_model_inputs(self, model: torch.nn.Module, input_shape: tuple[int, ...] | list[int] | None,
                               **kwargs: Any) -> Result:
        """The validating forward pass on a dummy input: ``ok``, the output shape, or the layer
        where it fails with its input shapes."""
        return Result(inspection.inspect_model(model, input_shape, **kwargs)["forward"])


class PyTorchDebugManager:
    """One of each seed 002 tool, sharing one :class:`PyTorchDebugConfig`.

    Attributes: ``anomaly_detector``, ``gradient_debugger``, ``memory_debugger``,
    ``model_debugger``, ``training_debugger``. ``profiling()`` profiles a block when
    ``enable_profiling``; ``generate_comprehensive_report()`` gathers everything.
    """

    def __init__(self, config: PyTorchDebugConfig | None = None, logger: object = None) -> None:
        self.config = _config(config)
        self.anomaly_detector = AutogradAnomalyDetector(self.config)
        self.gradient_debugger = GradientDebugger(self.config)
        self.memory_debugger = PyTorchMemoryDebugger(self.config)
        self.model_debugger = ModelDebugger(self.config)
        self.training_debugger = TrainingDebugger(self.config, logger=logger)
        self.timeline = Timeline(1000, [make_sink(logger if logger is not None else _logger)])
        self.profiles: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def profiling(self, output_file: str | os.PathLike[str] | None = None, **options: Any) -> Iterator[dict[str, Any]]:
        """A ``torch.profiler`` Chrome trace of the block (see :func:`torchtrace.profiling`);
        nothing when ``enable_profiling`` is False (``result["path"]`` None)."""
        with profiling(output_file, enabled=self.config.enable_profiling, **options) as result:
            yield result
        if result.get("path"):
            self.profiles.append({"path": result["path"],
                                  "top_ops": (result.get("windows") or [{}])[-1].get("top_ops")})

    def generate_comprehensive_report(self) -> Result:
        """Anomaly detection, gradient analysis, memory, model, training, CUDA and profiling sections."""
        grads = self.gradient_debugger.history
        cuda = torch.cuda.is_available()
        return Result(
            anomaly_detection={"enabled": self.config.enable_autograd_anomaly, "mode": self.config.anomaly_mode,
                               "total_anomalies": len(self.anomaly_detector.anomalies),
                               "anomaly_history": list(self.anomaly_detector.anomalies)},
            gradient_analysis={"checks": len(grads), "steps_with_anomalies": self.gradient_debugger.anomaly_count,
                               "last": grads[-1] if grads else None,
                               "anomalies": [a for g in grads for a in g["gradient_anomalies"]][-100:],
                               "flow": self.gradient_debugger.last_flow},
            memory={"snapshots": [s.as_dict() for s in self.memory_debugger.snapshots],
                    "tracked_tensors": tracker().tracked(),
                    "trend": self.memory_debugger.trend()},
            model={"inspections": list(self.model_debugger.inspections)},
            training=self.training_debugger.get_training_summary(),
            cuda={"available": cuda, "device": torch.cuda.get_device_name() if cuda else None,
                  "memory": memory.memory_profile() if cuda else None},
            profiling={"enabled": self.config.enable_profiling, "traces": list(self.profiles)},
            config=self.config.as_dict())


__all__ = ["AutogradAnomalyDetector", "GradientDebugger", "ModelDebugger", "PyTorchDebugManager",
           "PyTorchMemoryDebugger"]
