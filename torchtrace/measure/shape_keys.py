"""Shape keys: what of a step's arguments decides its FLOPs, as a hashable key.

A step's FLOPs are counted once per key (:mod:`torchtrace.measure.flops`). The key holds the
shapes and dtypes of the tensors among the arguments, never their values, so that a step
index or a learning rate does not make every step new.
"""

from __future__ import annotations

import dataclasses
from operator import attrgetter
from typing import Any, Hashable, Mapping, TypeGuard, Union

import torch

from torchtrace.measure.batch_layout import array_shape, dataclass_values, holds_model, is_dataclass_instance

#: How deep and how wide :func:`shape_key` looks into nested arguments.
KEY_MAX_DEPTH = 3
KEY_MAX_ITEMS = 32


# A shape key's part: hashable values, and classes (which mypy does not take for Hashable).
Key = Union[Hashable, type]


def shape_key(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Key, ...]:
    """A hashable key of the shapes and dtypes of the tensors in a step's arguments.

    Values never enter the key (an integer step index does not make every step new); models
    and optimizers are skipped. Cheap enough for every step: a few microseconds for a
    batch of a handful of tensors.

    >>> import torch
    >>> shape_key((torch.zeros(4, 3), 7), {"mask": torch.ones(4, 3, dtype=torch.bool)})
    ((torch.Size([4, 3]), torch.float32), <class 'int'>, ('mask', (torch.Size([4, 3]), torch.bool)))
    >>> shape_key((torch.zeros(4, 3), 8), {}) == shape_key((torch.ones(4, 3), 9), {})
    True
    """
    out: tuple = ()  # grown a key at a time (no list to turn into a tuple): at most KEY_MAX_ITEMS of them
    try:
        # Every step pays for this: plain tensors, models and optimizers met before, and tuples
        # and lists of plain tensors are keyed here in C, without a Python call per value;
        # everything else goes through _key.
        for value in args[_FIRST_ITEMS]:
            kind = type(value)
            if kind is _TENSOR:
                out += (_SHAPE_DTYPE(value),)
            elif kind in _KEYED_BY_TYPE:  # the model, the optimizer
                out += (kind,)
            elif (kind is tuple or kind is list) and len(value) <= KEY_MAX_ITEMS:
                if _ALL_TENSORS(map(type, value)):
                    out += (tuple(map(_SHAPE_DTYPE, value)),)
                else:
                    out += (tuple([(v.shape, v.dtype) if type(v) is _TENSOR else _key(v, 1) for v in value]),)
            else:
                out += (_key(value, 0),)
    except RuntimeError:  # a nested tensor of the strided layout has no sizes: the careful way
        out = tuple([_key(value, 0) for value in args[:KEY_MAX_ITEMS]])
    if kwargs:
        for index, (name, value) in enumerate(kwargs.items()):
            if index >= KEY_MAX_ITEMS:
                break
            out += ((name, _key(value, 0)),)
    return out


def loose_shape_key(args: tuple[Any, ...], kwargs: Mapping[str, Any], loose: frozenset[int]) -> tuple[Key, ...]:
    """:func:`shape_key` with the entries at the ``loose`` positions (keyword arguments
    numbered after the positional ones) as :data:`LOOSE`, their values not looked at: an
    argument that grows every step (see :class:`torchtrace.measure.flops.StepFlops`) costs
    nothing to key.

    >>> loose_shape_key((torch.zeros(4, 3), [1.0, 2.0]), {}, frozenset({1}))
    ((torch.Size([4, 3]), torch.float32), loose)
    """
    args = tuple([None if i in loose else v for i, v in enumerate(args[:KEY_MAX_ITEMS])])
    if kwargs:
        width = len(args)
        kwargs = {k: None if width + i in loose else v for i, (k, v) in enumerate(kwargs.items())}
    return tuple([LOOSE if i in loose else k for i, k in enumerate(shape_key(args, kwargs))])


_TENSOR = torch.Tensor
_SHAPE_DTYPE = attrgetter("shape", "dtype")  # a plain tensor's key, (shape, dtype), in one call in C
_ALL_TENSORS = frozenset({_TENSOR}).issuperset  # of the items' types: every item a plain tensor
_FIRST_ITEMS = slice(KEY_MAX_ITEMS)
# Classes of models and optimizers met among steps' arguments: their key is their class, found
# without a call when the next step passes them again.
_KEYED_BY_TYPE: set[type] = set()


class _Nested:
    """Stands for a nested tensor in a shape key (with its dtype, dimensions and number of
    components). ``FlopCounterMode`` fails on nested tensors' ops (torch 2.13, both layouts):
    a step with one among its inputs is not counted (:func:`countable`)."""

    def __repr__(self) -> str:
        return "nested"


NESTED = _Nested()


def _nested_key(value: torch.Tensor) -> Key:
    return (NESTED, value.dtype, value.dim(), value.size(0))


def countable(key: Key) -> bool:
    """False when the key holds a nested tensor (see :data:`NESTED`): its step is not counted.

    >>> import torch
    >>> countable(shape_key((torch.zeros(2, 3),), {}))
    True
    >>> countable(shape_key(([torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)],), {}))
    False
    """
    if key is NESTED:
        return False
    return all(countable(k) for k in key) if isinstance(key, tuple) else True


def _key(value: Any, depth: int) -> Key:
    kind = type(value)
    if kind is _TENSOR:  # the usual batch, checked first by identity: every step pays for this
        try:
            return (value.shape, value.dtype)
        except RuntimeError:  # a nested tensor of the strided layout has no sizes
            return _nested_key(value)
    if kind is tuple or kind is list:
        return _items_key(kind, value, depth) if depth < KEY_MAX_DEPTH else kind
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
        if len(_KEYED_BY_TYPE) < 256:
            _KEYED_BY_TYPE.add(kind)
        return kind
    if isinstance(value, _TENSOR):  # a Parameter, a tensor subclass
        return _nested_key(value) if value.is_nested else (value.shape, value.dtype)
    if depth >= KEY_MAX_DEPTH:
        return kind
    if isinstance(value, Mapping):
        return tuple((k if isinstance(k, Hashable) else type(k), _key(v, depth + 1))
                     for k, v in list(value.items())[:KEY_MAX_ITEMS])
    if isinstance(value, (tuple, list)):
        return _items_key(kind, value, depth)
    if is_dataclass_instance(value):  # a batch object of fields: its tensors' shapes, like a tuple's
        items = dataclass_values(value, KEY_MAX_ITEMS)
        if holds_model(items):
            return kind  # a trainer, not a batch
        return (kind, tuple([_key(v, depth + 1) for v in items]))
    shape = array_shape(value)
    if shape is not None:  # a NumPy array (or another array with a shape): its shape and dtype
        return (kind, shape, str(getattr(value, "dtype", "")))
    return type(value)


def _items_key(kind: type, value: Any, depth: int) -> Key:
    """A sequence's key: its first ``KEY_MAX_ITEMS`` items' keys, and past that many, its type
    and length too (a list of 40 same-size images is not a list of 64)."""
    items = tuple([_key(v, depth + 1) for v in value[:KEY_MAX_ITEMS]])
    return items if len(value) <= KEY_MAX_ITEMS else (kind, len(value), items)


def truncated(key: Key) -> bool:
    """True when ``key`` left out part of the arguments: a sequence, mapping or dataclass
    deeper than :data:`KEY_MAX_DEPTH` (keyed by its type alone), or a sequence past
    :data:`KEY_MAX_ITEMS` items (keyed by its first ones). What is inferred from the whole
    batch (its samples) is then not the key's to keep: two batches of one key may differ in it.

    >>> truncated(shape_key(([torch.zeros(2)] * 40,), {})), truncated(shape_key(([torch.zeros(2)] * 4,), {}))
    (True, False)
    >>> truncated(shape_key(({"a": {"b": [(torch.zeros(2), torch.zeros(2))]}},), {}))
    True
    """
    if isinstance(key, type):
        return issubclass(key, (list, tuple, Mapping)) or dataclasses.is_dataclass(key)
    if type(key) is not tuple:
        return False
    if len(key) == 3 and key[0] in (list, tuple) and type(key[1]) is int and type(key[2]) is tuple:
        return True  # (type, length, the first items' keys): past KEY_MAX_ITEMS
    return any(truncated(k) for k in key)


class _Loose:
    """Stands in a FLOP key for an argument that does not decide the operation's FLOPs."""

    def __repr__(self) -> str:
        return "loose"


LOOSE = _Loose()


def grown(a: Key, b: Key) -> bool:
    """True when ``a`` and ``b`` key one sequence at two lengths, the shorter's items the
    first of the longer's (a list the step appends to); a keyword argument's keys hold its
    name first. So does a 1-d tensor of another length. Other tensors' shapes never count
    as grown: an image of 64 x 32 and one of 32 x 64 cost the same FLOPs, and a third size
    would not.

    >>> grown(shape_key(([1.0],), {})[0], shape_key(([1.0, 2.0],), {})[0])
    True
    >>> grown(shape_key((torch.zeros(64, 32),), {})[0], shape_key((torch.zeros(32, 64),), {})[0])
    False
    """
    if type(a) is tuple and type(b) is tuple and len(a) == 2 == len(b) and type(a[0]) is str:
        if a[0] != b[0]:
            return False
        a, b = a[1], b[1]
    if _vector(a) and _vector(b):  # a 1-d tensor the step grows (torch.cat of its losses)
        return a[1] == b[1] and a[0] != b[0]
    one, two = _sequence(a), _sequence(b)
    if one is None or two is None or one[1] == two[1]:
        return False
    (short, _), (long, _) = sorted((one, two), key=lambda seq: seq[1])
    return long[:len(short)] == short


def _vector(key: Key) -> TypeGuard[tuple[torch.Size, torch.dtype]]:
    """True for the key of a 1-d tensor: ``(torch.Size([n]), dtype)``."""
    return type(key) is tuple and len(key) == 2 and isinstance(key[0], torch.Size) and len(key[0]) == 1


def _sequence(key: Key) -> tuple[tuple, int] | None:
    """``(the first items' keys, the length)`` of a list's or tuple's key; None for any other."""
    if type(key) is not tuple or (key and isinstance(key[0], torch.Size)):
        return None  # not a sequence's key, or a tensor's
    if len(key) == 3 and key[0] in (list, tuple) and type(key[1]) is int and type(key[2]) is tuple:
        return key[2], key[1]  # past KEY_MAX_ITEMS items: (type, length, the first items' keys)
    if key and all(type(item) is tuple and len(item) == 2 and not isinstance(item[0], (type, tuple)) for item in key):
        return None  # a mapping's key, (name, value's key) pairs: a batch that gained a field
    return key, len(key)
