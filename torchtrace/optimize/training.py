"""``optimize_training_loop`` and the training-step pieces the benchmark shares with it.

>>> import torch
>>> net = torch.nn.Linear(2, 1)
>>> out = optimize_training_loop(net, [(torch.ones(4, 2), torch.zeros(4, 1))],
...                              torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.functional.mse_loss)
>>> out["steps"], out["mode"]
(1, 'none')
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch
from torch import nn

from torchtrace import current, semconv
from torchtrace.levels import OptimizationMode
from torchtrace.optimize.modes import OptimizedModel, amp_step, model_device, optimize_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _move(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_move(b, device) for b in batch)
    return batch


def _train_step(om: OptimizedModel, opt, loss_fn, batch) -> torch.Tensor:
    x, y = batch
    opt.zero_grad(set_to_none=True)
    with om.context():
        loss = loss_fn(om(x), y)
    amp_step(loss, opt, om.amp.scaler if om.amp is not None else None)
    return loss.detach()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def optimize_training_loop(model: nn.Module, dataloader: Iterable, optimizer: torch.optim.Optimizer,
                           loss_fn: Callable, epochs: int = 1, mode: OptimizationMode | str = OptimizationMode.NONE,
                           **options: Any) -> dict[str, Any]:
    """Train ``model`` in place under ``mode``; return total time and what was measured.

    The optimizer must hold ``model``'s parameters (the optimized wrapper shares them).
    Losses are read to the host once per epoch. Returns ``total_time_s``, ``steps``,
    ``epoch_mean_loss`` (one per epoch), ``final_loss``, ``optimization`` (what was applied
    and skipped) and ``mode``. Options are those of :func:`optimize_model`.
    """
    chosen = OptimizationMode.parse(mode, "mode")
    if epochs < 1:
        raise ValueError(f"epochs={epochs}: need epochs >= 1")
    device = model_device(model)
    om = optimize_model(model, chosen, **options)
    om.train()
    rt = current.runtime()
    tracer = rt.tracer if rt is not None and not rt.off else None
    span_cm = tracer.start_as_current_span("optimize_training_loop", attributes={semconv.OPT_MODE: chosen.value}) \
        if tracer else _null()
    epoch_means: list[float] = []
    steps = 0
    final = None
    with span_cm as span:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(epochs):
            losses = [_train_step(om, optimizer, loss_fn, _move(batch, device)) for batch in dataloader]
            steps += len(losses)
            if losses:
                values = torch.stack([l.float() for l in losses]).double().cpu()  # one host read per epoch
                epoch_means.append(float(values.mean()))
                final = float(values[-1])
        _sync(device)
        total = time.perf_counter() - t0
        if span is not None:
            span.set_attributes({**om.report.span_attributes(), semconv.TRAIN_TOTAL_S: total,
                                 semconv.TRAIN_STEPS: steps})
    return {"mode": chosen.value, "total_time_s": total, "steps": steps, "epochs": epochs,
            "epoch_mean_loss": epoch_means, "final_loss": final, "optimization": om.report.as_dict()}
