"""Float16 training with a real loss scaler (``torch.amp.GradScaler``, enabled), in the two orders
PyTorch's AMP recipe gives: ``scaler.step(opt)`` straight after the backward, and
``scaler.unscale_(opt)`` then ``clip_grad_norm_`` first (nanoGPT's), and a third many loops
have: ``clip_grad_norm_(params, inf)`` on the still-scaled gradients, to log their norm, then
``scaler.step(opt)`` (accelerate's ``clip_grad_norm_`` with no ``unscale_`` due, too). Each with a
plain and a fused AdamW: a fused optimizer unscales the gradients in its own kernel, so they
are still scaled when its update begins.

- The recorded gradient norm is that of the unscaled gradients: the float64 norm of
  ``grad / scale`` summed in a plain loop of a run without torchtrace.
- A scale overflow (Inf in the scaled gradients, routine while the scale backs off) is the
  scaler's business: it skips the update itself. No guard raises or skips for it, the weights
  and losses are those of the run without torchtrace, and the record says ``scaler_overflow``
  with no anomaly.
"""

from __future__ import annotations

import math

import pytest
import torch

import torchtrace as tt
from torchtrace.api import get_runtime

STEPS = 12


def _setup(fused: bool, init_scale: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return model, opt, scaler, torch.randn(64, 16)


SCALED = "scaled"  # ``clip``: a clip of the still-scaled gradients, before ``scaler.step``
CLIPS = pytest.mark.parametrize("clip", [False, True, SCALED], ids=["step", "unscale-clip-step", "scaled-clip-step"])


def _body(model, opt, scaler, x, clip: bool | str, norms: list | None = None):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).pow(2).mean()
    scaler.scale(loss).backward()
    if clip is True:
        scaler.unscale_(opt)
        if norms is not None:  # the reference: unscaled already
            norms.append(math.sqrt(sum(float(v) ** 2 for p in model.parameters() for v in p.grad.double().flatten())))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    elif norms is not None:
        scale = scaler.get_scale()
        norms.append(math.sqrt(sum((float(v) / scale) ** 2 for p in model.parameters()
                                   for v in p.grad.double().flatten())))
    if clip == SCALED:  # the logging idiom: the gradients stay as they are
        torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss


def _plain(fused: bool, clip: bool, init_scale: float):
    """The run without torchtrace: losses, the unscaled gradient norms, scales, final weights."""
    model, opt, scaler, x = _setup(fused, init_scale)
    losses, norms, scales = [], [], []
    for _ in range(STEPS):
        scales.append(scaler.get_scale())
        losses.append(_body(model, opt, scaler, x, clip, norms).item())
    return losses, norms, scales, [p.detach().clone() for p in model.parameters()]


def _traced(tmp_path, guard: str, fused: bool, clip: bool | str, init_scale: float, scales: list | None = None):
    tt.configure(service_name="scaler", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                 register_atexit=False, guard=guard)
    try:
        model, opt, scaler, x = _setup(fused, init_scale)
        losses, records = [], []
        for _ in range(STEPS):
            if scales is not None:
                scales.append(scaler.get_scale())
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                loss = _body(model, opt, scaler, x, clip)
                step.record_loss(loss)
            losses.append(loss.item())
            records.append(get_runtime().history.last_record)  # (on the CPU a step's record is final at its end)
        return losses, records, [p.detach().clone() for p in model.parameters()]
    finally:
        tt.shutdown()


@CLIPS
@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
def test_the_recorded_norm_is_that_of_the_unscaled_gradients(tmp_path, fused, clip):
    losses, norms, scales, weights = _plain(fused, clip, init_scale=1024.0)
    assert min(scales) == max(scales) == 1024.0  # no overflow: every step updates
    got, records, got_weights = _traced(tmp_path, "warn", fused, clip, init_scale=1024.0)
    assert got == losses
    assert all(torch.equal(a, b) for a, b in zip(got_weights, weights))
    assert [r.grad_norm for r in records] == pytest.approx(norms, rel=1e-5)
    assert norms[0] < 10  # (the scaled norm would be 1024 times this)


@pytest.mark.parametrize("guard", ["warn", "skip", "raise"])
@CLIPS
@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
def test_a_scale_overflow_is_left_to_the_scaler(tmp_path, guard, fused, clip):
    """Also with a clip of the still-scaled gradients: before, torchtrace judged the overflow
    there, before the scaler saw it; under ``skip`` it dropped the update, so the scaler found
    no Inf and never backed off (no update in the whole run), and ``raise`` raised at step 0."""
    losses, norms, scales, weights = _plain(fused, clip, init_scale=2.0 ** 24)
    overflowed = [later < now for now, later in zip(scales, scales[1:])]
    assert any(overflowed) and not all(overflowed)  # the case: some steps overflow, later ones update
    got_scales: list[float] = []
    got, records, got_weights = _traced(tmp_path, guard, fused, clip, init_scale=2.0 ** 24, scales=got_scales)
    assert got_scales == scales
    assert got == losses
    assert all(torch.equal(a, b) for a, b in zip(got_weights, weights))
    finite = [i for i, norm in enumerate(norms) if math.isfinite(norm)]
    assert [records[i].grad_norm for i in finite] == pytest.approx([norms[i] for i in finite], rel=1e-5)
    assert [r.scaler_overflow for r in records][:-1] == overflowed
    assert not any(r.skipped for r in records)
    assert [r.anomaly_kinds for r in records] == [[]] * STEPS


def test_a_non_finite_weight_under_a_scaler_raises_at_the_steps_end_and_training_goes_on(tmp_path):
    """A NaN planted in a weight, under ``guard="raise"`` (the clip order): the scaler skips the
    update, the record names the module, and the error is raised as the step ends, after the
    user's ``scaler.update()``. Raised at the clip call instead, the scaler was left unscaled:
    the next step's ``unscale_`` failed with torch's "already been called" error."""
    tt.configure(service_name="scaler", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                 register_atexit=False, guard="raise")
    try:
        model, opt, scaler, x = _setup(False, 1024.0)

        @tt.debug_operation(model=model, optimizer=opt)
        def train_step(x):
            return _body(model, opt, scaler, x, clip=True)

        outcomes = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
            before = [p.detach().clone() for p in model.parameters()]
            try:
                train_step(x)
                outcomes.append("ok")
            except tt.NonFiniteError as err:
                outcomes.append(err.kinds)
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()) if not a.isnan().any())
                assert get_runtime().history.last_record.forensics["module"] == "0"
                opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    model[0].weight[0, 0] = 0.0
        assert outcomes[:2] == ["ok", "ok"] and outcomes[3] == "ok"
        assert "nonfinite_param" in outcomes[2]
    finally:
        tt.shutdown()


def _split(model) -> list[torch.optim.Optimizer]:
    """Two optimizers sharing the model (matrices, vectors), as Muon-style recipes have."""
    return [torch.optim.SGD([p for p in model.parameters() if p.ndim == 2], lr=1e-2),
            torch.optim.Adam([p for p in model.parameters() if p.ndim != 2], lr=1e-2)]


@pytest.mark.parametrize("clip", ["none", "all", "each"], ids=["step", "unscale-clip-step", "unscale-clip-each"])
def test_a_model_only_step_with_two_optimizers_under_a_scaler_measures_no_mixed_norm(tt_runtime, caplog, clip):
    """A scaler unscales one optimizer's gradients as it steps: at the first one's update the
    other's are still scaled (a norm mixing both would be about 1024 times too large). So each
    optimizer's gradients are measured as its own update begins, unscaled. (They were not
    measured at all before, with a warning saying so.) After ``unscale_`` of both and a clip,
    the clip measures the whole model. Each optimizer unscaled and clipped on its own before
    its update: each clip measures the parameters it clips. Always: the float64 norm of the
    unscaled gradients before any clip; and each clip's total is torch's, bit for bit."""
    model, _, scaler, x = _setup(False, 1024.0)
    optimizers = _split(model)
    for _ in range(3):
        with tt.debug_context("train_step", model=model) as step:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).pow(2).mean()
            scaler.scale(loss).backward()
            expected = math.sqrt(sum(float(v) ** 2 for p in model.parameters()
                                     for v in p.grad.double().flatten())) / scaler.get_scale()
            if clip == "all":
                for opt in optimizers:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for opt in optimizers:
                if clip == "each":
                    scaler.unscale_(opt)
                    params = [p for group in opt.param_groups for p in group["params"]]
                    torch_total = torch.nn.utils.get_total_norm([p.grad.detach().clone() for p in params])
                    assert torch.equal(torch.nn.utils.clip_grad_norm_(params, 0.01), torch_total)
                scaler.step(opt)
            scaler.update()
            model.zero_grad(set_to_none=True)
            step.record_loss(loss)
        assert step.record.grad_norm == pytest.approx(expected, rel=1e-5)
    said = [r.getMessage() for r in caplog.records if "gradients were not measured" in r.getMessage()]
    assert not said, said


@pytest.mark.parametrize("report_json", [True, False], ids=["report", "spans-only"])
def test_the_updates_the_scaler_skipped_are_on_the_spans_and_in_the_report(tmp_path, report_json):
    """float16 whose scale starts too high: the scaler finds Inf gradients and skips the update
    itself until the scale has backed off. A run stuck there does not train, and before, nothing
    but goodput said so: no span attribute, no total, no report line."""
    import json

    from torchtrace import semconv
    from torchtrace.reporting import terminal_report

    _, _, scales, _ = _plain(False, False, init_scale=2.0 ** 24)
    overflowed = [later < now for now, later in zip(scales, scales[1:])]
    result = tt.configure(service_name="scaler", prometheus_port="off", run_dir=str(tmp_path / "runs"),
                          strict=True, register_atexit=False)
    model, opt, scaler, x = _setup(False, 2.0 ** 24)
    for _ in range(STEPS):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            step.record_loss(_body(model, opt, scaler, x, clip=False))
    totals = dict(get_runtime().history.totals)
    tt.shutdown()
    run_dir = tmp_path / "runs" / result.run_id
    spans = [json.loads(line) for line in (run_dir / "spans.jsonl").read_text().splitlines()]
    flagged = [s["attributes"].get(semconv.STEP_SCALER_OVERFLOW, False) for s in spans]
    assert flagged[:-1] == overflowed and sum(flagged) >= 2
    assert totals["scaler_overflow_steps"] == sum(flagged)
    if not report_json:
        (run_dir / "report.json").unlink()  # the report read from the spans alone
    shown = ", ".join(str(i) for i, f in enumerate(flagged) if f)
    assert f"  skipped by the loss scaler: {sum(flagged)} (step {shown})\n" in terminal_report(run_dir)


def _gauge(samples: dict, name: str) -> float | None:
    """The one series of ``name`` in a scrape, or None when there is none yet."""
    found = [v for key, v in samples.items() if key != "exemplars" and key[0] == name]
    assert len(found) <= 1
    return found[0] if found else None


@CLIPS
def test_a_scale_overflow_leaves_the_gradient_gauges_at_the_last_real_step(tmp_path, clip):
    """A scale that backs off from 2**24: the scaler finds Inf in its scaled gradients and skips
    those updates itself, which is no anomaly (see above). Before, with ``unscale_`` and a clip,
    such a step set ``torchtrace_grad_nonfinite_tensors`` to 4 and ``torchtrace_grad_norm`` to
    NaN, so the alert TrainingNonFiniteGradients fired on routine overflows; without the clip
    the norm gauge kept the step before's value. Now, in both orders, after every step the
    norm gauge is the float64 norm of the unscaled gradients of the last step whose gradients
    were finite (a plain run without torchtrace), and no tensor is counted non-finite."""
    from tests.helpers import scrape

    _, norms, scales, _ = _plain(False, clip, init_scale=2.0 ** 24)
    overflowed = [not math.isfinite(norm) for norm in norms]
    assert any(overflowed) and not all(overflowed)  # the case: some steps overflow, later ones update
    result = tt.configure(service_name="scaler", prometheus_port=0, run_dir=str(tmp_path / "runs"), strict=True,
                          register_atexit=False)
    try:
        model, opt, scaler, x = _setup(False, 2.0 ** 24)
        gauges = []
        for _ in range(STEPS):
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                step.record_loss(_body(model, opt, scaler, x, clip))
            samples = scrape(result.metrics_url)
            gauges.append((_gauge(samples, "torchtrace_grad_norm"),
                           _gauge(samples, "torchtrace_grad_nonfinite_tensors")))
    finally:
        tt.shutdown()
    last_real = [next((n for n in reversed(norms[:i + 1]) if math.isfinite(n)), None) for i in range(STEPS)]
    assert [norm for norm, _ in gauges] == pytest.approx(last_real, rel=1e-5)
    assert [count for _, count in gauges] == [None if n is None else 0 for n in last_real]


def test_a_clip_of_the_scaled_gradients_returns_torchs_scaled_total(tt_runtime):
    """The clip reuses the norms the step measured: those of the scaled gradients, as torch's
    own clip computes them (bit for bit), while the record's norm is that of the unscaled ones."""
    model, opt, scaler, x = _setup(False, 1024.0)
    for _ in range(3):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).pow(2).mean()
            scaler.scale(loss).backward()
            grads = [p.grad.detach().clone() for p in model.parameters()]
            expected = math.sqrt(sum(float(v) ** 2 for g in grads for v in g.double().flatten())) / 1024.0
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            assert torch.equal(total, torch.nn.utils.get_total_norm(grads))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            step.record_loss(loss)
        assert step.record.grad_norm == pytest.approx(expected, rel=1e-5)
        assert step.record.anomaly_kinds == []
