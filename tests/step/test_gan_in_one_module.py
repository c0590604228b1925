"""A step that names one module holding a GAN's two networks, and no optimizer, in the order of
PyTorch's DCGAN example: the discriminator's gradients zeroed, its backward, its update; then
the generator's gradients zeroed, its backward, its update.

The step takes the first optimizer to update (the discriminator's) as its own and measures the
whole module's gradients there. The generator's gradients at that moment are the last step's,
and its own update comes after a backward of its own. Before, that update was neither measured
nor guarded: a NaN born in the generator's backward was applied under ``guard="skip"``, its step
recorded no anomaly, and the next step's record mixed the stale gradients into its norm.

Now an update by another optimizer of the module, after a backward since the step's gradients
were measured, has its parameters' gradients measured again as it begins: the record holds each
parameter's gradient as the update that applies it saw it, and the guard decides on them. When
no backward ran between the updates (Muon and AdamW over one backward), nothing is read again.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import torchtrace as tt
from tests.helpers import norm64
from tests.step.test_clipping_bytes import GradientReads
from torchtrace.api import get_runtime
from torchtrace.errors import NonFiniteError

STEPS = 4
BAD = 2  # the step whose generator loss is NaN


def _gan():
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    gan = nn.ModuleDict({"G": generator, "D": discriminator})
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    return gan, opt_d, opt_g


def _discriminator_backward(gan, real, noise, loss_fn):
    """The discriminator's half of a DCGAN step up to its update: its gradients zeroed, then
    the backward of its loss on real and on generated samples; returns (its loss, the fakes)."""
    generator, discriminator = gan["G"], gan["D"]
    discriminator.zero_grad()
    out = discriminator(real)
    loss_d = loss_fn(out, torch.ones_like(out))
    loss_d.backward()
    fake = generator(noise)
    out = discriminator(fake.detach())
    loss_fn(out, torch.zeros_like(out)).backward()
    return loss_d, fake


def _run(tmp_path, guard: str, bad: int | None = BAD, clip: float | None = None) -> list[dict]:
    """Train STEPS steps; each row: the record, the float64 norm of the gradients each update
    was given (before its network's clip, with ``clip``), the clips' total norms and torch's on
    copies of the same gradients, and the generator's parameters before and after the step."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True, guard=guard)
    try:
        gan, opt_d, opt_g = _gan()
        generator, discriminator = gan["G"], gan["D"]
        loss_fn = nn.BCEWithLogitsLoss()
        data = torch.Generator().manual_seed(1)
        rows = []
        for step in range(STEPS):
            real, noise = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
            row: dict = {"g_before": [p.detach().clone() for p in generator.parameters()], "raised": None,
                         "clips": [], "torch_clips": []}
            try:
                with tt.debug_context("gan_step", model=gan) as scope:
                    loss_d, fake = _discriminator_backward(gan, real, noise, loss_fn)
                    d_applied = [p.grad.detach().clone() for p in discriminator.parameters()]
                    if clip is not None:
                        _clip(row, discriminator, clip)
                    opt_d.step()
                    generator.zero_grad()
                    out = discriminator(fake)
                    loss_g = loss_fn(out, torch.ones_like(out))
                    if step == bad:
                        loss_g = loss_g * float("nan")
                    loss_g.backward()
                    g_applied = [p.grad.detach().clone() for p in generator.parameters()]
                    if clip is not None:
                        _clip(row, generator, clip)
                    opt_g.step()
                    scope.record_loss(loss_d)
            except NonFiniteError as exc:
                row["raised"] = exc
            row["record"] = scope.record
            row["applied"] = norm64(d_applied + g_applied)
            row["g_after"] = [p.detach().clone() for p in generator.parameters()]
            rows.append(row)
        return rows
    finally:
        tt.shutdown()


def _clip(row: dict, network: nn.Module, max_norm: float) -> None:
    """The network's clip, and torch's own on copies of the same gradients."""
    copies = [nn.Parameter(p.detach().clone()) for p in network.parameters()]
    for copy, p in zip(copies, network.parameters()):
        copy.grad = p.grad.detach().clone()
    row["torch_clips"].append(torch.nn.utils.clip_grad_norm_(copies, max_norm))
    row["clips"].append(torch.nn.utils.clip_grad_norm_(network.parameters(), max_norm))
    row.setdefault("clipped", []).append(all(torch.equal(c.grad, p.grad) for c, p in zip(copies, network.parameters())))


def _unchanged(row) -> bool:
    return all(torch.equal(a, b) for a, b in zip(row["g_before"], row["g_after"]))


def test_each_update_is_measured_as_it_begins(tmp_path):
    rows = _run(tmp_path, "warn", bad=None)
    for row in rows:
        assert row["record"].grad_norm == pytest.approx(row["applied"], rel=1e-6)
        assert not row["record"].anomalies


def test_each_network_clipped_is_measured_before_its_clip(tmp_path):
    """Each network clipped before its own update: the record holds the norms before the
    clips, and each clip is torch's, bit for bit."""
    rows = _run(tmp_path, "warn", bad=None, clip=0.05)
    for row in rows:
        assert row["record"].grad_norm == pytest.approx(row["applied"], rel=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(row["clips"], row["torch_clips"]))
        assert all(row["clipped"])
        assert not row["record"].anomalies


def test_a_module_without_a_forward_is_told_of_as_a_container(tmp_path, caplog):
    """The phases cannot be split where the step's model is never called: said once, without
    the advice to call it."""
    caplog.set_level(logging.WARNING, logger="torchtrace")
    _run(tmp_path, "warn", bad=None)
    phases = [r.getMessage() for r in caplog.records if "phases" in r.getMessage()]
    assert phases == ["torchtrace: the model of a step (ModuleDict) has no forward of its own: the step calls the "
                      "modules it holds, so its phases hold the optimizer only"]


def test_a_nan_born_in_the_second_networks_backward_is_recorded_at_its_step(tmp_path):
    rows = _run(tmp_path, "warn")
    bad = rows[BAD]["record"]
    assert "nonfinite_grad" in [a.kind for a in bad.anomalies]
    assert set(bad.grad_nonfinite_params) == {"G.0.weight", "G.0.bias", "G.2.weight", "G.2.bias"}
    assert all(not r["record"].anomalies for r in rows[:BAD])


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clipped"])
def test_skip_drops_the_second_networks_nan_update(tmp_path, clip):
    rows = _run(tmp_path, "skip", clip=clip)
    assert rows[BAD]["record"].skipped
    assert _unchanged(rows[BAD])  # the generator kept its weights
    for row in rows[BAD + 1:]:  # and trains on, finite, with nothing left to skip
        assert not row["record"].skipped and not row["record"].anomalies
        assert all(bool(torch.isfinite(p).all()) for p in row["g_after"])
        assert row["record"].grad_norm == pytest.approx(row["applied"], rel=1e-6)


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clipped"])
def test_raise_stops_before_the_second_networks_update(tmp_path, clip):
    rows = _run(tmp_path, "raise", clip=clip)
    assert isinstance(rows[BAD]["raised"], NonFiniteError)
    assert _unchanged(rows[BAD])
    assert all(row["raised"] is None for row in rows[:BAD])


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clipped"])
def test_two_optimizers_over_one_backward_read_the_gradients_once(tt_runtime, clip):
    """Muon and AdamW's shape: one backward, (a clip of the whole model,) then each optimizer's
    update of its share of the model. The module's gradients were measured at the first update
    (or the clip, which reuses the norms); the second update reads none."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() != 2]
    first, second = torch.optim.SGD(matrices, lr=0.01), torch.optim.AdamW(vectors, lr=0.01)
    x = torch.randn(4, 8)
    for _ in range(3):
        first.zero_grad(set_to_none=True)
        second.zero_grad(set_to_none=True)
        with tt.debug_context("train_step", model=model) as scope:
            model(x).pow(2).mean().backward()
            grads = [p.grad for p in model.parameters()]
            expected = norm64(grads)
            counter = GradientReads(grads)
            with counter:
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                first.step()
                second.step()
    total = sum(g.numel() * g.element_size() for g in grads)
    assert counter.read == total  # each gradient byte once: the first update's measuring
    assert scope.record.grad_norm == pytest.approx(expected, rel=1e-6)


def test_under_warn_the_replay_sees_the_second_network_before_its_update(tmp_path):
    """A decorated step replays by itself. Under ``warn`` on the CPU the NaN measured at the
    second network's update is replayed there, before that update: the report finds it born in
    the generator's loss, not in the parameters the NaN update would have left."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True, guard="warn")
    try:
        gan, opt_d, opt_g = _gan()
        generator, discriminator = gan["G"], gan["D"]
        loss_fn = nn.BCEWithLogitsLoss()

        @tt.debug_operation(model=gan)
        def gan_step(real, noise, bad):
            loss_d, fake = _discriminator_backward(gan, real, noise, loss_fn)
            opt_d.step()
            generator.zero_grad()
            out = discriminator(fake)
            loss_g = loss_fn(out, torch.ones_like(out))
            (loss_g * float("nan") if bad else loss_g).backward()
            opt_g.step()
            return loss_d

        data = torch.Generator().manual_seed(1)
        for step in range(STEPS):
            gan_step(torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data), step == BAD)
        reports = list(get_runtime().forensics.reports)
        assert [r["step"] for r in reports] == [BAD]
        assert reports[0]["params_updated"] is False
        assert (reports[0]["cause"], reports[0]["module"]) == ("backward", "<loss>")
    finally:
        tt.shutdown()


def test_under_a_loss_scaler_each_network_is_measured_unscaled(tmp_path):
    """Mixed precision: one GradScaler for both networks. The scaler unscales each optimizer's
    gradients as that optimizer steps, so no moment has them all unscaled: each network is
    measured as its own update begins. Before, the step measured at its end, where the
    discriminator's gradients held the generator loss's scaled part (never applied): a norm
    about 40,000 times too large, a false ``grad_explosion`` on every step."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    try:
        gan, opt_d, opt_g = _gan()
        generator, discriminator = gan["G"], gan["D"]
        loss_fn = nn.BCEWithLogitsLoss()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        data = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            real, noise = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
            with tt.debug_context("gan_step", model=gan) as scope:
                discriminator.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = discriminator(real)
                    loss_d = loss_fn(out.float(), torch.ones(16, 1))
                    fake = generator(noise)
                    out = discriminator(fake.detach())
                    loss_d = loss_d + loss_fn(out.float(), torch.zeros(16, 1))
                scaler.scale(loss_d).backward()
                d_applied = [p.grad / scaler.get_scale() for p in discriminator.parameters()]
                scaler.step(opt_d)
                generator.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = discriminator(fake)
                    loss_g = loss_fn(out.float(), torch.ones(16, 1))
                scaler.scale(loss_g).backward()
                g_applied = [p.grad / scaler.get_scale() for p in generator.parameters()]
                scaler.step(opt_g)
                scaler.update()
                scope.record_loss(loss_d)
            assert scope.record.grad_norm == pytest.approx(norm64(d_applied + g_applied), rel=1e-6)
            assert not scope.record.anomalies
    finally:
        tt.shutdown()
