"""Forensic replay: the planted-fault zoo is localised and classified; healthy steps report nothing;
the replay leaves the training result untouched; guard policies skip, raise and stop."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import torchtrace as tt
from tests.conftest import TinyNet
from tests.forensics.zoo import BadGrad, HalfBlock, MyNorm, SafeLogLoss, SqrtFeature, Zoo
from torchtrace import semconv
from torchtrace.api import get_runtime
from torchtrace.probes.forensics import sentence


def _configure(tmp_path, **kw):
    kw.setdefault("guard", "skip")
    return tt.configure(service_name="t", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                        register_atexit=False, **kw)


def _make_step(loss_kind="mse"):
    @tt.debug_operation
    def train_step(model, batch, opt):
        opt.zero_grad()
        out = model(batch)
        if loss_kind == "mse":
            loss = out.pow(2).mean()
        else:  # a hand-written log loss; saturated softmax -> log(0)
            loss = SafeLogLoss()(torch.softmax(out * 1e4, -1), torch.ones_like(out))
        loss.backward()
        opt.step()
        return loss
    return train_step


def _const_row():
    x = torch.randn(4, 8)
    x[2] = 1.0
    return x


def _nan_input():
    x = torch.randn(4, 8)
    x[1, 3] = float("nan")
    return x


# (fault module, slot name, slot position, batch factory, loss) -> expected (cause, kind, module, op)
ZOO = {
    "log0_in_loss": (None, "block", "mid", lambda: torch.randn(4, 8), "log",
                     ("loss", semconv.NONFINITE_LOSS, "<loss>", None)),
    "sqrt_negative": (SqrtFeature(), "features", "mid", lambda: torch.randn(4, 8), "mse",
                      ("forward", semconv.NONFINITE_OUTPUT, "features", None)),
    "zero_std_norm": (MyNorm(), "norm", "pre", _const_row, "mse",
                      ("forward", semconv.NONFINITE_OUTPUT, "norm", None)),
    "fp16_overflow": (HalfBlock(), "fp16", "mid", lambda: torch.randn(4, 8) * 10, "mse",
                      ("forward", semconv.NONFINITE_OUTPUT, "fp16", None)),
    "nan_in_batch": (None, "block", "mid", _nan_input, "mse",
                     ("input", semconv.NONFINITE_INPUT, "", None)),
    "nan_born_in_backward": (BadGrad(), "custom", "mid", lambda: torch.randn(4, 8), "mse",
                             ("backward", semconv.NONFINITE_GRAD, "custom", "_BadBackwardBackward")),
}


@pytest.mark.parametrize("case", sorted(ZOO))
def test_zoo_fault_is_localised_and_classified(case, tmp_path):
    fault, slot, where, batch, loss_kind, (cause, kind, module, op) = ZOO[case]
    _configure(tmp_path)
    torch.manual_seed(0)
    model = Zoo(fault, slot, where)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step = _make_step(loss_kind)
    train_step(model, batch(), opt)
    rt = get_runtime()
    assert rt.forensics.replays == 1
    report = rt.forensics.reports[-1]
    assert (report["cause"], report["kind"], report["module"]) == (cause, kind, module)
    assert report.get("op") == op
    assert report["rank"] == 0 and report["step"] == 0 and report["params_updated"] is False
    assert report["overflow"] is (case == "fp16_overflow")
    last = rt.history.last_record
    assert kind in last.anomaly_kinds and last.skipped
    if cause == "forward":  # producer's inputs finite, outputs not
        assert report["inputs"]["nan_count"] == 0 and report["inputs"]["inf_count"] == 0
        assert report["outputs"]["nan_count"] + report["outputs"]["inf_count"] > 0


def test_zoo_through_debug_context_with_replay_closure_and_no_optimizer(tmp_path):
    """No optimizer, warn policy: detected at the step's end, replayed through the user's closure."""
    _configure(tmp_path, guard="warn")
    torch.manual_seed(0)
    model = Zoo(SqrtFeature(), "features")
    x = torch.randn(4, 8)
    with tt.debug_context("eval_step", model=model, replay=lambda: model(x).pow(2).mean()) as step:
        loss = model(x).pow(2).mean()
        step.record_loss(loss)
    report = step.record.forensics
    assert (report["cause"], report["module"]) == ("forward", "features")
    assert semconv.NONFINITE_OUTPUT in step.record.anomaly_kinds
    assert all(p.grad is None for p in model.parameters())  # the replay's backward left nothing


def test_no_false_report_over_500_clean_steps(tmp_path):
    # Throughput off: a busy machine (another process on the cores) slows these 0.1 ms steps
    # several-fold, which the throughput rule rightly reports; this test is about health anomalies.
    _configure(tmp_path, guard="warn", throughput=False)
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_step = _make_step()
    for _ in range(500):
        train_step(model, torch.randn(16, 8), opt)
    rt = get_runtime()
    assert rt.history.totals["steps"] == 500
    assert rt.history.totals.get("anomaly_steps", 0) == 0
    assert rt.forensics.replays == 0 and not rt.forensics.reports


def _snapshot(model, opt, buffers=True):
    src = model.state_dict() if buffers else dict(model.named_parameters())
    params = {k: v.detach().clone() for k, v in src.items()}
    state = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
             for i, s in enumerate(opt.state.values())}
    return params, state


def _identical(a, b):
    pa, sa = a
    pb, sb = b
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            va, vb = sa[i][k], sb[i][k]
            assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, (i, k)


class Gate(torch.nn.Module):
    """Identity, or NaN when armed (to plant a fault in one chosen step)."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return x * float("nan") if self.armed else x


class NetWithState(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.3)
        self.gate = Gate()
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.gate(self.drop(torch.relu(self.bn(self.encoder(x))))))


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam"])
def test_skip_keeps_parameters_and_optimizer_state_bit_identical(opt_name, tmp_path):
    _configure(tmp_path, guard="skip")
    torch.manual_seed(0)
    model = NetWithState()
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgd_momentum"
           else torch.optim.Adam(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train_step = _make_step()
    batches = [torch.randn(8, 8) for _ in range(6)]
    for b in batches[:3]:
        train_step(model, b, opt)
        sched.step()
    before = _snapshot(model, opt, buffers=False)  # BatchNorm statistics are the step's own forward's
    model.gate.armed = True
    train_step(model, batches[3], opt)
    model.gate.armed = False
    rt = get_runtime()
    assert rt.history.last_record.skipped and rt.history.last_record.nonfinite
    assert all(p.grad is None for p in model.parameters())  # gradients cleared
    _identical(before, _snapshot(model, opt, buffers=False))
    assert rt.metrics.registry.get_sample_value(
        "torchtrace_skipped_steps_total", {"run_id": rt.settings.run_id, "rank": "0", "operation": "train_step"}) == 1
    train_step(model, batches[4], opt)  # training goes on
    after = _snapshot(model, opt, buffers=False)
    assert not rt.history.last_record.anomalies
    assert any(not torch.equal(after[0][k], before[0][k]) for k in before[0] if "weight" in k)


def test_replay_changes_nothing_compared_with_forensics_off(tmp_path):
    """Same run with and without forensics (dropout, BatchNorm, one planted NaN step): bit-identical."""
    finals = []
    for forensics in (True, False):
        _configure(tmp_path, guard="skip", forensics=forensics)
        torch.manual_seed(0)
        model = NetWithState()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        train_step = _make_step()
        for i in range(6):
            model.gate.armed = i == 3
            train_step(model, torch.randn(8, 8), opt)
        assert get_runtime().forensics.replays == (1 if forensics else 0)
        finals.append((_snapshot(model, opt), torch.rand(3)))
        tt.shutdown()
    _identical(finals[0][0], finals[1][0])
    assert torch.equal(finals[0][1], finals[1][1])  # the RNG stream continues as without replay


class TwoHeads(torch.nn.Module):
    """Two tasks, each head reading its own half of the input: a NaN in the first half makes
    the first task's outputs non-finite and leaves the second's finite."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)

    def forward(self, x):
        return torch.cat([self.first(x[:, :2]), self.second(x[:, 2:])], dim=1)


def _state_outside_the_model(tmp_path, forensics: bool, guard: str, how: str) -> list:
    """Five steps, a NaN in the first half of step 3's input, of a step that keeps state outside
    ``model=``: an uncertainty weight per task trained by the same optimizer (a multi-task
    loss's ``log_vars``), a critic with BatchNorm that scores the second task's output (no
    optimizer of its own, not the step's model), and a mixup weight drawn from NumPy's and
    Python's global generators. ``how``: ``operation`` (decorated), ``operation_zero_at_end``
    (the decorated step zeroes its gradients after the update, as nanoGPT does) or
    ``context`` (``replay=`` the same function). Returns everything the run leaves behind."""
    import random

    import numpy as np

    _configure(tmp_path, guard=guard, forensics=forensics)
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = TwoHeads()
    critic = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.BatchNorm1d(4))
    log_vars = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([*model.parameters(), log_vars], lr=0.1)
    zero_at_end = how == "operation_zero_at_end"

    def step(x):
        if not zero_at_end:
            opt.zero_grad()
        mix = float(np.random.beta(0.4, 0.4)) * random.uniform(0.5, 1.0)
        out = model(x * mix)
        losses = out.pow(2).mean(0)
        loss = (losses * torch.exp(-log_vars) + log_vars).sum() + critic(out[:, 1:]).pow(2).mean()
        loss.backward()
        opt.step()
        if zero_at_end:
            opt.zero_grad()
        return loss

    decorated = tt.debug_operation(name="train_step", model=model, optimizer=opt)(step)
    try:
        for i in range(5):
            x = torch.randn(8, 4)
            if i == 3:
                x[0, 0] = float("nan")
            if how == "context":
                with tt.debug_context("train_step", model=model, optimizer=opt, replay=lambda x=x: step(x)) as scope:
                    scope.record_loss(step(x))
            else:
                decorated(x)
        assert get_runtime().forensics.replays == (1 if forensics else 0)
    finally:
        tt.shutdown()
    return [*(t.detach().clone() for t in (*model.parameters(), log_vars, *critic.state_dict().values())),
            *(v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
            torch.tensor(np.random.random()), torch.tensor(random.random())]


@pytest.mark.parametrize("how", ["operation", "operation_zero_at_end", "context"])
@pytest.mark.parametrize("guard", ["warn", "skip"])
def test_a_replay_puts_back_the_state_the_step_keeps_outside_its_model(tmp_path, guard, how):
    """Bit for bit the run without forensics. Before, the replay's backward added the task
    weights' gradients a second time (or its ``zero_grad`` at the end wiped them: their update
    was lost), the critic's BatchNorm counted one batch more, and NumPy's and Python's
    generators were one mixup draw ahead."""
    with_replay = _state_outside_the_model(tmp_path / "on", True, guard, how)
    without = _state_outside_the_model(tmp_path / "off", False, guard, how)
    assert len(with_replay) == len(without)
    for a, b in zip(with_replay, without):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_gradients_accumulated_over_steps_say_the_nan_came_from_an_earlier_step(tmp_path):
    """One decorated step per micro-batch, the update every fourth: a NaN in micro-batch 1 is
    found in its input; the update's step, whose own replay is finite, says its non-finite
    gradients were there before its backward (it read "origin not found")."""
    _configure(tmp_path, guard="skip")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    @tt.debug_operation(name="micro_step", model=model, optimizer=opt)
    def micro_step(x):
        loss = model(x).pow(2).mean() / 4
        loss.backward()
        if len(calls) % 4 == 3:
            opt.step()
            opt.zero_grad()
        return loss

    for i in range(4):
        x = torch.randn(8, 4)
        if i == 1:
            x[0, 0] = float("nan")
        micro_step(x)
        calls.append(i)
    reports = get_runtime().forensics.reports
    first, update = reports[0], reports[-1]
    assert (first["step"], first["cause"]) == (1, "input")
    assert update["step"] == 3 and update["cause"] == "unknown"
    assert update["carried_over"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    text = sentence(update)
    assert "before this step" in text and "origin not found" not in text, text


def test_raise_policy_carries_the_report_after_recording(tmp_path):
    _configure(tmp_path, guard="raise")
    torch.manual_seed(0)
    model = Zoo(SqrtFeature(), "features")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(tt.NonFiniteError) as info:
        _make_step()(model, torch.randn(4, 8), opt)
    assert info.value.report["module"] == "features"
    assert semconv.NONFINITE_GRAD in info.value.kinds
    rt = get_runtime()
    assert rt.history.totals["nonfinite_steps"] == 1 and rt.history.last_record.exception_type == "NonFiniteError"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_raise_policys_error_carries_every_kind_its_step_recorded(tmp_path):
    """The error raised from the optimizer's pre-hook said ``nonfinite_grad`` alone while the
    step's record (its span, the report) had the loss and the output too."""
    _configure(tmp_path, guard="raise")
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tt.NonFiniteError) as info:
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            opt.zero_grad()
            loss = model(torch.full((2, 8), float("nan"))).sum()
            step.record_loss(loss)
            loss.backward()
            opt.step()
    recorded = get_runtime().history.last_record.anomaly_kinds
    assert {semconv.NONFINITE_GRAD, semconv.NONFINITE_LOSS} <= set(recorded), recorded
    assert sorted(info.value.kinds) == sorted(recorded)


def test_raise_policy_without_optimizer_raises_after_the_step(tmp_path):
    _configure(tmp_path, guard="raise")
    model = TinyNet()
    with pytest.raises(tt.NonFiniteError):
        with tt.debug_context("eval", model=model) as step:
            step.record_loss(torch.tensor(float("nan")))
    assert get_runtime().history.totals["nonfinite_steps"] == 1


def test_stop_after_k_consecutive_bad_steps(tmp_path):
    _configure(tmp_path, guard="skip", max_consecutive_bad_steps=3)
    torch.manual_seed(0)
    model = NetWithState()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step = _make_step()
    model.gate.armed = True
    train_step(model, torch.randn(8, 8), opt)
    train_step(model, torch.randn(8, 8), opt)
    model.gate.armed = False
    train_step(model, torch.randn(8, 8), opt)  # a good step resets the count
    model.gate.armed = True
    train_step(model, torch.randn(8, 8), opt)
    train_step(model, torch.randn(8, 8), opt)
    with pytest.raises(tt.NonFiniteError, match="3 consecutive"):
        train_step(model, torch.randn(8, 8), opt)


def test_replay_budget_is_spent_per_incident(tmp_path):
    """Consecutive non-finite steps are one incident: one replay. A new incident after recovery
    gets its own replay, until the budget is spent."""
    _configure(tmp_path, guard="skip", forensics_max_replays=2)
    model = NetWithState()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _make_step()
    rt = get_runtime()
    model.gate.armed = True
    for _ in range(5):  # incident 1: five bad steps in a row
        step(model, torch.randn(8, 8), opt)
    assert rt.forensics.replays == 1 and rt.forensics.incident_steps == 4
    model.gate.armed = False
    step(model, torch.randn(8, 8), opt)  # recovered
    model.gate.armed = True
    step(model, torch.randn(8, 8), opt)  # incident 2: replayed
    assert rt.forensics.replays == 2 and rt.forensics.incidents == 2
    model.gate.armed = False
    step(model, torch.randn(8, 8), opt)
    model.gate.armed = True
    step(model, torch.randn(8, 8), opt)  # incident 3: over the budget of 2
    assert rt.forensics.replays == 2 and rt.forensics.skipped_budget == 1
    assert rt.history.totals["nonfinite_steps"] == 7
    section = rt.summary()["forensics"]
    assert section["replays"] == 2 and len(section["reports"]) == 2
    assert [r["step"] for r in section["reports"]] == [0, 6]


def test_report_is_span_event_report_section_log_and_metric(tmp_path, caplog):
    _configure(tmp_path, guard="skip")
    torch.manual_seed(0)
    model = Zoo(SqrtFeature(), "features")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.ERROR, logger="torchtrace.forensics"):
        _make_step()(model, torch.randn(4, 8), opt)
    assert any("born in features" in r.getMessage() for r in caplog.records)
    rt = get_runtime()
    labels = {"run_id": rt.settings.run_id, "rank": "0", "operation": "train_step"}
    assert rt.metrics.registry.get_sample_value("torchtrace_anomalies_total",
                                                {**labels, "kind": semconv.NONFINITE_OUTPUT}) == 1
    section = rt.report()["forensics"]
    assert section["reports"][0]["module"] == "features"
    spans_path = rt.spans_path
    tt.shutdown()
    spans = [json.loads(line) for line in spans_path.read_text().splitlines()]
    events = [e for s in spans for e in s.get("events", []) if e["name"] == semconv.EVENT_FORENSICS]
    assert len(events) == 1
    attrs = events[0]["attributes"]
    assert attrs[semconv.FORENSICS_MODULE] == "features" and attrs[semconv.FORENSICS_CAUSE] == "forward"


def test_gradscaler_overflow_is_not_a_nonfinite_anomaly(tmp_path):
    _configure(tmp_path, guard="skip")
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1e38)

    @tt.debug_operation
    def amp_step(model, batch, opt, scaler):
        opt.zero_grad()
        loss = model(batch).pow(2).mean() * 1e3
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    before = {k: v.clone() for k, v in model.state_dict().items()}
    amp_step(model, torch.randn(4, 8), opt, scaler)
    assert scaler.get_scale() < 1e38  # the scaler saw the overflow and backed off
    with tt.debug_context("amp_ctx", model=model, scaler=scaler) as step:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        (loss * 1e38).backward()  # overflowing scaled gradients, finite loss
        step.record_loss(loss)
    rt = get_runtime()
    assert rt.history.totals.get("nonfinite_steps", 0) == 0 and rt.forensics.replays == 0
    assert step.record.scaler_overflow is True
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_gradscaler_with_a_real_nan_is_localised_without_touching_the_scaler(tmp_path):
    _configure(tmp_path, guard="skip")
    torch.manual_seed(0)
    model = Zoo(SqrtFeature(), "features")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    @tt.debug_operation
    def amp_step(model, batch, opt, scaler):
        opt.zero_grad()
        loss = model(batch).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    before = {k: v.clone() for k, v in model.state_dict().items()}
    amp_step(model, torch.randn(4, 8), opt, scaler)
    rt = get_runtime()
    report = rt.forensics.reports[-1]
    assert (report["cause"], report["module"]) == ("forward", "features")
    assert scaler.get_scale() == 512.0  # backed off once by the step itself, not again by the replay
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_nested_scopes_record_nothing_during_the_replay(tmp_path):
    _configure(tmp_path, guard="skip")
    model = Zoo(SqrtFeature(), "features")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tt.debug_operation
    def train_step(model, batch, opt):
        opt.zero_grad()
        with tt.debug_context("forward"):
            loss = model(batch).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    train_step(model, torch.randn(4, 8), opt)
    rt = get_runtime()
    assert rt.forensics.replays == 1
    assert dict(rt.history.operations) == {"forward": 1, "train_step": 1}


def test_replay_blames_attention_like_debug_forward_pass(tmp_path, monkeypatch):
    """The forensics rule and debug_forward_pass agree: a NaN born in self-attention (a fully
    padded row) is blamed on ``self_attn``, not on the next leaf or the whole layer."""
    import math as _math

    def plain_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        scores = q @ k.transpose(-2, -1) / _math.sqrt(q.shape[-1])
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                else scores + attn_mask
        return torch.softmax(scores, dim=-1) @ v

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", plain_attention)
    _configure(tmp_path, guard="skip")
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True, dropout=0.0)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(3, 5, 8)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, :] = True

    @tt.debug_operation(model=layer, optimizer=opt)
    def train_step(x, mask):
        opt.zero_grad()
        loss = layer(x, src_key_padding_mask=mask).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    train_step(x, mask)
    report = get_runtime().history.last_record.forensics
    assert report["cause"] == "forward" and report["module"] == "self_attn"
    assert report["module_type"] == "MultiheadAttention"
    assert tt.debug_forward_pass(layer, {"src": x, "src_key_padding_mask": mask})["first_nonfinite_layer"] == "self_attn"


@pytest.mark.parametrize("convert", [float, __import__("numpy").float32])
def test_a_returned_nan_number_is_replayed_as_the_losss_own(tmp_path, convert):
    """A step returning its loss as a number (a NumPy float32 is no float) that is NaN while its
    gradients are finite: the replay finds the loss non-finite, and adds no gradient anomaly
    (with np.float32 it read no loss, blamed "unknown ... born in None" and added nonfinite_grad)."""
    _configure(tmp_path, guard="skip")
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tt.debug_operation(model=model, optimizer=opt)
    def train_step(x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return convert(loss.item() * float("nan"))

    train_step(torch.randn(4, 8))
    rt = get_runtime()
    rt.finish_deferred(block=True)
    record = rt.history.last_record
    assert [a.kind for a in record.anomalies] == [semconv.NONFINITE_LOSS]
    assert record.forensics["cause"] == "loss"


class _Scaled(torch.nn.Module):
    """Two linears; the first one's weight is set to ``magnitude`` (finite), and the output is
    squared and summed: large enough weights overflow float32 in the squares."""

    def __init__(self, magnitude: float) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 1)
        with torch.no_grad():
            self.first.weight.fill_(magnitude)

    def forward(self, x):
        return self.second(self.first(x).pow(2))


@pytest.mark.parametrize("magnitude, expected", [(1e36, "parameter"), (1e19, "forward")])
def test_a_finite_but_extreme_parameter_is_the_cause_of_the_overflow_it_makes(tmp_path, magnitude, expected):
    """A weight at 1e36 (past float32's 2.6e28: a huge learning rate's update) is the cause,
    named by its module, with where the value went non-finite kept in ``found_in``; at 1e19 the
    squares still overflow (1e40), but the weight is within range: the forward is the cause."""
    _configure(tmp_path)
    model = _Scaled(magnitude)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _make_step()(model, torch.ones(4, 8), opt)
    report = get_runtime().forensics.reports[-1]
    assert report["cause"] == expected
    assert report["kind"] == semconv.NONFINITE_OUTPUT  # the anomaly counted is where it was found
    assert report["largest_params"][0]["name"] == "first.weight"
    if expected == "parameter":
        as_float32 = float(torch.tensor(magnitude, dtype=torch.float32))
        assert report["module"] == "first"
        assert report["extreme_params"][0] == {"name": "first.weight", "max_abs": as_float32}
        assert (report["found_in"]["cause"], report["found_in"]["module"]) == ("forward", "")
        assert "first.weight is finite but extreme" in sentence(report)
    else:
        assert report["module"] == "" and "found_in" not in report and "extreme_params" not in report
