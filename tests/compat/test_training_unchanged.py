"""The seed APIs that run work on the side of the user's training (a speed-up measurement on a
copy, an output check) leave the training result bit-for-bit as the same loop without them:
the reference is a plain torch loop, compared with ``torch.equal``."""

from __future__ import annotations

import time

import torch

import torchtrace as tt
from torchtrace import PyTorchOptimizer


def dropout_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))


def regression_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def plain_loop(model: torch.nn.Module, data: list, epochs: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(epochs):
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()


def test_the_speedup_measurement_leaves_a_dropout_models_training_as_the_plain_loop():
    """Before, ``optimize_training_loop(measure_speedup=True)`` (the default) measured the
    speed-up on a copy before training with draws from the global RNG: a model with Dropout
    then trained to other parameters than with ``measure_speedup=False`` or a plain loop. Now
    the measurement puts the RNG back and the parameters equal the plain loop's bit for bit."""
    data = regression_batches(8)
    reference = dropout_model()
    torch.manual_seed(7)
    plain_loop(reference, data, epochs=2)

    model = dropout_model()
    torch.manual_seed(7)
    result = PyTorchOptimizer(mode="memory_efficient").optimize_training_loop(
        model, data, torch.optim.SGD(model.parameters(), lr=0.05), torch.nn.MSELoss(), epochs=2,
        measure_speedup=True)
    tt.shutdown()
    assert result["optimization_metrics"]["speedup_factor"] is not None
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))


def batchnorm_dropout_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))


def train_with_check(check: bool) -> torch.nn.Module:
    model = batchnorm_dropout_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(5)
    for x, y in regression_batches(10):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if check:
            assert tt.detect_model_anomalies(model, x)["ok"]
            assert model.training
    return model


def test_detect_model_anomalies_in_a_training_loop_leaves_the_training_as_without_it():
    """Before, ``detect_model_anomalies(model, x)`` after each update ran the model in train
    mode: BatchNorm counted 20 batches instead of 10 (running mean off by 0.103) and Dropout
    drew from the global RNG. Now buffers, mode and random generators are as it found them:
    parameters and buffers equal the loop without the check bit for bit."""
    reference, checked = train_with_check(False), train_with_check(True)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), checked.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(reference.buffers(), checked.buffers()))
    assert int(checked[1].num_batches_tracked) == 10


def test_monitor_only_steps_book_the_loop_between_them_as_training_not_data_wait(tt_runtime):
    """Seed 001's loop calls ``TrainingDebugger.monitor_training_step`` after backward: its step
    covers the check only, the forward, backward and update lie between two calls. Before,
    that gap was data wait (8.99 s of data wait beside 0.04 s of steps) and raised data_stall
    in a loop that loads no data. Now the time between two monitor calls is the loop's
    training: data wait stays near 0 (here under 5 % of the 15 ms of work measured between
    the calls) and no data_stall is raised."""
    from tests.compat.common import metric
    from torchtrace import TrainingDebugger, semconv

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    debugger = TrainingDebugger()
    between = 0.0
    for step in range(30):
        began = time.perf_counter()
        opt.step()
        opt.zero_grad()
        time.sleep(0.015)  # the model's forward and backward, as long as a real one
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        between += time.perf_counter() - began if step else 0.0
        debugger.monitor_training_step(model, loss, step)
    waited = metric("torchtrace_data_wait_seconds_sum", operation="training_step")
    assert waited is not None and waited < 0.05 * between
    assert not metric(semconv.M_ANOMALIES, operation="training_step", kind=semconv.DATA_STALL)
