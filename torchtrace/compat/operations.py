"""``PyTorchDebugger``'s operations (seed 003's ``debug_context`` and ``optimize_model``) and its
summary, report and clearing. A mixin; the class is :class:`torchtrace.compat.PyTorchDebugger`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from torchtrace import current, files
from torchtrace.compat import steps
from torchtrace.compat.records import DebugMetrics, OptimizationMetrics
from torchtrace.compat.results import Result
from torchtrace.compat.settings import DebugConfig
from torchtrace.forensics.anomaly import anomaly_detection as core_anomaly_detection
from torchtrace.levels import DebugMode, OptimizationMode
from torchtrace.measure import memory as mem_measure
from torchtrace.optimize import optimize_model as core_optimize_model

_ANOMALY_MODES = (DebugMode.ANOMALY_DETECTION, DebugMode.FULL_DEBUG)


def pick_mode(optimization_mode: OptimizationMode | str | None, mode: OptimizationMode | str | None,
              default: OptimizationMode) -> OptimizationMode:
    """``optimization_mode=`` (the seeds) or ``mode=`` (torchtrace); both only when they agree."""
    if optimization_mode is not None and mode is not None:
        a, b = OptimizationMode.parse(optimization_mode, "optimization_mode"), OptimizationMode.parse(mode, "mode")
        if a is not b:
            raise ValueError(f"optimization_mode={a.value!r} contradicts mode={b.value!r}; give one of them")
    chosen = optimization_mode if optimization_mode is not None else mode
    return default if chosen is None else OptimizationMode.parse(chosen, "optimization_mode")


class OperationsMixin:
    """Operations, summary and report of :class:`~torchtrace.compat.PyTorchDebugger`."""

    config: DebugConfig

    def _reset_counts(self) -> None:
        """All-time operation statistics (the kept ``debug_metrics`` are bounded)."""
        self._ops = {"count": 0, "time": 0.0, "time_max": 0.0, "memory": 0.0}
        self._optimizations = 0

    @contextlib.contextmanager
    def debug_context(self, name: str = "operation", *, model: torch.nn.Module | None = None,
                      optimizer: torch.optim.Optimizer | None = None,
                      step: int | None = None) -> Iterator[DebugMetrics]:
        """One debugged operation (seed 003): a torchtrace step named ``name`` (span, step
        metrics, report entry) at the debugger's level and mode, under autograd anomaly
        detection when the mode or ``enable_anomaly_detection=True`` asks for it, measured
        into :attr:`debug_metrics` (time, memory, the gradient anomalies the checks inside
        found). ``check_gradients(model, loss)`` inside hands the step the model and loss.
        Exceptions are logged and re-raised unchanged.
        """
        metrics = DebugMetrics(mode=self.config.mode, operation=name)
        self._open_metrics.append(metrics)
        wanted = self.config.enable_anomaly_detection is True and not self._off("enable_anomaly_detection")
        t0 = time.perf_counter()
        try:
            with steps.open_step(name, model=model, optimizer=optimizer, step=step, level=self.config.level,
                                 mode=self.config.mode) as scope:
                core_does_it = scope.active and self.config.mode in _ANOMALY_MODES
                with core_anomaly_detection(mode=self.config.anomaly_mode, enabled=wanted and not core_does_it):
                    yield metrics
        except BaseException as exc:
            metrics.error = f"{type(exc).__name__}: {exc}"[:300]
            self._log("operation_failed", f"{name} raised {type(exc).__name__}",
                      {"operation": name, "error": metrics.error}, logging.WARNING)
            raise
        finally:
            self._open_metrics.remove(metrics)
            self._finish_operation(metrics, time.perf_counter() - t0)

    def _finish_operation(self, metrics: DebugMetrics, elapsed: float) -> None:
        sample = mem_measure.sample()
        metrics.execution_time = elapsed
        metrics.memory_usage = sample.rss / 2 ** 20
        metrics.gpu_memory = sample.cuda_allocated / 2 ** 20 if sample.cuda_allocated is not None else None
        ops = self._ops
        ops["count"] += 1
        ops["time"] += elapsed
        ops["time_max"] = max(ops["time_max"], elapsed)
        ops["memory"] += metrics.memory_usage
        self.debug_metrics.append(metrics)
        del self.debug_metrics[:-self.config.max_events]
        self._log("operation", f"{metrics.operation} took {elapsed:.4f} s", metrics.as_dict(), logging.DEBUG)

    def optimize_model(self, model: torch.nn.Module, optimization_mode: OptimizationMode | str | None = None, *,
                       mode: OptimizationMode | str | None = None, **options: Any) -> Any:
        """Apply an optimization mode (default FULL_OPTIMIZATION) with :func:`torchtrace.optimize_model`
        (span ``optimize_model``) and append an :class:`OptimizationMetrics` to
        :attr:`optimization_metrics` (``speedup_factor``/``memory_savings`` are None: applying
        measures nothing; ``PyTorchOptimizer.optimize_training_loop`` measures them)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"optimize_model: model= must be an nn.Module, got {type(model).__name__}")
        chosen = pick_mode(optimization_mode, mode, OptimizationMode.FULL_OPTIMIZATION)
        t0 = time.perf_counter()
        optimized = core_optimize_model(model, chosen, **options)
        report = optimized.report
        self.record_optimization(OptimizationMetrics(
            mode=chosen, execution_time=time.perf_counter() - t0, amp_enabled="amp" in report.applied,
            applied=list(report.applied), skipped=dict(report.skipped)))
        return optimized

    def record_optimization(self, metrics: OptimizationMetrics) -> None:
        """Keep an optimization's metrics (``optimization_metrics``) and log it."""
        self.optimization_metrics.append(metrics)
        del self.optimization_metrics[:-self.config.max_events]
        self._optimizations += 1
        self._log("model_optimized", f"{metrics.operation}: {metrics.mode.value}, applied "
                  f"{', '.join(metrics.applied) or 'nothing'}", metrics.as_dict())

    # ------------------------------------------------------------ summary and report
    def get_debug_summary(self) -> Result:
        """Everything at a glance, JSON-ready (``json.dumps(summary)`` works).

        Seed 000: ``anomaly_detection``/``profiling``/``memory_tracking``/``gradient_checking``
        status blocks, ``gradient_violations`` (nonfinite, explosion, vanishing: checks that
        found each), ``total_events`` and ``events_by_type``. Seeds 001/002: ``total_anomalies``,
        ``debug_history_length``. Seed 003: ``total_operations``, ``avg_execution_time`` and
        ``max_execution_time`` (s), ``avg_memory_usage`` (MB), ``total_optimizations``
        (0 before the first). Also ``recent_events``, ``config``, ``memory`` and ``run`` (the
        configured run's summary, or None).
        """
        ops = self._ops
        violations = {k: self._violations.get(k, 0) for k in ("nonfinite", "explosion", "vanishing")}
        rt = current.runtime(create=False)
        return Result(
            debug_mode=self.config.debug_mode, level=self.config.level.value if self.config.level else None,
            mode=self.config.mode.value,
            anomaly_detection={"enabled": not self._off("enable_anomaly_detection"),
                               "active": self._active["anomaly_detection"] > 0, "mode": self.config.anomaly_mode,
                               "anomalies": self.timeline.by_type.get("autograd_anomaly", 0)},
            profiling={"enabled": not self._off("enable_profiling"), "active": self._active["profiling"] > 0,
                       "profiles_written": list(self.profiles_written)},
            memory_tracking={"enabled": not self._off("enable_memory_tracking"),
                             "active": self._active["memory_tracking"] > 0, "snapshots": len(self.memory_snapshots),
                             "last_snapshot": self.memory_snapshots[-1] if self.memory_snapshots else None},
            gradient_checking={"enabled": not self._off("enable_gradient_checking"), "violations": violations},
            gradient_violations=violations,
            total_events=self.timeline.total, debug_history_length=len(self.history.events()),
            events_by_type=dict(self.timeline.by_type), total_anomalies=self.timeline.anomalies(),
            recent_events=self.timeline.events()[-20:],
            total_operations=ops["count"], avg_execution_time=ops["time"] / ops["count"] if ops["count"] else 0.0,
            max_execution_time=ops["time_max"], avg_memory_usage=ops["memory"] / ops["count"] if ops["count"] else 0.0,
            total_optimizations=self._optimizations,
            config=self.config.as_dict(), memory=mem_measure.sample().as_dict(),
            run=rt.summary() if rt is not None else None)

    def save_debug_report(self, filename: str | os.PathLike[str] | None = None) -> str:
        """Write the summary, the whole timeline, the memory snapshots, the gradient violations
        and the per-operation and per-optimization metrics as strict JSON, atomically, mode
        0600. A relative ``filename`` (or None: ``debug_report_<time>.json``) goes under
        ``log_dir``. Returns the path."""
        report = dict(self.get_debug_summary())
        report["events"] = self.timeline.events()
        report["memory_snapshots"] = list(self.memory_snapshots)
        report["performance"] = {"debug_metrics": [m.as_dict() for m in self.debug_metrics],
                                 "optimization_metrics": [m.as_dict() for m in self.optimization_metrics]}
        target = files.write_json_atomic(self._path(filename, time.strftime("debug_report_%Y%m%d-%H%M%S.json")),
                                         report)
        self._log("report_saved", f"debug report written to {target}", {"path": str(target)}, logging.DEBUG)
        return str(Path(target))

    def clear_debug_data(self) -> None:
        """Forget the timeline, snapshots, metrics and counts (settings stay)."""
        self.timeline.clear()
        self.memory_snapshots.clear()
        self.debug_metrics.clear()
        self.optimization_metrics.clear()
        self.profiles_written.clear()
        self._violations.clear()
        self._reset_counts()

    def clear_debug_history(self) -> None:
        """Seed 001's name for :meth:`clear_debug_data`."""
        self.clear_debug_data()


__all__ = ["OperationsMixin", "pick_mode"]
