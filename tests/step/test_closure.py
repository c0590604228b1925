"""``optimizer.step(closure)``: the gradients are computed inside the step call, after the
optimizer's pre-hook. They are measured (and guarded) when the closure's first evaluation
returns; the pre-hook used to see none (the first step) or the previous step's."""

from __future__ import annotations

import math

import pytest
import torch

import torchtrace as tt
from torchtrace.api import get_runtime


def _run(tmp_path, optimizer_class, poison_at=None, guard="warn", steps=3, **opt_args):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True, guard=guard)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = optimizer_class(model.parameters(), **opt_args)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        first_norms: list[float] = []
        kept = []

        @tt.debug_operation(name="closure_step", model=model, optimizer=opt)
        def step(i):
            calls = []

            def closure():
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                if i == poison_at:
                    loss = loss * float("nan")
                loss.backward()
                if not calls:
                    first_norms.append(math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters())))
                calls.append(1)
                return loss
            return opt.step(closure)

        for i in range(steps):
            before = [p.detach().clone() for p in model.parameters()]
            step(i)
            kept.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        rt = get_runtime()
        rt.finish_deferred(block=True)
        return rt.history.steps(), first_norms, kept
    finally:
        tt.shutdown()


@pytest.mark.parametrize("optimizer_class, opt_args", [(torch.optim.LBFGS, {"lr": 0.5, "max_iter": 3}),
                                                       (torch.optim.SGD, {"lr": 0.1})])
def test_a_closure_steps_gradients_are_the_closures(tmp_path, optimizer_class, opt_args):
    rows, first_norms, _ = _run(tmp_path, optimizer_class, **opt_args)
    assert [row["grad_norm"] for row in rows] == pytest.approx(first_norms, rel=1e-6)


def test_a_non_finite_closure_step_is_skipped_before_the_update(tmp_path):
    """guard="skip": the NaN step's gradients are cleared inside the closure, before LBFGS
    uses them, so the parameters stay as they were; the next step trains again."""
    rows, _, kept = _run(tmp_path, torch.optim.LBFGS, poison_at=1, guard="skip", lr=0.5, max_iter=3)
    assert kept == [False, True, False]
    assert rows[1]["skipped"] and "nonfinite_grad" in rows[1]["anomalies"]
