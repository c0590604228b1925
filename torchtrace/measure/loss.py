"""The loss of a step, as the user hands it over: a tensor, a number, or inside a return value."""

from __future__ import annotations

from typing import Any

import torch


def extract_loss(result: Any) -> Any:
    """The loss from a step's return value: a scalar tensor, a dict's "loss", an object's .loss."""
    if isinstance(result, torch.Tensor):
        return result if result.numel() == 1 else None
    if isinstance(result, dict):
        value = result.get("loss")
    else:
        value = getattr(result, "loss", None)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None
