"""Seed 000 ("PyTorch Debugging Tools Integration", email-sequence trainer): every example, as
written, with only the imports changed and small models in place of the seed's.

Seed imports ``from core.pytorch_debugging import create_pytorch_debugger, debug_training_session``
and ``from core.enhanced_training_optimizer import create_enhanced_training_optimizer``; here
the first two come from ``torchtrace``, the third from ``torchtrace.compat``.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import gc
import json
import logging
import math
import os

import pytest
import torch

import torchtrace as tt
from tests.compat.common import (
    SeedLogger,
    batches,
    chrome_trace_ops,
    metric,
    ref_norm,
    ref_stats,
    small_classifier,
    spans,
)
from torchtrace import create_pytorch_debugger, debug_training_session, semconv
from torchtrace.compat import create_enhanced_training_optimizer
from torchtrace.record import readout


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the seed's relative paths (debug_logs/, profile.json) land here


@pytest.fixture
def setup():
    model = small_classifier()
    (inputs, targets), = batches(1)
    return model, inputs, targets, torch.nn.CrossEntropyLoss()


# ---------------------------------------------------------------- 1. autograd anomaly detection
def test_anomaly_detection_example(setup):
    model, inputs, targets, loss_fn = setup
    debugger = create_pytorch_debugger(enable_anomaly_detection=True)
    seen = []
    with debugger.anomaly_detection():
        seen.append(torch.is_anomaly_enabled())
        outputs = model(inputs)
        loss = loss_fn(outputs, targets)
        loss.backward()
    assert seen == [True] and not torch.is_anomaly_enabled()
    # A real anomaly: sqrt(-1) makes a NaN gradient; detect mode re-raises autograd's error.
    x = torch.tensor([-1.0, 4.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="SqrtBackward0"):
        with debugger.anomaly_detection():
            torch.sqrt(x).sum().backward()
    assert debugger.get_debug_summary()["events_by_type"]["autograd_anomaly"] == 1


def test_anomaly_detection_raise_mode_raises_nonfinite_error():
    """Issue 19, item 5: mode="raise" raises NonFiniteError, as promised (it raised RuntimeError)."""
    debugger = create_pytorch_debugger(enable_anomaly_detection=True)
    x = torch.tensor([-1.0], requires_grad=True)
    with pytest.raises(tt.NonFiniteError) as info:
        with debugger.anomaly_detection(mode="raise"):
            torch.sqrt(x).sum().backward()
    assert info.value.kinds == [semconv.NONFINITE_GRAD] and isinstance(info.value.__cause__, RuntimeError)
    assert not torch.is_anomaly_enabled()


# ---------------------------------------------------------------- 2. profiler
def test_profiling_example_writes_a_chrome_trace(setup):
    model, inputs, targets, loss_fn = setup
    debugger = create_pytorch_debugger(enable_anomaly_detection=True)

    def train_epoch():
        loss_fn(model(inputs), targets).backward()

    num_epochs = 2
    with debugger.profiling(output_file="profile.json"):
        for epoch in range(num_epochs):
            train_epoch()
    path = os.path.join("debug_logs", "profile.json")
    ops = chrome_trace_ops(path)
    assert "aten::addmm" in ops and "aten::relu" in ops  # the two Linear layers and the ReLU ran inside
    assert debugger.get_debug_summary()["profiling"]["profiles_written"] == [path]


# ---------------------------------------------------------------- 3. memory tracking
def test_memory_tracking_example_sees_what_the_block_keeps():
    debugger = create_pytorch_debugger()
    kept = []

    def train_model():
        # 256 MiB, written, so resident: above glibc's largest mmap threshold (32 MiB), so fresh
        # pages whatever earlier tests freed (a 32 MiB block could reuse resident heap); large
        # beside what other threads of a long test process free or take meanwhile
        kept.append(torch.ones(64 * 2 ** 20))

    gc.collect()  # earlier tests' garbage is not freed inside the block
    with debugger.memory_tracking():
        train_model()
    event = [e for e in debugger.timeline.events() if e["event_type"] == "memory_tracking"][-1]
    expected = kept[0].numel() * kept[0].element_size()
    assert 0.9 * expected <= event["data"]["rss_delta_bytes"] <= 1.5 * expected, (event["data"], expected)
    snap = debugger.memory_snapshots[-1]  # seed 000's snapshot shape
    assert set(snap) >= {"cpu_memory_percent", "cuda_allocated", "cuda_reserved", "timestamp"}
    datetime.datetime.fromisoformat(snap["timestamp"])
    total = __import__("psutil").virtual_memory().total
    assert snap["cpu_memory_percent"] == pytest.approx(100.0 * snap["rss_bytes"] / total)


# ---------------------------------------------------------------- 4. gradient checking
def test_gradient_checking_example_against_a_float64_loop(setup):
    model, inputs, targets, loss_fn = setup
    debugger = create_pytorch_debugger()
    loss_fn(model(inputs), targets).backward()
    gradient_norm = debugger.check_gradients(model, gradient_threshold=1.0)
    ref = ref_norm(p.grad for p in model.parameters())
    # The core's norm: float32 per-tensor norms (fused kernels), the reference float64.
    assert float(gradient_norm) == pytest.approx(ref, rel=1e-6)
    assert (gradient_norm > 1.0) is (ref > 1.0) and (gradient_norm <= 1.0) is (ref <= 1.0)
    param_stats = debugger.check_model_parameters(model)
    assert param_stats["total_parameters"] == 6 * 8 + 8 + 8 * 3 + 3 and param_stats["ok"]
    for name, p in model.named_parameters():
        assert param_stats["param_stats"][name]["mean"] == pytest.approx(ref_stats(p)["mean"], rel=1e-9, abs=1e-12)


def test_explosion_event_has_the_seeds_shape():
    model = small_classifier()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)  # norm = 0.5 * sqrt(n)
    n = sum(p.numel() for p in model.parameters())
    debugger = create_pytorch_debugger()
    debugger.check_gradients(model, gradient_threshold=1.0)
    event = [e for e in debugger.timeline.events() if e["event_type"] == "gradient_explosion"][0]
    assert set(event) >= {"timestamp", "event_type", "message", "data"}
    datetime.datetime.fromisoformat(event["timestamp"])
    assert event["data"]["gradient_norm"] == pytest.approx(0.5 * math.sqrt(n)) and event["data"]["threshold"] == 1.0


# ---------------------------------------------------------------- 5. forward / backward
def test_forward_and_backward_debugging_example(setup):
    model, inputs, targets, loss_fn = setup
    debugger = create_pytorch_debugger()
    outputs = debugger.debug_forward_pass(model, inputs, layer_hooks=True)
    assert torch.equal(outputs, model(inputs))  # the seed uses the return value as the outputs
    layers = {layer["name"]: layer for layer in debugger.last_forward_pass["layers"]}
    hidden = model[0](inputs)
    assert layers["0"]["mean"] == pytest.approx(ref_stats(hidden)["mean"], rel=1e-6)
    assert layers["1"]["max"] == pytest.approx(ref_stats(torch.relu(hidden))["max"], rel=1e-6)
    loss = loss_fn(outputs, targets)
    out = debugger.debug_backward_pass(loss, retain_graph=True)
    assert out["global_norm"] == pytest.approx(ref_norm(p.grad for p in model.parameters()), rel=1e-9)
    first = [p.grad.clone() for p in model.parameters()]
    debugger.debug_backward_pass(loss)  # the retained graph allows a second backward
    for g0, p in zip(first, model.parameters()):
        torch.testing.assert_close(p.grad, 2 * g0)


def test_debug_training_step_signature_and_sgd_reference(setup):
    model, inputs, targets, loss_fn = setup
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = create_pytorch_debugger()
    out = debugger.debug_training_step(model, inputs, targets, loss_fn, optimizer, gradient_threshold=1.0)
    ref_loss = loss_fn(reference(inputs), targets)
    ref_loss.backward()
    assert out["loss"] == pytest.approx(ref_loss.item(), rel=1e-6) and out["optimizer_stepped"]
    assert float(out["gradient_check"]) == pytest.approx(ref_norm(p.grad for p in reference.parameters()), rel=1e-6)
    for p, r in zip(model.parameters(), reference.parameters()):
        expected = r.detach().double() - 0.1 * r.grad.double()
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-6, atol=1e-7)
    # The step's batch is the seed call's inputs: its rows are the step's samples.
    record = tt.api.get_runtime().history.steps()[-1]
    assert (record["operation"], record["samples"]) == ("debug_training_step", inputs.shape[0])


# ---------------------------------------------------------------- training optimizer integration
# The seed's loop calls float(loss) on a loss that requires grad, as written; torch warns about it.
@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar:UserWarning")
def test_enhanced_training_optimizer_matches_a_plain_adam_loop(tt_runtime):
    model = small_classifier()
    reference = copy.deepcopy(model)
    train_loader, val_loader = batches(2, seed=3), batches(1, seed=4)
    optimizer = create_enhanced_training_optimizer(
        model=model, train_loader=train_loader, val_loader=val_loader, debug_mode=True,
        enable_pytorch_debugging=True, enable_profiling=False, max_epochs=3, learning_rate=0.001,
        gradient_clip=1.0)

    async def main():
        return await optimizer.train()

    results = asyncio.run(main())
    opt = torch.optim.Adam(reference.parameters(), lr=0.001)
    ref_means, ref_val = [], []
    for _ in range(3):
        losses = []
        for x, y in train_loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(reference(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            opt.step()
            losses.append(float(loss))
        ref_means.append(math.fsum(losses) / len(losses))
        with torch.no_grad():
            ref_val.append(float(torch.nn.functional.cross_entropy(reference(val_loader[0][0]), val_loader[0][1])))
    assert results["train_losses"] == pytest.approx(ref_means, rel=1e-5)
    assert results["val_losses"] == pytest.approx(ref_val, rel=1e-5)
    assert results["epochs_completed"] == 3 and results["steps"] == 6
    assert results["debug_summary"]["gradient_checking"]["enabled"]
    train_spans = [s for s in spans(tt_runtime) if s["name"] == "train_step"]
    assert len(train_spans) == 6 and metric(semconv.M_STEPS, operation="train_step") == 6
    assert train_spans[0]["attributes"][semconv.LOSS] == pytest.approx(
        torch.nn.functional.cross_entropy(small_classifier()(train_loader[0][0]), train_loader[0][1]).item(), rel=1e-6)


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar:UserWarning")
def test_enhanced_training_optimizer_reports_throughput_and_validation_as_evaluation(tt_runtime):
    """The seed's trainer knows each batch: its steps carry samples (a plain count of the rows)
    and FLOPs (FlopCounterMode on the same step), and each validation pass is one operation
    of the evaluation kind, so its time (slowed by planted sleeps) is evaluation in goodput,
    not the next training step's data wait, and reports no gradients of its own. Before,
    every step had neither samples nor FLOPs, and validation was data wait."""
    import time

    from torch.utils.flop_counter import FlopCounterMode

    model = small_classifier()
    g = torch.Generator().manual_seed(5)
    train_loader = [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (5, 5, 2)]
    pause = 0.04

    class SlowValidation:
        def __iter__(self):
            for x, y in batches(2, seed=6):
                time.sleep(pause)
                yield x, y

    trainer = create_enhanced_training_optimizer(model=model, train_loader=train_loader,
                                                 val_loader=SlowValidation(), max_epochs=2)
    asyncio.run(trainer.train())
    rt = tt.api.get_runtime()
    records = rt.history.steps()
    train = [r for r in records if r["operation"] == "train_step"]
    assert [r["samples"] for r in train] == [len(x) for x, _ in train_loader] * 2
    probe = copy.deepcopy(model)
    for rows in (5, 2):
        x, y = torch.randn(rows, 6), torch.randint(0, 3, (rows,))
        with FlopCounterMode(display=False) as ref:
            torch.nn.functional.cross_entropy(probe(x), y).backward()
        got = {r["flops"] for r in train if r["samples"] == rows}
        assert got == {ref.get_total_flops()}, (rows, got)
    validation = [r for r in records if r["operation"] == "validation"]
    assert len(validation) == 2 and all(r.get("grad_norm") is None for r in validation)
    badput = rt.throughput.ledger.closed().badput
    assert badput["evaluation"] >= 2 * 2 * pause * 0.95
    after = train[len(train_loader)]  # the first step after the first validation
    assert after["data_wait_s"] < pause


def test_enhanced_optimizer_settings_take_effect(tmp_path):
    model = small_classifier()
    plain = create_enhanced_training_optimizer(model=model, train_loader=batches(1), enable_pytorch_debugging=False,
                                               max_epochs=1, learning_rate=0.5)
    assert plain.optimizer.param_groups[0]["lr"] == 0.5 and plain.debugger is None
    assert asyncio.run(plain.train())["debug_summary"] is None
    profiled = create_enhanced_training_optimizer(model=model, train_loader=batches(1), enable_profiling=True,
                                                  max_epochs=1, log_dir=str(tmp_path / "logs"))
    res = asyncio.run(profiled.train())
    assert res["profile"] and "aten::addmm" in chrome_trace_ops(res["profile"])
    with pytest.raises(ValueError, match="enable_profiling=True needs enable_pytorch_debugging=True"):
        create_enhanced_training_optimizer(model=model, train_loader=[], enable_pytorch_debugging=False,
                                           enable_profiling=True)
    with pytest.raises(ValueError, match="max_epochs=0"):
        create_enhanced_training_optimizer(model=model, train_loader=[], max_epochs=0)


# ---------------------------------------------------------------- training session
def test_debug_training_session_example(tt_runtime, setup):
    model, inputs, targets, loss_fn = setup
    logger = logging.getLogger("seed000")
    anomaly_inside = []

    def train_model():
        anomaly_inside.append(torch.is_anomaly_enabled())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(2):
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                opt.zero_grad()
                loss = loss_fn(model(inputs), targets)
                loss.backward()
                step.record_loss(loss)
                opt.step()

    with debug_training_session(
        model=model,
        logger=logger,
        debug_mode=True,
        enable_anomaly_detection=True,
        enable_profiling=True,
        enable_memory_tracking=True,
        enable_gradient_checking=True
    ) as debugger:
        train_model()
    assert anomaly_inside == [True] and not torch.is_anomaly_enabled()
    trace = os.path.join("debug_logs", "session_profile.json")
    assert "aten::addmm" in chrome_trace_ops(trace)  # enable_profiling=True wrote a trace of the session
    names = [s["name"] for s in debugger.memory_snapshots]
    assert names == ["memory_tracking_start", "memory_tracking_end"]
    by_name = {s["name"]: s for s in spans(tt_runtime)}
    steps = [s for s in spans(tt_runtime) if s["name"] == "train_step"]
    assert len(steps) == 2 and all(s["parent_span_id"] == by_name["training_session"]["span_id"] for s in steps)
    summary = debugger.get_debug_summary()
    assert summary["events_by_type"]["session_finished"] == 1 and summary["gradient_checking"]["enabled"]


# ---------------------------------------------------------------- configuration, summary, report
def test_configuration_summary_and_report(setup):
    model, inputs, targets, loss_fn = setup
    logger = SeedLogger()
    debugger = create_pytorch_debugger(
        logger=logger,                    # Training logger instance
        debug_mode=True,                  # Enable debug mode
        enable_anomaly_detection=True,    # Enable autograd anomaly detection
        enable_profiling=False,           # Enable PyTorch profiling
        enable_memory_tracking=True,      # Enable memory tracking
        enable_gradient_checking=True,    # Enable gradient checking
        log_dir="debug_logs"             # Debug log directory
    )
    with debugger.anomaly_detection():
        loss_fn(model(inputs), targets).backward()
    for p in model.parameters():
        p.grad.mul_(1e3)
    debugger.check_gradients(model, gradient_threshold=1.0)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    debugger.check_model_parameters(model)
    summary = debugger.get_debug_summary()
    text = json.dumps(summary, indent=2)  # the seed prints it this way
    assert json.loads(text)["total_events"] == summary["total_events"] == len(debugger.timeline.events())
    assert summary["anomaly_detection"]["enabled"] and not summary["profiling"]["enabled"]
    assert summary["gradient_violations"] == {"nonfinite": 0, "explosion": 1, "vanishing": 0}
    assert summary["total_anomalies"] == 2  # the explosion and the NaN parameter
    # The seed's logger got each event at its level.
    assert any("Anomaly detection enabled" in m for m in logger.of("info"))
    assert any("Gradient explosion detected" in m for m in logger.of("warning"))
    assert any("NaN/Inf parameter" in m for m in logger.of("error"))
    report_path = debugger.save_debug_report("debug_report.json")
    assert report_path == os.path.join("debug_logs", "debug_report.json")
    report = json.loads(open(report_path).read())
    assert {"events", "memory_snapshots", "gradient_violations", "performance"} <= set(report)
    assert [e["event_type"] for e in report["events"]] == [e["type"] for e in report["events"]]
    assert os.path.dirname(debugger.save_debug_report()) == "debug_logs"  # default name, under log_dir
    debugger.save_debug_report("final_debug_report.json")
    debugger.clear_debug_data()
    assert debugger.get_debug_summary()["total_events"] == 0


def test_error_recovery_and_custom_error_examples():
    torch.manual_seed(0)
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    if torch.isnan(x).any() or torch.isinf(x).any():
        x = torch.where(torch.isnan(x) | torch.isinf(x), torch.zeros_like(x), x)
    assert x.tolist() == [1.0, 0.0, 0.0, -2.0]
    debugger = create_pytorch_debugger()
    model = small_classifier()
    model(torch.randn(2, 6)).sum().backward()
    gradient_norm = debugger.check_gradients(model, gradient_threshold=1.0)
    assert float(gradient_norm) == pytest.approx(ref_norm(p.grad for p in model.parameters()))
    try:
        with debugger.anomaly_detection():
            raise ValueError("training code failed")
    except Exception as e:
        debugger._log_debug_event("custom_error", str(e))
    assert debugger.timeline.events()[-1]["message"] == "training code failed"


# ---------------------------------------------------------------- usage scenarios and settings
def test_development_scenario_nests_the_three_contexts(setup):
    model, inputs, targets, loss_fn = setup
    debugger = create_pytorch_debugger(debug_mode=True, enable_anomaly_detection=True, enable_profiling=True,
                                       enable_memory_tracking=True, enable_gradient_checking=True)
    states = []

    def train_model():
        states.append(torch.is_anomaly_enabled())
        loss_fn(model(inputs), targets).backward()

    with debugger.anomaly_detection():
        with debugger.profiling():
            with debugger.memory_tracking():
                train_model()
    assert states == [True]
    assert "aten::addmm" in chrome_trace_ops(os.path.join("debug_logs", "profile_0.json"))
    assert len(debugger.memory_snapshots) == 2


def test_production_scenario_debug_mode_false_turns_debugging_off(setup):
    model, inputs, targets, loss_fn = setup
    debugger = create_pytorch_debugger(debug_mode=False, enable_anomaly_detection=False, enable_profiling=False,
                                       enable_memory_tracking=True, enable_gradient_checking=True)
    states = []
    with debugger.anomaly_detection():  # off: the settings say so
        states.append(torch.is_anomaly_enabled())
    with debugger.profiling(output_file="p.json") as result:
        pass
    assert states == [False] and result["path"] is None and not os.path.exists("debug_logs/p.json")
    with debugger.memory_tracking():  # monitoring stays on
        loss_fn(model(inputs), targets).backward()
    assert len(debugger.memory_snapshots) == 2
    assert debugger.check_gradients(model)["enabled"]
    # debug_mode=False: the layer-by-layer forward is a plain forward (no hook is installed).
    hooks = []
    model[0].register_forward_pre_hook(lambda m, i: hooks.append(len(m._forward_hooks)))
    debugger.debug_forward_pass(model, inputs)
    assert hooks == [0] and debugger.last_forward_pass["layers"] == []


def test_every_setting_has_its_effect_or_is_refused(setup):
    model, inputs, targets, loss_fn = setup
    loss_fn(model(inputs), targets).backward()
    off = create_pytorch_debugger(enable_gradient_checking=False)
    before = readout.reads()
    report = off.check_gradients(model, gradient_threshold=1e-9)
    assert readout.reads() == before and not report["enabled"] and report["anomalies"] == []
    assert off.check_gradient_explosion(model, threshold=1e-9) == []
    no_mem = create_pytorch_debugger(enable_memory_tracking=False)
    with no_mem.memory_tracking():
        pass
    assert no_mem.memory_snapshots == []
    no_anomaly = create_pytorch_debugger(enable_anomaly_detection=False)
    with no_anomaly.anomaly_detection():
        assert not torch.is_anomaly_enabled()
    with no_anomaly.anomaly_detection(enabled=True):  # an explicit request wins
        assert torch.is_anomaly_enabled()
    with pytest.raises(ValueError, match="enable_profiling=True contradicts debug_mode=False"):
        create_pytorch_debugger(debug_mode=False, enable_profiling=True)
    with pytest.raises(ValueError, match="enable_anomaly_detection=True contradicts debug_mode=False"):
        create_pytorch_debugger(debug_mode=False, enable_anomaly_detection=True)
    with pytest.raises(TypeError, match="unknown debugger setting 'enable_everything'"):
        create_pytorch_debugger(enable_everything=True)
    with pytest.raises(ValueError, match="log_dir="):
        create_pytorch_debugger(log_dir="")
    with pytest.raises(TypeError, match="logger= must be"):
        create_pytorch_debugger(logger=object())


def test_performance_investigation_scenario(setup):
    model, inputs, targets, loss_fn = setup
    debugger = create_pytorch_debugger(debug_mode=True, enable_profiling=True, enable_memory_tracking=True)
    with debugger.profiling(output_file="performance_profile.json"):
        loss_fn(model(inputs), targets).backward()
    assert "aten::addmm" in chrome_trace_ops(os.path.join("debug_logs", "performance_profile.json"))
