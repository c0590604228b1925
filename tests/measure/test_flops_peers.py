"""The step's FLOP count beside other users of PyTorch's dispatch and profiler in the same
process: a FLOP measurement of the user's own on a meta-device copy, the user's
``torch.profiler``, and the user's FlopCounterMode inside an epoch. Every count is checked
against FlopCounterMode on a plain copy of the model, outside torchtrace."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
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


def _recorded(step):
    """``step``, keeping each call's record (which says whether it ran under the counter)."""
    kept = []

    def call(*args):
        out = step(*args)
        kept.append(get_runtime().history.last_record)
        return out

    call.records = kept
    return call


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


# ------------------------------------------------------------------ profilers
def _profiled(steps, n):
    """``n`` steps under the user's ``torch.profiler.profile(with_flops=True)``: its
    ``aten::addmm`` calls, its FLOPs and its PythonDispatchMode events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for _ in range(n):
            steps(*_batch())
    events = prof.key_averages()
    return (sum(e.count for e in events if e.key == "aten::addmm"), sum(e.flops for e in events),
            sum(e.count for e in events if e.key == "PythonDispatchMode"))


def test_the_users_profiler_sees_the_steps_as_without_torchtrace_and_the_count_waits(run):
    """A user's profiler around steps that would be counted: it saw the counted step's ops
    twice (10 addmm for 8, 25 % more FLOPs) and the counter's PythonDispatchMode. Now the
    count waits for the first step without a profiler, and its FLOPs equal a plain count."""
    torch.manual_seed(0)
    plain = _mlp()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    expected = _profiled(lambda x, y: _body(plain, plain_opt, x, y), 4)
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step = _recorded(tt.debug_operation(model=model, optimizer=opt, name="train_step")(
        lambda x, y: _body(model, opt, x, y)))
    assert _profiled(train_step, 4) == expected and expected[0] == 8 and expected[2] == 0
    for _ in range(3):
        train_step(*_batch())
    records = train_step.records
    assert [r.flops_counted for r in records] == [False] * 4 + [True, False, False]
    assert [r.flops for r in records] == [None] * 4 + [_reference()] * 3
    assert get_runtime().throughput.flops.counts == 1


def test_a_context_without_inputs_waits_for_a_step_without_a_profiler(run):
    """The same for a step keyed by its model's call (a ``debug_context`` without inputs)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    for profiled in (True, True, False, False):
        with profile(activities=[ProfilerActivity.CPU]) if profiled else contextlib.nullcontext():
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                _body(model, opt, *_batch())
        records.append(step.record)
    assert [r.flops_counted for r in records] == [False, False, True, False]
    assert [r.flops for r in records] == [None, None, _reference(), _reference()]


def test_torchtraces_own_profiler_window_postpones_the_count_too(run, tmp_path):
    """torchtrace's own window over the first steps: their trace shows the steps as they run
    (no counter's PythonDispatchMode, each addmm once), and the first step after the window
    is counted."""
    import json

    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step = _recorded(tt.debug_operation(model=model, optimizer=opt, name="train_step")(
        lambda x, y: _body(model, opt, x, y)))
    with tt.profiling(tmp_path / "prof" / "t.json", tt.ProfileSchedule(steps=[0], active=2)) as result:
        for _ in range(4):
            train_step(*_batch())
    assert len(result["windows"]) == 1
    names = [e.get("name") for e in json.loads(open(result["path"]).read())["traceEvents"]]
    assert names.count("aten::addmm") == 4 and "PythonDispatchMode" not in names
    records = train_step.records
    assert [r.flops_counted for r in records] == [False, False, True, False]
    assert [r.flops for r in records] == [None, None, _reference(), _reference()]


# ------------------------------------------------------------------ the user's mode inside an epoch
@pytest.mark.parametrize("form", ["decorated", "context with a model"])
def test_an_epoch_holding_steps_inside_the_users_mode_is_not_counted_and_its_steps_are(run, form):
    """An epoch operation holding training steps, the user's FlopCounterMode entered inside it
    around the steps: the epoch's count, below the user's mode, cannot be left as the first
    step begins. It recorded the whole epoch's FLOPs (and an MFU) while from the second epoch
    on its steps had FLOPs for the same work, and the first epoch's steps had none. Now the
    epoch's count records nothing and every step has its FLOPs; the user's count is that of
    the same loop without torchtrace."""
    def epoch_of(train_step, x, y):
        with FlopCounterMode(display=False) as mine:
            for _ in range(3):
                train_step(x, y)
        return mine.get_total_flops()

    torch.manual_seed(0)
    plain = _mlp()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    reference_epoch = epoch_of(lambda x, y: _body(plain, plain_opt, x, y), *_batch(6))
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step = tt.debug_operation(model=model, optimizer=opt, name="train_step")(
        lambda x, y: _body(model, opt, x, y))
    if form == "decorated":
        epoch = tt.debug_operation(name="epoch")(epoch_of)
    else:  # keyed by its model's call, known only at its end (a LateKey)
        def epoch(*args):
            with tt.debug_context("epoch", model=model):
                return epoch_of(*args)
    counts = [epoch(train_step, *_batch(6)) for _ in range(3)]
    assert counts == [reference_epoch] * 3
    assert [r.get("flops") for r in _records("epoch")] == [None] * 3
    assert [r.get("flops") for r in _records("train_step")] == [_reference(6)] * 9
    assert get_runtime().throughput.section()["operations"]["epoch"]["mfu"] is None
    assert _get_current_dispatch_mode_stack() == []
