"""The seeds' debugger API against references computed another way."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

import torchtrace as tt


def grads_model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    m(torch.randn(7, 6)).pow(2).sum().backward()
    return m


def ref_norm(t):
    return math.sqrt(sum(v * v for v in t.detach().double().reshape(-1).tolist()))


def test_check_gradients_norm_stats_and_anomalies():
    m = grads_model()
    dbg = tt.create_pytorch_debugger()
    report = dbg.check_gradients(m, gradient_threshold=1e9)
    ref_total = math.sqrt(sum(ref_norm(p.grad) ** 2 for p in m.parameters()))
    # The core's norm: float32 per-tensor norms (fused kernels), the reference float64.
    assert float(report) == pytest.approx(ref_total, rel=1e-6)
    for name, p in m.named_parameters():
        st = report["param_stats"][name]
        vals = p.grad.double().reshape(-1).tolist()
        mean = sum(vals) / len(vals)
        # The core's norm: float32 per-tensor norms (fused kernels), the reference float64.
        assert st["norm"] == pytest.approx(ref_norm(p.grad), rel=1e-6)
        assert st["mean"] == pytest.approx(mean, rel=1e-9, abs=1e-15)
        assert st["max"] == max(vals) and st["min"] == min(vals)
    assert report["anomalies"] == []
    low = dbg.check_gradients(m, gradient_threshold=1e-6)
    assert [a["kind"] for a in low["anomalies"]] == ["grad_explosion"]


def test_explosion_vanishing_names_and_nonfinite():
    m = grads_model()
    dbg = tt.PyTorchDebugger()
    norms = {n: ref_norm(p.grad) for n, p in m.named_parameters()}
    # Between two norms: the checks compare the core's float32 norms, the reference is float64.
    thr = sum(sorted(norms.values())[1:3]) / 2
    assert dbg.check_gradient_explosion(m, threshold=thr) == [n for n, v in norms.items() if v > thr]
    assert dbg.check_gradient_vanishing(m, threshold=thr) == [n for n, v in norms.items() if v < thr]
    m[0].weight.grad[0, 0] = float("nan")
    rep = dbg.check_gradients(m)
    assert rep["nonfinite_params"] == ["0.weight"] and math.isnan(float(rep))
    # NaN/Inf is non-finite, never "over the threshold" (before: listed as exploded at any threshold).
    assert dbg.check_gradient_explosion(m, threshold=1e-9) == [n for n in norms if n != "0.weight"]
    last = dbg.timeline.events()[-1]
    assert last["event_type"] == "nonfinite_gradient" and last["data"]["params"] == ["0.weight"]


def test_analyze_tensor_matches_reference():
    t = torch.tensor([[1.0, 2.0], [float("nan"), 4.0], [float("inf"), -3.0]])
    info = tt.PyTorchDebugger().analyze_tensor(t, "x")
    finite = [1.0, 2.0, 4.0, -3.0]
    mean = sum(finite) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / 3)
    assert info["nan_count"] == 1 and info["inf_count"] == 1 and info["has_nan"] and info["has_inf"]
    assert info["mean"] == pytest.approx(mean) and info["std"] == pytest.approx(std)
    assert (info["min"], info["max"]) == (-3.0, 4.0)
    assert info["shape"] == [3, 2] and info["dtype"] == "float32" and info["bytes"] == 24


def test_model_parameters_analysis():
    m = grads_model()
    m[2].weight.requires_grad_(False)
    out = tt.PyTorchDebugger().check_model_parameters(m)
    assert out["total_parameters"] == 6 * 5 + 5 + 5 * 2 + 2
    assert out["frozen_parameters"] == 5 * 2 and out["ok"]
    with torch.no_grad():
        m[0].bias[1] = float("inf")
    bad = tt.PyTorchDebugger().check_model_parameters(m)
    assert bad["nonfinite_params"] == ["0.bias"] and not bad["ok"]


def test_gradient_flow_and_clipping_on_anomaly():
    m = grads_model()
    flow = tt.PyTorchDebugger().analyze_gradient_flow(m)
    assert [l["name"] for l in flow["layers"]] == [n for n, _ in m.named_parameters()]
    w = m[0].weight.grad
    assert flow["layers"][0]["max_abs"] == pytest.approx(float(w.abs().max()))
    dbg = tt.create_pytorch_debugger(clip_on_anomaly=True, clip_max_norm=0.5, gradient_threshold=1e-3)
    dbg.check_gradients(m)
    assert math.sqrt(sum(ref_norm(p.grad) ** 2 for p in m.parameters())) == pytest.approx(0.5, rel=1e-5)


def test_anomaly_detection_modes_and_state_restored():
    dbg = tt.create_pytorch_debugger(enable_anomaly_detection=True)
    assert not torch.is_anomaly_enabled()
    x = torch.tensor([-1.0], requires_grad=True)
    with pytest.raises(RuntimeError):
        with dbg.anomaly_detection("detect"):
            assert torch.is_anomaly_enabled()
            torch.sqrt(x).sum().backward()
    assert not torch.is_anomaly_enabled()
    with pytest.warns(RuntimeWarning):
        with dbg.anomaly_detection("warn"):
            torch.sqrt(x).sum().backward()
    assert not torch.is_anomaly_enabled()
    assert dbg.get_debug_summary()["events_by_type"]["autograd_anomaly"] == 2
    with pytest.raises(ValueError, match="detect, warn, raise"):
        with dbg.anomaly_detection("loud"):
            pass


def test_summary_report_and_clear(tmp_path, caplog):
    m = grads_model()
    m[0].weight.grad[0, 0] = float("inf")
    dbg = tt.create_pytorch_debugger()
    with caplog.at_level(logging.WARNING, logger="torchtrace.debugger"):
        dbg.check_gradients(m)
    assert "nonfinite_gradient: NaN/Inf gradients in 0.weight" in caplog.text
    summary = dbg.get_debug_summary()
    assert summary["total_anomalies"] >= 1
    path = dbg.save_debug_report(tmp_path / "r.json")
    data = json.loads(open(path).read(), parse_constant=lambda c: pytest.fail("bare NaN"))
    assert data["events"][0]["type"] == data["events"][0]["event_type"] == "nonfinite_gradient"
    dbg.clear_debug_data()
    assert dbg.get_debug_summary()["total_events"] == 0


def test_bad_debugger_settings_raise_naming_the_setting():
    with pytest.raises(ValueError, match="explosion_threshold"):
        tt.create_pytorch_debugger(explosion_threshold=0)
    with pytest.raises(ValueError, match="anomaly_mode"):
        tt.create_pytorch_debugger(anomaly_mode="loud")
    with pytest.raises(TypeError, match="unknown debugger setting"):
        tt.create_pytorch_debugger(enable_everything=True)


def test_debug_training_session_is_a_span(tt_runtime):
    m = grads_model()
    with tt.debug_training_session(m, enable_anomaly_detection=True) as dbg:
        assert torch.is_anomaly_enabled()
        with tt.debug_context("train_step", model=m):
            pass
    assert not torch.is_anomaly_enabled()
    from tests.helpers import read_spans

    spans = {s["name"]: s for s in read_spans(tt_runtime.spans_path)}
    assert spans["train_step"]["parent_span_id"] == spans["training_session"]["span_id"]
    assert dbg.get_debug_summary()["events_by_type"]["session_finished"] == 1


def test_public_names_import():
    for name in tt.__all__:
        assert getattr(tt, name) is not None, name
    assert tt.DebugLevel.ADVANCED.value == "advanced" and tt.OptimizationMode.AMP.value == "amp"
    assert tt.DebugMode.FULL_DEBUG.value == "full_debug"


def test_one_default_per_threshold():
    """Issue 19, item 5: the explosion threshold was 1.0, 10.0 or 1e3 depending on the API."""
    from torchtrace import config
    from torchtrace.compat import PyTorchDebugConfig, TrainingDebugger

    explode, vanish = config.DEFAULT_GRAD_EXPLOSION_THRESHOLD, config.DEFAULT_GRAD_VANISHING_THRESHOLD
    settings = tt.Settings.resolve({}, environ={})
    assert (settings.grad_explosion_threshold, settings.grad_vanishing_threshold) == (explode, vanish)
    cfg = tt.create_pytorch_debugger().config
    assert (cfg.explosion_threshold, cfg.vanishing_threshold) == (explode, vanish)
    assert (tt.TrainingMonitor().explosion_threshold, tt.TrainingMonitor().vanishing_threshold) == (explode, vanish)
    assert TrainingDebugger().explosion_threshold == explode
    assert PyTorchDebugConfig().gradient_norm_threshold == explode
    # Every API judges a gradient at the default the same way: norms 5, 50, 5e3 and 1e-8.
    m = torch.nn.Linear(1, 4)
    m.weight.grad = torch.tensor([[5.0], [0.0], [0.0], [0.0]])
    m.bias.grad = torch.zeros(4)
    dbg = tt.PyTorchDebugger()
    for norm, exploded in ((5.0, False), (50.0, False), (5e3, True)):
        m.weight.grad[0, 0] = norm
        assert (dbg.check_gradient_explosion(m) == ["weight"]) is exploded
        assert ("grad_explosion" in [a["kind"] for a in dbg.check_gradients(m)["anomalies"]]) is exploded
        assert ("grad_explosion" in tt.TrainingMonitor().monitor_training_step(m, 1.0)["anomalies"]) is exploded
    for norm, vanished in ((1e-8, True), (1e-6, False)):  # around the vanishing default 1e-7
        m.weight.grad[0, 0] = norm
        assert ("grad_vanishing" in tt.TrainingMonitor().monitor_training_step(m, 1.0)["anomalies"]) is vanished
        assert ("grad_vanishing" in [a["kind"] for a in dbg.check_gradients(m)["anomalies"]]) is vanished


def test_check_gradients_forms_by_type_and_keyword():
    """Issue 20: check_gradients(model, step) and (model, loss) took the second argument as the threshold."""
    m = grads_model()
    dbg = tt.PyTorchDebugger()
    ref = math.sqrt(sum(ref_norm(p.grad) ** 2 for p in m.parameters()))
    at_step0 = dbg.check_gradients(m, 0)
    assert at_step0["step"] == 0 and at_step0["threshold"] == 1e3 and at_step0["anomalies"] == []
    with_loss = dbg.check_gradients(m, torch.tensor(0.25))
    assert with_loss["loss"] == 0.25 and with_loss["threshold"] == 1e3
    assert [a["kind"] for a in dbg.check_gradients(m, ref / 2)["anomalies"]] == ["grad_explosion"]
    assert [a["kind"] for a in dbg.check_gradients(m, gradient_threshold=ref / 2)["anomalies"]] == ["grad_explosion"]
    with pytest.raises(TypeError, match="is a bool"):
        dbg.check_gradients(m, True)
    with pytest.raises(TypeError, match="is not a number"):
        dbg.check_gradients(m, gradient_threshold=torch.tensor(1.0))
    with pytest.raises(TypeError, match="given twice"):
        dbg.check_gradients(m, 0.5, gradient_threshold=1.0)
    with pytest.raises(ValueError, match="gradient_threshold=-1"):
        dbg.check_gradients(m, gradient_threshold=-1)


def test_gradient_report_compares_as_its_norm_and_reads_as_attributes():
    m = grads_model()
    report = tt.PyTorchDebugger().check_gradients(m)
    ref = math.sqrt(sum(ref_norm(p.grad) ** 2 for p in m.parameters()))
    assert (report > ref / 2, report < ref / 2, report >= ref * 2, report <= ref * 2) == (True, False, False, True)
    assert report.global_norm == report["gradient_norm"] == float(report)
    with pytest.raises(TypeError):
        report > "1.0"


def test_constructor_forms_level_and_error_system(tt_runtime):
    from tests.helpers import read_spans

    seed000 = tt.PyTorchDebugger(logging.getLogger("x"), False)  # (logger, debug_mode)
    assert seed000.config.debug_mode is False and seed000.logger.name == "x"
    seed003 = tt.PyTorchDebugger(debug_mode=tt.DebugMode.ANOMALY_DETECTION)
    assert seed003.mode is tt.DebugMode.ANOMALY_DETECTION and seed003.config.enable_anomaly_detection
    with pytest.raises(ValueError, match="debug_mode=False contradicts mode='profiling'"):
        tt.PyTorchDebugger(debug_mode=False, mode="profiling")
    with pytest.raises(TypeError, match="error_system= must have"):
        tt.PyTorchDebugger(error_system=object())
    m = grads_model()
    off = tt.PyTorchDebugger(tt.DebugLevel.OFF)
    assert off.check_gradients(m)["enabled"] is False and off.check_gradients(m)["disabled_by"] == "level=off"
    advanced = tt.PyTorchDebugger(tt.DebugLevel.ADVANCED)
    basic = tt.PyTorchDebugger(tt.DebugLevel.BASIC)
    x, y = torch.randn(4, 6), torch.randn(4, 2)
    for dbg in (basic, advanced):
        dbg.debug_training_step(m, x, y, torch.nn.functional.mse_loss, torch.optim.SGD(m.parameters(), lr=0.0))
    steps = [s for s in read_spans(tt_runtime.spans_path) if s["name"] == "debug_training_step"]
    assert [s["attributes"]["torchtrace.level"] for s in steps] == ["basic", "advanced"]  # the step's level
