"""Gradient clipping inside a step is measured first: the recorded norm is the one before clipping.

``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` are wrapped at ``configure()`` and
put back at ``shutdown()``: inside an open step the wrapper lets the step measure (and guard) the gradients
as backward left them, then clips. Outside a step it only reads a context variable. Without
it the optimizer hook would see clipped gradients and an explosion would read as
``max_norm``. A function bound by name before ``configure()``
(``from torch.nn.utils import clip_grad_norm_``) is not reached (documented).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from torchtrace import current
from torchtrace.errors import NonFiniteError


def is_compiling() -> bool:
    """True while torch.compile traces the caller (a wrapper then steps aside: no graph break)."""
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(check()) if check is not None else False


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip(*args: Any, **kwargs: Any) -> Any:
        if is_compiling():  # traced by torch.compile: stay out of the graph (no break)
            return original(*args, **kwargs)
        scope = current.step()
        if scope is not None and scope.active and (scope.gradients is None or not scope.gradients.fired):
            try:
                scope.check_gradients_now()
            except NonFiniteError:
                raise  # guard="raise": the policy the user asked for
            except Exception as exc:  # torchtrace's own failure never reaches the user's clip call
                rt = current.runtime(create=False)
                if rt is not None:
                    rt.errors.report("gradients", exc)
        result = original(*args, **kwargs)
        if scope is not None and scope.active and scope.gradients is not None and scope.gradients.skipped:
            # guard="skip": the clip returned the true (non-finite) norm; the gradients stay
            # tensors, zeroed, so an update the user writes by hand changes nothing.
            scope.gradients.zero_skipped()
        return result

    clip.__torchtrace_wrapped__ = True  # type: ignore[attr-defined]
    return clip


def install() -> None:
    """Wrap the clip functions of ``torch.nn.utils`` (idempotent)."""
    import torch.nn.utils as nn_utils
    from torch.nn.utils import clip_grad as clip_module

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        existing = getattr(nn_utils, name, None)
        if existing is None or getattr(existing, "__torchtrace_wrapped__", False):
            continue
        wrapped = _wrap(existing)
        setattr(nn_utils, name, wrapped)
        if getattr(clip_module, name, None) is existing:
            setattr(clip_module, name, wrapped)


def uninstall() -> None:
    """Put torch's own clip functions back where :func:`install` put the wrappers (idempotent)."""
    import torch.nn.utils as nn_utils
    from torch.nn.utils import clip_grad as clip_module

    for module in (nn_utils, clip_module):
        for name in ("clip_grad_norm_", "clip_grad_value_"):
            wrapped = getattr(module, name, None)
            if getattr(wrapped, "__torchtrace_wrapped__", False):
                setattr(module, name, wrapped.__wrapped__)
