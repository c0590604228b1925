"""The loss of a step, as the user hands it over: a tensor, a number, or inside a return value."""

from __future__ import annotations

import numbers

import torch


class LossValue:
    """A loss ready for the record: a device tensor to read, or a host number, or why it is neither."""

    __slots__ = ("tensor", "number", "problem")

    def __init__(self, tensor: torch.Tensor | None = None, number: float | None = None,
                 problem: str | None = None) -> None:
        self.tensor = tensor  # 1 element, floating point (the read detaches it)
        self.number = number
        self.problem = problem  # why it is not recorded (said once per operation)


_FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def _is_fake(t: torch.Tensor) -> bool:
    """A tensor without data: on the meta device, or a fake tensor of a compiler trace."""
    if t.device.type == "meta":
        return True
    return type(t).__name__ in ("FakeTensor", "FunctionalTensor") or bool(getattr(t, "fake_mode", None))


def classify_loss(loss: object) -> LossValue:
    """What a loss handed to ``record_loss`` is.

    >>> classify_loss(0.25).number
    0.25
    >>> classify_loss(torch.ones(16, 1)).problem
    'a loss of shape [16, 1] is not a scalar; record loss.mean() or loss.sum()'
    >>> classify_loss(torch.tensor(True)).problem
    'a loss of dtype torch.bool is not a number; record a floating-point loss'
    """
    if type(loss) is torch.Tensor and loss.dtype in _FLOATS and loss.device.type != "meta" and loss.numel() == 1:
        return LossValue(tensor=loss)  # the common case, cheaply (a plain tensor is never fake)
    if isinstance(loss, torch.Tensor):
        if loss.dtype is torch.bool or not (loss.dtype.is_floating_point or loss.dtype.is_complex):
            return LossValue(problem=f"a loss of dtype {loss.dtype} is not a number; record a floating-point loss")
        if loss.numel() != 1:
            return LossValue(problem=f"a loss of shape {list(loss.shape)} is not a scalar; record loss.mean() or "
                                     "loss.sum()")
        if _is_fake(loss):
            return LossValue(problem=f"a loss on the {loss.device.type} device holds no value")
        return LossValue(tensor=loss.detach().real if loss.dtype.is_complex else loss)
    if isinstance(loss, bool):
        return LossValue(problem="a loss of type bool is not a number")
    if isinstance(loss, numbers.Real):  # int, float, NumPy scalars
        return LossValue(number=float(loss))
    if isinstance(loss, (tuple, list)):  # a step's `return loss, logits`: which item is the loss is not ours to guess
        return LossValue(problem=f"a step that returns a {type(loss).__name__} gives no loss; return the loss (or a "
                                 "dict with \"loss\"), or call record_loss(loss)")
    return LossValue(problem=f"a loss of type {type(loss).__name__} is not a number")


def extract_loss(result: object) -> object:
    """The loss from a step's return value: a tensor, a number, a dict's "loss", an object's (a
    named tuple's too) .loss.

    Whatever is found is judged by :func:`classify_loss` (a non-scalar tensor is reported, not
    silently cut to its first element).

    >>> extract_loss({"loss": 1.5})
    1.5
    >>> extract_loss(0.5)
    0.5
    """
    if isinstance(result, (torch.Tensor, numbers.Real)) and not isinstance(result, bool):
        return result  # a NumPy scalar too (np.float32 is no float), as record_loss takes it
    if isinstance(result, dict):
        return result.get("loss")
    if isinstance(result, tuple) and "loss" in getattr(result, "_fields", ()):
        return getattr(result, "loss")  # a named tuple that names its loss
    if isinstance(result, (tuple, list)) and result:
        return result  # judged by classify_loss: a tuple is said to hold no loss
    return getattr(result, "loss", None)


def not_a_loss(value: object) -> bool:
    """What an evaluation returns that is no loss: its predictions (a tensor of many values),
    or a tuple or list (predictions and labels)."""
    return isinstance(value, (tuple, list)) or isinstance(value, torch.Tensor) and value.numel() != 1
