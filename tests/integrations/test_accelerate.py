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


def _accumulating_run(tmp_path, guard: str | None, nan_at: int) -> tuple[list[int], torch.Tensor, int]:
    """accelerate's accumulation loop (``with accelerator.accumulate(model):`` in the decorated
    step, four micro-batches an update), twelve micro-batches, a NaN in micro-batch
    ``nan_at``. ``guard``: torchtrace's, or None for the plain loop, which drops the update the
    NaN reaches as ``skip`` does (for ``warn`` it is applied). Returns where the updates fell
    (``sync_gradients`` after each call), the weights and the scheduler's position."""
    torch.manual_seed(0)
    acc = accelerate.Accelerator(gradient_accumulation_steps=4, cpu=True)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    model, opt, sched = acc.prepare(model, opt, sched)
    bad_update = (nan_at // 4) * 4 + 3

    def train_step(x, y, drop=False):
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            if drop and acc.sync_gradients:
                for p in model.parameters():
                    p.grad = None
            opt.step()
            sched.step()
            opt.zero_grad()
        return loss

    if guard is not None:
        tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True, guard=guard)
        train_step = tt.debug_operation(name="train_step", model=model, optimizer=opt)(train_step)
    data = torch.Generator().manual_seed(1)
    syncs = []
    try:
        for i in range(12):
            x, y = torch.randn(8, 4, generator=data), torch.randn(8, 2, generator=data)
            if i == nan_at:
                x[0, 0] = float("nan")
            if guard is None:
                train_step(x, y, drop=i == bad_update)
            else:
                train_step(x, y)
            syncs.append(int(acc.sync_gradients))
        if guard is not None:
            assert get_runtime().forensics.replays >= 1
    finally:
        if guard is not None:
            tt.shutdown()
    return syncs, model.weight.detach().clone(), sched.scheduler.last_epoch


@pytest.mark.parametrize("nan_at", [5, 7])
def test_a_replay_inside_accelerates_accumulate_leaves_its_micro_batch_count_alone(tmp_path, nan_at):
    """The replay called the step again, and ``accumulate()`` counted one micro-batch more: the
    updates fell on other micro-batches from then on; replayed in the update's hook (micro-batch
    7), it also turned the update's ``sync_gradients`` off, and the scheduler missed a step.
    Under ``skip`` the run equals the plain loop that drops the bad update itself."""
    plain_syncs, plain_weights, plain_epoch = _accumulating_run(tmp_path / "plain", None, nan_at)
    syncs, weights, epoch = _accumulating_run(tmp_path / "skip", "skip", nan_at)
    assert plain_syncs == syncs == [0, 0, 0, 1] * 3
    assert epoch == plain_epoch == 3
    assert torch.equal(weights, plain_weights)
