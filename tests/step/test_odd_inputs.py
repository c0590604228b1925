"""Steps whose inputs or ops the throughput features cannot read (nested tensors, ops without
a FLOP formula, a failure at the step's start): the step is still recorded, the user's
result is unchanged, and the next step is a step of its own."""

from __future__ import annotations

import logging

import pytest
import torch
from opentelemetry import trace
from torch.utils._python_dispatch import _get_current_dispatch_mode

import torchtrace as tt
from torchtrace import current
from torchtrace.api import get_runtime
from torchtrace.step import throughput as step_throughput
from torchtrace.step.throughput import RunThroughput

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")


def _configure(tmp_path, strict=True):
    return tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=strict)


def _records(name):
    rt = get_runtime()
    rt.finish_deferred(block=True)
    return [s for s in rt.history.steps() if s["operation"] == name]


def _train_step(model):
    """A decorated SGD step named train_step on ``model``, returning the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @tt.debug_operation(name="train_step", model=model, optimizer=opt)
    def step(x):
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        opt.step()
        return loss

    return step


def _nested(layout):
    torch.manual_seed(3)
    return torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(5, 4)], layout=layout)


def _padded_loss(out):
    return (out.values() if out.layout is torch.jagged else torch.nested.to_padded_tensor(out, 0.0)).sum()


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensor_inputs_are_recorded_and_not_flop_counted(tmp_path, layout):
    """Before: a strided nested tensor's shape raised inside the step's start (no record, and
    every later step nested inside the dead one); a jagged one made FlopCounterMode fail the
    user's first step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    reference = torch.nn.Linear(4, 2)
    reference.load_state_dict(model.state_dict())
    _configure(tmp_path)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tt.debug_operation(name="nested_step", model=model, optimizer=opt)
    def step(batch):
        opt.zero_grad()
        loss = _padded_loss(model(batch))
        loss.backward()
        opt.step()
        return loss

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        got = step(_nested(layout))
        ref_opt.zero_grad()
        want = _padded_loss(reference(_nested(layout)))
        want.backward()
        ref_opt.step()
        assert torch.equal(got, want)
    records = _records("nested_step")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["samples"] == 2 and r.get("flops") is None for r in records)
    assert get_runtime().errors.total == 0


def test_a_step_whose_start_fails_leaves_no_span_context_or_counter_behind(tmp_path, tiny_model, monkeypatch):
    """An internal error late in a step's start (after its span, contexts, hooks and the FLOP
    counter were set up) used to leave them all in place: every later step ran as a child of
    the dead step's span, was not the outermost step (no FLOP count) and FlopCounterMode
    stayed on. Now the failed step is undone and only its record is lost."""
    _configure(tmp_path, strict=False)
    rt = get_runtime()
    enter = rt.probes.enter
    calls = []

    def failing_once(scope):
        calls.append(scope.step)
        if len(calls) == 1:
            raise RuntimeError("planted")
        return enter(scope)

    monkeypatch.setattr(rt.probes, "enter", failing_once)
    step = _train_step(tiny_model)

    x = torch.randn(4, 8)
    for _ in range(3):
        step(x)
        assert current.step() is None
        assert trace.get_current_span() is trace.INVALID_SPAN
        assert _get_current_dispatch_mode() is None
    records = _records("train_step")
    assert [r["step"] for r in records] == [1, 2]
    assert len({r["trace_id"] for r in records}) == 2  # each its own trace, not children of step 0
    assert records[0].get("flops") and records[0]["flops"] == records[1]["flops"]  # outermost: counted
    assert rt.errors.by_component == {"step": 1}


@pytest.mark.parametrize("where", ["start", "finish", "end"])
def test_a_throughput_failure_costs_only_the_throughput_figures(tmp_path, tiny_model, monkeypatch, where):
    """At the step's start (its shape key), as it finishes (its batch, FLOPs and learning
    rates) or at its end (the goodput booking): the step's record is still there, with its
    loss. Before, a failure at the end, and one as it finished, lost the whole record."""
    _configure(tmp_path, strict=False)

    def boom(*args):
        raise RuntimeError("planted")

    if where == "start":
        monkeypatch.setattr(step_throughput, "shape_key", boom)
    elif where == "finish":
        monkeypatch.setattr(RunThroughput, "finish_step", boom)
    else:
        monkeypatch.setattr(RunThroughput, "account", boom)
    step = _train_step(tiny_model)

    losses = [step(torch.ones(4, 8)).item() for _ in range(2)]
    assert _get_current_dispatch_mode() is None  # no FLOP counter left open
    records = _records("train_step")
    assert [r["loss"] for r in records] == pytest.approx(losses)
    if where == "start":
        assert all(r.get("flops") is None and r.get("phases") is None for r in records)
    if where == "finish":
        assert all(r.get("flops") is None and r.get("samples") is None for r in records)
    assert get_runtime().errors.by_component == {"record" if where == "end" else "step": 2}


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensors_made_inside_the_step_run_and_are_not_counted(tmp_path, layout):
    """A model that builds nested tensors inside its step: torch's FlopCounterMode fails their
    ops (torch 2.13), which failed the user's one counted step. Their ops now run uncounted and
    the count, incomplete, is dropped: every step runs and has no FLOPs."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    _configure(tmp_path)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tt.debug_operation(name="inside_step", model=model, optimizer=opt)
    def step(x):
        opt.zero_grad()
        loss = _padded_loss(model(torch.nested.as_nested_tensor([x[:3], x[3:]], layout=layout)))
        loss.backward()
        opt.step()
        return loss

    for _ in range(3):
        step(torch.randn(8, 4))
    records = _records("inside_step")
    assert [r["step"] for r in records] == [0, 1, 2] and not any(r.get("exception_type") for r in records)
    assert all(r.get("flops") is None for r in records)
    assert get_runtime().throughput.flops.counts == 1 and get_runtime().errors.total == 0


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@pytest.mark.parametrize("error", [RuntimeError, _OOM])
def test_a_flop_count_that_breaks_the_step_is_not_tried_again(tmp_path, tiny_model, caplog, monkeypatch, error):
    """If an op fails under the counter (planted here in its FLOP formula call), torchtrace
    cannot undo that step: it never counts that input shape again, says so once, and the next
    steps run. Running out of memory is the step's size, not the counter: counted next time."""
    from torch.utils.flop_counter import FlopCounterMode

    real = FlopCounterMode._count_flops
    calls = []

    def planted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error("planted counter failure")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FlopCounterMode, "_count_flops", planted)
    _configure(tmp_path)
    step = _train_step(tiny_model)
    caplog.set_level(logging.WARNING, logger="torchtrace")
    with pytest.raises(error, match="planted counter failure"):
        step(torch.randn(4, 8))
    for _ in range(3):
        step(torch.randn(4, 8))
    records = _records("train_step")
    assert [r["step"] for r in records] == [0, 1, 2, 3] and records[0]["exception_type"] == error.__qualname__
    warned = [r for r in caplog.records if "while the step's FLOPs were being counted" in r.getMessage()]
    if error is RuntimeError:
        assert all(r.get("flops") is None for r in records[1:])
        assert get_runtime().throughput.flops.counts == 0  # never tried again
        assert len(warned) == 1
    else:
        assert records[1]["flops"] > 0 and records[1]["flops"] == records[3]["flops"]
        assert get_runtime().throughput.flops.counts == 1 and not warned


def test_a_count_of_zero_is_no_count(tmp_path):
    """Ops without a FLOP formula (here only element-wise ones) count zero: the step gets no
    FLOPs, not 0 (which would read as an MFU of 0)."""
    model = torch.nn.Linear(4, 2)
    _configure(tmp_path)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tt.debug_operation(name="elementwise", model=model, optimizer=opt)
    def step(x):
        opt.zero_grad()
        loss = (model.weight * x[0, :4]).square().sum()
        loss.backward()
        opt.step()
        return loss

    for _ in range(3):
        step(torch.randn(8, 4))
    records = _records("elementwise")
    assert len(records) == 3 and all(r.get("flops") is None for r in records)
    assert get_runtime().throughput.flops.counts == 1  # counted once, found nothing, not tried again
