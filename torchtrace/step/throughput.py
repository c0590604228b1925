"""How fast a step ran: its batch (samples, tokens), FLOPs, learning rate and phases (the
clock is :mod:`torchtrace.step.phases`), and the run's goodput accounting.

On the training thread a step pays for: reading the batch's shapes (no host read: a mask's
token count rides in the step's one read), a dictionary lookup of the FLOPs of its input
shapes (counted once per shape under ``FlopCounterMode``; that step is left out of
throughput), the optimizer's learning rates, five clock reads at the phase boundaries (forward,
backward, optimizer, step end; CUDA events on a GPU, read with the step's deferred read). Each
finished record is booked in the goodput ledger (:mod:`torchtrace.record.goodput`): data wait,
MFU, the throughput rules.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Hashable

import torch

from torchtrace.forensics.replay import find_side_effect_owners
from torchtrace.measure import peaks
from torchtrace.measure.batch import NOTHING, BatchSize, batch_of
from torchtrace.measure.flops import LateKey, StepFlops, drop_counter, shape_key
from torchtrace.measure.learning_rates import learning_rates, plan_rates
from torchtrace.measure.shape_keys import loose_shape_key, truncated
from torchtrace.measure.scaler import scale_at_start, skipped_update
from torchtrace.record.goodput import MAX_PEAKS, TRAIN, GoodputLedger, enclosing
from torchtrace.record.step import Anomaly, StepRecord
from torchtrace.step.call_keys import MANY, CallKeys
from torchtrace.step.cycles import DeviceCycles
from torchtrace.step.flop_counting import FlopCounting
from torchtrace.step.nesting import below_containers, hold_steps
from torchtrace.step.phases import ModelMarks, OptimizerMarks, StepClock, host_clock, none_ref
from torchtrace.step.trainable import TrainedParameters
from torchtrace.step.watched import hookable

MAX_SHAPES = 256  # input-shape keys whose FLOPs and batch size are kept
_NOT_READ = object()  # a step's learning rates before they were read
_NO_FAST = (None, none_ref, none_ref, None, none_ref)  # RunThroughput._fast when no step may take the short way


class RunThroughput(FlopCounting):
    """The runtime's side: FLOPs per input shape, phase hooks, peak FLOP/s and the goodput ledger."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.flops = StepFlops()
        self.ledger = GoodputLedger(configured_at=time.perf_counter(), peak_flops=rt.settings.peak_flops)
        if not rt.features.throughput:  # configured at level off or with throughput=False: not measuring
            self.ledger.pause(self.ledger.configured_at)
        self._models: "weakref.WeakKeyDictionary[Any, ModelMarks]" = weakref.WeakKeyDictionary()
        self._optimizers: "weakref.WeakKeyDictionary[Any, OptimizerMarks]" = weakref.WeakKeyDictionary()
        self._peaks: dict[str, float | None] = {}  # peak FLOP/s by device and dtype
        self._peaked: set[str] = set()  # operations whose peak was looked up
        self._cycles = DeviceCycles()  # on a GPU, the rates' time base
        self.framework_dtype: torch.dtype | None = None  # what a framework says its steps compute in
        # Batch size of each input-shape key (one per key unless a mask is counted), and FLOPs
        # and batch size of each key whose FLOPs are final (see _shape_of).
        self._batches: dict[Hashable, BatchSize] = {}
        self._shapes: dict[Hashable, tuple[float | None, BatchSize]] = {}
        self.trained = TrainedParameters(self.flops, rt.warn_once, self._shapes.clear)  # FLOPs recounted on a change
        self._counted_with = self.trained.counted_with  # (the same dict: looked up every step)
        self._no_scaler: set[str] = set()  # operations whose arguments hold no GradScaler
        self._last: tuple[Any, Any, ModelMarks] | None = None  # (model ref, optimizer ref, hooks) of the last step
        # What lets start() take the short way: (operation, model ref, optimizer ref, the marks'
        # call-through, the model's first parameter's ref) of the step before, when it was an
        # outermost step without a GradScaler (none in its arguments) and the marks sit in the seam.
        self._fast: tuple[Any, ...] = _NO_FAST
        self.calls = CallKeys(self.flops)  # steps keyed by their model's call (no batch in their arguments)
        self._opaque = self.calls.opaque  # (the same set: looked up every step)
        self._given: set[str] = set()  # operations whose steps gave their FLOPs (record_batch, a framework)
        self._containers: set[str] = set()  # operations that held training steps (an epoch)
        self._counting: Any = none_ref  # the step whose FLOP counter was last opened (while open), weakly
        self.left_at: float | None = None  # when the last step's bookkeeping ended (perf_counter)

    # ------------------------------------------------------------ step start and end
    def start(self, scope: Any, parent: Any) -> None:
        """At a step's start (``parent``: the step it runs inside, or None): the scope's FLOP key,
        phase clock and FLOP counter (``flops_key``, ``clock``, ``_flops_counter``; the counter
        is None unless this step counts, as the scope's fields were); a failure here costs the
        step its throughput figures, never its record. The FLOP key: the operation and its
        inputs' shapes past ``batch_skip`` (a method's instance), less the arguments the FLOP
        table learnt do not decide FLOPs (a growing list). Every step pays for this: a step like
        the one before (an outermost step of the same operation, model and optimizer, no
        GradScaler, the marks still in the model's seam) takes the shortest way, :meth:`_start`
        every other."""
        scope.parent = parent
        scope.holds_steps = False
        inputs = scope.inputs
        name = scope.name
        fast_name, model_ref, optimizer_ref, call, first_ref = self._fast
        if parent is not None or inputs is None or fast_name is not name or scope.scaler is not None:
            scope.flops_key, scope.clock, scope._flops_counter = self._start(scope, parent)
            return
        try:
            model = scope.model
            # (The references are weak: a dead one says None, which no model is.)
            if model is None or model_ref() is not model or optimizer_ref() is not scope.optimizer \
                    or model.__dict__.get("_compiled_call_impl") is not call:
                scope.flops_key, scope.clock, scope._flops_counter = self._start(scope, parent)
                return
            skip, loose = scope.batch_skip, self.flops.loose
            args = inputs[0][skip:] if skip else inputs[0]
            key = (name, loose_shape_key(args, inputs[1], loose[name]) if loose and name in loose
                   else shape_key(args, inputs[1]))
            if self._opaque and key in self._opaque:
                # Arguments that hold no batch (an iterator): keyed by the model's call.
                key = scope.flops_key = scope.shape = shape = None
            else:
                scope.flops_key = key
                scope.shape = shape = self._shapes.get(key)
            first = first_ref()
            scope.clock = clock = host_clock() if first is None or not first.is_cuda else StepClock(True)
            if shape is not None:
                clock.batch = MANY  # (the seam keeps the batch of the model's call unless the arguments gave one)
                return  # its FLOPs are known: nothing to count
            if key is None and self.calls.counts(name) and name not in self._given:
                key = scope.flops_key = LateKey()  # no batch in its arguments, a model: its call's key
            scope._flops_counter = self._counter(scope, key, True)
        except Exception as exc:
            self.rt.errors.report("step", exc)
            scope.flops_key = scope.clock = scope._flops_counter = None

    def _start(self, scope: Any, parent: Any) -> tuple[Hashable | None, StepClock | None, Any]:
        """:meth:`start`, every way (a nested step, a scaler, another model or operation than
        the step before's, marks to put back); it notes a step :meth:`start` may take the short
        way for next."""
        outermost = parent is None
        if parent is not None:
            if scope.optimizer is not None and scope.kind == TRAIN:
                hold_steps(parent, self._containers)
            else:  # inside operations that hold training steps (an epoch): counted as without them
                outermost = below_containers(parent, self._containers)
        try:
            inputs = scope.inputs
            name = scope.name
            if inputs is None:
                key = None
            else:
                skip, loose = scope.batch_skip, self.flops.loose
                args = inputs[0][skip:] if skip else inputs[0]
                key = (name, loose_shape_key(args, inputs[1], loose[name]) if loose and name in loose
                       else shape_key(args, inputs[1]))
                if self._opaque and key in self._opaque:
                    key = None  # arguments that hold no batch (an iterator): keyed by the model's call
            scope.flops_key = key
            scope.shape = shape = self._shapes.get(key) if key is not None else None
            if scope.scaler is None and inputs is not None and name not in self._no_scaler:
                self._find_scaler(scope, inputs)
            if scope.scaler is not None:
                scope.scale_before = scale_at_start(scope.scaler)
            model = scope.model
            clock = None
            self._fast = _NO_FAST
            if model is not None:
                last = self._last
                cuda = last[2].state(model) if last is not None and last[0]() is model \
                    and last[1]() is scope.optimizer else None
                if cuda is None:  # not the model and optimizer of the step before, or its marks were displaced
                    last = self._hooks_for(model, scope.optimizer)
                    cuda = last[2].state(model)
                hooks = last[2]
                if outermost and hooks.seam and scope.scaler is None and name in self._no_scaler \
                        and last[0] is not none_ref:
                    self._fast = (name, last[0], last[1], hooks.call, hooks.first)  # (see __init__)
                # (The seam keeps the batch of the model's call unless the arguments gave one.)
                clock = StepClock(cuda, MANY if shape is not None else None)
            if shape is not None and outermost:
                return key, clock, None  # its FLOPs are known: nothing to count
            if key is None and clock is not None and self.calls.counts(scope.name) and name not in self._given:
                key = scope.flops_key = LateKey()  # no batch in its arguments, a model: its call's key
            return key, clock, self._counter(scope, key, outermost)
        except Exception as exc:
            self._fast = _NO_FAST
            self.rt.errors.report("step", exc)
            return None, None, None

    def _find_scaler(self, scope: Any, inputs: tuple) -> None:
        """A GradScaler passed to the step function; an operation whose first step had none is
        not searched again."""
        scalers = find_side_effect_owners(*inputs)[1]
        scope.scaler = scalers[0] if scalers else None
        if scope.scaler is None and len(self._no_scaler) < 1024:
            self._no_scaler.add(scope.name)

    def _hooks_for(self, model: Any, optimizer: Any) -> tuple[Any, Any, ModelMarks]:
        hooks = self._models.get(model)
        if hooks is None:
            hooks = self._models[model] = ModelMarks(model)
        elif hooks.state(model) is None:
            hooks.detach()  # a seam the user compiled over: put the marks around their compiled call
            hooks.attach(model)
        if optimizer is not None and optimizer not in self._optimizers and hookable(optimizer):
            self._optimizers[optimizer] = OptimizerMarks(optimizer)
        try:  # weak references only: a model the user drops is not kept alive here
            last = (weakref.ref(model), weakref.ref(optimizer) if optimizer is not None else none_ref, hooks)
        except TypeError:  # an object without weak references: looked up every step
            return none_ref, none_ref, hooks
        self._last = last
        return last

    def finish_step(self, scope: Any, counter: Any, exc: BaseException | None, given: tuple | None,
                    plan: Any) -> tuple[int | None, int | None, float | None, bool, list[float] | None]:
        """At a step's end: ``(samples, tokens, flops, counted, learning rates)`` for its record.

        Closes the step's FLOP counter (``counted``: the step ran under it, so its time is not
        throughput) and adds to the step's one read what only the device knows (a mask's token
        count, whether a GradScaler skipped the update). ``given`` is what ``record_batch``
        said: it wins over what was inferred or counted."""
        shape = scope.shape
        grads = scope.gradients
        if shape is not None and counter is None and given is None and scope.scaler is None:
            # The usual step: its input shapes' FLOPs and batch are known and final (host values).
            lr = grads.lr if grads is not None else None
            if lr is None:
                lr = learning_rates(scope.optimizer)
            if lr.__class__ is list or lr is None:  # (else a DeviceRates: read with the step)
                return shape[1].samples, shape[1].tokens, shape[0], False, lr
        else:
            lr = _NOT_READ
        counted = False
        by_call = shape is None and scope.clock is not None and (scope.flops_key is None
                                                                 or type(scope.flops_key) is LateKey)
        if by_call:
            self.calls.resolve(scope)
        if counter is not None:
            ended = self.flops.fits.ended
            counted = self._close_counter(scope, counter, exc)
            if self.flops.fits.ended != ended:  # a count disagreed with a fit: forget what it gave
                self._shapes.clear()
        flops, batch = shape if shape is not None else self._shape_of(scope, by_call)
        if given is not None:
            batch = (batch or NOTHING).with_overrides(samples=given[0], tokens=given[1])
        samples = tokens = None
        if batch is not None:
            samples, tokens = batch.samples, batch.tokens
            if isinstance(tokens, torch.Tensor):
                plan.add("tokens", tokens.to(torch.float64))
                tokens = None  # filled from the read
            elif tokens is not None:
                tokens = int(tokens)
            if type(samples) is not int and isinstance(samples, torch.Tensor):  # a packed row's sequences
                plan.add("samples", samples.to(torch.float64))
                samples = None  # filled from the read
        if scope.scaler is not None:
            try:
                skipped = skipped_update(scope.scaler, scope.optimizer, scope.scale_before)
                if skipped is not None:
                    plan.add("scaler_skipped", skipped)
            except Exception as err:
                self.rt.errors.report("step", err)
        if given is not None and given[2] is not None:
            flops = given[2]  # (a step that ran under the counter still ran slower: not throughput)
            if len(self._given) < MAX_SHAPES:
                self._given.add(scope.name)  # its FLOPs are given: it is not counted again
        if lr is _NOT_READ:  # (read after the FLOP counter closed: a device rate's copy is no op of the step's)
            lr = grads.lr if grads is not None and grads.lr is not None else learning_rates(scope.optimizer)
        if lr is not None and type(lr) is not list:  # some rates are on a device: read with the step
            plan_rates(lr, plan)
            lr = None  # filled from the read
        return samples, tokens, flops, counted, lr

    def _shape_of(self, scope: Any, by_call: bool) -> tuple[float | None, BatchSize | None]:
        """``(FLOPs, batch size)`` of a step's input shapes: looked up after a count, inferred
        from the inputs. Kept for the shapes' later steps once final: the FLOPs are counted (or
        never will be) and the batch size is not a device count (a mask's). ``by_call``: the
        step is keyed by its model's call (:mod:`torchtrace.step.call_keys`), whose batch is its batch."""
        key, clock, forward = scope.flops_key, scope.clock, None
        if clock is not None:
            forward, clock.batch = clock.batch, None  # its tensors are not kept past this
            forward = None if forward is MANY else forward
        if by_call:
            if key is None:  # (no one call's batch)
                return None, None
            cached = self._shapes.get(key)
            return cached if cached is not None else self._kept(key, self.flops.lookup(key), batch_of(forward))
        if key is None:
            return None, batch_of(scope.inputs, scope.batch_skip)
        flops = self.flops.lookup(key)
        batch = self._batches.get(key)
        if batch is None:
            batch = batch_of(scope.inputs, scope.batch_skip)
            if batch.samples is None and batch.tokens is None and forward is not None:
                called = batch_of(forward)
                if called.samples is not None and self.calls.adopt(scope, key, flops, forward):
                    return flops, called
            if not batch.pending and len(self._batches) < MAX_SHAPES and not truncated(key):
                self._batches[key] = batch
        return self._kept(key, flops, batch)

    def _kept(self, key: Hashable, flops: float | None, batch: BatchSize) -> tuple[float | None, BatchSize]:
        """``(flops, batch)``, kept for the key's later steps once final (see :meth:`_shape_of`)."""
        if not batch.pending and not self.flops.needs_count(key) and len(self._shapes) < MAX_SHAPES \
                and not truncated(key):  # (a key that leaves part of the batch out: its samples may differ)
            self._shapes[key] = (flops, batch)
        return flops, batch

    # ------------------------------------------------------------ finished records
    def account(self, scope: Any, record: StepRecord) -> None:
        """The record's phases, and its booking in the goodput ledger: its data wait, and the
        throughput rules' anomalies. (MFU, goodput and badput are read from the ledger when
        metrics are scraped.)"""
        clock = scope.clock
        operation = record.operation
        # On the host there is no device cycle (DeviceCycles.cycle would say None): no call.
        if clock is not None:
            record.phases = clock.phases(scope.step_end)  # on CUDA once its events completed
            device_cycle = self._cycles.cycle(operation, clock) if clock.cuda or self._cycles.last is not None else None
        else:
            device_cycle = self._cycles.cycle(operation, None) if self._cycles.last is not None else None
        flops = record.flops
        if flops is not None:
            if operation not in self._given:
                # TrainedParameters.changed, called only where it may say True: a count now, or
                # FLOPs counted with another number of parameter tensors with gradients.
                grads = scope.gradients
                stats = grads.stats if grads is not None else None
                if stats is not None and (record.flops_counted or self._counted_with.get(operation) not in (
                        None, len(stats.names))) and self.trained.changed(operation, grads, record.flops_counted):
                    flops = record.flops = None  # counted with other parameters trained
            if flops is not None and operation not in self._peaked:
                self._look_up_peak(scope, operation)
        start, parent = scope.started_at, scope.parent
        record.data_wait_s, findings = self.ledger.post(
            start, start + record.duration_s,
            not (record.skipped or record.scaler_overflow) and record.exception_type is None,  # update applied
            record.flops_counted, record.samples, record.tokens, int(flops) if flops is not None else None,
            record.kind, operation, device_cycle,
            enclosing(parent.kind, parent.started_at, getattr(parent, "holds_steps", False)) if parent else None,
            scope.holds_steps, scope.entered_at, scope.left_before)
        for finding in findings:
            record.anomalies.append(Anomaly(finding.kind, finding.detail, record.step, operation, dict(finding.data)))

    def book(self, start: float, end: float, kind: str, operation: str) -> None:
        """Time between steps that a framework spent on an operation of ``kind`` (its evaluation
        loop, a checkpoint save) and the step pipeline saw no step of: badput of that kind
        instead of data wait (perf_counter seconds; an operation named for the record)."""
        self.ledger.post(start, end, True, True, None, None, None, kind, operation)

    def scrape(self) -> tuple[float | None, dict[str, float], dict[str, float | None]]:
        """For ``/metrics``: the goodput ratio now, badput seconds by kind (final counts: they
        only grow), and each operation's MFU over its last window."""
        mfu = {}
        for name in list(self.rt.history.operations):
            tp = self.ledger.throughput(name)
            if tp is not None and tp.mfu is not None:
                mfu[name] = tp.mfu
        return self.ledger.snapshot(time.perf_counter(), self.left_at).ratio, self.ledger.closed().badput, mfu

    def _look_up_peak(self, scope: Any, operation: str) -> None:
        """The operation's peak, once: at its first step with FLOPs and a model (whose device
        and dtype say which peak)."""
        if scope.model is None and self.ledger.peak_flops is None:
            return  # a later step of the operation may name its model
        if len(self._peaked) < MAX_PEAKS:  # the ledger keeps no more
            self._peaked.add(operation)
            if self.ledger.peak_flops is None:
                self.ledger.set_peak(operation, self._peak(scope))

    def _peak(self, scope: Any) -> float | None:
        # The dtype the counted step's FLOPs ran in; without a count (FLOPs the user or a
        # framework gave), the framework's mixed precision, then peaks.model_peak's.
        dtype = self.flops.compute_dtype(scope.flops_key) if scope.flops_key is not None else None
        return peaks.model_peak(scope.model, dtype if dtype is not None else self.framework_dtype, self._peaks)

    def section(self) -> dict[str, Any]:
        # Up to the end of the last step, as the badput counters on /metrics: data wait runs
        # from one step's end to the next one's start, and no step follows the last (yet).
        g = self.ledger.closed()
        ops = {}
        for name in list(self.rt.history.operations):
            tp = self.ledger.throughput(name)
            if tp is not None:
                ops[name] = {"steps": tp.steps, "seconds": tp.seconds, "samples_per_s": tp.samples_per_s,
                             "tokens_per_s": tp.tokens_per_s, "flops_per_s": tp.flops_per_s, "mfu": tp.mfu,
                             "peak_flops": self.ledger.peak_of(name), "data_wait_share": tp.data_wait_share}
        return {"wall_s": g.wall_s, "productive_s": g.productive_s, "goodput_ratio": g.ratio, "badput_s": g.badput,
                "peak_flops": self.ledger.peak_flops, "flop_counted_shapes": len(self.flops), "operations": ops}

    def release(self) -> None:
        """Throughput went off: take the forward marks off the models, so that a model called at
        level OFF, or with ``throughput=False``, runs PyTorch's own call. The next step that
        measures throughput puts them back. The optimizers keep their two step hooks until
        shutdown (one call each per ``optimizer.step()``, which returns at once outside a step).
        Goodput pauses until the next measured step: unmeasured time is no class's."""
        self.ledger.pause(time.perf_counter())
        for hooks in list(self._models.values()):
            hooks.detach()

    def close(self) -> None:
        self._last, self._fast = None, _NO_FAST
        for hooks in list(self._models.values()) + list(self._optimizers.values()):
            hooks.remove()
        self._models.clear()
        self._optimizers.clear()


__all__ = ["RunThroughput", "StepClock", "drop_counter", "learning_rates"]
