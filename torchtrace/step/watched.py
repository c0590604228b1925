"""Which model, optimizer and loss scaler a decorated step watches when the decorator names none.

In order: the decorator's ``model=`` / ``optimizer=``; a module passed as the first or second
argument (``self`` of a module's method, or ``train_step(model, batch)``) and an optimizer
among the arguments, or kept on that module (``self.optimizer`` of a module's own method);
and for a method of any other class (a trainer object), the model, optimizer and
GradScaler among the attributes of its ``self``:

- the optimizer is the one attribute that is an optimizer (two or more: none is chosen),
  and the scaler the one that is a GradScaler (its updates are left out of a forensic
  replay, and its skipped steps count in goodput);
- the model is the module attribute whose parameters that optimizer updates, or without
  an optimizer the one module attribute that has parameters (a loss module has none); of
  several, the one that holds all the others' parameters (a model and its own backbone),
  else none is chosen.

Which attributes they are is worked out once per class and read on every call, so a model
replaced on the object (wrapped, compiled) is the one watched from the next step. Attributes
that were None then (an optimizer a trainer builds in its first step) are looked at again
once one of them is set, and the attributes worked out anew.

>>> import torch
>>> class Trainer:
...     def __init__(self):
...         self.model = torch.nn.Linear(2, 1)
...         self.ema = torch.nn.Linear(2, 1)
...         self.criterion = torch.nn.MSELoss()
...         self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
>>> t = Trainer()
>>> watched(None, None, None, (t, torch.zeros(1)), {}) == (t.model, t.opt, None)
True
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, TypeGuard

import torch

_Module = torch.nn.Module
_Optimizer = torch.optim.Optimizer
# Arguments that are never a trainer object: told apart by type, cheaply.
_PLAIN = (torch.Tensor, _Module, _Optimizer, tuple, list, dict, str, bytes, int, float, bool, type(None))
_MAX_CLASSES = 256
_MAX_ATTRIBUTES = 256  # attributes of an object looked at, at most
_MAX_PENDING = 16  # attributes that were None when the class was looked at, watched for being set
_MAX_LOOKS = 8  # looks at a class, at most (an attribute that goes back and forth to None costs no more)
# class -> the names of its model, optimizer and scaler attributes, of those that were None, and the looks
_fields: dict[type, tuple[tuple[str | None, str | None, str | None], tuple[str, ...], int]] = {}


def watched(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
            scaler: torch.amp.GradScaler | None, args: tuple,
            kwargs: dict) -> tuple[torch.nn.Module | None, torch.optim.Optimizer | None, torch.amp.GradScaler | None]:
    """``(model, optimizer, scaler)`` a decorated step watches; any may be None (a scaler among
    the arguments is found where it is used)."""
    if model is None:
        for arg in args[:2]:
            if isinstance(arg, _Module):
                model = arg
                break
    if optimizer is None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, _Optimizer):
                optimizer = value
                break
    if (model is None or optimizer is None) and args and not isinstance(args[0], _PLAIN):
        found = _attributes_of(args[0])
        model = model if model is not None else found[0]
        optimizer = optimizer if optimizer is not None else found[1]
        scaler = scaler if scaler is not None else found[2]
    elif optimizer is None and args and isinstance(args[0], _Module):
        # A module's own method (``self`` is the model): an optimizer kept on the module.
        found = _attributes_of(args[0])
        optimizer = found[1]
        scaler = scaler if scaler is not None else found[2]
    return model, optimizer, scaler


def instance_first(fn: Callable[..., Any]) -> bool:
    """True for a function defined as a method (its first parameter ``self`` or ``cls``): the
    first argument of its calls is the instance, not the batch."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].name in ("self", "cls") and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


_layout_version = 0
_layout_hooks: list[Any] = []


def layout_version() -> int:
    """How many submodules and parameters were registered on modules anywhere in the process
    since :func:`watch_layouts`: a list of a model's parameters made at another version may be
    stale (its head replaced for fine-tuning, adapters injected, a weight pruned)."""
    return _layout_version


def _layout_changed(module: torch.nn.Module, name: str, value: object) -> None:
    global _layout_version
    _layout_version += 1


def watch_layouts() -> None:
    """Count registrations through torch's global module and parameter registration hooks
    (idempotent; at ``configure()``)."""
    if not _layout_hooks:
        from torch.nn.modules import module as module_module

        _layout_hooks.append(module_module.register_module_module_registration_hook(_layout_changed))
        _layout_hooks.append(module_module.register_module_parameter_registration_hook(_layout_changed))


def unwatch_layouts() -> None:
    """Remove the hooks of :func:`watch_layouts` (idempotent; at ``shutdown()``)."""
    while _layout_hooks:
        _layout_hooks.pop().remove()


def real_optimizer(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The torch optimizer behind a wrapper that never initialised torch's ``Optimizer`` (its
    hooks cannot be registered on it): accelerate's ``AcceleratedOptimizer`` holds the real one
    in ``.optimizer``; another wrapper may keep it under a name of its own (the one initialised
    optimizer among its attributes). Anything else is returned as it is; see :func:`hookable`.

    >>> sgd = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    >>> class Wrapper(torch.optim.Optimizer):
    ...     def __init__(self, optimizer):
    ...         self.optimizer = optimizer
    >>> real_optimizer(Wrapper(sgd)) is sgd and real_optimizer(sgd) is sgd
    True
    >>> class Hidden(torch.optim.Optimizer):
    ...     def __init__(self, optimizer):
    ...         self._inner = optimizer
    >>> real_optimizer(Hidden(sgd)) is sgd
    True
    """
    for _ in range(4):  # wrappers of wrappers, a few deep at most
        if optimizer is None or hookable(optimizer):
            return optimizer
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, _Optimizer):
            held = [v for v in getattr(optimizer, "__dict__", {}).values() if isinstance(v, _Optimizer)]
            if len(held) != 1:  # none, or two it cannot choose between
                return optimizer
            inner = held[0]
        optimizer = inner
    return optimizer


def shares_groups(optimizer: object, other: object) -> bool:
    """Whether two optimizers update through one list of parameter groups: a wrapper and the
    base optimizer it hands its update to (SAM, Lookahead: ``self.param_groups =
    base_optimizer.param_groups``).

    >>> sgd = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    >>> class Wrapper(torch.optim.Optimizer):
    ...     def __init__(self, base):
    ...         super().__init__(base.param_groups, {})
    ...         self.base, self.param_groups = base, base.param_groups
    >>> shares_groups(Wrapper(sgd), sgd), shares_groups(sgd, torch.optim.SGD([torch.zeros(1)], lr=0.1))
    (True, False)
    """
    groups = getattr(optimizer, "param_groups", None)
    return groups is not None and groups is getattr(other, "param_groups", None)


def hookable(optimizer: object) -> bool:
    """True when torch's step hooks can be registered on ``optimizer`` (its ``Optimizer.__init__`` ran)."""
    return hasattr(optimizer, "_optimizer_step_pre_hooks")


def _attributes_of(obj: object) -> tuple[torch.nn.Module | None, torch.optim.Optimizer | None,
                                         torch.amp.GradScaler | None]:
    kind = type(obj)
    known = _fields.get(kind)
    if known is None or (known[1] and any(getattr(obj, name, None) is not None for name in known[1])):
        looks = known[2] + 1 if known is not None else 1  # first seen, or an attribute that was None is set now
        known = (_find(obj), _unset(obj) if looks < _MAX_LOOKS else (), looks)
        if len(_fields) < _MAX_CLASSES or kind in _fields:
            _fields[kind] = known
    names = known[0]
    model, optimizer, scaler = (getattr(obj, name, None) if name is not None else None for name in names)
    return (model if isinstance(model, _Module) else None,
            optimizer if isinstance(optimizer, _Optimizer) else None,
            scaler if _is_scaler(scaler) else None)


def _unset(obj: object) -> tuple[str, ...]:
    """The names of ``obj``'s attributes that are None (a model or optimizer still to come)."""
    try:
        items = list(vars(obj).items())[:_MAX_ATTRIBUTES]
    except TypeError:
        return ()
    return tuple(name for name, value in items if value is None)[:_MAX_PENDING]


def _is_scaler(value: object) -> TypeGuard[torch.amp.GradScaler]:
    """A GradScaler, or an object that behaves as one."""
    return value is not None and hasattr(value, "_scale") and hasattr(value, "unscale_")


def _find(obj: object) -> tuple[str | None, str | None, str | None]:
    """The names of the model, optimizer and scaler attributes of ``obj`` (see the module docstring)."""
    try:
        items = list(vars(obj).items())[:_MAX_ATTRIBUTES]
    except TypeError:  # no __dict__
        return None, None, None
    optimizers = [name for name, value in items if isinstance(value, _Optimizer)]
    optimizer_name = optimizers[0] if len(optimizers) == 1 else None
    scalers = [name for name, value in items if _is_scaler(value)]
    scaler_name = scalers[0] if len(scalers) == 1 else None
    modules = [(name, value) for name, value in items
               if isinstance(value, _Module) and next(value.parameters(), None) is not None]
    if optimizer_name is not None:
        updated = {id(p) for group in getattr(obj, optimizer_name).param_groups for p in group["params"]}
        modules = [(name, value) for name, value in modules if any(id(p) in updated for p in value.parameters())]
    if len(modules) > 1:  # one may hold the others (the model and its backbone): the one that holds all
        owned = [(name, {id(p) for p in value.parameters()}) for name, value in modules]
        name, widest = max(owned, key=lambda item: len(item[1]))
        if all(ids <= widest for _, ids in owned):
            return name, optimizer_name, scaler_name
    model_name = modules[0][0] if len(modules) == 1 else None
    return model_name, optimizer_name, scaler_name


__all__ = ["hookable", "instance_first", "real_optimizer", "watched"]
