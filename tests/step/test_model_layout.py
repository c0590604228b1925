"""A model whose layout changes between steps: its head replaced for fine-tuning (the body
frozen, a new optimizer for the head), a weight pruned with ``torch.nn.utils.prune`` (which
registers ``weight_orig`` in its place). The watched parameters were listed once per model:
after the change a step that names its model only kept measuring the old list, so the new
head's optimizer was not the step's (it updated no parameter of that list), nothing was
measured, and a warning blamed optimizers stepped in ``backward()``. The lists are now made
again after any module registers a submodule or a parameter (torch's global registration
hooks, from ``configure()`` to ``shutdown()``). A pruned weight keeps its parameter object
(renamed), so it was measured before as now: its test keeps it so.
"""

from __future__ import annotations

import logging

import pytest
import torch

import torchtrace as tt
from tests.helpers import norm64, seeded_batches, small_mlp


def _model_only_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor):
    """One step that names the model only; returns its record and the reference norm."""
    with tt.debug_context("train_step", model=model) as step:
        loss = model(x).pow(2).mean()
        loss.backward()
        expected = norm64(p.grad for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step.record_loss(loss)
    return step.record, expected


def test_a_replaced_head_is_measured(tt_runtime, caplog):
    caplog.set_level(logging.WARNING, logger="torchtrace")
    model = small_mlp()
    batches = seeded_batches(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record, expected = _model_only_step(model, opt, batches[0])
    assert record.grad_norm == pytest.approx(expected, rel=1e-5)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(3)
    model[2] = torch.nn.Linear(16, 1)  # the new head, trained alone
    head_opt = torch.optim.SGD(model[2].parameters(), lr=0.05)
    for x in batches[1:]:
        record, expected = _model_only_step(model, head_opt, x)
        assert record.grad_norm == pytest.approx(expected, rel=1e-5)
    assert not [r.getMessage() for r in caplog.records if "not measured" in r.getMessage()]


def test_a_pruned_weight_is_measured(tt_runtime):
    from torch.nn.utils import prune

    model = small_mlp()
    batches = seeded_batches(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _model_only_step(model, opt, batches[0])
    prune.l1_unstructured(model[0], "weight", amount=0.5)  # weight is now weight_orig * weight_mask
    for x in batches[1:]:
        record, expected = _model_only_step(model, opt, x)
        assert record.grad_norm == pytest.approx(expected, rel=1e-5)
