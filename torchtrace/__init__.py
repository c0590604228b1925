"""torchtrace: production telemetry for PyTorch training steps.

Decorate a training step (``@torchtrace.debug_operation``) or wrap it in
``torchtrace.debug_context`` and every call becomes an OpenTelemetry span with the step's
health (loss, gradient norms, NaN/Inf, memory, anomalies); the same numbers become
Prometheus metrics, and each run leaves a directory with ``spans.jsonl`` and
``report.json``. ``torchtrace demo`` shows it on a small model; ``torchtrace report RUN``
reads a run back.

Where to read on (the docs/ folder of the source tree):

- README.md: install, the two first commands, what you get;
- docs/usage.md: decorating steps, ``configure`` and its settings (docs/configuration.md);
- docs/telemetry.md: span attributes and Prometheus metrics, by name;
- docs/throughput.md: samples, tokens, FLOPs, MFU and goodput;
- docs/forensics.md: NaN forensics and replaying a bad step;
- docs/seed-api.md: the older debugging API (``PyTorchDebugger``, ``TrainingDebugger``),
  kept in ``torchtrace.compat`` and re-exported here.

>>> import torchtrace as tt
>>> @tt.debug_operation
... def train_step(batch): ...
"""

import sys as _sys
import warnings as _warnings

if "torch" not in _sys.modules:
    # torch's first argument parse looks for NumPy and, where it is not installed, warns
    # "Failed to initialize NumPy" once per process. torchtrace needs no NumPy: only that
    # import-time notice is silenced (a later NumPy conversion still raises with its reason).
    with _warnings.catch_warnings():
        _warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
        import torch as _torch  # noqa: F401

from torchtrace._version import __version__
from torchtrace.api import (
    ConfigureResult,
    StepScope,
    configure,
    current_step,
    debug_context,
    debug_operation,
    flush,
    idle,
    shutdown,
)
from torchtrace.compat import (
    DebugConfig,
    GradientReport,
    PyTorchDebugger,
    PyTorchOptimizer,
    TrainingDebugger,
    create_pytorch_debugger,
    debug_training_session,
)
from torchtrace.config import Settings
from torchtrace.errors import NonFiniteError
from torchtrace.forensics import anomaly_detection, replay_step
from torchtrace.job.checkpoints import checkpoint
from torchtrace.job.story import job_story
from torchtrace.levels import DebugLevel, DebugMode, OptimizationMode
from torchtrace.measure.snapshots import MemorySnapshot, MemoryTracker
from torchtrace.optimize import (
    AmpState,
    BenchmarkResults,
    ModeResult,
    OptimizationReport,
    OptimizedModel,
    amp_step,
    benchmark_optimizations,
    current_amp,
    optimize_model,
    optimize_training_loop,
)
from torchtrace.probes.profiler import ProfileSchedule
from torchtrace.record.monitor import TrainingMonitor
from torchtrace.tools.checks import detect_model_anomalies, validate_model_input
from torchtrace.tools.inspection import debug_backward_pass, debug_forward_pass, debug_training_step, inspect_model
from torchtrace.tools.memory import clear_memory, memory_tracking, take_memory_snapshot, track_tensor
from torchtrace.tools.pipeline import analyze_pipeline, monitor_loop_step
from torchtrace.tools.profiling import profiling

__all__ = [
    "ConfigureResult",
    "DebugConfig",
    "DebugLevel",
    "DebugMode",
    "GradientReport",
    "NonFiniteError",
    "OptimizationMode",
    "PyTorchDebugger",
    "Settings",
    "StepScope",
    "__version__",
    "configure",
    "create_pytorch_debugger",
    "current_step",
    "debug_context",
    "debug_operation",
    "debug_training_session",
    "flush",
    "idle",
    "shutdown",
    "TrainingMonitor",
    "TrainingDebugger",
    "validate_model_input",
    "detect_model_anomalies",
    "analyze_pipeline",
    "monitor_loop_step",
    "anomaly_detection",
    "replay_step",
    "MemorySnapshot",
    "MemoryTracker",
    "ProfileSchedule",
    "clear_memory",
    "debug_backward_pass",
    "debug_forward_pass",
    "debug_training_step",
    "inspect_model",
    "memory_tracking",
    "profiling",
    "take_memory_snapshot",
    "track_tensor",
    "AmpState",
    "BenchmarkResults",
    "ModeResult",
    "OptimizationReport",
    "OptimizedModel",
    "PyTorchOptimizer",
    "amp_step",
    "benchmark_optimizations",
    "current_amp",
    "optimize_model",
    "optimize_training_loop",
    "checkpoint",
    "job_story",
]
