"""Forensics and the guard on the shapes real training code has (issue 49): a disabled
GradScaler, gradients zeroed at the end of the step, a torch.compile'd model, hand-written
updates and clip_grad_norm_'s return value under ``skip``, a NaN made by the root module's
own forward, an async step, and the smaller bookkeeping points."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest
import torch

import torchtrace as tt
from tests.forensics.zoo import BadGrad
from torchtrace.api import get_runtime


def _configure(tmp_path, **kw):
    kw.setdefault("guard", "warn")
    return tt.configure(service_name="t", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                        register_atexit=False, **kw)


class Mlp(torch.nn.Module):
    def __init__(self, fault: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.c_fc = torch.nn.Linear(8, 16)
        self.fault = fault if fault is not None else torch.nn.Identity()
        self.c_proj = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.c_proj(self.fault(torch.relu(self.c_fc(x))))


class TinyLM(torch.nn.Module):
    """Token ids in, (logits, loss) out, like nanoGPT's forward."""

    def __init__(self, fault: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(16, 8)
        self.mlp = Mlp(fault)
        self.lm_head = torch.nn.Linear(8, 16)

    def forward(self, idx, targets):
        logits = self.lm_head(self.wte(idx) + self.mlp(self.wte(idx)))
        return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1))


def _batch():
    return torch.randint(0, 16, (2, 5)), torch.randint(0, 16, (2, 5))


def _nanogpt_step(scaler, norms):
    """nanoGPT's order: backward through the scaler, unscale, clip, step, update, zero_grad last."""
    @tt.debug_operation
    def train_step(model, idx, targets, opt):
        _, loss = model(idx, targets)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss
    return train_step


@pytest.mark.parametrize("guard", ["warn", "skip"])
def test_disabled_grad_scaler_does_not_hide_nan_gradients(guard, tmp_path):
    """GradScaler(enabled=False) is no scaler: a NaN gradient under a finite loss is an anomaly."""
    _configure(tmp_path, guard=guard)
    torch.manual_seed(0)
    model = TinyLM(BadGrad())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    train_step = _nanogpt_step(torch.amp.GradScaler("cpu", enabled=False), [])
    train_step(model, *_batch(), opt)
    rt = get_runtime()
    record = rt.history.last_record
    assert "nonfinite_grad" in record.anomaly_kinds, record.anomaly_kinds
    assert not record.scaler_overflow
    assert rt.history.totals["nonfinite_steps"] == 1
    report = rt.forensics.reports[-1]
    assert (report["cause"], report["module"]) == ("backward", "mlp.fault")
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    if guard == "skip":
        assert record.skipped and finite
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    else:
        assert not finite  # warn applies the update, as documented


def test_step_that_zeroes_gradients_at_its_end_is_replayed(tmp_path):
    """The replay's step already ran backward and zeroed the gradients: no second backward."""
    _configure(tmp_path, guard="skip")
    torch.manual_seed(0)
    model = TinyLM(BadGrad())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step = _nanogpt_step(torch.amp.GradScaler("cpu", enabled=False), [])
    train_step(model, *_batch(), opt)
    report = get_runtime().forensics.reports[-1]
    assert "replay_error" not in report, report
    assert (report["cause"], report["module"], report["op"]) == ("backward", "mlp.fault", "_BadBackwardBackward")
    assert "mlp.fault" not in report["nonfinite_grads"] and "mlp.c_fc.weight" in report["nonfinite_grads"]


def test_a_replay_that_cannot_run_says_what_was_tried(tmp_path):
    """No 'born in None': the sentence says the replay found nothing, and why."""
    from torchtrace.probes.forensics import sentence
    _configure(tmp_path, guard="warn")
    torch.manual_seed(0)
    model = TinyLM()
    calls = []

    def replay():
        calls.append(1)
        raise RuntimeError("the data iterator is exhausted")

    with tt.debug_context("train_step", model=model, replay=replay) as step:
        _, loss = model(*_batch())
        step.record_loss(loss * float("nan"))
    report = step.record.forensics
    assert calls and report["cause"] == "unknown"
    text = sentence(report)
    assert "None" not in text
    assert "RuntimeError" in text and "the data iterator is exhausted" in text


def test_compiled_model_is_replayed_and_reported(tmp_path):
    _configure(tmp_path, guard="skip")
    torch.manual_seed(0)
    model = TinyLM()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step = _nanogpt_step(torch.amp.GradScaler("cpu", enabled=False), [])
    train_step(compiled, *_batch(), opt)
    with torch.no_grad():
        model.mlp.c_fc.weight[0, 0] = float("inf")
    train_step(compiled, *_batch(), opt)
    rt = get_runtime()
    report = rt.forensics.reports[-1]
    assert report["cause"] == "parameter"
    assert report["module"] in ("mlp.c_fc", "_orig_mod.mlp.c_fc")
    assert rt.history.last_record.skipped


def test_skip_leaves_gradients_tensors_for_a_hand_written_update(tmp_path):
    """The word-language-model update after clip_grad_norm_: gradients stay tensors, the
    update changes nothing, clip_grad_norm_ returns the true (NaN) norm."""
    _configure(tmp_path, guard="skip")
    torch.manual_seed(0)
    model = TinyLM(BadGrad())
    before = [p.detach().clone() for p in model.parameters()]
    norms = []

    @tt.debug_operation
    def train_step(model, idx, targets):
        model.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25))
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
        return loss

    train_step(model, *_batch())
    rt = get_runtime()
    assert rt.history.last_record.skipped
    assert math.isnan(float(norms[-1]))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert rt.forensics.reports[-1]["module"] == "mlp.fault"


class RootMath(torch.nn.Module):
    """The NaN is made by the root's own forward code, after its only child."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.log(self.lin(x) - 100.0)


def test_nan_made_in_the_root_modules_own_forward_is_blamed_on_the_root(tmp_path):
    _configure(tmp_path, guard="skip")
    torch.manual_seed(0)
    model = RootMath()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tt.debug_operation
    def train_step(model, x, opt):
        opt.zero_grad()
        loss = model(x).mean()
        loss.backward()
        opt.step()
        return loss

    train_step(model, torch.randn(4, 8), opt)
    report = get_runtime().forensics.reports[-1]
    assert (report["cause"], report["module"], report["module_type"]) == ("forward", "", "RootMath")


def test_async_step_is_replayed(tmp_path):
    _configure(tmp_path, guard="skip")
    torch.manual_seed(0)
    model = TinyLM(BadGrad())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tt.debug_operation
    async def train_step(model, idx, targets, opt):
        await asyncio.sleep(0)
        opt.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        return loss

    asyncio.run(train_step(model, *_batch(), opt))
    rt = get_runtime()
    assert rt.forensics.replays == 1
    assert rt.forensics.reports[-1]["module"] == "mlp.fault"


def test_incident_steps_are_counted_only_for_replayed_incidents(tmp_path):
    """A run of non-finite steps that was never replayed (no replay possible) counts nothing
    under steps_in_replayed_incidents."""
    _configure(tmp_path, guard="warn")
    torch.manual_seed(0)
    model = TinyLM()
    for _ in range(4):
        with tt.debug_context("train_step", model=model) as step:  # no replay= callable
            _, loss = model(*_batch())
            step.record_loss(loss * float("nan"))
    section = get_runtime().forensics.section()
    assert section["replays"] == 0 and section["steps_in_replayed_incidents"] == 0


NAMES_IN_A_LOG_LINE = 8


def test_diverged_step_log_caps_gradient_names(tmp_path, caplog):
    _configure(tmp_path, guard="warn")
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(40)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # a diverged run: every step non-finite, parameters too after the first
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                loss = model(torch.ones(1, 2)).sum() * float("nan")
                loss.backward()
                step.record_loss(loss)
                opt.step()
    messages = [r.getMessage() for r in caplog.records]
    assert messages
    for message in messages:
        assert message.count(".weight") + message.count(".bias") <= NAMES_IN_A_LOG_LINE, message


def test_an_applied_nan_update_is_not_productive_time(tmp_path):
    """Under warn the NaN update is applied: that step's time is not goodput's productive time."""
    _configure(tmp_path, guard="warn", forensics=False)
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tt.debug_operation
    def train_step(model, idx, targets, opt, poison=False):
        opt.zero_grad()
        _, loss = model(idx, targets)
        (loss * float("nan") if poison else loss).backward()
        opt.step()
        return loss

    for i in range(4):
        train_step(model, *_batch(), opt, poison=(i == 3))
    rt = get_runtime()
    records = list(rt.history.records) if hasattr(rt.history, "records") else None
    goodput = rt.throughput.ledger.closed()
    bad = rt.history.last_record
    assert bad.nonfinite and not bad.skipped
    assert goodput.badput["skipped_step"] == pytest.approx(bad.duration_s, rel=1e-6, abs=1e-9), (goodput, records)


def test_skip_decided_at_a_clip_holds_for_an_optimizer_the_step_does_not_name(tmp_path):
    """The optimizer is a global the step never names: the skip decided at the clip call still
    leaves the parameters and Adam's state as they were (its update finds no gradients)."""
    _configure(tmp_path, guard="skip")
    torch.manual_seed(0)
    model = TinyLM(BadGrad())
    opt = torch.optim.Adam(model.parameters(), lr=0.1, weight_decay=0.1)

    @tt.debug_operation
    def train_step(model, idx, targets):
        opt.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    train_step(model, *_batch())
    assert get_runtime().history.last_record.skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.state  # Adam never stepped a parameter: no moments, no step count
