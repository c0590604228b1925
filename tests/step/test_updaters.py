"""Optimizers and loss scalers a step reaches without naming them to torchtrace (a global, a
closure, the second optimizer of two): a forensic replay applies none of their updates a
second time, a scaler's overflow is not an anomaly, and training ends where it ends without
torchtrace. Each case runs the same loop bare and instrumented and compares the results."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import torchtrace as tt
from torchtrace import semconv
from torchtrace.api import get_runtime


def _configure(tmp_path):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)


def _run(tmp_path, instrument: bool, build, steps: int, with_context: bool = False):
    """``build()`` -> (model, step function, state to compare); ``steps`` batches, the second
    of which carries a NaN into the loss (an input NaN or a NaN term)."""
    if instrument:
        _configure(tmp_path)
    try:
        model, step, state = build()
        if instrument and not with_context:
            step = tt.debug_operation(name="train_step", model=model)(step)  # model only: the rest unnamed
        for i in range(steps):
            if instrument and with_context:
                with tt.debug_context("train_step", model=model, replay=lambda i=i: step(i)) as scope:
                    scope.record_loss(step(i))
            else:
                step(i)
        records = None
        if instrument:
            rt = get_runtime()
            rt.finish_deferred(block=True)
            records = [r for r in rt.history.steps()]
            records.append(rt)
        return state(), records
    finally:
        if instrument:
            tt.shutdown()


def _adam_with_a_nan_term():
    """A global Adam (not given to torchtrace) and a loss whose second step has a NaN term that
    does not depend on the parameters: the loss is non-finite (the step is replayed) while the
    gradients are finite, so an update applied twice would show in the parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def step(i):
        opt.zero_grad()
        fit = torch.nn.functional.mse_loss(model(x), y)
        fit.backward()
        opt.step()
        return fit + (torch.tensor(float("nan")) if i == 1 else 0.0)

    def state():
        return [p.detach().clone() for p in model.parameters()] + [opt.state[next(model.parameters())]["step"]]
    return model, step, state


def _gan_with_a_nan_term():
    """Two optimizers; torchtrace is given neither. The discriminator's is stepped second."""
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    g_opt = torch.optim.SGD(gen.parameters(), lr=0.1, momentum=0.9)
    d_opt = torch.optim.SGD(disc.parameters(), lr=0.1, momentum=0.9)
    z = torch.randn(6, 4)

    def step(i):
        g_opt.zero_grad()
        d_opt.zero_grad()
        loss = disc(gen(z)).pow(2).mean()
        loss.backward()
        g_opt.step()
        d_opt.step()
        return loss + (torch.tensor(float("nan")) if i == 1 else 0.0)

    def state():
        return [p.detach().clone() for p in (*gen.parameters(), *disc.parameters())]
    return gen, step, state


def _scheduled_with_a_nan_term():
    """A per-step learning-rate schedule stepped inside the step (warm-up, then cosine, as
    transformer training does): a replay that stepped it again would leave every later step's
    learning rate one step ahead."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 3))
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    schedule = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[3])
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    rates = []

    def step(i):
        opt.zero_grad()
        fit = torch.nn.functional.mse_loss(model(x), y)
        fit.backward()
        opt.step()
        schedule.step()
        rates.append(opt.param_groups[0]["lr"])
        return fit + (torch.tensor(float("nan")) if i == 1 else 0.0)

    def state():
        return [p.detach().clone() for p in model.parameters()] + [torch.tensor(opt.param_groups[0]["lr"]),
                                                                   torch.tensor(schedule.last_epoch)]
    return model, step, state


def _averaged_with_a_nan_term():
    """An EMA copy of the weights updated inside the step (torch's AveragedModel)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def step(i):
        opt.zero_grad()
        fit = torch.nn.functional.mse_loss(model(x), y)
        fit.backward()
        opt.step()
        ema.update_parameters(model)
        return fit + (torch.tensor(float("nan")) if i == 1 else 0.0)

    def state():
        return [p.detach().clone() for p in (*model.parameters(), *ema.parameters())] + [ema.n_averaged.clone()]
    return model, step, state


@pytest.mark.parametrize("build", [_adam_with_a_nan_term, _gan_with_a_nan_term, _scheduled_with_a_nan_term,
                                   _averaged_with_a_nan_term])
@pytest.mark.parametrize("with_context", [False, True])
def test_a_replay_applies_no_update_twice(tmp_path, build, with_context):
    bare, _ = _run(tmp_path, False, build, 4)
    traced, records = _run(tmp_path, True, build, 4, with_context)
    rt = records.pop()
    assert semconv.NONFINITE_LOSS in records[1]["anomalies"]
    replays = [e for e in rt.history.events() if e.event_type == "forensics"]
    assert len(replays) == 1 and replays[0].data["step"] == 1  # the step was replayed
    for a, b in zip(bare, traced):
        assert torch.equal(a, b), "the replay applied an update a second time"


def _schedule_and_average(tmp_path, guard: str | None, with_context: bool):
    """Four steps of a model, its optimizer, a per-step learning-rate schedule and an EMA copy of
    the weights, the last two stepped after the update (as most training loops do); the second
    batch holds a NaN, so its gradients are non-finite. ``guard``: torchtrace's, or None for the
    plain loop, which drops that step's update itself as ``skip`` does. Returns the parameters,
    the EMA's, its count, the learning rate and the schedule's position."""
    if guard is not None:
        tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True, guard=guard)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    batches = [torch.randn(8, 4) for _ in range(4)]
    batches[1][0, 0] = float("nan")

    def step(x, drop_update=False):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        if drop_update:
            opt.zero_grad(set_to_none=True)
        opt.step()
        schedule.step()
        ema.update_parameters(model)
        return loss

    try:
        for i, x in enumerate(batches):
            if guard is None:
                step(x, drop_update=i == 1)
            elif with_context:
                with tt.debug_context("train_step", model=model, optimizer=opt, replay=lambda x=x: step(x)) as scope:
                    scope.record_loss(step(x))
            else:
                tt.debug_operation(name="train_step", model=model, optimizer=opt)(step)(x)
        if guard is not None:
            assert len(get_runtime().forensics.reports) == 1  # the step was replayed
    finally:
        if guard is not None:
            tt.shutdown()
    return ([p.detach().clone() for p in (*model.parameters(), *ema.parameters())]
            + [ema.n_averaged.clone(), torch.tensor(opt.param_groups[0]["lr"]), torch.tensor(schedule.last_epoch)])


@pytest.mark.parametrize("with_context", [False, True])
def test_a_replay_in_the_update_steps_no_schedule_and_averages_nothing_that_comes_after_it(tmp_path, with_context):
    """Non-finite gradients are replayed in the optimizer's hook, before the schedule and the EMA
    of the same step have run: the replay ran the whole step again, and they stepped twice
    (the learning rate half of the plain loop's from then on, ``n_averaged`` one ahead)."""
    reference = _schedule_and_average(tmp_path, None, with_context)
    traced = _schedule_and_average(tmp_path, "skip", with_context)
    for a, b in zip(reference, traced):
        assert torch.equal(a, b), "the replay stepped the schedule or the average a second time"


def _scaled(init_scale: float, nan_at: int | None):
    """The PyTorch AMP recipe with the scaler in a closure: scale, backward, step, update."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        x, y = torch.randn(8, 4) * 100, torch.randn(8, 1) * 100
        scales = []

        def step(i):
            opt.zero_grad()
            xi = x.clone()
            if i == nan_at:
                xi[0, 0] = float("nan")
            loss = torch.nn.functional.mse_loss(model(xi), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            return loss

        def state():
            return scales, [p.detach().clone() for p in model.parameters()]
        return model, step, state
    return build


@pytest.mark.parametrize("with_context", [False, True])
def test_an_unnamed_scalers_overflow_is_not_an_anomaly_and_its_scale_is_left_alone(tmp_path, with_context):
    """Scaled gradients overflow for the first steps (the scale starts at 2**127 and backs off):
    the scale goes down exactly as without torchtrace, no step is a nonfinite_grad anomaly, and
    each overflow is a skipped update in goodput."""
    build = _scaled(2.0 ** 127, None)
    (bare_scales, bare_params), _ = _run(tmp_path, False, build, 6)
    (scales, params), records = _run(tmp_path, True, build, 6, with_context)
    rt = records.pop()
    overflowed = sum(1 for a, b in zip(bare_scales, bare_scales[1:]) if b < a) + (bare_scales[0] < 2.0 ** 127)
    assert overflowed >= 2
    assert scales == bare_scales
    assert all(torch.equal(a, b) for a, b in zip(bare_params, params))
    assert not any(semconv.NONFINITE_GRAD in r["anomalies"] for r in records), [r["anomalies"] for r in records]
    assert rt.throughput.ledger.closed().badput["skipped_step"] > 0


def test_an_unnamed_scaler_backs_off_once_for_a_nan_batch(tmp_path):
    build = _scaled(1024.0, 1)
    (bare_scales, bare_params), _ = _run(tmp_path, False, build, 3)
    (scales, params), records = _run(tmp_path, True, build, 3)
    records.pop()
    assert records[1]["anomalies"] and math.isnan(records[1]["loss"])
    # The replay ran the step again, so the closure's list has one more entry; the scaler's
    # scale is what matters: backed off once.
    assert bare_scales == [1024.0, 512.0, 512.0] and scales[-1] == 512.0
    assert all(torch.equal(a, b) for a, b in zip(bare_params, params))


def _gan_step(gen, disc, nan_in: str, updates: int = 2):
    """A GAN step given both optimizers as arguments: the discriminator's update, then the
    generator's; ``nan_in``: whose gradients turn NaN ("disc", "gen" or ""); ``updates``: how
    many of the two updates are applied (the plain loop's reference of a skip)."""

    def gan_step(real, z, opt_g, opt_d):
        opt_d.zero_grad()
        d_loss = disc(real).mean() - disc(gen(z).detach()).mean()
        (d_loss * float("nan") if nan_in == "disc" else d_loss).backward()
        if updates >= 1:
            opt_d.step()
        opt_g.zero_grad()
        loss = -disc(gen(z)).mean()
        (loss * float("nan") if nan_in == "gen" else loss).backward()
        if updates >= 2:
            opt_g.step()
        return loss

    return gan_step


@pytest.mark.parametrize("guard", ["skip", "warn"])
@pytest.mark.parametrize("nan_in", ["disc", "gen"])
def test_a_second_optimizer_in_the_step_is_guarded_as_its_own(tmp_path, caplog, guard, nan_in):
    """A GAN step given both optimizers as arguments watches the first (the discriminator's).
    Before, under guard='skip' a NaN in the generator's gradients was applied (its parameters
    all NaN from then on) while the step read "skipped", and only a warning said that update was
    not guarded; a NaN in the discriminator's skipped its update but let the generator's, made
    from it, through. Now the second optimizer's gradients are guarded as it begins its update
    (a norm pass and a host read of their own), and a skip drops the step's later updates,
    whichever optimizer makes them: the parameters are the plain loop's that leaves out the bad
    step's updates from the first non-finite one on, bit for bit. Under 'warn' every update is applied, as without torchtrace."""
    def run(traced: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        gen, disc = torch.nn.Linear(4, 6), torch.nn.Linear(6, 1)
        opt_g = torch.optim.Adam(gen.parameters(), lr=0.1)
        opt_d = torch.optim.Adam(disc.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(1)
        for i in range(4):
            real, z = torch.randn(8, 6, generator=data), torch.randn(8, 4, generator=data)
            bad = nan_in if i == 2 else ""
            if traced:
                tt.debug_operation(name="gan_step")(_gan_step(gen, disc, bad))(real, z, opt_g, opt_d)
            elif not bad or guard == "warn":
                _gan_step(gen, disc, bad)(real, z, opt_g, opt_d)
            else:  # a skip: the updates from the first non-finite one on are left out
                _gan_step(gen, disc, bad, updates=0 if bad == "disc" else 1)(real, z, opt_g, opt_d)
            if traced:
                assert get_runtime().history.last_record.skipped is (bool(bad) and guard == "skip")
        return [p.detach().clone() for p in (*gen.parameters(), *disc.parameters())]

    plain = run(traced=False)
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True, guard=guard)
    try:
        caplog.set_level(logging.WARNING, logger="torchtrace")
        traced = run(traced=True)
        assert all(torch.equal(a, b) for a, b in zip(plain, traced)) or \
            (guard == "warn" and all(a.isnan().all() == b.isnan().all() for a, b in zip(plain, traced)))
        if guard == "skip":
            assert all(torch.isfinite(p).all() for p in traced)
        assert not [r.getMessage() for r in caplog.records if "does not cover" in r.getMessage()]
        assert get_runtime().errors.total == 0
    finally:
        tt.shutdown()
