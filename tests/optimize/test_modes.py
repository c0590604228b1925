"""optimize_model: AMP, compilation with fallback, activation checkpointing, the decorator."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchtrace as tt
from tests.helpers import read_spans
from tests.optimize.models import DeepMLP, batches
from torchtrace import semconv
from torchtrace.measure.saved import SavedTensorMeter
from torchtrace.optimize import modes as modes_mod

M = tt.OptimizationMode


def _train(model, forward, steps=40, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches(4) * (steps // 4):
        opt.zero_grad()
        loss = F.mse_loss(forward(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ----------------------------------------------------------------------------- AMP
AMP_TOLERANCE = 0.02  # bfloat16 keeps 8 mantissa bits: losses agree to about 1e-2 relative


def test_amp_bfloat16_on_cpu_trains_within_tolerance_of_float32():
    torch.manual_seed(0)
    ref_model = DeepMLP(depth=3)
    amp_model = copy.deepcopy(ref_model)
    ref = _train(ref_model, ref_model)
    om = tt.optimize_model(amp_model, M.AMP)
    assert om.report.applied == ["amp"] and om.report.amp_dtype == "bfloat16" and not om.report.grad_scaler
    assert om(batches(1)[0][0]).dtype == torch.bfloat16  # autocast really ran
    amp = _train(amp_model, om)
    assert amp[-1] < 0.8 * amp[0]  # it trains
    for a, r in zip(amp, ref):
        assert abs(a - r) <= AMP_TOLERANCE * abs(r), (a, r)
    assert amp != ref  # and it really was a different precision


def test_amp_float16_on_cpu_is_refused_with_a_reason():
    om = tt.optimize_model(nn.Linear(2, 2), M.AMP, amp_dtype="float16")
    assert om.report.applied == [] and "bfloat16" in om.report.skipped["amp"]
    assert om(torch.ones(1, 2)).dtype == torch.float32


def test_bad_mode_and_dtype_raise_naming_the_setting():
    with pytest.raises(ValueError, match="mode='fast'.*accepted values: none, amp"):
        tt.optimize_model(nn.Linear(2, 2), "fast")
    with pytest.raises(ValueError, match="amp_dtype='int8'"):
        tt.optimize_model(mode="amp", amp_dtype="int8")


def test_amp_step_with_a_grad_scaler_gives_the_unscaled_update():
    torch.manual_seed(0)
    a = nn.Linear(3, 1)
    b = copy.deepcopy(a)
    x = torch.randn(5, 3)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    tt.amp_step(a(x).pow(2).mean(), opt_a)  # no scaler: backward + step
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    tt.amp_step(b(x).pow(2).mean(), opt_b, scaler)
    assert scaler.get_scale() == 2.0 ** 10  # finite gradients: scale kept (growth after 2000 steps)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_amp_on_cuda_uses_float16_and_a_grad_scaler():  # pragma: no cover - no GPU in CI
    model = DeepMLP(depth=2).cuda()
    om = tt.optimize_model(model, M.AMP)
    assert om.report.amp_dtype == "float16" and om.report.grad_scaler
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = (t.cuda() for t in batches(1)[0])
    with om.context():
        loss = F.mse_loss(om(x), y)
        assert tt.current_amp().scaler is om.amp.scaler
    tt.amp_step(loss, opt, om.amp.scaler)
    assert om.amp.scaler.get_scale() > 0


# ----------------------------------------------------------------------------- compilation
class Counting:
    """A torch.compile backend that counts the graphs it compiles and runs them eagerly."""

    __name__ = "counting"

    def __init__(self, fail: bool = False) -> None:
        self.graphs = 0
        self.fail = fail

    def __call__(self, gm, example_inputs):
        if self.fail:
            raise RuntimeError("unsupported op: aten.fancy")
        self.graphs += 1
        return gm.forward


def test_compilation_compiles_and_agrees_with_eager():
    torch.manual_seed(0)
    model = DeepMLP(depth=2)
    backend = Counting()
    om = tt.optimize_model(model, M.COMPILATION, compile_backend=backend)
    x = batches(1)[0][0]
    torch.testing.assert_close(om(x), model(x), rtol=0, atol=0)
    om(x)
    assert backend.graphs == 1  # compiled once, reused
    assert om.report.applied == ["compilation"] and om.report.compile_fallback is None


def test_compilation_falls_back_when_torch_compile_raises(tt_runtime, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no working C compiler")
    monkeypatch.setattr(torch, "compile", broken)
    model = DeepMLP(depth=2)
    om = tt.optimize_model(model, M.COMPILATION, compile_backend="inductor")
    x = batches(1)[0][0]
    torch.testing.assert_close(om(x), model(x), rtol=0, atol=0)
    assert om.report.applied == []
    assert om.report.compile_fallback == "RuntimeError: no working C compiler"
    span = [s for s in read_spans(tt_runtime.spans_path) if s["name"] == "optimize_model"][0]
    assert span["attributes"] == {
        semconv.OPT_MODE: "compilation", semconv.OPT_DEVICE: "cpu", semconv.OPT_APPLIED: [],
        semconv.OPT_SKIPPED: ["compilation: fell back to eager: RuntimeError: no working C compiler"],
        semconv.OPT_COMPILE_BACKEND: "inductor",
        semconv.OPT_COMPILE_FALLBACK: "RuntimeError: no working C compiler"}


def test_compilation_falls_back_when_the_backend_fails_on_first_call(tt_runtime):
    torch.manual_seed(0)
    model = DeepMLP(depth=2)
    om = tt.optimize_model(model, M.COMPILATION, compile_backend=Counting(fail=True))
    assert om.report.applied == ["compilation"]  # nothing known against it before the call
    x = batches(1)[0][0]
    torch.testing.assert_close(om(x), model(x), rtol=0, atol=0)
    assert om.report.applied == [] and "unsupported op: aten.fancy" in om.report.compile_fallback
    names = [s["name"] for s in read_spans(tt_runtime.spans_path)]
    assert names.count("optimize_model.fallback") == 1


def test_unknown_backend_name_falls_back():
    om = tt.optimize_model(nn.Linear(2, 2), M.COMPILATION, compile_backend="no_such_backend")
    assert om.report.applied == [] and "no_such_backend" in om.report.compile_fallback


def test_no_cxx_compiler_falls_back_without_trying(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(modes_mod.shutil, "which", lambda name: None)
    om = tt.optimize_model(nn.Linear(2, 2), M.COMPILATION)
    assert om.report.compile_fallback == "no C++ compiler found: inductor needs one for CPU code"


def test_user_errors_pass_through_a_compiled_model():
    om = tt.optimize_model(nn.Linear(2, 2), M.COMPILATION, compile_backend=Counting())
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        om(torch.ones(1, 3))


# ----------------------------------------------------------------------------- checkpointing
def _saved_bytes(forward, model, x):
    with SavedTensorMeter(model.parameters()) as meter:
        out = forward(x)
    return meter.bytes, out


def test_memory_efficient_lowers_saved_activation_bytes_and_keeps_results():
    torch.manual_seed(0)
    B, d, depth = 32, 16, 6
    model = DeepMLP(d=d, depth=depth)
    x = batches(1, b=B)[0][0]
    plain, out_plain = _saved_bytes(model, model, x)
    om = tt.optimize_model(model, M.MEMORY_EFFICIENT)
    assert om.report.applied == ["activation_checkpointing"]
    assert om.report.checkpointed == [f"blocks.{i}" for i in range(depth)]
    saved, out_ckpt = _saved_bytes(om, model, x)
    f = 4  # float32 bytes
    # Reference by hand: inp saves x; each block saves its input (B*d) and tanh's output
    # (B*4d); out saves the last block's output (B*d). Checkpointed blocks keep only inputs.
    assert plain == f * (B * 8 + depth * (B * d + B * 4 * d) + B * d)
    assert saved == f * (B * 8 + depth * B * d + B * d)
    assert saved < plain
    torch.testing.assert_close(out_ckpt, out_plain, rtol=0, atol=0)
    out_plain.sum().backward()
    g_plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out_ckpt.sum().backward()
    for a, b in zip(g_plain, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all("forward" not in m.__dict__ for m in model.modules())  # the user's model untouched


def test_flat_sequential_is_checkpointed_in_segments():
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    model = nn.Sequential(*layers)
    x = torch.randn(4, 16)
    plain, out_plain = _saved_bytes(model, model, x)
    om = tt.optimize_model(model, M.MEMORY_EFFICIENT)
    assert om.report.checkpointed == ["<model>[4 segments]"]
    saved, out = _saved_bytes(om, model, x)
    torch.testing.assert_close(out, out_plain, rtol=0, atol=0)
    # One activation is 4*16 float32 = 256 bytes. Plain: x (first Linear's input) and the 8
    # tanh outputs (each also the next Linear's input, counted once) = 9. Checkpointed in 4
    # segments of 4 layers: the first 3 segments keep only their inputs (3); the last runs
    # normally: its input and its 2 tanh outputs (3).
    assert plain == 9 * 256 and saved == 6 * 256


def test_blocks_with_batchnorm_are_not_checkpointed():
    class BNBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.lin(x))
    model = nn.Sequential(BNBlock(), BNBlock())
    om = tt.optimize_model(model, M.MEMORY_EFFICIENT)
    assert om.report.applied == [] and "BatchNorm" in om.report.skipped["activation_checkpointing:0"]


def test_full_optimization_applies_everything_that_applies():
    torch.manual_seed(0)
    model = DeepMLP(depth=2)
    om = tt.optimize_model(model, M.FULL_OPTIMIZATION, compile_backend=Counting())
    x, y = batches(1)[0]
    out = om(x)
    assert out.dtype == torch.bfloat16
    assert om.report.applied == ["amp", "activation_checkpointing", "compilation"]
    F.mse_loss(out.float(), y).backward()
    assert all(p.grad is not None for p in model.parameters())


# ----------------------------------------------------------------------------- decorator
def test_decorator_autocasts_and_exposes_the_amp_state(tt_runtime):
    seen = []

    @tt.optimize_model(mode=M.AMP)
    def predict(model, x):
        seen.append(tt.current_amp())
        return model(x)

    model = nn.Linear(4, 2)
    assert predict(model, torch.ones(1, 4)).dtype == torch.bfloat16
    predict(model, torch.ones(1, 4))
    assert tt.current_amp() is None and seen[0].dtype == torch.bfloat16 and seen[0].scaler is None
    assert model(torch.ones(1, 4)).dtype == torch.float32  # outside the decorated call: untouched
    spans = [s for s in read_spans(tt_runtime.spans_path) if s["name"] == "optimize_model"]
    assert len(spans) == 1  # applied once per model, cached
    assert spans[0]["attributes"][semconv.OPT_APPLIED] == ["amp"]


def test_decorator_compiles_the_model_argument_once():
    backend = Counting()

    @tt.optimize_model(mode="compilation", compile_backend=backend)
    def predict(model, x):
        return model(x)

    model = nn.Linear(4, 2)
    for _ in range(3):
        torch.testing.assert_close(predict(model, torch.ones(2, 4)), model(torch.ones(2, 4)))
    assert backend.graphs == 1
    assert predict.optimized[model].report.applied == ["compilation"]
    assert predict.optimized[model].weight is model.weight  # attributes reach the wrapped model


def test_state_dict_keys_are_the_models():
    model = DeepMLP(depth=2)
    om = tt.optimize_model(model, M.FULL_OPTIMIZATION, compile_backend="eager")
    assert list(om.state_dict()) == list(model.state_dict())


def test_optimization_mode_is_the_seeds_name_for_mode():
    """Issue 20: @optimize_model(optimization_mode=...) raised TypeError."""
    @tt.optimize_model(optimization_mode=tt.OptimizationMode.AMP)
    def predict(model, x):
        return model(x)

    assert predict(nn.Linear(3, 2), torch.randn(4, 3)).dtype == torch.bfloat16
    assert tt.optimize_model(nn.Linear(3, 2), optimization_mode="none").report.mode is tt.OptimizationMode.NONE
    assert tt.optimize_model(nn.Linear(3, 2), mode="amp", optimization_mode="amp").report.applied == ["amp"]
    with pytest.raises(ValueError, match="contradicts"):
        tt.optimize_model(nn.Linear(3, 2), mode="amp", optimization_mode="none")
    with pytest.raises(ValueError, match="optimization_mode='turbo'"):
        tt.optimize_model(optimization_mode="turbo")
