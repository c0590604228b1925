"""The user's mistakes, named where they are made: wrong argument types at scope creation or
decoration raise ``TypeError`` with the correct call, instead of failing later inside the step
(where torchtrace would only count them as its own errors)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping

import torch

from torchtrace.levels import DebugLevel, DebugMode

STEP_KINDS = ("train", "evaluation", "checkpoint", "other")
_EXAMPLE = 'debug_context("train_step", model=model, optimizer=optimizer)'


def _kind(value: object) -> str:
    return type(value).__name__


def is_optimizer(value: object) -> bool:
    """A torch optimizer, or an object that behaves as one (param_groups, step, step pre-hooks)."""
    if isinstance(value, torch.optim.Optimizer):
        return True
    return (hasattr(value, "param_groups") and callable(getattr(value, "step", None))
            and callable(getattr(value, "register_step_pre_hook", None)))


def is_scaler(value: object) -> bool:
    return callable(getattr(value, "unscale_", None)) and callable(getattr(value, "scale", None))


def check_model(model: object, where: str) -> None:
    if model is None or isinstance(model, torch.nn.Module):
        return
    hint = " (model and optimizer swapped?)" if is_optimizer(model) else ""
    raise TypeError(f"{where}: model= must be a torch.nn.Module, got {_kind(model)}{hint}; "
                    f"for example {_EXAMPLE}")


def check_optimizer(optimizer: object, where: str) -> None:
    if optimizer is None or is_optimizer(optimizer):
        return
    hint = " (model and optimizer swapped?)" if isinstance(optimizer, torch.nn.Module) else ""
    raise TypeError(f"{where}: optimizer= must be a torch.optim.Optimizer, got {_kind(optimizer)}{hint}; "
                    f"for example {_EXAMPLE}")


def check_scaler(scaler: object, where: str) -> None:
    if scaler is None or is_scaler(scaler):
        return
    raise TypeError(f"{where}: scaler= must be a torch.amp.GradScaler (an object with scale() and unscale_()), "
                    f"got {_kind(scaler)}; for example debug_context(\"train_step\", model=model, "
                    f"optimizer=optimizer, scaler=torch.amp.GradScaler())")


def check_attributes(attributes: object, where: str) -> None:
    """``attributes=``: None or a mapping of string keys to values a span holds (the SDK would
    warn of any other on every step's span and write None or its str() instead)."""
    if attributes is None:
        return
    if not isinstance(attributes, Mapping) or not all(isinstance(k, str) for k in attributes):
        raise TypeError(f"{where}: attributes= must be a dict of string keys to values (str, bool, int, float, or "
                        f"lists of them), got {_kind(attributes)}; for example attributes={{\"dataset\": \"train\"}}")
    for key, value in attributes.items():
        odd = _odd_attribute_value(value)
        if odd is not None:
            raise TypeError(f"{where}: attributes[{key!r}] holds a {_kind(odd)}; accepted values: str, bool, int, "
                            "float, bytes, None, or lists and dicts of them (convert it: str(value), float(value))")


def _odd_attribute_value(value: object, depth: int = 0) -> object:
    """The first value inside ``value`` that a span attribute cannot hold, or None."""
    if value is None or isinstance(value, (str, bool, int, float, bytes)):  # as the SDK judges them
        return None
    if depth < 8 and isinstance(value, (list, tuple)):
        return next((odd for odd in (_odd_attribute_value(v, depth + 1) for v in value) if odd is not None), None)
    if depth < 8 and isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return next((odd for odd in (_odd_attribute_value(v, depth + 1) for v in value.values()) if odd is not None),
                    None)
    return value


def check_scope_arguments(name: object, model: object, optimizer: object, scaler: object, replay: object,
                          step: object, kind: object, attributes: object = None) -> None:
    """Raises TypeError or ValueError naming the argument and showing the correct call."""
    where = "debug_context"
    if not isinstance(name, str):
        if isinstance(name, torch.nn.Module):
            raise TypeError(f"{where}: the first argument is the operation's name, got a {_kind(name)}; pass the "
                            f"model by keyword: {_EXAMPLE}")
        raise TypeError(f"{where}: the operation's name must be a string, got {_kind(name)}; for example {_EXAMPLE}")
    if not name.strip():
        raise ValueError(f"{where}: the operation's name must not be empty; for example {_EXAMPLE}")
    check_model(model, where)
    check_optimizer(optimizer, where)
    check_scaler(scaler, where)
    if replay is not None and not callable(replay):
        raise TypeError(f"{where}: replay= must be a callable that runs the step's forward and loss again, got "
                        f"{_kind(replay)}; for example replay=lambda: loss_fn(model(x), y)")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise TypeError(f"{where}: step= must be a non-negative int, got {step!r}")
    if kind not in STEP_KINDS:
        raise ValueError(f"{where}: kind={kind!r} is not valid; accepted values: {', '.join(STEP_KINDS)}")
    check_attributes(attributes, where)


def check_decorator_target(func: object) -> None:
    """``@debug_operation(model)``: a module where the decorated function belongs."""
    if isinstance(func, torch.nn.Module):
        raise TypeError("debug_operation: got a torch.nn.Module where the function to decorate belongs; pass the "
                        "model by keyword: @debug_operation(model=model, optimizer=optimizer)")
    if isinstance(func, torch.optim.Optimizer):
        raise TypeError("debug_operation: got an optimizer where the function to decorate belongs; pass it by "
                        "keyword: @debug_operation(model=model, optimizer=optimizer)")
    if func is not None and not callable(func):
        raise TypeError(f"debug_operation decorates a function, got {_kind(func)}; for example "
                        "@debug_operation(name=\"train_step\", model=model)")


def check_decorator_arguments(func: object, name: object, model: object, optimizer: object,
                              level: DebugLevel | str | None, mode: DebugMode | str | None, replay: object,
                              scaler: object, kind: object, attributes: object = None) -> None:
    """``debug_operation``'s arguments, checked at decoration.

    Raises:
        TypeError / ValueError: naming the argument and showing the correct call.
    """
    where = "debug_operation"
    check_decorator_target(func)
    if level is not None:
        DebugLevel.parse(level, "level")
    if mode is not None:
        DebugMode.parse(mode, "mode")
    check_model(model, where)
    check_optimizer(optimizer, where)
    check_scaler(scaler, where)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise TypeError(f"{where}: name= must be a non-empty string, got {name!r}")
    if replay is not None and replay is not False and not callable(replay):
        raise TypeError(f"{where}: replay= must be a callable, False or None, got {_kind(replay)}")
    if kind not in STEP_KINDS:
        raise ValueError(f"{where}: kind={kind!r} is not valid; accepted values: {', '.join(STEP_KINDS)}")
    check_attributes(attributes, where)


def operation_name(fn: object, name: str | None) -> str:
    """The operation a decorated ``fn`` is: ``name=``, else the function's name (a
    ``functools.partial``'s function, a callable object's class).

    Raises:
        TypeError: a module or an optimizer where the function belongs, or a generator
            function (calling it only makes the generator; its body would run outside the step).
    """
    check_decorator_target(fn)
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(f"debug_operation: {getattr(fn, '__qualname__', _kind(fn))} is a generator function: "
                        "a call only creates the generator and its body runs later, outside the step; "
                        "decorate the function that runs one training step")
    if name:
        return name
    while isinstance(fn, functools.partial):
        fn = fn.func
    own = getattr(fn, "__name__", None)
    return own if isinstance(own, str) and own else _kind(fn)
