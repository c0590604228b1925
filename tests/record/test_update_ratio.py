"""ADVANCED's update-to-weight ratio against a float64 plain-loop reference, on the sampled
steps only; settings validated."""

from __future__ import annotations

import math

import pytest
import torch

import torchtrace as tt
from tests.helpers import read_spans
from torchtrace import semconv


def _configure(tmp_path, **kw):
    return tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False,
                        level=kw.pop("level", "advanced"), **kw)


def _train(steps, optimizer_cls=torch.optim.SGD, **opt_kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    opt = optimizer_cls(model.parameters(), **opt_kw)
    names = [n for n, _ in model.named_parameters()]
    records, refs = [], []
    for _ in range(steps):
        x = torch.randn(5, 6)
        before = [p.detach().double().clone() for p in model.parameters()]
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        after = [p.detach().double() for p in model.parameters()]
        per = [math.sqrt(float(((a - b) ** 2).sum())) / math.sqrt(float((a ** 2).sum())) for a, b in zip(after, before)]
        total = math.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(after, before))) / \
            math.sqrt(sum(float((a ** 2).sum()) for a in after))
        records.append(step.record)
        refs.append((per, total))
    return names, records, refs


@pytest.mark.parametrize("optimizer_cls,opt_kw", [(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
                                                  (torch.optim.Adam, {"lr": 1e-2})])
def test_update_ratio_equals_reference_on_sampled_steps(tmp_path, optimizer_cls, opt_kw):
    result = _configure(tmp_path, update_ratio_interval=3)
    try:
        names, records, refs = _train(7, optimizer_cls, **opt_kw)
        for i, (rec, (per, total)) in enumerate(zip(records, refs)):
            if i % 3:
                assert rec.update_ratio is None and rec.update_ratios == []
                continue
            assert rec.update_ratio == pytest.approx(total, rel=1e-5)
            assert rec.update_ratios == pytest.approx(per, rel=1e-5)
            k = max(range(len(per)), key=per.__getitem__)
            assert rec.update_ratio_max_param == names[k]
            assert rec.update_ratio_max == pytest.approx(per[k], rel=1e-5)
        tt.flush()
        spans = read_spans(result.spans_path)
        sampled = [s for s in spans if semconv.UPDATE_RATIO in s["attributes"]]
        assert [s["attributes"][semconv.STEP] for s in sampled] == [0, 3, 6]
        assert sampled[1]["attributes"][semconv.UPDATE_RATIO] == pytest.approx(refs[3][1], rel=1e-5)
    finally:
        tt.shutdown()


@pytest.mark.parametrize("level,interval", [("basic", 1), ("advanced", 0)])
def test_no_update_ratio_at_basic_or_when_off(tmp_path, level, interval):
    _configure(tmp_path, level=level, update_ratio_interval=interval)
    try:
        _, records, _ = _train(3, lr=0.1)
        assert all(r.update_ratio is None for r in records)
    finally:
        tt.shutdown()


def test_guard_skip_gives_a_zero_update(tmp_path):
    _configure(tmp_path, update_ratio_interval=1, guard="skip")
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            opt.zero_grad()
            (model(torch.randn(3, 4)).sum() * float("nan")).backward()
            opt.step()
        assert step.record.skipped and step.record.update_ratio == 0.0
    finally:
        tt.shutdown()


@pytest.mark.parametrize("bad", [-1, 1.5, "often"])
def test_bad_interval_is_rejected_naming_the_setting(tmp_path, bad):
    with pytest.raises(ValueError, match="update_ratio_interval"):
        _configure(tmp_path, update_ratio_interval=bad)
