"""torchtrace's own failures never reach the training loop (RELIABILITY.md promise 1).

Each case makes one internal part raise on every call, trains 50 steps, and checks: the
loop completes, the weights are bit-identical to an uninstrumented run, and the failure was
counted under its component in ``torchtrace_internal_errors_total``.
"""

from __future__ import annotations

import logging

import pytest
import torch

import torchtrace as tt
from tests.conftest import TinyNet
from torchtrace import files
from torchtrace.api import get_runtime
from torchtrace.export import metrics, tracing
from torchtrace.measure import gradients, memory
from torchtrace.probes.base import Probe
from torchtrace.record import history, readout, rules
from torchtrace.step import runtime as runtime_mod
from torchtrace.step import throughput as throughput_mod
from torchtrace.step import updaters

STEPS = 50


def _boom(*args, **kwargs):
    raise RuntimeError("injected fault")


class _RaisingProbe(Probe):
    def __init__(self, where: str) -> None:
        self.where = where

    def enter(self, scope):
        if self.where == "enter":
            raise RuntimeError("probe enter")

    def exit(self, scope, state, exc):
        if self.where == "exit":
            raise RuntimeError("probe exit")

    def finish(self, scope, state, record, values):
        if self.where == "finish":
            raise RuntimeError("probe finish")


# name -> (target object, attribute, components expected to count it)
FAULTS = {
    "span_exporter": (tracing.JsonLinesSpanExporter, "export", {"tracing"}),
    "metric_update": (metrics.Metrics, "observe_step", {"metrics"}),
    "overhead_metric": (metrics.Metrics, "add_overhead", {"metrics"}),
    "report_file_write": (files, "write_json_atomic", {"files"}),
    "memory_sample": (memory, "step_sample", {"memory"}),
    "gradient_norms": (gradients, "gradient_norms", {"gradients"}),
    "host_readout": (readout, "start", {"record"}),
    "span_start": (runtime_mod.Runtime, "at_step_boundary", {"step"}),
    "throughput_start": (throughput_mod, "StepClock", {"step"}),  # the phase clock every step with a model makes
    "throughput_end": (throughput_mod.RunThroughput, "account", {"record"}),
    "history": (history.History, "add_step", {"record"}),
    "loss_rule": (rules, "evaluate_loss", {"record"}),
    "optimizer_noted": (updaters, "_note", {"step"}),  # the global optimizer hook's work
    "probe_enter": None,
    "probe_exit": None,
    "probe_finish": None,
}


def _train(model, steps=STEPS):
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = [(torch.randn(8, 8), torch.randn(8, 4)) for _ in range(steps)]
    for i, (x, y) in enumerate(data):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            step.record_loss(loss)
            opt.step()
            opt.zero_grad()
    return model


def _reference():
    torch.manual_seed(0)
    model = TinyNet()
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = [(torch.randn(8, 8), torch.randn(8, 4)) for _ in range(STEPS)]
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_injected_fault_is_counted_and_training_is_unchanged(fault, tmp_path, monkeypatch, caplog):
    for name in list(__import__("os").environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)
    spec = FAULTS[fault]
    if spec is not None:
        target, attr, expected = spec
        monkeypatch.setattr(target, attr, _boom)
    tt.configure(prometheus_port=0, run_dir=str(tmp_path), strict=False, register_atexit=False,
                 level="advanced")
    rt = get_runtime()
    if spec is None:
        rt.probes.add(_RaisingProbe(fault.split("_", 1)[1]))
        expected = {"other"}
    torch.manual_seed(0)
    caplog.set_level(logging.WARNING, logger="torchtrace")
    model = _train(TinyNet())
    tt.shutdown()

    ref = _reference()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), name  # bit-identical
    counted = {c: n for c, n in rt.errors.by_component.items() if n}
    assert expected <= set(counted), counted
    for component in expected:
        value = rt.metrics.internal_errors.labels(rt.settings.run_id, "0", component)._value.get()
        assert value == counted[component] >= 1
    # Every step is still recorded (its start failing loses that step's record, by design; a
    # failing history cannot hold them), whatever else the fault cost.
    if fault not in ("span_start", "history"):
        assert rt.history.totals.get("steps") == STEPS, rt.history.totals
    # Logged once per (component, exception type), not once per step.
    internal = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert 1 <= len(internal) <= len({(c, "RuntimeError") for c in counted}) + 1


def test_strict_mode_raises_internal_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics.Metrics, "add_overhead", _boom)
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False)
    with pytest.raises(RuntimeError, match="injected fault"):
        with tt.debug_context("train_step"):
            pass
    tt.shutdown()
    from opentelemetry import context

    assert not tt.current_step()  # no step left open
    assert context.get_current() == {} or not context.get_current()


def test_user_exceptions_pass_through_untouched(tt_runtime):
    class UserError(Exception):
        pass

    err = UserError("mine")
    with pytest.raises(UserError) as info:
        with tt.debug_context("train_step"):
            raise err
    assert info.value is err


def test_a_return_value_whose_loss_property_raises_is_absorbed(tmp_path, monkeypatch):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=False, register_atexit=False)
    rt = get_runtime()

    class Output:
        @property
        def loss(self):
            raise KeyError("no loss here")

    @tt.debug_operation
    def step():
        return Output()

    out = step()
    assert isinstance(out, Output)
    tt.shutdown()
    assert rt.errors.by_component == {"step": 1}
