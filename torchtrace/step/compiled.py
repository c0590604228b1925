"""What of a step torchtrace keeps out of ``torch.compile``.

A training script may compile the whole step function: torchtrace's ``with`` block or decorated
step inside it, or its ``optimizer.step()`` and ``clip_grad_norm_`` calls. The step's entry and
exit, and the moments its gradients are measured (the optimizer's step pre-hook, a clip call, an
optimizer the step adopts), then run inside compiled code. Traced by dynamo they would lose their
phases and FLOPs, and a forensic replay started there failed inside the trace. Marked with
:func:`outside_compiler`, the graph breaks at them and they run eagerly, with dynamo off for all
they call.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar, cast

import torch

_M = TypeVar("_M", bound=Callable[..., Any])


def outside_compiler(method: _M) -> _M:
    """``method``, never traced by ``torch.compile``.

    ``torch.compiler.disable`` imports ``torch._dynamo``: a second, so not at ``import
    torchtrace``. Until something imports it (torch does as the first optimizer is made) nothing
    can compile, and ``method`` runs as it is. The first call after that puts the disabled method
    on its class in place of this wrapper, so later calls pay for the disabled call only: 0.4 us
    in a warm loop, 1-2 us of step entry (the check on every call cost 3 us;
    benchmarks/RESULTS.md, 2026-11-29, session 23). A bound method taken before that (a hook
    registered on an optimizer) keeps the wrapper, which then calls the disabled method.
    """
    disabled: Callable[..., Any] | None = None

    @functools.wraps(method)
    def until_dynamo_loads(self: object, *args: object, **kwargs: object) -> Any:
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return method(self, *args, **kwargs)
            disabled = torch.compiler.disable(method)
            for owner in type(self).__mro__:  # the class that holds the wrapper
                if vars(owner).get(method.__name__) is until_dynamo_loads:
                    setattr(owner, method.__name__, disabled)
                    break
        return disabled(self, *args, **kwargs)

    return cast(_M, until_dynamo_loads)


def is_compiling() -> bool:
    """True while torch.compile traces the caller (a wrapper then steps aside: no graph break)."""
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(check()) if check is not None else False
