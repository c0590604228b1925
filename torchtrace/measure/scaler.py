"""Whether a mixed-precision loss scaler (``torch.amp.GradScaler``) skipped a step's optimizer
update, as a device value read with the step's one host read.

A scaler skips the update of a step whose scaled gradients overflowed, and then halves its
scale: a run's first steps do so while the scale backs off from its start, and any step
later can. Such a step made no progress, which goodput counts as ``skipped_step``. Two signs,
both on the device and never waited for here:

- the scaler's record of infinities found for the optimizer in this step, while it still
  holds it (the user calls ``scaler.update()`` after the step);
- otherwise its scale now below the scale at the step's start (``update()`` ran inside it;
  ``update()`` lowers the scale exactly when it found infinities).

Before the scaler's first ``scale()`` call it has no scale yet: the scale at the start of
that step is the one it starts from (``init_scale``). The scaler's own attributes are read
(``_scale``, ``_init_scale``, ``_per_optimizer_states``: torch has no public way to read them
without a host sync, or at all); a scaler without them gives no sign.
"""

from __future__ import annotations

from typing import Any

import torch


def scale_at_start(scaler: object) -> torch.Tensor | float | None:
    """A copy of the scaler's scale now (a device op); before its first ``scale()`` call, the
    scale it will start from (a number); None without either."""
    if scaler is None or not _enabled(scaler):
        return None
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):
        return scale.detach().clone()
    initial = getattr(scaler, "_init_scale", None)
    return float(initial) if isinstance(initial, (int, float)) else None


def skipped_update(scaler: object, optimizer: torch.optim.Optimizer | None,
                   before: torch.Tensor | float | None) -> torch.Tensor | None:
    """A 0-d float64 device tensor, above 0 when the scaler skipped this step's update; None
    when there is no sign to read.

    >>> scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    >>> _ = scaler.scale(torch.ones(()))
    >>> before = scale_at_start(scaler)
    >>> scaler.update(new_scale=2.0)
    >>> float(skipped_update(scaler, None, before))
    1.0
    """
    if scaler is None or not _enabled(scaler):
        return None
    states = getattr(scaler, "_per_optimizer_states", None)
    if optimizer is not None and isinstance(states, dict) and id(optimizer) in states:
        found = states[id(optimizer)].get("found_inf_per_device")
        if found:
            values = list(found.values())
            first = values[0]
            total = sum((v.to(first.device, non_blocking=True) for v in values[1:]), first)
            return total.detach().to(torch.float64).reshape(())
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor) and (isinstance(before, float) or (isinstance(before, torch.Tensor)
                                                                            and scale.device == before.device)):
        return (scale.detach() < before).to(torch.float64).reshape(())
    return None


def unscaled_by(scaler: object) -> bool:
    """Whether ``scaler`` (enabled) unscaled an optimizer's gradients since its last ``update()``
    (``scaler.unscale_(optimizer)``, before a clip): its ``step`` then skips that update itself
    when it found Inf or NaN in them."""
    if scaler is None or not _enabled(scaler):
        return False
    states = getattr(scaler, "_per_optimizer_states", None)
    return isinstance(states, dict) and any(isinstance(state, dict) and state.get("found_inf_per_device")
                                            for state in states.values())


def carried_scale(scaler: object, optimizer: object = None) -> torch.Tensor | None:
    """The scale gradients made by ``scaler.scale(loss).backward()`` still carry: the enabled
    scaler's scale while it has not unscaled ``optimizer``'s gradients (any optimizer's, when
    None) since its last ``update()``; None otherwise. The scale is the scaler's own device
    tensor (``_scale``), read without a host sync, where ``get_scale()`` would read it to the
    host.

    >>> scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    >>> _ = scaler.scale(torch.ones(()))
    >>> float(carried_scale(scaler))
    4.0
    """
    if not scaler_enabled(scaler):
        return None
    scale = getattr(scaler, "_scale", None)
    if not isinstance(scale, torch.Tensor):
        return None
    if optimizer is None:
        return None if unscaled_by(scaler) else scale
    states = getattr(scaler, "_per_optimizer_states", None)
    state = states.get(id(optimizer)) if isinstance(states, dict) else None
    return None if isinstance(state, dict) and state.get("found_inf_per_device") else scale


def find_side_effect_owners(args: tuple, kwargs: dict) -> tuple[list[Any], list[Any]]:
    """Optimizers and GradScalers passed to a step function: a replay neutralises their updates,
    and throughput reads a scaler's skipped updates.

    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> find_side_effect_owners((torch.ones(2), opt), {})[0] == [opt]
    True
    """
    opts, scalers = [], []
    for value in (*args, *kwargs.values()):
        if isinstance(value, _PLAIN):  # the common arguments: nothing to neutralise (and cheap to tell)
            continue
        if isinstance(value, torch.optim.Optimizer):
            opts.append(value)
        elif hasattr(value, "_scale") and hasattr(value, "unscale_"):
            scalers.append(value)
    return opts, scalers


def scaler_enabled(scaler: object) -> bool:
    """A scaler that scales: ``GradScaler(enabled=False)`` (nanoGPT's default off float16) is no
    scaler, and a non-finite gradient under it is no overflow.

    >>> scaler_enabled(torch.amp.GradScaler("cpu", enabled=False))
    False
    """
    return scaler is not None and _enabled(scaler)


_PLAIN = (torch.Tensor, torch.nn.Module, int, float, str, bytes, bool, type(None), tuple, list, dict)


def _enabled(scaler: object) -> bool:
    try:
        return bool(getattr(scaler, "is_enabled")())
    except Exception:
        return False


__all__ = ["carried_scale", "find_side_effect_owners", "scale_at_start", "scaler_enabled", "skipped_update",
           "unscaled_by"]
