"""Bytes of activations kept alive for backward, counted with ``saved_tensors_hooks``.

On CPU there is no allocator counter, so the activation memory of a forward pass is
measured as the bytes of the distinct storages autograd saves for backward while the
meter is active. Parameter storages (a Linear saves its weight) are excluded: they are
alive anyway. A storage saved twice (the output of one layer is the input of the next) is
counted once, at its full size. Activation checkpointing shows up honestly: the inputs a
checkpoint keeps for its recomputation are saved through the outer hooks and counted.
"""

from __future__ import annotations

from typing import Iterable

import torch


class SavedTensorMeter:
    """Count the distinct non-parameter storages saved for backward inside ``with``.

    >>> lin = torch.nn.Linear(4, 4)
    >>> with SavedTensorMeter(lin.parameters()) as meter:
    ...     y = torch.tanh(lin(torch.randn(2, 4)))
    >>> meter.bytes  # the input (2x4) and tanh's output (2x4), float32
    64
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {_storage_key(t) for t in exclude}
        self._seen: set[tuple[int, int]] = set()
        self.bytes = 0
        self.tensors = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._exclude and key not in self._seen:
            self._seen.add(key)
            self.bytes += int(tensor.untyped_storage().nbytes())
            self.tensors += 1
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> "SavedTensorMeter":
        hooks = self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(*exc)


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    try:
        storage = tensor.untyped_storage()
        return (storage.data_ptr(), int(storage.nbytes()))
    except (RuntimeError, NotImplementedError):  # tensors without storage (fake, sparse)
        return (id(tensor), 0)
