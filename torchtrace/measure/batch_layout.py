"""How a model consumes its batch: whether its input is time-major (``(seq, batch, ...)``,
PyTorch's default for recurrent layers and ``nn.Transformer``) and whether integer input is
token ids (it holds an embedding). :func:`torchtrace.measure.batch.infer_batch` reads a
plain tensor batch through it when it knows the step's model.

The batch dimension is told from the modules that consume sequences: ``nn.LSTM``,
``nn.GRU``, ``nn.RNN`` and ``nn.MultiheadAttention`` (inside ``nn.Transformer`` and its
encoder and decoder layers). All ``batch_first=False``: time-major. Some of each: it cannot be
told, and a warning says so once per model (samples are then the first dimension). A model
that transposes its input itself before a time-major module (takes ``(batch, seq)`` and
feeds ``(seq, batch)``) is read as time-major all the same: give
``step.record_batch(samples=...)`` for it. Images (a tensor of four dimensions or more) are
no sequence module's input: their first dimension is the batch whatever the model does.

It also holds what the batch rules and the FLOP key share: how deep and wide they look, the
first tensor of a batch, an array's shape, a dataclass batch's fields.
"""

from __future__ import annotations

import dataclasses
import numbers
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, TypeGuard

import torch

from torchtrace.errors import get_logger

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

logger = get_logger(__name__)

#: How deep the batch rules look into nested tuples, lists and mappings.
MAX_DEPTH = 3
#: How many elements of one container the rules look at before giving up (a list of
#: ten thousand strings must not cost ten thousand checks every step).
MAX_ITEMS = 16
#: Arguments that are never a batch.
SKIP = (torch.nn.Module, torch.optim.Optimizer, str, bytes, bytearray, int, float, complex, bool, type(None))


@dataclass(frozen=True)
class SequenceLayout:
    """How a model consumes its input: ``time_major`` (``(seq, batch, ...)``: every sequence
    module takes ``batch_first=False``), ``ambiguous`` (they disagree: the batch dimension
    cannot be told), ``embeds`` (it holds an ``nn.Embedding``: integer input is token ids)."""

    time_major: bool = False
    ambiguous: bool = False
    embeds: bool = False


_SEQUENCE_MODULES = (torch.nn.RNNBase, torch.nn.MultiheadAttention)
_EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)
_layouts: "weakref.WeakKeyDictionary[torch.nn.Module, SequenceLayout]" = weakref.WeakKeyDictionary()
_MAX_MODULES = 100_000  # modules looked at per model (once per model)


def sequence_layout(model: torch.nn.Module) -> SequenceLayout:
    """The layout ``model`` reads its input in, from its modules (looked at once per model):
    see :class:`SequenceLayout`.

    >>> sequence_layout(torch.nn.TransformerEncoderLayer(8, 2))
    SequenceLayout(time_major=True, ambiguous=False, embeds=False)
    >>> sequence_layout(torch.nn.LSTM(8, 8, batch_first=True)).time_major
    False
    """
    known = _layouts.get(model)
    if known is not None:
        return known
    firsts: set[bool] = set()
    embeds = False
    for index, module in enumerate(model.modules()):
        if index >= _MAX_MODULES:
            break
        if isinstance(module, _SEQUENCE_MODULES):
            firsts.add(bool(getattr(module, "batch_first", False)))
        elif isinstance(module, _EMBEDDINGS):
            embeds = True
    layout = SequenceLayout(time_major=firsts == {False}, ambiguous=len(firsts) > 1, embeds=embeds)
    try:
        _layouts[model] = layout
    except TypeError:  # a model without weak references: looked at again next time
        pass
    if layout.ambiguous:
        logger.warning("torchtrace: %s holds sequence modules with batch_first=True and batch_first=False: the "
                       "batch dimension of its input cannot be told; samples are read from the first dimension "
                       "(give step.record_batch(samples=...) if that is the sequence)", type(model).__name__)
    return layout


def as_consumed(tensor: torch.Tensor, model: torch.nn.Module) -> tuple[int, int | None]:
    """``(samples, tokens)`` of a batch whose first tensor, of two or more dimensions, is
    ``tensor``, read as ``model`` consumes it: the second dimension for a time-major model, and
    every element a token when it is integer and the model embeds.

    Time-major is read only from a tensor a sequence module can take: token ids ``(seq,
    batch)`` or features ``(seq, batch, dim)``. Images (four dimensions and more) that the model
    turns into a sequence itself (a CRNN's columns, a vision transformer's patches) keep their
    first dimension.

    >>> rnn_lm = torch.nn.ModuleList([torch.nn.Embedding(50, 8), torch.nn.LSTM(8, 8)])
    >>> as_consumed(torch.zeros(35, 20, dtype=torch.long), rnn_lm)
    (20, 700)
    >>> as_consumed(torch.zeros(32, 1, 28, 100), rnn_lm)[0]
    32
    """
    layout = sequence_layout(model)
    samples, tokens = int(tensor.size(0)), None
    if layout.time_major and not tensor.is_nested and tensor.dim() <= 3:
        samples = int(tensor.size(1))
    if layout.embeds and not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool):
        tokens = int(tensor.numel())
    return samples, tokens


def first_tensor(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The first tensor with dimensions of a step's arguments, looking into tuples, lists,
    mappings and dataclasses as the rules do (None when there is none).

    >>> first_tensor(((torch.zeros(3, 2), torch.zeros(3)),), {}).shape
    torch.Size([3, 2])
    """
    for value in (*args[:MAX_ITEMS], *list(kwargs.values())[:MAX_ITEMS]):
        found = _first_tensor(value, 0)
        if found is not None:
            return found
    return None


def _first_tensor(value: object, depth: int) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.dim() > 0 else None
    if isinstance(value, SKIP) or depth >= MAX_DEPTH:
        return None
    if isinstance(value, Mapping):
        items = list(value.values())[:MAX_ITEMS]
    elif isinstance(value, (tuple, list)):
        items = list(value[:MAX_ITEMS])
    elif is_dataclass_instance(value):
        items = dataclass_values(value, MAX_ITEMS)
        if holds_model(items):
            return None
    else:
        return None
    for item in items:
        found = _first_tensor(item, depth + 1)
        if found is not None:
            return found
    return None


_ARRAY_MODULES = frozenset({"numpy", "pandas", "cupy", "jax", "jaxlib"})


def array_shape(value: object) -> tuple[int, ...] | None:
    """The shape of an array of another library (a NumPy array, a pandas frame: a ``shape``
    tuple of integers on an object of those libraries); None for anything else, such as a
    settings object with a ``shape`` of its own. Reading it never raises.

    >>> import numpy as np
    >>> array_shape(np.zeros((3, 2))), array_shape(np.float32(1.0)), array_shape("text")
    ((3, 2), (), None)
    """
    if type(value).__module__.partition(".")[0] not in _ARRAY_MODULES:
        return None
    try:
        shape = getattr(value, "shape", None)
    except Exception:  # a property that raises
        return None
    if type(shape) is not tuple or not all(type(d) is int or isinstance(d, numbers.Integral) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def holds_model(values: list[Any]) -> bool:
    """True when an object's fields hold a model or an optimizer: a trainer, not a batch (its
    other fields, a list of past losses say, may change every step)."""
    return any(isinstance(v, (torch.nn.Module, torch.optim.Optimizer)) for v in values)


def is_dataclass_instance(value: object) -> TypeGuard[DataclassInstance]:
    """True for an instance of a dataclass (not the class itself)."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def dataclass_values(value: DataclassInstance, limit: int) -> list[Any]:
    """The first ``limit`` field values of a dataclass instance, in field order."""
    return [getattr(value, f.name, None) for f in dataclasses.fields(value)[:limit]]


__all__ = ["MAX_DEPTH", "MAX_ITEMS", "SKIP", "SequenceLayout", "array_shape", "as_consumed", "dataclass_values",
           "first_tensor", "holds_model", "is_dataclass_instance", "sequence_layout"]
