"""The FLOP counter's side of a step (:class:`~torchtrace.step.throughput.RunThroughput` holds
it): opening the counter on a step whose input shapes were not counted yet, dropping an
enclosing operation's counter, leaving it at the step's end. Each runs on a few steps of a
run only (a new input shape, an epoch's first step): the per-step path is in ``throughput``.
"""

from __future__ import annotations

import weakref
from typing import Any, Hashable

from torchtrace.measure.flops import LateKey, countable, release_counter
from torchtrace.step.phases import none_ref


class FlopCounting:
    """Counter handling of :class:`~torchtrace.step.throughput.RunThroughput` (which sets
    ``rt``, ``flops``, ``calls``, ``_given`` and ``_counting``)."""

    rt: Any
    flops: Any
    calls: Any
    _given: set[str]
    _counting: Any

    def _counter(self, scope: Any, key: Hashable | None, outermost: bool) -> Any:
        """The FLOP counter of a step whose inputs' shapes were not counted yet, if it counts."""
        if not outermost and scope.optimizer is not None:
            # A training step inside another operation (an epoch): that one is a container.
            outermost = self._release_container()
        if scope.name in self._given:
            return None
        if type(key) is LateKey:
            if not outermost:
                return None
        elif not (outermost and key is not None and self.flops.needs_count(key)) or self._skipped(key):
            return None
        counter = self.flops.begin(key)  # (None while a profiler records: a later step counts)
        if counter is not None:
            self._counting = weakref.ref(scope)  # weak: a scope holds the user's model
        return counter

    def _release_container(self) -> bool:
        """A step with an optimizer began inside another operation: that operation holds steps
        (an epoch), so its FLOPs are not counted, and the FLOP counter it holds open, if any, is
        dropped now (counting a whole epoch slowed it down several times, and its steps were
        never counted; one below a mode of the user's runs on and records nothing). True when
        the step may count its own FLOPs."""
        owner = self._counting()
        if owner is None or owner._flops_counter is None:
            return True
        if not owner.active:
            return False
        if release_counter(owner._flops_counter):  # (else below a mode of the user's: it records nothing)
            owner._flops_counter = None
        if type(owner.flops_key) is LateKey:
            self.calls.dropped(owner.name)
        else:
            self.flops.skip(owner.flops_key)
        self._counting = none_ref
        return True

    def _skipped(self, key: Hashable) -> bool:
        """True (and the key is never counted) when the counter cannot run on the step's inputs."""
        if countable(key):
            return False
        self.flops.skip(key)
        return True

    def _close_counter(self, scope: Any, counter: Any, exc: BaseException | None) -> bool:
        """Leave the step's FLOP counter; True when it counted the whole step."""
        try:
            if exc is None:
                counter.__exit__(None, None, None)
                return True
            failures = self.flops.failures
            counter.__exit__(type(exc), exc, None)
            if self.flops.failures > failures:
                self._counter_failed(scope, exc)
        except Exception as err:
            self.rt.errors.report("other", err)
        return False

    def _counter_failed(self, scope: Any, exc: BaseException) -> None:
        """An op of the step raised under the FLOP counter: that key is never counted again (so
        the user's next try runs without the counter); say so once."""
        self.rt.warn_once(("flops", scope.name),
                          "torchtrace: %s: an op raised while the step's FLOPs were being counted (%s: %s); "
                          "steps with these input shapes are not counted again (record_batch(flops=...) gives "
                          "their FLOPs)", scope.name,
                          type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
