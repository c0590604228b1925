"""Statistics of one tensor, as device tensors; ``analyze_tensor`` reads them once."""

from __future__ import annotations

from typing import Any

import torch

STAT_NAMES = ("mean", "std", "min", "max", "nan_count", "inf_count")


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """mean, std, min, max over finite values, and NaN/Inf counts, as one float64 device tensor.

    Statistics ignore non-finite elements so one NaN does not hide the rest of the picture;
    with no finite element they are NaN.
    """
    x = t.detach()
    if x.is_sparse:
        x = x.coalesce().values()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.reshape(-1).to(torch.float64)
    nan = torch.isnan(x)
    inf = torch.isinf(x)
    finite = ~(nan | inf)
    n = finite.sum()
    vals = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    nf = n.to(torch.float64)
    mean = vals.sum() / nf
    var = torch.where(finite, (x - mean) ** 2, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / (nf - 1).clamp(min=1)
    big = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    mn = torch.where(finite, x, big).min() if x.numel() else big
    mx = torch.where(finite, x, -big).max() if x.numel() else -big
    nanv = torch.tensor(float("nan"), dtype=x.dtype, device=x.device)
    empty = n == 0
    return torch.stack([
        torch.where(empty, nanv, mean),
        torch.where(empty, nanv, var.sqrt()),
        torch.where(empty, nanv, mn),
        torch.where(empty, nanv, mx),
        nan.sum().to(torch.float64),
        inf.sum().to(torch.float64),
    ])


FAST_STAT_NAMES = ("mean", "std", "min", "max", "nonfinite_count")


def fast_tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """mean, std, min, max over *all* elements and the non-finite count, as one float32 device tensor.

    The per-step variant of :func:`tensor_stats` (EXTREME level): three fused passes in the
    tensor's own precision (low precision is reduced in float32), no float64 copy. With a
    non-finite element the four statistics are non-finite too, which is the point: the count
    says how many.
    """
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype != torch.float64 and x.dtype != torch.float32:
        x = x.float()
    if x.numel() == 0:
        nan = torch.full((4,), float("nan"), dtype=torch.float32, device=x.device)
        return torch.cat([nan, torch.zeros(1, dtype=torch.float32, device=x.device)])
    std, mean = torch.std_mean(x, correction=1 if x.numel() > 1 else 0)
    mn, mx = torch.aminmax(x)
    nonfinite = x.numel() - torch.isfinite(x).sum()
    return torch.stack([mean.float(), std.float(), mn.float(), mx.float(), nonfinite.float()])


def describe(t: torch.Tensor, values: list[float], name: str = "tensor") -> dict[str, Any]:
    """A tensor's description from its statistics already read to the host."""
    stats = dict(zip(STAT_NAMES, values))
    return {
        "name": name,
        "shape": list(t.shape),
        "dtype": str(t.dtype).replace("torch.", ""),
        "device": str(t.device),
        "numel": t.numel(),
        "bytes": t.numel() * t.element_size(),
        "requires_grad": bool(t.requires_grad),
        "mean": stats["mean"],
        "std": stats["std"],
        "min": stats["min"],
        "max": stats["max"],
        "nan_count": int(stats["nan_count"]),
        "inf_count": int(stats["inf_count"]),
        "has_nan": stats["nan_count"] > 0,
        "has_inf": stats["inf_count"] > 0,
    }
