"""The seeds' debugger API (``PyTorchDebugger``), built on the same measures as the steps.

These calls are for interactive debugging and occasional checks: each reads its results to
the host once. The per-step telemetry path is :func:`torchtrace.debug_context`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterator

import torch

from torchtrace import current, files, semconv
from torchtrace.errors import NonFiniteError
from torchtrace.levels import DebugLevel, DebugMode
from torchtrace.measure import gradients as grad_measure
from torchtrace.measure import memory as mem_measure
from torchtrace.measure import tensors as tensor_measure
from torchtrace.record import readout
from torchtrace.record.history import History

ANOMALY_MODES = ("detect", "warn", "raise")


@dataclass
class DebugConfig:
    """Per-feature switches and thresholds of a :class:`PyTorchDebugger`.

    Raises:
        ValueError: from :meth:`validate`, naming the setting and the accepted values.
    """

    level: DebugLevel | str = DebugLevel.BASIC
    mode: DebugMode | str = DebugMode.NONE
    enable_anomaly_detection: bool = False
    anomaly_mode: str = "detect"
    enable_profiling: bool = False
    enable_memory_tracking: bool = True
    enable_gradient_checking: bool = True
    gradient_threshold: float = 1.0
    explosion_threshold: float = 10.0
    vanishing_threshold: float = 1e-6
    clip_on_anomaly: bool = False
    clip_max_norm: float = 1.0
    max_events: int = 1000

    def validate(self) -> "DebugConfig":
        self.level = DebugLevel.parse(self.level, "level")
        self.mode = DebugMode.parse(self.mode, "mode")
        if self.anomaly_mode not in ANOMALY_MODES:
            raise ValueError(f"anomaly_mode={self.anomaly_mode!r} is not valid; accepted values: {', '.join(ANOMALY_MODES)}")
        for name in ("gradient_threshold", "explosion_threshold", "vanishing_threshold", "clip_max_norm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ValueError(f"{name}={value!r} is not valid; accepted values: a positive finite number")
        if isinstance(self.max_events, bool) or not isinstance(self.max_events, int) or self.max_events <= 0:
            raise ValueError(f"max_events={self.max_events!r} is not valid; accepted values: a positive integer")
        if self.mode in (DebugMode.ANOMALY_DETECTION, DebugMode.FULL_DEBUG):
            self.enable_anomaly_detection = True
        if self.mode in (DebugMode.PROFILING, DebugMode.FULL_DEBUG):
            self.enable_profiling = True
        return self


class GradientReport(dict):
    """``check_gradients``'s result: a dict that also converts to the global norm.

    Keys: ``global_norm``, ``param_stats`` (name -> norm, mean, std, min, max, nan/inf counts),
    ``nonfinite_params``, ``exploded_params``, ``vanished_params``, ``anomalies``.
    ``float(report)`` is the global norm, so ``norm = debugger.check_gradients(model)`` keeps
    working as a number.
    """

    def __float__(self) -> float:
        value = self.get("global_norm")
        return float("nan") if value is None else float(value)


class PyTorchDebugger:
    """Gradient, parameter, tensor and memory checks with a bounded event timeline.

    >>> import torch, torchtrace as tt
    >>> dbg = tt.create_pytorch_debugger(enable_anomaly_detection=False)
    >>> model = torch.nn.Linear(4, 2); model(torch.ones(3, 4)).sum().backward()
    >>> round(float(dbg.check_gradients(model)), 3) > 0
    True
    """

    def __init__(self, config: DebugConfig | DebugLevel | str | None = None, logger: logging.Logger | None = None,
                 **overrides: Any) -> None:
        if isinstance(config, (DebugLevel, str)):
            overrides.setdefault("level", config)
            config = None
        config = config or DebugConfig()
        known = {f.name for f in fields(DebugConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown debugger setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        for key, value in overrides.items():
            setattr(config, key, value)
        self.config = config.validate()
        self.logger = logger or logging.getLogger("torchtrace.debugger")
        self.history = History(self.config.max_events)

    # ------------------------------------------------------------ events
    def _log_debug_event(self, event_type: str, message: str, data: dict[str, Any] | None = None,
                         level: int = logging.INFO) -> None:
        """Add an event to the timeline and to the logger at ``level``."""
        self.history.add_event(event_type, message, data)
        self.logger.log(level, "%s: %s", event_type, message)

    log_event = _log_debug_event

    # ------------------------------------------------------------ gradients
    def _grad_table(self, model: torch.nn.Module) -> tuple[list[str], list[list[float]], list[torch.Tensor]]:
        refs = [r for r in grad_measure.named_params(model) if r.param.grad is not None]
        if not refs:
            return [], [], []
        stats = torch.stack([
            torch.cat([tensor_measure.tensor_stats(r.param.grad),
                       torch.linalg.vector_norm(grad_measure.dense(r.param.grad).to(torch.float64)).reshape(1)])
            for r in refs])
        values = readout.read(stats.reshape(-1).cpu() if stats.device.type != "cpu" else stats.reshape(-1))
        width = len(tensor_measure.STAT_NAMES) + 1
        rows = [values[i * width:(i + 1) * width] for i in range(len(refs))]
        return [r.name for r in refs], rows, [r.param.grad for r in refs]

    def check_gradients(self, model: torch.nn.Module, gradient_threshold: float | None = None) -> GradientReport:
        """Global norm, per-parameter statistics and anomalies of the model's current gradients.

        ``gradient_threshold`` (default: the config's) is the global norm above which an
        explosion is reported; with ``clip_on_anomaly`` the gradients are then clipped.
        """
        threshold = self.config.gradient_threshold if gradient_threshold is None else gradient_threshold
        names, rows, _ = self._grad_table(model)
        param_stats = {}
        norms = []
        for name, row in zip(names, rows):
            s = dict(zip(tensor_measure.STAT_NAMES, row[:-1]))
            s["norm"] = row[-1]
            s["nan_count"] = int(s["nan_count"])
            s["inf_count"] = int(s["inf_count"])
            param_stats[name] = s
            norms.append(row[-1])
        total = math.sqrt(math.fsum(n * n for n in norms)) if norms else None
        if total is not None and any(not math.isfinite(n) for n in norms):
            total = float("nan") if any(math.isnan(n) for n in norms) else float("inf")
        nonfinite = [n for n, s in param_stats.items() if s["nan_count"] or s["inf_count"]]
        exploded = [n for n, s in param_stats.items() if math.isfinite(s["norm"]) and s["norm"] > self.config.explosion_threshold]
        vanished = [n for n, s in param_stats.items() if s["norm"] < self.config.vanishing_threshold]
        anomalies = []
        if nonfinite:
            anomalies.append({"kind": semconv.NONFINITE_GRAD, "params": nonfinite})
        if total is not None and math.isfinite(total) and total > threshold:
            anomalies.append({"kind": semconv.GRAD_EXPLOSION, "grad_norm": total, "threshold": threshold})
        if exploded:
            anomalies.append({"kind": semconv.GRAD_EXPLOSION, "params": exploded})
        if vanished:
            anomalies.append({"kind": semconv.GRAD_VANISHING, "params": vanished})
        report = GradientReport(global_norm=total, param_stats=param_stats, nonfinite_params=nonfinite,
                                exploded_params=exploded, vanished_params=vanished, anomalies=anomalies,
                                threshold=threshold)
        for a in anomalies:
            self._log_debug_event("gradient_anomaly", f"{a['kind']}: {a.get('params') or a.get('grad_norm')}",
                                  dict(a), logging.WARNING)
        if anomalies and self.config.clip_on_anomaly and total is not None and math.isfinite(total):
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.config.clip_max_norm)
            report["clipped_to"] = self.config.clip_max_norm
            self._log_debug_event("gradient_clipped", f"gradients clipped to norm {self.config.clip_max_norm}")
        if not anomalies:
            self._log_debug_event("gradient_check", f"gradient norm {total}", {"grad_norm": total}, logging.DEBUG)
        return report

    analyze_gradients = check_gradients

    def clip_gradients(self, model: torch.nn.Module, max_norm: float = 1.0) -> float:
        """Clip the model's gradients to ``max_norm``; returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        value = readout.read(norm.reshape(1).to(torch.float64))[0]
        self._log_debug_event("gradient_clipped", f"gradient norm {value:.4g} clipped to {max_norm}")
        return value

    def check_gradient_explosion(self, model: torch.nn.Module, threshold: float = 10.0) -> list[str]:
        """Names of parameters whose gradient norm is above ``threshold`` (or non-finite)."""
        names, rows, _ = self._grad_table(model)
        out = [n for n, r in zip(names, rows) if not math.isfinite(r[-1]) or r[-1] > threshold]
        if out:
            self._log_debug_event("gradient_explosion", f"{len(out)} parameter(s) over {threshold}",
                                  {"params": out, "threshold": threshold}, logging.WARNING)
        return out

    def check_gradient_vanishing(self, model: torch.nn.Module, threshold: float = 1e-6) -> list[str]:
        """Names of parameters whose gradient norm is below ``threshold``."""
        names, rows, _ = self._grad_table(model)
        out = [n for n, r in zip(names, rows) if r[-1] < threshold]
        if out:
            self._log_debug_event("gradient_vanishing", f"{len(out)} parameter(s) under {threshold}",
                                  {"params": out, "threshold": threshold}, logging.WARNING)
        return out

    def analyze_gradient_flow(self, model: torch.nn.Module) -> dict[str, Any]:
        """Mean and max absolute gradient per parameter, in model order, and the layers with none."""
        refs = grad_measure.named_params(model)
        with_grad = [r for r in refs if r.param.grad is not None]
        layers = []
        if with_grad:
            vals = torch.stack([torch.stack([grad_measure.dense(r.param.grad).abs().to(torch.float64).mean(),
                                             grad_measure.dense(r.param.grad).abs().to(torch.float64).max()])
                                for r in with_grad])
            flat = readout.read(vals.reshape(-1).cpu())
            for i, r in enumerate(with_grad):
                layers.append({"name": r.name, "mean_abs": flat[2 * i], "max_abs": flat[2 * i + 1]})
        no_grad = [r.name for r in refs if r.param.grad is None and r.param.requires_grad]
        zero = [l["name"] for l in layers if l["max_abs"] == 0.0]
        return {"layers": layers, "no_gradient": no_grad, "zero_gradient": zero}

    # ------------------------------------------------------------ parameters and tensors
    def analyze_tensor(self, tensor: torch.Tensor, name: str = "tensor") -> dict[str, Any]:
        """NaN/Inf counts, mean/std/min/max (over finite values), shape, dtype, bytes."""
        values = readout.read(tensor_measure.tensor_stats(tensor).cpu())
        info = tensor_measure.describe(tensor, values, name)
        if info["has_nan"] or info["has_inf"]:
            self._log_debug_event("tensor_anomaly", f"{name} holds {info['nan_count']} NaN and {info['inf_count']} Inf",
                                  {"name": name}, logging.WARNING)
        return info

    def analyze_model_parameters(self, model: torch.nn.Module) -> dict[str, Any]:
        """Counts, bytes, dtypes and devices of the parameters, with per-parameter statistics."""
        refs = grad_measure.named_params(model)
        per = {}
        if refs:
            stats = torch.stack([tensor_measure.tensor_stats(r.param) for r in refs])
            flat = readout.read(stats.reshape(-1).cpu())
            w = len(tensor_measure.STAT_NAMES)
            for i, r in enumerate(refs):
                per[r.name] = tensor_measure.describe(r.param, flat[i * w:(i + 1) * w], r.name)
        total = sum(r.param.numel() for r in refs)
        trainable = sum(r.param.numel() for r in refs if r.param.requires_grad)
        nonfinite = [n for n, d in per.items() if d["has_nan"] or d["has_inf"]]
        if nonfinite:
            self._log_debug_event("parameter_anomaly", f"{len(nonfinite)} parameter(s) non-finite",
                                  {"params": nonfinite}, logging.WARNING)
        dtypes: dict[str, int] = {}
        devices: dict[str, int] = {}
        for r in refs:
            dtypes[str(r.param.dtype).replace("torch.", "")] = dtypes.get(str(r.param.dtype).replace("torch.", ""), 0) + r.param.numel()
            devices[str(r.param.device)] = devices.get(str(r.param.device), 0) + r.param.numel()
        return {"total_parameters": total, "trainable_parameters": trainable, "frozen_parameters": total - trainable,
                "parameter_bytes": sum(r.param.numel() * r.param.element_size() for r in refs),
                "tensors": len(refs), "dtypes": dtypes, "devices": devices, "nonfinite_params": nonfinite,
                "param_stats": per}

    def check_model_parameters(self, model: torch.nn.Module) -> dict[str, Any]:
        """The parameter analysis; ``ok`` is False when any parameter is non-finite."""
        out = self.analyze_model_parameters(model)
        out["ok"] = not out["nonfinite_params"]
        return out

    def profile_memory(self, model: torch.nn.Module | None = None) -> dict[str, Any]:
        """Process and CUDA memory now, and the model's parameter and gradient bytes."""
        sample = mem_measure.sample().as_dict()
        if model is not None:
            params = list(model.parameters())
            sample["parameter_bytes"] = sum(p.numel() * p.element_size() for p in params)
            sample["gradient_bytes"] = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        self._log_debug_event("memory_profile", f"rss {sample['rss_bytes']} bytes", sample, logging.DEBUG)
        return sample

    profile_memory_usage = profile_memory

    # ------------------------------------------------------------ anomaly detection
    @contextlib.contextmanager
    def anomaly_detection(self, mode: str | None = None) -> Iterator[None]:
        """``torch.autograd.detect_anomaly`` for the block, restoring the previous state.

        Modes: ``detect`` records an anomaly error and re-raises it; ``warn`` records it,
        issues a ``RuntimeWarning`` and lets the program go on after the block; ``raise``
        also raises ``NonFiniteError`` after a block whose gradients are non-finite even
        when autograd raised nothing.
        """
        mode = mode or self.config.anomaly_mode
        if mode not in ANOMALY_MODES:
            raise ValueError(f"mode={mode!r} is not valid; accepted values: {', '.join(ANOMALY_MODES)}")
        with torch.autograd.detect_anomaly(check_nan=True):
            try:
                yield
            except RuntimeError as exc:
                self._log_debug_event("autograd_anomaly", f"{type(exc).__name__} under anomaly detection",
                                      {"mode": mode, "error": str(exc)[:500]}, logging.ERROR)
                if mode == "warn":
                    warnings.warn(f"autograd anomaly: {exc}", RuntimeWarning, stacklevel=3)
                    return
                raise

    autograd_anomaly_detection = anomaly_detection

    def check_nonfinite_gradients(self, model: torch.nn.Module) -> None:
        """Raise ``NonFiniteError`` when any gradient of ``model`` is non-finite."""
        names, rows, _ = self._grad_table(model)
        bad = [n for n, r in zip(names, rows) if not math.isfinite(r[-1])]
        if bad:
            raise NonFiniteError(f"non-finite gradients in {', '.join(bad[:8])}", kinds=[semconv.NONFINITE_GRAD])

    # ------------------------------------------------------------ profiling, memory, layers
    def profiling(self, output_file: str | os.PathLike[str] | None = None, schedule: Any = None, **options: Any):
        """A ``torch.profiler`` window over the block (or windows per ``schedule``); see :func:`torchtrace.profiling`."""
        from torchtrace.tools.profiling import profiling

        self._log_debug_event("profiling", f"profiling to {output_file or 'the run directory'}", level=logging.DEBUG)
        return profiling(output_file, schedule, **options)

    def memory_tracking(self):
        """Per-step memory samples inside the block; see :func:`torchtrace.memory_tracking`."""
        from torchtrace.tools.memory import memory_tracking

        return memory_tracking()

    def take_memory_snapshot(self, name: str | None = None, census: bool = False):
        """A named memory snapshot; ``snapshot.compare(earlier)`` gives the differences."""
        from torchtrace.tools.memory import take_memory_snapshot

        snap = take_memory_snapshot(name, census)
        self._log_debug_event("memory_snapshot", f"snapshot {snap.name}", snap.as_dict(), logging.DEBUG)
        return snap

    def compare_memory_snapshots(self, before, after) -> dict[str, Any]:
        from torchtrace.measure.snapshots import compare

        return compare(before, after)

    def track_tensor(self, tensor: torch.Tensor, name: str) -> None:
        """Watch ``tensor`` by weak reference (never keeps it alive)."""
        from torchtrace.tools.memory import track_tensor

        track_tensor(tensor, name)

    def clear_memory(self) -> dict[str, Any]:
        """``gc.collect()`` and CUDA ``empty_cache()``; returns the bytes released."""
        from torchtrace.tools.memory import clear_memory

        freed = clear_memory()
        self._log_debug_event("memory_cleared", f"released {freed}", freed, logging.DEBUG)
        return freed

    def debug_forward_pass(self, model: torch.nn.Module, inputs: Any, layer_hooks: bool = True) -> dict[str, Any]:
        """Per-layer output statistics and time; see :func:`torchtrace.debug_forward_pass`."""
        from torchtrace.tools.inspection import debug_forward_pass

        out = debug_forward_pass(model, inputs, layer_hooks=layer_hooks)
        if out["nonfinite_layers"]:
            self._log_debug_event("activation_anomaly", f"first non-finite output in {out['first_nonfinite_layer']}",
                                  {"layers": out["nonfinite_layers"]}, logging.WARNING)
        return out

    def debug_backward_pass(self, loss: torch.Tensor, model: torch.nn.Module | None = None) -> dict[str, Any]:
        """Timed backward and per-parameter gradient statistics; see :func:`torchtrace.debug_backward_pass`."""
        from torchtrace.tools.inspection import debug_backward_pass

        out = debug_backward_pass(loss, model=model)
        if out["nonfinite_params"]:
            self._log_debug_event("gradient_anomaly", f"non-finite gradients in {out['nonfinite_params'][:8]}",
                                  {"params": out["nonfinite_params"]}, logging.WARNING)
        return out

    def inspect_model(self, model: torch.nn.Module, input_shape: Any = None, **kwargs: Any) -> dict[str, Any]:
        """Layers, parameter counts, dtypes, devices and a validating forward pass; see :func:`torchtrace.inspect_model`."""
        from torchtrace.tools.inspection import inspect_model

        out = inspect_model(model, input_shape, **kwargs)
        fwd = out.get("forward")
        if fwd is not None and not fwd["ok"]:
            self._log_debug_event("shape_mismatch", f"forward fails in {fwd['failed_layer']}: {fwd['error']}",
                                  {"layer": fwd["failed_layer"]}, logging.WARNING)
        return out

    def debug_training_step(self, model: torch.nn.Module, inputs: Any, targets: Any, loss_fn: Any,
                            optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Forward statistics, loss, backward statistics and the optimizer step, in one report."""
        from torchtrace.tools.inspection import debug_training_step

        return debug_training_step(model, inputs, targets, loss_fn, optimizer)

    # ------------------------------------------------------------ summaries
    def get_debug_summary(self) -> dict[str, Any]:
        """Counts of events by type, anomalies, the last events, and the run's telemetry summary."""
        events = self.history.events()
        by_type: dict[str, int] = {}
        for e in events:
            by_type[e.event_type] = by_type.get(e.event_type, 0) + 1
        anomalies = sum(v for k, v in by_type.items() if "anomaly" in k or k in ("gradient_explosion", "gradient_vanishing"))
        rt = current.runtime(create=False)
        return {
            "total_events": self.history.totals["events"],
            "events_by_type": by_type,
            "total_anomalies": anomalies,
            "recent_events": [e.as_dict() for e in events[-20:]],
            "config": {k: (v.value if hasattr(v, "value") else v) for k, v in asdict(self.config).items()},
            "memory": mem_measure.sample().as_dict(),
            "run": rt.summary() if rt is not None else None,
        }

    def save_debug_report(self, path: str | os.PathLike[str] = "debug_report.json") -> str:
        """Write the summary and the whole timeline as strict JSON, atomically, mode 0600."""
        report = self.get_debug_summary()
        report["events"] = [e.as_dict() for e in self.history.events()]
        target = files.write_json_atomic(Path(path), report)
        self._log_debug_event("report_saved", f"debug report written to {target}", level=logging.DEBUG)
        return str(target)

    def clear_debug_data(self) -> None:
        """Forget the timeline and counts."""
        self.history.clear()


def create_pytorch_debugger(logger: logging.Logger | None = None, debug_mode: bool = True, **settings: Any) -> PyTorchDebugger:
    """A :class:`PyTorchDebugger` from keyword settings (the seeds' factory).

    ``debug_mode=False`` gives a debugger at level OFF. Other keywords are
    :class:`DebugConfig` fields (``enable_anomaly_detection``, ``explosion_threshold`` ...).
    """
    if not debug_mode:
        settings.setdefault("level", DebugLevel.OFF)
    return PyTorchDebugger(DebugConfig(), logger=logger, **settings)


@contextlib.contextmanager
def debug_training_session(model: torch.nn.Module, logger: logging.Logger | None = None, debug_mode: bool = True,
                           **settings: Any) -> Iterator[PyTorchDebugger]:
    """A debugger for a whole training session, traced as one ``training_session`` span.

    With ``enable_anomaly_detection`` the session runs under autograd anomaly detection.
    At the end a parameter check and a summary are logged.
    """
    debugger = create_pytorch_debugger(logger=logger, debug_mode=debug_mode, **settings)
    rt = current.runtime()
    span_cm = rt.tracer.start_as_current_span("training_session") if rt is not None else contextlib.nullcontext()
    with span_cm:
        anomaly = debugger.anomaly_detection() if debugger.config.enable_anomaly_detection else contextlib.nullcontext()
        debugger._log_debug_event("session_started", f"training session for {type(model).__name__}")
        try:
            with anomaly:
                yield debugger
        finally:
            check = debugger.check_model_parameters(model)
            debugger._log_debug_event("session_finished", f"{check['total_parameters']} parameters, "
                                      f"{len(check['nonfinite_params'])} non-finite")
