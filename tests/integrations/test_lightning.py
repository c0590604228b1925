"""Lightning callback: spans per batch, grad norm in on_before_optimizer_step, guard skip/raise, validation."""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import require_module

pl = require_module("lightning.pytorch")

import torchtrace as tt  # noqa: E402
from tests.helpers import read_spans, scrape, value  # noqa: E402
from torchtrace import semconv  # noqa: E402
from torchtrace.api import get_runtime  # noqa: E402
from torchtrace.integrations.lightning import TorchtraceCallback  # noqa: E402


class Module(pl.LightningModule):
    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.nan_at = nan_at
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if batch_idx == self.nan_at:
            loss = loss * float("nan")
        self.losses.append(float(loss.detach().double()))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Spy(pl.Callback):
    """Runs before torchtrace's callback: float64 reference norms and parameter snapshots."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.before: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []
        self.validation: list[float] = []  # wall time of each validation loop (the sanity check's left out)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append([p.detach().clone() for p in pl_module.parameters()])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # (None: a skip decided at a manual-optimization module's clip_gradients cleared them)
        self.norms.append(math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in pl_module.parameters()
                                        if p.grad is not None)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append([p.detach().clone() for p in pl_module.parameters()])

    def on_validation_start(self, trainer, pl_module):
        self._validating = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validation.append(time.perf_counter() - self._validating)


def loaders():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=4), torch.utils.data.DataLoader(ds, batch_size=8)


def fit(module, callbacks, steps=5, val=True):
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         limit_val_batches=2 if val else 0, val_check_interval=steps if val else None,
                         num_sanity_val_steps=2 if val else 0)
    train, valid = loaders()
    trainer.fit(module, train, valid if val else None)
    return trainer


def configure(tmp_path, **kw):
    return tt.configure(service_name="test", prometheus_port=0, run_dir=str(tmp_path / "runs"), strict=True,
                        register_atexit=False, **kw)


def test_spans_loss_grad_norm_and_validation(tmp_path):
    result = configure(tmp_path)
    spy = Spy()
    module = Module()
    trainer = fit(module, [spy, TorchtraceCallback()])
    spans = read_spans(result.spans_path)
    train = [s for s in spans if s["name"] == "train_step"]
    val = [s for s in spans if s["name"] == "validation_step"]
    assert len(train) == 5 and len(val) == 2  # the sanity check's 2 batches are not traced
    assert [s["attributes"][semconv.STEP] for s in train] == [0, 1, 2, 3, 4]
    for span, ref_norm, ref_loss in zip(train, spy.norms, module.losses):
        assert span["attributes"][semconv.GRAD_NORM] == pytest.approx(ref_norm, rel=1e-6)
        assert span["attributes"][semconv.LOSS] == pytest.approx(ref_loss, rel=1e-6)
        assert span["status"] == "UNSET"
    assert all(semconv.GRAD_NORM not in s["attributes"] and semconv.LOSS in s["attributes"] for s in val)
    samples = scrape(result.metrics_url)
    assert value(samples, "torchtrace_steps_total", operation="train_step") == 5
    assert value(samples, "torchtrace_steps_total", operation="validation_step") == 2
    assert value(samples, "torchtrace_grad_norm", operation="train_step") == pytest.approx(spy.norms[-1], rel=1e-6)
    # Lightning's own logged metrics are exactly what the module logged: nothing added.
    assert set(trainer.logged_metrics) == {"train_loss", "val_loss"}
    # Validation is evaluation in goodput: the whole loop (its batches' steps, and its loading
    # and bookkeeping around them, inside its own span) is badput, not productive time.
    rt = tt.api.get_runtime()
    records = [r for r in rt.history.steps()]
    val_seconds = sum(r["duration_s"] for r in records if r["operation"] == "validation_step")
    loops = [r for r in records if r["operation"] == "validation_step_loop"]
    train_seconds = sum(r["duration_s"] for r in records if r["operation"] == "train_step")
    good = rt.throughput.ledger.closed()
    assert len(loops) == 1 and loops[0]["duration_s"] > val_seconds > 0
    assert good.badput["evaluation"] == pytest.approx(loops[0]["duration_s"], rel=1e-6, abs=1e-9)
    assert loops[0]["duration_s"] == pytest.approx(spy.validation[0], abs=0.005)  # (Lightning's own loop, timed)
    assert good.productive_s == pytest.approx(train_seconds, rel=1e-6, abs=1e-9)
    loop_span = next(s for s in spans if s["name"] == "validation_step_loop")
    assert all(s["parent_span_id"] == loop_span["span_id"] for s in val)


def test_weights_equal_uninstrumented_run(tmp_path):
    configure(tmp_path)
    plain, traced = Module(), Module()
    fit(plain, [], val=False)
    fit(traced, [TorchtraceCallback()], val=False)
    for a, b in zip(plain.parameters(), traced.parameters()):
        assert torch.equal(a, b)


def test_nan_detected_and_update_skipped(tmp_path, caplog):
    result = configure(tmp_path, guard="skip")
    caplog.set_level(logging.WARNING, logger="torchtrace")
    spy = Spy()
    module = Module(nan_at=2)
    fit(module, [spy, TorchtraceCallback()], val=False)
    # The callback measures before the optimizer steps, so the guard can act: no warning says otherwise.
    assert not [r for r in caplog.records if "cannot skip" in r.getMessage()]
    spans = read_spans(result.spans_path)
    assert [s["status"] for s in spans] == ["UNSET", "UNSET", "ERROR", "UNSET", "UNSET"]
    bad = spans[2]["attributes"]
    assert bad[semconv.STEP_SKIPPED] is True
    assert {"nonfinite_loss", "nonfinite_grad"} <= set(bad[semconv.ANOMALY_KINDS])
    for i, (before, after) in enumerate(zip(spy.before, spy.after)):
        same = all(torch.equal(a, b) for a, b in zip(before, after))
        assert same == (i == 2), i
    assert all(torch.isfinite(p).all() for p in module.parameters())
    samples = scrape(result.metrics_url)
    assert value(samples, "torchtrace_skipped_steps_total", operation="train_step") == 1
    assert value(samples, "torchtrace_anomalies_total", operation="train_step", kind="nonfinite_grad") == 1


class ManualModule(pl.LightningModule):
    """Manual optimization, as Lightning's docs show it: the module clips with
    ``self.clip_gradients`` before its ``optimizer.step()``. ``gan``: a second optimizer, for a
    discriminator trained after the generator in the same batch (its own loss and backward).
    ``norms``: the generator's gradient norm before the clip, float64, per batch (a forensic
    replay of ``training_step`` is not counted)."""

    def __init__(self, gan: bool = False, nan_at: int | None = None, clip: str = "module") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        # "module" / "module-value": self.clip_gradients by norm / by value; "torch-norm" /
        # "torch-value": torch's clip_grad_norm_ / clip_grad_value_ called directly, as plain
        # PyTorch code does.
        self.clip = clip
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.critic = torch.nn.Linear(1, 1)
        self.gan, self.nan_at = gan, nan_at
        self.norms: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        opts = self.optimizers()
        opt = opts[0] if self.gan else opts
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if batch_idx == self.nan_at:
            loss = loss * float("nan")
        opt.zero_grad()
        self.manual_backward(loss)
        self.norms.setdefault(batch_idx, math.sqrt(sum(float((p.grad.double() ** 2).sum())
                                                       for p in self.net.parameters())))
        if self.clip == "torch-norm":
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), 0.5)
        elif self.clip == "torch-value":
            torch.nn.utils.clip_grad_value_(self.net.parameters(), 0.05)
        else:
            self.clip_gradients(opt, gradient_clip_val=0.5,
                                gradient_clip_algorithm="value" if self.clip == "module-value" else "norm")
        opt.step()
        if self.gan:
            critic_opt = opts[1]
            critic_opt.zero_grad()
            self.manual_backward(self.critic(self.net(x).detach()).pow(2).mean())
            critic_opt.step()
        return loss

    def configure_optimizers(self):
        generator = torch.optim.Adam(self.net.parameters(), lr=0.01)
        if self.gan:
            return [generator, torch.optim.Adam(self.critic.parameters(), lr=0.01)]
        return generator


@pytest.mark.parametrize("clip", ["module", "torch-norm", "torch-value"])
@pytest.mark.parametrize("gan", [False, True], ids=["one-optimizer", "gan"])
def test_manual_optimization_is_measured_before_the_modules_own_clip(tmp_path, gan, clip):
    """The norm is the gradients' own, not the clipped one: before, it was 0.5 (the clip value)
    on every batch, so no explosion could be seen. With a GAN's two optimizers it is the
    generator's update's alone, though the critic's stale gradients are there. The same when
    ``training_step`` calls torch's ``clip_grad_norm_`` (or ``clip_grad_value_``) itself on the
    generator's parameters (plain PyTorch code moved into a module): before, that recorded the
    clipped norm on every batch too."""
    result = configure(tmp_path)
    module = ManualModule(gan=gan, clip=clip)
    fit(module, [TorchtraceCallback()], steps=8 if gan else 4, val=False)  # (a GAN's batch steps twice)
    spans = [s for s in read_spans(result.spans_path) if s["name"] == "train_step"]
    assert len(spans) == 4 and len(module.norms) == 4
    for i, span in enumerate(spans):
        assert span["attributes"][semconv.GRAD_NORM] == pytest.approx(module.norms[i], rel=1e-6)
    assert max(module.norms.values()) > 0.5  # the clip changed the gradients
    assert "clip_gradients" not in vars(module)  # teardown put the module's own method back


def test_a_fit_after_one_that_raised_measures_before_the_clip_again(tmp_path):
    """A fit that raises ends without the callbacks' ``teardown``: the module keeps the measuring
    ``clip_gradients``, bound to that fit's callback. The next fit, with a callback of its own,
    measures before the clip again. Before, it recorded the clip value (0.5) on every batch."""
    class RaisesOnce(ManualModule):
        def training_step(self, batch, batch_idx):
            if self.boom and batch_idx == 1:
                raise RuntimeError("planted")
            return super().training_step(batch, batch_idx)

    result = configure(tmp_path)
    module = RaisesOnce()
    module.boom = True
    with pytest.raises(RuntimeError, match="planted"):
        fit(module, [TorchtraceCallback()], steps=3, val=False)
    module.boom = False
    module.norms.clear()
    fit(module, [TorchtraceCallback()], steps=3, val=False)
    spans = [s for s in read_spans(result.spans_path) if s["name"] == "train_step"][-3:]
    assert [s["attributes"][semconv.GRAD_NORM] for s in spans] == \
        [pytest.approx(n, rel=1e-6) for n in module.norms.values()]
    assert "clip_gradients" not in vars(module)


def test_a_modules_own_clip_gradients_and_checkpoint_io_are_theirs_again_after_fit(tmp_path):
    """The module sets a ``clip_gradients`` of its own on the instance, the checkpoint IO a
    ``save_checkpoint`` of its own: after the fit each is the one it set, and still called.
    Before, teardown deleted them (the class's methods came back)."""
    result = configure(tmp_path)
    module = ManualModule()
    counted = {"clips": 0, "saves": 0}
    clip = module.clip_gradients

    def counting_clip(optimizer, *args, **kwargs):
        counted["clips"] += 1
        return clip(optimizer, *args, **kwargs)

    module.clip_gradients = counting_clip
    io = pl.plugins.TorchCheckpointIO()
    save = io.save_checkpoint

    def counting_save(*args, **kwargs):
        counted["saves"] += 1
        return save(*args, **kwargs)

    io.save_checkpoint = counting_save
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[TorchtraceCallback()], plugins=[io])
    trainer.fit(module, loaders()[0])
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert vars(module)["clip_gradients"] is counting_clip and vars(io)["save_checkpoint"] is counting_save
    assert counted == {"clips": 3, "saves": 1}
    spans = [s for s in read_spans(result.spans_path) if s["name"] == "train_step"]
    assert [s["attributes"][semconv.GRAD_NORM] for s in spans] == \
        [pytest.approx(n, rel=1e-6) for n in module.norms.values()]


@pytest.mark.parametrize("clip", ["module", "torch-norm"])
def test_manual_optimization_under_16_mixed_is_measured_unscaled(tmp_path, clip):
    """Under ``16-mixed`` the module's ``clip_gradients`` runs on gradients the loss scaler has
    not unscaled yet (Lightning unscales inside ``optimizer.step()``): measured there they
    read 1024 times too large (12,817 against 12.5 on the first batch). They are measured at
    ``on_before_optimizer_step`` instead, after the unscaling: the gradients the update uses."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    result = configure(tmp_path)
    spy = Spy()
    module = ManualModule(clip=clip)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", plugins=[plugin], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[spy, TorchtraceCallback()])
    trainer.fit(module, loaders()[0])
    spans = read_spans(result.spans_path)
    assert len(spans) == 3 and len(spy.norms) == 3
    for span, ref in zip(spans, spy.norms):
        assert span["attributes"][semconv.GRAD_NORM] == pytest.approx(ref, rel=1e-5)
    assert min(module.norms.values()) > 1000  # what the module's clip was given: still scaled


@pytest.mark.parametrize("clip", ["module", "module-value", "torch-norm", "torch-value"])
def test_manual_optimization_skips_a_nan_update_at_the_clip(tmp_path, clip):
    """The NaN batch's update is skipped, decided now at the module's clip (before the clip was
    wrapped it was decided at ``on_before_optimizer_step``, with the same outcome): the
    weights are unchanged by that batch alone and finite at the end. A clip by value
    (``self.clip_gradients(opt, v, "value")`` or torch's ``clip_grad_value_``) clips the zeroed
    gradients: before, the guard had set them to ``None`` and torch's ``clip_grad_value_``
    raised on the empty list, ending ``trainer.fit`` at the NaN batch."""
    configure(tmp_path, guard="skip")
    spy = Spy()
    module = ManualModule(nan_at=2, clip=clip)
    fit(module, [spy, TorchtraceCallback()], steps=4, val=False)
    for i, (before, after) in enumerate(zip(spy.before, spy.after)):
        assert all(torch.equal(a, b) for a, b in zip(before, after)) == (i == 2), i
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert tt.api.get_runtime().history.totals["skipped_steps"] == 1


class PlainlySkipped(Module):
    """The reference for a skipped update, in Lightning's own terms: on the ``skip_at`` batch
    (the ``nan_at`` one unless said) the closure runs (forward, backward) and
    ``optimizer.step`` does not."""

    def __init__(self, nan_at: int, skip_at: int | None = None) -> None:
        super().__init__(nan_at)
        self.skip_at = nan_at if skip_at is None else skip_at

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if batch_idx == self.skip_at:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)


class GradientsAfter(pl.Callback):
    """Listed after torchtrace's callback: whether each parameter still has a gradient tensor
    in ``on_before_optimizer_step``, which Lightning calls before it clips."""

    def __init__(self) -> None:
        self.tensors: list[bool] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.tensors.append(all(p.grad is not None for p in pl_module.parameters()))


@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_a_skipped_update_under_the_trainers_gradient_clipping(tmp_path, algorithm):
    """``guard="skip"`` with ``gradient_clip_algorithm="value"``: before, the NaN batch crashed
    ``trainer.fit`` (torch's ``clip_grad_value_`` refused the empty gradient list the guard had
    left by setting every gradient to ``None`` before Lightning clips). Now the gradients stay
    tensors, zeroed, until the torch optimizer's update begins: the fit trains its 5 batches,
    a callback after torchtrace's still finds every gradient, and the weights are bit-identical
    to a plain run that skips the NaN batch's update (Adam, so its state must be untouched too)."""
    def trainer(callbacks):
        return pl.Trainer(max_epochs=1, limit_train_batches=5, accelerator="cpu", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          gradient_clip_val=0.05, gradient_clip_algorithm=algorithm, callbacks=callbacks)

    configure(tmp_path, guard="skip")
    plain, traced = PlainlySkipped(nan_at=2), Module(nan_at=2)
    trainer([]).fit(plain, loaders()[0])
    after = GradientsAfter()
    trainer([TorchtraceCallback(), after]).fit(traced, loaders()[0])
    assert after.tensors == [True] * 5
    for a, b in zip(plain.parameters(), traced.parameters()):
        assert torch.equal(a, b)
    assert all(torch.isfinite(p).all() for p in traced.parameters())
    assert tt.api.get_runtime().history.totals["skipped_steps"] == 1


class Counts(pl.Callback):
    """What Lightning's loop did, as a callback hears it: batches trained, optimizer steps
    announced (``on_before_optimizer_step``) and backward passes (``on_before_backward``)."""

    def __init__(self) -> None:
        self.batches = self.optimizer_steps = self.backwards = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.optimizer_steps += 1

    def on_before_backward(self, trainer, pl_module, loss):
        self.backwards += 1


@pytest.mark.parametrize("clip", ["module", "torch-norm"])
def test_a_manual_optimization_replay_leaves_lightnings_loop_as_it_was(tmp_path, clip):
    """A GAN's NaN batch is replayed for forensics through ``training_step``, whose
    ``opt.step()`` calls go through Lightning's optimizer. Before, the replays (two passes)
    advanced ``global_step`` by 4 and ran every callback's ``on_before_optimizer_step`` and
    ``on_before_backward`` again: with ``max_steps=8`` the traced run trained 3 batches where
    the plain run trains 4. Now the replay's ``opt.step()`` runs its closure only and no
    callback hears the replay: 4 batches, ``global_step`` 8, 8 optimizer steps and 8
    backward passes announced, as in the plain run."""
    def run(callbacks):
        counts = Counts()
        trainer = fit(ManualModule(gan=True, nan_at=1, clip=clip), [counts, *callbacks], steps=8, val=False)
        return counts.batches, trainer.global_step, counts.optimizer_steps, counts.backwards

    configure(tmp_path)
    plain = run([])
    traced = run([TorchtraceCallback()])
    assert plain == (4, 8, 8, 8)
    assert traced == plain
    assert tt.api.get_runtime().history.totals["nonfinite_steps"] >= 1  # (the case: a replayed batch)


def test_guard_raise_ends_span_and_propagates(tmp_path):
    result = configure(tmp_path, guard="raise")
    with pytest.raises(tt.NonFiniteError):
        fit(Module(nan_at=1), [TorchtraceCallback()], val=False)
    spans = read_spans(result.spans_path)
    assert len(spans) == 2 and spans[1]["status"] == "ERROR"
    assert any(e["name"] == "exception" for e in spans[1]["events"])


def test_disabled_torchtrace_trains_normally(tmp_path):
    tt.configure(disabled=True)
    module = Module()
    fit(module, [TorchtraceCallback()], val=False)
    assert len(module.losses) == 5


def test_mixed_precision_grads_are_measured_unscaled(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    result = configure(tmp_path)
    spy = Spy()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", plugins=[plugin], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[spy, TorchtraceCallback()])
    trainer.fit(Module(), loaders()[0])
    spans = read_spans(result.spans_path)
    assert len(spans) == 3
    for span, ref in zip(spans, spy.norms):  # the spy sees what the optimizer uses: unscaled
        assert span["attributes"][semconv.GRAD_NORM] == pytest.approx(ref, rel=1e-5)
        assert ref < 1000  # the scaled gradients would be ~1024 times larger


@pytest.mark.parametrize("guard", ["skip", "raise"])
def test_a_16_mixed_scale_overflow_is_left_to_the_scaler(tmp_path, guard):
    """Lightning's 16-mixed unscales before ``on_before_optimizer_step``: a scale so large that
    the first steps overflow (Inf gradients the scaler skips, then backs off from) is no
    anomaly, and no guard skips or raises for it. (Before: ``raise`` ended ``trainer.fit`` at
    step 0, and ``skip`` counted each overflow as a ``nonfinite_grad`` with a forensic replay.)"""
    from lightning.pytorch.plugins.precision import MixedPrecision

    configure(tmp_path, guard=guard)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    trainer = pl.Trainer(max_steps=5, accelerator="cpu", plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[TorchtraceCallback()])
    trainer.fit(Module(), loaders()[0])
    assert scaler.get_scale() < 2.0 ** 24  # the case: overflows the scaler skipped
    rows = get_runtime().history.steps()
    assert len(rows) == 5
    assert [(row["anomalies"], row["skipped"]) for row in rows] == [([], False)] * 5


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_mfus_peak_is_taken_at_the_precision_the_step_computed_in(tmp_path, monkeypatch, precision):
    """Lightning's bf16-mixed autocast is open only inside its training step: the peak comes
    from the dtype the counted step's products ran in (bfloat16), not from the float32 weights
    the step's end sees. Before, MFU was taken against the float32 peak."""
    table = {torch.bfloat16: 4e9, torch.float32: 1e9}  # stands for a device's row of the peak table
    monkeypatch.setattr("torchtrace.measure.peaks.peak_flops", lambda device, dtype, override=None: table.get(dtype))
    configure(tmp_path)
    try:
        module = Module()
        dtypes = []
        module.net.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
        trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[TorchtraceCallback()],
                             limit_val_batches=0, num_sanity_val_steps=0, precision=precision)
        trainer.fit(module, loaders()[0])
        dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
        assert dtypes[0] == dtype  # Lightning's autocast ran
        rt = tt.api.get_runtime()
        assert rt.throughput.ledger.peak_of("train_step") == table[dtype]
        tp = rt.throughput.ledger.throughput("train_step")
        assert tp.mfu == pytest.approx(tp.flops_per_s / table[dtype], rel=1e-9)
    finally:
        tt.shutdown()


def test_gradient_accumulation_one_span_per_batch(tmp_path):
    result = configure(tmp_path)
    spy = Spy()
    module = Module()
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                         callbacks=[spy, TorchtraceCallback()])
    trainer.fit(module, loaders()[0])
    spans = read_spans(result.spans_path)
    assert len(spans) == 4 and len(spy.norms) == 2
    # gradients are measured on the batch that steps the optimizer; the loss is Lightning's (divided by 2)
    assert [semconv.GRAD_NORM in s["attributes"] for s in spans] == [False, True, False, True]
    assert [s["attributes"][semconv.GRAD_NORM] for s in spans[1::2]] == pytest.approx(spy.norms, rel=1e-6)
    assert [s["attributes"][semconv.LOSS] for s in spans] == pytest.approx([v / 2 for v in module.losses], rel=1e-6)


def test_a_nan_micro_batch_of_a_skipped_accumulation_is_no_update_that_went_through(tmp_path):
    """``accumulate_grad_batches=3``, ``guard="skip"``, a NaN loss on batch 3, the first of the
    second update's three: that update (at batch 5) is skipped, and the weights are
    bit-identical to a plain run whose ``optimizer_step`` skips it. Before, the run report's
    ``guard.not_applied`` still counted ``{"train_step": 1}`` for batch 3, whose step makes no
    update; now it counts none (2 non-finite steps, 1 skipped update)."""
    def trainer(callbacks):
        return pl.Trainer(max_epochs=1, limit_train_batches=9, accumulate_grad_batches=3, accelerator="cpu",
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, callbacks=callbacks)

    configure(tmp_path, guard="skip")
    plain, traced = PlainlySkipped(nan_at=3, skip_at=5), Module(nan_at=3)
    trainer([]).fit(plain, loaders()[0])
    trainer([TorchtraceCallback()]).fit(traced, loaders()[0])
    for a, b in zip(plain.parameters(), traced.parameters()):
        assert torch.equal(a, b)
    rt = tt.api.get_runtime()
    assert (rt.history.totals["nonfinite_steps"], rt.history.totals["skipped_steps"]) == (2, 1)
    assert rt.summary()["guard"]["not_applied"] == {}


def test_torchtrace_failure_is_counted_and_training_goes_on(tmp_path, monkeypatch):
    from torchtrace.api import get_runtime
    from torchtrace.measure import gradients

    tt.configure(service_name="test", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=False,
                 register_atexit=False)

    def broken(params):
        raise RuntimeError("measurement broke")

    monkeypatch.setattr(gradients, "gradient_norms", broken)
    plain, traced = Module(), Module()
    fit(plain, [], val=False)
    fit(traced, [TorchtraceCallback()], val=False)
    assert get_runtime().errors.by_component["gradients"] == 5
    for a, b in zip(plain.parameters(), traced.parameters()):
        assert torch.equal(a, b)


def test_samples_and_learning_rate_come_from_the_framework(tmp_path):
    """Each training batch's samples (4 rows; the last is short) and the optimizer's rate."""
    result = configure(tmp_path)
    fit(Module(), [TorchtraceCallback()], steps=10, val=False)
    train = [s for s in read_spans(result.spans_path) if s["name"] == "train_step"]
    assert [s["attributes"][semconv.SAMPLES] for s in train] == [4] * 10  # 40 rows in batches of 4
    assert all(s["attributes"][semconv.LR] == 0.01 for s in train)  # Module's Adam(lr=0.01)
    samples = scrape(result.metrics_url)
    assert value(samples, "torchtrace_samples_total", operation="train_step") == 40
    assert value(samples, "torchtrace_learning_rate", operation="train_step", group="0") == 0.01


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.04)
        return grad


class SlowModule(Module):
    """Planted phase times: 20 ms in the forward, 40 ms in the backward, 30 ms in the optimizer."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        x, y = batch
        return torch.nn.functional.mse_loss(_SlowBackward.apply(self.net(x)), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        opt.register_step_post_hook(lambda *a: time.sleep(0.03))
        return opt


def test_phases_come_from_lightnings_hooks(tmp_path):
    """The module joins the scope late, so the forward, backward and optimizer marks are
    Lightning's hooks; each phase holds its planted sleep and little else."""
    result = configure(tmp_path)
    fit(SlowModule(), [TorchtraceCallback()], steps=4, val=False)
    train = [s["attributes"] for s in read_spans(result.spans_path) if s["name"] == "train_step"]
    assert len(train) == 4
    for a in train[1:]:  # the first step also counted FLOPs
        # Upper bounds short of the next phase's sleep: a mark in the wrong place shows.
        assert 0.02 <= a[semconv.PHASE_FORWARD_S] < 0.02 + 0.035
        assert 0.04 <= a[semconv.PHASE_BACKWARD_S] < 0.04 + 0.025
        assert 0.03 <= a[semconv.PHASE_OPTIMIZER_S] < 0.03 + 0.035
    samples = scrape(result.metrics_url)
    assert value(samples, "torchtrace_step_phase_seconds_count", operation="train_step", phase="optimizer") == 4


class _SleepyModule(Module):
    def training_step(self, batch, batch_idx):
        time.sleep(0.01)  # a step long enough that both tools' boundaries differ by little
        return super().training_step(batch, batch_idx)


@pytest.mark.filterwarnings("ignore:When using the `ThroughputMonitor`")  # no FLOPs asked of it here
def test_lightnings_own_throughput_monitor_beside_torchtrace_agrees(tmp_path):
    """A peer's tool in the same process: Lightning's ThroughputMonitor (samples per second of
    wall time over its last 20 batches, timed at each batch's end) beside torchtrace's callback.
    Both run, the losses are those of a run without torchtrace, and torchtrace's samples per
    second over its window of 20 agree with the monitor's (strict configure: an internal error
    of torchtrace would raise here)."""
    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning.pytorch.loggers.logger import Logger

    class Keep(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[dict] = []

        name = property(lambda self: "keep")
        version = property(lambda self: 0)

        def log_hyperparams(self, *args, **kwargs) -> None:
            pass

        def log_metrics(self, metrics, step=None) -> None:
            self.rows.append(dict(metrics))

    def run(callbacks, logger):
        module = _SleepyModule()
        trainer = pl.Trainer(max_steps=40, accelerator="cpu", devices=1, logger=logger, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                             limit_val_batches=0, log_every_n_steps=1)
        trainer.fit(module, loaders()[0])
        return module.losses

    plain = run([], False)
    configure(tmp_path)
    keep = Keep()
    losses = run([TorchtraceCallback(), ThroughputMonitor(batch_size_fn=lambda b: b[0].size(0), window_size=20)],
                 keep)
    assert losses == plain
    peer = [r["train/device/samples_per_sec"] for r in keep.rows if "train/device/samples_per_sec" in r]
    assert peer, keep.rows[-3:]
    ours = get_runtime().throughput.ledger.throughput("train_step")
    assert ours.steps == 20
    assert ours.samples_per_s == pytest.approx(peer[-1], rel=0.05)


@pytest.mark.filterwarnings("ignore::UserWarning:lightning")  # (its advice on resuming mid-epoch: not the subject)
def test_a_run_resumed_from_its_checkpoint_goes_on_counting_steps(tmp_path):
    """Resumed with ``ckpt_path`` from the checkpoint of step 4 (mid-epoch: Lightning warns
    that a plain loader restarts its epoch), in a new run (a new process's), the training steps
    are numbered 4 to 7, Lightning's batches, not 0 to 3 again."""
    def ckpt():
        return pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="last", every_n_train_steps=4)

    def trainer(steps, callbacks):
        return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, callbacks=callbacks, limit_val_batches=0,
                          num_sanity_val_steps=0, default_root_dir=str(tmp_path))

    first = configure(tmp_path / "first")
    trainer(4, [TorchtraceCallback(), ckpt()]).fit(Module(), loaders()[0])
    tt.shutdown()
    resumed = configure(tmp_path / "resumed")
    trainer(8, [TorchtraceCallback()]).fit(Module(), loaders()[0], ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    tt.flush()
    steps = [[s["attributes"][semconv.STEP] for s in read_spans(r.spans_path) if s["name"] == "train_step"]
             for r in (first, resumed)]
    assert steps == [[0, 1, 2, 3], [4, 5, 6, 7]]



@pytest.mark.filterwarnings("ignore::UserWarning:lightning")  # (its advice on resuming mid-epoch: not the subject)
def test_a_restarted_runs_lost_steps_are_the_steps_it_repeats(tmp_path, monkeypatch):
    """Attempt 0 saves after Lightning's step 4 (batches 0 to 3) and ends after 7 batches;
    attempt 1 resumes from that checkpoint. The batches it repeats, from its first (Lightning's,
    4) to attempt 0's last (6), are attempt 0's lost steps: 3; the black box's checkpoint step
    is the last step finished before the save, 3 (as the Trainer integration's now is)."""
    from torchtrace.job.story import job_story

    def trainer(steps, callbacks):
        return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, callbacks=callbacks, limit_val_batches=0,
                          num_sanity_val_steps=0, default_root_dir=str(tmp_path))

    saving = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="{step}", every_n_train_steps=4,
                                          save_top_k=-1)
    first = configure(tmp_path, run_id="job")
    trainer(7, [TorchtraceCallback(), saving]).fit(Module(), loaders()[0])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step=4.ckpt"]
    root = get_runtime().run_root
    tt.shutdown()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # (the launcher's restart: attempt 1 in this process)
    resumed = configure(tmp_path, run_id="job")
    trainer(8, [TorchtraceCallback()]).fit(Module(), loaders()[0], ckpt_path=str(tmp_path / "ckpt" / "step=4.ckpt"))
    tt.shutdown()
    repeated = [s["attributes"][semconv.STEP] for s in read_spans(resumed.spans_path) if s["name"] == "train_step"]
    last = [s["attributes"][semconv.STEP] for s in read_spans(first.spans_path) if s["name"] == "train_step"][-1]
    attempts = job_story(root)["attempts"]
    assert [a["attempt"] for a in attempts] == [0, 1] and attempts[0]["last_step"] == last == 6
    assert repeated[0] == 4 and attempts[0]["checkpoint_step"] == 3
    assert attempts[0]["lost_steps"] == len([s for s in repeated if s <= last]) == 3

def test_checkpoint_io_is_timed_as_saves_and_loads(tmp_path):
    configure(tmp_path)
    rt = get_runtime()
    callback = TorchtraceCallback(validation_name=None)
    trainer = fit(Module(), [callback], steps=4, val=False)
    io = trainer.strategy.checkpoint_io
    assert "save_checkpoint" not in vars(io)  # teardown took the timing off
    # A save and a load through a new fit: save after training, then resume from the file.
    path = tmp_path / "last.ckpt"
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    train, _ = loaders()
    trainer.fit(Module(), train)
    t0 = time.perf_counter()
    callback.setup(trainer, None, "fit")  # (the hooks are on while a stage runs; here by hand)
    assert trainer.strategy.checkpoint_io.save_checkpoint.__torchtrace_kind__ == "save"  # serialising and writing
    trainer.save_checkpoint(path)
    took = time.perf_counter() - t0
    callback.teardown(trainer, None, "fit")
    resumed = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    resumed.fit(Module(), train, ckpt_path=str(path))
    labels = {"kind": "save"}
    assert rt.metrics.value("torchtrace_checkpoint_seconds_count", labels) == 1  # its torch.save inside: once
    assert 0 < rt.metrics.value("torchtrace_checkpoint_seconds_sum", labels) <= took
    assert rt.metrics.value("torchtrace_checkpoint_seconds_count", {"kind": "load"}) == 1
    assert rt.rank_state.fields["checkpoint_step"] is not None
    tt.shutdown()


class HeldWrites(pl.plugins.TorchCheckpointIO):
    """Checkpoint files written on cue: each write off the main thread (the asynchronous
    plugin's) waits for ``release`` (slow storage), then is written, or fails (``fail``)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.writing = threading.Event()
        self.release = threading.Event()

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if threading.current_thread() is not threading.main_thread():
            self.writing.set()
            assert self.release.wait(30)
        if self.fail:
            raise OSError("the volume is full")
        super().save_checkpoint(checkpoint, path, storage_options)


class HeldWhileTraining(pl.Callback):
    """After torchtrace's callback: the black box's checkpoint step at each batch's end while
    the first write is held; lets the write go two batches later."""

    def __init__(self, writes: HeldWrites) -> None:
        self.writes = writes
        self.held_seen: list[object] = []
        self.step_at_end: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.step_at_end.append(get_runtime().rank_state.fields["step"])
        if self.writes.writing.is_set() and not self.writes.release.is_set():
            self.held_seen.append(get_runtime().rank_state.fields.get("checkpoint_step"))
            if len(self.held_seen) == 2:
                self.writes.release.set()


def async_fit(tmp_path, callbacks, writes, steps=6):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[*callbacks, saving], limit_val_batches=0,
                         plugins=[AsyncCheckpointIO(writes)])
    trainer.fit(Module(), loaders()[0])
    return trainer


def test_an_asynchronous_checkpoint_io_counts_a_save_once_written_as_of_its_call(tmp_path):
    """Lightning's ``AsyncCheckpointIO`` hands the checkpoint to a thread that writes it while
    training goes on. The checkpoint holds the step of the call, and exists once written.

    Before: it counted as saved when handed over, so a restart while the write was held (or
    after it failed) would have been told it lost nothing."""
    configure(tmp_path)
    rt = get_runtime()
    writes = HeldWrites()
    held = HeldWhileTraining(writes)
    async_fit(tmp_path, [TorchtraceCallback(validation_name=None), held], writes)
    assert held.held_seen == [None, None]  # written nowhere yet: a restart would start from scratch
    # Saves after batches 1, 3 and 5 (every 2 steps); the last holds the last batch's step.
    assert rt.rank_state.fields["checkpoint_step"] == held.step_at_end[-1]
    assert rt.metrics.value("torchtrace_checkpoint_seconds_count", {"kind": "save"}) == 3
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]
    assert "save_checkpoint" not in vars(writes)  # teardown took the writer's wrapper off too
    tt.shutdown()


def test_an_asynchronous_checkpoint_io_whose_write_fails_is_no_checkpoint(tmp_path):
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    configure(tmp_path)
    rt = get_runtime()
    writes = HeldWrites(fail=True)
    held = HeldWhileTraining(writes)
    try:
        with pytest.raises(OSError, match="the volume is full"):  # Lightning raises it at the next save
            async_fit(tmp_path, [TorchtraceCallback(validation_name=None), held], writes)
        assert held.held_seen == [None, None]
        assert rt.rank_state.fields.get("checkpoint_step") is None
    finally:
        tt.shutdown()
        for sig, handler in handlers.items():  # a fit that raised leaves Lightning's handlers behind
            signal.signal(sig, handler)


class RawWrites(HeldWrites):
    """Writes without ``torch.save`` (as a safetensors plugin does): torchtrace does not see
    them on their own."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if threading.current_thread() is not threading.main_thread():
            self.writing.set()
            assert self.release.wait(30)
        Path(path).write_bytes(repr(sorted(checkpoint)).encode())


def test_a_direct_write_does_not_complete_a_save_handed_over(tmp_path):
    """A write called on the training thread (straight to the plugin the asynchronous one
    wraps) is not the write of a save waiting on the plugin's thread: each save handed over
    counts when its own write ends."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    configure(tmp_path)
    rt = get_runtime()
    writes = RawWrites()
    io = AsyncCheckpointIO(writes)
    callback = TorchtraceCallback(validation_name=None)
    trainer = SimpleNamespace(strategy=SimpleNamespace(checkpoint_io=io))
    callback.setup(trainer, Module(), "fit")
    for step in (0, 1):  # a save after each step: the first write held, the second queued behind it
        with tt.debug_context("train_step", step=step):
            pass
        io.save_checkpoint({"w": torch.ones(2)}, tmp_path / f"handed{step}.ckpt")
        assert writes.writing.wait(10)
    writes.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "direct.ckpt")
    assert (tmp_path / "direct.ckpt").exists()
    assert rt.rank_state.fields.get("checkpoint_step") is None  # neither save handed over is written yet
    writes.release.set()
    io.teardown()  # waits for the writes
    deadline = time.monotonic() + 10
    while rt.rank_state.fields.get("checkpoint_step") != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rt.rank_state.fields["checkpoint_step"] == 1
    assert (tmp_path / "handed0.ckpt").exists() and (tmp_path / "handed1.ckpt").exists()
    callback.teardown(trainer, Module(), "fit")
    assert "save_checkpoint" not in vars(io) and "save_checkpoint" not in vars(writes)
    tt.shutdown()
