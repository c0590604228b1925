"""A hand-written Hugging Face accelerate loop: the prepared optimizer is accelerate's wrapper
(``AcceleratedOptimizer``), which never initialises torch's ``Optimizer``, so no hook can be
registered on it. Given as ``optimizer=``, every step failed to start (no span, no record, no
guard); torchtrace now watches the torch optimizer it wraps."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import require_module

accelerate = require_module("accelerate")

import torchtrace as tt  # noqa: E402
from torchtrace.api import get_runtime  # noqa: E402


def test_an_accelerate_loop_is_watched_through_the_wrapped_optimizer(tmp_path):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True, guard="skip")
    try:
        acc = accelerate.Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
        model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=8))
        assert isinstance(opt, accelerate.optimizer.AcceleratedOptimizer)
        reference: list[float] = []

        @tt.debug_operation(name="train_step", model=model, optimizer=opt)
        def step(x, y, poison):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if poison:
                loss = loss * float("nan")
            acc.backward(loss)
            reference.append(math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters())))
            opt.step()
            return loss

        kept = None
        for i, (x, y) in enumerate(loader):
            before = [p.detach().clone() for p in model.parameters()]
            step(x, y, i == 2)
            if i == 2:
                kept = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        rt = get_runtime()
        rt.finish_deferred(block=True)
        rows = rt.history.steps()
        assert len(rows) == 6 and rt.errors.total == 0
        assert kept, "the guard's skip did not keep the parameters of the non-finite step"
        assert rows[2]["skipped"] and "nonfinite_loss" in rows[2]["anomalies"]
        finite = [i for i in range(6) if i != 2]
        # The forensic replay called the step again (the NaN one): its reference is left out.
        expected = [r for r in reference if not math.isnan(r)]
        assert [rows[i]["grad_norm"] for i in finite] == pytest.approx(expected, rel=1e-5)
        assert all(set(rows[i]["phases"]) == {"forward", "backward", "optimizer"} for i in finite)
        assert rt.history.last_record.lr == [opt.param_groups[0]["lr"]] == [1e-2]
    finally:
        tt.shutdown()
