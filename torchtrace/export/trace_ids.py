"""One trace per step across ranks: a trace id every rank derives for (run, operation, step)."""

from __future__ import annotations

import contextvars
import hashlib

from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

_forced_trace_id: contextvars.ContextVar[int] = contextvars.ContextVar("torchtrace_trace_id", default=0)


def step_trace_id(run_id: str, operation: str, step: int) -> int:
    """The 128-bit trace id every rank derives for (run, operation, step)."""
    digest = hashlib.sha256(f"{run_id}\x00{operation}\x00{step}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1


class StepTraceIdGenerator(RandomIdGenerator):
    """An OTel IdGenerator: random ids, except a root step span's trace id is derived from
    (run id, operation, step), so all ranks' spans of one step share one trace."""

    def generate_trace_id(self) -> int:
        return _forced_trace_id.get() or super().generate_trace_id()

    def is_trace_id_random(self) -> bool:
        # A derived id is not random in the W3C sense (trace-flags "random" bit).
        return not _forced_trace_id.get()


class _StepTrace:
    __slots__ = ("_value", "_token")

    def __init__(self, value: int) -> None:
        self._value = value
        self._token = None

    def __enter__(self) -> None:
        if self._value:
            self._token = _forced_trace_id.set(self._value)

    def __exit__(self, *exc) -> None:
        if self._token is not None:
            _forced_trace_id.reset(self._token)


_NO_TRACE = _StepTrace(0)


def step_trace(enabled: bool, run_id: str, operation: str, step: int) -> _StepTrace:
    """Context around the step span's creation: forces the shared trace id when enabled."""
    if not enabled:
        return _NO_TRACE
    return _StepTrace(step_trace_id(run_id, operation, step))
