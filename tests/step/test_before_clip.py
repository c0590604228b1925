"""``StepScope.before_clip``: a framework's step whose model joins only as its gradients are used
(Lightning's manual optimization) is handed the parameters a clip call inside the step clips,
before the clip; the clip itself is torch's, whatever form the parameters came in."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import torchtrace as tt


def _model_with_gradients() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    model(torch.randn(7, 6)).pow(2).sum().backward()
    return model


@pytest.mark.parametrize("form", ["generator", "keyword-generator", "list", "tensor"])
def test_the_clipped_parameters_are_handed_over_and_clipped_as_torch_clips_them(tt_runtime, form):
    model = _model_with_gradients()
    reference = copy.deepcopy(model)  # (its parameters without gradients: given a copy of each)
    for r, p in zip(reference.parameters(), model.parameters()):
        r.grad = p.grad.clone()
    params = list(model.parameters())
    if form == "tensor":
        params, ref_params = params[:1], list(reference.parameters())[:1]
    else:
        ref_params = list(reference.parameters())
    expected = torch.nn.utils.clip_grad_norm_(ref_params[0] if form == "tensor" else ref_params, 0.5)
    handed: list[list[torch.Tensor]] = []
    with tt.debug_context("framework_step") as scope:
        scope.before_clip = handed.append
        if form == "generator":
            total = torch.nn.utils.clip_grad_norm_((p for p in params), 0.5)
        elif form == "keyword-generator":
            total = torch.nn.utils.clip_grad_norm_(parameters=(p for p in params), max_norm=0.5)
        elif form == "list":
            total = torch.nn.utils.clip_grad_norm_(params, 0.5)
        else:
            total = torch.nn.utils.clip_grad_norm_(params[0], 0.5)
    assert len(handed) == 1 and [id(p) for p in handed[0]] == [id(p) for p in params]
    assert torch.equal(total, expected)
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(params, ref_params))


def test_an_empty_generator_still_gets_torchs_warning(tt_runtime):
    handed: list[list[torch.Tensor]] = []
    with tt.debug_context("framework_step") as scope:
        scope.before_clip = handed.append
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
    assert handed == [[]]
    assert any("empty generator" in str(w.message) for w in caught)
