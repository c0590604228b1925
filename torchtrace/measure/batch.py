"""How many samples and tokens a step processed, inferred from its arguments without a host read.

Rules, in order (the first argument that gives an answer wins):

1. keyword arguments that hold ``input_ids`` are read as one mapping (``step(input_ids=...,
   attention_mask=...)``);
2. then each positional argument, then each keyword value, skipping ``nn.Module`` and
   ``Optimizer`` objects, numbers, strings, ``None`` and 0-d tensors:

   - a tensor with at least one dimension: samples = its first dimension;
   - a ``PackedSequence`` (``pack_padded_sequence``): samples = its sequences (the
     batch size of its first time step, a host value), not its time steps;
   - a time-major padded batch beside its lengths, ``(padded, lengths)`` (``(time, batch,
     ...)`` and a 1-d integer tensor of ``batch`` entries), alone or as a part of
     ``((src, src_lengths), (tgt, tgt_lengths))``: samples = the lengths' count;
   - a mapping (a ``dict`` or a transformers ``BatchEncoding``) with ``input_ids``:
     samples = ``input_ids.shape[0]`` (1 for an unbatched 1-d sequence) and tokens =
     ``input_ids.numel()``, or, with an ``attention_mask`` of the same shape, the number of
     its non-zero entries, as a 0-d device tensor. A packed row (one row of ``input_ids``
     without such a mask, several sequences end to end: transformers'
     ``DataCollatorWithFlattening``, padding-free collators, a block-diagonal 4-d mask)
     holds as many samples as sequences: ``len(cu_seq_lens_q) - 1``
     when the flash-attention boundaries are given, else the number of zeros in its
     ``position_ids`` (each sequence's positions start at 0), as a 0-d device tensor;
   - a list or tuple of two or more mappings with ``input_ids`` (micro-batches of token ids
     a step accumulates gradients over): their samples and tokens summed;
   - a list or tuple of two or more alike tuples, lists or mappings, each with at least two
     tensors that agree on their first dimension (micro-batches of ``(inputs, targets)``):
     their samples summed;
   - a list of tensors beside a list of mappings of the same length (images and their
     targets, torchvision's detection batch), or a list of alike tensors beside as many
     class labels (a 1-d integer tensor or a list of integers: images of different sizes),
     as arguments or as the items of one tuple: samples = that length;
   - a list or tuple of alike tuples, lists or mappings, each holding one tensor with
     dimensions or several beside numbers, strings, 0-d tensors or mappings (samples one by
     one with their labels or targets, ``collate_fn=lambda rows: rows``), unless every
     item's tensors share a first dimension (micro-batches): samples = their number;
   - any other mapping, tuple or list, or a dataclass instance: the rules applied to its
     values (a dataclass's fields, in order), first answer wins (``(inputs, labels)``
     batches, ``{"x": ..., "y": ...}`` batches, ``Batch(inputs=..., targets=...)``); a
     dataclass holding an ``nn.Module`` or ``Optimizer`` is a trainer, not a batch: skipped.

Given the step's model, a plain tensor batch is read as it consumes it (token ids fed to an
embedding, a time-major layout: :mod:`torchtrace.measure.batch_layout`).

Only shapes are read, which the host already knows. The masked token count is a device
tensor (``torch.count_nonzero(mask)``): it is read to the host with the rest of the step's
values, in the step's one read (:mod:`torchtrace.record.readout`), never here.

>>> import torch
>>> infer_batch((torch.zeros(32, 10), torch.zeros(32)), {})
BatchSize(samples=32, tokens=None)
>>> ids = torch.ones(2, 5, dtype=torch.long)
>>> mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
>>> size = infer_batch(({"input_ids": ids, "attention_mask": mask},), {})
>>> size.samples, int(size.tokens)
(2, 8)
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from torchtrace.measure.batch_layout import (
    MAX_DEPTH,
    MAX_ITEMS,
    SKIP,
    array_shape,
    as_consumed,
    dataclass_values,
    first_tensor,
    holds_model,
    is_dataclass_instance,
)

#: How many micro-batches (tokenizer outputs in one list) are summed; a longer list reads as its first.
MAX_MICRO_BATCHES = 64
#: Keys of a mapping batch that hold the token ids and the padding mask.
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"  # a packed row's: each sequence's positions start at 0

_NUMBER = numbers.Number
_PACKED: type[torch.nn.utils.rnn.PackedSequence] = torch.nn.utils.rnn.PackedSequence


@dataclass(frozen=True)
class BatchSize:
    """Samples and tokens of one step.

    ``tokens`` is an ``int`` when the host knows it (a shape), a 0-d integer device tensor
    when it is a count over an attention mask (read later, with the step's one host read),
    or ``None`` when the batch says nothing about tokens. ``samples`` likewise: a device
    tensor for a packed row whose sequences are counted from its position ids.

    >>> BatchSize(8, 1024).with_overrides(tokens=1000)
    BatchSize(samples=8, tokens=1000)
    """

    samples: int | torch.Tensor | None = None
    tokens: int | torch.Tensor | None = None

    @property
    def pending(self) -> bool:
        """True when ``samples`` or ``tokens`` is a device tensor still to be read to the host."""
        return isinstance(self.tokens, torch.Tensor) or isinstance(self.samples, torch.Tensor)

    def with_overrides(self, samples: int | None = None, tokens: int | None = None) -> "BatchSize":
        """This size with the values the user gave (``StepScope.record_batch``) in place of inferred ones."""
        changes: dict[str, Any] = {}
        if samples is not None:
            changes["samples"] = samples
        if tokens is not None:
            changes["tokens"] = tokens
        return dataclasses.replace(self, **changes) if changes else self


NOTHING = BatchSize()


def infer_batch(args: tuple[Any, ...], kwargs: Mapping[str, Any], model: torch.nn.Module | None = None) -> BatchSize:
    """Samples and tokens of a step called as ``fn(*args, **kwargs)``; see the module's rules.
    ``model``: the model that consumes the batch, which tells token ids and a time-major
    layout (:func:`~torchtrace.measure.batch_layout.sequence_layout`).

    Never reads a device value and never raises for an unusual batch: what it cannot read
    gives ``BatchSize(None, None)``.

    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> infer_batch((model, torch.zeros(16, 4)), {"step": 3})
    BatchSize(samples=16, tokens=None)
    >>> lstm = torch.nn.LSTM(8, 8)  # batch_first=False: (seq, batch, features)
    >>> infer_batch((torch.zeros(35, 20, 8),), {}, model=lstm)
    BatchSize(samples=20, tokens=None)
    """
    found = _infer_batch(args, kwargs)
    if model is None or found.tokens is not None or found.samples is None:
        return found
    tensor = first_tensor(args, kwargs)
    if tensor is None or isinstance(found.samples, torch.Tensor) or tensor.dim() < 2 \
            or found.samples != int(tensor.size(0)):
        return found  # not the plain tensor rule's answer (the first tensor's first dimension)
    try:
        samples, tokens = as_consumed(tensor, model)
    except Exception:  # a model whose modules() raises: the plain reading stands
        return found
    return BatchSize(samples=samples, tokens=tokens)


def _infer_batch(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> BatchSize:
    try:
        if INPUT_IDS in kwargs:
            found = _from_mapping(kwargs, 0)
            if found is not None:
                return found
        found = _per_sample(args)
        if found is not None:
            return found
        for value in args:
            found = _infer(value, 0)
            if found is not None:
                return found
        for value in kwargs.values():
            found = _infer(value, 0)
            if found is not None:
                return found
    except Exception:  # a tensor whose shape cannot be read, a mapping whose lookups raise
        pass
    return NOTHING


def _infer(value: Any, depth: int) -> BatchSize | None:
    if isinstance(value, torch.Tensor):  # size(0): a nested tensor's number of components too
        return BatchSize(samples=int(value.size(0))) if value.dim() > 0 else None
    if isinstance(value, _PACKED):  # its first time step holds every sequence (batch_sizes is on the host)
        return BatchSize(samples=int(value.batch_sizes[0])) if value.batch_sizes.numel() else None
    if isinstance(value, SKIP) or depth >= MAX_DEPTH:
        return None
    if isinstance(value, Mapping):
        return _from_mapping(value, depth)
    if isinstance(value, (tuple, list)):
        found = _time_major_with_lengths(value)
        if found is None and not any(isinstance(item, (tuple, list)) and _time_major_with_lengths(item)
                                     for item in value[:MAX_ITEMS]):  # (parts of one seq2seq batch)
            found = _per_sample(value)
            if found is None:
                found = _micro_batches(value, depth)
            if found is None:
                found = _tensor_micro_batches(value)
            if found is None:
                found = _sample_items(value)
        if found is not None:
            return found
        for item in value[:MAX_ITEMS]:
            found = _infer(item, depth + 1)
            if found is not None:
                return found
    elif is_dataclass_instance(value):
        items = dataclass_values(value, MAX_ITEMS)
        if holds_model(items):
            return None  # a trainer, not a batch
        for item in items:
            found = _infer(item, depth + 1)
            if found is not None:
                return found
    elif (shape := array_shape(value)) is not None:  # a NumPy array, a DataFrame: its first dimension
        return BatchSize(samples=shape[0]) if shape else None
    return None


def _per_sample(items: Any) -> BatchSize | None:
    """Samples given one by one beside their targets: a list of tensors beside a list of
    mappings of the same length (torchvision's detection models take ``model(images,
    targets)``, and its reference collate makes ``(images, targets)`` batches), or a list of
    alike tensors beside class labels as long (a 1-d integer tensor or a list of integers:
    images of different sizes). Samples = that length; read by the first tensor, it was the
    first image's channels. (Float values beside a list, loss weights, say nothing of it.)"""
    lists = [v for v in items[:MAX_ITEMS] if type(v) in (list, tuple) and v]
    for images in lists:
        if all(isinstance(t, torch.Tensor) for t in images[:MAX_ITEMS]):
            n = len(images)
            if any(len(targets) == n and all(isinstance(m, Mapping) for m in targets[:MAX_ITEMS]) for targets in lists):
                return BatchSize(samples=n)
            if len({(t.dim(), t.dtype) for t in images[:MAX_ITEMS]}) == 1 and any(
                    _labels(v, n) for v in items[:MAX_ITEMS] if v is not images):
                return BatchSize(samples=n)
    return None


def _time_major_with_lengths(items: tuple | list) -> BatchSize | None:
    """A time-major padded batch beside its lengths, ``(padded, lengths)``, the input
    ``pack_padded_sequence`` takes at ``batch_first=False`` (PyTorch's seq2seq tutorials'
    ``((src, src_lengths), (tgt, tgt_lengths))`` batches): a tensor of at least two dimensions,
    ``(time, batch, ...)``, and a 1-d integer tensor as long as its second dimension but not its
    first. Samples = the lengths' count. A batch-first one, ``(batch, time)`` beside its
    lengths, cannot be told from inputs beside their labels, and is read as those are."""
    if len(items) != 2:
        return None
    padded, lengths = items
    if not isinstance(padded, torch.Tensor) or padded.dim() < 2 or padded.size(0) == padded.size(1):
        return None
    return BatchSize(samples=int(padded.size(1))) if _labels(lengths, int(padded.size(1))) else None


def _labels(value: Any, n: int) -> bool:
    """True for ``n`` class labels: a 1-d integer tensor or a list or tuple of integers."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 1 and value.size(0) == n and not value.is_floating_point() and not value.is_complex()
    return (type(value) in (list, tuple) and len(value) == n
            and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in value[:MAX_ITEMS]))


def _sample_items(items: Any) -> BatchSize | None:
    """Samples one by one, each with its label or target (``collate_fn=lambda rows: rows`` over
    ``(image, label)`` rows): alike tuples, lists or mappings, each holding one tensor with
    dimensions (or several: an image and its mask, a source and a target sequence) beside
    numbers, strings, 0-d tensors or mappings. Samples = their number; read by the first
    tensor, they were its first dimension (an image's channels). Not rows: items whose tensors
    all share a first dimension, or share it with their targets' (micro-batches), every one."""
    form, batched = None, 0
    for item in items[:MAX_ITEMS]:
        parts = _parts(item)
        if parts is None or not 2 <= len(parts[1]) <= MAX_ITEMS:  # (a tensor without its label: a micro-batch's)
            return None
        shape, values, tensors = parts
        if not tensors:
            return None
        firsts = {int(t.size(0)) for t in tensors}
        shared = len(tensors) > 1 and len(firsts) == 1
        for v in values:
            if isinstance(v, Mapping):
                inner_parts = _parts(v)
                inner = inner_parts[2] if inner_parts is not None else []
                shared = shared or bool(inner) and {int(t.size(0)) for t in inner} == firsts
            elif not (v is None or isinstance(v, (torch.Tensor, str, _NUMBER))):
                return None
        batched += shared
        if form is None:
            form = shape
        elif shape != form:
            return None
    if form is None or batched == min(len(items), MAX_ITEMS):
        return None  # every item holds a batch dimension: micro-batches, not samples
    return BatchSize(samples=len(items))


def _micro_batches(items: Any, depth: int) -> BatchSize | None:
    """Token batches, one per micro-batch (a step that accumulates gradients over a list of
    tokenizer outputs): two or more mappings, each with ``input_ids``. Their samples and
    tokens are summed (device counts on the device); read by the first, the step had one
    micro-batch's."""
    if not 2 <= len(items) <= MAX_MICRO_BATCHES:
        return None
    if not all(isinstance(m, Mapping) and _has_key(m, INPUT_IDS) for m in items):
        return None
    return _summed([_from_mapping(m, depth + 1) for m in items])


def _summed(sizes: list[BatchSize | None]) -> BatchSize | None:
    """Micro-batches' sizes summed (device counts on the device): None when one has no
    samples; tokens only when every one has them."""
    samples: list[int | torch.Tensor] = []
    tokens: list[int | torch.Tensor] = []
    for size in sizes:
        if size is None or size.samples is None:
            return None
        samples.append(size.samples)
        if size.tokens is not None:
            tokens.append(size.tokens)
    return BatchSize(samples=sum(samples), tokens=sum(tokens) if len(tokens) == len(sizes) else None)


def _tensor_micro_batches(items: Any) -> BatchSize | None:
    """Micro-batches of tensors (a step that accumulates gradients over a list of ``(inputs,
    targets)`` pairs or ``{"x": ..., "y": ...}`` batches): two or more tuples, lists or
    mappings, each holding at least two tensors that agree on their first dimension, that
    micro-batch's samples. Their samples are summed; read by the first, a step over four
    micro-batches of 8 had 8 samples. The micro-batches are alike (the same keys, and tensors
    of the same dimensions and dtypes); the parts of one batch, ``((images, masks), (labels,
    weights))``, are not. A list of per-sample pairs (an image and its label,
    ``collate_fn=lambda b: b``) has no two tensors agreeing on a batch dimension: not summed."""
    if not 2 <= len(items) <= MAX_MICRO_BATCHES:
        return None
    total, alike = 0, None
    for item in items:
        parts = _parts(item)
        if parts is None:
            return None
        form, _, tensors = parts
        dims = {int(t.size(0)) for t in tensors}
        if len(tensors) < 2 or len(dims) != 1:
            return None
        if alike is None:
            alike = form
        elif form != alike:  # not micro-batches but the parts of one batch ((images, masks), (labels, weights))
            return None
        total += dims.pop()
    return BatchSize(samples=total)


def _parts(item: Any) -> tuple[Any, list, list[torch.Tensor]] | None:
    """``(form, values, tensors)`` of one item of a list of micro-batches or rows (a tuple, list
    or mapping; None for anything else): its values, its tensors with dimensions among the first
    :data:`MAX_ITEMS`, and its form (its keys or length, and those tensors' ranks and dtypes),
    alike for items of one kind."""
    keys: tuple | int
    if isinstance(item, Mapping):
        keys, values = tuple(item.keys()), list(item.values())
    elif type(item) in (tuple, list):
        keys, values = len(item), list(item)
    else:
        return None
    tensors = [v for v in values[:MAX_ITEMS] if isinstance(v, torch.Tensor) and v.dim() > 0]
    return (keys, tuple((t.dim(), t.dtype) for t in tensors)), values, tensors


def _from_mapping(batch: Mapping[str, Any], depth: int) -> BatchSize | None:
    ids = batch.get(INPUT_IDS) if _has_key(batch, INPUT_IDS) else None
    if isinstance(ids, torch.Tensor) and ids.dim() > 0:
        samples: int | torch.Tensor = int(ids.shape[0]) if ids.dim() > 1 else 1
        mask = batch.get(ATTENTION_MASK) if _has_key(batch, ATTENTION_MASK) else None
        if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
            return BatchSize(samples=samples, tokens=torch.count_nonzero(mask.detach()))
        if samples == 1:  # one row and no padding mask of its shape: it may hold several sequences
            samples = _packed_sequences(batch, ids)
        return BatchSize(samples=samples, tokens=int(ids.numel()))
    for index, item in enumerate(batch.values()):
        if index >= MAX_ITEMS:
            break
        found = _infer(item, depth + 1)
        if found is not None:
            return found
    return None


def _packed_sequences(batch: Mapping[str, Any], ids: torch.Tensor) -> int | torch.Tensor:
    """The sequences in one row of token ids with no mask: the flash-attention boundaries'
    count when given (a host shape), else the zeros among its position ids (a 0-d device
    count, read with the step's one read), else 1."""
    bounds = batch.get("cu_seq_lens_q") if _has_key(batch, "cu_seq_lens_q") else None
    if isinstance(bounds, torch.Tensor) and bounds.dim() == 1 and bounds.numel() >= 2:
        return int(bounds.numel()) - 1
    positions = batch.get(POSITION_IDS) if _has_key(batch, POSITION_IDS) else None
    if isinstance(positions, torch.Tensor) and positions.shape == ids.shape and not positions.is_floating_point():
        return torch.count_nonzero(positions.detach() == 0)
    return 1


def _has_key(batch: Mapping[str, Any], key: str) -> bool:
    try:
        return key in batch
    except TypeError:  # a mapping keyed by something unhashable with str
        return False


def same_arguments(call: tuple[tuple, dict], args: tuple, kwargs: dict) -> bool:
    """True when ``(args, kwargs)`` are the very objects of the earlier ``call`` (the same
    batch passed again, as an activation checkpoint's recomputation does).

    >>> x = torch.zeros(2)
    >>> same_arguments(((x,), {}), (x,), {}), same_arguments(((x,), {}), (x.clone(),), {})
    (True, False)
    """
    first, named = call
    return (len(first) == len(args) and all(a is b for a, b in zip(first, args))
            and named.keys() == kwargs.keys() and all(named[k] is kwargs[k] for k in kwargs))


class MicroBatches(tuple):
    """The model's calls on one step's micro-batches (a backward after each), as one ``(args,
    kwargs)`` pair whose ``args`` are the calls' ``(args, kwargs)``: keyed by their shapes like
    any call, and its batch is their samples and tokens summed (:func:`batch_of`).

    >>> calls = MicroBatches.of([((torch.zeros(4, 3),), {}), ((torch.zeros(2, 3),), {})])
    >>> batch_of(calls)
    BatchSize(samples=6, tokens=None)
    """

    @classmethod
    def of(cls, calls: list[tuple[tuple, dict]]) -> "MicroBatches":
        return cls((tuple(calls), {}))


def batch_of(inputs: tuple[tuple, dict] | None, skip: int = 0,
             model: torch.nn.Module | None = None) -> BatchSize | None:
    """The batch of a step's inputs ``(args, kwargs)``, past the first ``skip`` positional ones
    (a method's instance), as ``model`` consumes it (see :func:`infer_batch`); None without
    inputs. :class:`MicroBatches`: the sum of their batches (None samples when one has none)."""
    if inputs is None:
        return None
    if type(inputs) is MicroBatches:
        summed = _summed([infer_batch(args, kwargs, model) for args, kwargs in inputs[0]])
        return summed if summed is not None else NOTHING
    return infer_batch(inputs[0][skip:] if skip else inputs[0], inputs[1], model)
