"""Input and output checks: ``validate_model_input`` and ``detect_model_anomalies``.

Occasional checks (data loading, evaluation, serving), not per-step telemetry: each reads
its statistics to the host once.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any, Iterator, Sequence

import torch

from torchtrace import semconv
from torchtrace.forensics.isolation import rng_kept
from torchtrace.measure import tensors as tensor_measure
from torchtrace.record import readout
from torchtrace.record.monitor import record_anomalies


def _stats(t: torch.Tensor) -> dict[str, Any]:
    values = readout.read(tensor_measure.tensor_stats(t).cpu())
    return tensor_measure.describe(t, values)


def _dims(expected_dims: object) -> tuple[int, ...] | None:
    """The numbers of dimensions accepted, or ``ValueError`` naming ``expected_dims``."""
    if expected_dims is None:
        return None
    values = tuple(expected_dims) if isinstance(expected_dims, (list, tuple, set, frozenset, range)) \
        else (expected_dims,)
    if not values or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0 for v in values):
        raise ValueError(f"expected_dims={expected_dims!r} is not valid; accepted values: a number of dimensions "
                         "(a non-negative int), a sequence of them, or None")
    return tuple(int(v) for v in values)


def _number(value: object, name: str, accepted: str = "a number or None") -> float | None:
    """A real number (not NaN), None, or ``ValueError`` naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name}={value!r} is not valid; accepted values: {accepted}")
    return float(value)


def _bounds(min_value: object, max_value: object) -> tuple[float | None, float | None]:
    """``(min_value, max_value)`` as numbers, the minimum not above the maximum."""
    low, high = _number(min_value, "min_value"), _number(max_value, "max_value")
    if low is not None and high is not None and low > high:
        raise ValueError(f"min_value={min_value!r} is above max_value={max_value!r}: no input could pass; "
                         "accepted values: min_value <= max_value")
    return low, high


def _value_range(value_range: object) -> tuple[float, float] | None:
    """``(low, high)`` with low <= high, or None; else ``ValueError`` naming ``value_range``."""
    if value_range is None:
        return None
    pair = tuple(value_range) if isinstance(value_range, (list, tuple)) else ()
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(v) for v in pair) \
            or pair[0] > pair[1]:
        raise ValueError(f"value_range={value_range!r} is not valid; accepted values: a pair (low, high) of numbers "
                         "with low <= high, or None")
    return float(pair[0]), float(pair[1])


def _tolerance(value: object) -> float:
    """A non-negative finite number, or ``ValueError`` naming ``uniform_tolerance``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) < math.inf:
        raise ValueError(f"uniform_tolerance={value!r} is not valid; accepted values: a non-negative finite number")
    return float(value)


def validate_model_input(x: torch.Tensor, *, expected_dims: int | Sequence[int] | None = None,
                         min_value: float | None = None, max_value: float | None = None,
                         allow_nonfinite: bool = False, name: str = "input") -> dict[str, Any]:
    """Check a batch before it reaches the model; returns its statistics.

    Raises:
        TypeError: ``x`` is not a tensor.
        ValueError: NaN/Inf values (counted as ``nonfinite_input``), values outside
            ``[min_value, max_value]``, or a number of dimensions not in ``expected_dims``;
            the message says what was found and what was expected.
        ValueError: a setting that is not valid (``expected_dims`` not an int or a sequence of
            ints, a bound not a number, ``min_value`` above ``max_value``), naming it.

    >>> import torch, torchtrace as tt
    >>> tt.validate_model_input(torch.zeros(2, 3), expected_dims=2)["nan_count"]
    0
    """
    allowed = _dims(expected_dims)
    min_value, max_value = _bounds(min_value, max_value)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if allowed is not None:
        if x.dim() not in allowed:
            raise ValueError(f"{name} has {x.dim()} dimensions (shape {tuple(x.shape)}); expected "
                             f"{' or '.join(str(a) for a in allowed)}")
    if not (x.is_floating_point() or x.is_complex()):
        x_stats = x.to(torch.float64)
    else:
        x_stats = x
    info = _stats(x_stats)
    if not allow_nonfinite and (info["nan_count"] or info["inf_count"]):
        record_anomalies([semconv.NONFINITE_INPUT], -1, None, None, operation="validate_model_input")
        raise ValueError(f"{name} holds {info['nan_count']} NaN and {info['inf_count']} Inf value(s) "
                         f"out of {info['numel']} (shape {tuple(x.shape)})")
    if min_value is not None and info["min"] is not None and info["min"] < min_value:
        raise ValueError(f"{name} minimum {info['min']:.6g} is below the allowed minimum {min_value:.6g}")
    if max_value is not None and info["max"] is not None and info["max"] > max_value:
        raise ValueError(f"{name} maximum {info['max']:.6g} is above the allowed maximum {max_value:.6g}")
    return info


@contextlib.contextmanager
def model_kept(model: torch.nn.Module) -> Iterator[None]:
    """A forward run on the side leaves ``model`` as it found it: every buffer's value (a
    BatchNorm's running statistics and batch count), the tensor each buffer name holds, the
    train/eval mode of every module, and the global random generators (Dropout's draws)."""
    buffers = [(module, name, buf, buf.detach().clone())
               for module in model.modules() for name, buf in module.named_buffers(recurse=False)]
    modes = [(module, module.training) for module in model.modules()]
    try:
        with rng_kept():
            yield
    finally:
        with torch.no_grad():
            for module, name, buf, saved in buffers:
                if getattr(module, name, None) is not buf:
                    setattr(module, name, buf)
                buf.copy_(saved)
        for module, training in modes:
            module.training = training


def detect_model_anomalies(model: torch.nn.Module, x: object, *, value_range: tuple[float, float] | None = None,
                           uniform_tolerance: float = 1e-6) -> dict[str, Any]:
    """Run ``model(x)`` without gradients, in the mode the model is in, and check its output.

    The check does not change training: the model's buffers (BatchNorm's running statistics),
    its modules' train/eval modes and the global random generators are put back afterwards
    (:func:`model_kept`), so a loop that calls it after each update trains as without it.

    Anomalies (recorded on the runtime as ``torchtrace_anomalies_total{kind}`` and in the
    run history): ``nonfinite_output`` (NaN/Inf), ``output_out_of_range`` (outside
    ``value_range``), ``uniform_output`` (every sample of a batch of two or more gets the
    same prediction, within ``uniform_tolerance``: a collapsed model).

    Returns ``{"ok", "anomalies": [kind...], "output": statistics, "details": {...}}``.

    Raises:
        ValueError: ``value_range`` is not a pair ``(low, high)`` of numbers with low <= high,
            or ``uniform_tolerance`` is not a non-negative finite number (before the model runs).
    """
    value_range = _value_range(value_range)
    uniform_tolerance = _tolerance(uniform_tolerance)
    with model_kept(model), torch.no_grad():
        out = model(x)
    if isinstance(out, (tuple, list)):
        out = out[0]
    elif isinstance(out, dict):
        out = next(v for v in out.values() if isinstance(v, torch.Tensor))
    o = out.detach()
    of = o.to(torch.float64)
    spread = torch.zeros((), dtype=torch.float64, device=o.device)
    if o.dim() >= 1 and o.shape[0] >= 2:
        flat = of.reshape(o.shape[0], -1)
        spread = (flat - flat[:1]).abs().nan_to_num(nan=math.inf).amax()
    values = readout.read(torch.cat([tensor_measure.tensor_stats(o), spread.reshape(1)]).cpu())
    info = tensor_measure.describe(o, values[:-1], "output")
    anomalies: list[str] = []
    details: dict[str, Any] = {}
    if info["nan_count"] or info["inf_count"]:
        anomalies.append(semconv.NONFINITE_OUTPUT)
        details[semconv.NONFINITE_OUTPUT] = {"nan_count": info["nan_count"], "inf_count": info["inf_count"]}
    if value_range is not None and info["min"] is not None and (info["min"] < value_range[0]
                                                                or info["max"] > value_range[1]):
        anomalies.append(semconv.OUTPUT_OUT_OF_RANGE)
        details[semconv.OUTPUT_OUT_OF_RANGE] = {"min": info["min"], "max": info["max"], "range": list(value_range)}
    if o.dim() >= 1 and o.shape[0] >= 2 and values[-1] <= uniform_tolerance:
        anomalies.append(semconv.UNIFORM_OUTPUT)
        details[semconv.UNIFORM_OUTPUT] = {"max_difference": values[-1], "batch": int(o.shape[0])}
    if anomalies:
        record_anomalies(anomalies, -1, None, None, operation="detect_model_anomalies")
    return {"ok": not anomalies, "anomalies": anomalies, "output": info, "details": details}
