"""Gradient norms against a float64 reference computed element by element in Python."""

from __future__ import annotations

import math

import pytest
import torch

from torchtrace.measure import gradients as g


def ref_norm(t: torch.Tensor) -> float:
    """L2 norm in float64 by a plain loop over the elements (complex: |z|^2)."""
    if t.is_sparse:
        t = t.to_dense()
    flat = t.detach().reshape(-1).tolist()
    total = 0.0
    for v in flat:
        total += abs(complex(v)) ** 2
    return math.sqrt(total)


def params_with(grads: dict[str, torch.Tensor]) -> list[g.ParamRef]:
    refs = []
    for name, grad in grads.items():
        p = torch.nn.Parameter(torch.zeros(grad.shape, dtype=grad.dtype), requires_grad=True) if not grad.is_sparse \
            else torch.nn.Parameter(torch.zeros(grad.shape))
        p.grad = grad
        refs.append(g.ParamRef(name, p))
    return refs


def check(grads: dict[str, torch.Tensor], rel: float = 1e-6) -> None:
    stats = g.gradient_norms(params_with(grads))
    got = dict(zip(stats.names, stats.norms.tolist()))
    refs = {name: ref_norm(t) for name, t in grads.items()}
    for name, want in refs.items():
        assert got[name] == pytest.approx(want, rel=rel), name
    total = math.sqrt(sum(v * v for v in refs.values()))
    assert float(stats.total) == pytest.approx(total, rel=rel)


def test_float32_dense():
    torch.manual_seed(0)
    check({"a": torch.randn(30, 20), "b": torch.randn(7), "c": torch.randn(3, 4, 5) * 1e-3})


def test_float64():
    torch.manual_seed(1)
    check({"a": torch.randn(10, 10, dtype=torch.float64)}, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_reduced_in_float32(dtype):
    torch.manual_seed(2)
    t = torch.randn(64, 64).to(dtype)
    check({"w": t})  # the reference reads the same low-precision values, exactly


def test_fp16_large_finite_values_do_not_overflow():
    t = torch.full((1000,), 60000.0, dtype=torch.float16)  # squares overflow fp16, not fp32
    stats = g.gradient_norms(params_with({"w": t}))
    assert math.isfinite(float(stats.total))
    assert float(stats.total) == pytest.approx(ref_norm(t), rel=1e-6)


def test_complex():
    torch.manual_seed(3)
    check({"z": torch.randn(16, 8, dtype=torch.complex64)})


def test_sparse_gradient_from_embedding():
    emb = torch.nn.Embedding(50, 8, sparse=True)
    emb(torch.tensor([1, 3, 3, 7])).sum().backward()
    assert emb.weight.grad.is_sparse
    stats = g.gradient_norms(g.named_params(emb))
    assert float(stats.total) == pytest.approx(ref_norm(emb.weight.grad), rel=1e-6)


def test_mixed_dtypes_keep_names_aligned():
    torch.manual_seed(4)
    grads = {"h": torch.randn(5).half(), "f": torch.randn(6), "d": torch.randn(7, dtype=torch.float64),
             "b": torch.randn(8).bfloat16()}
    check(grads)


def test_none_frozen_and_shared_parameters():
    torch.manual_seed(5)
    a = torch.nn.Linear(4, 4)
    b = torch.nn.Linear(4, 4)
    model = torch.nn.ModuleDict({"a": a, "b": b, "shared": a})  # a is registered twice
    b.weight.requires_grad_(False)  # frozen
    model["a"](torch.randn(2, 4)).sum().backward()
    refs = g.named_params(model)
    assert [r.name for r in refs] == ["a.weight", "a.bias", "b.weight", "b.bias"]  # shared appears once
    stats = g.gradient_norms(refs)
    assert stats.names == ["a.weight", "a.bias"]  # no grad for b (frozen / unused)
    assert float(stats.total) == pytest.approx(math.sqrt(ref_norm(a.weight.grad) ** 2 + ref_norm(a.bias.grad) ** 2),
                                                rel=1e-6)


def test_no_gradients_gives_none():
    assert g.gradient_norms(g.named_params(torch.nn.Linear(2, 2))) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_elements_give_nonfinite_norms(bad):
    t = torch.randn(10)
    t[3] = bad
    stats = g.gradient_norms(params_with({"w": t, "ok": torch.randn(4)}))
    got = dict(zip(stats.names, stats.norms.tolist()))
    assert not math.isfinite(got["w"])
    assert math.isfinite(got["ok"])
    if math.isnan(bad):
        assert math.isnan(got["w"])
    assert g.classify_infinite([t]) == [True]


def test_overflow_is_told_apart_from_inf():
    t = torch.full((4,), 3e38)  # finite float32, sum of squares overflows
    stats = g.gradient_norms(params_with({"w": t}))
    assert math.isinf(stats.norms.tolist()[0])
    assert g.classify_infinite([t]) == [False]


def test_optimizer_params_named_after_model():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD([{"params": model[1].parameters()}, {"params": model[0].parameters()}], lr=0.1)
    assert [r.name for r in g.named_params(model, opt)] == ["1.weight", "1.bias", "0.weight", "0.bias"]
    assert [r.name for r in g.named_params(None, opt)] == ["group0.param0", "group0.param1", "group1.param0",
                                                             "group1.param1"]
