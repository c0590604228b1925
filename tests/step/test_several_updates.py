"""A step whose optimizer updates several times: the minibatch loop of a PPO update (CleanRL's
shape) inside one ``debug_context``. The gradients were measured, and guarded, at the first
update only: under ``skip`` a NaN in a later minibatch was applied, and every parameter was NaN
from then on. Now, under ``skip`` and ``raise``, every update of the step's optimizer is
guarded; a skip drops the bad update and the step's later ones. The step's statistics stay
those of its first update when every update is finite. The same holds for a step that names
only its model (``debug_context(model=...)``): the optimizer it takes for its own has every
update guarded, as the step's own optimizer does.
"""

from __future__ import annotations

import pytest
import torch

import torchtrace as tt
from tests.helpers import norm64, seeded_batches, small_mlp

MINIBATCHES = 4
BAD = (1, 2)  # (step, minibatch) holding a NaN


def _minibatches(step: int) -> list[torch.Tensor]:
    batches = seeded_batches(2 * MINIBATCHES)[step * MINIBATCHES:(step + 1) * MINIBATCHES]
    if step == BAD[0]:
        batches[BAD[1]] = batches[BAD[1]].clone()
        batches[BAD[1]][0, 0] = float("nan")
    return batches


def _update(model, opt, x) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    return loss


def _reference() -> tuple[list[torch.Tensor], float]:
    """Without torchtrace: the weights after the good updates (the bad one and the step's later
    ones left out), and the first update's gradient norm before clipping in the healthy step."""
    model = small_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for step in range(2):
        for i, x in enumerate(_minibatches(step)):
            if (step, i) >= BAD:
                break
            loss = model(x).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if first is None:
                first = norm64(p.grad for p in model.parameters())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
    return [p.detach().clone() for p in model.parameters()], first


@pytest.mark.parametrize("named", [True, False], ids=["optimizer", "model-only"])
@pytest.mark.parametrize("guard", ["skip", "raise"])
def test_every_update_of_the_step_is_guarded(tmp_path, guard, named):
    weights, first_norm = _reference()
    tt.configure(service_name="test", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                 register_atexit=False, guard=guard)
    try:
        model = small_mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        records, raised = [], []
        for step in range(2):
            try:
                with tt.debug_context("ppo_update", model=model, optimizer=opt if named else None) as scope:
                    for x in _minibatches(step):
                        loss = _update(model, opt, x)
                    scope.record_loss(loss)
            except tt.NonFiniteError:
                raised.append(step)
            records.append(scope.record)
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
        assert records[0].grad_norm == pytest.approx(first_norm, rel=1e-5) and not records[0].skipped
        assert "nonfinite_grad" in records[1].anomaly_kinds
        if guard == "skip":
            assert raised == [] and records[1].skipped
        else:
            assert raised == [1]
    finally:
        tt.shutdown()
