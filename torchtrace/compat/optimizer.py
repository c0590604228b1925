"""Seed 003's ``PyTorchOptimizer`` over :mod:`torchtrace.optimize`.

``PyTorchOptimizer(debugger)`` or ``PyTorchOptimizer(mode)``; ``optimize_model``,
``optimize_training_loop`` (with the seed's ``total_time`` and a *measured*
``optimization_metrics["speedup_factor"]``) and ``benchmark_optimizations`` (a mapping of mode
to result dicts, ``.items()``).

>>> import torch, torch.nn.functional as F
>>> opt = PyTorchOptimizer("none")
>>> m = torch.nn.Linear(3, 1)
>>> data = [(torch.ones(4, 3), torch.zeros(4, 1))]
>>> r = opt.optimize_training_loop(m, data, torch.optim.SGD(m.parameters(), lr=0.1), F.mse_loss)
>>> r["total_time"] > 0 and r["optimization_metrics"]["speedup_factor"] == 1.0
True
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar, Union

import torch
from torch import nn

from torchtrace.compat.operations import pick_mode
from torchtrace.compat.records import OptimizationMetrics
from torchtrace.compat.results import Result
from torchtrace.errors import get_logger
from torchtrace.forensics.isolation import rng_kept
from torchtrace.levels import OptimizationMode
from torchtrace.optimize import benchmark as bench
from torchtrace.optimize import optimize_model as core_optimize_model

if TYPE_CHECKING:
    from torchtrace.compat.debugger import PyTorchDebugger

logger = get_logger("torchtrace.optimize")
_T = TypeVar("_T")
# A torch optimizer, or a factory params -> optimizer.
OptimizerOrFactory = Union[torch.optim.Optimizer, Callable[..., torch.optim.Optimizer]]
Mode = Union[OptimizationMode, str, None]
DEFAULT_LR = 1e-3


class PyTorchOptimizer:
    """The seeds' optimizer object: a mode (default FULL_OPTIMIZATION), options for
    :func:`torchtrace.optimize_model`, and optionally a debugger whose
    ``optimization_metrics`` receive every optimization.

    ``optimizer=`` arguments take a ``torch.optim.Optimizer`` or a factory ``params ->
    optimizer``. Seed 003's examples pass the ``PyTorchOptimizer`` itself (their variable
    ``optimizer`` was rebound); that is accepted as "no optimizer given": Adam with learning
    rate ``default_lr`` is used and a warning names ``optimizer=``.
    """

    def __init__(self, debugger_or_mode: PyTorchDebugger | Mode = None, mode: Mode = None, *,
                 default_lr: float = DEFAULT_LR, **options: Any) -> None:
        self.debugger: PyTorchDebugger | None = None
        if isinstance(debugger_or_mode, (OptimizationMode, str)):
            if mode is not None:
                raise TypeError("PyTorchOptimizer: the mode was given twice")
            mode = debugger_or_mode
        elif debugger_or_mode is not None:
            if not callable(getattr(debugger_or_mode, "record_optimization", None)):
                raise TypeError(f"PyTorchOptimizer: the first argument must be a PyTorchDebugger or an "
                                f"OptimizationMode, got {type(debugger_or_mode).__name__}")
            self.debugger = debugger_or_mode
        self.mode = OptimizationMode.parse(mode, "mode") if mode is not None else OptimizationMode.FULL_OPTIMIZATION
        self.default_lr = float(default_lr)
        self.options = options

    def _mode(self, optimization_mode: Mode, mode: Mode) -> OptimizationMode:
        return pick_mode(optimization_mode, mode, self.mode)

    def _factory(self, optimizer: object) -> OptimizerOrFactory:
        if isinstance(optimizer, torch.optim.Optimizer) or (callable(optimizer)
                                                            and not isinstance(optimizer, PyTorchOptimizer)):
            return optimizer
        if optimizer is None or isinstance(optimizer, PyTorchOptimizer):
            logger.warning("optimizer= is %s, not a torch optimizer; using Adam(lr=%s). Pass a torch.optim.Optimizer "
                           "to choose", "the PyTorchOptimizer itself" if optimizer is not None else "missing",
                           self.default_lr)
            lr = self.default_lr
            return lambda params: torch.optim.Adam(params, lr=lr)
        raise TypeError(f"optimizer= must be a torch.optim.Optimizer or a factory params -> optimizer, "
                        f"got {type(optimizer).__name__}")

    def optimize_model(self, model: nn.Module, optimization_mode: Mode = None, *, mode: Mode = None) -> Any:
        chosen = self._mode(optimization_mode, mode)
        if self.debugger is not None:
            return self.debugger.optimize_model(model, chosen, **self.options)
        return core_optimize_model(model, chosen, **self.options)

    def benchmark_optimizations(self, model: nn.Module, dataloader: Iterable | None = None, optimizer: object = None,
                                criterion: Callable | None = None, epochs: int | None = None, *,
                                batches: Iterable | None = None, loss_fn: Callable | None = None,
                                modes: Iterable | None = None, **kwargs: Any) -> bench.BenchmarkResults:
        """Every mode (or ``modes``) trained on a copy and compared with NONE.

        Seed keywords: ``dataloader`` (= ``batches``), ``criterion`` (= ``loss_fn``) and
        ``epochs`` (timed steps = epochs x batches, after ``min(2, batches)`` warm-up steps).
        The result maps mode values to dicts with ``total_time`` and ``error`` for a failed mode.
        """
        data = _one(dataloader, batches, "dataloader", "batches")
        loss = _one(criterion, loss_fn, "criterion", "loss_fn")
        if data is None or loss is None:
            raise TypeError("benchmark_optimizations needs dataloader= (or batches=) and criterion= (or loss_fn=)")
        data = list(data)
        if epochs is not None:
            if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
                raise ValueError(f"epochs={epochs!r} is not valid; accepted values: a positive integer")
            kwargs.setdefault("steps", epochs * len(data))
            kwargs.setdefault("warmup", min(2, len(data)))
        kwargs.setdefault("print_table", False)
        opts = {k: v for k, v in self.options.items() if k in ("amp_dtype", "compile_backend", "compile_options")}
        return bench.benchmark_optimizations(model, data, self._factory(optimizer), loss, modes, **{**opts, **kwargs})

    def optimize_training_loop(self, model: nn.Module, dataloader: Iterable | None = None, optimizer: object = None,
                               criterion: Callable | None = None, epochs: int = 1, optimization_mode: Mode = None, *,
                               batches: Iterable | None = None, loss_fn: Callable | None = None, mode: Mode = None,
                               measure_speedup: bool = True) -> Result:
        """Train ``model`` in place under the mode (span ``optimize_training_loop``).

        Returns :func:`torchtrace.optimize_training_loop`'s keys plus the seed's ``total_time``
        and ``optimization_metrics`` (``speedup_factor`` and ``memory_savings`` against NONE,
        measured before training by :func:`torchtrace.benchmark_optimizations` on a copy, a few
        steps each, with the random generators put back afterwards; 1.0 and 0.0 for NONE; None
        with ``measure_speedup=False``; ``amp_enabled``, ``applied``, ``skipped``).
        """
        data = list(_one(dataloader, batches, "dataloader", "batches") or [])
        loss = _one(criterion, loss_fn, "criterion", "loss_fn")
        if loss is None or not data:
            raise TypeError("optimize_training_loop needs dataloader= (non-empty) and criterion= (or loss_fn=)")
        chosen = self._mode(optimization_mode, mode)
        factory = self._factory(optimizer)
        speed, saving = self._measure(model, data, factory, loss, chosen) if measure_speedup else (None, None)
        opt = factory if isinstance(factory, torch.optim.Optimizer) else factory(model.parameters())
        t0 = time.perf_counter()
        out = Result(bench.optimize_training_loop(model, data, opt, loss, epochs, chosen, **self.options))
        applied = out["optimization"]["applied"]
        metrics = OptimizationMetrics(mode=chosen, execution_time=time.perf_counter() - t0, speedup_factor=speed,
                                      memory_savings=saving, amp_enabled="amp" in applied, applied=list(applied),
                                      skipped=dict(out["optimization"]["skipped"]),
                                      operation="optimize_training_loop")
        out["total_time"] = out["total_time_s"]
        out["optimization_metrics"] = Result(metrics.as_dict())
        if self.debugger is not None:
            self.debugger.record_optimization(metrics)
        return out

    def _measure(self, model: nn.Module, data: list, factory: OptimizerOrFactory, loss: Callable,
                 chosen: OptimizationMode) -> tuple[float | None, float | None]:
        """``(speedup, memory_saving)`` of ``chosen`` against NONE, a few steps each on a copy of
        ``model``; the global random generators are left as found (a model with Dropout trains
        afterwards as it would have unmeasured)."""
        if chosen is OptimizationMode.NONE:
            return 1.0, 0.0
        steps = min(5, max(1, len(data)))
        opts = {k: v for k, v in self.options.items() if k in ("amp_dtype", "compile_backend", "compile_options")}
        with rng_kept():  # the training that follows draws what it would have drawn unmeasured
            res = bench.benchmark_optimizations(model, data[:steps], factory, loss, [chosen], warmup=1, steps=steps,
                                                print_table=False, **opts)[chosen]
        if not res.ok:
            logger.warning("could not measure %s against none: %s", chosen.value, res.error)
        return res.speedup, res.memory_saving


def _one(a: _T | None, b: _T | None, name_a: str, name_b: str) -> _T | None:
    if a is not None and b is not None:
        raise TypeError(f"give {name_a}= or {name_b}=, not both")
    return a if a is not None else b


__all__ = ["PyTorchOptimizer"]
