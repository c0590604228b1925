"""Small helpers shared by tests: reading spans, scraping metrics."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import torch
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

import torchtrace as tt


def read_spans(path) -> list[dict]:
    tt.flush()
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def scrape(url: str, openmetrics: bool = False) -> dict:
    """{(name, frozenset(labels)): value} from a real HTTP scrape; exemplars under key 'exemplars'."""
    headers = {"Accept": "application/openmetrics-text; version=1.0.0"} if openmetrics else {}
    req = urllib.request.Request(url, headers=headers)
    body = urllib.request.urlopen(req, timeout=5).read().decode()
    families = parse_openmetrics(body) if openmetrics else parse_text(body)
    out: dict = {"exemplars": []}
    for fam in families:
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
            if getattr(s, "exemplar", None):
                out["exemplars"].append((s.name, s.labels, s.exemplar))
    return out


def value(samples: dict, name: str, **labels) -> float:
    matches = [v for (n, ls), v in ((k, v) for k, v in samples.items() if k != "exemplars")
               if n == name and all(dict(ls).get(k) == str(x) for k, x in labels.items())]
    assert len(matches) == 1, f"{name} {labels}: {len(matches)} series"
    return matches[0]


class DifferentiatingModel(torch.nn.Module):
    """Computes in its own forward: the derivative of its output with respect to its input
    (``torch.autograd.grad`` with ``create_graph``), as physics-informed losses and gradient
    penalties do. Returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x):
        x = x.requires_grad_(True)
        u = self.net(x)
        du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        return ((du - torch.cos(x)) ** 2).mean()


def small_mlp() -> torch.nn.Module:
    """The step tests' model: an 8-16-1 MLP, seeded (the same weights at every call)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def seeded_batches(steps: int, scale: float = 1.0, nan_at: int | None = None) -> list[torch.Tensor]:
    """``steps`` batches of 4 rows for :func:`small_mlp`, the same at every call, times ``scale``;
    the first value of batch ``nan_at`` NaN."""
    gen = torch.Generator().manual_seed(1)
    batches = [scale * torch.randn(4, 8, generator=gen) for _ in range(steps)]
    if nan_at is not None:
        batches[nan_at][0, 0] = float("nan")
    return batches


def norm64(tensors) -> float:
    """The 2-norm of all of ``tensors`` together, in float64, summed in a plain loop: the
    reference a gradient norm is checked against."""
    total = 0.0
    for t in tensors:
        for v in t.detach().double().flatten().tolist():
            total += v * v
    return total ** 0.5
