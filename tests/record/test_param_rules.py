"""ADVANCED's per-tensor gradient rules: the exploded and vanished tensor names equal a float64
plain loop over the gradients, and BASIC names none."""

from __future__ import annotations

import math

import pytest
import torch

import torchtrace as tt
from torchtrace import semconv


def _run(tmp_path, level, explosion, vanishing, scale):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False, level=level,
                 grad_explosion_threshold=explosion, grad_vanishing_threshold=vanishing)
    try:
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        with torch.no_grad():
            model[2].weight.mul_(scale)  # the last layer's weight sets how large the gradients get
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            opt.zero_grad()
            model(torch.randn(4, 5)).pow(2).sum().backward()
            opt.step()
        norms = {n: math.sqrt(sum(float(g) ** 2 for g in p.grad.double().reshape(-1)))
                 for n, p in model.named_parameters()}
        return step.record, norms
    finally:
        tt.shutdown()


@pytest.mark.parametrize("scale", [1.0, 50.0])
def test_exploded_and_vanished_names_equal_the_plain_loop(tmp_path, scale):
    explosion, vanishing = 3.0, 0.5
    rec, norms = _run(tmp_path, "advanced", explosion, vanishing, scale)
    assert rec.grad_exploded_params == [n for n, v in norms.items() if v > explosion]
    assert rec.grad_vanished_params == [n for n, v in norms.items() if v < vanishing]
    total = math.sqrt(sum(v * v for v in norms.values()))
    assert rec.grad_norm == pytest.approx(total, rel=1e-6)
    assert (semconv.GRAD_EXPLOSION in rec.anomaly_kinds) == (total > explosion)
    if scale == 50.0:
        assert rec.grad_exploded_params  # the case exercises the names, not only the empty list


def test_global_norm_under_the_threshold_names_no_exploded_tensor(tmp_path):
    rec, norms = _run(tmp_path, "advanced", 1e6, 1e-12, 1.0)
    assert max(norms.values()) < 1e6 and rec.grad_exploded_params == [] and rec.grad_vanished_params == []


def test_basic_names_no_tensors(tmp_path):
    rec, norms = _run(tmp_path, "basic", 3.0, 0.5, 50.0)
    assert any(v > 3.0 for v in norms.values())
    assert rec.grad_exploded_params == [] and rec.grad_vanished_params == []
    assert semconv.GRAD_EXPLOSION in rec.anomaly_kinds  # the global rule still applies
