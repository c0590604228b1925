"""The learning rate of each of an optimizer's parameter groups, as a step records it.

A rate is usually a float; a config may leave any real number (a NumPy float), and a
capturable optimizer (set up for CUDA graphs) holds its rates in one-value tensors on the GPU.
Those are copied on the device and read with the step's one host read
(:class:`~torchtrace.record.readout.ReadPlan`): reading them here would wait for the GPU.
"""

from __future__ import annotations

import numbers
from operator import itemgetter
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torchtrace.record.readout import ReadPlan


_RATE = itemgetter("lr")
_FLOATS = {float}


class DeviceRates(list):
    """Learning rates of which some are device tensors (a capturable optimizer's): each such
    rate is a float64 copy taken when the rates were read (a scheduler may overwrite the
    tensor in place before the step ends); they are read with the step's one host read."""


def learning_rates(optimizer: torch.optim.Optimizer | None) -> list[float] | None:
    """The learning rate of every parameter group, as floats; where a rate is a one-value
    tensor on a device, a :class:`DeviceRates` holding a copy of it (no host read here)."""
    if optimizer is None:
        return None
    try:  # every step pays for this: plain float rates, read without a Python loop (none: below)
        rates = list(map(_RATE, optimizer.param_groups))
        if set(map(type, rates)) == _FLOATS:
            return rates
    except (KeyError, TypeError):  # a group without a rate, groups that are not dicts: the careful way
        pass
    out = []
    for group in optimizer.param_groups:
        lr = group.get("lr")
        if type(lr) is float:  # the usual case, checked first: every step pays for this
            out.append(lr)
            continue
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                return None  # not a rate
            if lr.device.type != "cpu":
                out = DeviceRates(out)
                out.append(lr.detach().reshape(1).to(torch.float64, copy=True))
                continue
            lr = lr.item()
        if not isinstance(lr, numbers.Real) or isinstance(lr, bool):  # a NumPy float is a rate too
            return None
        out.append(float(lr))
    return out or None


def plan_rates(rates: DeviceRates, plan: ReadPlan) -> None:
    """Add a :class:`DeviceRates`' device values to the step's one read (slot ``"lr"``, the
    rates as its label: the read's values take the tensors' places, see ``step.finish``)."""
    tensors = [r for r in rates if isinstance(r, torch.Tensor)]
    home = tensors[0].device  # groups' rates on two GPUs: one slot, on the first one's
    plan.add("lr", tensors[0] if len(tensors) == 1 else torch.cat([t.to(home, non_blocking=True) for t in tensors]),
             label=[None if isinstance(r, torch.Tensor) else r for r in rates])


def read_rates(plan: ReadPlan, values: list[float] | None) -> list[float] | None:
    """The learning rates of a step whose rates were partly on a device, once the read has
    landed; None when nothing was read (no rate rather than a wrong one)."""
    read = plan.take("lr", values)
    rates = plan.label("lr")
    if read is None or rates is None:
        return None
    it = iter(read)
    return [r if r is not None else next(it) for r in rates]


__all__ = ["DeviceRates", "learning_rates", "plan_rates", "read_rates"]
