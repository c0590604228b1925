"""Real-code suite, frameworks: a GPT-2 model built from its config (no download) trained by the
Hugging Face Trainer and by Lightning, with torchtrace's callbacks. The four planted faults
(tests/realcode/models.py) under ``warn`` and ``skip``: the callbacks replay the batch
(the Trainer's model on its inputs, Lightning's ``training_step`` on its batch), the report
names the cause and the module, and ``skip`` leaves the weights as they were."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import require_module
from tests.realcode import models

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = require_module("transformers")
require_module("accelerate")
pl = require_module("lightning.pytorch")

import torchtrace as tt  # noqa: E402
from torchtrace.api import get_runtime  # noqa: E402
from torchtrace.integrations.lightning import TorchtraceCallback as LightningCallback  # noqa: E402
from torchtrace.integrations.transformers import TorchtraceCallback as TrainerCallback  # noqa: E402

BAD_STEP = 3
STEPS = 5
GUARDS = ("warn", "skip")


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=models.VOCAB, n_positions=8, n_embd=models.D_MODEL, n_layer=2,
                                     n_head=models.N_HEAD, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     tie_word_embeddings=False)
    return transformers.GPT2LMHeadModel(config)


class Data(torch.utils.data.Dataset):
    """Float embeddings (``inputs_embeds``) and token labels: the way a NaN reaches the input."""

    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.embeds = torch.randn(n, models.SEQ, models.D_MODEL, generator=g)
        self.labels = torch.randint(0, models.VOCAB, (n, models.SEQ), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"inputs_embeds": self.embeds[i], "labels": self.labels[i]}


class Planter:
    """Plants the fault for the bad step, snapshots the weights around it, and takes a
    transient fault back out after a skipped step. ``gpt``: the GPT2LMHeadModel."""

    def __init__(self, fault: str, gpt: torch.nn.Module, optimizer_of) -> None:
        self.fault, self.gpt, self.optimizer_of = fault, gpt, optimizer_of
        self.saved = None
        self.armed = False
        self.unchanged = None
        self.before = None
        gpt.register_forward_pre_hook(self._input, with_kwargs=True)

    def _input(self, module, args, kwargs):
        if self.armed and self.fault == "nan_input" and "inputs_embeds" in kwargs:
            embeds = kwargs["inputs_embeds"].clone()
            embeds[0, 1, 2] = float("nan")
            return args, {**kwargs, "inputs_embeds": embeds}
        return None

    def begin(self, step: int) -> None:
        if step == BAD_STEP:
            self.armed = True
            if self.fault == "inf_weight":
                self.saved = self.gpt.transformer.h[0].mlp.c_fc.weight.detach().clone()
                models.plant_inf_weight(self.gpt.transformer.h[0].mlp.c_fc)
            elif self.fault == "attention_overflow":
                self.saved = models.plant_attention_overflow(self.gpt.transformer.h[0].attn.c_attn)
            elif self.fault == "huge_lr":
                self.optimizer_of().param_groups[0]["lr"] = models.HUGE_LR
        if step == self.bad_step():
            self.before = [p.detach().clone() for p in self.gpt.parameters()]

    def end(self, step: int) -> None:
        if step == self.bad_step():
            self.unchanged = all(torch.equal(a, b) for a, b in zip(self.before, self.gpt.parameters()))
        if step == BAD_STEP:
            self.armed = False
            if self.fault == "huge_lr":
                self.optimizer_of().param_groups[0]["lr"] = 0.1
            record = get_runtime().history.last_record
            if self.saved is not None and record is not None and record.skipped:
                target = (self.gpt.transformer.h[0].mlp.c_fc.weight if self.fault == "inf_weight"
                          else self.gpt.transformer.h[0].attn.c_attn.weight)
                models.put_back(target, self.saved)

    def bad_step(self) -> int:
        return BAD_STEP + 1 if self.fault == "huge_lr" else BAD_STEP


def _configure(tmp_path, guard):
    tt.configure(service_name="realcode", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                 register_atexit=False, guard=guard, throughput=False)


def _outcome(planter: Planter) -> dict:
    rt = get_runtime()
    result = {"reports": list(rt.forensics.reports), "totals": rt.history.totals.copy(),
              "unchanged": planter.unchanged, "section": rt.forensics.section()}
    tt.shutdown()
    return result


def _check(result, guard, fault, expected):
    cause, module = expected[fault]
    step = BAD_STEP + 1 if fault == "huge_lr" else BAD_STEP
    assert result["reports"], result["totals"]
    report = result["reports"][0]
    assert (report["cause"], report["module"], report["step"]) == (cause, module, step), report
    assert "replay_error" not in report
    if fault == "huge_lr":
        assert report["largest_params"][0]["name"] == report["extreme_params"][0]["name"]
        assert report["extreme_params"][0]["name"].endswith("lm_head.weight")
        assert report["found_in"]["cause"] == "forward"
    else:
        assert "found_in" not in report
    if guard == "skip":
        assert result["unchanged"] is True  # the bad step's update was not applied
    assert result["section"]["replays"] == 1


# ---------------------------------------------------------------- Hugging Face Trainer
class _TrainerPlant(transformers.TrainerCallback):
    def __init__(self, planter: Planter) -> None:
        self.planter = planter

    def on_step_begin(self, args, state, control, **kwargs):
        self.planter.begin(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.planter.end(state.global_step - 1)  # (the Trainer counts the step before this event)


TRAINER_EXPECTED = {
    "inf_weight": ("parameter", "transformer.h.0.mlp.c_fc"),
    "attention_overflow": ("forward", "transformer.h.0.attn"),
    # the head blown up to ~1e36 (past float32's extreme magnitude); its logits overflow in the
    # loss GPT-2 computes itself (found_in)
    "huge_lr": ("parameter", "lm_head"),
    "nan_input": ("input", ""),
}


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("fault", models.FAULTS)
def test_hugging_face_trainer(tmp_path, guard, fault):
    _configure(tmp_path, guard)
    model = gpt2()
    opt = torch.optim.SGD(models.gpt_param_groups(model, "lm_head"), lr=0.1)
    planter = Planter(fault, model, lambda: opt)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS,
                                          per_device_train_batch_size=2, report_to=[], use_cpu=True,
                                          save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                          max_grad_norm=1.0, lr_scheduler_type="constant", seed=0, data_seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None),
                                   callbacks=[TrainerCallback(), _TrainerPlant(planter)])
    trainer.train()
    _check(_outcome(planter), guard, fault, TRAINER_EXPECTED)


# ---------------------------------------------------------------- Lightning
class GPTModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = gpt2()

    def training_step(self, batch, batch_idx):
        loss = self.model(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"]).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(models.gpt_param_groups(self, "model.lm_head"), lr=0.1)


class _LightningPlant(pl.Callback):
    def __init__(self, planter: Planter) -> None:
        self.planter = planter

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.planter.begin(batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.planter.end(batch_idx)


LIGHTNING_EXPECTED = {
    "inf_weight": ("parameter", "model.transformer.h.0.mlp.c_fc"),
    "attention_overflow": ("forward", "model.transformer.h.0.attn"),
    "huge_lr": ("parameter", "model.lm_head"),
    "nan_input": ("input", "model"),
}


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("fault", models.FAULTS)
def test_lightning(tmp_path, guard, fault):
    _configure(tmp_path, guard)
    module = GPTModule()
    planter = Planter(fault, module.model, lambda: trainer.optimizers[0])
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[LightningCallback(), _LightningPlant(planter)], default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(Data(), batch_size=2))
    _check(_outcome(planter), guard, fault, LIGHTNING_EXPECTED)


class NanValidation(GPTModule):
    def validation_step(self, batch, batch_idx):
        loss = self.model(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"]).loss * float("nan")
        self.log("val_loss", loss)
        return loss


def test_lightning_validation_nans_are_not_guard_failures(tmp_path):
    """A validation batch makes no update: its NaN is recorded, not counted as a step the skip
    guard could not act on, and no incident is counted as replayed without a replay."""
    _configure(tmp_path, "skip")
    module = NanValidation()
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         val_check_interval=2, limit_val_batches=3, callbacks=[LightningCallback()],
                         default_root_dir=str(tmp_path))
    data = torch.utils.data.DataLoader(Data(), batch_size=2)
    trainer.fit(module, data, data)
    rt = get_runtime()
    report = rt.report() if hasattr(rt, "report") else None
    assert rt.history.totals["nonfinite_steps"] >= 3  # the validation batches' NaN losses are recorded
    assert dict(rt.guard_unable) == {}, report
    section = rt.forensics.section()
    assert section["steps_in_replayed_incidents"] == 0 and section["replays"] == 0
    tt.shutdown()


class _HalfOverflowAtBadStep(transformers.TrainerCallback):
    """On the bad step, ``transformer.h.0.mlp`` overflows when it runs in reduced precision
    (its output through a float16 kernel, as a half-precision overflow on a GPU): under the
    Trainer's bfloat16 autocast only, so a replay outside the autocast finds nothing."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        self.mlp = mlp
        self.handle = None

    @staticmethod
    def _overflow(module, inputs, output):
        return output.to(torch.float16) * 1e9 if output.dtype == torch.bfloat16 else output

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == BAD_STEP:
            self.handle = self.mlp.register_forward_hook(self._overflow)

    def on_step_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class _OwnAutocastTrainer(transformers.Trainer):
    """A Trainer whose loss runs under its own bfloat16 autocast (as transformers 4's CPU AMP
    did), not under accelerate's wrapper of the model's forward (which a replay calling the
    model goes through anyway)."""

    def autocast_smart_context_manager(self, cache_enabled=True):
        return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("trainer_class", [transformers.Trainer, _OwnAutocastTrainer])
def test_hugging_face_trainer_replays_under_its_autocast(tmp_path, trainer_class):
    _configure(tmp_path, "warn")
    model = gpt2()
    bf16 = trainer_class is transformers.Trainer  # accelerate's autocast, or the Trainer's own
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS, bf16=bf16,
                                          per_device_train_batch_size=2, report_to=[], use_cpu=True,
                                          save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                          lr_scheduler_type="constant", seed=0, data_seed=0)
    trainer = trainer_class(model=model, args=args, train_dataset=Data(),
                            callbacks=[TrainerCallback(), _HalfOverflowAtBadStep(model.transformer.h[0].mlp)])
    trainer.train()
    (report,) = get_runtime().forensics.reports
    tt.shutdown()
    assert (report["cause"], report["module"], report["step"]) == ("forward", "transformer.h.0.mlp", BAD_STEP), report
    assert report["output_dtype"] == "float16" and report["overflow"] is True
