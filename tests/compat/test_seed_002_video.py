"""Seed 002 ("PyTorch Debugging Integration Summary", video clipper): every example, as written,
with only the imports changed and small models in place of the seed's.

Seed imports ``from pytorch_debug_tools import AutogradAnomalyDetector, GradientDebugger,
PyTorchMemoryDebugger, ModelDebugger, TrainingDebugger, PyTorchDebugConfig, PyTorchDebugManager``;
they come from ``torchtrace.compat``. ``optimized_training.OptimizedTrainer``/``TrainingConfig``
are the product's own trainer (docs/seed-api.md): that example builds its PyTorchDebugConfig only.
"""

from __future__ import annotations

import copy
import logging
import math
import os

import pytest
import torch

from tests.compat.common import chrome_trace_ops, metric, ref_norm, spans
from torchtrace import semconv
from torchtrace.compat import (
    AutogradAnomalyDetector,
    GradientDebugger,
    ModelDebugger,
    PyTorchDebugConfig,
    PyTorchDebugManager,
    PyTorchMemoryDebugger,
    TrainingDebugger,
)
from torchtrace.record import readout
from torchtrace.tools.memory import take_memory_snapshot


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 10, generator=g), torch.randn(32, 2, generator=g)


# ---------------------------------------------------------------- 1. autograd anomaly detection
def test_anomaly_detector_example_and_modes():
    config = PyTorchDebugConfig()
    anomaly_detector = AutogradAnomalyDetector(config)
    model, (x, y) = mlp(), data()
    loss = torch.nn.functional.mse_loss(model(x), y)
    with anomaly_detector.detect_anomaly():
        assert torch.is_anomaly_enabled()
        loss.backward()
    assert not torch.is_anomaly_enabled()
    bad = torch.tensor([-1.0], requires_grad=True)
    with pytest.warns(RuntimeWarning, match="autograd anomaly"):
        with AutogradAnomalyDetector(PyTorchDebugConfig(anomaly_mode="warn")).detect_anomaly():
            torch.sqrt(bad).sum().backward()
    off = AutogradAnomalyDetector(PyTorchDebugConfig(enable_autograd_anomaly=False))
    with off.detect_anomaly():
        assert not torch.is_anomaly_enabled()  # the switch has its effect


# ---------------------------------------------------------------- 2. gradient debugging
def test_gradient_debugger_example_step_is_never_a_threshold(tt_runtime):
    """Issue 20: check_gradients(model, step) took the step as the threshold; at step 0 every
    parameter was both exploded and vanished."""
    model, (x, y) = mlp(), data()
    torch.nn.functional.mse_loss(model(x), y).backward()
    gradient_debugger = GradientDebugger(PyTorchDebugConfig())
    step = 0
    gradient_info = gradient_debugger.check_gradients(model, step)
    assert gradient_info["step"] == 0 and gradient_info["anomalies"] == [] and gradient_info["exploded_params"] == []
    assert gradient_info["threshold"] == 1e3
    # The core's norm: float32 per-tensor norms (fused kernels), the reference float64.
    assert float(gradient_info) == pytest.approx(ref_norm(p.grad for p in model.parameters()), rel=1e-6)
    flow_analysis = gradient_debugger.analyze_gradient_flow(model)
    w = model[0].weight.grad.double().abs()
    assert flow_analysis["layers"][0]["mean_abs"] == pytest.approx(float(w.mean()), rel=1e-12)
    before = ref_norm(p.grad for p in model.parameters())
    returned = gradient_debugger.clip_gradients(model, max_norm=1.0)
    assert returned == pytest.approx(before, rel=1e-6)
    assert ref_norm(p.grad for p in model.parameters()) == pytest.approx(min(1.0, before), rel=1e-5)
    # Outside a step, an anomaly is counted under the seed call's name.
    model[0].bias.grad[0] = float("inf")
    assert gradient_debugger.check_gradients(model, 1)["params_with_inf_grad"] == 1
    assert metric(semconv.M_ANOMALIES, operation="check_gradients", kind="nonfinite_grad") == 1


def test_gradient_clip_threshold_clips_only_on_explosion():
    model, (x, y) = mlp(), data()
    (torch.nn.functional.mse_loss(model(x), y) * 1e6).backward()
    norm = ref_norm(p.grad for p in model.parameters())
    assert norm > 1e3
    debugger = GradientDebugger(PyTorchDebugConfig(gradient_norm_threshold=1e3, gradient_clip_threshold=1.0))
    info = debugger.check_gradients(model)
    # The core's norm: float32 per-tensor norms (fused kernels), the reference float64.
    assert info["clipped_to"] == 1.0 and info["norm_before_clipping"] == pytest.approx(norm, rel=1e-6)
    assert ref_norm(p.grad for p in model.parameters()) == pytest.approx(1.0, rel=1e-5)
    healthy = mlp()
    torch.nn.functional.mse_loss(healthy(x), y).backward()
    kept = ref_norm(p.grad for p in healthy.parameters())
    assert "clipped_to" not in debugger.check_gradients(healthy)
    assert ref_norm(p.grad for p in healthy.parameters()) == kept  # no anomaly: gradients untouched
    off = GradientDebugger(PyTorchDebugConfig(enable_gradient_debugging=False))
    before = readout.reads()
    assert off.check_gradients(healthy)["enabled"] is False and readout.reads() == before


# ---------------------------------------------------------------- 3. memory debugging
def test_memory_debugger_example():
    memory_debugger = PyTorchMemoryDebugger(PyTorchDebugConfig())
    tensor = torch.ones(256, 1024)
    assert memory_debugger.track_tensor(tensor, "my_tensor")
    snapshot = memory_debugger.take_memory_snapshot("checkpoint")
    assert snapshot.name == "checkpoint" and snapshot.tracked["my_tensor"] == 256 * 1024 * 4
    del tensor
    freed = memory_debugger.clear_memory()
    assert "rss_bytes" in freed
    assert take_memory_snapshot("after").tracked["my_tensor"] is None  # tracking never kept it alive
    quiet = PyTorchMemoryDebugger(PyTorchDebugConfig(track_tensor_memory=False))
    assert quiet.track_tensor(torch.ones(2), "ignored") is False
    assert PyTorchMemoryDebugger(PyTorchDebugConfig(enable_memory_debugging=False)).take_memory_snapshot("x") is None


# ---------------------------------------------------------------- 4. model debugging
def test_model_debugger_example():
    model_debugger = ModelDebugger(PyTorchDebugConfig())
    model = mlp()
    inspection = model_debugger.inspect_model(model, input_shape=(32, 10))
    assert inspection["total_parameters"] == 10 * 16 + 16 + 16 * 2 + 2
    assert inspection["forward"]["ok"] and inspection["forward"]["output_shape"] == [32, 2]
    validation = model_debugger._validate_model_inputs(model, (32, 10))
    assert validation["ok"]
    wrong = model_debugger._validate_model_inputs(model, (32, 9))
    assert not wrong["ok"] and wrong["failed_layer"] == "0" and wrong["input_shapes"] == [[32, 9]]
    assert ModelDebugger(PyTorchDebugConfig(enable_model_debugging=False)).inspect_model(model, (32, 10)) == {
        "enabled": False}


# ---------------------------------------------------------------- 5. training debugging
def test_training_debugger_example_against_a_plain_step(tt_runtime):
    model, (inputs, targets) = mlp(), data()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = torch.nn.functional.mse_loss
    training_debugger = TrainingDebugger(PyTorchDebugConfig())
    step = 3
    debug_info = training_debugger.debug_training_step(
        model, optimizer, loss_fn, inputs, targets, step
    )
    ref_loss = loss_fn(reference(inputs), targets)
    ref_loss.backward()
    assert debug_info["loss"] == pytest.approx(ref_loss.item(), rel=1e-6) and debug_info["optimizer_stepped"]
    assert float(debug_info["gradient_check"]) == pytest.approx(ref_norm(p.grad for p in reference.parameters()),
                                                                rel=1e-6)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().double(), r.detach().double() - 0.05 * r.grad.double(),
                                   rtol=1e-6, atol=1e-7)
    assert [layer["name"] for layer in debug_info["forward"]["layers"]] == ["0", "1", "2"]
    span = [s for s in spans(tt_runtime) if s["name"] == "debug_training_step"]
    assert len(span) == 1 and span[0]["attributes"][semconv.STEP] == 3
    assert span[0]["attributes"][semconv.LOSS] == pytest.approx(ref_loss.item(), rel=1e-6)
    assert training_debugger.get_training_summary()["total_steps"] == 1
    # The step's batch is the seed call's inputs: its rows, and FLOPs as FlopCounterMode counts
    # the same forward and backward.
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counted:
        loss_fn(copy.deepcopy(reference)(inputs), targets).backward()
    assert span[0]["attributes"][semconv.SAMPLES] == inputs.shape[0]
    assert span[0]["attributes"][semconv.FLOPS] == counted.get_total_flops()


def test_training_debugging_switch_and_snapshot_frequency():
    model, (inputs, targets) = mlp(), data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    plain = TrainingDebugger(PyTorchDebugConfig(enable_training_debugging=False))
    out = plain.debug_training_step(model, optimizer, torch.nn.functional.mse_loss, inputs, targets, 0)
    assert out["forward"]["layers"] == [] and out["gradient_check"] is None and "params" not in out["backward"]
    every2 = TrainingDebugger(PyTorchDebugConfig(memory_snapshot_frequency=2))
    taken = [("memory_snapshot" in every2.debug_training_step(model, optimizer, torch.nn.functional.mse_loss,
                                                              inputs, targets, s)) for s in range(4)]
    assert taken == [True, False, True, False]


# ---------------------------------------------------------------- use cases and config
def test_config_use_cases_construct_and_bad_values_are_refused():
    PyTorchDebugConfig(enable_autograd_anomaly=True, enable_gradient_debugging=True, enable_memory_debugging=True,
                       enable_model_debugging=True, enable_training_debugging=True, enable_profiling=True)
    PyTorchDebugConfig(enable_autograd_anomaly=True, enable_gradient_debugging=False, enable_memory_debugging=True,
                       enable_profiling=False)
    PyTorchDebugConfig(enable_autograd_anomaly=True, enable_gradient_debugging=True, gradient_norm_threshold=1e3,
                       gradient_clip_threshold=1.0)
    PyTorchDebugConfig(enable_memory_debugging=True, track_tensor_memory=True, memory_snapshot_frequency=10)
    with pytest.raises(ValueError, match="gradient_norm_threshold=-1"):
        PyTorchDebugConfig(gradient_norm_threshold=-1)
    with pytest.raises(ValueError, match="memory_snapshot_frequency=1.5"):
        PyTorchDebugConfig(memory_snapshot_frequency=1.5)
    with pytest.raises(ValueError, match="enable_profiling='yes'"):
        PyTorchDebugConfig(enable_profiling="yes")
    with pytest.raises(TypeError):
        PyTorchDebugConfig(enable_everything=True)


def test_manager_profiling_follows_enable_profiling(tmp_path):
    model, (x, y) = mlp(), data()
    on = PyTorchDebugManager(PyTorchDebugConfig(enable_profiling=True))
    with on.profiling(tmp_path / "t.json") as result:
        torch.nn.functional.mse_loss(model(x), y).backward()
    assert "aten::addmm" in chrome_trace_ops(result["path"])
    off = PyTorchDebugManager(PyTorchDebugConfig(enable_profiling=False))
    with off.profiling(tmp_path / "u.json") as result:
        pass
    assert result["path"] is None and not os.path.exists(tmp_path / "u.json")


# ---------------------------------------------------------------- integration with existing code
def test_manager_loop_example_and_comprehensive_report(tt_runtime):
    debug_manager = PyTorchDebugManager()
    model = mlp()
    loss_fn = torch.nn.functional.mse_loss
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(5)
    dataloader = [(torch.randn(8, 10, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]
    num_epochs = 2
    norms = []
    for epoch in range(num_epochs):
        for batch_idx, (inputs, targets) in enumerate(dataloader):
            with debug_manager.anomaly_detector.detect_anomaly():
                outputs = model(inputs)
                loss = loss_fn(outputs, targets)
                loss.backward()
            gradient_info = debug_manager.gradient_debugger.check_gradients(model)
            norms.append((float(gradient_info), ref_norm(p.grad for p in model.parameters())))
            optimizer.step()
        debug_manager.memory_debugger.take_memory_snapshot(f"epoch_{epoch}")
    report = debug_manager.generate_comprehensive_report()
    for got, ref in norms:
        # The core's norm: float32 per-tensor norms (fused kernels), the reference float64.
        assert got == pytest.approx(ref, rel=1e-6)
    assert report["gradient_analysis"]["checks"] == 6 and report["anomaly_detection"]["total_anomalies"] == 0
    assert [s["name"] for s in report["memory"]["snapshots"]] == ["epoch_0", "epoch_1"]
    assert set(report) >= {"anomaly_detection", "gradient_analysis", "memory", "model", "training", "cuda",
                           "profiling"}
    assert report["cuda"]["available"] == torch.cuda.is_available()


# torch's anomaly mode reports the planted NaN's backward op as a warning; torchtrace records it.
@pytest.mark.filterwarnings("ignore:Error detected in SqrtBackward0:UserWarning")
def test_error_recovery_example():
    anomaly_detector = AutogradAnomalyDetector(PyTorchDebugConfig())
    logger = logging.getLogger("seed002")
    w = torch.nn.Parameter(torch.tensor([-1.0, 4.0]))
    optimizer = torch.optim.SGD([w], lr=0.1)
    loss = torch.sqrt(w).sum()
    recovered = False
    try:
        with anomaly_detector.detect_anomaly():
            loss.backward()
    except Exception as e:
        logger.error(f"Gradient computation error: {e}")
        optimizer.zero_grad()
        recovered = True
    assert recovered and w.grad is None and len(anomaly_detector.anomalies) == 1
    assert "SqrtBackward0" in anomaly_detector.anomalies[0]["error"]
    assert math.isfinite(float(w.detach()[1]))
