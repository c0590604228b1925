"""Optimization modes applied to a model, measured against doing nothing.

>>> import torchtrace as tt
>>> net = tt.optimize_model(torch.nn.Linear(4, 2), tt.OptimizationMode.AMP)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from torchtrace.levels import OptimizationMode
from torchtrace.optimize.benchmark import (BenchmarkResults, ModeResult, benchmark_optimizations,
                                           optimize_training_loop)
from torchtrace.optimize.amp import AmpState, amp_step, current_amp
from torchtrace.optimize.modes import (OptimizationReport, OptimizedModel,
                                       optimize_model)


class PyTorchOptimizer:
    """The seeds' optimizer object: one mode and its options, and the three operations.

    >>> opt = PyTorchOptimizer(OptimizationMode.AMP)
    >>> net = opt.optimize_model(torch.nn.Linear(4, 2))
    """

    def __init__(self, mode: OptimizationMode | str = OptimizationMode.FULL_OPTIMIZATION, **options: Any) -> None:
        self.mode = OptimizationMode.parse(mode, "mode")
        self.options = options

    def optimize_model(self, model: nn.Module, mode: OptimizationMode | str | None = None) -> OptimizedModel:
        return optimize_model(model, mode if mode is not None else self.mode, **self.options)

    def benchmark_optimizations(self, model: nn.Module, batches: Iterable, optimizer, loss_fn: Callable,
                                modes: Iterable[OptimizationMode | str] | None = None, **kwargs: Any) -> BenchmarkResults:
        return benchmark_optimizations(model, batches, optimizer, loss_fn, modes, **{**self.options, **kwargs})

    def optimize_training_loop(self, model: nn.Module, dataloader: Iterable, optimizer: torch.optim.Optimizer,
                               loss_fn: Callable, epochs: int = 1,
                               mode: OptimizationMode | str | None = None) -> dict[str, Any]:
        return optimize_training_loop(model, dataloader, optimizer, loss_fn, epochs,
                                      mode if mode is not None else self.mode, **self.options)


__all__ = ["AmpState", "BenchmarkResults", "ModeResult", "OptimizationReport", "OptimizedModel", "PyTorchOptimizer",
           "amp_step", "benchmark_optimizations", "current_amp", "optimize_model", "optimize_training_loop"]
