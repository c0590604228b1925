"""Layer-by-layer debugging: forward statistics against a hand-computed reference, no hook or
activation left behind, backward statistics, model inspection, EXTREME per-step activations."""

from __future__ import annotations

import gc
import json
import math
import weakref

import pytest
import torch

import torchtrace as tt
from torchtrace import semconv
from torchtrace.record import readout


def _ref_stats(t: torch.Tensor) -> dict:
    """mean/std/min/max over finite values and non-finite count, with plain Python floats."""
    vals = [float(v) for v in t.detach().to(torch.float64).reshape(-1).tolist()]
    finite = [v for v in vals if math.isfinite(v)]
    n = len(finite)
    mean = math.fsum(finite) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in finite) / (n - 1))
    return {"mean": mean, "std": std, "min": min(finite), "max": max(finite),
            "nonfinite_count": len(vals) - n}


def _hook_count(model) -> int:
    """Hooks on the model's layers. (The root carries the step-phase clock's two hooks while
    torchtrace runs: counted by _root_hooks.)"""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               for name, m in model.named_modules() if name)


def _root_hooks(model) -> int:
    return len(model._forward_hooks) + len(model._forward_pre_hooks) + len(model._backward_hooks)


def test_forward_stats_match_reference_and_nothing_left(tiny_model):
    x = torch.randn(5, 8, dtype=torch.float32)
    ref = {"encoder": _ref_stats(tiny_model.encoder(x)), "act": _ref_stats(torch.tanh(tiny_model.encoder(x))),
           "head": _ref_stats(tiny_model(x))}
    before = readout.reads()
    out = tt.debug_forward_pass(tiny_model, x)
    assert readout.reads() - before == 1  # one host read for every layer and the output
    assert [l["name"] for l in out["layers"]] == ["encoder", "act", "head"]
    for layer in out["layers"]:
        r = ref[layer["name"]]
        for key in ("mean", "std", "min", "max"):
            assert math.isclose(layer[key], r[key], rel_tol=1e-6, abs_tol=1e-7), (layer["name"], key)
        assert layer["nonfinite_count"] == r["nonfinite_count"] == 0
        assert layer["dtype"] == "float32" and layer["time_s"] >= 0
    assert out["layers"][0]["shape"] == [5, 16] and out["layers"][2]["shape"] == [5, 4]
    assert _hook_count(tiny_model) == 0
    # No activation is retained: the layer outputs die with the returned output.
    refs = []
    h = tiny_model.encoder.register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o)))
    out = tt.debug_forward_pass(tiny_model, x)
    h.remove()
    del out
    gc.collect()
    assert refs and all(r() is None for r in refs)


def test_forward_reports_first_nonfinite_layer():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Identity(), torch.nn.ReLU())
    x = torch.ones(2, 3)
    with torch.no_grad():
        model[0].bias[1] = float("inf")
    out = tt.debug_forward_pass(model, x)
    assert out["first_nonfinite_layer"] == "0"
    assert out["layers"][0]["inf_count"] == 2 and out["layers"][0]["nan_count"] == 0
    assert _hook_count(model) == 0


def test_hooks_removed_when_model_raises(tiny_model):
    try:
        tt.debug_forward_pass(tiny_model, torch.ones(2, 3))
    except RuntimeError:
        pass
    assert _hook_count(tiny_model) == 0


def test_backward_stats_match_reference(tiny_model):
    x = torch.randn(4, 8)
    loss = tiny_model(x).pow(2).mean()
    out = tt.debug_backward_pass(loss, model=tiny_model)
    assert set(out["params"]) == {"encoder.weight", "encoder.bias", "head.weight", "head.bias"}
    norms = []
    for name, p in tiny_model.named_parameters():
        g = [float(v) for v in p.grad.to(torch.float64).reshape(-1).tolist()]
        norm = math.sqrt(math.fsum(v * v for v in g))
        norms.append(norm)
        assert math.isclose(out["params"][name]["norm"], norm, rel_tol=1e-9)
        assert math.isclose(out["params"][name]["max"], max(g), rel_tol=1e-9)
    assert math.isclose(out["global_norm"], math.sqrt(math.fsum(n * n for n in norms)), rel_tol=1e-9)
    assert out["nonfinite_params"] == [] and out["time_s"] >= 0


def test_backward_without_model_finds_leaves():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    loss = (w * w).sum()
    out = tt.debug_backward_pass(loss)
    assert list(out["params"]) == ["param_0"]
    assert math.isclose(out["params"]["param_0"]["norm"], math.sqrt(2.0 ** 2 + 4.0 ** 2))


def test_inspect_model_names_failing_layer(tiny_model):
    ok = tt.inspect_model(tiny_model, (2, 8))
    assert ok["forward"]["ok"] and ok["forward"]["output_shape"] == [2, 4]
    assert ok["total_parameters"] == 8 * 16 + 16 + 16 * 4 + 4
    per = {l["name"]: l for l in ok["layers"]}
    assert per["encoder"]["parameters"] == 8 * 16 + 16 and per["head"]["parameters"] == 16 * 4 + 4
    assert per["(root)"]["parameters_total"] == ok["total_parameters"]
    assert ok["dtypes"] == ["float32"] and ok["devices"] == ["cpu"]
    bad = tt.inspect_model(tiny_model, (2, 7))
    assert bad["forward"]["ok"] is False
    assert bad["forward"]["failed_layer"] == "encoder"
    assert bad["forward"]["failed_module"] == "Linear"
    assert bad["forward"]["input_shapes"] == [[2, 7]]
    assert _hook_count(tiny_model) == 0 and tiny_model.training


def test_inspect_model_names_inner_layer():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    out = tt.PyTorchDebugger().inspect_model(model, (3, 4))
    assert out["forward"]["failed_layer"] == "2"
    assert out["forward"]["input_shapes"] == [[3, 6]]
    assert out["forward"]["output_shapes"]["0"] == [3, 6]


def test_debug_training_step(tiny_model):
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
    before = tiny_model.head.bias.detach().clone()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    out = tt.PyTorchDebugger().debug_training_step(tiny_model, x, y, torch.nn.functional.mse_loss, opt)
    assert out["optimizer_stepped"] and "output" not in out["forward"]
    assert [l["name"] for l in out["forward"]["layers"]] == ["encoder", "act", "head"]
    assert math.isfinite(out["loss"]) and out["backward"]["global_norm"] > 0
    assert not torch.equal(before, tiny_model.head.bias)


def test_extreme_level_records_layers_every_step(tiny_model, tmp_path):
    res = tt.configure(level="extreme", prometheus_port="off", run_dir=str(tmp_path), strict=True,
                       register_atexit=False)
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.0)
    x = torch.randn(3, 8)
    ref_head = _ref_stats(tiny_model(x))
    before = readout.reads()
    for _ in range(2):
        with tt.debug_context("train_step", model=tiny_model, optimizer=opt) as step:
            loss = tiny_model(x).sum()
            loss.backward()
            step.record_loss(loss)
            opt.step()
    assert readout.reads() - before == 2  # still one host read per step
    assert _hook_count(tiny_model) == 3  # kept between steps (switched off), one per leaf layer
    rows = step.record.activations
    assert [r["name"] for r in rows] == ["encoder", "act", "head"]
    assert math.isclose(rows[2]["mean"], ref_head["mean"], rel_tol=1e-6)
    tt.flush()
    spans = [json.loads(l) for l in res.spans_path.read_text().splitlines()]
    assert len(spans) == 2
    for s in spans:
        ev = [e for e in s["events"] if e["name"] == semconv.EVENT_ACTIVATIONS]
        assert len(ev) == 1
        assert ev[0]["attributes"][semconv.ACTIVATION_LAYERS] == ["encoder", "act", "head"]
        assert math.isclose(ev[0]["attributes"][semconv.ACTIVATION_MAX][2], ref_head["max"], rel_tol=1e-6)
    tt.shutdown()
    assert _hook_count(tiny_model) == 0  # shutdown removes them


def test_kept_hooks_record_only_inside_steps_and_go_with_the_level(tiny_model, tmp_path):
    tt.configure(level="extreme", prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False)
    try:
        x = torch.randn(3, 8)
        ref = _ref_stats(tiny_model(x))  # before the hooks exist
        for i in range(3):
            with tt.debug_context("train_step", model=tiny_model) as step:
                tiny_model(x).sum().backward()
            with torch.no_grad():
                tiny_model(torch.randn(5, 8) * 100)  # an evaluation between steps: not recorded
            rows = step.record.activations
            assert [r["name"] for r in rows] == ["encoder", "act", "head"], i
            assert math.isclose(rows[2]["mean"], ref["mean"], rel_tol=1e-6)
            assert math.isclose(rows[2]["max"], ref["max"], rel_tol=1e-6)
        with tt.debug_context("outer", model=tiny_model) as outer:
            tiny_model(x)
            with tt.debug_context("inner", model=tiny_model) as inner:
                tiny_model(x)
            assert _hook_count(tiny_model) == 3  # the inner step's own hooks are gone
        assert [r["name"] for r in inner.record.activations] == ["encoder", "act", "head"]
        # The outer step's hooks also saw the inner forward (as in a step without nesting).
        assert [r["name"] for r in outer.record.activations] == [
            "encoder", "act", "head", "encoder#1", "act#1", "head#1"]
        assert _hook_count(tiny_model) == 3
        tt.api.get_runtime().set_level("advanced")
        assert _hook_count(tiny_model) == 0
        with tt.debug_context("train_step", model=tiny_model) as step:
            tiny_model(x).sum().backward()
        assert step.record.activations is None and _hook_count(tiny_model) == 0
    finally:
        tt.shutdown()


def test_basic_level_installs_no_layer_hooks(tiny_model, tmp_path):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False)
    seen = []
    with tt.debug_context("s", model=tiny_model) as step:
        seen.append((_hook_count(tiny_model), _root_hooks(tiny_model)))
        tiny_model(torch.ones(1, 8)).sum().backward()
    # No hook at all: the phase clock's marks sit in the root's call seam, which shutdown empties.
    assert seen == [(0, 0)] and step.record.activations is None and set(step.record.phases) == {"forward", "backward"}
    assert tiny_model.__dict__.get("_compiled_call_impl") is not None
    tt.shutdown()
    assert _root_hooks(tiny_model) == 0 and "_compiled_call_impl" not in tiny_model.__dict__


def test_an_operation_pinned_at_extreme_keeps_its_hooks_through_runtime_level_changes(tiny_model, tmp_path):
    tt.configure(level="basic", prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False)
    try:
        x = torch.randn(3, 8)

        @tt.debug_operation(name="probe_step", model=tiny_model, level="extreme")
        def step():
            tiny_model(x).sum().backward()

        step()
        assert _hook_count(tiny_model) == 3
        tt.api.get_runtime().set_level("advanced")  # the runtime was never EXTREME
        assert _hook_count(tiny_model) == 3
        step()
        rec = tt.api.get_runtime().history.last_record
        assert [r["name"] for r in rec.activations] == ["encoder", "act", "head"]
        tt.api.get_runtime().set_level("extreme")
        tt.api.get_runtime().set_level("basic")  # leaving EXTREME removes every kept hook
        assert _hook_count(tiny_model) == 0
    finally:
        tt.shutdown()
    assert _hook_count(tiny_model) == 0


# ---------------------------------------------------------------- issue 19, item 2: the forensics rule
def _plain_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
    """softmax(QK^T/sqrt(d) + mask) V, the textbook attention: a row whose keys are all masked is
    softmax over -inf only, which is NaN (PyTorch >= 2.5's CPU kernels return zeros for it instead;
    older releases and other kernels return NaN, which is what this reproduces)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return torch.softmax(scores, dim=-1) @ v


def test_nan_born_in_attention_is_blamed_on_self_attn_not_dropout1(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _plain_attention)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
    x = torch.randn(3, 5, 8)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, :] = True  # a fully padded row
    out = tt.debug_forward_pass(layer, {"src": x, "src_key_padding_mask": mask})
    assert torch.isnan(out["output"][1]).all() and not torch.isnan(out["output"][[0, 2]]).any()
    # Before: only leaves were hooked, and the first non-finite leaf output was dropout1's.
    assert out["first_nonfinite_layer"] == "self_attn"
    assert out["nonfinite_origin"] == {"cause": "forward", "module": "self_attn", "module_type": "MultiheadAttention"}
    names = [layer_row["name"] for layer_row in out["layers"]]
    assert names[:2] == ["self_attn", "dropout1"]  # the attention module is in the layer list
    attn = out["layers"][0]
    assert attn["own_compute"] and attn["nan_count"] == 5 * 8  # the padded sequence's 5 positions
    # Its statistics against a reference computed another way: the module called directly.
    direct = layer.self_attn(x, x, x, key_padding_mask=mask, need_weights=False)[0]
    finite = direct[[0, 2]].detach().double()
    assert attn["mean"] == pytest.approx(float(finite.mean()), rel=1e-6)
    assert _hook_count(layer) == 0


def test_the_rule_shared_with_replay_ignores_minus_inf_masks_only():
    from torchtrace.forensics import blame

    mask = torch.tensor([0.0, float("-inf")])
    assert bool(blame.inputs_ok([mask])) and not bool(blame.outputs_ok([mask]))
    assert not bool(blame.inputs_ok([torch.tensor([float("inf")])]))
    assert not bool(blame.inputs_ok([torch.tensor([float("nan"), 0.0])]))
    # A model input holding NaN is the input's fault, not the first module's.
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    out = tt.debug_forward_pass(model, torch.tensor([[float("nan"), 1.0]]))
    assert out["nonfinite_origin"]["cause"] == "input" and out["first_nonfinite_layer"] == "0"


def test_root_computing_in_its_own_forward_is_blamed():
    class Divide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x) / 0.0  # born in the root's own code

    out = tt.debug_forward_pass(Divide(), torch.ones(1, 2))
    assert out["first_nonfinite_layer"] == "(root)" and out["nonfinite_origin"]["cause"] == "forward"
    assert out["layers"][0]["name"] == "lin" and out["layers"][0]["nonfinite_count"] == 0
