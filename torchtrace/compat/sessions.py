"""Seed factories and decorators: ``create_pytorch_debugger``, ``debug_training_session`` (seed
000) and ``debug_operation(debug_mode=...)`` (seed 003), over the core API.

>>> import torch, torchtrace as tt
>>> model = torch.nn.Linear(2, 1)
>>> with tt.debug_training_session(model, enable_memory_tracking=False) as dbg:
...     model(torch.ones(1, 2)).sum().backward()
>>> dbg.get_debug_summary()["events_by_type"]["session_finished"]
1
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from torchtrace import api, current
from torchtrace.compat.debugger import PyTorchDebugger
from torchtrace.levels import DebugMode


def create_pytorch_debugger(logger: object = None, debug_mode: bool | DebugMode | str | None = True,
                            **settings: Any) -> PyTorchDebugger:
    """A :class:`PyTorchDebugger` from keyword settings (seed 000's factory).

    ``debug_mode`` (default True): False turns the debugging-only features off (anomaly
    detection, profiling, layer statistics); gradient checking and memory tracking stay as
    their own switches say. Other keywords: ``enable_anomaly_detection``, ``enable_profiling``,
    ``enable_memory_tracking``, ``enable_gradient_checking``, ``log_dir``, ``level``, the
    thresholds (:class:`~torchtrace.compat.settings.DebugConfig`).

    >>> create_pytorch_debugger(debug_mode=False).config.debug_mode
    False
    """
    return PyTorchDebugger(logger=logger, debug_mode=debug_mode, **settings)


@contextlib.contextmanager
def debug_training_session(model: torch.nn.Module, logger: object = None,
                           debug_mode: bool | DebugMode | str | None = True,
                           **settings: Any) -> Iterator[PyTorchDebugger]:
    """A debugger for a whole training session, traced as one ``training_session`` span (the
    parent of the steps inside it).

    Settings take effect over the whole session: ``enable_anomaly_detection=True`` runs it
    under autograd anomaly detection; ``enable_profiling=True`` profiles it into
    ``<log_dir>/session_profile.json``; ``enable_memory_tracking`` (default True) takes
    snapshots at its start and end and a memory sample per torchtrace step;
    ``enable_gradient_checking`` (default True) checks the gradients left at its end. At the
    end the parameters are checked and a ``session_finished`` event is logged.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"debug_training_session: model= must be an nn.Module, got {type(model).__name__}")
    debugger = create_pytorch_debugger(logger=logger, debug_mode=debug_mode, **settings)
    cfg = debugger.config
    rt = current.runtime()
    with contextlib.ExitStack() as stack:
        if rt is not None and not rt.off:
            stack.enter_context(rt.tracer.start_as_current_span("training_session"))
        debugger.log_event("session_started", f"training session for {type(model).__name__}")
        if cfg.enable_anomaly_detection is True:
            stack.enter_context(debugger.anomaly_detection())
        if cfg.enable_profiling is True:
            stack.enter_context(debugger.profiling(output_file="session_profile.json"))
        if cfg.enable_memory_tracking:
            stack.enter_context(debugger.memory_tracking())
        try:
            yield debugger
        finally:
            _finish_session(debugger, model)


def _finish_session(debugger: PyTorchDebugger, model: torch.nn.Module) -> None:
    check = debugger.check_model_parameters(model)
    grads = None
    if any(p.grad is not None for p in model.parameters()):
        # Measures nothing (global_norm None) when gradient checking is off.
        grads = debugger.check_gradients(model)
    debugger.log_event("session_finished", f"{check['total_parameters']} parameters, "
                  f"{len(check['nonfinite_params'])} non-finite",
                  {"nonfinite_params": check["nonfinite_params"][:32],
                   "gradient_norm": None if grads is None else grads["global_norm"]}, logging.INFO)


# The seeds' decorator (``debug_mode=`` included) is the core one.
debug_operation = api.debug_operation


__all__ = ["create_pytorch_debugger", "debug_operation", "debug_training_session"]
