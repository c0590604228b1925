"""Seed 000's ``create_enhanced_training_optimizer``: an ``async`` training loop whose every step
is a torchtrace step (span ``train_step``, the step metrics, its batch's samples and FLOPs),
checked by a :class:`~torchtrace.compat.PyTorchDebugger` when ``enable_pytorch_debugging`` is
on; each validation pass is an operation ``validation`` (evaluation, in goodput).

>>> import asyncio, torch
>>> model = torch.nn.Linear(3, 1)
>>> data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
>>> trainer = create_enhanced_training_optimizer(model=model, train_loader=data, max_epochs=2)
>>> results = asyncio.run(trainer.train())
>>> results["epochs_completed"], len(results["train_losses"])
(2, 2)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from torchtrace.compat import steps
from torchtrace.compat.results import Result
from torchtrace.compat.sessions import create_pytorch_debugger
from torchtrace.compat.settings import flag, positive


def default_loss(output: Any, targets: Any) -> torch.Tensor:
    """The loss when none is given: an output's own ``.loss`` / ``["loss"]``; else cross-entropy for
    integer class targets, mean squared error otherwise."""
    own = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(own, torch.Tensor):
        return own
    if isinstance(targets, torch.Tensor) and not (targets.is_floating_point() or targets.is_complex()):
        return F.cross_entropy(output, targets)
    return F.mse_loss(output, targets)


# Any: the user's batch and its parts, whatever their loader yields.
def _split(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, dict):
        return batch, batch.get("labels", batch.get("targets"))
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(f"a batch must be (inputs, targets) or a dict; got {type(batch).__name__}")


def _forward(model: torch.nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


class EnhancedTrainingOptimizer:
    """Train ``model`` for ``max_epochs`` over ``train_loader`` (validating on ``val_loader`` after
    each epoch) with Adam at ``learning_rate`` (or your ``optimizer``), clipping to
    ``gradient_clip`` when given. See :func:`create_enhanced_training_optimizer`."""

    def __init__(self, model: torch.nn.Module, train_loader: Iterable, val_loader: Iterable | None = None, *,
                 loss_fn: Callable[..., torch.Tensor] | None = None, optimizer: torch.optim.Optimizer | None = None,
                 debug_mode: bool = True, enable_pytorch_debugging: bool = True, enable_profiling: bool = False,
                 max_epochs: int = 100, learning_rate: float | None = None, gradient_clip: float | None = None,
                 logger: object = None, **debugger_settings: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model= must be an nn.Module, got {type(model).__name__}")
        flag(enable_pytorch_debugging, "enable_pytorch_debugging")
        flag(enable_profiling, "enable_profiling")
        if enable_profiling and not enable_pytorch_debugging:
            raise ValueError("enable_profiling=True needs enable_pytorch_debugging=True "
                             "(profiling is one of its tools)")
        if debugger_settings and not enable_pytorch_debugging:
            raise ValueError(f"{', '.join(sorted(debugger_settings))} configure the debugger, which "
                             "enable_pytorch_debugging=False turns off")
        if isinstance(max_epochs, bool) or not isinstance(max_epochs, int) or max_epochs < 1:
            raise ValueError(f"max_epochs={max_epochs!r} is not valid; accepted values: a positive integer")
        if optimizer is not None and learning_rate is not None:
            raise ValueError("give learning_rate= (for the default Adam) or optimizer=, not both")
        self.model = model
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.loss_fn = loss_fn or default_loss
        self.max_epochs = max_epochs
        self.gradient_clip = positive(gradient_clip, "gradient_clip") if gradient_clip is not None else None
        lr = positive(learning_rate, "learning_rate") if learning_rate is not None else 1e-3
        self.optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=lr)
        self.enable_profiling = enable_profiling
        self.debugger = create_pytorch_debugger(logger=logger, debug_mode=debug_mode, **debugger_settings) \
            if enable_pytorch_debugging else None
        self.history: dict[str, list[float]] = {"train_losses": [], "val_losses": []}

    async def train(self) -> Result:
        """Run the epochs; yields to the event loop after every step. Returns ``epochs_completed``,
        ``steps``, ``train_losses`` and ``val_losses`` (per-epoch means), ``best_val_loss``,
        ``nonfinite_steps``, ``total_time``, ``profile`` (the trace path) and ``debug_summary``."""
        t0 = time.perf_counter()
        profile: dict[str, Any] = {"path": None}
        n_steps = nonfinite = 0
        ctx: contextlib.AbstractContextManager[dict[str, Any] | None] = \
            self.debugger.profiling(enabled=True, output_file="training_profile.json") \
            if self.enable_profiling and self.debugger is not None else contextlib.nullcontext()
        with ctx as prof:
            profile = prof or profile
            for epoch in range(self.max_epochs):
                losses = []
                for batch in self.train_loader:
                    value = self._step(batch, epoch)
                    n_steps += 1
                    nonfinite += not math.isfinite(value)
                    losses.append(value)
                    await asyncio.sleep(0)
                self.history["train_losses"].append(math.fsum(losses) / len(losses) if losses else math.nan)
                if self.val_loader is not None:
                    self.history["val_losses"].append(await self._validate())
        vals = [v for v in self.history["val_losses"] if math.isfinite(v)]
        return Result(epochs_completed=self.max_epochs, steps=n_steps, train_losses=list(self.history["train_losses"]),
                      val_losses=list(self.history["val_losses"]), best_val_loss=min(vals) if vals else None,
                      nonfinite_steps=nonfinite, total_time=time.perf_counter() - t0, profile=profile.get("path"),
                      debug_summary=self.debugger.get_debug_summary() if self.debugger is not None else None)

    def _step(self, batch: Any, epoch: int) -> float:
        inputs, targets = _split(batch)
        self.model.train()
        with steps.open_step("train_step", model=self.model, optimizer=self.optimizer, inputs=batch):
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(_forward(self.model, inputs), targets)
            steps.share_with_step(loss=loss)
            loss.backward()
            if self.debugger is not None:
                self.debugger.check_gradients(self.model, loss=loss)
            if self.gradient_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.gradient_clip)
            self.optimizer.step()
        value = steps.loss_value(loss)
        # (None only for a loss with no element, which backward() refuses first)
        return value if value is not None else math.nan

    async def _validate(self) -> float:
        """The validation loop, as one operation ``validation`` of the evaluation kind: its
        time is evaluation in goodput, not the next training step's data wait."""
        loader = self.val_loader
        if loader is None:
            return math.nan
        self.model.eval()
        total, count = 0.0, 0
        try:
            with steps.open_step("validation", kind="evaluation"), torch.no_grad():
                for batch in loader:
                    inputs, targets = _split(batch)
                    value = steps.loss_value(self.loss_fn(_forward(self.model, inputs), targets))
                    total += value if value is not None else math.nan
                    count += 1
                    await asyncio.sleep(0)
        finally:
            self.model.train()
        return total / count if count else math.nan


def create_enhanced_training_optimizer(model: torch.nn.Module, train_loader: Iterable,
                                       val_loader: Iterable | None = None,
                                       **settings: Any) -> EnhancedTrainingOptimizer:
    """Seed 000's trainer factory. Keywords: ``debug_mode``, ``enable_pytorch_debugging`` (a
    :class:`PyTorchDebugger` checks every step's gradients; off: none), ``enable_profiling``
    (the whole training profiled into ``<log_dir>/training_profile.json``), ``max_epochs``,
    ``learning_rate`` (Adam's), ``gradient_clip`` (clip to this norm every step), ``loss_fn``
    (default :func:`default_loss`), ``optimizer``, ``logger``, and the debugger's settings."""
    return EnhancedTrainingOptimizer(model, train_loader, val_loader, **settings)


__all__ = ["EnhancedTrainingOptimizer", "create_enhanced_training_optimizer", "default_loss"]
