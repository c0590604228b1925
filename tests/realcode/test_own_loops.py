"""Real-code suite, hand-written loops: a GPT-style decoder trained in nanoGPT's order
(``zero_grad`` at the end, a disabled GradScaler, clipping), the same model under
``torch.compile``, and an LSTM language model with a hand-written SGD update. Each gets the
four planted faults (tests/realcode/models.py) under ``warn`` and ``skip``; the forensic report
must name the cause and the module, and ``skip`` must leave the weights as they were."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import torchtrace as tt
from tests.realcode import models
from torchtrace.api import get_runtime

BAD_STEP = 3
STEPS = 5
GUARDS = ("warn", "skip")


def _configure(tmp_path, guard):
    tt.configure(service_name="realcode", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                 register_atexit=False, guard=guard, throughput=False)


def _gpt_run(tmp_path, guard: str, fault: str, compiled: bool) -> dict:
    _configure(tmp_path, guard)
    torch.manual_seed(0)
    model = models.TinyGPT()
    runner = torch.compile(model, backend="eager") if compiled else model
    opt = torch.optim.SGD(models.gpt_param_groups(model, "lm_head"), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT's default off float16

    @tt.debug_operation
    def train_step(model, idx, targets, opt):
        _, loss = model(idx, targets)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)  # nanoGPT zeroes at the end of the step
        return loss

    gen = torch.Generator().manual_seed(1)
    out = {"before": None}
    for step in range(STEPS):
        idx, targets = models.gpt_batch(gen)
        saved = None
        if step == BAD_STEP:
            if fault == "inf_weight":
                saved = model.h[0].mlp.c_fc.weight.detach().clone()
                models.plant_inf_weight(model.h[0].mlp.c_fc)
            elif fault == "attention_overflow":
                saved = models.plant_attention_overflow(model.h[0].attn.c_attn)
            elif fault == "huge_lr":
                opt.param_groups[0]["lr"] = models.HUGE_LR
            else:
                idx = models.nan_embeddings(model, idx)
        if step == (BAD_STEP + 1 if fault == "huge_lr" else BAD_STEP):
            out["before"] = [p.detach().clone() for p in model.parameters()]
        train_step(runner, idx, targets, opt)
        if fault == "huge_lr" and step == BAD_STEP:
            opt.param_groups[0]["lr"] = 0.1
        if saved is not None and get_runtime().history.last_record.skipped:
            target = model.h[0].mlp.c_fc.weight if fault == "inf_weight" else model.h[0].attn.c_attn.weight
            models.put_back(target, saved)  # the fault was transient; the skipped step left no trace
            out["before"] = None  # (compared below only where nothing was put back)
        if step == (BAD_STEP + 1 if fault == "huge_lr" else BAD_STEP):
            out["after"] = [p.detach().clone() for p in model.parameters()]
    return _outcome(model, out)


def _outcome(model, out) -> dict:
    rt = get_runtime()
    result = {"reports": list(rt.forensics.reports), "section": rt.forensics.section(),
              "records": rt.history.totals.copy(), "unchanged": None}
    if out.get("before") is not None:
        result["unchanged"] = all(torch.equal(a, b) for a, b in zip(out["before"], out["after"]))
    tt.shutdown()
    return result


GPT_EXPECTED = {
    "inf_weight": ("parameter", "h.0.mlp.c_fc", BAD_STEP),
    "attention_overflow": ("forward", "h.0.attn", BAD_STEP),
    # The head's weights jumped to ~1e36, finite but past float32's extreme magnitude: the
    # cause is the head's parameter, and the overflow it made (in the loss the root module
    # computes) is where the value was found.
    "huge_lr": ("parameter", "lm_head", BAD_STEP + 1),
    "nan_input": ("input", "", BAD_STEP),
}


def _check(result, guard, expected, largest=None):
    cause, module, step = expected
    (report,) = result["reports"]
    assert (report["cause"], report["module"], report["step"]) == (cause, module, step), report
    assert "replay_error" not in report and report["params_updated"] is False
    if largest is not None:
        assert report["largest_params"][0]["name"] == report["extreme_params"][0]["name"] == largest
        assert report["found_in"]["cause"] == "forward" and report["found_in"]["module"] == ""
    else:
        assert "found_in" not in report  # no parameter past the extreme magnitude
    assert result["records"]["nonfinite_steps"] >= 1
    if guard == "skip" and result["unchanged"] is not None:
        assert result["unchanged"]  # the bad step's update was not applied


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("fault", models.FAULTS)
def test_gpt_in_nanogpt_order(tmp_path, guard, fault):
    result = _gpt_run(tmp_path, guard, fault, compiled=False)
    _check(result, guard, GPT_EXPECTED[fault], "lm_head.weight" if fault == "huge_lr" else None)


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("fault", models.FAULTS)
def test_compiled_gpt(tmp_path, guard, fault):
    result = _gpt_run(tmp_path, guard, fault, compiled=True)
    _check(result, guard, GPT_EXPECTED[fault], "lm_head.weight" if fault == "huge_lr" else None)


def _lstm_run(tmp_path, guard: str, fault: str) -> dict:
    """The word-language-model loop: hidden state carried and detached, clip_grad_norm_, then
    ``p.data.add_(p.grad, alpha=-lr)`` by hand. Its overflow fault is a temperature near zero
    in the model's own forward (an LSTM has no attention)."""
    _configure(tmp_path, guard)
    torch.manual_seed(0)
    model = models.TinyLSTM()
    lr = {"value": 0.5}
    norms = []

    @tt.debug_operation
    def train_step(model, ids, targets, hidden):
        model.zero_grad()
        log_probs, hidden = model(ids, hidden)
        loss = F.nll_loss(log_probs.reshape(-1, models.VOCAB), targets.reshape(-1))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25))
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr["value"])
        return loss

    gen = torch.Generator().manual_seed(2)
    hidden = model.init_hidden(2)
    out = {}
    for step in range(STEPS):
        ids = torch.randint(0, models.VOCAB, (models.SEQ, 2), generator=gen)
        targets = torch.roll(ids, -1, dims=0)
        hidden = tuple(h.detach() for h in hidden)
        saved = None
        if step == BAD_STEP:
            if fault == "inf_weight":
                saved = model.rnn.weight_hh_l0.detach().clone()
                with torch.no_grad():
                    model.rnn.weight_hh_l0.view(-1)[0] = float("inf")
            elif fault == "attention_overflow":
                model.temperature = 1e-40  # the logits overflow to Inf: NaN after log_softmax
            elif fault == "huge_lr":
                lr["value"] = models.HUGE_LR
            else:
                hidden = (hidden[0].clone(), hidden[1])
                hidden[0][0, 0, 0] = float("nan")
        bad = step == (BAD_STEP + 1 if fault == "huge_lr" else BAD_STEP)
        if bad:
            out["before"] = [p.detach().clone() for p in model.parameters()]
        loss = train_step(model, ids, targets, hidden)
        _, hidden = model(ids, hidden) if loss is not None else (None, hidden)
        if fault == "huge_lr" and step == BAD_STEP:
            lr["value"] = 0.5
        if step == BAD_STEP:
            model.temperature = 1.0
        if saved is not None and get_runtime().history.last_record.skipped:
            models.put_back(model.rnn.weight_hh_l0, saved)
            out["before"] = None
        if bad:
            out["after"] = [p.detach().clone() for p in model.parameters()]
            out["norm"] = float(norms[-1])
    result = _outcome(model, out)
    result["norm"] = out["norm"]
    return result


LSTM_EXPECTED = {
    "inf_weight": ("parameter", "rnn", BAD_STEP),
    "attention_overflow": ("forward", "", BAD_STEP),  # made by the root's own forward code
    "nan_input": ("input", "", BAD_STEP),
}


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("fault", models.FAULTS)
def test_lstm_with_a_hand_written_update(tmp_path, guard, fault):
    result = _lstm_run(tmp_path, guard, fault)
    if fault == "huge_lr":
        # The update is clipped to norm 0.25 first, so lr=1e38 moves a weight by 2.5e37 at most,
        # and the LSTM's gates saturate: every value stays finite. Nothing to localise, and no
        # false report either.
        assert result["reports"] == [] and result["records"].get("nonfinite_steps", 0) == 0
        assert math.isfinite(result["norm"])
        return
    assert not math.isfinite(result["norm"])  # clip_grad_norm_ returned the true norm
    _check(result, guard, LSTM_EXPECTED[fault])


@pytest.mark.usefixtures("tt_runtime")
def test_an_llm_recipe_trains_bit_for_bit_as_without_torchtrace():
    """The step LLM recipes write (bf16 autocast, a head sharing the token embedding's weight,
    clip_grad_norm_ to 1.0, AdamW) at the default settings, FLOP counting on its first steps
    included: the losses, the weights and AdamW's state equal an uninstrumented copy's to the
    bit over 30 steps. A second uninstrumented copy, run between them, is the control: were the
    machine's kernels not reproducible, it would differ too."""
    torch.manual_seed(0)
    base = models.TinyGPT()
    base.lm_head.weight = base.wte.weight
    copies = [copy.deepcopy(base) for _ in range(3)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in copies]

    def step(model, opt, idx, targets):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    instrumented = tt.debug_operation(name="train_step", model=copies[1], optimizer=opts[1])(step)
    runners = [step, instrumented, step]
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        idx, targets = models.gpt_batch(gen, batch=4)
        losses = [run(m, o, idx, targets) for run, m, o in zip(runners, copies, opts)]
        assert torch.equal(losses[0], losses[2]), "the control differs: this machine's kernels are not reproducible"
        assert torch.equal(losses[0], losses[1])
    bare, traced, control = copies
    assert all(torch.equal(p, q) for p, q in zip(bare.parameters(), control.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(bare.parameters(), traced.parameters()))
    for p, q in zip(bare.parameters(), traced.parameters()):
        sa, sb = opts[0].state[p], opts[1].state[q]
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert get_runtime().step_counters["train_step"] == 30  # every step was instrumented
