"""EXTREME: per-layer activation statistics of every step, read with the step's one host read."""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from torchtrace import semconv
from torchtrace.measure.activations import LayerHooks


class ActivationProbe:
    """EXTREME: forward hooks on the step's model; stats stacked into the step's one host read.

    The hooks are registered on a model at its first EXTREME step and kept (switched off
    between steps) until the runtime's level drops from EXTREME or torchtrace shuts down: registering
    and removing a hook per layer on every step cost more than the statistics of a small
    model. Modules added to a model after that are hooked after the next level change.
    """

    KEY = "read:activations"

    def __init__(self, runtime) -> None:
        self.rt = runtime
        self._kept: weakref.WeakKeyDictionary[torch.nn.Module, LayerHooks] = weakref.WeakKeyDictionary()
        self._runtime_extreme = bool(getattr(getattr(runtime, "features", None), "activations", False))

    def enter(self, scope) -> None:
        if not (scope._features.activations and scope.model is not None):
            return
        hooks = self._kept.get(scope.model)
        if hooks is None:
            hooks = self._kept[scope.model] = LayerHooks(scope.model, fast=True, active=False)
        elif hooks.active:  # a step inside a step on the same model: hooks of its own
            scope.extras["activation_hooks"] = LayerHooks(scope.model, fast=True)
            return
        hooks.active = True
        scope.extras["activation_hooks"] = hooks

    def exit(self, scope, exc) -> None:
        hooks = scope.extras.pop("activation_hooks", None)
        if hooks is None:
            return
        if self._kept.get(scope.model) is hooks:
            hooks.active = False
            hooks = hooks.take()
        else:
            hooks.remove()
        stacked = hooks.stacked()
        hooks.stats = []
        if stacked is not None:
            scope.extras[self.KEY] = stacked
            scope.extras["activation_layers"] = hooks

    def on_level(self, features) -> None:
        # Leaving EXTREME removes the hooks. An operation pinned at EXTREME by its own
        # ``level=`` keeps them through level changes that never made the runtime EXTREME.
        if self._runtime_extreme and not features.activations:
            self.close()
        self._runtime_extreme = features.activations

    def close(self) -> None:
        """Remove every kept hook (level below EXTREME, shutdown)."""
        for hooks in list(self._kept.values()):
            hooks.remove()
        self._kept.clear()

    def finalize(self, scope, record, span) -> None:
        if scope is None:
            return
        hooks = scope.extras.pop("activation_layers", None)
        scope.extras.pop(self.KEY, None)
        values = scope.extras.pop("value:activations", None)
        if hooks is None or values is None:
            return
        rows = hooks.rows(values)
        cap = semconv.MAX_NAMES_PER_ATTRIBUTE
        bad = [r["name"] for r in rows if r["nonfinite"]]
        record.extra["activations"] = rows
        attrs: dict[str, Any] = {
            semconv.ACTIVATION_LAYERS: [r["name"][:200] for r in rows[:cap]],
            semconv.ACTIVATION_MEAN: [_f(r["mean"]) for r in rows[:cap]],
            semconv.ACTIVATION_STD: [_f(r["std"]) for r in rows[:cap]],
            semconv.ACTIVATION_MIN: [_f(r["min"]) for r in rows[:cap]],
            semconv.ACTIVATION_MAX: [_f(r["max"]) for r in rows[:cap]],
            semconv.ACTIVATION_NONFINITE: [r["nonfinite"] for r in rows[:cap]],  # 1 = held NaN/Inf
        }
        if bad:
            attrs[semconv.ACTIVATION_NONFINITE_LAYERS] = bad[:cap]
        span.add_event(semconv.EVENT_ACTIVATIONS, attrs)


def _f(v: float) -> float:
    return v if math.isfinite(v) else float("nan")
