"""How seed-style calls feed the telemetry: through the public step API only.

A training step that a seed class monitors is opened with :func:`torchtrace.debug_context`
(one span, the step metrics, a report entry, exactly as ``@debug_operation`` would make);
a check made inside an open step hands the step its loss and model (``record_loss``, the
public ``model`` attribute) so that the step's record holds them; anomalies found outside a
step are counted with :func:`torchtrace.record.monitor.record_anomalies`.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from torchtrace import api, current
from torchtrace.errors import get_logger
from torchtrace.levels import DebugLevel, DebugMode
from torchtrace.measure.loss import classify_loss
from torchtrace.record import readout
from torchtrace.record.goodput_types import TRAIN
from torchtrace.record.monitor import STEP_JUDGED_KINDS, record_anomalies, share_with_open_step

_logger = get_logger("torchtrace.debugger")

STEP_KINDS = STEP_JUDGED_KINDS
"""Kinds a step's own record judges from the loss and gradients it holds."""


def open_step(name: str, *, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
              step: int | None = None,
              level: DebugLevel | None = None, mode: DebugMode | None = None, inputs: object = None,
              kind: str = "train") -> api.StepScope:
    """A step scope, as ``torchtrace.debug_context`` makes it (use with ``with``).

    A level or mode the seed object was given applies to this step only; ``None`` leaves the
    run's. ``inputs`` is the step's batch, when the seed call has it: its samples, tokens and
    the FLOP count's shapes. ``kind`` is the operation's goodput kind. Inside a step of
    another seed object (nested), no second step is opened: the returned scope is inert and
    the outer one records the step.
    """
    outer = current.step()
    if outer is not None and getattr(outer, "active", False):
        return api.StepScope(name, level=DebugLevel.OFF)  # records nothing
    return api.debug_context(name, model=model, optimizer=optimizer, step=step, level=level,
                             mode=None if mode in (None, DebugMode.NONE) else mode, inputs=inputs, kind=kind)


def book_loop(since: float | None, operation: str) -> None:
    """The loop's time from ``since`` (perf_counter: when the previous monitor-only step was
    left) to now is training, not data wait. A monitor-only step (seed 001's
    ``monitor_training_step``, called after ``backward()``) covers the check alone: the
    forward, backward and update lie between two of its steps, where the ledger would count
    data wait (and raise ``data_stall`` in a loop that loads no data). Booked as the
    operation's training time, the next step waits about nothing. The loop's data loading is
    in it too: such steps cannot tell it apart (docs/seed-api.md)."""
    rt = current.runtime(create=False)
    if since is None or rt is None or rt.off or not rt.settings.throughput:
        return
    try:
        rt.throughput.book(since, time.perf_counter(), TRAIN, operation)
    except Exception as exc:  # torchtrace's own failure never reaches the caller
        rt.errors.report("other", exc)


def active_step() -> api.StepScope | None:
    scope = api.current_step()
    return scope if scope is not None and scope.active else None


def share_with_step(model: torch.nn.Module | None = None, loss: object = None) -> bool:
    """Give the open step the model whose gradients were checked and the loss, when it lacks
    them (:func:`torchtrace.record.monitor.share_with_open_step`). True when a step is open (it
    then counts the loss and gradient anomalies itself)."""
    if active_step() is None:
        return False
    share_with_open_step(model, loss)
    return True


def report(kinds: list[str], operation: str, *, step: int | None = None, loss: float | None = None,
           grad_norm: float | None = None, in_step: bool = False, data: dict[str, Any] | None = None) -> None:
    """Record anomalies a seed check found. With ``in_step`` (the open step holds the loss and
    model) the kinds the step judges itself are not counted a second time."""
    if not kinds:
        return
    counted = [k for k in kinds if not (in_step and k in STEP_KINDS)]
    shared = [k for k in kinds if k not in counted]
    scope = active_step() if in_step else None
    if scope is not None and counted:
        # The open step's record takes what only this check judges (a loss spike): counted
        # once, with the step's span and history event.
        for kind in counted:
            scope.add_anomaly(kind, f"{kind} at step {step}", {**(data or {}), "source": operation})
        counted = []
    if counted:
        record_anomalies(counted, step, _finite_or_none(loss), _finite_or_none(grad_norm), operation, data)
    if shared:
        # Marked in_step: the step counts these itself (the seed summary's sections skip them).
        record_anomalies(shared, step, _finite_or_none(loss), _finite_or_none(grad_norm), operation,
                         {**(data or {}), "in_step": True}, count=False)


def _finite_or_none(v: float | None) -> float | None:
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def loss_value(loss: object) -> float | None:
    """A loss as a Python float (one host read for a tensor), or None.

    Judged as the core step judges a loss (:func:`torchtrace.measure.loss.classify_loss`): a
    tensor of more than one value (a per-sample loss) or of an integer or bool dtype is no
    loss: None, with the core's sentence logged once ("a loss of shape [8, 1] is not a
    scalar; record loss.mean() or loss.sum()"), never its first element read as the loss.
    """
    if loss is None or isinstance(loss, str):
        return None
    judged = classify_loss(loss)
    if judged.tensor is not None:
        return readout.read(judged.tensor.detach().reshape(1).to(torch.float64).cpu())[0]
    if judged.number is not None:
        return judged.number
    if isinstance(loss, torch.Tensor) and judged.problem is not None:
        _warn_once(("loss", judged.problem), "torchtrace: the loss was not read: %s", judged.problem)
    return None


def _warn_once(key: tuple, message: str, *args: object) -> None:
    """A user's mistake, logged the first time (through the runtime's once-only warning when
    one is configured)."""
    rt = current.runtime(create=False)
    if rt is not None:
        rt.warn_once(key, message, *args)
    elif key not in _WARNED:
        _WARNED.add(key)
        _logger.warning(message, *args)


_WARNED: set[tuple] = set()


def nonfinite(value: float | None) -> bool:
    return value is not None and not math.isfinite(value)


__all__ = ["STEP_KINDS", "active_step", "book_loop", "loss_value", "nonfinite", "open_step", "report",
           "share_with_step"]
