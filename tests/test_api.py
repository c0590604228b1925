"""debug_context / debug_operation: spans, attributes, events, status, loss, exceptions."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import os

import pytest
import torch

import torchtrace as tt
from tests.helpers import read_spans
from torchtrace import api, semconv

CONTRACT_ATTRS = {semconv.STEP, semconv.OPERATION, semconv.LEVEL, semconv.LOSS, semconv.GRAD_NORM,
                  semconv.GRAD_NONFINITE_COUNT, semconv.MEMORY_RSS_BYTES, semconv.RANK}


def train(model, opt, steps, nan_at=None, op="train_step"):
    torch.manual_seed(123)
    for i in range(steps):
        x = torch.randn(5, 8)
        with tt.debug_context(op, model=model, optimizer=opt) as step:
            loss = model(x).pow(2).mean()
            if i == nan_at:
                loss = loss * float("nan")
            opt.zero_grad()
            loss.backward()
            step.record_loss(loss)
            opt.step()


def test_three_steps_three_spans_with_contract_attributes(tt_runtime, tiny_model):
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.01)
    train(tiny_model, opt, 3)
    spans = read_spans(tt_runtime.spans_path)
    assert [s["name"] for s in spans] == ["train_step"] * 3
    assert [s["attributes"][semconv.STEP] for s in spans] == [0, 1, 2]
    for s in spans:
        assert CONTRACT_ATTRS <= set(s["attributes"]), CONTRACT_ATTRS - set(s["attributes"])
        assert s["attributes"][semconv.OPERATION] == "train_step"
        assert s["attributes"][semconv.LEVEL] == "basic"
        assert s["attributes"][semconv.GRAD_NONFINITE_COUNT] == 0
        assert s["status"] == "UNSET" and s["events"] == []
        assert s["resource"]["service.name"] == "test"
        assert s["resource"][semconv.RESOURCE_RUN_ID] == tt_runtime.run_id
        assert s["end_unix_ns"] >= s["start_unix_ns"]
    assert len({s["trace_id"] for s in spans}) == 3


def test_grad_norm_on_span_equals_reference(tt_runtime, tiny_model):
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.0)  # lr 0: gradients stay inspectable
    x = torch.randn(5, 8)
    with tt.debug_context("train_step", model=tiny_model, optimizer=opt) as step:
        loss = tiny_model(x).pow(2).mean()
        loss.backward()
        step.record_loss(loss)
        opt.step()
    ref = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in tiny_model.parameters()))
    span = read_spans(tt_runtime.spans_path)[0]
    assert span["attributes"][semconv.GRAD_NORM] == pytest.approx(ref, rel=1e-6)
    assert span["attributes"][semconv.LOSS] == pytest.approx(float(loss.detach().double()), rel=1e-6)
    assert step.record.grad_names == [n for n, _ in tiny_model.named_parameters()]


def test_nan_at_step_k_marks_exactly_that_span(tt_runtime, tiny_model):
    # skip keeps the model healthy after the bad step, so only step 2 is non-finite.
    tt.configure(service_name="test", prometheus_port="off", run_dir=str(tt_runtime.run_dir.parent),
                 guard="skip", strict=True, register_atexit=False)
    from torchtrace.api import get_runtime

    rt = get_runtime()
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.01)
    train(tiny_model, opt, 5, nan_at=2)
    spans = read_spans(rt.spans_path)
    assert [s["status"] for s in spans] == ["UNSET", "UNSET", "ERROR", "UNSET", "UNSET"]
    bad = spans[2]
    kinds = {e["attributes"][semconv.EVENT_ANOMALY_KIND] for e in bad["events"] if e["name"] == semconv.EVENT_ANOMALY}
    assert {"nonfinite_loss", "nonfinite_grad"} <= kinds
    assert bad["attributes"][semconv.GRAD_NONFINITE_COUNT] == 4
    assert bad["attributes"][semconv.STEP_SKIPPED] is True
    assert sorted(bad["attributes"][semconv.GRAD_NONFINITE_PARAMS]) == sorted(n for n, _ in tiny_model.named_parameters())
    assert all(not any(e["name"] == semconv.EVENT_ANOMALY for e in s["events"]) for i, s in enumerate(spans) if i != 2)
    assert all(torch.isfinite(p).all() for p in tiny_model.parameters())


def test_exception_reaches_caller_unchanged_and_is_on_span(tt_runtime):
    class Boom(RuntimeError):
        pass

    err = Boom("secret-user-data")
    with pytest.raises(Boom) as caught:
        with tt.debug_context("train_step"):
            raise err
    assert caught.value is err
    span = read_spans(tt_runtime.spans_path)[0]
    assert span["status"] == "ERROR"
    exc_events = [e for e in span["events"] if e["name"] == "exception"]
    assert exc_events and exc_events[0]["attributes"]["exception.type"].endswith("Boom")
    assert "secret-user-data" not in str(span)  # messages only when the user opts in


def test_decorator_bare_and_with_arguments_and_loss_sources(tt_runtime, tiny_model):
    @tt.debug_operation
    def returns_tensor(x):
        return x.sum()

    @tt.debug_operation(name="dict_step")
    def returns_dict(x):
        return {"loss": x.mean(), "other": 1}

    class Out:
        def __init__(self, loss):
            self.loss = loss

    @tt.debug_operation(name="obj_step")
    def returns_obj(x):
        return Out(x.max())

    x = torch.arange(4.0)
    assert returns_tensor(x).item() == 6.0
    assert returns_dict(x)["other"] == 1
    returns_obj(x)
    spans = {s["name"]: s for s in read_spans(tt_runtime.spans_path)}
    assert spans["returns_tensor"]["attributes"][semconv.LOSS] == 6.0
    assert spans["dict_step"]["attributes"][semconv.LOSS] == 1.5
    assert spans["obj_step"]["attributes"][semconv.LOSS] == 3.0


def test_decorated_method_and_model_from_first_argument(tt_runtime, tiny_model):
    class Trainer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(3, 1)

        @tt.debug_operation(name="method_step")
        def step(self, x):
            loss = self.net(x).sum()
            loss.backward()
            return loss

    t = Trainer()
    t.step(torch.ones(2, 3))
    span = read_spans(tt_runtime.spans_path)[0]
    assert span["name"] == "method_step"
    ref = math.sqrt(float((t.net.weight.grad.double() ** 2).sum() + (t.net.bias.grad.double() ** 2).sum()))
    assert span["attributes"][semconv.GRAD_NORM] == pytest.approx(ref, rel=1e-6)


def test_async_operation(tt_runtime):
    @tt.debug_operation(name="async_step")
    async def step(x):
        await asyncio.sleep(0)
        assert tt.current_step() is not None
        return x.sum()

    out = asyncio.run(step(torch.ones(3)))
    assert out.item() == 3.0
    span = read_spans(tt_runtime.spans_path)[0]
    assert span["name"] == "async_step" and span["attributes"][semconv.LOSS] == 3.0


def test_explicit_step_numbers_and_automatic_counter(tt_runtime):
    for s in (10, 11):
        with tt.debug_context("op", step=s):
            pass
    with tt.debug_context("op"):
        pass
    assert [s["attributes"][semconv.STEP] for s in read_spans(tt_runtime.spans_path)] == [10, 11, 12]


def test_child_spans_are_parented_to_the_step(tt_runtime):
    from opentelemetry.sdk.trace import TracerProvider

    user_tracer = TracerProvider().get_tracer("user")  # the application's own provider
    with tt.debug_context("outer") as scope:
        child = user_tracer.start_span("inner")
        child.end()
        assert child.parent.span_id == scope.span.get_span_context().span_id


def test_step_without_loss_or_model_is_observed(tt_runtime):
    with tt.debug_context("bare"):
        torch.ones(2) + 1
    span = read_spans(tt_runtime.spans_path)[0]
    assert semconv.LOSS not in span["attributes"] and semconv.GRAD_NORM not in span["attributes"]
    assert span["status"] == "UNSET"


def test_explosion_and_vanishing_thresholds(tmp_path, tiny_model):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), grad_explosion_threshold=1e-3, strict=True,
                 register_atexit=False)
    with tt.debug_context("s", model=tiny_model) as s:
        tiny_model(torch.randn(4, 8)).sum().backward()
    assert s.record.anomaly_kinds == ["grad_explosion"]
    tiny_model.zero_grad()
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), grad_vanishing_threshold=1e6, strict=True,
                 register_atexit=False)
    with tt.debug_context("s", model=tiny_model) as s:
        tiny_model(torch.randn(4, 8)).sum().backward()
    assert s.record.anomaly_kinds == ["grad_vanishing"]


def test_level_off_records_nothing(tmp_path):
    tt.configure(level="off", prometheus_port="off", run_dir=str(tmp_path), register_atexit=False)

    @tt.debug_operation
    def f(x):
        return x * 2

    assert f(torch.ones(1)).item() == 2.0
    with tt.debug_context("s") as s:
        pass
    assert s.record is None and not s.active


def test_disabled_environment_means_no_threads_no_files(tmp_path, monkeypatch):
    import threading

    monkeypatch.setenv("TORCHTRACE_DISABLED", "1")
    monkeypatch.chdir(tmp_path)
    tt.shutdown()
    from torchtrace import current

    monkeypatch.setattr(current, "_disabled", False)
    before = threading.active_count()

    @tt.debug_operation
    def f(x):
        return x + 1

    assert f(torch.ones(1)).item() == 2.0
    assert threading.active_count() == before
    assert list(tmp_path.iterdir()) == []


def test_weights_bit_identical_after_50_instrumented_steps(tt_runtime):
    torch.manual_seed(7)
    base = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(50)]
    for x, y in batches:
        opt_a.zero_grad()
        torch.nn.functional.mse_loss(a(x), y).backward()
        opt_a.step()

    @tt.debug_operation(name="train_step", model=b, optimizer=opt_b, level="advanced")
    def step(x, y):
        opt_b.zero_grad()
        loss = torch.nn.functional.mse_loss(b(x), y)
        loss.backward()
        opt_b.step()
        return loss

    for x, y in batches:
        step(x, y)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values()):
        for k in sa:
            assert torch.equal(sa[k], sb[k])


def test_advanced_names_tiny_gradient_tensors_without_calling_the_step_an_anomaly(tmp_path):
    tt.configure(level="advanced", prometheus_port="off", run_dir=str(tmp_path), grad_vanishing_threshold=1e-3,
                 strict=True, register_atexit=False)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with tt.debug_context("s", model=model) as s:
        model(torch.randn(8, 4)).sum().backward()
        with torch.no_grad():
            model[0].bias.grad.mul_(1e-6)  # one tensor's gradient is tiny, the global norm is not
    assert s.record.grad_vanished_params == ["0.bias"]
    assert s.record.anomaly_kinds == []
    spans = read_spans(tt.api.get_runtime().spans_path)
    assert spans[0]["attributes"][semconv.GRAD_VANISHED_PARAMS] == ["0.bias"]


@pytest.mark.parametrize("setup", ["none", "configured", "off"])
def test_current_step_outside_a_step_is_inert(tmp_path, setup):
    """``tt.current_step().record_loss(loss)`` is what the docs tell a custom ``compute_loss``
    to call, and the Trainer calls that function in evaluation too, outside any step; as it
    does with torchtrace at level off. There the current step is a false, inert scope: its
    calls record nothing and raise nothing (they raised AttributeError on None), and entering
    it opens no step."""
    if setup != "none":
        tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True,
                     level="off" if setup == "off" else "basic")
    try:
        with (tt.debug_context("train_step") if setup == "off" else contextlib.nullcontext()):
            step = tt.current_step()
            assert not step and not step.active
            step.record_loss(torch.tensor(1.0))
            step.record_batch(samples=4, tokens=10, flops=100)
            step.add_anomaly(semconv.LOSS_SPIKE, "outside")
            assert step.record is None and not step.span.get_span_context().is_valid
            with step as entered:
                assert entered is step and not tt.current_step()
        rt = api.get_runtime() if setup != "none" else None
        assert rt is None or (rt.history.steps() == [] and rt.history.totals.get("steps", 0) == 0)
    finally:
        tt.shutdown()


def test_import_patches_nothing_configure_patches_and_shutdown_puts_torch_back(tmp_path):
    """``import torchtrace`` leaves torch and logging as they are; ``configure()`` wraps the clip
    functions, GradScaler, the schedulers, the weight average and ``init_process_group`` and adds
    the global optimizer hook and the module and parameter registration hooks; ``shutdown()``
    puts back the very functions it found and removes the hooks."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = r"""
import json, logging, sys, torch, torch.distributed
from torch.optim import lr_scheduler, optimizer as optimizer_module, swa_utils
from torch.nn.modules import module as module_module
def found():
    return [torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_, torch.nn.utils.clip_grads_with_norm_,
            torch.nn.utils.clip_grad.clip_grad_norm_, torch.amp.GradScaler.scale, torch.amp.GradScaler.step,
            lr_scheduler.LRScheduler.step, swa_utils.AveragedModel.update_parameters,
            torch.distributed.init_process_group, torch.distributed.distributed_c10d.init_process_group]
def patched():
    return [getattr(f, "__torchtrace_wrapped__", False) for f in found()] + [
        bool(optimizer_module._global_optimizer_pre_hooks), bool(module_module._global_module_registration_hooks),
        bool(module_module._global_parameter_registration_hooks)]
before = found()
import torchtrace as tt
imported = patched() + [type(logging.getLogger("torchtrace")) is not logging.Logger]
tt.configure(run_dir=sys.argv[1], prometheus_port="off", register_atexit=False)
configured = patched()
tt.shutdown()
print(json.dumps({"imported": imported, "configured": configured, "shut_down": patched(),
                  "same": [a is b for a, b in zip(before, found())]}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not any(got["imported"]), got
    assert all(got["configured"]), got
    assert not any(got["shut_down"]), got
    assert all(got["same"]), got
