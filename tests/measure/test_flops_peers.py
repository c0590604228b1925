"""The step's FLOP count beside other users of PyTorch's dispatch and profiler in the same
process: a FLOP measurement of the user's own on a meta-device copy, the user's
``torch.profiler``, and the user's FlopCounterMode inside an epoch. Every count is checked
against FlopCounterMode on a plain copy of the model, outside torchtrace."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import torchtrace as tt
from torchtrace.api import get_runtime
from torchtrace.measure.flops import StepFlops


@pytest.fixture
def run(tmp_path):
    """torchtrace configured for the test, shut down after it."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True, peak_flops=1e12)
    yield
    tt.shutdown()


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _body(model, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _batch(rows=8):
    torch.manual_seed(1)
    return torch.randn(rows, 16), torch.randn(rows, 4)


def _reference(rows=8):
    """One step on a plain copy of the model, counted by FlopCounterMode outside torchtrace."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with FlopCounterMode(display=False) as ref:
        _body(model, opt, *_batch(rows))
    return ref.get_total_flops()


def _meta_flops():
    """FLOPs of a forward and backward of a meta-device copy, counted by a FlopCounterMode of
    the user's (as Lightning's ``measure_flops`` does): nothing runs for them."""
    with torch.device("meta"):
        model, x = _mlp(), torch.empty(8, 16)
    with FlopCounterMode(display=False) as mine:
        model(x).sum().backward()
    return mine.get_total_flops()


def _records(operation):
    rt = get_runtime()
    rt.finish_deferred(block=True)
    return [r for r in rt.history.steps() if r["operation"] == operation]


# ------------------------------------------------------------------ meta-device ops
def test_ops_on_meta_tensors_inside_a_count_are_not_counted():
    """Meta tensors compute nothing: a meta copy's forward and backward inside the counted
    code add no FLOPs (they doubled the step's count)."""
    cache = StepFlops()
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cache.counting("step"):
        _meta_flops()
        _body(model, opt, *_batch())
    assert cache.lookup("step") == _reference()


def test_a_lazy_meta_measurement_inside_the_first_step_leaves_the_steps_flops_alone(run):
    """Lightning's advice: ``measure_flops`` on a meta-device copy, here done lazily in the first
    training step. Every step's FLOPs equal a plain count of the step, and the user's own
    measurement equals the same measurement without torchtrace."""
    reference, meta_reference = _reference(), _meta_flops()
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    measured = []

    @tt.debug_operation(model=model, optimizer=opt, name="train_step")
    def train_step(x, y):
        if not measured:
            measured.append(_meta_flops())
        return _body(model, opt, x, y)

    for _ in range(3):
        train_step(*_batch())
    assert measured == [meta_reference] and meta_reference > 0
    assert [r["flops"] for r in _records("train_step")] == [reference] * 3


def test_the_users_mode_around_a_count_still_counts_meta_ops(run):
    """The user's FlopCounterMode around torchtrace's counted step keeps its exact count, the
    meta copy's ops included (theirs to count), while the step's own count leaves them out."""
    torch.manual_seed(0)
    plain = _mlp()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    with FlopCounterMode(display=False) as ref:
        _meta_flops()
        _body(plain, plain_opt, *_batch())
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tt.debug_operation(model=model, optimizer=opt, name="train_step")
    def train_step(x, y):
        _meta_flops()
        return _body(model, opt, x, y)

    with FlopCounterMode(display=False) as mine:
        train_step(*_batch())
    assert mine.get_total_flops() == ref.get_total_flops()
    assert [r["flops"] for r in _records("train_step")] == [_reference()]
