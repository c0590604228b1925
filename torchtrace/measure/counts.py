"""Counts a step was given or read back: what ``record_batch`` was given, checked, and the
device counts (a mask's tokens, a packed row's sequences) as read to the host."""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, TypeGuard

import torch

from torchtrace.config.parsers import shown

if TYPE_CHECKING:
    from torchtrace.record.readout import ReadPlan


#: What ``record_batch`` accepts for a count (one limit: an int64, what a device count holds).
COUNTS = "an integer >= 0 (below 2**63) or a one-element integer device tensor"
_MAX_COUNT = 2**63


def checked_overrides(samples: object = None, tokens: object = None, flops: object = None,
                      earlier: tuple | None = None) -> tuple[tuple, str | None]:
    """What ``StepScope.record_batch`` was given, each value that is not valid left out (so
    that what torchtrace infers or counts stands in for it), and a message naming every such
    argument with its accepted values (None when all were valid). Never raises: it runs
    inside the user's step. Counters only grow, so a negative count is not valid.

    ``earlier`` is what the step's earlier calls gave: a value this call does not give (or
    gives invalid) keeps the earlier one, so ``record_batch(samples=...)`` then
    ``record_batch(flops=...)`` keeps both.

    >>> checked_overrides(samples=8, tokens="512")
    ((8, None, None), "tokens='512' ignored; accepted values: an integer >= 0 (below 2**63) or a one-element integer device tensor")
    >>> checked_overrides(flops=10**400)[1]
    'flops=1000000000000000000000000000000000000000...<401 characters> ignored; accepted values: a finite number >= 0'
    >>> checked_overrides(flops=1e6, earlier=(8, None, None))[0]
    (8, None, 1000000.0)
    """  # noqa: E501 - a doctest's expected output is one line
    given, problem = _checked_all(samples, tokens, flops)
    if earlier is not None:
        given = tuple(old if new is None else new for new, old in zip(given, earlier))
    return given, problem


def _checked_all(samples: object, tokens: object, flops: object) -> tuple[tuple, str | None]:
    problems: list[str] = []
    try:
        samples = _checked_count("samples", samples, problems)
        tokens = _checked_count("tokens", tokens, problems)
        flops = _checked_flops(flops, problems)
    except Exception as exc:  # a value that fails even its checks (a broken __eq__, say): all left out
        return (None, None, None), f"the values could not be checked ({type(exc).__name__}) and are ignored"
    return (samples, tokens, flops), "; ".join(problems) or None


def _checked_flops(flops: object, problems: list[str]) -> float | None:
    if flops is None:
        return None
    if isinstance(flops, numbers.Real) and not isinstance(flops, bool):
        try:
            number = float(flops)  # (an int past the float range raises OverflowError)
        except (OverflowError, ValueError, TypeError):
            number = math.nan
        if math.isfinite(number) and number >= 0:
            return number
    problems.append(f"flops={shown(flops)} ignored; accepted values: a finite number >= 0")
    return None


def _checked_count(name: str, value: object, problems: list[str]) -> int | torch.Tensor | None:
    """A count ``record_batch`` was given: an integer, or a one-element device tensor (read
    with the step's one read, checked then); None, with a problem named, for anything else."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            problems.append(f"{name}=<tensor of shape {tuple(value.shape)}> ignored; accepted values: {COUNTS}")
        elif value.dtype == torch.bool or value.is_floating_point() or value.is_complex():  # (host metadata)
            problems.append(f"{name}=<tensor of dtype {value.dtype}> ignored; accepted values: {COUNTS}")
        else:
            return value.detach().reshape(())  # its sign is checked when the step's read lands
        return None
    if _is_count(value):
        return int(value)
    problems.append(f"{name}={shown(value)} ignored; accepted values: {COUNTS}")
    return None


def plan_given(given: tuple | None, plan: ReadPlan) -> tuple | None:
    """``given`` (what ``record_batch`` kept) for the host: its device counts are added to the
    step's one read instead (``given_samples``, ``given_tokens``), checked by
    :func:`read_given` when it lands, so that what was inferred is still at hand when one
    turns out to be no count. None when nothing is left for the host."""
    if given is None:
        return None
    host = list(given)
    for i, name in ((0, "given_samples"), (1, "given_tokens")):
        if isinstance(host[i], torch.Tensor):
            plan.add(name, host[i].to(torch.float64))
            host[i] = None
    return tuple(host) if any(v is not None for v in host) else None


def read_given(plan: ReadPlan, values: list[float] | None) -> tuple[dict[str, int], list[str]]:
    """The device counts ``record_batch`` was given, as read: ``({field: count}, problems)``,
    one that is no count (negative) left out and named in ``problems``."""
    counts: dict[str, int] = {}
    problems: list[str] = []
    for field in ("samples", "tokens"):
        value = plan.first("given_" + field, values)
        if value is None:
            continue
        count = device_count(value)
        if count is None:
            problems.append(f"{field}=<tensor holding {value:g}> ignored; accepted values: {COUNTS}")
        else:
            counts[field] = count
    return counts, problems


def device_count(value: float) -> int | None:
    """A device count (tokens, samples) as read to the host: None when it is no count (NaN,
    Inf, negative)."""
    return int(value) if math.isfinite(value) and value >= 0 else None


def _is_count(value: object) -> TypeGuard[numbers.Integral]:
    # (numbers.Integral declares no comparison to an int in the stubs; every integer has one)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and \
        0 <= value < _MAX_COUNT  # type: ignore[operator]
