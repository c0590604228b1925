"""Result shapes the seeds' users type: dict access and attribute access both work.

>>> r = Result(has_nan=False, mean=1.5)
>>> r["has_nan"], r.has_nan, r.mean
(False, False, 1.5)
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable


class Result(dict):
    """A ``dict`` whose keys are also attributes (``info["has_nan"]`` and ``info.has_nan``).

    A missing name raises ``AttributeError`` (so ``getattr(r, "x", None)`` and ``hasattr``
    behave), a missing key ``KeyError``, as for any dict.
    """

    # Any: a key's value, whatever the caller stored.
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no key or attribute {name!r}; "
                                 f"keys: {', '.join(sorted(map(str, self)))}") from None

    def __setattr__(self, name: str, value: object) -> None:
        self[name] = value

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | {k for k in self if isinstance(k, str)})


def tensor_info(desc: dict[str, Any]) -> Result:
    """A tensor description (:func:`torchtrace.measure.tensors.describe`) with the seeds' names.

    Adds ``mean_value``, ``std_value``, ``min_value``, ``max_value`` (the statistics over
    finite values) and ``memory_usage`` (bytes) beside ``mean``/``std``/``min``/``max``/``bytes``.

    >>> tensor_info({"mean": 2.0, "std": 0.0, "min": 2.0, "max": 2.0, "bytes": 4}).mean_value
    2.0
    """
    out = Result(desc)
    for key in ("mean", "std", "min", "max"):
        if key in out:
            out[f"{key}_value"] = out[key]
    if "bytes" in out:
        out["memory_usage"] = out["bytes"]
    return out


def _number(other: object) -> float | None:
    if isinstance(other, bool) or not isinstance(other, numbers.Real):
        return None
    return float(other)


class GradientReport(Result):
    """``check_gradients``' result: a dict (and attributes) that also works as the global norm.

    ``float(report)`` is the global L2 norm (NaN when there is no gradient, NaN/Inf when one
    is non-finite), and ``report > 1.0``, ``report <= x`` compare that number, so seed code
    written as ``norm = debugger.check_gradients(model)`` keeps working.

    Keys: ``global_norm`` (= ``gradient_norm``), ``param_stats`` (= ``parameter_stats``: name ->
    norm, mean, std, min, max, nan/inf counts), ``nonfinite_params``, ``exploded_params``,
    ``vanished_params``, ``params_with_nan_grad``, ``params_with_inf_grad``, ``anomalies``
    (dicts with ``kind``), ``gradient_anomalies`` (one sentence each, saying NaN/Inf where
    it is), ``threshold``, ``vanishing_threshold``, ``step``, ``loss``, ``enabled``.

    >>> r = GradientReport(global_norm=2.0)
    >>> float(r), r > 1.0, r < 1.0
    (2.0, True, False)
    """

    def __float__(self) -> float:
        value = self.get("global_norm")
        return float("nan") if value is None else float(value)

    def _cmp(self, other: object, op: Callable[[float, float], bool]) -> bool:
        x = _number(other)
        return NotImplemented if x is None else op(float(self), x)

    def __gt__(self, other: object) -> bool:
        return self._cmp(other, lambda a, b: a > b)

    def __ge__(self, other: object) -> bool:
        return self._cmp(other, lambda a, b: a >= b)

    def __lt__(self, other: object) -> bool:
        return self._cmp(other, lambda a, b: a < b)

    def __le__(self, other: object) -> bool:
        return self._cmp(other, lambda a, b: a <= b)

    def is_finite(self) -> bool:
        return math.isfinite(float(self))


class ParameterAnalysis(Result):
    """``analyze_model_parameters``' result: parameter name -> tensor info (a :class:`Result`).

    The totals are attributes, not keys, so ``for name, info in result.items()`` sees
    parameters only: ``total_parameters``, ``trainable_parameters``, ``frozen_parameters``,
    ``parameter_bytes``, ``nonfinite_params`` and ``summary`` (all of them as one dict).
    """

    def __init__(self, per_param: dict[str, Result], summary: dict[str, Any]) -> None:
        super().__init__(per_param)
        object.__setattr__(self, "summary", summary)

    # Any: a key's value, whatever the caller stored.
    def __getattr__(self, name: str) -> Any:
        summary = self.__dict__.get("summary", {})
        if name in summary:
            return summary[name]
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)


__all__ = ["GradientReport", "ParameterAnalysis", "Result", "tensor_info"]
