"""The probe interface, and the set of probes a runtime runs around every step.

A probe is an optional family of checks (activations, memory samples, leaks, the profiler,
forensics, stragglers). Its three step hooks run on the training thread:

* ``enter(scope)`` when the step starts; returns the probe's state for this step, or None;
* ``exit(scope, state, exc)`` when the step ends, before the host read; returns a device
  tensor to read with the step's one host read, or None;
* ``finish(scope, state, record, values)`` once the record's host values are known
  (``values``: the host copy of what ``exit`` returned); it fills the record's typed fields
  (``record.activations``, ``record.leak``...) and may add anomalies. It never touches the
  span: export turns the record into span attributes and events.

A probe overrides only the hooks it needs: :class:`ProbeSet` calls only overridden ones, and
only on steps whose features the probe acts on (:meth:`Probe.wanted`): at BASIC a step calls
no activation, memory-sample, leak or profiler code at all. A probe's failure is counted under
its ``component`` and the step goes on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Iterator, TypeVar, cast

import torch

from torchtrace.record.step import StepRecord

if TYPE_CHECKING:
    from torchtrace.errors import InternalErrors
    from torchtrace.levels import Features
    from torchtrace.record.readout import ReadPlan
    from torchtrace.step.scope import StepScope


S = TypeVar("S")


class Probe(Generic[S]):
    """Base class of every probe (see the module docstring); ``S`` is the type of the state
    its ``enter`` returns for a step (``Probe[None]``: it keeps none).

    >>> class CountSteps(Probe):
    ...     name = "count"
    ...     def __init__(self): self.n = 0
    ...     def finish(self, scope, state, record, values): self.n += 1
    ...     def section(self): return {"steps": self.n}
    """

    name = "probe"  # the report section's name
    component = "other"  # torchtrace_internal_errors_total{component} of its failures

    def wanted(self, features: Features) -> bool:
        """Whether the probe acts on steps with ``features``. Asked when :class:`ProbeSet` makes
        the hook lists for a step's features, not on every step: a probe whose answer changes
        for another reason (a ``profiling()`` block opened) calls :meth:`ProbeSet.refresh`."""
        return True

    def enter(self, scope: StepScope) -> S | None:
        return None

    def exit(self, scope: StepScope, state: S | None, exc: BaseException | None) -> torch.Tensor | None:
        return None

    def finish(self, scope: StepScope, state: S | None, record: StepRecord, values: list[float] | None) -> None:
        return None

    def on_level(self, features: Features) -> None:
        """The runtime's level or mode changed (a probe whose feature went off releases what it holds)."""
        return None

    def close(self) -> None:
        """Shutdown: release everything (hooks, profiler windows, tracing)."""
        return None

    def section(self) -> dict[str, Any] | list[dict[str, Any]] | None:
        """The probe's section of the run report, or None."""
        return None


P = TypeVar("P", bound="Probe[Any]")


def _overrides(probe: Probe[Any], method: str) -> bool:
    return getattr(type(probe), method) is not getattr(Probe, method)


_MAX_FEATURE_SETS = 16  # hook lists kept at once (levels x modes in use; more only from hand-made Features)


class _Hooks:
    """The probes one set of features runs, by step hook: (index, probe) pairs in the set's order."""

    __slots__ = ("features", "enter", "exit", "finish")

    def __init__(self, features: Features | None) -> None:
        self.features = features
        self.enter: list[tuple[int, Probe[Any]]] = []
        self.exit: list[tuple[int, Probe[Any]]] = []
        self.finish: list[tuple[int, Probe[Any]]] = []


class ProbeSet:
    """The probes of one runtime, in a fixed order, with the step hooks each one overrides.
    Each probe has its own state type: here they are ``Probe[Any]``, and a step's states a
    list of ``object``."""

    def __init__(self, errors: InternalErrors) -> None:
        self._errors = errors
        self._probes: list[Probe[Any]] = []
        self._index: dict[int, int] = {}
        self._hooks: dict[int, _Hooks] = {}  # id(features) -> the hook lists made for them

    def add(self, probe: P) -> P:
        """Add a probe (at configure, before the first step)."""
        self._index[id(probe)] = len(self._probes)
        self._probes.append(probe)
        self.refresh()
        return probe

    def refresh(self) -> None:
        """A probe's :meth:`Probe.wanted` may answer otherwise now: the next step asks again."""
        self._hooks = {}

    def _hooks_for(self, features: Features | None) -> _Hooks:
        """The probes that act on steps with ``features``, by the step hooks they override; made
        once per features object (``Features.for_level`` makes one per level and mode: the
        runtime's, and those of operations pinned at their own) until :meth:`refresh`."""
        hooks = self._hooks.get(id(features))
        if hooks is not None and hooks.features is features:
            return hooks
        if len(self._hooks) >= _MAX_FEATURE_SETS:
            self._hooks = {}
        hooks = self._hooks[id(features)] = _Hooks(features)
        for i, probe in enumerate(self._probes):
            if features is None or not probe.wanted(features):
                continue
            for method, table in (("enter", hooks.enter), ("exit", hooks.exit), ("finish", hooks.finish)):
                if _overrides(probe, method):
                    table.append((i, probe))
        return hooks

    def __iter__(self) -> Iterator[Probe[Any]]:
        return iter(list(self._probes))

    def __len__(self) -> int:
        return len(self._probes)

    def find(self, kind: type[P]) -> P | None:
        """The probe of class ``kind``, or None."""
        for p in self._probes:
            if isinstance(p, kind):
                return p
        return None

    def state_of(self, states: list[object] | None, probe: Probe[S]) -> S | None:
        """``probe``'s state in a step's ``states`` (what :meth:`enter` returned)."""
        i = self._index.get(id(probe))
        # The state at the probe's index is what its enter() returned: an S.
        return cast("S | None", states[i]) if states is not None and i is not None else None

    # ------------------------------------------------------------ step hooks
    def enter(self, scope: StepScope) -> list[object] | None:
        states: list[object] | None = None
        for i, probe in self._hooks_for(scope.features).enter:
            try:
                state = probe.enter(scope)
            except Exception as exc:
                self._errors.report(probe.component, exc)
                continue
            if state is not None:
                if states is None:
                    states = [None] * len(self._probes)
                states[i] = state
        return states

    def exit(self, scope: StepScope, states: list[object] | None, exc: BaseException | None, plan: ReadPlan) -> None:
        for i, probe in self._hooks_for(scope.features).exit:
            try:
                tensor = probe.exit(scope, states[i] if states is not None else None, exc)
                if tensor is not None:
                    plan.add(probe, tensor)
            except Exception as err:
                self._errors.report(probe.component, err)

    def finish(self, scope: StepScope, states: list[object] | None, record: StepRecord, plan: ReadPlan,
               values: list[float] | None) -> None:
        for i, probe in self._hooks_for(scope.features).finish:
            try:
                probe.finish(scope, states[i] if states is not None else None, record,
                             plan.take(probe, values) if plan is not None else None)
            except Exception as err:
                self._errors.report(probe.component, err)

    # ------------------------------------------------------------ lifecycle
    def on_level(self, features: Features) -> None:
        self.refresh()
        for probe in list(self._probes):
            try:
                probe.on_level(features)
            except Exception as exc:
                self._errors.report(probe.component, exc)

    def close(self) -> None:
        for probe in list(self._probes):
            try:
                probe.close()
            except Exception as exc:
                self._errors.report(probe.component, exc)

    def sections(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for probe in list(self._probes):
            try:
                section = probe.section()
            except Exception as exc:
                self._errors.report(probe.component, exc)
                continue
            if section is not None:
                out[probe.name] = section
        return out
