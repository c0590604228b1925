"""Counts a step was given or read back: what ``record_batch`` was given, checked, and the
device counts (a mask's tokens, a packed row's sequences) as read to the host."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch


def checked_overrides(samples: Any = None, tokens: Any = None, flops: Any = None) -> tuple[tuple, str | None]:
    """What ``StepScope.record_batch`` was given, each value that is not valid left out (so
    that what torchtrace infers or counts stands in for it), and a message naming every such
    argument with its accepted values (None when all were valid). Never raises: it runs
    inside the user's step. Counters only grow, so a negative count is not valid.

    >>> checked_overrides(samples=8, tokens="512")
    ((8, None, None), "tokens='512' ignored; accepted values: an integer >= 0 or a one-element device tensor")
    """
    problems: list[str] = []
    samples = _checked_count("samples", samples, problems)
    tokens = _checked_count("tokens", tokens, problems)
    if flops is not None:
        if isinstance(flops, numbers.Real) and not isinstance(flops, bool) and math.isfinite(flops) and flops >= 0:
            flops = float(flops)
        else:
            problems.append(f"flops={flops!r} ignored; accepted values: a finite number >= 0")
            flops = None
    return (samples, tokens, flops), "; ".join(problems) or None


def _checked_count(name: str, value: Any, problems: list[str]) -> int | torch.Tensor | None:
    """A count ``record_batch`` was given: an integer, or a one-element device tensor (read
    with the step's one read, checked then); None, with a problem named, for anything else."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and not value.is_complex():
            return value.detach().reshape(())
        problems.append(f"{name}=<tensor of shape {tuple(value.shape)}> ignored; accepted values: an integer >= 0 "
                        "or a one-element device tensor")
        return None
    if _is_count(value):
        return int(value)
    problems.append(f"{name}={value!r} ignored; accepted values: an integer >= 0 or a one-element device tensor")
    return None


def device_count(value: float) -> int | None:
    """A device count (tokens, samples) as read to the host: None when it is no count (NaN,
    Inf, negative)."""
    return int(value) if math.isfinite(value) and value >= 0 else None


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0
