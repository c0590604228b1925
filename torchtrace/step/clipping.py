"""Gradient clipping inside a step is measured first: the recorded norm is the one before clipping.

``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_`` and ``clip_grads_with_norm_`` (the
scaling half of a clip whose total norm the caller took with ``get_total_norm``, torchtitan's
way) are wrapped at ``configure()`` and put back at ``shutdown()``: inside an open step the
wrapper lets the step measure (and guard) the gradients as backward left them, then clips.
Outside a step it only reads a context variable. Without it the optimizer hook would see
clipped gradients and an explosion would read as ``max_norm``. A function bound by name
before ``configure()`` (``from torch.nn.utils import clip_grad_norm_``) is not reached
(documented).

``clip_grad_norm_`` (and the deprecated ``clip_grad_norm``, which calls it) does not read the
gradients a second time: the total norm comes from the per-tensor norms the step has just
measured (:func:`torchtrace.measure.clip_norm.total_norm`, the same bits as torch's), and
torch's own ``clip_grads_with_norm_`` scales the gradients with it. It falls back to torch's
whole function, which reads the gradients again, where equality is not shown: ``norm_type``
other than 2, gradients on several devices, ``foreach=False`` off the CPU, parameters the
step does not watch, sparse or DTensor/FSDP2 gradients, a second clip call in the same step
(but for a clip of another network's gradients after a backward of their own, measured then:
:meth:`~torchtrace.step.gradients.GradientCheck.other_clip`), a step whose norms came out
non-finite, and ``error_if_nonfinite=True`` with a non-finite norm (torch's function then
raises its own error).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from torchtrace import current
from torchtrace.errors import NonFiniteError
from torchtrace.measure import clip_norm
from torchtrace.patches import Patches, marked
from torchtrace.step.compiled import is_compiling

if TYPE_CHECKING:
    from torchtrace.measure.gradients import GradStats
    from torchtrace.step.scope import StepScope


CLIPS = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")  # the torch.nn.utils functions wrapped


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    # Only the norm clip has a norm to reuse; clip_grad_value_ reads each gradient once anyway.
    reuses_norms = getattr(original, "__name__", "") == "clip_grad_norm_"

    @functools.wraps(original)
    def clip(*args: object, **kwargs: object) -> Any:
        if is_compiling():  # traced by torch.compile: stay out of the graph (no break)
            return original(*args, **kwargs)
        scope = current.step()
        measured: GradStats | None = None
        again = False  # measured again: another optimizer's parameters, after a backward of their own
        if scope is not None and scope.active:
            try:
                if scope.gradients is None or not scope.gradients.fired:
                    only_clipped = scope.wants_clipped()  # (under a loss scaler: what was unscaled for the clip)
                    clipped = None
                    if scope.before_clip is not None or only_clipped:
                        args, kwargs = _listed(args, kwargs)  # (a generator of parameters is read once)
                        clipped = _clipped(args, kwargs)
                        if scope.before_clip is not None:
                            scope.before_clip(clipped)
                    scope.check_gradients_now(clipped=clipped if only_clipped else None)
                    measured = _fresh_norms(scope)
                elif scope.gradients.adopted:
                    args, kwargs = _listed(args, kwargs)
                    again = scope.gradients.other_clip(_clipped(args, kwargs))
                    measured = _fresh_norms(scope) if again else None
            except NonFiniteError:
                raise  # guard="raise": the policy the user asked for
            except Exception as exc:  # torchtrace's own failure never reaches the user's clip call
                _report(exc)
        if reuses_norms and measured is not None:
            result = _clip_with_norms(original, measured, args, kwargs)
        else:
            result = original(*args, **kwargs)
        if again and scope is not None and scope.gradients is not None:
            scope.gradients.mark_again()  # the update that follows applies what the clip left
        if scope is not None and scope.active and scope.gradients is not None and scope.gradients.skipped:
            # guard="skip": the clip returned the true (non-finite) norm; the gradients stay
            # tensors, zeroed, so an update the user writes by hand changes nothing.
            scope.gradients.zero_skipped()
        return result

    return clip


def _listed(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A clip call's arguments with its ``parameters`` (the first) made a list, so that they can
    be read before the clip and again by it; an empty generator stays as it is (torch warns of
    it)."""
    if args:
        first = args[0]
        if not isinstance(first, (torch.Tensor, list, tuple)):
            listed = list(first)
            return ((listed, *args[1:]) if listed else args), kwargs
        return args, kwargs
    first = kwargs.get("parameters")
    if first is not None and not isinstance(first, (torch.Tensor, list, tuple)):
        listed = list(first)
        if listed:
            return args, {**kwargs, "parameters": listed}
    return args, kwargs


def _clipped(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The parameters a clip call (its arguments :func:`_listed`) clips."""
    first = args[0] if args else kwargs.get("parameters", [])
    if isinstance(first, torch.Tensor):
        return [first]
    return [p for p in first if isinstance(p, torch.Tensor)] if isinstance(first, (list, tuple)) else []


def _report(exc: Exception) -> None:
    rt = current.runtime(create=False)
    if rt is not None:
        rt.errors.report("gradients", exc)


def _fresh_norms(scope: StepScope) -> GradStats | None:
    """The norms the step measured just now, in this clip call, when they can stand for the
    gradients the clip is given: not when they came out non-finite (forensics may have replayed
    the step in between, and such a step is rare enough to pay for torch's own pass)."""
    check = scope.gradients
    if check is None or not check.fired or check.stats is None:
        return None
    if check.values is not None and not all(math.isfinite(v) for v in check.values):
        return None
    return check.stats


def _arguments(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
               error_if_nonfinite: bool = False, foreach: bool | None = None
               ) -> tuple[torch.Tensor | Iterable[torch.Tensor], float, float, bool, bool | None]:
    """``clip_grad_norm_``'s arguments by name (a TypeError for a call torch would refuse)."""
    return parameters, max_norm, norm_type, error_if_nonfinite, foreach


def _clip_with_norms(original: Callable[..., Any], stats: GradStats, args: tuple, kwargs: dict) -> Any:
    """``clip_grad_norm_(*args, **kwargs)`` with the total norm taken from ``stats``: torch's
    ``clip_grads_with_norm_`` scales the gradients; torch's whole function runs instead where
    the total cannot be shown to be its own (see the module docstring)."""
    try:
        parameters, max_norm, norm_type, error_if_nonfinite, foreach = _arguments(*args, **kwargs)
    except TypeError:
        return original(*args, **kwargs)  # torch's own error for a call it refuses
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not params:
        # An empty list, or an exhausted generator: torch's function warns about the latter.
        return original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    grads = [p.grad for p in params if p.grad is not None]
    try:
        # As torch's function does: no graph, even for gradients of a create_graph backward.
        with torch.no_grad():
            total = clip_norm.total_norm(stats, grads, norm_type, foreach)
    except Exception as exc:  # torchtrace's own failure: torch's function does the whole job
        _report(exc)
        total = None
    if total is None:
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
    # torch reads the same flag from the device before it clips: no added host read.
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)  # raises torch's error
    scale = torch.nn.utils.clip_grads_with_norm_  # (wrapped: measuring is done, torch's own scales)
    getattr(scale, "__wrapped__", scale)(params, max_norm, total, foreach)
    return total


def install() -> None:
    """Wrap the clip functions of ``torch.nn.utils`` (idempotent)."""
    import torch.nn.utils as nn_utils
    from torch.nn.utils import clip_grad as clip_module

    for name in CLIPS:
        existing = getattr(nn_utils, name, None)
        if existing is None or marked(existing):
            continue
        wrapped = _wrap(existing)
        _PATCHES.replace(nn_utils, name, wrapped)
        if getattr(clip_module, name, None) is existing:
            _PATCHES.replace(clip_module, name, wrapped)


def uninstall() -> None:
    """Put torch's own clip functions back where :func:`install` put the wrappers and they still
    are (idempotent; :class:`~torchtrace.patches.Patches`)."""
    _PATCHES.undo()


_PATCHES = Patches()
