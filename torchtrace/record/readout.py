"""The one place torchtrace copies device values to the host.

Every host read torchtrace makes goes through :func:`read`; it counts them so a test can
prove there is at most one per recorded step. A read of a CUDA tensor can be *started*
without waiting (:func:`start`: a non-blocking copy into pinned memory plus an event) and
*finished* later (:meth:`Pending.result`), by which time the device has long moved on.
"""

from __future__ import annotations

import threading

import torch

from torchtrace.record import events

_lock = threading.Lock()
_reads = 0
_cpu_peeks = 0


def reads() -> int:
    """How many host reads torchtrace has made in this process."""
    return _reads


def _count() -> None:
    global _reads
    with _lock:
        _reads += 1


class Pending:
    """A host copy of a 1-D tensor that may still be in flight."""

    __slots__ = ("_host", "_event")

    def __init__(self, host: torch.Tensor, event: "torch.cuda.Event | None") -> None:
        self._host = host
        self._event = event

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> list[float]:
        """The values as Python floats, waiting for the copy if it has not landed yet."""
        event = self._event
        if event is not None:
            if not event.query():  # a landed copy needs no (sync-debug-visible) wait
                event.synchronize()
            self._event = None
            events.LANDED.give_back(event)
        return self._host.tolist()


def start(values: torch.Tensor) -> Pending:
    """Begin copying ``values`` (1-D) to the host; counts as the step's one host read."""
    _count()
    values = values.detach()
    if values.device.type == "cuda":
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        return Pending(host, events.LANDED.recorded())
    if values.device.type != "cpu":
        return Pending(values.cpu(), None)
    return Pending(values, None)


def cpu_peeks() -> int:
    """How many times torchtrace looked at values already in host memory (:func:`peek_cpu`)."""
    return _cpu_peeks


def peek_cpu(values: torch.Tensor) -> list[float]:
    """The values of a CPU tensor: no copy and nothing to synchronise with, so not a host read.

    Used where a decision is worth making early only because it is free (CPU gradients).

    Raises:
        ValueError: the tensor is not on the CPU; device values must go through :func:`read`.
    """
    global _cpu_peeks
    if values.device.type != "cpu":
        raise ValueError(f"peek_cpu() takes CPU tensors only, not {values.device}; use read()")
    with _lock:
        _cpu_peeks += 1
    return values.detach().tolist()


def read(values: torch.Tensor) -> list[float]:
    """Copy ``values`` (1-D) to the host now and return them as floats."""
    return start(values).result()
