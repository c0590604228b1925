"""TrainingMonitor counts and rates, input/output checks, pipelines and loop steps."""

from __future__ import annotations

import json
import math

import pytest
import torch

import torchtrace as tt
from tests.conftest import TinyNet
from torchtrace import semconv
from torchtrace.api import get_runtime


def _grads(model, scale):
    for p in model.parameters():
        p.grad = torch.full_like(p, scale)


def test_summary_rates_equal_hand_counts_on_a_scripted_run():
    torch.manual_seed(0)
    model = TinyNet()
    n_params = sum(p.numel() for p in model.parameters())
    mon = tt.TrainingMonitor(window=5, spike_factor=3.0, min_history=3, explosion_threshold=100.0,
                             vanishing_threshold=1e-6)
    # (loss, per-element gradient value); expectations written by hand below.
    script = [(1.0, 0.1), (1.1, 0.1), (0.9, 0.1), (1.0, 0.1),  # healthy
              (50.0, 0.1),                                     # loss spike
              (1.0, 100.0),                                    # explosion: norm = 100*sqrt(n)
              (1.0, 1e-9),                                     # vanishing
              (float("nan"), float("nan")),                    # non-finite loss and grads
              (1.05, 0.1), (0.95, 1e-9)]                       # healthy, vanishing
    for step, (loss, g) in enumerate(script):
        _grads(model, g)
        out = mon.monitor_training_step(model, torch.tensor(loss), step)
        assert out["step"] == step
    s = mon.get_training_summary()
    # The NaN gradient is non-finite, never an explosion.
    total, spikes, explosions, nonfinite, vanishing, loss_anoms, anomaly_steps = 10, 1, 1, 1, 2, 2, 5
    assert (s["total_steps"], s["loss_spikes"], s["gradient_explosions"], s["nonfinite_gradients"],
            s["gradient_vanishing"], s["loss_anomalies"], s["anomaly_steps"]) == (
        total, spikes, explosions, nonfinite, vanishing, loss_anoms, anomaly_steps)
    assert s["nonfinite_gradient_rate"] == nonfinite / total
    assert s["anomaly_rate"] == anomaly_steps / total
    assert s["gradient_explosion_rate"] == explosions / total
    assert s["gradient_vanishing_rate"] == vanishing / total
    assert s["loss_anomaly_rate"] == loss_anoms / total
    assert s["loss_spike_rate"] == spikes / total
    assert math.isclose(mon.last["grad_norm"], 1e-9 * math.sqrt(n_params), rel_tol=1e-5)


def test_monitor_state_round_trip():
    mon = tt.TrainingMonitor(window=4, min_history=2)
    for v in (1.0, 1.0, 1.0, 9.0):
        mon.monitor_training_step(None, v)
    other = tt.TrainingDebugger()
    other.load_state_dict(json.loads(json.dumps(mon.state_dict())))
    assert other.get_training_summary() == mon.get_training_summary()
    assert other.monitor_training_step(None, 50.0)["anomalies"] == mon.monitor_training_step(None, 50.0)["anomalies"]


def test_monitor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="window=0"):
        tt.TrainingMonitor(window=0)


def test_monitor_records_anomalies_on_the_runtime(tt_runtime):
    mon = tt.TrainingMonitor()
    mon.monitor_training_step(None, float("inf"), 7)
    rt = get_runtime()
    assert rt.metrics.registry.get_sample_value("torchtrace_anomalies_total", {
        "run_id": rt.settings.run_id, "rank": "0", "operation": "training_monitor", "kind": "nonfinite_loss"}) == 1


def test_validate_model_input():
    x = torch.randn(4, 3)
    assert tt.validate_model_input(x, expected_dims=2)["numel"] == 12
    bad = x.clone()
    bad[0, 0] = float("nan")
    bad[1, 1] = float("inf")
    with pytest.raises(ValueError, match="holds 1 NaN and 1 Inf value"):
        tt.validate_model_input(bad)
    with pytest.raises(ValueError, match="3 dimensions .* expected 2 or 4"):
        tt.validate_model_input(torch.zeros(1, 2, 3), expected_dims=(2, 4))
    with pytest.raises(ValueError, match="above the allowed maximum 1"):
        tt.validate_model_input(torch.tensor([0.5, 2.0]), max_value=1.0)
    with pytest.raises(ValueError, match="below the allowed minimum 0"):
        tt.validate_model_input(torch.tensor([-0.5, 0.0]), min_value=0.0)
    with pytest.raises(TypeError):
        tt.validate_model_input([1.0, 2.0])


def test_detect_model_anomalies(tt_runtime):
    torch.manual_seed(0)
    model = TinyNet()
    ok = tt.detect_model_anomalies(model, torch.randn(5, 8))
    assert ok["ok"] and ok["anomalies"] == []
    x = torch.randn(5, 8)
    x[0, 0] = float("nan")
    assert tt.detect_model_anomalies(model, x)["anomalies"] == [semconv.NONFINITE_OUTPUT]
    same = torch.randn(1, 8).repeat(5, 1)
    res = tt.detect_model_anomalies(model, same, value_range=(-1e-3, 1e-3))
    assert res["anomalies"] == [semconv.OUTPUT_OUT_OF_RANGE, semconv.UNIFORM_OUTPUT]
    rt = get_runtime()
    labels = {"run_id": rt.settings.run_id, "rank": "0", "operation": "detect_model_anomalies"}
    assert rt.metrics.registry.get_sample_value("torchtrace_anomalies_total", {**labels, "kind": "uniform_output"}) == 1


def test_analyze_pipeline_counts_per_component():
    class Pipe:
        def __init__(self):
            self.text_encoder = torch.nn.Linear(4, 6)
            self.unet = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 2)).to(torch.float64)
            self.unet[1].weight.requires_grad_(False)
            self.name = "not a module"

    p = Pipe()
    out = tt.analyze_pipeline(p)
    assert set(out["components"]) == {"text_encoder", "unet"}
    te, un = out["components"]["text_encoder"], out["components"]["unet"]
    assert te["parameters"] == 4 * 6 + 6 and te["dtypes"] == {"float32": 30} and te["devices"] == {"cpu": 30}
    assert un["parameters"] == 42 + 14 and un["trainable_parameters"] == 56 - 12
    assert un["parameter_bytes"] == 56 * 8
    assert out["total_parameters"] == 86 and out["component_count"] == 2
    shared = {"a": p.text_encoder, "b": p.text_encoder}
    assert tt.analyze_pipeline(shared)["total_parameters"] == 30


def test_monitor_loop_step_span_events(tt_runtime):
    with tt.debug_context("sample"):
        for i in range(3):
            t = torch.full((4,), float(i))
            if i == 2:
                t[0] = float("nan")
            out = tt.monitor_loop_step("denoise", i, t)
    assert out["nonfinite"] and out["nan_count"] == 1 and out["mean"] == 2.0
    rt = get_runtime()
    path = rt.spans_path
    tt.shutdown()
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    span = next(s for s in spans if s["name"] == "sample")
    events = [e for e in span["events"] if e["name"] == semconv.EVENT_LOOP_STEP]
    assert [e["attributes"][semconv.LOOP_STEP] for e in events] == [0, 1, 2]
    assert [e["attributes"][semconv.LOOP_NONFINITE] for e in events] == [False, False, True]
    assert events[1]["attributes"]["torchtrace.loop.mean"] == 1.0


def test_a_spike_the_monitor_finds_inside_a_step_is_the_steps_anomaly_and_says_its_numbers(tmp_path):
    """``TrainingMonitor.monitor_training_step`` inside a decorated step, the loss x50 at step
    40 of 60. Before, the spike went to an operation of its own ("training_monitor"): the step's
    span had no ``torchtrace.anomaly.kinds``, report.json's ``anomalies_by_kind`` was {} and the
    detail read "loss_spike at step 40". Now the step holds it (its span, the history's counts,
    report.json) and the detail gives the loss and the threshold the rule compared it with,
    computed here again from the losses the step returned."""
    import statistics

    result = tt.configure(service_name="spike", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                          register_atexit=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = tt.TrainingMonitor(window=20, spike_factor=3.0)
    teacher = torch.randn(16, 1)
    g = torch.Generator().manual_seed(2)
    losses = []

    @tt.debug_operation(model=model, optimizer=opt)
    def train_step(x, s):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x @ teacher) * (50.0 if s == 40 else 1.0)
        loss.backward()
        mon.monitor_training_step(model, loss, s)
        losses.append(loss.item())
        opt.step()
        return loss

    for s in range(60):
        train_step(torch.randn(32, 16, generator=g), s)
    tt.flush()
    rt = get_runtime()
    assert mon.get_training_summary()["loss_spikes"] == 1
    assert dict(rt.history.anomaly_counts) == {semconv.LOSS_SPIKE: 1}
    tt.shutdown()
    window = losses[20:40]
    mean, std = statistics.fmean(window), statistics.stdev(window)
    threshold = mean + 3.0 * std
    assert losses[40] > threshold and all(
        v <= statistics.fmean(losses[i - 20:i]) + 3 * statistics.stdev(losses[i - 20:i])
        for i, v in enumerate(losses) if 20 <= i != 40)
    run_dir = tmp_path / "runs" / result.run_id
    report = json.loads((run_dir / "report.json").read_text())
    assert report["anomalies_by_kind"] == {semconv.LOSS_SPIKE: 1}
    spans = [json.loads(line) for line in (run_dir / "spans.jsonl").read_text().splitlines()]
    spiked = [sp["attributes"][semconv.STEP] for sp in spans if sp["attributes"].get(semconv.ANOMALY_KINDS)]
    assert spiked == [40]
    event = next(e for e in report["events"] if e["type"] == "anomaly")
    assert event["data"]["operation"] == "train_step" and event["data"]["step"] == 40
    assert event["message"] == (f"loss {losses[40]:.4g} above the spike threshold {threshold:.4g} "
                                f"(mean {mean:.4g} + 3 x std {std:.4g} of the last 20 losses)")
