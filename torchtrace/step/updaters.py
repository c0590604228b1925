"""The optimizers, learning-rate schedulers and loss scaler a step used, however the step
reached them.

**Loss scalers.**

``torch.amp.GradScaler.scale`` and ``.step`` are wrapped (at ``configure()``; every patch of
this module is undone at ``shutdown()``):
the first call inside an open step that has no scaler yet makes that scaler the step's, as
if it had been passed as ``scaler=``. A scaler the step knows of is what tells an overflow
(which the scaler handles by skipping the update) from a non-finite gradient, is left
unchanged by a forensic replay (its ``update`` would back the scale off a second time), and
has its skipped updates counted in goodput. Without the wrapper, a scaler held in a global
or in the trainer object's closure went unseen: every overflow was a ``nonfinite_grad``
anomaly, and its replay halved the scale again. Outside a step the wrapper reads a context
variable; under ``torch.compile`` tracing it steps aside. ``ShardedGradScaler`` (FSDP) has
its own ``scale`` and inherits ``step``, which finds it.

**Optimizers.** A global optimizer step pre-hook (``register_optimizer_step_pre_hook``)
notes every optimizer that steps inside an open step besides the step's own (one in a
global, or the second of a GAN's two): a forensic replay calls the step function again, and
must not apply any of their updates a second time. Outside a step the hook reads a context
variable. A step that names a model but no optimizer takes the first optimizer that steps in
it after the backward and updates part of the model as its own: all of the model's gradients
are measured (and guarded) right before that update, which a loop that zeroes them at the
step's end leaves no other moment for. Several optimizers sharing the model (Muon and AdamW, a
sparse embedding's SparseAdam and an Adam for the rest) are measured together at the first
one's update. Another optimizer of the model that updates after a backward since (a GAN's
second network), or under an enabled loss scaler (which unscales one optimizer's gradients at
a time, as each steps), has its gradients measured as its own update begins
(:meth:`~torchtrace.step.gradients.GradientCheck.other_update`). One optimizer per parameter
stepped inside ``backward()`` is not the step's: the other gradients do not exist yet there.
A step's optimizer that hands its update to a base optimizer sharing its parameter groups
(SAM, Lookahead) has the base's update taken for its own: measured before it when the
wrapper's own ``step`` never ran. An optimizer that updates only the step's optimizer's
parameters (ZeRO's shard optimizer) is not a second optimizer the guard cannot cover.
Under ``guard="skip"`` the hook sets the gradients of a skipped update to ``None`` as it
begins; for ``optimizer.step(closure)`` in an open step it does so as the closure returns too,
for a framework that measures the gradients inside the closure (Lightning).

**Learning-rate schedulers.** The ``step`` of every scheduler class in
``torch.optim.lr_scheduler`` is wrapped: inside a forensic replay it does nothing. A
scheduler stepped inside the step (the per-step schedule of most transformer training) is
not stepped again by a replay, which would shift the learning rate one step ahead for the
rest of the run; this holds for one stepped after the update too, which a replay begun in the
optimizer's hook (non-finite gradients) reaches before the step itself did. A scheduler class
of the user's own that overrides ``step`` without calling the base's is not reached.

**Weight averages.** ``torch.optim.swa_utils.AveragedModel.update_parameters`` (an EMA or
SWA copy of the weights) is wrapped the same way: a replay does not average the weights in
a second time.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch
from torch.compiler import is_compiling
from torch.optim import lr_scheduler, swa_utils
from torch.optim import optimizer as optimizer_module

from torchtrace import current
from torchtrace.errors import NonFiniteError
from torchtrace.measure.gradients import in_backward
from torchtrace.measure.learning_rates import learning_rates
from torchtrace.measure.scaler import scale_at_start
from torchtrace.patches import Patches, marked
from torchtrace.step.gradients import adoptable, covers
from torchtrace.step.watched import real_optimizer, shares_groups

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope

AVERAGE = "update_parameters"  # the method of a weight average (AveragedModel) a replay must not call


def _note_scaler(scaler: torch.amp.GradScaler, args: tuple, kwargs: dict) -> None:
    """A GradScaler used in the open step that has none yet becomes the step's."""
    scope = current.step()
    if scope is not None and scope.active and scope.scaler is None:
        scope.scaler = scaler
        if scope.throughput is not None:  # the scale before this step's update, for goodput
            scope.throughput.scale_before = scale_at_start(scaler)


def _scaler_stepping(scaler: torch.amp.GradScaler, args: tuple, kwargs: dict) -> None:
    """``scaler.step(optimizer)`` in the open step: the scaler is noted (:func:`_note_scaler`),
    and the learning rates of the step's optimizer are read now, unless its gradients were
    measured already (a clip call): on an overflow the scaler skips the optimizer's step, whose
    hook reads them, and a scheduler stepped after it would have changed them by the step's end."""
    _note_scaler(scaler, args, kwargs)
    scope = current.step()
    if scope is None or not scope.active or scope.features is None or not scope.features.throughput:
        return
    check = scope.gradients
    optimizer = args[0] if args else kwargs.get("optimizer")
    if check is None or check.lr is not None or optimizer is None:
        return
    if real_optimizer(optimizer) is scope.optimizer:
        check.lr = learning_rates(scope.optimizer)


_SCALER_NOTES = {"scale": _note_scaler, "step": _scaler_stepping}


def _note(updater: object, args: tuple, kwargs: dict) -> None:
    """An optimizer or scheduler stepped in the open step: a replay must not step it again."""
    scope = current.step()
    if scope is not None and scope.active and updater is not scope.optimizer:
        scope.forensics.note_stepped(updater)


_R = TypeVar("_R")


def _safely(note: Callable[..., _R], *args: object) -> _R | None:
    """``note(*args)`` outside a compiled graph (no break), never raising into the user's call
    but the guard's error (``guard="raise"``: the user asked for it); its result, or None."""
    if is_compiling():
        return None
    try:
        return note(*args)
    except NonFiniteError:
        raise
    except Exception as exc:
        rt = current.runtime(create=False)
        if rt is not None:
            rt.errors.report("step", exc)
        return None


def _optimizer_stepping(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The global step pre-hook; returns the step's arguments with its closure wrapped where the
    step's gradients are measured as the closure's first evaluation returns."""
    _safely(_stepped_after_its_step, optimizer)
    _safely(_note, optimizer, args, kwargs)
    _safely(_unguarded, optimizer)
    replaced = _safely(_the_steps_update, optimizer, args, kwargs)
    _safely(_skipped, optimizer)
    args, kwargs = replaced or (args, kwargs)
    return _safely(_skipped_as_closure_returns, optimizer, args, kwargs) or replaced


def _stepped_after_its_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer`` is about to update, and the last step that named it (``optimizer=``) ended
    without its update: when no step is open now, the update comes after that step (a ``with``
    block around the forward and backward only), unmeasured and unguarded, which is said once
    per operation. Inside a step (the last micro-batch of an accumulation) it is not."""
    rt = current.runtime(create=False)
    if rt is None or rt.replaying or not rt.unstepped:
        return
    name = rt.unstepped.pop(optimizer, None)
    scope = current.step()
    if name is None or (scope is not None and scope.active):
        return
    rt.warn_once(("stepped-after", name),
                 "torchtrace: the optimizer of %s (%s) stepped after the step ended: the gradients of its update "
                 "were not measured, and guard='%s' could not act on them; call optimizer.step() inside the "
                 "step (the with block or the decorated function)", name, type(optimizer).__name__,
                 rt.guard.value)


def _the_steps_update(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``optimizer`` is about to update in an open step whose gradients are not measured yet.
    Its update is the step's, measured (and guarded) now, with the phase marks on it, when:

    - the step names a model but no optimizer, and this one steps after the backward (not
      inside it) and updates part of the model: all of the model's gradients are measured
      (:meth:`GradientCheck.adopt`; a skip decision drops them in :func:`_skipped`, next, and
      for every later optimizer of the step). Its later updates in the step are guarded as
      the step's own optimizer's are (a minibatch loop inside one step);
    - the step's optimizer hands its update to this one, sharing its parameter groups (SAM's
      ``second_step``: SAM never calls its own ``step``).

    This update's optimizer phase starts after the measuring, which counts in the backward.
    Returns the step's arguments (``args``, ``kwargs``, its pre-hook's) with a closure wrapped,
    or None."""
    scope = current.step()
    if scope is None or not scope.active or optimizer is scope.optimizer or scope.gradients is None:
        return None
    rt = current.runtime(create=False)
    if rt is None or rt.replaying:
        return None
    check = scope.gradients
    if scope.optimizer is None:
        if check.optimizer is not None:  # adopted already: its later updates are guarded too
            if optimizer is check.optimizer:
                return check.adopt(optimizer, args, kwargs)
            check.other_update(optimizer)  # another of the model's, perhaps after a backward of its own
            return None
        if scope.model is None or in_backward() or not adoptable(rt, scope, optimizer):  # (a gradient hook's)
            return None
        if scope.throughput is not None:
            rt.throughput.mark_optimizer(optimizer)
        return check.adopt(optimizer, args, kwargs)
    if check.fired:
        return None
    if shares_groups(optimizer, scope.optimizer):
        if scope.throughput is not None:
            rt.throughput.mark_optimizer(optimizer)
        scope.check_gradients_now(optimizer)
    return None


def _skipped(optimizer: torch.optim.Optimizer) -> None:
    """A skip decided at a ``clip_grad_norm_`` call left the gradients tensors (zeroed): an
    optimizer the step does not name finds them set to ``None`` as its update begins. In a
    forensic replay, an optimizer not yet known to it (the replay began at a clip call, before
    the step's optimizer stepped) finds no gradients either: its update and state stay as they
    were (the replay puts the gradients back)."""
    rt = current.runtime(create=False)
    if rt is not None and rt.replaying:
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        return
    scope = current.step()
    if scope is not None and scope.active and scope.gradients is not None:
        scope.gradients.drop_skipped(optimizer)


def _skipped_as_closure_returns(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict
                                ) -> tuple[tuple, dict] | None:
    """``optimizer.step(closure)`` in an open step: a skip decided while the closure runs (a
    framework measures the gradients inside it: Lightning's closure runs the backward, then
    ``on_before_optimizer_step``, then its clip) leaves the gradients zeroed there; they are
    set to ``None`` as the closure returns, right before the update (:func:`_skipped`).
    Returns the step's arguments (its pre-hook's, the optimizer first) with the closure
    wrapped, or None."""
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if not callable(closure):  # (the usual update: nothing to wrap)
        return None
    scope = current.step()
    rt = current.runtime(create=False)
    if scope is None or not scope.active or rt is None or rt.replaying:
        return None

    def closure_then_skipped(*inner: object, **named: object) -> Any:
        out = closure(*inner, **named)
        _safely(_skipped, optimizer)
        return out

    if len(args) > 1:
        return (args[0], closure_then_skipped, *args[2:]), kwargs
    return args, {**kwargs, "closure": closure_then_skipped}


def _unguarded(optimizer: torch.optim.Optimizer) -> None:
    """A second optimizer stepping in a step that has one of its own, updating parameters the
    step's optimizer does not (the other of a GAN's two): its gradients are guarded as it
    begins (:meth:`GradientCheck.guard_other`). An optimizer that updates only the step's
    optimizer's parameters (the base a wrapper steps) is covered by the step's own guard."""
    scope = current.step()
    if scope is None or not scope.active or scope.optimizer is None or optimizer is scope.optimizer:
        return
    rt = current.runtime(create=False)
    if rt is None or rt.replaying or covers(rt, scope, optimizer):
        return
    if scope.gradients is not None:
        scope.gradients.guard_other(optimizer)
    if scope.model is not None:
        _say_unmeasured(rt, scope, optimizer)


_TOLD: weakref.WeakKeyDictionary[torch.optim.Optimizer, set[str]] = weakref.WeakKeyDictionary()
"""The operations each other optimizer was looked at in by :func:`_say_unmeasured`."""


def _say_unmeasured(rt: Runtime, scope: StepScope, optimizer: torch.optim.Optimizer) -> None:
    """A second optimizer stepped in a step that names its model and its own optimizer, and
    updates parameters of that model the step's optimizer does not (``SparseAdam`` for the
    embedding beside ``optimizer=Adam`` of the rest): their gradients are not measured, which
    is said once, whatever the guard. Looked at once per operation and optimizer. Parameters
    of another model (a GAN's other network) are none of the step's."""
    told = _TOLD.setdefault(optimizer, set())
    if scope.name in told:
        return
    told.add(scope.name)
    assert scope.model is not None and scope.optimizer is not None  # (a step with both: see _unguarded)
    outside = {id(ref.param): ref.name for ref in rt.outside(scope.model, scope.optimizer)}
    names = [outside[id(ref.param)] for ref in rt.params_for(scope.model, optimizer) if id(ref.param) in outside]
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        rt.warn_once(("unmeasured", scope.name, type(optimizer).__name__),
                     "torchtrace: %s stepped in %s and updated parameters of its model that its optimizer= (%s) "
                     "does not (%s): their gradients are not measured (not in the step's norms, nor in its "
                     "non-finite check); pass the model without optimizer= to measure them all, or give that "
                     "update a step of its own", type(optimizer).__name__, scope.name,
                     type(scope.optimizer).__name__, shown)


def _replaying() -> bool:
    """A forensic replay is running."""
    rt = current.runtime(create=False)
    return rt is not None and rt.replaying


def _wrap(original: Callable[..., Any], note: Callable[[Any, tuple, dict], None],
          none_in_replay: bool = False) -> Callable[..., Any]:
    """``original`` (a method) that first notes its object and the call's arguments with
    ``note``; ``none_in_replay``: a call in a forensic replay does nothing and returns None (a
    scheduler's step, a weight average's update)."""
    @functools.wraps(original)
    def method(self: object, *args: object, **kwargs: object) -> Any:
        if none_in_replay and _safely(_replaying):
            return None
        _safely(note, self, args, kwargs)
        return original(self, *args, **kwargs)

    return method


_hook_handle: RemovableHandle | None = None
_PATCHES = Patches()


def install() -> None:
    """Wrap ``GradScaler.scale`` and ``GradScaler.step`` and the schedulers' ``step``, and
    register the global optimizer hook (idempotent)."""
    global _hook_handle
    register = getattr(optimizer_module, "register_optimizer_step_pre_hook", None)
    if _hook_handle is None and register is not None:
        _hook_handle = register(_optimizer_stepping)
    base = getattr(lr_scheduler, "LRScheduler", None)
    for scheduler_class in list(vars(lr_scheduler).values()):
        if isinstance(scheduler_class, type) and base is not None and issubclass(scheduler_class, base):
            existing = vars(scheduler_class).get("step")
            if existing is not None and not marked(existing):
                _PATCHES.replace(scheduler_class, "step", _wrap(existing, _note, none_in_replay=True))
    averaged = getattr(swa_utils, "AveragedModel", None)
    existing = vars(averaged).get(AVERAGE) if averaged is not None else None
    if existing is not None and not marked(existing):
        _PATCHES.replace(averaged, AVERAGE, _wrap(existing, _note, none_in_replay=True))
    scaler_class = getattr(getattr(getattr(torch, "amp", None), "grad_scaler", None), "GradScaler", None)
    if scaler_class is None:
        return
    for name, note in _SCALER_NOTES.items():
        existing = vars(scaler_class).get(name)
        if existing is None or marked(existing):
            continue
        _PATCHES.replace(scaler_class, name, _wrap(existing, note))


def uninstall() -> None:
    """Undo :func:`install`: torch's own methods back, the global optimizer hook removed (idempotent)."""
    global _hook_handle
    if _hook_handle is not None:
        _hook_handle.remove()
        _hook_handle = None
    _PATCHES.undo()


__all__ = ["install", "uninstall"]
