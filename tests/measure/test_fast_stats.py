"""The per-step activation statistics against a float64 reference computed by a plain loop."""

from __future__ import annotations

import math

import pytest
import torch

from torchtrace.measure.tensors import FAST_STAT_NAMES, fast_raw_stats, finish_fast_stats


def fast_tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """The EXTREME path for one tensor: device reductions, one read, host finishing."""
    raw, n = fast_raw_stats(t)
    return torch.tensor(finish_fast_stats(torch.stack(raw).double().tolist(), n), dtype=torch.float64)


def reference(t: torch.Tensor) -> dict:
    vals = [float(v) for v in t.detach().double().reshape(-1).tolist()]
    n = len(vals)
    mean = sum(vals) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(vals), "max": max(vals),
            "nonfinite": 1.0 if any(not math.isfinite(v) for v in vals) else 0.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_fast_stats_match_reference(dtype):
    torch.manual_seed(0)
    t = (torch.randn(37, 11) * 3 + 1).to(dtype)
    got = dict(zip(FAST_STAT_NAMES, fast_tensor_stats(t).tolist()))
    want = reference(t)
    for key in ("mean", "std", "min", "max"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert got["nonfinite"] == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_fast_stats_flag_nonfinite_and_show_it(bad):
    t = torch.randn(100)
    t[37] = bad
    got = dict(zip(FAST_STAT_NAMES, fast_tensor_stats(t).tolist()))
    assert got["nonfinite"] == 1
    assert not math.isfinite(got["mean"])


def test_fast_stats_large_finite_values_are_not_flagged():
    t = torch.full((10,), 1e15)  # squares 1e30: finite in float32
    got = dict(zip(FAST_STAT_NAMES, fast_tensor_stats(t).tolist()))
    assert got["nonfinite"] == 0 and got["mean"] == pytest.approx(1e15)


def test_fast_stats_single_and_empty():
    one = dict(zip(FAST_STAT_NAMES, fast_tensor_stats(torch.tensor([2.5])).tolist()))
    assert one == {"mean": 2.5, "std": 0.0, "min": 2.5, "max": 2.5, "nonfinite": 0}
    empty = fast_tensor_stats(torch.empty(0)).tolist()
    assert all(math.isnan(v) for v in empty[:4]) and empty[4] == 0


class _Mixed(torch.nn.Module):
    """Layers whose outputs differ in dtype and size, one of them empty and one holding a NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 4).double()
        self.c = torch.nn.Identity()
        self.d = torch.nn.Identity()

    def forward(self, x):
        y = self.b(self.a(x).double())
        self.c(torch.empty(0))
        z = y.clone()
        z[0, 1] = float("nan")
        return self.d(z)


def test_layer_hooks_batch_the_per_layer_statistics():
    # The hooks keep raw sums per call and finish every row in one vectorised pass at the
    # end of the step: each row must equal the float64 plain-loop reference of that output.
    from torchtrace.measure.activations import LayerHooks

    torch.manual_seed(1)
    model = _Mixed()
    outputs = {}
    for name in ("a", "b", "c", "d"):
        getattr(model, name).register_forward_hook(lambda m, i, o, name=name: outputs.__setitem__(name, o.detach()))
    hooks = LayerHooks(model, fast=True)
    model(torch.randn(3, 6))
    hooks.remove()
    rows = hooks.rows(hooks.stacked().reshape(-1).tolist())
    assert [r["name"] for r in rows] == ["a", "b", "c", "d"]
    for row in rows:
        out = outputs[row["name"]]
        if out.numel() == 0:
            assert all(math.isnan(row[k]) for k in ("mean", "std", "min", "max")) and row["nonfinite"] == 0
            continue
        want = reference(out)
        assert row["nonfinite"] == want["nonfinite"]
        if want["nonfinite"]:
            assert math.isnan(row["mean"])
            continue
        for key in ("mean", "std", "min", "max"):
            assert row[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (row["name"], key)


def test_nonfinite_flag_when_the_row_sum_overflows_but_every_value_is_finite():
    big = 1.5e308  # finite in float64; the four add to more than float64 can hold
    assert finish_fast_stats([big, big, big, big], 4)[4] == 0
    assert finish_fast_stats([1.0, float("inf"), 0.0, 1.0], 4)[4] == 1
    assert finish_fast_stats([float("nan"), 1.0, 0.0, 1.0], 4)[4] == 1
    assert finish_fast_stats([1.0, 1.0, float("-inf"), 1.0], 4)[4] == 1
