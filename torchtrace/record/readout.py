"""The one place torchtrace copies device values to the host, and the step's read, planned.

Every host read torchtrace makes goes through :func:`read` or :func:`start`; they count them so
a test can prove there is at most one per recorded step. A read of a CUDA tensor can be
*started* without waiting (:func:`start`: a non-blocking copy into pinned memory plus an
event) and *finished* later (:meth:`Pending.result`), by which time the device has long moved
on.

A step's device values (the loss, the gradient norms, parameter norms, a probe's statistics,
a token count) are gathered by a :class:`ReadPlan` into that one read.
"""

from __future__ import annotations

import threading
from typing import Any, Hashable

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


class ReadPlan:
    """The step's one host read, planned: device values gathered into one vector, with named
    slots. A slot's key is any hashable owner (a name, a probe object).

    Every device value the step needs on the host is added as a slot; :meth:`start`
    concatenates them (one ``cat``, which promotes to the widest dtype: a slot whose values
    need float64 adds them as float64) and starts the copy (:func:`start`); once the values
    are on the host, :meth:`take` hands each owner its slice.

    >>> plan = ReadPlan()
    >>> plan.add("loss", torch.tensor([0.5], dtype=torch.float64))
    >>> plan.add("norms", torch.tensor([3.0, 4.0]))
    >>> values = plan.start().result()
    >>> plan.take("norms", values)
    [3.0, 4.0]
    """

    __slots__ = ("_pieces", "_slots", "_size", "home", "_labels")

    def __init__(self) -> None:
        self._pieces: list[torch.Tensor] = []
        self._slots: dict[Hashable, tuple[int, int]] = {}
        self._size = 0
        self.home: torch.device | None = None  # the first piece's device: the others are moved there
        self._labels: dict[Hashable, Any] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def add(self, key: Hashable, tensor: torch.Tensor, label: object = None) -> None:
        """Add ``tensor`` (any shape; flattened) under ``key``; ``label`` travels with it (the
        names of the values, say). No host read happens here."""
        if label is not None:
            self._labels[key] = label
        flat = tensor.detach() if tensor.requires_grad else tensor
        if flat.dim() != 1:
            flat = flat.reshape(-1)
        if flat.device.type == "meta":  # a model on the meta device has no values to read
            return
        if self.home is None:
            self.home = flat.device
        elif flat.device != self.home:
            flat = flat.to(self.home, non_blocking=True)
        n = flat.numel()
        self._slots[key] = (self._size, n)
        self._pieces.append(flat)
        self._size += n

    def start(self) -> Pending | None:
        """Start the copy of every slot (one host read); None when there is nothing to read."""
        pieces = self._pieces
        if not pieces:
            return None
        # One cat promotes to the widest dtype; float32 values read as exact Python floats, so
        # nothing is converted on the device (a slot that needs float64 adds it as float64).
        vec = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        self._pieces = []  # keep no device tensor alive past the copy
        return start(vec)

    def take(self, key: Hashable, values: list[float] | None) -> list[float] | None:
        """The host values of ``key``'s slot; None when the slot is absent or nothing was read."""
        where = self._slots.get(key)
        if where is None or values is None:
            return None
        start, n = where
        return values[start:start + n]

    def label(self, key: Hashable) -> Any:
        """What was added with ``key``'s slot as its ``label``, or None."""
        return self._labels.get(key)

    def first(self, key: Hashable, values: list[float] | None) -> float | None:
        """The first value of ``key``'s slot, or None."""
        where = self._slots.get(key)
        if where is None or values is None:
            return None
        return values[where[0]]
