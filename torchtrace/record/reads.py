"""The step's one host read, planned: device values gathered into one vector, with named slots.

Every device value a step needs on the host (the loss, the gradient norms, parameter norms,
a probe's statistics, a token count) is added as a slot; :meth:`ReadPlan.start` concatenates
them (one ``cat``, which promotes to the widest dtype: a slot whose values need float64 adds
them as float64) and starts the copy
(:func:`torchtrace.record.readout.start`); once the values are on the host,
:meth:`ReadPlan.take` hands each owner its slice.

>>> import torch
>>> plan = ReadPlan()
>>> plan.add("loss", torch.tensor([0.5], dtype=torch.float64))
>>> plan.add("norms", torch.tensor([3.0, 4.0]))
>>> values = plan.start().result()
>>> plan.take("norms", values)
[3.0, 4.0]
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

from torchtrace.record import readout


class ReadPlan:
    """Slots of one host read. A slot's key is any hashable owner (a name, a probe object)."""

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

    def start(self) -> readout.Pending | None:
        """Start the copy of every slot (one host read); None when there is nothing to read."""
        pieces = self._pieces
        if not pieces:
            return None
        # One cat promotes to the widest dtype; float32 values read as exact Python floats, so
        # nothing is converted on the device (a slot that needs float64 adds it as float64).
        vec = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        self._pieces = []  # keep no device tensor alive past the copy
        return readout.start(vec)

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

    def first(self, key: Hashable, values: list[float] | None) -> Any:
        """The first value of ``key``'s slot, or None."""
        where = self._slots.get(key)
        if where is None or values is None:
            return None
        return values[where[0]]
