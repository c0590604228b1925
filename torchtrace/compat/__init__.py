"""The debugging API of the systems torchtrace replaces: every name the four seed documents use.

Each name is a thin facade over torchtrace's core (measures, records, steps, tools); none
measures anything its own way. Training steps these objects monitor are torchtrace steps
(spans, metrics, report entries). docs/seed-api.md maps every name to its torchtrace
equivalent and its telemetry.

Names the seeds import from their top-level module are also importable from ``torchtrace``
(``PyTorchDebugger``, ``create_pytorch_debugger``, ``debug_training_session``,
``TrainingDebugger``, ``DebugLevel``, ``DebugMode``, ``OptimizationMode``,
``PyTorchOptimizer``, ``debug_context``); the rest come from here.

>>> from torchtrace.compat import PyTorchDebugger, DebugLevel
>>> PyTorchDebugger(DebugLevel.ADVANCED).level
<DebugLevel.ADVANCED: 'advanced'>
"""

from torchtrace.api import debug_context
from torchtrace.compat.async_logger import AsyncTrainingLogger, TrainingPhase
from torchtrace.compat.debugger import PyTorchDebugger
from torchtrace.compat.enhanced import EnhancedTrainingOptimizer, create_enhanced_training_optimizer
from torchtrace.compat.manager import (
                                       AutogradAnomalyDetector,
                                       GradientDebugger,
                                       ModelDebugger,
                                       PyTorchDebugManager,
                                       PyTorchMemoryDebugger,
)
from torchtrace.compat.optimizer import PyTorchOptimizer
from torchtrace.compat.records import DebugMetrics, OptimizationMetrics
from torchtrace.compat.resources import monitor_resources
from torchtrace.compat.results import GradientReport, ParameterAnalysis, Result
from torchtrace.compat.sessions import create_pytorch_debugger, debug_operation, debug_training_session
from torchtrace.compat.settings import DebugConfig
from torchtrace.compat.toolconfig import PyTorchDebugConfig
from torchtrace.compat.training import DiffusionModelDebugger, TrainingDebugger
from torchtrace.levels import DebugLevel, DebugMode, OptimizationMode
from torchtrace.optimize import benchmark_optimizations, optimize_model, optimize_training_loop
from torchtrace.tools.checks import detect_model_anomalies, validate_model_input

__all__ = [
    "AsyncTrainingLogger",
    "AutogradAnomalyDetector",
    "DebugConfig",
    "DebugLevel",
    "DebugMetrics",
    "DebugMode",
    "DiffusionModelDebugger",
    "EnhancedTrainingOptimizer",
    "GradientDebugger",
    "GradientReport",
    "ModelDebugger",
    "OptimizationMetrics",
    "OptimizationMode",
    "ParameterAnalysis",
    "PyTorchDebugConfig",
    "PyTorchDebugManager",
    "PyTorchDebugger",
    "PyTorchMemoryDebugger",
    "PyTorchOptimizer",
    "Result",
    "TrainingDebugger",
    "TrainingPhase",
    "benchmark_optimizations",
    "create_enhanced_training_optimizer",
    "create_pytorch_debugger",
    "debug_context",
    "debug_operation",
    "debug_training_session",
    "detect_model_anomalies",
    "monitor_resources",
    "optimize_model",
    "optimize_training_loop",
    "validate_model_input",
]
