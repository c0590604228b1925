"""The recorded gradient norm is the one before the user's clipping (telemetry contract), and
clipping under torchtrace gives the same weights as without it."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import torchtrace as tt


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _reference_norm(model, x) -> float:
    """Global L2 norm of the unclipped gradients, float64, plain loop, on a copy."""
    ref = copy.deepcopy(model)
    ref.zero_grad()
    (ref(x).pow(2).sum() * 100).backward()
    return math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in ref.parameters()))


def _step(model, opt, x, clip):
    opt.zero_grad()
    (model(x).pow(2).sum() * 100).backward()
    result = clip(model)
    opt.step()
    return result


CLIPS = {
    "norm": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.01),
    "norm_module_path": lambda m: torch.nn.utils.clip_grad.clip_grad_norm_(m.parameters(), 0.01, foreach=True),
    "value": lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), clip_value=1e-4),
}


@pytest.mark.parametrize("kind", sorted(CLIPS))
@pytest.mark.parametrize("with_optimizer", [True, False])
def test_grad_norm_is_measured_before_clipping(tt_runtime, kind, with_optimizer):
    model = _net()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    torch.manual_seed(1)
    xs = [torch.randn(4, 8) for _ in range(4)]
    for x in xs:
        want = _reference_norm(model, x)
        with tt.debug_context("train_step", model=model, optimizer=opt if with_optimizer else None) as step:
            got_clip = _step(model, opt, x, CLIPS[kind])
        twin_clip = _step(twin, twin_opt, x, CLIPS[kind])
        assert step.record.grad_norm == pytest.approx(want, rel=1e-6)
        assert want > 1.0  # far above what clipping leaves: the clipped norm would be <= 0.01-ish
        if got_clip is not None:  # clip_grad_norm_ still returns torch's own total norm
            assert float(got_clip) == float(twin_clip)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)  # clipping under torchtrace changes nothing


def test_clip_outside_a_step_is_torchs_own(tt_runtime):
    model = _net()
    (model(torch.randn(4, 8)).sum()).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    ref = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
    assert float(total) == pytest.approx(ref, rel=1e-6)
    assert getattr(torch.nn.utils.clip_grad_norm_, "__torchtrace_wrapped__", False)


def test_guard_skip_applies_when_the_user_clips(tmp_path):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False, guard="skip")
    try:
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = [p.detach().clone() for p in model.parameters()]
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            opt.zero_grad()
            (model(torch.randn(4, 8)).sum() * float("nan")).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # NaN gradients would spread here
            opt.step()
        assert step.record.skipped
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    finally:
        tt.shutdown()


def test_a_fault_in_the_clip_wrapper_is_counted_not_raised(tmp_path, monkeypatch):
    from torchtrace import api

    def boom(self, optimizer=None):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(api.StepScope, "check_gradients_now", boom)
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=False, register_atexit=False)
    try:
        model = _net()
        twin = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
        x = torch.randn(4, 8)
        with tt.debug_context("train_step", model=model, optimizer=opt):
            got = _step(model, opt, x, CLIPS["norm"])
        want = _step(twin, twin_opt, x, CLIPS["norm"])
        assert float(got) == float(want)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
        assert api.get_runtime().errors.by_component.get("gradients", 0) >= 1
    finally:
        tt.shutdown()
