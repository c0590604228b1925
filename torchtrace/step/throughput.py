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

import math
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Hashable, NamedTuple

import torch

from torchtrace.measure import peaks
from torchtrace.measure.batch import NOTHING, BatchSize, batch_of
from torchtrace.measure.flops import LateKey, StepFlops, countable, drop_counter, release_counter, shape_key
from torchtrace.measure.learning_rates import learning_rates, plan_rates
from torchtrace.measure.scaler import find_side_effect_owners, scale_at_start, skipped_update
from torchtrace.measure.shape_keys import loose_shape_key, truncated
from torchtrace.record.goodput import MAX_PEAKS, TRAIN, FinishedStep, GoodputLedger, enclosing
from torchtrace.record.goodput_types import EVALUATION
from torchtrace.record.step import Anomaly, StepRecord
from torchtrace.step.call_keys import MANY, CallKeys
from torchtrace.step.cycles import DeviceCycles
from torchtrace.step.phases import ModelMarks, OptimizerMarks, StepClock, none_ref
from torchtrace.step.state import StepThroughput
from torchtrace.step.trainable import TrainedParameters
from torchtrace.step.watched import hookable

if TYPE_CHECKING:
    from contextlib import ExitStack

    from torchtrace.record.readout import ReadPlan
    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope

MAX_SHAPES = 256  # input-shape keys whose FLOPs and batch size are kept
MAX_CONTAINERS = 256  # operation names remembered as holding training steps
_NOT_READ = object()  # a step's learning rates before they were read


class StepFigures(NamedTuple):
    """A step's throughput figures for its record: None where a device read fills them in
    (a mask's token count, learning rates on a device). ``counted``: the step ran under the
    FLOP counter (its time is not throughput)."""

    samples: int | None
    tokens: int | None
    flops: float | None
    counted: bool
    lr: list[float] | None


UNMARKED_EVALUATION = "unmarked_evaluation"
"""The operation an evaluation the script did not mark is booked under (:meth:`RunThroughput.unmarked_call`)."""


class RunThroughput:
    """The runtime's side: FLOPs per input shape, phase marks, peak FLOP/s and the goodput ledger."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.flops = StepFlops()
        self.ledger = GoodputLedger(configured_at=time.perf_counter(), peak_flops=rt.settings.peak_flops)
        if not rt.features.throughput:  # configured at level off or with throughput=False: not measuring
            self.ledger.pause(self.ledger.configured_at)
        self._models: weakref.WeakKeyDictionary[torch.nn.Module, ModelMarks] = weakref.WeakKeyDictionary()
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerMarks] = \
            weakref.WeakKeyDictionary()
        self._peaks: dict[str, float | None] = {}  # peak FLOP/s by device and dtype
        self._peaked: set[str] = set()  # operations whose peak was looked up
        self._cycles = DeviceCycles()  # on a GPU, the rates' time base
        self.framework_dtype: torch.dtype | None = None  # what a framework says its steps compute in
        # Batch size of each input-shape key (one per key unless a mask is counted), and FLOPs
        # and batch size of each key whose FLOPs are final (see _shape_of).
        self._batches: dict[Hashable, BatchSize] = {}
        self._shapes: dict[Hashable, tuple[float | None, BatchSize]] = {}
        # FLOPs are recounted when the trained parameters change.
        self.trained = TrainedParameters(self.flops, rt.warn_once, self._shapes.clear)
        self._no_scaler: set[str] = set()  # operations whose arguments hold no GradScaler
        self.calls = CallKeys(self.flops)  # steps keyed by their model's call (no batch in their arguments)
        self._given: set[str] = set()  # operations whose steps gave their FLOPs (record_batch, a framework)
        self._containers: set[str] = set()  # operations that held training steps (an epoch)
        # The step whose FLOP counter was last opened (while open), weakly: a scope holds the user's model.
        self._counting: Callable[[], StepScope | None] = none_ref
        self.left_at: float | None = None  # when the last step's bookkeeping ended (perf_counter)
        # [first start, last end] of the calls of a watched model under no_grad since the last
        # step began (an evaluation the script did not mark: see unmarked_call)
        self._unmarked: list[float] | None = None
        # Time between steps that is not data wait, waiting to be booked in time order with the
        # steps: unmarked evaluations a step's start closed, and bookings made while a step's
        # record still waited for its copy (on a GPU): see between_steps
        self._between: list[FinishedStep] = []

    # ------------------------------------------------------------ step start and end
    def start(self, scope: StepScope, parent: StepScope | None, entered_at: float) -> StepThroughput:
        """At a step's start: its throughput state (:class:`~torchtrace.step.state.StepThroughput`).

        ``parent`` is the step this one runs inside (or None); ``entered_at``, when torchtrace
        began it. The state holds the step's FLOP key (the operation and its inputs' shapes past
        ``batch_skip``, a method's instance, less the arguments the FLOP table learnt do not
        decide FLOPs), the FLOPs and batch size known for that key, the phase clock (the marks
        put on the model and optimizer where they are not) and, on a step whose shapes were not
        counted yet, the open FLOP counter. A failure here costs the step its throughput
        figures, never its record.
        """
        if self._unmarked is not None:  # an unmarked evaluation ran since the last step
            self._close_unmarked()
        state = StepThroughput(parent, entered_at, self.left_at)
        outermost = parent is None
        if parent is not None:
            if scope.optimizer is not None and scope.kind == TRAIN:
                hold_steps(parent, self._containers)
            else:  # inside operations that hold training steps (an epoch): counted as without them
                outermost = below_containers(parent, self._containers)
        try:
            name, inputs = scope.name, scope.inputs
            key = self._input_key(scope) if inputs is not None else None
            shape = self._shapes.get(key) if key is not None else None
            state.key, state.shape = key, shape
            if scope.scaler is None and inputs is not None and name not in self._no_scaler:
                scope.scaler = self._find_scaler(name, inputs)
            if scope.scaler is not None:
                state.scale_before = scale_at_start(scope.scaler)
            if scope.model is not None:
                # The seam keeps the batch of the model's call unless the arguments gave one.
                state.clock = StepClock(self._marks_on(scope.model, scope.optimizer),
                                        MANY if shape is not None else None)
            if shape is not None and outermost:
                return state  # its FLOPs are known: nothing to count
            if key is None and state.clock is not None and self.calls.counts(name) and name not in self._given:
                key = state.key = LateKey()  # no batch in its arguments, a model: its call's key
            state.counter = self._counter(scope, key, outermost)
        except Exception as exc:
            self.rt.errors.report("step", exc)
            state.key = state.shape = state.clock = state.counter = None
        return state

    def _input_key(self, scope: StepScope) -> Hashable | None:
        """The FLOP key of the step's inputs; None for arguments that hold no batch (an iterator),
        which are keyed by the model's call."""
        assert scope.inputs is not None
        args, kwargs = scope.inputs
        if scope.batch_skip:
            args = args[scope.batch_skip:]
        name, loose = scope.name, self.flops.loose
        key = (name, loose_shape_key(args, kwargs, loose[name]) if name in loose else shape_key(args, kwargs))
        return None if key in self.calls.opaque else key

    def _find_scaler(self, name: str, inputs: tuple[tuple, dict]) -> Any:
        """A GradScaler passed to the step function, or None; an operation whose first step had
        none is not searched again."""
        scalers = find_side_effect_owners(*inputs)[1]
        if scalers:
            return scalers[0]
        if len(self._no_scaler) < 1024:
            self._no_scaler.add(name)
        return None

    def _marks_on(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
        """Put the phase marks on the model and its optimizer where they are not (a new model,
        marks a ``model.compile()`` displaced: they go around the compiled call); whether the
        model is on a GPU (its clock then records CUDA events)."""
        marks = self._models.get(model)
        if marks is None:
            marks = self._models[model] = ModelMarks(model)
            # A container (a GAN's two networks, say); torch.compile(model)'s wrapper sets its forward on itself.
            if type(model).forward is torch.nn.Module.forward and "forward" not in vars(model):
                # (said under the key of the warning for a forward not seen, which it replaces)
                self.rt.warn_once(("phases", "unseen"), "torchtrace: the model of a step (%s) has no forward of its "
                                  "own: the step calls the modules it holds, so its phases hold the optimizer only",
                                  type(model).__name__)
        state = marks.state(model)
        if state is None:
            marks.detach()
            marks.attach(model)
            state = marks.state(model)
        if optimizer is not None:
            self.mark_optimizer(optimizer)
        return bool(state)

    def mark_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the phase marks on ``optimizer`` where they are not: its steps mark the optimizer
        phase of the open step."""
        if optimizer not in self._optimizers and hookable(optimizer):
            self._optimizers[optimizer] = OptimizerMarks(optimizer)

    def finish_step(self, scope: StepScope, state: StepThroughput, exc: BaseException | None,
                    given: tuple | None, plan: ReadPlan) -> StepFigures:
        """At a step's end: the throughput figures of its record.

        Closes the step's FLOP counter (``counted``: the step ran under it, so its time is not
        throughput) and adds to the step's one read what only the device knows (a mask's token
        count, whether a GradScaler skipped the update). ``given`` is what ``record_batch``
        said: it wins over what was inferred or counted. The usual step (its input shapes'
        FLOPs and batch known and final, no count, nothing given, no GradScaler, learning rates
        on the host) returns after the first lines."""
        shape, counter = state.shape, state.counter
        grads = scope.gradients
        if shape is not None and counter is None and given is None and scope.scaler is None:
            # The usual step: its input shapes' FLOPs and batch are known and final (host values).
            lr = grads.lr if grads is not None else None
            if lr is None:
                lr = learning_rates(scope.optimizer)
            if lr.__class__ is list or lr is None:  # (else a DeviceRates: read with the step)
                # (a kept shape's batch holds host counts, never device tensors)
                return StepFigures(shape[1].samples, shape[1].tokens, shape[0], False, lr)  # type: ignore[arg-type]
        else:
            lr = _NOT_READ  # type: ignore[assignment]  # (the sentinel, replaced below)
        counted = False
        by_call = shape is None and state.clock is not None and (state.key is None or type(state.key) is LateKey)
        if by_call:
            self.calls.resolve(scope.name, state)
        if counter is not None:
            state.counter = None
            ended = self.flops.fits.ended
            counted = self._close_counter(scope, counter, exc)
            if self.flops.fits.ended != ended:  # a count disagreed with a fit: forget what it gave
                self._shapes.clear()
        flops, batch = shape if shape is not None else self._shape_of(scope, state, by_call)
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
                skipped = skipped_update(scope.scaler, scope.optimizer, state.scale_before)
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
            plan_rates(lr, plan)  # type: ignore[arg-type]  # (not a plain list: a DeviceRates)
            lr = None  # filled from the read
        # (device counts went to the read above: samples and tokens are host ints or None here)
        return StepFigures(samples, tokens, flops, counted, lr)  # type: ignore[arg-type]

    def _shape_of(self, scope: StepScope, state: StepThroughput,
                  by_call: bool) -> tuple[float | None, BatchSize | None]:
        """``(FLOPs, batch size)`` of a step's input shapes: looked up after a count, inferred
        from the inputs. Kept for the shapes' later steps once final: the FLOPs are counted (or
        never will be) and the batch size is not a device count (a mask's). ``by_call``: the
        step is keyed by its model's call (:mod:`torchtrace.step.call_keys`), whose batch is its batch."""
        key, clock, forward = state.key, state.clock, None
        if clock is not None:
            forward, clock.batch = clock.batch, None  # its tensors are not kept past this
            forward = None if forward is MANY else forward
        if by_call:
            if key is None:  # (no one call's batch)
                return None, None
            cached = self._shapes.get(key)
            if cached is not None:
                return cached
            called = batch_of(forward, model=scope.model)
            assert called is not None  # (a step keyed by its model's call has the call's arguments)
            return self._kept(key, self.flops.lookup(key), called)
        if key is None:
            return None, batch_of(scope.inputs, scope.batch_skip, scope.model)
        flops = self.flops.lookup(key)
        batch = self._batches.get(key)
        if batch is None:
            batch = batch_of(scope.inputs, scope.batch_skip, scope.model)  # (the model: token ids, time-major)
            assert batch is not None  # (keyed by its inputs: the step has them)
            if batch.samples is None and batch.tokens is None and forward is not None:
                called = batch_of(forward, model=scope.model)
                assert called is not None  # (of arguments: a batch, if an empty one)
                if called.samples is not None and self.calls.adopt(scope.name, key, flops, forward):
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
    def account(self, scope: StepScope, record: StepRecord) -> None:
        """The record's phases, and its booking in the goodput ledger: its data wait, and the
        throughput rules' anomalies. (MFU, goodput and badput are read from the ledger when
        metrics are scraped.)"""
        state = scope.throughput
        assert state is not None
        clock = state.clock
        operation = record.operation
        # On the host there is no device cycle (DeviceCycles.cycle would say None): no call.
        if clock is not None:
            record.phases = clock.phases(state.step_end)  # on CUDA once its events completed
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
                if stats is not None and (record.flops_counted or self.trained.counted_with.get(operation) not in (
                        None, len(stats.names))) and self.trained.changed(operation, grads, record.flops_counted):
                    flops = record.flops = None  # counted with other parameters trained
            if flops is not None and operation not in self._peaked:
                self._look_up_peak(scope, operation)
        outer = state.parent
        parent = outer.throughput if outer is not None else None
        start = state.started_at
        if self._between:
            self.between_steps(before=start)
        account = self.ledger.add_step(FinishedStep(
            start, start + record.duration_s,
            applied=record.progressed,  # (a NaN update applied under warn is skipped_step)
            failed=record.exception_type is not None,
            excluded=record.flops_counted, samples=record.samples, tokens=record.tokens,
            flops=int(flops) if flops is not None else None, kind=record.kind, operation=operation,
            enclosing=enclosing(outer.kind, parent.started_at, parent.holds_steps) if outer and parent else None,
            holds_steps=state.holds_steps, entered=state.entered_at, left=state.left_before,
            device_cycle=device_cycle, checkpoint_s=state.checkpoint_s))
        record.data_wait_s = account.data_wait_s
        for finding in account.findings:
            record.anomalies.append(Anomaly(finding.kind, finding.detail, record.step, operation, dict(finding.data)))

    def book(self, start: float, end: float, kind: str, operation: str) -> None:
        """Time between steps that a framework spent on an operation of ``kind`` (its evaluation
        loop, a checkpoint save) and the step pipeline saw no step of: badput of that kind
        instead of data wait (perf_counter seconds; an operation named for the record). Booked
        now, after an unmarked evaluation before it; or, while a step's record still waits for
        its copy (on a GPU), once that step is booked (:meth:`between_steps`): booked first, it
        took the place of that step's time, which then read as data wait."""
        if self._unmarked is not None and self._unmarked[1] <= start:
            self._close_unmarked()
        self._between.append(FinishedStep(start, end, excluded=True, kind=kind, operation=operation))
        if not self.rt.records_pending():
            self.between_steps(before=math.inf)

    def unmarked_call(self, start: float, end: float) -> None:
        """A watched model was called from ``start`` to ``end`` (perf_counter) under no_grad,
        between steps, on the training thread: part of an evaluation the script did not mark
        (nanoGPT's ``estimate_loss``, a validation pass). The span from the first such call to
        the last (its loading between the calls included) is evaluation, not data wait. The
        next step's start closes it; it is booked when the ledger gets the first step that
        began after it (on a GPU, the step before it may be booked after that start: its
        record waits for its copy), a framework's booking after it, or the run's end."""
        if self._unmarked is None:
            self._unmarked = [start, end]
        else:
            self._unmarked[1] = end

    def _close_unmarked(self) -> None:
        """The unmarked evaluation seen so far ended: it waits in :attr:`_between` to be booked."""
        assert self._unmarked is not None
        start, end = self._unmarked
        self._unmarked = None
        self._between.append(FinishedStep(start, end, excluded=True, kind=EVALUATION, operation=UNMARKED_EVALUATION))

    def between_steps(self, before: float) -> None:
        """Book the time between steps waiting in :attr:`_between` that ended by ``before``
        (perf_counter: the start of the step about to be booked; ``math.inf`` at the run's end,
        with an unmarked evaluation still open), in time order."""
        if before == math.inf and self._unmarked is not None:
            self._close_unmarked()
        while self._between and self._between[0].end <= before:
            self.ledger.add_step(self._between.pop(0))

    def scrape(self) -> tuple[float | None, dict[str, float], dict[str, float]]:
        """For ``/metrics``: the goodput ratio now, badput seconds by kind (final counts: they
        only grow), and each operation's MFU over its last window."""
        mfu = {}
        for name in list(self.rt.history.operations):
            tp = self.ledger.throughput(name)
            if tp is not None and tp.mfu is not None:
                mfu[name] = tp.mfu
        return self.ledger.snapshot(time.perf_counter(), self.left_at).ratio, self.ledger.closed().badput, mfu

    def _look_up_peak(self, scope: StepScope, operation: str) -> None:
        """The operation's peak, once: at its first step with FLOPs and a model (whose device
        and dtype say which peak)."""
        if scope.model is None and self.ledger.peak_flops is None:
            return  # a later step of the operation may name its model
        if len(self._peaked) < MAX_PEAKS:  # the ledger keeps no more
            self._peaked.add(operation)
            if self.ledger.peak_flops is None:
                self.ledger.set_peak(operation, self._peak(scope))

    def _peak(self, scope: StepScope) -> float | None:
        # The dtype the counted step's FLOPs ran in; without a count (FLOPs the user or a
        # framework gave), the framework's mixed precision, then peaks.model_peak's.
        key = scope.throughput.key if scope.throughput is not None else None
        dtype = self.flops.compute_dtype(key) if key is not None else None
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
                             "peak_flops": self.ledger.peak_of(name), "data_wait_share": tp.data_wait_share,
                             "no_flop_rule_share": self.flops.unruled_share(name)}  # (what MFU cannot see)
        return {"wall_s": g.wall_s, "productive_s": g.productive_s, "goodput_ratio": g.ratio, "badput_s": g.badput,
                "peak_flops": self.ledger.peak_flops, "flop_counted_shapes": len(self.flops), "operations": ops}

    def release(self) -> None:
        """Throughput went off: take the forward marks off the models, so that a model called at
        level OFF, or with ``throughput=False``, runs PyTorch's own call. The next step that
        measures throughput puts them back. The optimizers keep their two step hooks until
        shutdown (one call each per ``optimizer.step()``, which returns at once outside a step).
        Goodput pauses until the next measured step: unmeasured time is no class's (an unmarked
        evaluation before it is booked first)."""
        self.between_steps(before=math.inf)
        self.ledger.pause(time.perf_counter())
        for hooks in list(self._models.values()):
            hooks.detach()

    def idle(self) -> None:
        """The script said training is over for now (:func:`torchtrace.idle`): goodput pauses
        until the next training step, as while nothing is measured (the time between steps
        waiting to be booked, an unmarked evaluation among it, is booked first). An evaluation
        or a checkpoint after it is booked as itself, and the pause goes on after it."""
        self.between_steps(before=math.inf)
        self.ledger.idle(time.perf_counter())

    def close(self) -> None:
        for hooks in list(self._models.values()) + list(self._optimizers.values()):
            hooks.remove()
        self._models.clear()
        self._optimizers.clear()


    # ------------------------------------------------------------ the FLOP counter (a few steps of a run)
    def _counter(self, scope: StepScope, key: Hashable | None, outermost: bool) -> ExitStack | None:
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
        state = owner.throughput if owner is not None else None
        if owner is None or state is None or state.counter is None:
            return True
        if not owner.active:
            return False
        if release_counter(state.counter):  # (else below a mode of the user's: it records nothing)
            state.counter = None
        if type(state.key) is LateKey:
            self.calls.dropped(owner.name)
        else:
            self.flops.skip(state.key)
        self._counting = none_ref
        return True

    def _skipped(self, key: Hashable) -> bool:
        """True (and the key is never counted) when the counter cannot run on the step's inputs."""
        if countable(key):
            return False
        self.flops.skip(key)
        return True

    def _close_counter(self, scope: StepScope, counter: ExitStack, exc: BaseException | None) -> bool:
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

    def _counter_failed(self, scope: StepScope, exc: BaseException) -> None:
        """An op of the step raised under the FLOP counter: that key is never counted again (so
        the user's next try runs without the counter); say so once."""
        self.rt.warn_once(("flops", scope.name),
                          "torchtrace: %s: an op raised while the step's FLOPs were being counted (%s: %s); "
                          "steps with these input shapes are not counted again (record_batch(flops=...) gives "
                          "their FLOPs)", scope.name,
                          type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")


def hold_steps(holder: StepScope | None, containers: set[str]) -> None:
    """A training step began inside ``holder``: mark it and the operations around it as
    holding steps, and remember their names in ``containers``.

    A step with an optimizer inside another operation makes that one, and every operation
    around it, a container: goodput counts the time their steps do not cover as data wait, not
    as their own (productive), and their FLOPs are not counted (the steps' are).
    """
    while holder is not None:
        state = holder.throughput
        if state is not None and state.holds_steps:
            return
        if len(containers) < MAX_CONTAINERS:
            containers.add(holder.name)
        if state is None:
            return
        state.holds_steps = True
        holder = state.parent


def below_containers(parent: StepScope | None, containers: set[str]) -> bool:
    """True when every operation from ``parent`` outwards holds training steps (now, or in an
    earlier call: an epoch's validation before its first step) and none has a FLOP count open:
    a step without an optimizer there (an evaluation step in an epoch) is counted as it is
    without them."""
    while parent is not None:
        state = parent.throughput
        if state is not None and state.counter is not None:
            return False
        if not (state is not None and state.holds_steps or parent.name in containers):
            return False
        parent = state.parent if state is not None else None
    return True


__all__ = ["RunThroughput", "StepClock", "StepFigures", "below_containers", "drop_counter", "hold_steps",
           "learning_rates"]
