"""Operations inside operations that hold training steps (an epoch, a run of epochs): the FLOPs
of evaluation steps inside them and the goodput class of their own time, each against a
reference computed another way (FlopCounterMode on the same call, planted sleeps)."""

from __future__ import annotations

import time

import pytest
import torch

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
