"""EXTREME: per-layer activation statistics of every step, read with the step's one host read."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from torchtrace.measure.activations import LayerHooks
from torchtrace.probes.base import Probe
from torchtrace.record.step import StepRecord

if TYPE_CHECKING:
    from torchtrace.levels import Features
    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope


class _State:
    __slots__ = ("hooks", "taken")

    def __init__(self, hooks: LayerHooks) -> None:
        self.hooks: LayerHooks | None = hooks
        self.taken: LayerHooks | None = None


class ActivationProbe(Probe[_State]):
    """EXTREME: forward hooks on the step's model; statistics stacked into the step's one host read.

    The hooks are registered on a model at its first EXTREME step and kept (switched off
    between steps) until the runtime's level drops from EXTREME or torchtrace shuts down:
    registering and removing a hook per layer on every step cost more than the statistics of
    a small model. Modules added to a model after that are hooked after the next level change.
    The rows land in ``record.activations``.
    """

    name = "activations"

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self._kept: weakref.WeakKeyDictionary[torch.nn.Module, LayerHooks] = weakref.WeakKeyDictionary()
        self._runtime_extreme = bool(runtime.features.activations)

    def wanted(self, features: Features) -> bool:
        return features.activations

    def enter(self, scope: StepScope) -> _State | None:
        model = scope.model
        if scope.features is None or not scope.features.activations or model is None:
            return None
        hooks = self._kept.get(model)
        if hooks is None:
            hooks = self._kept[model] = LayerHooks(model, fast=True, active=False)
        elif hooks.active:  # a step inside a step on the same model: hooks of its own
            return _State(LayerHooks(model, fast=True))
        hooks.active = True
        return _State(hooks)

    def exit(self, scope: StepScope, state: _State | None, exc: BaseException | None) -> torch.Tensor | None:
        hooks = state.hooks if state is not None else None
        if state is None or hooks is None:
            return None
        if scope.model is not None and self._kept.get(scope.model) is hooks:
            hooks.active = False
            hooks = hooks.take()
        else:
            hooks.remove()
        stacked = hooks.stacked()
        hooks.stats = []
        state.hooks = None
        if stacked is None:
            return None
        state.taken = hooks
        return stacked

    def finish(self, scope: StepScope, state: _State | None, record: StepRecord, values: list[float] | None) -> None:
        if state is None or state.taken is None or values is None:
            return
        record.activations = state.taken.rows(values)
        state.taken = None

    def on_level(self, features: Features) -> None:
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
