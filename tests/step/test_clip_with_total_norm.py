"""A clip in two halves, torchtitan's way: ``torch.nn.utils.get_total_norm`` of the gradients, then
``torch.nn.utils.clip_grads_with_norm_`` scaling them with it (between the two, a distributed
trainer reduces the norm across its meshes). The recorded norm is the one before clipping: the
float64 norm of a run without torchtrace, summed in a plain loop, far above ``max_norm``. Before
``clip_grads_with_norm_`` was wrapped, the step measured at its optimizer's update, after the
clip: every step read as ``max_norm``, however large its gradients.
"""

from __future__ import annotations

import pytest
import torch

import torchtrace as tt
from tests.helpers import norm64, seeded_batches, small_mlp

MAX_NORM = 1.0
STEPS = 4


def _model() -> torch.nn.Module:
    return small_mlp()


def _batches() -> list[torch.Tensor]:
    return seeded_batches(STEPS, scale=100.0)  # large gradients: clipped


def _clipped_step(model, opt, x) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    params = list(model.parameters())
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total)
    opt.step()
    return loss


def _reference() -> tuple[list[float], list[float], list[torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses, norms = [], []
    for x in _batches():
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        norms.append(norm64(p.grad for p in model.parameters()))
        params = list(model.parameters())
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, torch.nn.utils.get_total_norm([p.grad for p in params]))
        opt.step()
        losses.append(loss.item())
    return losses, norms, [p.detach().clone() for p in model.parameters()]


def test_the_norm_before_a_two_half_clip_is_recorded(tt_runtime):
    losses, norms, weights = _reference()
    assert min(norms) > 10 * MAX_NORM  # the case: every step is clipped
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step_fn = tt.debug_operation(name="train_step", model=model, optimizer=opt)(_clipped_step)
    records = []
    for x in _batches():
        step_fn(model, opt, x)
        records.append(tt.api.get_runtime().history.last_record)
    assert [r.loss for r in records] == losses  # bit for bit
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert [r.grad_norm for r in records] == pytest.approx(norms, rel=1e-5)


def test_skip_decided_at_the_clip_leaves_the_weights_unchanged(tmp_path):
    tt.configure(service_name="test", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                 register_atexit=False, guard="skip")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, x in enumerate(seeded_batches(STEPS, scale=100.0, nan_at=2)):
        before = [p.detach().clone() for p in model.parameters()]
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            step.record_loss(_clipped_step(model, opt, x))
        unchanged = [torch.equal(a, p) for a, p in zip(before, model.parameters())]
        assert unchanged == [i == 2] * len(unchanged)
        assert step.record.skipped is (i == 2)
