"""Shared pieces of the seed tests: small models in place of the seeds' domain models,
references computed another way (float64, plain loops), a seed-style logger and readers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from torchtrace import semconv


def small_classifier(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def batches(n: int = 3, seed: int = 1, classes: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(5, 6, generator=g)
        y = torch.randint(0, 3, (5,), generator=g) if classes else torch.randn(5, 3, generator=g)
        out.append((x, y))
    return out


def ref_norm(tensors) -> float:
    """Global L2 norm by a plain Python loop in float64."""
    return math.sqrt(math.fsum(float(v) ** 2 for t in tensors for v in t.detach().double().reshape(-1).tolist()))


def ref_stats(t: torch.Tensor) -> dict[str, float]:
    vals = [float(v) for v in t.detach().double().reshape(-1).tolist()]
    finite = [v for v in vals if math.isfinite(v)]
    mean = math.fsum(finite) / len(finite)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in finite) / (len(finite) - 1)) if len(finite) > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(finite), "max": max(finite),
            "nan": sum(math.isnan(v) for v in vals), "inf": sum(math.isinf(v) for v in vals)}


class SeedLogger:
    """A seed-style training logger: log_info / log_warning / log_error, each call recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def log_info(self, message, *args, **kwargs):
        self.calls.append(("info", str(message)))

    def log_warning(self, message, *args, **kwargs):
        self.calls.append(("warning", str(message)))

    def log_error(self, message, *args, **kwargs):
        self.calls.append(("error", str(message)))

    def of(self, level: str) -> list[str]:
        return [m for lv, m in self.calls if lv == level]


def spans(result) -> list[dict]:
    from tests.helpers import read_spans

    return read_spans(result.spans_path)


def metric(name: str, **labels) -> float | None:
    from torchtrace.api import get_runtime

    rt = get_runtime(create=False)
    full = {"run_id": rt.settings.run_id, "rank": "0", **{k: str(v) for k, v in labels.items()}}
    return rt.metrics.registry.get_sample_value(name, full)


def chrome_trace_ops(path) -> set[str]:
    data = json.loads(Path(path).read_text())
    return {e.get("name", "") for e in data["traceEvents"]}


ANOMALIES = semconv.M_ANOMALIES
