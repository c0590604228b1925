"""What both framework callbacks share: one step scope open between two framework hooks.

Frameworks call hooks, not ``with`` blocks, so :class:`StepDriver` enters a
:class:`~torchtrace.api.StepScope` in the "batch starts" hook and exits it in the "batch
ends" hook. Gradients are measured when the framework says the optimizer is about to step
(after its closure ran and, under mixed precision, after unscaling), never through the
torch optimizer's own pre-hook, which in Lightning runs before the closure.
"""

from __future__ import annotations

import importlib
import sys
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, Callable

import torch

from torchtrace import api, current
from torchtrace.errors import NonFiniteError
from torchtrace.measure.batch import infer_batch
from torchtrace.measure.loss import classify_loss
from torchtrace.record.step import StepRecord
from torchtrace.step.phases import StepClock
from torchtrace.step.watched import hookable, real_optimizer

if TYPE_CHECKING:
    from torchtrace.step.gradients import GradientCheck


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or raise ImportError saying which extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"torchtrace.integrations.{extra} needs {what}: pip install \"torchtrace[{extra}]\"") from exc



_ABSENT = object()


def replace_attribute(obj: object, name: str, wrapper: Callable[..., Any]) -> None:
    """``obj.name`` (an instance attribute) becomes ``wrapper``, which remembers what the
    instance held under that name itself (an override of the application's), or that it held
    nothing (the class's method): :func:`put_back_attribute` restores that."""
    wrapper.__torchtrace_replaced__ = vars(obj).get(name, _ABSENT)  # type: ignore[attr-defined]
    setattr(obj, name, wrapper)


def put_back_attribute(obj: object, name: str) -> None:
    """Undo :func:`replace_attribute` where its wrapper is still the instance's (idempotent)."""
    own = getattr(obj, "__dict__", {}).get(name)
    replaced = getattr(own, "__torchtrace_replaced__", None)
    if replaced is _ABSENT:
        delattr(obj, name)  # the class's method again
    elif replaced is not None:
        setattr(obj, name, replaced)  # the instance's own again

class StepDriver:
    """Opens and closes one scope per framework step; never raises torchtrace's own errors."""

    def __init__(self, name: str, kind: str = "train") -> None:
        self.name = name
        self.kind = kind  # the operation kind of goodput: train, evaluation, ...
        self.scope: api.StepScope | None = None
        self._losses: list[torch.Tensor] = []
        self._summed = False  # the micro-batch losses are parts of the step's (summed, not averaged)
        self._samples: int | torch.Tensor | None = None
        self._tokens: int | torch.Tensor | None = None
        self._flops: int | None = None
        self._given: list[tuple[Any, Any]] = []  # (loss, batch) the user gave for each earlier micro-batch

    @property
    def active(self) -> bool:
        return self.scope is not None and self.scope.active

    # Any: the batch the framework hands over, whatever its loader yields.
    def begin(self, model: torch.nn.Module | None, batch: object = None, loop: FrameType | None = None,
              step: int | None = None, replay: Callable[[], Any] | None = None) -> None:
        """Open the step; ``batch`` (when the framework hands it over) gives its samples,
        tokens and input shapes (FLOPs counted once per shape). ``loop``: the frame of the
        framework's training loop, for a framework that tells no callback when an exception
        leaves its loop: while such a step is open, a step that opens in this thread, and
        shutdown, first end it when that frame has left the stack. ``step``: the framework's
        own step number (a run resumed from a checkpoint goes on counting where it was).
        ``replay``: a callable that runs the batch's forward and loss again, for forensics."""
        self.abort(None)  # a scope left open by an interrupted step ends here
        rt = api.get_runtime()
        if rt is None or rt.skips_steps:
            return
        # No optimizer on the scope: its pre-hook would fire at the wrong moment (see module doc).
        scope = api.StepScope(self.name, model=model, inputs=((batch,), {}) if batch is not None else None,
                              kind=self.kind, step=step if isinstance(step, int) and step >= 0 else None,
                              replay=replay)
        scope.__enter__()
        # A guard="raise" decided inside the framework's own clip_grad_norm_ call (torchtrace
        # measures there, before clipping) must end this span as measure() does.
        scope.on_guard_raise = self.end
        # The framework tells of each optimizer update (measure): a step it tells of none made none.
        scope.update_told = False
        self.scope = scope
        if loop is not None and scope.active:
            _LOOPS[id(scope)] = (self, loop)
            current.orphan_check = _end_orphan
        self._losses = []
        self._summed = False
        self._samples = None
        self._tokens = None
        self._flops = None
        self._given = []

    def next_micro_batch(self) -> None:
        """Another micro-batch of the open step begins: what the user gave for the one before
        (``record_loss``, ``record_batch`` in a custom ``compute_loss``, called once per
        micro-batch) is kept apart, so that the step ends with the values of all its
        micro-batches (:func:`combined_given`), not those of the last one."""
        scope = self.scope
        if scope is not None and scope.active and (scope.given.loss is not None or scope.given.batch is not None):
            self._given.append(scope.given.take())

    def measure(self, model: torch.nn.Module | None, optimizer) -> None:
        """Gradient statistics and the guard policy, right before the optimizer's update.

        Raises:
            NonFiniteError: under ``guard="raise"`` with non-finite gradients; the step's
                span is ended with the error first.
        """
        scope = self.scope
        if scope is None or not scope.active:
            return
        if model is not None and scope.model is None:
            scope.model = model
        scope.update_told = True
        try:
            scope.check_gradients_now(optimizer)
        except NonFiniteError as exc:
            self.end(exc)
            raise
        if scope.gradients is not None:
            _hold_skipped(scope.gradients, optimizer)

    def mark(self, point: str, cuda: bool = False) -> None:
        """A phase boundary the framework's hooks see and the model's own marks cannot (the
        model joins the scope late, or the optimizer is not the scope's): ``forward_start``,
        ``forward_end``, ``optimizer_start`` or ``optimizer_end``. ``cuda``: the model is on a
        GPU (the clock then records CUDA events), for a scope that has no clock yet."""
        scope = self.scope
        if scope is None or not scope.active or scope.features is None or not scope.features.throughput:
            return
        try:
            state = scope.throughput
            if state is None:
                return
            if state.clock is None:
                state.clock = StepClock(cuda=cuda)
            state.clock.announce(point)
        except Exception as exc:
            rt = api.get_runtime()
            if rt is not None:  # (a step is open: the runtime is there)
                rt.errors.report("other", exc)

    def add_batch(self, args: tuple, kwargs: dict) -> None:
        """Count a micro-batch's samples and tokens (a mask's count stays on the device)."""
        if not self.active:
            return
        batch = infer_batch(args, kwargs)
        if batch.samples is not None:  # a device count (a packed row's) is added on the device
            self._samples = batch.samples if self._samples is None else self._samples + batch.samples
        if batch.tokens is not None:
            self._tokens = batch.tokens if self._tokens is None else self._tokens + batch.tokens

    def add_flops(self, flops: int | None) -> None:
        """Add a micro-batch's model FLOPs (the framework's estimate) to the step's."""
        if self.active and flops is not None:
            self._flops = (self._flops or 0) + flops

    def add_loss(self, loss: object, part: bool = False) -> None:
        """Collect a micro-batch loss (device tensor, no host read); averaged at the end, or
        summed when ``part`` says the framework normalised it by the whole step's items (the
        Hugging Face Trainer passing ``num_items_in_batch``: each is a part of the step's loss)."""
        if self.active and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach().reshape(()))
            self._summed = self._summed or part

    def end(self, exc: BaseException | None = None, loss: object = None) -> StepRecord | None:
        scope, self.scope = self.scope, None
        if scope is None:
            return None
        if _LOOPS.pop(id(scope), None) is not None and not _LOOPS:
            current.orphan_check = None
        if scope.active:
            if self._given:
                given, self._given = self._given, []
                scope.given.loss, scope.given.batch = combined_given(given + [scope.given.take()])
            if loss is not None:
                scope.record_loss(loss)
            elif self._losses and not scope.has_loss:
                losses = self._losses
                if len(losses) == 1:
                    scope.record_loss(losses[0])
                else:
                    stacked = torch.stack([t.to(losses[0].device, torch.float32) for t in losses])
                    scope.record_loss(stacked.sum() if self._summed else stacked.mean())
            self._losses, self._summed = [], False
            if self._samples is not None or self._tokens is not None or self._flops is not None:
                # What the user gave with record_batch inside the step wins over the framework's.
                user = scope.given.batch or (None, None, None)
                # (samples, tokens, FLOPs in record_batch's order: counts, a device count, a number)
                scope.record_batch(*(mine if theirs is None else theirs  # type: ignore[arg-type]
                                     for mine, theirs in zip((self._samples, self._tokens, self._flops), user)))
            self._samples = self._tokens = self._flops = None
            scope.__exit__(type(exc) if exc is not None else None, exc, None)
        return scope.record

    def abort(self, exc: BaseException | None) -> None:
        if self.scope is not None:
            self.end(exc if exc is not None else RuntimeError("step interrupted"))


def _hold_skipped(check: GradientCheck, optimizer: torch.optim.Optimizer | None) -> None:
    """``guard="skip"`` decided as the framework's optimizer is about to step: the gradients
    stay tensors, zeroed, for what the framework and the user's hooks do before the update
    (Lightning clips after ``on_before_optimizer_step``, and torch's ``clip_grad_value_``
    refuses a list of no gradients); they are set to ``None`` as the torch optimizer's update
    begins (:mod:`torchtrace.step.updaters`), so the update leaves the parameters and the
    optimizer's state unchanged. An optimizer that torch's step hooks do not reach (no
    ``Optimizer.__init__`` ran) has them set to ``None`` now."""
    check.zero_skipped()
    if optimizer is not None and not hookable(real_optimizer(optimizer)):
        check.drop_skipped()


def combined_given(given: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    """One step's values from what the user gave for each of its micro-batches: the mean of
    the losses given (on the device, no host read) and, for samples, tokens and FLOPs, the sum
    of the values given."""
    losses = [loss for loss, _ in given if loss is not None]
    loss = None
    if losses:
        device = next((v.tensor.device for v in losses if v.tensor is not None), None)
        parts = [v.tensor.detach().reshape(()).to(torch.float32) if v.tensor is not None
                 else torch.tensor(v.number, dtype=torch.float32, device=device) for v in losses]
        loss = classify_loss(torch.stack([t.to(parts[0].device) for t in parts]).mean())
    batches = [batch for _, batch in given if batch is not None]
    batch = tuple(_summed([v for v in values if v is not None]) for values in zip(*batches)) if batches else None
    return loss, batch


def _summed(values: list[Any]) -> Any:
    total = None
    for value in values:
        total = value if total is None else total + value
    return total


# The open steps of drivers given their loop's frame: id(scope) -> (driver, frame). The frame
# is held (not its id, which a later frame may reuse) only while its step is open.
_LOOPS: dict[int, tuple[StepDriver, Any]] = {}


def _end_orphan() -> None:
    """End this thread's open step if a driver opened it and its loop's frame is off the stack."""
    entry = _LOOPS.get(id(current.step()))
    if entry is None:
        return
    driver, loop = entry
    frame: FrameType | None
    frame = sys._getframe(1)
    while frame is not None:
        if frame is loop:
            return
        frame = frame.f_back
    try:
        driver.abort(RuntimeError("step interrupted: an exception left the training loop before the step ended"))
    except Exception as exc:  # called where a step opens: torchtrace's own failure never reaches it
        rt = current.runtime(create=False)
        if rt is not None:
            rt.errors.report("other", exc)


def loop_frame(skip: str) -> FrameType | None:
    """The first frame above the caller's caller whose module's name does not start with
    ``skip`` (the framework's callback machinery): the framework's loop."""
    frame: FrameType | None
    frame = sys._getframe(2)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith(skip):
        frame = frame.f_back
    return frame
