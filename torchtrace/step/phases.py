"""The phase clock of a step: forward, backward and optimizer boundaries.

The marks are host times, or CUDA events when the model is on a GPU (read with the step's
deferred read, never waited for). The forward marks sit in a plain module's call seam, or in
forward hooks on any other module (:class:`ModelMarks`); the optimizer's in its step pre- and
post-hooks (:class:`OptimizerMarks`). Both find the open step through :mod:`torchtrace.current`.
"""

from __future__ import annotations

import sys
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from torchtrace import current
from torchtrace.job import progress
from torchtrace.measure.gradients import backward_between, gradient_mark, in_backward
from torchtrace.record import events
from torchtrace.step.call_keys import MANY, note_call
from torchtrace.step.cycles import DeviceCycles  # noqa: F401  (imported from here before)
from torchtrace.step.watched import layout_version

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from torchtrace.measure.gradients import GradientMark
    from torchtrace.step.state import StepThroughput

_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)
# The frame that calls the seam: PyTorch's Module.__call__ (``_wrapped_call_impl``).
_SEAM_CODE = getattr(getattr(torch.nn.Module, "_wrapped_call_impl", None), "__code__", None)


def _open_clock() -> StepClock | None:
    """The open step's phase clock, or None (no step open, or it measures no throughput)."""
    scope = current.step()
    state = scope.throughput if scope is not None else None
    return state.clock if state is not None else None


MAX_GAPS = 32  # on a GPU, the pauses between forward calls a step keeps (two events each)


class StepClock:
    """The phase boundaries of one step: host times, or CUDA events when the model is on a GPU."""

    # Every step makes one: the fields start at the class's values, and __init__ sets only what
    # differs: a clock on the host sets nothing.
    # The (args, kwargs) of the model's call, for a step whose arguments do not give its batch;
    # MANY once called on other tensors, or from the start when the arguments give it.
    batch: Any = None
    cuda = False
    forward_start: Any = None
    forward_end: Any = None
    optimizer_start: Any = None
    optimizer_end: Any = None
    # The host time (time.perf_counter) the optimizer step began, the backward's end: on a GPU
    # too, where optimizer_start is an event (the straggler probe bounds the step's collectives by it).
    optimizer_host: float | None = None
    last: Any = None  # on a GPU, once the phases are read: the step's last mark (see DeviceCycles)
    graph = True  # the forward ran with autograd on (without it, no backward can follow)
    # The time between the model's calls in the step: not forward time. A pause in which a
    # backward moved the model's gradients (micro-batches) is backward time; one in which none
    # did (two views, a reinforcement-learning rollout stepping its environment) is neither.
    # On the host, seconds in ``gaps`` (backward) and ``idle``; on a GPU, the (end, start,
    # backward) events and flag of each pause in ``gaps``, None once more than MAX_GAPS (the
    # split is then unknown).
    gaps: Any = 0.0
    idle = 0.0
    again: Any = None  # a later call's start mark, booked as a pause's end once the call ends
    # whether a backward moved the gradients in the pause that ``again`` ends
    again_backward = True
    # the model's gradients at its last call's start (FirstGradient), None when not known
    grads: GradientMark | None = None
    # mark(): a boundary now, a host time or a recorded CUDA event (on the host, one C call)
    mark: Callable[[], Any] = time.perf_counter

    def __init__(self, cuda: bool, batch: Any = None) -> None:
        if batch is not None:
            self.batch = batch
        if cuda:
            self.cuda = True
            self.gaps = []
            self.mark = events.TIMING.recorded

    def announce(self, point: str, grads: GradientMark | None = None) -> None:
        """A boundary a framework hook announces (``forward_start``, ``forward_end``,
        ``optimizer_start``, ``optimizer_end``), by the rules the model and optimizer marks
        follow: the first forward start and optimizer start count (a later forward start ends
        a pause between forward calls), a forward end only before the optimizer started, an
        optimizer end only after it did. ``grads``: at a forward start, the model's gradients
        (:class:`FirstGradient`); without them a pause is taken for
        a micro-batch's backward."""
        if point == "forward_start":
            progress.mark("forward")  # (what the training thread does now: the watchdog's view)
            if self.forward_start is None:
                self.forward_start = self.mark()
                self.grads = grads
            elif self.forward_end is not None and self.optimizer_start is None:
                self.again = self.mark()
                self.again_backward = self.moved(grads)
        elif point == "forward_end":
            progress.mark("backward" if torch.is_grad_enabled() else "forward")
            if self.forward_start is not None and self.optimizer_start is None:
                if self.again is not None:
                    self.again, again = None, self.again
                    self.pause(again, self.again_backward)
                self.end_forward()
        elif point == "optimizer_start":
            progress.mark("optimizer")
            if self.optimizer_start is None:
                self.begin_optimizer()
        elif point == "optimizer_end":
            progress.mark("optimizer")
            if self.optimizer_start is not None:
                self.optimizer_end = self.mark()
        else:
            raise ValueError(f"point={point!r} is not valid; accepted values: forward_start, forward_end, "
                             "optimizer_start, optimizer_end")

    def begin_optimizer(self) -> None:
        """Mark the optimizer's start, also as a host time (``optimizer_host``)."""
        self.optimizer_start = self.mark()
        self.optimizer_host = time.perf_counter() if self.cuda else self.optimizer_start

    def moved(self, grads: GradientMark | None) -> bool:
        """At a later call's start, the model's gradients ``grads``: whether the pause before it
        was backward time. So it is when a backward moved them since the call before began, when
        the call comes inside a backward (a reentrant activation checkpoint's recomputation,
        before the model's gradients are made), and when either mark is not known (the pause is
        then taken for a micro-batch's backward)."""
        before, self.grads = self.grads, grads
        return before is None or grads is None or backward_between(before, grads) or in_backward()

    def pause(self, again: Any, backward: bool = True) -> None:
        """A later call of the model, begun at mark ``again``, has ended (right before its end
        mark): the time from the call before's end to ``again`` was a pause, not forward time:
        a micro-batch's loss and backward (``backward``), or no phase of the model's (an
        environment stepped between a policy's calls). A call that raised (an activation
        checkpoint's recomputation, stopped early inside the backward) books nothing: its time
        stays with the backward."""
        end = self.forward_end
        if not self.cuda:
            if backward:
                self.gaps += again - end
            else:
                self.idle += again - end
        elif self.gaps is not None and len(self.gaps) < MAX_GAPS:
            self.gaps.append((end, again, backward))
        else:  # too many pauses to keep: the forward and backward split is not known
            if self.gaps:
                events.TIMING.give_back(*(e for end_, start, _ in self.gaps for e in (end_, start)))
            self.gaps = None
            events.TIMING.give_back(end, again)

    def end_forward(self) -> None:
        """Mark the end of the forward (and whether it built an autograd graph)."""
        self.forward_end = self.mark()
        self.graph = torch.is_grad_enabled()

    def phases(self, step_end: Any) -> dict[str, float] | None:
        """Seconds per phase; None when neither the forward nor the optimizer was seen. Backward
        runs from the end of the forward to the optimizer's step, or to the end of the step
        without one; a forward run without autograd (an evaluation under ``no_grad``) has no
        backward. A step whose forward was not seen (``model.forward`` called directly, another
        module called) has its optimizer phase only: where its backward began is not known.
        A model called several times (micro-batches, two views, a rollout): forward is the sum
        of its calls; a pause between them counts with the backward when a backward moved the
        gradients in it, else with no phase."""
        if self.cuda:
            try:
                return self._device_phases(step_end)
            finally:  # read once: the events go back, to be recorded again by later steps, but the
                # last, which measures the next step's cycle (DeviceCycles gives it back then)
                marks = [self.forward_start, self.forward_end, self.optimizer_start, self.optimizer_end, step_end]
                if self.gaps:
                    marks.extend(e for end, start, _ in self.gaps for e in (end, start))
                    self.gaps = []
                if self.again is not None:  # a later call that never ended
                    marks.append(self.again)
                    self.again = None
                self.last = next((m for m in (self.optimizer_end, step_end, self.forward_end) if m is not None), None)
                events.TIMING.give_back(*(m for m in marks if m is not self.last))
                self.forward_start = self.forward_end = self.optimizer_start = self.optimizer_end = None
        # Host times: plain differences (the common case, kept short). The marks come from one
        # monotonic clock in the order the rules above set them, so no difference is negative.
        f0 = self.forward_start
        f1 = self.forward_end
        if f0 is None or f1 is None:
            return self._optimizer_only()
        o0 = self.optimizer_start
        o1 = self.optimizer_end
        gaps = self.gaps
        forward = f1 - f0 - gaps - self.idle  # (one forward call: x - 0.0 - 0.0 is x)
        if o0 is not None and o1 is not None:
            return {"forward": forward, "backward": o0 - f1 + gaps, "optimizer": o1 - o0}
        if step_end is None or not self.graph:
            return {"forward": forward}
        return {"forward": forward, "backward": step_end - f1 + gaps}

    def _device_phases(self, step_end: Any) -> dict[str, float] | None:
        if self.forward_start is None or self.forward_end is None or self.gaps is None:
            return self._optimizer_only()
        paused = idle = 0.0
        for end, start, backward in self.gaps:
            seconds = self._between(end, start)
            if seconds is None:
                return None
            if backward:
                paused += seconds
            else:
                idle += seconds
        forward = self._between(self.forward_start, self.forward_end)
        out = {"forward": forward - paused - idle if forward is not None else None}
        if self.optimizer_start is not None and self.optimizer_end is not None:
            backward = self._between(self.forward_end, self.optimizer_start)
            out["backward"] = backward + paused if backward is not None else None
            out["optimizer"] = self._between(self.optimizer_start, self.optimizer_end)
        elif step_end is not None and self.graph:
            backward = self._between(self.forward_end, step_end)
            out["backward"] = backward + paused if backward is not None else None
        if any(v is None for v in out.values()):
            return None
        return out  # type: ignore[return-value]  # (no value is None here)

    def _optimizer_only(self) -> dict[str, float] | None:
        if self.optimizer_start is None or self.optimizer_end is None:
            return None
        if (rt := current.runtime(create=False)) is not None and self.forward_end is None:
            inside = self.forward_start is not None  # (in optimizer.step(closure), LBFGS: no boundary to split at)
            how = "ran inside optimizer.step(closure)" if inside else \
                "was not seen (model.forward(x), another method or module called, or a call inside compiled " \
                "code: a function torch.compile compiles, or the module torch.compile(model) returned)"
            advice = "" if inside else "; give the step the module it calls (model=torch.compile(model)'s result, " \
                "not the module inside it) and call it as model(...), outside compiled functions, to split " \
                "forward and backward"
            rt.warn_once(("phases", "closure" if inside else "unseen"), "torchtrace: a step ran its optimizer but its "
                         "model's forward %s: its phases hold the optimizer only%s", how, advice)
        seconds = self._between(self.optimizer_start, self.optimizer_end)
        return {"optimizer": seconds} if seconds is not None else None

    def _between(self, a: Any, b: Any) -> float | None:
        if self.cuda:  # only events that completed (the record's read landed after them): no wait
            return events.seconds_between(a, b)
        return b - a


class FirstGradient:
    """Where a model's gradients stand (:func:`~torchtrace.measure.gradients.gradient_mark`), read
    from its first trained parameter among its first 64. The parameter is found once and kept
    weakly, and found again when it is freed, no longer trained (a backbone frozen mid-run), or
    any module's layout changed (:func:`~torchtrace.step.watched.layout_version`: a layer
    replaced). A read costs a fraction of a microsecond; walking ``model.parameters()`` at every
    call of the model cost several."""

    SEARCHED = 64

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = weakref.ref(model)
        self.param: weakref.ref[torch.Tensor] | None = None
        self.layout = -1

    def __call__(self) -> GradientMark | None:
        """The gradient's mark now; None when the model is gone or trains none of the
        parameters searched."""
        param = self.param() if self.param is not None else None
        if param is None or not param.requires_grad or self.layout != layout_version():
            param = self._find()
            if param is None:
                return None
        return gradient_mark(param)

    def _find(self) -> torch.Tensor | None:
        model = self.model()
        self.param, self.layout = None, layout_version()
        if model is None:
            return None
        for index, param in enumerate(model.parameters()):
            if index >= self.SEARCHED:
                return None
            if param.requires_grad:
                self.param = weakref.ref(param)
                return param
        return None


class ModelMarks:
    """The marks of the open step's forward phase, kept on a model.

    A plain module gets a call-through in ``_compiled_call_impl``: PyTorch's own per-instance
    seam in ``Module.__call__`` (what ``Module.compile()`` fills), which keeps the module on its
    hook-free path. Forward pre/post hooks cost about three times as much per step (every
    hook sends the call down the slow path). A module compiled with ``Module.compile()``
    (before or after the marks were put on) gets the call-through around its compiled call:
    hooks would run inside the compiled code, where marks are traced away. Any other module
    (a class with its own ``__call__``, a ``torch.compile`` wrapper) gets the hooks.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.handles: list[RemovableHandle] = []
        self.model = weakref.ref(model)  # weak: this object is the value of a dict keyed by the model
        self.seam = False  # the marks sit in the seam (else in hooks)
        self.attached = False
        self.call: Callable[..., Any] | None = None  # the call-through in the seam
        # the compiled call it calls through to (Module.compile()), or None
        self.inner: Callable[..., Any] | None = None
        # A parameter to ask where the model lives now (a model moved with .to() keeps its
        # parameters); weak, like the model.
        first = next(model.parameters(), None)
        self.first = weakref.ref(first) if first is not None else none_ref
        self.gradients = FirstGradient(model)  # where its gradients stand at each call (hooks)
        self.began: float | None = None  # a call between steps began then (hooks)
        self.attach(model)

    def attach(self, model: torch.nn.Module) -> None:
        """Put the marks on the model (again, after :meth:`detach`)."""
        if _seam_free(model) or _seam_compiled(model):
            self.inner = model.__dict__.get("_compiled_call_impl")
            self.call = _call_with_marks(model, self.inner)
            model.__dict__["_compiled_call_impl"] = self.call  # past any __setattr__ of the class
            self.seam = True
        else:
            # The start mark runs before the user's pre-hooks, the end mark after their hooks:
            # the forward phase is the whole call.
            self.handles = [model.register_forward_pre_hook(self._pre, prepend=True, with_kwargs=True),
                            model.register_forward_hook(self._post)]
        self.attached = True

    def detach(self) -> None:
        """Take the marks off: the model's call is PyTorch's own again."""
        for h in self.handles:
            h.remove()
        self.handles = []
        model = self.model()
        if self.seam and model is not None:
            if model.__dict__.get("_compiled_call_impl") is self.call:  # still ours
                if self.inner is not None:
                    model.__dict__["_compiled_call_impl"] = self.inner
                else:
                    del model.__dict__["_compiled_call_impl"]
        self.seam = self.attached = False
        self.call = self.inner = None

    def state(self, model: torch.nn.Module) -> bool | None:
        """None unless the marks are on and still in place (``model.compile()`` after they were
        put on replaces the call-through; the next step puts it back around the compiled call);
        else whether the model is on a GPU (a model moved with ``.to()`` keeps its parameters)."""
        if not self.attached or self.seam and model.__dict__.get("_compiled_call_impl") is not self.call:
            return None
        first = self.first()
        return first is not None and first.is_cuda

    @staticmethod
    def _throughput(module: torch.nn.Module) -> StepThroughput | None:
        """The open step's throughput state, when it has a clock and ``module`` is its model
        (another step's model called inside it, a critic in a generator's step, marks nothing);
        None inside a torch.compile trace."""
        if _COMPILING is not None and _COMPILING():  # inside a torch.compile trace: stay out of the graph
            return None
        scope = current.step()
        state = scope.throughput if scope is not None and scope.model is module else None
        return state if state is not None and state.clock is not None else None

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._between_steps(starting=True):
            return
        state = self._throughput(module)
        if state is not None and state.clock is not None:  # (a state with a clock: see _throughput)
            scope = current.step()
            grads = self.gradients()
            if state.clock.batch is not MANY and scope is not None:  # (as in the seam)
                note_call(scope, args, kwargs, grads)
            state.clock.announce("forward_start", grads)  # a later call's start is kept in clock.again

    def _post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._between_steps(starting=False):
            return
        state = self._throughput(module)
        if state is not None and state.clock is not None:
            state.clock.announce("forward_end")

    def _between_steps(self, starting: bool) -> bool:
        """At a hook: with no step open (outside a torch.compile trace), the call is progress,
        and under no_grad time of an evaluation the script did not mark, as in the seam
        (:func:`_between_steps`). True when no step is open."""
        if (_COMPILING is not None and _COMPILING()) or current.step() is not None:
            return False
        progress.called_between_steps()
        if starting:
            self.began = time.perf_counter()
        elif self.began is not None:
            began, self.began = self.began, None
            _unmarked_call(began)
        return True

    remove = detach


_MARKS = "__torchtrace_phase_marks__"


def _seam_free(model: object) -> bool:
    """True when the module's call goes through ``Module.__call__`` and its seam is free."""
    return (isinstance(model, torch.nn.Module) and "_compiled_call_impl" in vars(torch.nn.Module)
            and _SEAM_CODE is not None
            and type(model).__call__ is torch.nn.Module.__call__
            and model.__dict__.get("_compiled_call_impl") is None)


def _seam_compiled(model: object) -> bool:
    """True when the module's call goes through ``Module.__call__`` and its seam holds someone's
    ``Module.compile()``."""
    impl = model.__dict__.get("_compiled_call_impl") if isinstance(model, torch.nn.Module) else None
    return (impl is not None and not getattr(impl, _MARKS, False) and _SEAM_CODE is not None
            and type(model).__call__ is torch.nn.Module.__call__)


def _call_with_marks(model: torch.nn.Module, inner: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """``model``'s own call (hooks and all) between the forward phase's two marks; with
    ``inner`` (the compiled call ``Module.compile()`` put in the seam), that call, outside the
    compiled code.

    It holds the model weakly: the model holds it, and a cycle would keep a deleted model's
    memory (a GPU's worth) until a full garbage collection. Pickling and ``copy.deepcopy``
    leave it out (``Module.__getstate__`` drops the seam). A copy of the model's ``__dict__``
    carries it along (``DataParallel``'s replicas are made so): it calls the module that
    called it (uncompiled), found in PyTorch's ``Module.__call__`` frame, and marks only for
    the model.
    """
    ref = weakref.ref(model)
    impl: Callable[..., Any] = type(model)._call_impl if inner is None else \
        (lambda target, *args, **kwargs: inner(*args, **kwargs))
    # Every forward call pays for what follows: names are bound here, not looked up per call.
    compiling, frame, seam, open_step, grad_enabled, many = _COMPILING or _never, sys._getframe, _SEAM_CODE, \
        current.step, torch.is_grad_enabled, MANY
    phase_mark, gradients = progress.mark, FirstGradient(model)  # (where its gradients stand at each call)

    def call_with_marks(*args: Any, **kwargs: Any) -> Any:
        if compiling():  # traced by torch.compile: no frames, no marks
            return impl(ref(), *args, **kwargs)
        target = ref()
        module = frame(1).f_locals.get("self", target)  # (the model itself: the caller's frame is not asked again)
        if module is not target and module is not None and frame(1).f_code is seam:
            return type(module)._call_impl(module, *args, **kwargs)  # a copy (a replica): its own call, no marks
        scope = open_step()
        if scope is None:  # between steps: an evaluation loop, say
            return _between_steps(impl, target, args, kwargs)
        state = scope.throughput if scope.model is target else None
        if state is None or (clock := state.clock) is None:  # the model is not the open step's
            return impl(target, *args, **kwargs)
        grads = gradients()  # (where the model's gradients stand: a backward since the call before?)
        if clock.batch is not many:  # a step whose arguments gave no batch (yet): the model's call may say it
            note_call(scope, args, kwargs, grads)
        if clock.forward_start is None:  # the step's first call (the usual step's only one)
            phase_mark("forward")
            clock.forward_start = clock.mark()
            clock.grads = grads
            out = impl(target, *args, **kwargs)
            if clock.optimizer_start is None:  # StepClock.end_forward, inline
                clock.forward_end = clock.mark()
                clock.graph = graph = grad_enabled()
                phase_mark("backward" if graph else "forward")
            return out
        again = clock.mark() if clock.forward_end is not None and clock.optimizer_start is None else None
        backward = clock.moved(grads) if again is not None else True  # (a pause since its last call: whose?)
        phase_mark("forward")
        out = impl(target, *args, **kwargs)
        if clock.optimizer_start is None:
            if again is not None:
                clock.pause(again, backward)
            clock.forward_end = clock.mark()
            clock.graph = grad_enabled()
        phase_mark("backward" if grad_enabled() else "forward")
        return out

    setattr(call_with_marks, _MARKS, True)
    return call_with_marks


class OptimizerMarks:
    """Step pre/post hooks kept on an optimizer: they mark the open step's optimizer phase."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]
        # The start mark first, before pre-hooks the user registered earlier (a pre-hook's time is
        # the optimizer's, not the backward's). The hooks live in an ordered dict keyed by handle id.
        pre = getattr(optimizer, "_optimizer_step_pre_hooks", None)
        if pre is not None and hasattr(pre, "move_to_end") and self.handles[0].id in pre:
            pre.move_to_end(self.handles[0].id, last=False)

    # One call each per optimizer.step(): the open step's clock, read once.
    @staticmethod
    def _pre(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        clock = _open_clock()
        if clock is not None and clock.optimizer_start is None:
            progress.mark("optimizer")
            clock.begin_optimizer()

    @staticmethod
    def _post(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        clock = _open_clock()
        if clock is not None and clock.optimizer_start is not None:
            clock.optimizer_end = clock.mark()
            progress.mark("optimizer")  # (progress: the update is done)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _between_steps(impl: Callable[..., object], target: torch.nn.Module | None, args: tuple, kwargs: dict) -> object:
    """A call of a step's model with no step open: progress as it begins and as it ends
    (:func:`~torchtrace.job.progress.called_between_steps`), so that an evaluation loop the
    script does not mark is no hang, while a call that never returns still is; and under
    no_grad, time of that evaluation (:func:`_unmarked_call`)."""
    progress.called_between_steps()
    start = time.perf_counter()
    out = impl(target, *args, **kwargs)
    progress.called_between_steps()
    _unmarked_call(start)
    return out


def _unmarked_call(start: float) -> None:
    """A watched model's call between steps, begun at ``start``, has ended: under no_grad and
    on the training thread, it is part of an evaluation the script did not mark
    (:meth:`~torchtrace.step.throughput.RunThroughput.unmarked_call`)."""
    if torch.is_grad_enabled() or not progress.on_training_thread():
        return
    rt = current.runtime(create=False)
    if rt is not None and rt.features.throughput:
        rt.throughput.unmarked_call(start, time.perf_counter())


def _never() -> bool:
    """torch.compiler.is_compiling where PyTorch has none: never compiling."""
    return False


def none_ref() -> None:
    """What a weak reference to ``None`` would be: called, it gives ``None``."""
    return None
