"""The step's gradient check: measured right before the optimizer uses the gradients.

With an optimizer, :class:`GradientCheck` hears its ``step`` begin (a step pre-hook the runtime
keeps on it, :class:`UpdateHooks`), so the norms are those of the update about to happen and a
``skip`` guard can drop it before any parameter changes. ``torch.nn.utils.clip_grad_norm_``
called inside a step measures first (:mod:`torchtrace.step.clipping`), so the recorded norm is
the one before clipping. Without an optimizer the gradients are measured when the step ends.

The norms stay on the device and ride in the step's one host read, unless a decision is due
now: a ``skip``/``raise`` guard must decide before the update (its own host read), and on the
CPU the global norm is looked at for free so that a non-finite step is replayed while the
parameters are still those the step saw.
"""

from __future__ import annotations

import math
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from torchtrace.errors import NonFiniteError
from torchtrace.measure import gradients as grad_measure
from torchtrace.measure.scaler import carried_scale, scaler_enabled, unscaled_by
from torchtrace.record import readout
from torchtrace.record.policy import GuardPolicy, agree_any
from torchtrace.step.compiled import outside_compiler
from torchtrace.step.throughput import learning_rates
from torchtrace.step.watched import hookable

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope

_NO_GRADIENTS = frozenset({"evaluation", "checkpoint"})  # operation kinds that make no gradients


def kernel_scale(optimizer: object) -> torch.Tensor | None:
    """The scale the gradients still carry as ``optimizer`` updates, or None: ``GradScaler.step``
    leaves an optimizer that unscales in its own kernel (``_step_supports_amp_scaling``: the
    fused Adam, AdamW, SGD and Adagrad) the scaled gradients and the scale as
    ``optimizer.grad_scale``, for the length of that ``step`` call. After ``scaler.unscale_``
    (a clip first) it sets none: the gradients are unscaled already.

    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> kernel_scale(opt) is None
    True
    """
    scale = getattr(optimizer, "grad_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


def _applied_norms(params: list, optimizer: torch.optim.Optimizer | None,
                   scaler: object = None) -> grad_measure.GradStats | None:
    """The norms of the gradients of ``params`` as ``optimizer``'s update will apply them: divided
    by the scale they still carry. That is the scale a fused optimizer stepped through a
    GradScaler still has to remove, or, before the step's ``scaler`` unscaled them (a clip
    called on the scaled gradients, to log their norm), the scaler's own, which its ``step``
    removes before the update. (The stats keep the norms as measured, which a clip's total is
    made of.)"""
    stats = grad_measure.gradient_norms(params)
    scale = kernel_scale(optimizer)
    if scale is None:
        scale = carried_scale(scaler, optimizer)
    if stats is not None and scale is not None:
        stats = grad_measure.unscaled(stats, scale)
    return stats


def adoptable(rt: Runtime, scope: StepScope, optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step that names a model but no optimizer takes ``optimizer`` as its own: it
    updates part of the model's trainable parameters."""
    assert scope.model is not None  # (a step that names its model)
    updated = {id(ref.param) for ref in rt.params_for(scope.model, optimizer)}
    return any(ref.param.requires_grad and id(ref.param) in updated for ref in rt.params_for(scope.model, None))


def covers(rt: Runtime, scope: StepScope, optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter ``optimizer`` updates is one the step's optimizer updates: a skip
    decided on the step's gradients then drops this update too (the base optimizer a wrapper
    steps: ZeRO's shard, Lookahead's, accelerate's)."""
    watched = {id(ref.param) for ref in rt.params_for(scope.model, scope.optimizer)}
    return all(id(ref.param) in watched for ref in rt.params_for(scope.model, optimizer))


class UpdateHooks:
    """The step pre-hooks through which each open step's :class:`GradientCheck` hears its
    optimizer's update: one hook kept on each optimizer a step named, registered at its first
    step and removed at shutdown, that calls the checks of the steps open on that optimizer
    (outermost first: a step inside another one naming the same optimizer is measured by both,
    each with its own check). Registering a hook and removing it again on every step cost
    about 4 us of step entry on a 2-core machine (``benchmarks/step_entry.py``).

    The kept hook runs after the pre-hooks the user had registered before the optimizer's first
    step, and before the ones registered later.
    """

    def __init__(self) -> None:
        self._handles: weakref.WeakKeyDictionary[torch.optim.Optimizer, RemovableHandle] = \
            weakref.WeakKeyDictionary()
        self._checks: dict[int, list[GradientCheck]] = {}  # id(optimizer) -> the open steps' checks

    def watch(self, optimizer: torch.optim.Optimizer, check: GradientCheck) -> None:
        """``check`` hears ``optimizer``'s updates until :meth:`unwatch`."""
        if optimizer not in self._handles:
            self._handles[optimizer] = optimizer.register_step_pre_hook(self._updating)
        self._checks.setdefault(id(optimizer), []).append(check)

    def unwatch(self, optimizer: torch.optim.Optimizer, check: GradientCheck) -> None:
        checks = self._checks.get(id(optimizer))
        if checks is not None and check in checks:
            checks.remove(check)
            if not checks:
                del self._checks[id(optimizer)]

    @outside_compiler
    def _updating(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The kept pre-hook: each watching check in turn, each given the arguments the one
        before it returned (as torch chains pre-hooks); the last replacement, or None."""
        checks = self._checks.get(id(optimizer))
        if not checks:
            return None
        replaced = None
        for check in list(checks):
            out = check.pre_hook(optimizer, args, kwargs)
            if out is not None:
                replaced = args, kwargs = out
        return replaced

    def close(self) -> None:
        """Shutdown: every kept hook removed."""
        for handle in list(self._handles.values()):
            handle.remove()
        self._handles.clear()
        self._checks.clear()


class GradientCheck:
    """One step's gradient measurement and guard decision (see the module docstring)."""

    __slots__ = ("scope", "rt", "stats", "values", "fired", "skipped", "peer_nonfinite", "update_before", "optimizer",
                 "lr", "adopted", "whole_model", "updates", "_hooked", "_skip_params", "_mark", "_again",
                 "nested", "held")

    def __init__(self, scope: StepScope, rt: Runtime) -> None:
        self.scope = scope
        self.rt = rt
        self.stats: grad_measure.GradStats | None = None
        self.values: list[float] | None = None  # the norms, when read before the update
        self.fired = False
        self.skipped = False
        self.peer_nonfinite = False
        self.update_before: tuple[list, list[torch.Tensor]] | None = None
        self.optimizer: torch.optim.Optimizer | None = None  # the optimizer whose update was checked
        self.lr: list[float] | None = None  # its learning rates for this update (before a scheduler steps)
        self.adopted = False  # the step named no optimizer and took the first to update as its own
        self.whole_model = False  # measure all of the model's gradients, not the optimizer's (see adopt)
        self.updates = 0  # updates of the step's optimizer begun in the step
        self._hooked: torch.optim.Optimizer | None = None  # the optimizer whose updates it hears
        self._skip_params: list | None = None  # the parameters whose update the guard skips
        # Adopted: the gradient of the model's first trained parameter the step's
        # optimizer does not update, as that optimizer's last update began (see other_update);
        # and the other optimizers whose gradients were measured again, after a backward.
        self._mark: tuple[torch.Tensor, grad_measure.GradientMark] | None = None
        self._again: list[torch.optim.Optimizer] | None = None
        self.nested = False  # the step runs inside other steps
        self.held = False  # a step inside this one measured the gradients before an update

    def hook(self, optimizer: torch.optim.Optimizer) -> None:
        """Measure the gradients as ``optimizer.step()`` begins (through the runtime's
        :class:`UpdateHooks`). An optimizer without torch's step hooks (a wrapper that never ran
        ``Optimizer.__init__``) is not hooked: its step's gradients are measured at the step's
        end (:meth:`measure_at_end`)."""
        if hookable(optimizer):
            self.rt.update_hooks.watch(optimizer, self)
            self._hooked = optimizer

    def unhook(self) -> None:
        if self._hooked is not None:
            self.rt.update_hooks.unwatch(self._hooked, self)
            self._hooked = None

    def pre_hook(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # ``args`` holds the optimizer itself first (torch passes step's own arguments).
        later = self.updates > 0
        self.updates += 1
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if callable(closure) and not self.fired:
            # optimizer.step(closure) (LBFGS, or SGD given one): the gradients do not exist yet;
            # they are measured, and guarded, when the closure's first evaluation returns.
            measured = self._measured(optimizer, closure)
            if len(args) > 1:
                return (args[0], measured, *args[2:]), kwargs
            return args, {**kwargs, "closure": measured}
        if self.fired:  # measured earlier (a clip call, an earlier update): the rates are read now
            if self.scope.active and self.scope.features is not None and self.scope.features.throughput:
                self.lr = learning_rates(optimizer)
            if later:
                self._guard_again(optimizer)
            self.drop_skipped(optimizer)
            return None
        self.before_update(optimizer)
        self.drop_skipped(optimizer)
        return None

    def _measured(self, optimizer: torch.optim.Optimizer, closure: Callable[..., Any]) -> Callable[..., Any]:
        def measured(*args: object, **kwargs: object) -> Any:
            out = closure(*args, **kwargs)
            self.before_update(optimizer)  # once: the gradients where the step started
            self.drop_skipped(optimizer)
            return out
        return measured

    def drop_skipped(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """``optimizer`` is about to update: under a ``skip`` decision the skipped gradients and
        those of ``optimizer``'s parameters (when given) are set to ``None`` now, so the update leaves every
        parameter and its state unchanged: a skip drops the step's later updates, whichever
        optimizer makes them. (Decided at a ``clip_grad_norm_`` call, the gradients stay tensors
        until here: the user's code between the clip and the update sees what it would see
        without torchtrace.)"""
        if not self.skipped:
            return
        for ref in self._skip_params or ():
            ref.param.grad = None
        for group in optimizer.param_groups if optimizer is not None else ():
            for p in group["params"]:
                p.grad = None

    def zero_skipped(self) -> None:
        """After the user's ``clip_grad_norm_`` call on a skipped step: the gradients stay tensors
        but hold zeros, so a hand-written update (``p.data.add_(p.grad, alpha=-lr)``, with no
        optimizer to skip) leaves the parameters unchanged."""
        if self.skipped and self._skip_params is not None:
            with torch.no_grad():
                for ref in self._skip_params:
                    if ref.param.grad is not None:
                        ref.param.grad.zero_()

    @outside_compiler
    def adopt(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The step names a model but no optimizer, and ``optimizer``, the first to update part
        of the model in it, is about to (its step pre-hook's arguments): all of the model's
        gradients are measured (and guarded) before its update, whichever of its optimizers
        update them, and the step's learning rates are this one's. Under an enabled loss scaler,
        which unscales one optimizer's gradients at a time as each steps, only this optimizer's
        are: the others' are measured as their own updates begin (:meth:`other_update`). Its later updates in the step
        come here too, and are guarded as the step's own optimizer's are. Returns the step's arguments
        with its closure wrapped (``optimizer.step(closure)``: measured as the closure's first
        evaluation returns), or None.

        Raises:
            NonFiniteError: under ``guard="raise"`` with non-finite gradients.
        """
        if self.optimizer is None:  # adopted now (perhaps measured at a clip call already)
            self.optimizer = optimizer
            self.adopted = True
            self.whole_model = not scaler_enabled(self.scope.scaler)
        replaced = self.pre_hook(optimizer, args, kwargs)
        self._mark_outside(optimizer)
        return replaced

    def _mark_outside(self, optimizer: torch.optim.Optimizer) -> None:
        """As the step's (adopted) optimizer begins an update: mark the gradient of the model's
        first trained parameter it does not update, if any (:meth:`other_update`)."""
        assert self.scope.model is not None  # (adopted: the step names its model)
        self._mark = None
        for ref in self.rt.outside(self.scope.model, optimizer):
            if ref.param.requires_grad:
                self._mark = (ref.param, grad_measure.gradient_mark(ref.param))
                return

    def _gradients_moved(self) -> bool:
        """Whether the marked gradient (:meth:`_mark_outside`) moved: a backward wrote it since.
        (A loss scaler's unscaling writes in place without a new version: not seen here.)"""
        if self._mark is None:
            return False
        param, mark = self._mark
        return grad_measure.gradient_moved(mark, grad_measure.gradient_mark(param))

    @outside_compiler
    def other_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Another optimizer of the model begins an update, after the step's own (adopted) one.

        When a backward ran since the step's optimizer began its last update (a GAN's second
        network: its gradients zeroed and made again), the ones measured then are not the ones
        this update applies; under an enabled loss scaler, which unscales one optimizer's
        gradients at a time as each steps, the first update measured its own only. Either way
        this optimizer's parameters are measured now (unless a clip of them just did), take
        their place in the step's statistics, and are guarded as the step's own update's are (a
        skip drops this update and the step's later ones). A later update of the same optimizer
        after another backward is guarded only, as the step's own optimizer's later updates
        are. Without a backward in between and without a scaler (Muon and AdamW over one
        backward) they were measured with the model's, and nothing is read again.

        Raises:
            NonFiniteError: under ``guard="raise"`` with non-finite gradients.
        """
        moved = self._later_moment()
        if moved is None:
            return
        scope = self.scope
        assert scope.model is not None and self.optimizer is not None  # (adopted)
        if self._again is not None and optimizer in self._again:
            if moved:
                self._guard_again(optimizer)
        else:
            outside = {id(ref.param) for ref in self.rt.outside(scope.model, self.optimizer)}
            refs = [ref for ref in self.rt.params_for(scope.model, optimizer) if id(ref.param) in outside]
            if self._due(refs, moved):
                self._again = [*(self._again or ()), optimizer]
                self._remeasure(refs, optimizer)
        self.mark_again()

    def _later_moment(self) -> bool | None:
        """At another optimizer's update or clip in an adopted step: whether the gradients moved
        since the step's optimizer began its last update (:meth:`_gradients_moved`); None when
        there is nothing to measure (not adopted, skipped, over, or measured with the whole
        model then and unchanged since)."""
        if not self.adopted or self.skipped or not self.scope.active:
            return None
        moved = self._gradients_moved()
        if self.whole_model and not moved:
            return None
        return moved

    def _due(self, refs: list, moved: bool) -> bool:
        """Whether the gradients of ``refs`` are to be measured now: a backward wrote them since
        they were (``moved``), or some are not in the step's statistics yet (under a loss
        scaler the first update measured its own only)."""
        measured = set(self.stats.names) if self.stats is not None else set()
        return bool(refs) and (moved or any(ref.name not in measured for ref in refs))

    def other_clip(self, params: list[torch.Tensor]) -> bool:
        """A clip call after the step's (adopted) optimizer began its update: the clipped
        parameters it does not update (a GAN's second network, clipped before its own update)
        are measured now, before the clip, where :meth:`other_update` would measure them as
        their update begins. Returns whether they were (their norms are
        then the clip's to reuse, and :meth:`mark_again` is due after the clip).

        Raises:
            NonFiniteError: under ``guard="raise"`` with non-finite gradients.
        """
        moved = self._later_moment()
        if moved is None:
            return False
        scope = self.scope
        assert scope.model is not None and self.optimizer is not None  # (adopted)
        clipped = {id(p) for p in params}
        refs = [ref for ref in self.rt.outside(scope.model, self.optimizer) if id(ref.param) in clipped]
        if not self._due(refs, moved):
            return False
        self._remeasure(refs, None)
        return True

    def mark_again(self) -> None:
        """The gradients the next update applies are measured (by :meth:`other_update`, or by
        :meth:`other_clip` before the clip that left them): mark them, so that this update
        measures nothing again."""
        if self._mark is not None:
            self._mark = (self._mark[0], grad_measure.gradient_mark(self._mark[0]))

    def _remeasure(self, refs: list, optimizer: torch.optim.Optimizer | None) -> None:
        """Measure the gradients of ``refs`` again (see :meth:`other_update`), put their norms in
        the step's statistics in place of the earlier ones, and guard.

        Raises:
            NonFiniteError: under ``guard="raise"`` with non-finite gradients.
        """
        rt, scope = self.rt, self.scope
        t0 = time.perf_counter()
        try:
            stats = _applied_norms(refs, optimizer, scope.scaler)
            if stats is not None:
                self.stats = grad_measure.remeasured(self.stats, stats)
                self.values = None  # the earlier values, if read, are not all current now
            assert scope.model is not None  # (adopted)
            self._guard(rt.params_for(scope.model, None), measured=stats is not None)  # a skip drops every later update
        finally:
            scope.add_overhead(time.perf_counter() - t0)

    def before_update(self, optimizer: torch.optim.Optimizer | None,
                      clipped: list[torch.Tensor] | None = None) -> None:
        """Measure the gradients the optimizer is about to use (all of the model's, adopted; at
        a clip under a loss scaler in a step that names no optimizer, ``clipped``, those the
        clip was given); apply the guard policy.

        Raises:
            NonFiniteError: under ``guard="raise"`` with non-finite gradients.
        """
        scope = self.scope
        if self.fired or not scope.active:
            return
        assert scope.features is not None and scope.step is not None  # (the step is active)
        t0 = time.perf_counter()
        self.fired = True
        self.optimizer = optimizer
        if self.nested:
            scope.hold_outer_gradients()
        if scope.features.throughput:
            self.lr = learning_rates(optimizer)
        rt = self.rt
        try:
            params = rt.params_for(scope.model, None if self.whole_model else optimizer)
            if clipped is not None:
                ids = {id(p) for p in clipped}
                params = [ref for ref in params if id(ref.param) in ids]
            self.stats = _applied_norms(params, optimizer, scope.scaler)
            self._guard(params, measured=self.stats is not None)
            every = rt.settings.update_ratio_interval
            if scope.features.param_stats and every and scope.step % every == 0 and params:
                # Before the update: the parameters now, to measure what the update changed.
                self.update_before = (params, grad_measure.snapshot_parameters(params))
        except NonFiniteError:
            scope.add_overhead(time.perf_counter() - t0)
            raise
        except Exception as exc:
            rt.errors.report("gradients", exc)
        scope.add_overhead(time.perf_counter() - t0)

    def _guard(self, params: list, measured: bool) -> None:
        """The guard, on the norms just measured (``measured``: there were gradients) before an
        update: under ``skip`` or ``raise``, a host read and a decision now. Under ``warn``, CPU
        norms are already in host memory: they are looked at for free, and a bad step is decided
        on now (a forensic replay), while the parameters are still those the step saw; the
        values are kept, and the step's end reads no norms again.

        Raises:
            NonFiniteError: under ``guard="raise"`` with non-finite gradients.
        """
        rt, stats = self.rt, self.stats
        if rt.guard is not GuardPolicy.WARN and (measured or rt.identity.distributed):
            self._decide(params)
        elif measured and stats is not None and rt.forensics is not None and \
                rt.forensics.wants_early_look(self.scope, stats):
            values = self.values = readout.peek_cpu(stats.norms)
            if not all(map(math.isfinite, values)):
                self._decide(params, values)

    def _guard_again(self, optimizer: torch.optim.Optimizer) -> None:
        """A later update of the step's optimizer in the same step (the minibatch loop of a PPO
        update inside one step): under ``skip`` or ``raise`` its gradients are guarded too, with
        a norm pass and a host read of their own. The step's statistics stay its first update's
        unless this one is non-finite; a skip drops this update and every later one of the step.

        Raises:
            NonFiniteError: under ``guard="raise"`` with non-finite gradients.
        """
        rt, scope = self.rt, self.scope
        if rt.guard is GuardPolicy.WARN or self.skipped or not scope.active:
            return
        self._guard_update(rt.params_for(scope.model, None if self.whole_model else optimizer), optimizer)

    def guard_other(self, optimizer: torch.optim.Optimizer) -> None:
        """A second optimizer, updating parameters the step's own does not (a GAN's other
        network; an encoder's and a decoder's optimizers, as the step's arguments), is about to
        update in the step: under ``skip`` or ``raise`` its gradients are guarded as the step's
        own were, with a norm pass and a host read of their own. The step's statistics stay its
        own optimizer's unless this update is non-finite; a skip drops this update and the
        step's later ones (:meth:`drop_skipped`).

        Raises:
            NonFiniteError: under ``guard="raise"`` with non-finite gradients.
        """
        if self.rt.guard is GuardPolicy.WARN or self.skipped or not self.scope.active:
            return
        self._guard_update(self.rt.params_for(None, optimizer), optimizer)

    def _guard_update(self, params: list, optimizer: torch.optim.Optimizer) -> None:
        """Guard one more update of the step, of ``params`` by ``optimizer``: measure, read, decide."""
        stats = _applied_norms(params, optimizer, self.scope.scaler)
        if stats is None and not self.rt.identity.distributed:
            return
        first = self.stats, self.values
        self.stats, self.values = stats, None
        self._decide(params)  # may raise (the record then shows this update)
        if not self.skipped:  # finite: the record keeps the first update's statistics
            self.stats, self.values = first

    def measure_at_end(self) -> None:
        """No optimizer was hooked: measure the gradients as the step leaves them. (With an
        optimizer that did not step, no update used them: nothing to measure, and the optimizer
        is noted in ``rt.unstepped``, for the warning should it step after the step, outside
        it. An evaluation or checkpoint operation makes none: what it would find are the last
        training step's.)

        A step around steps that measured their gradients before an update (an epoch given its
        model) measures none: what it would find is its last step's, which that step measured
        and guarded.

        None left, after optimizers stepped in the step (one per parameter, inside
        ``backward()``, each zeroing its tensor's gradient): the step's gradients were not
        measured, which a warning says once per operation."""
        scope = self.scope
        if self.fired or self.held or scope.kind in _NO_GRADIENTS:
            return
        if scope.optimizer is not None and hookable(scope.optimizer):
            # It did not step in the step: one that steps after it is said once (updaters).
            self.rt.unstepped[scope.optimizer] = scope.name
            return
        if scope.model is None:
            return
        self.fired = True
        self.stats = grad_measure.gradient_norms(self.rt.params_for(scope.model, None))
        stepped = scope.forensics.stepped or ()
        if self.stats is None and any(isinstance(u, torch.optim.Optimizer) for u in stepped):
            self.rt.warn_once(("gradients-gone", scope.name),
                              "torchtrace: %s: the step's gradients were not measured: optimizers stepped in it, "
                              "none of them updating all of the model's trainable parameters (one optimizer per "
                              "parameter, stepped in backward()?), and no gradient was left at its end; pass "
                              "optimizer= to measure one optimizer's gradients before its update", scope.name)

    def _left_to_scaler(self) -> bool:
        """Whether a loss scaler skips this update itself if the gradients hold Inf or NaN: it
        unscaled them (``scaler.unscale_`` before a clip), it steps a fused optimizer that
        unscales in its kernel, or the gradients measured still carry its scale (a clip called
        before any ``unscale_``, to log the norm: its ``step`` unscales and checks them). Its
        overflows are routine while its scale backs off: the guard leaves them to it (the
        record tells an overflow from a non-finite loss)."""
        carried = self.stats is not None and self.stats.measured is not None
        return carried or kernel_scale(self.optimizer) is not None or unscaled_by(self.scope.scaler)

    def _decide(self, params: list, values: list[float] | None = None) -> None:
        """Read the norms now (a host read of its own, unless ``values`` are the CPU norms already
        looked at) and skip or raise when one is non-finite."""
        rt, scope, stats = self.rt, self.scope, self.stats
        assert rt.forensics is not None  # (added at configure)
        bad = False
        if stats is not None:
            if values is None:
                values = readout.read(stats.norms)
            self.values = values
            bad = not all(map(math.isfinite, values))
        local_bad = bad
        if rt.identity.distributed and rt.guard is not GuardPolicy.WARN:
            try:  # every rank takes the same decision in the same step: one all_reduce(MAX)
                bad = agree_any(bad)
            except Exception as exc:
                rt.errors.report("distributed", exc)
        if not bad or self._left_to_scaler():
            return
        report = None
        if not local_bad:
            self.peer_nonfinite = True
        else:
            try:  # localise before anything changes: the parameters are still those the step saw
                report = rt.forensics.replay_now(scope, params_updated=False)
            except Exception as exc:
                rt.errors.report("forensics", exc)
        if rt.identity.distributed and rt.guard is not GuardPolicy.WARN:
            try:  # every rank is here (the flag was agreed): each learns where the value was born
                report = rt.forensics.share_origin(scope, report)
            except Exception as exc:
                rt.errors.report("distributed", exc)
        if rt.guard is GuardPolicy.SKIP:
            # Cleared when the update begins (drop_skipped), not here: a clip call inside the
            # step measures first and must still return the true norm.
            self._skip_params = params
            self.skipped = True
        elif rt.guard is GuardPolicy.RAISE:
            where = "" if local_bad else " on another rank"
            error = NonFiniteError(f"non-finite gradients{where} at step {scope.step} of {scope.name}",
                                   step=scope.step, kinds=["nonfinite_grad"], report=report)
            scope.raised = error
            raise error
