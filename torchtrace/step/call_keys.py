"""FLOP keys from the model's call, for steps whose arguments do not give their batch.

A step's FLOPs are counted once per key, and the key is normally the shapes of the step's
arguments, known when it begins. Two kinds of step have no such shapes: a ``debug_context``
without ``inputs=`` (and a framework's step, opened before its batch is known), and a step
whose arguments hold no batch (an iterator it draws from, no arguments at all). Both are
keyed by the shapes of their model's call instead, which the forward seam keeps
(``StepClock.batch``) and which are known only once the step has called the model. So the
count cannot wait for a new key: a step is counted when the operation's step before it had
shapes still without FLOPs (or it is the operation's first), under a :class:`LateKey` that
the step's end fills in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable

import torch

from torchtrace import current
from torchtrace.measure.batch import MAX_MICRO_BATCHES, MicroBatches, batch_of, same_arguments
from torchtrace.measure.flops import LateKey, StepFlops, countable, leave_counter, shape_key
from torchtrace.measure.gradients import GradientMark, backward_between

if TYPE_CHECKING:
    from torchtrace.step.scope import StepScope
    from torchtrace.step.state import StepThroughput

MAX_KEYS = 256  # operations, and keys of each kind below, kept
MANY = object()  # StepClock.batch once the model was called on another batch in the step


class _Call(tuple):
    """A model call's ``(args, kwargs)``, with the state of the model's gradients when it was
    made (:class:`~torchtrace.step.phases.FirstGradient`): a later call after a backward is another micro-batch; and
    whether autograd was on (``graph``): a call without it trains nothing."""

    grads: GradientMark | None = None
    updates = 0
    graph = True


def note_call(scope: StepScope, args: tuple, kwargs: dict, grads: GradientMark | None) -> None:
    """The model was called in a step whose arguments gave no batch (``clock.batch`` is not
    MANY), its gradients standing at ``grads`` (:class:`~torchtrace.step.phases.FirstGradient`): keep the call's
    arguments. A call on another batch after a backward (the model's gradients changed since
    the call before: gradient accumulation) is one more micro-batch,
    kept with the others (:class:`MicroBatches`, samples and tokens summed, FLOPs counted over
    them all); so is a call after an update of the step's optimizer (a loop that zeroes the
    gradients before each forward: they are None at every call). On another batch without a
    backward or an update between (two views, an evaluation loop), or past the batch rules'
    limit of micro-batches, the step has none, and its count ends if it is keyed by the call.
    An activation checkpoint's recomputation passes the same tensors: one batch.

    A call with autograd off beside calls with it on is no batch of the step: it trains nothing
    (Double DQN's choice of the next actions with the online network, a held-out batch looked
    at after the update). It is passed over, and an earlier such call gives way to the first
    call with autograd on. (Its FLOPs ran, and are counted.)

    A forensic replay's calls are none of the step's batches (its own hidden state, say, is
    another tensor: the step lost its batch and its FLOPs to a replay)."""
    rt = current.runtime(create=False)
    if rt is not None and rt.replaying:
        return
    state = scope.throughput
    clock = state.clock if state is not None else None
    if state is None or clock is None:
        return
    batch = clock.batch
    graph = torch.is_grad_enabled()
    if batch is None or (graph and type(batch) is _Call and not batch.graph):
        clock.batch = call = _Call((args, kwargs))
        call.grads = grads
        call.updates = _updates(scope)
        call.graph = graph
        return
    if batch is MANY:
        return
    if not graph and (type(batch) is MicroBatches or batch.graph):
        return
    last = batch[0][-1] if type(batch) is MicroBatches else batch
    if same_arguments(last, args, kwargs):
        return
    updates = _updates(scope)
    another = backward_between(batch.grads, grads) or updates > batch.updates
    if another and _countable_calls(batch):
        calls = list(batch[0]) if type(batch) is MicroBatches else [tuple(batch)]
        clock.batch = MicroBatches.of([*calls, (args, kwargs)])
        clock.batch.grads = grads
        clock.batch.updates = updates
        return
    clock.batch = MANY
    _say_no_batch(scope, too_many=another)
    counter = state.counter
    if counter is not None and type(state.key) is LateKey and leave_counter(counter):
        state.counter = None


def _say_no_batch(scope: StepScope, too_many: bool) -> None:
    """Say once per operation and run why its steps get no samples (a warning, not silence):
    calls on several batches with no backward or update between them, or, ``too_many``, more
    micro-batches than the batch rules keep. A step whose arguments give its batch (a WGAN
    critic's step given its real batch, calling the critic on fakes and interpolates too) has
    its samples all the same: nothing to say."""
    name = getattr(scope, "name", None)
    rt = current.runtime(create=False)
    if not isinstance(name, str) or rt is None or _arguments_give_batch(scope):
        return
    why = (f"more than {MAX_MICRO_BATCHES} batches in one step (a loop over the data inside the step: an epoch?)"
           if too_many else "several batches with no backward between them (two views of a batch, an evaluation "
           "loop)")
    rt.warn_once(("no batch", name), "torchtrace: %s called its model on %s: its steps get no samples, tokens or "
                 "FLOPs from the model's calls; give step.record_batch(samples=..., tokens=...) or "
                 "debug_context(inputs=...)", name, why)


def _arguments_give_batch(scope: StepScope) -> bool:
    """Whether the step is keyed by its arguments (not by its model's call) and they hold a
    batch with samples or tokens: the model's calls are then not where its batch comes from."""
    key = scope.throughput.key if scope.throughput is not None else None
    if key is None or type(key) is LateKey:
        return False
    batch = batch_of(scope.inputs, scope.batch_skip, scope.model)
    return batch is not None and (batch.samples is not None or batch.tokens is not None)


def _countable_calls(batch: object) -> bool:
    """Room for one more micro-batch (up to the batch rules' limit)."""
    return type(batch) is not MicroBatches or len(batch[0]) < MAX_MICRO_BATCHES


def _updates(scope: StepScope) -> int:
    """How many times the step's optimizer has updated so far in the step (0 without one)."""
    check = scope.gradients
    return check.updates if check is not None else 0


class CallKeys:
    """The model-call keys of a run's operations; one per :class:`~torchtrace.step.throughput.RunThroughput`."""

    def __init__(self, flops: StepFlops) -> None:
        self.flops = flops
        self.last: dict[str, Hashable | None] = {}  # the key of each operation's last step (None: none)
        self.missed: set[Hashable] = set()  # keys whose next step, counted for them, had other shapes
        self.opaque: set[Hashable] = set()  # argument keys that hold no batch (see adopt)

    def counts(self, name: str) -> bool:
        """Whether the operation's next step is counted: it is its first, or the step before it
        had shapes still to count (a new length: that step itself got no FLOPs)."""
        last = self.last.get(name, LateKey)
        return last is LateKey or (last is not None and self.flops.needs_count(last) and last not in self.missed
                                   and countable(last))

    def resolve(self, name: str, state: StepThroughput) -> None:
        """At a step's end: its FLOP key is its model's call's (None when the model was not
        called, or called on several batches), which its count, if it ran under one, is
        recorded for; remembered for the operation's next step (:meth:`counts`)."""
        assert state.clock is not None
        forward, late = state.clock.batch, state.key
        key = (name, shape_key(forward[0], forward[1])) if forward is not None and forward is not MANY else None
        if type(late) is LateKey:
            if key is not None and countable(key) and self.flops.needs_count(key):
                late.value = key
            elif self.last.get(name) is not None and len(self.missed) < MAX_KEYS:
                self.missed.add(self.last[name])  # shapes of one step (a short last batch): not again
        if name in self.last or len(self.last) < MAX_KEYS:
            self.last[name] = key
        state.key = key

    def adopt(self, name: str, key: Hashable, flops: float | None, forward: tuple) -> bool:
        """The step's arguments (``key``) hold no batch and it called its model on one: the
        operation's steps with these arguments are keyed by the model's call from now on, and
        this step's FLOPs are that call's shapes'. False when no more keys are kept."""
        if len(self.opaque) >= MAX_KEYS:
            return False
        self.opaque.add(key)
        self.last[name] = call = (name, shape_key(forward[0], forward[1]))
        if flops is not None:
            self.flops.record(call, flops)
        return True

    def dropped(self, name: str) -> None:
        """The operation's count was dropped (it holds steps: an epoch): it is not counted again."""
        self.last[name] = None


__all__ = ["MANY", "CallKeys", "LateKey", "note_call"]
