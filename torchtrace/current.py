"""The configured runtime and the open step: where every layer finds them.

``torchtrace.api.configure()`` installs the runtime here and ``StepScope`` sets the open step,
so code below the API (records, probes, forensics, tools) reaches both through this module
without importing the API: imports run one way. This module imports nothing of torchtrace.

>>> from torchtrace import current
>>> current.step() is None
True
"""

from __future__ import annotations

import contextvars
import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope

lock = threading.RLock()
"""Held while the runtime is replaced (configure, shutdown)."""

_runtime: Runtime | None = None
_disabled = False  # configured with disabled=True, or the environment said so
_auto_configure: Callable[[], Runtime | None] | None = None  # set by torchtrace.api
_step: contextvars.ContextVar[StepScope | None] = contextvars.ContextVar("torchtrace_step", default=None)


def runtime(create: bool = True) -> Runtime | None:
    """The configured runtime; on first use configures one from the environment.

    None when torchtrace is disabled, or when ``create`` is False and nothing is configured.
    """
    rt = _runtime
    if rt is not None or _disabled or not create or _auto_configure is None:
        return rt
    return _auto_configure()


def set_runtime(rt: Runtime | None) -> None:
    global _runtime, _disabled
    _runtime = rt
    if rt is not None:
        _disabled = False


def set_disabled(flag: bool) -> None:
    global _disabled
    _disabled = flag


def disabled() -> bool:
    return _disabled


def set_auto_configure(fn: Callable[[], Runtime | None]) -> None:
    """Who builds a runtime on first use (``torchtrace.api`` registers it at import)."""
    global _auto_configure
    _auto_configure = fn


# step(): the innermost open step scope of this thread or task, or None. The context
# variable's own getter (a C call): the phase marks ask it on every forward and optimizer step.
step: Callable[[], StepScope | None] = _step.get


orphan_check: Callable[[], None] | None = None
"""Set while a framework integration has a step open (its hooks open and close it, not a
``with`` block): ends this thread's open step when the training loop that opened it is no
longer running, an exception having left the loop between two hooks. Called where a step
opens inside another, and at shutdown."""


def end_orphan() -> None:
    """Run :data:`orphan_check` when one is set."""
    check = orphan_check
    if check is not None:
        check()


def enter_step(scope: StepScope) -> contextvars.Token:
    return _step.set(scope)


def leave_step(token: contextvars.Token) -> None:
    _step.reset(token)
