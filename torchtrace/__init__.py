"""torchtrace: production telemetry for PyTorch training steps.

Decorate a training step or wrap it in ``debug_context`` and every call becomes an
OpenTelemetry span carrying the step's health, the same numbers become Prometheus metrics,
and a run report is written at exit.

The seed documents' debugging API (``PyTorchDebugger``, ``TrainingDebugger``...) is
``torchtrace.compat``; the names the seeds import from their top-level module are here too.

>>> import torchtrace as tt
>>> @tt.debug_operation
... def train_step(batch): ...
"""

from torchtrace._version import __version__
from torchtrace.api import (ConfigureResult, StepScope, configure, current_step, debug_context, debug_operation,
                            flush, shutdown)
from torchtrace.config import Settings
from torchtrace.compat import (DebugConfig, GradientReport, PyTorchDebugger, PyTorchOptimizer, TrainingDebugger,
                               create_pytorch_debugger, debug_training_session)
from torchtrace.errors import NonFiniteError
from torchtrace.job.checkpoints import checkpoint
from torchtrace.job.story import job_story
from torchtrace.levels import DebugLevel, DebugMode, OptimizationMode
from torchtrace.forensics import anomaly_detection, replay_step
from torchtrace.tools.checks import detect_model_anomalies, validate_model_input
from torchtrace.record.monitor import TrainingMonitor
from torchtrace.tools.pipeline import analyze_pipeline, monitor_loop_step
from torchtrace.tools.inspection import debug_backward_pass, debug_forward_pass, debug_training_step, inspect_model
from torchtrace.measure.snapshots import MemorySnapshot, MemoryTracker
from torchtrace.tools.memory import clear_memory, memory_tracking, take_memory_snapshot, track_tensor
from torchtrace.probes.profiler import ProfileSchedule
from torchtrace.tools.profiling import profiling
from torchtrace.optimize import (AmpState, BenchmarkResults, ModeResult, OptimizationReport, OptimizedModel,
                                 amp_step, benchmark_optimizations, current_amp, optimize_model, optimize_training_loop)

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
