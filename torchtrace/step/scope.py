"""StepScope: one instrumented operation call, from its entry to the hand-over of its record.

At entry the scope opens the step's span (so user code inside keeps it as its parent), hooks
the optimizer and lets the probes start. While the step runs, it only launches device work.
At exit it gathers every device value the record needs into one host read
(:class:`~torchtrace.record.readout.ReadPlan`), builds the :class:`StepRecord` and hands it to
the runtime, which finishes it (now on the CPU; when the copy has landed on a GPU) and passes
it on to export. One scope serves ``with``, ``async with`` and the decorators.
"""

from __future__ import annotations

import contextvars
import time
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace

from torchtrace import current, semconv
from torchtrace.errors import NonFiniteError
from torchtrace.export.spans import clean_attributes
from torchtrace.job import progress
from torchtrace.levels import DebugLevel, DebugMode, Features
from torchtrace.measure import memory as mem_measure
from torchtrace.measure.counts import checked_overrides, plan_given
from torchtrace.measure.loss import LossValue, classify_loss
from torchtrace.measure.scaler import scaler_enabled
from torchtrace.record.goodput_types import TRAIN
from torchtrace.record.readout import ReadPlan
from torchtrace.record.step import Anomaly, StepRecord
from torchtrace.step import checks, job
from torchtrace.step.compiled import outside_compiler
from torchtrace.step.gradients import GradientCheck
from torchtrace.step.state import Given, StepForensics, StepThroughput
from torchtrace.step.throughput import drop_counter, learning_rates
from torchtrace.step.watched import real_optimizer

if TYPE_CHECKING:
    from torchtrace.probes.base import Probe, S
    from torchtrace.step.runtime import Runtime

STEP_KINDS = checks.STEP_KINDS




class StepScope:
    """One instrumented operation call: a span, a step record, the step's measurements.

    Use through :func:`torchtrace.debug_context` or :func:`torchtrace.debug_operation`.
    Inside the block, :meth:`record_loss` hands over the loss and :meth:`record_batch` the
    batch size. What the step used is public (``name``, ``model``, ``optimizer``, ``scaler``,
    ``kind``, ``step``, ``features``, ``inputs``); so is its state, one object per concern
    (:mod:`torchtrace.step.state`): ``given`` (what the user handed over), ``throughput``
    (None when not measured), ``gradients`` and ``forensics``. Attributes with a leading
    underscore are the scope's own.
    """

    __slots__ = ("name", "model", "optimizer", "scaler", "kind", "step", "features", "inputs", "batch_skip",
                 "on_guard_raise", "before_clip", "update_told", "record", "duration_s", "given", "throughput",
                 "gradients", "forensics", "raised", "pending_error", "suppress", "_step_arg", "_level_arg",
                 "_mode_arg", "_attributes", "_rt", "_active", "_span", "_token", "_ctx_token", "_anomaly_cm", "_t0",
                 "_start_ns", "_overhead", "_states", "_anomalies", "_holds_steps", "__weakref__")
    # Set as a step begins (_begin), not in __init__.
    _rt: Runtime
    _states: list[object] | None
    _anomalies: list[tuple[str, str, dict[str, Any]]] | None
    _overhead: float
    _holds_steps: bool
    _t0: float
    _start_ns: int

    def __init__(self, name: str = "step", *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, step: int | None = None,
                 level: DebugLevel | str | None = None, mode: DebugMode | str | None = None,
                 attributes: dict[str, Any] | None = None, replay: Callable[[], Any] | None = None,
                 scaler: torch.amp.GradScaler | None = None, kind: str = "train",
                 inputs: tuple[tuple, dict] | None = None, checked: bool = False) -> None:
        if not checked:  # (``debug_operation`` checks its arguments once, at decoration)
            checks.check_scope_arguments(name, model, optimizer, scaler, replay, step, kind, attributes)
        self.name = name
        self.model = model
        self.optimizer = real_optimizer(optimizer)  # the torch optimizer behind accelerate's wrapper
        self.scaler = scaler
        self.forensics = StepForensics(replay)
        self.on_guard_raise: Callable[[BaseException], Any] | None = None  # a framework callback ends its span
        # A framework's step whose model joins only as its gradients are used (Lightning's manual
        # optimization): a gradient clip in the step calls this with the parameters it clips first.
        self.before_clip: Callable[[list[torch.Tensor]], None] | None = None
        # A framework's step: whether its framework told of an optimizer update in it (False
        # for a micro-batch that only accumulates gradients); None for the user's own step.
        self.update_told: bool | None = None
        self.kind = kind
        self._step_arg = step
        self._level_arg = DebugLevel.parse(level, "level") if level is not None else None
        self._mode_arg = DebugMode.parse(mode, "mode") if mode is not None else None
        self._attributes = clean_attributes(attributes) if attributes else None
        self._active = False
        # What a started step holds until its end (an undo after a failed start finds them).
        self._span: trace.Span | None = None
        self._token: contextvars.Token[otel_context.Context] | None = None
        self._ctx_token: contextvars.Token[StepScope | None] | None = None
        self._anomaly_cm: torch.autograd.set_detect_anomaly | None = None
        self.record: StepRecord | None = None
        self.step: int | None = None
        self.features: Features | None = None
        self.gradients: GradientCheck | None = None
        self.given = Given()
        self.throughput: StepThroughput | None = None
        self.raised: NonFiniteError | None = None  # the guard's error, raised from the optimizer hook
        self.pending_error: NonFiniteError | None = None  # decided on the host record, raised at the step's end
        self.suppress = False  # an exception the guard absorbs (out of memory under "skip")
        self.duration_s = 0.0  # the step's wall time, once it has ended
        self.inputs = inputs  # (args, kwargs) of the step: its batch and input shapes
        self.batch_skip = 0  # leading positional inputs that are not the batch (a method's instance)

    # ------------------------------------------------------------ user API
    def record_loss(self, loss: object) -> None:
        """Record the step's loss (a scalar tensor or a number). No host read happens here.

        A tensor with more than one element, or of a bool or integer dtype, is not a loss: it is
        not recorded and a warning says why, once per operation.
        """
        if not self._active or loss is None:
            return
        value = classify_loss(loss)
        if value.problem is not None:
            self._rt.warn_once(("loss", self.name, value.problem),
                               "torchtrace: step %s of %s: the loss was not recorded: %s", self.step, self.name,
                               value.problem)
            return
        self.given.loss = value

    def record_batch(self, samples: int | Any | None = None, tokens: int | Any | None = None,
                     flops: float | None = None) -> None:
        """Record the batch's size (items), its tokens and the step's model FLOPs (forward +
        backward); each given value overrides what torchtrace infers or counts.

        ``samples`` and ``tokens`` may be device tensors (a mask's sum): read with the step's one read.
        A value that is not valid is left out, with a warning that names it (once per message).
        """
        if self._active:
            self.given.batch, problem = checked_overrides(samples, tokens, flops, self.given.batch)
            if problem is not None:
                self._rt.warn_once(("batch", problem), "torchtrace: %s: record_batch: %s", self.name, problem)

    def add_anomaly(self, kind: str, detail: str, data: dict[str, Any] | None = None) -> None:
        """Add an anomaly the caller found (a loss spike a monitor judged, say) to this step's
        record: it is counted, put on the span and in the history like torchtrace's own.

        Raises:
            ValueError: ``kind`` is not one of the anomaly kinds (``torchtrace.semconv.ANOMALY_KINDS_ALL``).
        """
        if kind not in semconv.ANOMALY_KINDS_ALL:
            raise ValueError(f"kind={kind!r} is not valid; accepted values: {', '.join(semconv.ANOMALY_KINDS_ALL)}")
        if not self._active:
            return
        if self._anomalies is None:
            self._anomalies = []
        self._anomalies.append((kind, str(detail), dict(data or {})))

    @property
    def span(self):
        """The step's span (the current span inside the step), or an invalid span outside it."""
        return self._span if self._active else trace.INVALID_SPAN

    @property
    def active(self) -> bool:
        return self._active

    @property
    def has_loss(self) -> bool:
        return self._active and self.given.loss is not None

    def add_overhead(self, seconds: float) -> None:
        """Time spent inside torchtrace during the step (hooks), for ``torchtrace_overhead_seconds_total``."""
        self._overhead += seconds

    def state_of(self, probe: Probe[S]) -> S | None:
        """The per-step state ``probe.enter`` returned for this step (None when it returned none)."""
        return self._rt.probes.state_of(self._states, probe) if self._states is not None else None

    @outside_compiler
    def check_gradients_now(self, optimizer: torch.optim.Optimizer | None = None,
                            clipped: list[torch.Tensor] | None = None) -> None:
        """Measure (and guard) the gradients now, as they are about to be used: the user is about
        to clip them (``clipped``: the parameters, where :meth:`wants_clipped` said so), or a
        framework says its optimizer is about to step (``optimizer`` then names the parameters
        to watch). Once per step.

        Raises:
            NonFiniteError: under ``guard="raise"`` with non-finite gradients.
        """
        if not self._active:
            return
        assert self.features is not None  # (set as the step began)
        if not self.features.grad_stats:
            return
        optimizer = real_optimizer(optimizer) if optimizer is not None else self.optimizer
        if optimizer is None and self.model is None:
            return
        try:
            if self.gradients is None:
                self.gradients = GradientCheck(self, self._rt)
            elif self.gradients.fired:  # measured already (at a clip call): the optimizer is news
                if self.gradients.optimizer is None and optimizer is not None:
                    self.gradients.optimizer = optimizer
                    self.gradients.lr = learning_rates(optimizer) if self.features.throughput else None
                return
            self.gradients.before_update(optimizer, clipped)
        except NonFiniteError as exc:
            if self.on_guard_raise is not None:
                self.on_guard_raise(exc)
            raise

    def wants_clipped(self) -> bool:
        """Whether a clip should hand :meth:`check_gradients_now` the parameters it clips: the
        step names no optimizer, and an enabled loss scaler unscales one optimizer's gradients
        at a time (the others may still be scaled): only the clipped ones are measured."""
        return self.optimizer is None and scaler_enabled(self.scaler)

    def __call__(self, func: object) -> NoReturn:
        """``@debug_context(...)`` above a function: a step's scope is used once, in a ``with``
        block; the decorator that makes each call a step is :func:`torchtrace.debug_operation`."""
        raise TypeError(f"debug_context() is a context manager (with torchtrace.debug_context({self.name!r}, ...): "
                        f"...); to make each call of a function a step, decorate it with "
                        f"@torchtrace.debug_operation(name={self.name!r}, model=..., optimizer=...)")

    # ------------------------------------------------------------ enter
    @outside_compiler
    def __enter__(self) -> "StepScope":
        rt = current.runtime()
        if rt is None or rt.replaying:  # a forensic replay records nothing itself
            return self
        t0 = time.perf_counter()
        try:
            rt.at_step_boundary()  # queued changes apply before the level is read (the way back on from off too)
            if not rt.settings_agreed and self.kind == TRAIN:
                rt.agree_settings()  # once, at a job of several ranks' first training step
            level = self._level_arg or rt.level
            if level is not DebugLevel.OFF:
                self._begin(rt, level, t0)
        except Exception as exc:
            self._active = False
            rt.errors.report("step", exc)
            self._abandon()  # a half-begun step leaves no span, context or hook behind for the next
        return self

    def _begin(self, rt: Runtime, level: DebugLevel, t0: float) -> None:
        self._span = self._token = self._ctx_token = None
        self._rt = rt
        mode = self._mode_arg or rt.mode
        if level is rt.level and mode is rt.mode:
            self.features = feats = rt.features
        else:  # an operation pinned at its own level or mode
            self.features = feats = Features.for_level(level, mode, rt.settings.throughput)
        self.step = rt.step_number(self.name, self._step_arg)
        progress.step_began(self.step, self.kind)  # (the watchdog's view: a few dict stores)
        if current.orphan_check is not None and current.step() is not None:
            current.orphan_check()  # a framework's step its loop left by an exception ends first
        parent = current.step()  # the operation this step runs inside, if any
        if parent is not None:
            parent._holds_steps = True
        self._states = self._anomalies = self._anomaly_cm = None
        self.given.loss = self.given.batch = None
        self.throughput = None
        self.forensics.stepped = None
        self._overhead = 0.0
        self._holds_steps = False
        self.gradients = None
        self.raised = None
        self.pending_error = None
        self.suppress = False
        self._start_ns = time.time_ns()
        around = otel_context.get_current()  # (read once: the parent span's context, and the step's)
        self._span = rt.open_span(self, level, self._attributes, self._start_ns, around)
        self._token = otel_context.attach(trace.set_span_in_context(self._span, around))
        self._ctx_token = current.enter_step(self)
        if feats.grad_stats and (self.optimizer is not None or self.model is not None):
            self.gradients = GradientCheck(self, rt)
            if self.optimizer is not None:
                self.gradients.hook(self.optimizer)
        if parent is not None and self.gradients is not None:
            self.gradients.nested = True
        if feats.anomaly_mode:
            self._anomaly_cm = torch.autograd.set_detect_anomaly(True, check_nan=True)  # no warning to raise
            self._anomaly_cm.__enter__()
        if feats.throughput:
            self.throughput = rt.throughput.start(self, parent, t0)
        self._active = True
        self._states = rt.probes.enter(self)
        t1 = time.perf_counter()
        self._overhead += t1 - t0
        self._t0 = t1
        if self.throughput is not None:
            self.throughput.started_at = t1

    def hold_outer_gradients(self) -> None:
        """This step, inside other steps (an epoch, a run of epochs), measured its gradients
        before an update: they were its to measure and guard, and the steps around it measure
        none at their end (where they would find this step's again)."""
        token = self._ctx_token
        while token is not None and isinstance(token.old_value, StepScope):
            outer = token.old_value
            if outer.gradients is not None:
                outer.gradients.held = True
            token = outer._ctx_token

    # ------------------------------------------------------------ exit
    @outside_compiler
    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self._active:
            return False
        assert self.step is not None and self.features is not None  # (set as the step began)
        # A SIGTERM's handler exited in the step ("save and exit"), or a SIGINT raised
        # KeyboardInterrupt in it (Ctrl-C, its default action): the step was lost to the
        # preemption, as under SIGTERM's default action. It stays the current step, which the
        # shutdown names ``interrupted_step``; it gets no record and no span.
        interrupted = ((isinstance(exc, SystemExit) and exc.code in (0, None) or isinstance(exc, KeyboardInterrupt))
                       and job.preempted_since(self._rt, self._start_ns / 1e9))
        if not interrupted:
            progress.step_ended(self.step, self.kind)
        state = self.throughput
        clock = state.clock if state is not None else None
        if state is not None and clock is not None and clock.optimizer_end is None and \
                clock.forward_end is not None and clock.graph:
            state.step_end = clock.mark()  # where the backward ends when no optimizer mark ends it
        t0 = time.perf_counter()
        self.duration_s = duration = t0 - self._t0
        end_ns = time.time_ns()
        self._active = False
        rt = self._rt
        if isinstance(exc, StopIteration):  # the loop's data ran out: its signal, not the step's failure
            if self._did_nothing():
                self._leave_unrecorded(rt, exc)
                return False
            exc = None  # the step trained, then found no next batch: a step like any other
        elif interrupted:  # (the step stays the black box's current one: interrupted_step)
            self._leave_unrecorded(rt, exc)
            return False
        elif isinstance(exc, SystemExit):  # the process ends: cleanly (status 0 or none), or failing
            if exc.code in (0, None):
                exc = None  # (the step did not fail)
            else:
                job.exit_in_step(rt, exc, self.step)
        try:
            self._finish(rt, exc, duration, end_ns, t0)
        except Exception as err:
            try:
                rt.errors.report("step", err)
            finally:
                self._abandon()
        if self.features.throughput:
            rt.throughput.left_at = time.perf_counter()  # (the next step's data wait starts here)
        if exc is None and self.pending_error is not None:
            error, self.pending_error = self.pending_error, None
            raise error  # a guard policy decided on the host record
        return bool(exc is not None and self.suppress)

    def _did_nothing(self) -> bool:
        """Nothing of the step's work was seen: no loss given, no anomaly added, no update begun
        (the step's optimizer or another), no forward of its model, no step inside it."""
        if self.given.loss is not None or self._anomalies or self.forensics.stepped or self._holds_steps:
            return False
        grads = self.gradients
        if grads is not None and (grads.fired or grads.updates):
            return False
        clock = self.throughput.clock if self.throughput is not None else None
        return clock is None or clock.forward_start is None

    def _leave_unrecorded(self, rt: Runtime, exc: BaseException) -> None:
        """The loop's data ran out before the step did anything (``next(batches)`` at its top
        raised ``StopIteration``): it was no step; or a preemption's handler ended the process
        in it. Everything it began is undone, its span is never ended (so nothing exports it),
        its time counts as the next step's wait for data, and a counted number is the next
        step's."""
        try:
            self._restore()
            rt.probes.exit(self, self._states, exc, ReadPlan())  # (a probe lets go of what it holds)
            state = self.throughput
            if state is not None and state.counter is not None:
                drop_counter(state.counter)
                state.counter = None
            assert self._token is not None  # (set as the step began)
            otel_context.detach(self._token)
            self._token = None
            if self._step_arg is None and self.step is not None:
                rt.give_back_step_number(self.name, self.step)
        except Exception as err:
            try:
                rt.errors.report("step", err)
            finally:
                self._abandon()
        self.release()

    def _abandon(self) -> None:
        """After an internal error in ``_begin`` or ``_finish``: restore every global, end the
        span. Each undo runs on its own: one that fails leaves the others to run."""
        state, cm, gradients = self.throughput, self._anomaly_cm, self.gradients
        ctx_token, token, span = self._ctx_token, self._token, self._span
        if state is not None and state.counter is not None:
            _quietly(drop_counter, state.counter)
        if cm is not None:
            _quietly(cm.__exit__, None, None, None)
        if gradients is not None:
            _quietly(gradients.unhook)
        if ctx_token is not None:
            _quietly(current.leave_step, ctx_token)
        if token is not None:
            _quietly(otel_context.detach, token)
        if span is not None:
            _quietly(span.end)
        self._anomaly_cm = self._ctx_token = self._token = None
        if state is not None:
            state.counter = None

    def _restore(self) -> None:
        if self._anomaly_cm is not None:
            self._anomaly_cm.__exit__(None, None, None)
            self._anomaly_cm = None
        if self.gradients is not None:
            self.gradients.unhook()
        if self._ctx_token is not None:
            current.leave_step(self._ctx_token)
            self._ctx_token = None

    def _finish(self, rt: Runtime, exc: BaseException | None, duration: float, end_ns: int, t0: float) -> None:
        # (set as the step began)
        assert self.features is not None and self.step is not None and self._span is not None
        assert self._token is not None
        self._restore()
        plan = ReadPlan()
        figures = None
        state = self.throughput
        if state is not None:
            try:
                # record_batch's device counts ride in the step's one read.
                given = self.given.batch and plan_given(self.given.batch, plan)
                figures = rt.throughput.finish_step(self, state, exc, given, plan)
            except Exception as terr:  # costs the step its throughput figures, never its record
                rt.errors.report("step", terr)
                if state.counter is not None:  # (a second exit of a closed one does nothing)
                    try:
                        drop_counter(state.counter)
                    except Exception:  # the error above is reported already
                        pass
            state.counter = None
        loss = self.given.loss
        if loss is not None and loss.tensor is not None:
            plan.add("loss", loss.tensor)
        grads = self._plan_gradients(rt, plan)
        rt.plan_parameter_check(self, plan)
        rt.probes.exit(self, self._states, exc, plan)
        pending = None
        try:
            pending = plan.start()
        except Exception as rerr:
            rt.errors.report("record", rerr)
            plan = ReadPlan()
        try:
            mem = mem_measure.step_sample(cuda=self.features.cuda_memory)
        except Exception as merr:
            rt.errors.report("memory", merr)
            mem = {}
        otel_context.detach(self._token)
        self._token = None
        record = StepRecord(operation=self.name, step=self.step, level=(self._level_arg or rt.level).value,
                            start_unix_ns=self._start_ns, end_unix_ns=end_ns, duration_s=duration, memory=mem,
                            skipped=grads is not None and grads.skipped,
                            exception_type=type(exc).__qualname__ if exc is not None else None, kind=self.kind)
        if grads is not None:
            record.guard_peer_nonfinite = grads.peer_nonfinite
        if self._anomalies:
            record.anomalies.extend(Anomaly(k, d, record.step, record.operation, x) for k, d, x in self._anomalies)
        if loss is not None and loss.number is not None:
            record.loss = loss.number
        if figures is not None:
            record.samples, record.tokens, record.flops, record.flops_counted, record.lr = figures
        ctx = self._span.get_span_context()
        if ctx.trace_flags.sampled:  # an unsampled span is exported nowhere: no exemplar or report link to it
            record.trace_id, record.span_id = format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
        self.record = record
        self._overhead += time.perf_counter() - t0
        record.overhead_s = self._overhead
        rt.submit(self, record, plan, pending, self._span, exc)

    def _plan_gradients(self, rt: Runtime, plan: ReadPlan) -> GradientCheck | None:
        """Measure the gradients if no hook did, and add their norms to the step's one read."""
        grads = self.gradients
        assert self.features is not None  # (set as the step began)
        if grads is None and self.model is not None and self.features.grad_stats:
            # The model was handed over inside the step (a framework hook, a seed-style check).
            grads = self.gradients = GradientCheck(self, rt)
        if grads is None:
            return None
        if not grads.fired:
            try:
                grads.measure_at_end()
            except Exception as gerr:
                rt.errors.report("gradients", gerr)
            if grads.stats is not None:
                # Measured only now, after any update the step made: a skip guard could not act. (A
                # framework callback or a clip call inside the step measures before the update.)
                rt.guard_without_optimizer(self)
        stats = grads.stats
        if stats is not None and grads.values is None:
            plan.add("grads", stats.norms)
        return grads

    def hand_over(self) -> tuple[list | None, float]:
        """What the runtime finishes a record with: the probe states and the overhead so far."""
        return self._states, self._overhead

    def replayer(self) -> Callable[[], Any] | None:
        """What replays the step: ``replay=``, or the decorated function with its arguments."""
        forensics = self.forensics
        if forensics.replay is not None:
            return forensics.replay
        if forensics.function is not None and self.inputs is not None:
            fn, (args, kwargs) = forensics.function, self.inputs
            return lambda: fn(*args, **kwargs)
        return None

    def release(self) -> None:
        """After the record is finished: drop every reference to tensors and callables."""
        self.inputs = None
        if self.throughput is not None:
            self.throughput.clock = self.throughput.step_end = None
        self._states = None
        self.given.loss = self.given.batch = None
        self.gradients = None
        forensics = self.forensics
        forensics.replay = forensics.function = forensics.stepped = None

    # ------------------------------------------------------------ async
    async def __aenter__(self) -> "StepScope":
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        return self.__exit__(exc_type, exc, tb)


def _quietly(action: Callable[..., object], *args: object) -> None:
    """``action(*args)``, a failure ignored: an undo after an error that is reported already."""
    try:
        action(*args)
    except Exception:
        pass


__all__ = ["LossValue", "STEP_KINDS", "StepScope"]
