"""Optimization modes applied to a model, measured against doing nothing.

>>> import torchtrace as tt
>>> net = tt.optimize_model(torch.nn.Linear(4, 2), tt.OptimizationMode.AMP)
"""

from __future__ import annotations

import torch  # noqa: F401 - the doctest above uses it

from torchtrace.optimize.amp import AmpState, amp_step, current_amp
from torchtrace.optimize.benchmark import BenchmarkResults, ModeResult, benchmark_optimizations, optimize_training_loop
from torchtrace.optimize.modes import OptimizationReport, OptimizedModel, optimize_model

__all__ = ["AmpState", "BenchmarkResults", "ModeResult", "OptimizationReport", "OptimizedModel",
           "amp_step", "benchmark_optimizations", "current_amp", "optimize_model", "optimize_training_loop"]
