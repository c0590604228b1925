"""Operations inside operations that hold training steps (an epoch, a run of epochs): the FLOPs
of evaluation steps inside them and the goodput class of their own time, each against a
reference computed another way (FlopCounterMode on the same call, planted sleeps)."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import torchtrace as tt
from torchtrace.api import get_runtime


def _configure(tmp_path):
    return tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)


def _steps():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @tt.debug_operation(model=model, optimizer=opt)
    def train_step(x):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    @tt.debug_operation(model=model, kind="evaluation")
    def eval_step(x):
        with torch.no_grad():
            return model(x).mean()

    return model, train_step, eval_step


@pytest.mark.parametrize("validate_op", [False, True])
def test_evaluation_inside_an_epoch_gets_its_flops(tmp_path, validate_op):
    """A decorated epoch: training steps, then evaluation steps (directly, or inside a decorated
    validation pass). The epoch holds training steps, so its count is dropped; the evaluation
    steps inside it had no FLOPs at all (every epoch, before and after their shapes were seen),
    as if an outer operation counted them. Now the evaluation is counted as it is without the
    epoch: each evaluation step's FLOPs (or the validation pass's, the outermost below the
    epoch) are FlopCounterMode's, counted once."""
    _configure(tmp_path)
    try:
        model, train_step, eval_step = _steps()

        @tt.debug_operation(kind="evaluation")
        def validate():
            for _ in range(3):
                eval_step(torch.randn(4, 8))

        @tt.debug_operation(name="epoch")
        def epoch():
            for _ in range(3):
                train_step(torch.randn(4, 8))
            if validate_op:
                validate()
            else:
                for _ in range(3):
                    eval_step(torch.randn(4, 8))

        for _ in range(3):
            epoch()
        with FlopCounterMode(display=False) as reference:
            with torch.no_grad():
                model(torch.randn(4, 8)).mean()
        per_eval = reference.get_total_flops()
        rt = get_runtime()
        rt.finish_deferred(block=True)
        rows = rt.history.steps()
        flops = {op: [r.get("flops") for r in rows if r["operation"] == op] for op in ("eval_step", "validate", "epoch")}
        assert flops["epoch"] == [None] * 3
        if validate_op:
            assert flops["validate"] == [3 * per_eval] * 3
            assert flops["eval_step"] == [None] * 9  # (the pass holds their count: not twice)
        else:
            assert flops["eval_step"] == [per_eval] * 9
    finally:
        tt.shutdown()


def test_the_tail_of_a_run_of_epochs_is_data_wait(tmp_path):
    """A decorated run around decorated epochs around training steps: what the run does after
    its last epoch (a planted sleep, no step: a final validation or save) was counted as
    productive, since only the epoch, the step's direct parent, was known to hold steps. It is
    data wait, as it is without the run operation; productive is the steps' own time."""
    _configure(tmp_path)
    try:
        _, train_step, _ = _steps()
        own = []

        def timed_step():
            t = time.perf_counter()
            train_step(torch.randn(4, 8))
            own.append(time.perf_counter() - t)

        @tt.debug_operation(name="epoch")
        def epoch():
            for _ in range(3):
                timed_step()

        @tt.debug_operation(name="run")
        def run():
            for _ in range(2):
                epoch()
                time.sleep(0.2)

        run()
        rt = get_runtime()
        rt.finish_deferred(block=True)
        booked = rt.summary()["throughput"]
        assert booked["productive_s"] == pytest.approx(sum(own), abs=0.05)  # (not the 0.2 s after the last epoch)
        assert booked["badput_s"]["data_wait"] >= 0.4
    finally:
        tt.shutdown()


@pytest.mark.parametrize("throughput", [True, False], ids=["throughput", "no-throughput"])
def test_an_operation_holding_training_steps_leaves_the_gradients_to_them(tmp_path, caplog, throughput):
    """An epoch given its model, around steps that name their optimizer: the steps measure and
    guard their gradients; the epoch measures none at its end (it would find its last step's)
    and does not say that ``guard="skip"`` cannot act for it (its steps' guard did)."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True, guard="skip",
                 throughput=throughput)
    caplog.set_level("WARNING", logger="torchtrace")
    model, train_step, _ = _steps()
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with tt.debug_context("epoch", model=model, kind="other") as epoch:
        for x in batches:
            train_step(x)
            assert get_runtime().history.last_record.grad_norm is not None  # the step's own
    assert epoch.record.grad_norm is None and not epoch.record.grad_names
    assert not [r for r in caplog.records if "cannot skip" in r.getMessage()]


def test_an_operation_around_evaluation_steps_still_measures_its_own_gradients(tmp_path):
    """Only training steps inside take the gradients over: an operation whose inner steps are
    evaluations measures the gradients its own backward made."""
    _configure(tmp_path)
    model, _, eval_step = _steps()
    x = torch.randn(4, 8)
    with tt.debug_context("train_and_look", model=model) as outer:
        model(x).pow(2).mean().backward()
        eval_step(x)
    expected = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()]))
    assert outer.record.grad_norm == pytest.approx(float(expected), rel=1e-6)


def test_a_loss_function_decorated_inside_the_step_leaves_the_step_its_gradients(tmp_path):
    """A training step with a hand-written update (no optimizer: measured at its end) calls a
    loss function decorated on its own, which names the model too. The loss function measured
    nothing before an update, so the step still measures its gradients."""
    _configure(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)

    @tt.debug_operation(model=model)
    def loss_fn(model, x):
        return model(x).pow(2).mean()

    @tt.debug_operation(model=model)
    def train_step(model, x):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, x)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.01)
        return loss

    for i in range(3):
        train_step(model, torch.randn(4, 8, generator=torch.Generator().manual_seed(i)))
        record = get_runtime().history.last_record
        assert record.operation == "train_step"
        expected = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()]))
        assert record.grad_norm == pytest.approx(float(expected), rel=1e-6)
