"""Seed 001 ("PyTorch Debugging Guide", ads generation): every example, as written, with only
the imports changed and small models in place of the seed's.

Seed imports ``from onyx.server.features.ads.pytorch_debug_utils import PyTorchDebugger,
debug_context, TrainingDebugger, DiffusionModelDebugger`` and ``from ...training_logger import
AsyncTrainingLogger``; ``PyTorchDebugger``, ``debug_context``, ``TrainingDebugger`` and
``DebugLevel`` come from ``torchtrace``, the others from ``torchtrace.compat``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import types

import pytest
import torch

from tests.compat.common import metric, ref_norm, ref_stats, small_classifier, spans
from tests.export.debug_helpers import call, get_json
from torchtrace import DebugLevel, PyTorchDebugger, TrainingDebugger, debug_context, semconv
from torchtrace.compat import AsyncTrainingLogger, DiffusionModelDebugger, TrainingPhase


class LossModel(torch.nn.Module):
    """The seed's ``loss = model(inputs)``: a model whose forward returns its loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 2)
        self.scale = 1.0

    def forward(self, x):
        return self.net(x).pow(2).mean() * self.scale


# ---------------------------------------------------------------- basic autograd debugging
def test_basic_autograd_debugging_example(tt_runtime):
    model = LossModel()
    inputs = torch.randn(3, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with debug_context(DebugLevel.BASIC) as debugger:
        loss = model(inputs)
        loss.backward()
        optimizer.step()
    debugger = PyTorchDebugger(DebugLevel.ADVANCED)
    with debugger.autograd_anomaly_detection():
        assert torch.is_anomaly_enabled()
    assert not torch.is_anomaly_enabled() and debugger.level is DebugLevel.ADVANCED
    step_spans = [s for s in spans(tt_runtime) if s["name"] == "step"]
    assert len(step_spans) == 1 and step_spans[0]["attributes"][semconv.LEVEL] == "basic"


# ---------------------------------------------------------------- training debugger
def test_training_debugger_example_counts_rates_and_steps(tt_runtime):
    model = LossModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step sees the same gradients
    inputs = torch.randn(3, 4)
    debugger = TrainingDebugger(DebugLevel.ADVANCED)
    num_steps = 8
    explode_step, nan_step = 5, 7  # the NaN step last: the seed's loop steps the optimizer on it too
    norms = []
    for step in range(num_steps):
        optimizer.zero_grad()
        model.scale = {nan_step: float("nan"), explode_step: 1e6}.get(step, 1.0)
        loss = model(inputs)
        loss.backward()
        norms.append(ref_norm(p.grad for p in model.parameters()))
        step_info = debugger.monitor_training_step(model, loss, step)
        # The monitor's per-tensor norms are float32 (fused kernels), the reference float64.
        assert step_info["grad_norm"] == pytest.approx(norms[-1], rel=1e-6) or math.isnan(norms[-1])
        optimizer.step()
    summary = debugger.get_training_summary()
    print(f"Anomaly rate: {summary['anomaly_rate']:.2%}")
    # By hand: step 5 has a norm over 1e3 (the default) and a loss 1e6 times the others (a spike
    # over mean + 3 std of the window), step 7 a NaN loss and NaN gradients.
    assert norms[explode_step] > 1e3 > max(n for i, n in enumerate(norms) if i not in (nan_step, explode_step))
    assert (summary["total_steps"], summary["anomaly_steps"], summary["gradient_explosions"],
            summary["nonfinite_gradients"], summary["loss_spikes"], summary["loss_anomalies"]) == (8, 2, 1, 1, 1, 2)
    assert summary["anomaly_rate"] == 2 / 8 and summary["gradient_explosion_rate"] == 1 / 8
    # Each monitored step is a torchtrace step: spans, step metrics, anomalies counted once.
    step_spans = [s for s in spans(tt_runtime) if s["name"] == "training_step"]
    assert [s["attributes"][semconv.STEP] for s in step_spans] == list(range(8))
    assert step_spans[0]["attributes"][semconv.GRAD_NORM] == pytest.approx(norms[0], rel=1e-6)
    assert metric(semconv.M_STEPS, operation="training_step") == 8
    assert metric(semconv.M_ANOMALIES, operation="training_step", kind="nonfinite_loss") == 1
    assert metric(semconv.M_ANOMALIES, operation="training_step", kind="grad_explosion") == 1
    assert metric(semconv.M_ANOMALIES, operation="training_step", kind="loss_spike") == 1  # the monitor's rule


def test_training_debugger_level_off_measures_nothing():
    model = LossModel()
    model(torch.ones(1, 4)).backward()
    off = TrainingDebugger(DebugLevel.OFF)
    assert off.monitor_training_step(model, torch.tensor(float("nan")), 0)["enabled"] is False
    assert off.get_training_summary()["total_steps"] == 0
    basic = TrainingDebugger(DebugLevel.BASIC).monitor_training_step(model, torch.tensor(1.0), 0)
    advanced = TrainingDebugger(DebugLevel.ADVANCED).monitor_training_step(model, torch.tensor(1.0), 0)
    assert "memory" not in basic and advanced["memory"]["rss_bytes"] > 0 and advanced["vanished_params"] == []
    with pytest.raises(ValueError, match="level='loud'"):
        TrainingDebugger("loud")


# ---------------------------------------------------------------- diffusion debugger
class TinyUNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.time = torch.nn.Linear(1, 4)
        self.cross = torch.nn.Linear(8, 4)

    def forward(self, latents, timestep, encoder_hidden_states):
        t = self.time(torch.tensor([[float(timestep)]]))[..., None, None]
        c = self.cross(encoder_hidden_states.mean(1))[..., None, None]
        return latents - 0.1 * self.conv(latents) + 0.01 * (t + c)


class Pipeline:
    """A multi-module pipeline object, as a diffusers pipeline holds its parts."""

    def __init__(self):
        torch.manual_seed(0)
        self.unet = TinyUNet()
        self.text_encoder = torch.nn.Embedding(10, 8)
        self.vae = torch.nn.Sequential(torch.nn.Conv2d(4, 3, 1))
        self.scheduler = "not a module"


def test_diffusion_debugger_example(tt_runtime):
    pipeline = Pipeline()
    debugger = DiffusionModelDebugger(DebugLevel.BASIC)
    pipeline_analysis = debugger.analyze_diffusion_pipeline(pipeline)
    print(f"Total parameters: {pipeline_analysis['total_parameters']}")
    expected = sum(p.numel() for m in (pipeline.unet, pipeline.text_encoder, pipeline.vae) for p in m.parameters())
    assert pipeline_analysis["total_parameters"] == expected
    assert set(pipeline_analysis["components"]) == {"unet", "text_encoder", "vae"}
    latents = torch.randn(1, 4, 8, 8)
    encoder_hidden_states = pipeline.text_encoder(torch.tensor([[1, 2, 3]]))
    num_inference_steps = 4
    means = []
    with torch.no_grad():
        for step in range(num_inference_steps):
            timestep = 1000 - 250 * step
            latents = pipeline.unet(latents, timestep, encoder_hidden_states)
            if step == 3:
                latents[0, 0, 0, 0] = float("nan")
            step_info = debugger.monitor_diffusion_step(pipeline, step, latents)
            means.append((step_info["mean"], ref_stats(latents)["mean"]))
    for got, ref in means:
        assert got == pytest.approx(ref, rel=1e-9, abs=1e-12)
    assert step_info["nonfinite"] and step_info["nan_count"] == 1
    assert debugger.get_debug_summary()["total_anomalies"] == 1
    loop = [e for s in spans(tt_runtime) for e in s["events"] if e["name"] == semconv.EVENT_LOOP_STEP]
    assert [e["attributes"][semconv.LOOP_STEP] for e in loop] == [0, 1, 2, 3]
    assert metric(semconv.M_ANOMALIES, operation="diffusion", kind="nonfinite_output") == 1


def test_diffusion_pipeline_with_a_components_dict():
    class DiffusersLike:
        def __init__(self):
            self.components = {"unet": TinyUNet(), "vae": torch.nn.Conv2d(4, 3, 1), "tokenizer": object()}

    pipe = DiffusersLike()
    out = DiffusionModelDebugger().analyze_diffusion_pipeline(pipe)
    assert set(out["components"]) == {"unet", "vae"}
    assert out.total_parameters == sum(p.numel() for m in ("unet", "vae") for p in pipe.components[m].parameters())
    with pytest.raises(TypeError, match="holds no nn.Module"):
        DiffusionModelDebugger().analyze_diffusion_pipeline(object())


# ---------------------------------------------------------------- tensor and gradient analysis
def test_tensor_analysis_example():
    debugger = PyTorchDebugger()
    my_tensor = torch.tensor([[1.0, float("nan")], [3.0, -2.0]])
    tensor_info = debugger.analyze_tensor(my_tensor, "my_tensor")
    print(f"Has NaN: {tensor_info.has_nan}")
    print(f"Mean value: {tensor_info.mean_value}")
    ref = ref_stats(my_tensor)
    assert tensor_info.has_nan and tensor_info["has_nan"] and not tensor_info.has_inf
    assert tensor_info.mean_value == pytest.approx(ref["mean"]) and tensor_info.std_value == pytest.approx(ref["std"])
    model = small_classifier()
    with torch.no_grad():
        model[2].bias[0] = float("nan")
    param_analysis = debugger.analyze_model_parameters(model)
    flagged = []
    for name, info in param_analysis.items():
        if info.has_nan:
            flagged.append(name)
    assert flagged == ["2.bias"] and list(param_analysis) == [n for n, _ in model.named_parameters()]
    assert param_analysis.total_parameters == sum(p.numel() for p in model.parameters())
    assert param_analysis["0.weight"].mean_value == pytest.approx(ref_stats(model[0].weight)["mean"], rel=1e-9)


def test_gradient_analysis_example():
    debugger = PyTorchDebugger()
    model = small_classifier()
    model(torch.randn(4, 6)).pow(2).sum().backward()
    with torch.no_grad():
        model[0].weight.grad.mul_(100.0)
        model[2].bias.grad.mul_(1e-9)
    gradient_info = debugger.analyze_gradients(model)
    norms = {n: ref_norm([p.grad]) for n, p in model.named_parameters()}
    # The core's norm: float32 per-tensor norms (fused kernels), the reference float64.
    assert float(gradient_info) == pytest.approx(ref_norm(p.grad for p in model.parameters()), rel=1e-6)
    exploded_params = debugger.check_gradient_explosion(model, threshold=10.0)
    if exploded_params:
        print(f"Gradient explosion in: {exploded_params}")
    vanished_params = debugger.check_gradient_vanishing(model, threshold=1e-6)
    if vanished_params:
        print(f"Gradient vanishing in: {vanished_params}")
    assert exploded_params == [n for n, v in norms.items() if v > 10.0] == ["0.weight"]
    assert vanished_params == [n for n, v in norms.items() if v < 1e-6] == ["2.bias"]
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    assert ref_norm(p.grad for p in model.parameters()) == pytest.approx(1.0, rel=1e-5)


def test_memory_issue_example_total_is_the_models_bytes():
    debugger = PyTorchDebugger()
    model = small_classifier()
    model.register_buffer("running", torch.zeros(7, dtype=torch.float64))
    model(torch.randn(2, 6)).sum().backward()
    memory_profile = debugger.profile_memory_usage(model)
    total_memory = memory_profile["total"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert total_memory == 2 * params + 7 * 8  # parameters, their gradients, the float64 buffer
    available_memory = 1 << 40
    assert not total_memory > available_memory


def test_nan_loss_example_and_best_practices():
    debugger = PyTorchDebugger()
    model = small_classifier()
    inputs = torch.randn(3, 6)
    loss = model(inputs).sum() * float("nan")
    learning_rate, warnings = 2.0, []
    if torch.isnan(loss):
        input_info = debugger.analyze_tensor(inputs, "model_inputs")
        param_info = debugger.analyze_model_parameters(model)
        if learning_rate > 1.0:
            warnings.append("Learning rate too high")
    assert not input_info.has_nan and not any(i.has_nan for i in param_info.values()) and warnings
    summary = debugger.get_debug_summary()
    threshold = 0
    assert summary["total_anomalies"] == threshold  # nothing anomalous was analysed
    debugger.analyze_tensor(loss, "loss")
    assert debugger.get_debug_summary()["total_anomalies"] == 1
    debugger.clear_debug_history()
    assert debugger.get_debug_summary()["total_anomalies"] == 0


# ---------------------------------------------------------------- async training logger
class SlowHandler(logging.Handler):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.records: list[logging.LogRecord] = []
        self.threads: set[str] = set()

    def emit(self, record):
        time.sleep(self.delay)
        self.threads.add(threading.current_thread().name)
        self.records.append(record)


def test_async_logger_really_logs_asynchronously():
    target = logging.getLogger("seed001.slow")
    target.setLevel(logging.INFO)
    handler = SlowHandler(0.2)
    target.addHandler(handler)
    log = AsyncTrainingLogger(user_id=123, model_name="tiny", logger=target)
    try:
        t0 = time.perf_counter()
        for i in range(5):
            log.log_info(f"step {i}", TrainingPhase.TRAINING)
        caller = time.perf_counter() - t0
        assert caller < 0.1  # five records behind a 0.2 s handler: the caller did not wait for it
        assert log.flush(timeout=5.0)
        assert time.perf_counter() - t0 >= 5 * 0.2
        assert [r.getMessage() for r in handler.records] == [f"[training] step {i}" for i in range(5)]
        assert handler.threads == {"torchtrace-training-logger"} and handler.records[0].user_id == 123
    finally:
        log.close()
        target.removeHandler(handler)


@pytest.mark.parametrize("lr,shown", [
    (torch.tensor([1e-3]), "lr 0.001"), (torch.tensor(2e-3), "lr 0.002"), ("1e-3", "lr 0.001"),
    (torch.tensor([1e-3, 2e-3]), "lr tensor([0.0010, 0.0020])"), (None, None),
])
def test_update_progress_takes_any_learning_rate_the_optimizer_holds(lr, shown):
    """The seed passes ``optimizer.param_groups[0]['lr']``, which PyTorch lets be a one-element
    tensor (``Adam(params, lr=torch.tensor([1e-3]))``): before, formatting it raised TypeError
    inside the training loop (and a string ValueError). Now it is logged as its value."""
    target = logging.getLogger("seed001.lr")
    target.setLevel(logging.INFO)
    handler = SlowHandler(0.0)
    target.addHandler(handler)
    log = AsyncTrainingLogger(user_id=1, model_name="tiny", logger=target)
    try:
        result = asyncio.run(log.update_progress_async(epoch=0, step=1, loss=0.5, learning_rate=lr))
        assert result["learning_rate"] is lr
        assert log.flush(timeout=5.0)
        message = handler.records[-1].getMessage()
        assert (shown in message) if shown else ("lr" not in message), message
    finally:
        log.close()
        target.removeHandler(handler)


def test_async_training_logger_example(tt_runtime):
    model = small_classifier()
    logger = AsyncTrainingLogger(
        user_id=123,
        model_name="microsoft/DialoGPT-medium",
        enable_autograd_debug=True  # Enables PyTorch debugging
    )
    logger.start_training(total_epochs=10, total_steps=1000)
    assert torch.is_anomaly_enabled()  # "autograd debugging automatically enabled"
    loss_tensor = torch.tensor(float("nan"))
    warned = []

    async def main():
        tensor_info = await logger.check_tensor_anomalies_async(loss_tensor, "loss")
        if tensor_info["has_nan"]:
            logger.log_warning("Loss tensor contains NaN values")
            warned.append("loss")
        model(torch.randn(2, 6)).sum().backward()
        model[0].weight.grad[0, 0] = float("nan")
        gradient_info = await logger.check_gradient_anomalies_async(model)
        if gradient_info["params_with_nan_grad"] > 0:
            logger.log_warning("Model has parameters with NaN gradients")
            warned.append("grad")
        return gradient_info

    gradient_info = asyncio.run(main())
    logger.close()
    assert not torch.is_anomaly_enabled()  # restored
    assert warned == ["loss", "grad"] and gradient_info["nonfinite_params"] == ["0.weight"]
    assert metric(semconv.M_ANOMALIES, operation="check_tensor_anomalies", kind="nonfinite_loss") == 1
    assert metric(semconv.M_ANOMALIES, operation="check_gradient_anomalies", kind="nonfinite_grad") == 1


def test_custom_training_loop_example():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, batch):
            x, y = batch
            return types.SimpleNamespace(loss=torch.nn.functional.mse_loss(self.net(x), y))

    model = Model()
    g = torch.Generator().manual_seed(2)
    dataloader = [(torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)) for _ in range(3)]
    dataloader[1] = (dataloader[1][0] * float("nan"), dataloader[1][1])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    target = logging.getLogger("seed001.loop")
    target.setLevel(logging.INFO)
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    target.addHandler(handler)
    logger = AsyncTrainingLogger(user_id=1, model_name="m", logger=target)
    num_epochs = 2

    async def debug_training_loop(model, dataloader, optimizer, logger):
        """Training loop with comprehensive debugging."""
        for epoch in range(num_epochs):
            for step, batch in enumerate(dataloader):
                try:
                    outputs = model(batch)
                    loss = outputs.loss
                    loss_info = await logger.check_tensor_anomalies_async(loss, "loss")
                    if loss_info["has_nan"] or loss_info["has_inf"]:
                        logger.log_error(
                            ValueError("Loss contains NaN/Inf values"),
                            TrainingPhase.TRAINING,
                            {"epoch": epoch, "step": step, "loss_info": loss_info}
                        )
                        continue
                    loss.backward()
                    gradient_info = await logger.check_gradient_anomalies_async(model)
                    if gradient_info["params_with_nan_grad"] > 0:
                        logger.log_warning(
                            f"Gradient anomalies detected at step {step}",
                            TrainingPhase.TRAINING
                        )
                    await logger.update_progress_async(
                        epoch=epoch,
                        step=step,
                        loss=loss.item(),
                        learning_rate=optimizer.param_groups[0]['lr']
                    )
                    optimizer.step()
                    optimizer.zero_grad()
                except Exception as e:
                    logger.log_error(e, TrainingPhase.TRAINING, {"epoch": epoch, "step": step})
                    raise

    try:
        asyncio.run(debug_training_loop(model, dataloader, optimizer, logger))
        logger.flush()
    finally:
        logger.close()
        target.removeHandler(handler)
    errors = [r for r in seen if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all(r.context["step"] == 1 for r in errors) and errors[0].exc_info
    progress = [r for r in seen if r.getMessage().startswith("[training] epoch")]
    assert [(r.context["epoch"], r.context["step"]) for r in progress] == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert logger.progress["learning_rate"] == 0.1


# ---------------------------------------------------------------- the HTTP API
def _train(model, opt, n, nan_at=()):
    import torchtrace as tt

    x = torch.randn(4, 4)
    for i in range(n):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = model(x) * (float("nan") if i in nan_at else 1.0)
            opt.zero_grad()
            loss.backward()
            step.record_loss(loss)
            if i not in nan_at:
                opt.step()
    tt.flush()


def test_seed_routes_are_aliases_of_ours(tt_runtime):
    model = LossModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    _train(model, opt, 4, nan_at=(2,))
    port = tt_runtime.prometheus_port
    token = __import__("torchtrace").api.get_runtime().debug_api.token
    summary = get_json(port, "/training-logs/debug/summary")
    ours = get_json(port, "/debug/summary")
    assert summary["totals"]["steps"] == ours["totals"]["steps"] == 4
    training = get_json(port, "/training-logs/debug/training/summary")
    for key in ("total_steps", "anomaly_steps", "gradient_explosions", "gradient_vanishing", "loss_anomalies",
                "anomaly_rate", "loss_anomaly_rate", "gradient_explosion_rate", "gradient_vanishing_rate"):
        assert key in training, key
    assert (training["total_steps"], training["anomaly_steps"], training["loss_anomalies"]) == (4, 1, 1)
    assert training["loss_anomaly_rate"] == 0.25 and training["gradient_explosions"] == 0
    assert call(port, "POST", "/training-logs/debug/level/advanced")[0] == 401  # the same safety checks
    status, _, body = call(port, "POST", "/training-logs/debug/level/advanced", {"Authorization": f"Bearer {token}"})
    assert status == 202 and json.loads(body)["level"] == "advanced"
    status, _, _ = call(port, "POST", "/training-logs/debug/clear", {"Authorization": f"Bearer {token}"})
    assert status == 202
    _train(model, opt, 1)
    rt = __import__("torchtrace").api.get_runtime()
    assert rt.level is DebugLevel.ADVANCED and rt.history.totals["steps"] == 1
    assert call(port, "POST", "/training-logs/debug/level/loud", {"Authorization": f"Bearer {token}"})[0] == 400
