"""Hugging Face Trainer callback: spans per optimizer step, loss via forward hook, guard skip/raise."""

from __future__ import annotations

import json
import logging
import math
import os
import time

import pytest
import torch

from tests.conftest import require_module

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = require_module("transformers")
require_module("accelerate")

import torchtrace as tt  # noqa: E402
from tests.helpers import read_spans, scrape, value  # noqa: E402
from torchtrace import semconv  # noqa: E402
from torchtrace.api import get_runtime  # noqa: E402
from torchtrace.integrations.transformers import TorchtraceCallback  # noqa: E402
from torchtrace.measure.flop_rules import RULES  # noqa: E402


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2)
    return transformers.BertForSequenceClassification(config)


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 40) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 50, (n, 8), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Spy(transformers.TrainerCallback):
    """Runs before torchtrace's callback: reference norms, losses and parameter snapshots."""

    def __init__(self, nan_at: int | None = None) -> None:
        self.norms: list[float] = []
        self.losses: list[float] = []
        self.before: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []
        self.nan_at = nan_at
        self.step = -1
        self.handle = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.handle = model.register_forward_hook(self._forward)

    def _forward(self, module, inputs, output):
        if self.step == self.nan_at:
            output.loss = output.loss * float("nan")
        self.losses.append(float(output.loss.detach().double()))
        return output

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.step += 1
        self.before.append([p.detach().clone() for p in model.parameters()])

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.norms.append(math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()
                                        if p.grad is not None)))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after.append([p.detach().clone() for p in model.parameters()])

    def on_train_end(self, args, state, control, **kwargs):
        self.handle.remove()


def train(tmp_path, callbacks, steps=5, model=None, eval_dataset=None, **args):
    model = model or tiny_bert()
    kw = dict(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4, report_to=[],
              use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, max_grad_norm=0.0,
              seed=0, data_seed=0)
    kw.update(args)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**kw), train_dataset=Data(),
                                   eval_dataset=eval_dataset, callbacks=callbacks)
    trainer.train()
    return model


def configure(tmp_path, **kw):
    return tt.configure(service_name="test", prometheus_port=0, run_dir=str(tmp_path / "runs"), strict=True,
                        register_atexit=False, **kw)


def test_spans_loss_and_grad_norm(tmp_path):
    result = configure(tmp_path)
    spy = Spy()
    train(tmp_path, [spy, TorchtraceCallback()])
    spans = read_spans(result.spans_path)
    assert [s["name"] for s in spans] == ["train_step"] * 5
    assert [s["attributes"][semconv.STEP] for s in spans] == [0, 1, 2, 3, 4]
    for span, ref_norm, ref_loss in zip(spans, spy.norms, spy.losses):
        assert span["attributes"][semconv.GRAD_NORM] == pytest.approx(ref_norm, rel=1e-6)
        assert span["attributes"][semconv.LOSS] == pytest.approx(ref_loss, rel=1e-6)
    samples = scrape(result.metrics_url)
    assert value(samples, "torchtrace_steps_total", operation="train_step") == 5
    assert value(samples, "torchtrace_loss", operation="train_step") == pytest.approx(spy.losses[-1], rel=1e-6)


def test_gradient_accumulation_averages_micro_batch_losses(tmp_path):
    result = configure(tmp_path)
    spy = Spy()
    train(tmp_path, [spy, TorchtraceCallback()], steps=2, gradient_accumulation_steps=2)
    spans = read_spans(result.spans_path)
    assert len(spans) == 2 and len(spy.losses) == 4
    for i, span in enumerate(spans):
        ref = (spy.losses[2 * i] + spy.losses[2 * i + 1]) / 2
        assert span["attributes"][semconv.LOSS] == pytest.approx(ref, rel=1e-6)


def test_weights_equal_uninstrumented_run(tmp_path):
    configure(tmp_path)
    plain = train(tmp_path, [])
    traced = train(tmp_path, [TorchtraceCallback()])
    for a, b in zip(plain.parameters(), traced.parameters()):
        assert torch.equal(a, b)


def test_nan_detected_and_update_skipped(tmp_path, caplog):
    result = configure(tmp_path, guard="skip")
    caplog.set_level(logging.WARNING, logger="torchtrace")
    spy = Spy(nan_at=2)
    model = train(tmp_path, [spy, TorchtraceCallback()])
    # The callback measures before the optimizer steps, so the guard can act: no warning says otherwise.
    assert not [r for r in caplog.records if "cannot skip" in r.getMessage()]
    spans = read_spans(result.spans_path)
    assert [s["status"] for s in spans] == ["UNSET", "UNSET", "ERROR", "UNSET", "UNSET"]
    bad = spans[2]["attributes"]
    assert bad[semconv.STEP_SKIPPED] is True
    assert {"nonfinite_loss", "nonfinite_grad"} <= set(bad[semconv.ANOMALY_KINDS])
    assert str(bad[semconv.LOSS]).lower() == "nan"
    for i, (before, after) in enumerate(zip(spy.before, spy.after)):
        same = all(torch.equal(a, b) for a, b in zip(before, after))
        assert same == (i == 2), i
    assert all(torch.isfinite(p).all() for p in model.parameters())
    samples = scrape(result.metrics_url)
    assert value(samples, "torchtrace_skipped_steps_total", operation="train_step") == 1


def test_guard_raise_ends_span_and_propagates(tmp_path):
    result = configure(tmp_path, guard="raise")
    with pytest.raises(tt.NonFiniteError):
        train(tmp_path, [Spy(nan_at=1), TorchtraceCallback()])
    spans = read_spans(result.spans_path)
    assert len(spans) == 2 and spans[1]["status"] == "ERROR"


def test_callback_clipping_measures_before_clipping(tmp_path):
    result = configure(tmp_path)
    spy = Spy()
    clipped = train(tmp_path, [spy, TorchtraceCallback(max_grad_norm=0.01)], steps=3)
    reference = train(tmp_path, [], steps=3, max_grad_norm=0.01)  # the Trainer's own clipping, same maths
    spans = read_spans(result.spans_path)
    assert [s["attributes"][semconv.GRAD_NORM] for s in spans] == pytest.approx(spy.norms, rel=1e-6)
    assert all(n > 0.01 for n in spy.norms)  # clipping was active on every step
    for a, b in zip(clipped.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_trainers_own_clipping_is_measured_before_clipping(tmp_path):
    # The Trainer clips with max_grad_norm before on_pre_optimizer_step; torchtrace measures at
    # the clip call, so the spans carry the pre-clip norms the Trainer itself computed.
    result = configure(tmp_path)
    seen = []

    class Recording(transformers.Trainer):
        def _clip_grad_norm(self, model):
            norm = super()._clip_grad_norm(model)
            seen.append(float(norm))
            return norm

    kw = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, report_to=[],
              use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, max_grad_norm=0.01,
              seed=0, data_seed=0)
    Recording(model=tiny_bert(), args=transformers.TrainingArguments(**kw), train_dataset=Data(),
              callbacks=[TorchtraceCallback()]).train()
    spans = read_spans(result.spans_path)
    assert len(seen) == 3 and all(n > 0.01 for n in seen)  # clipping was active on every step
    assert [s["attributes"][semconv.GRAD_NORM] for s in spans] == pytest.approx(seen, rel=1e-5)


def test_bad_max_grad_norm_is_rejected():
    with pytest.raises(ValueError, match="max_grad_norm"):
        TorchtraceCallback(max_grad_norm=-1)


def test_custom_compute_loss_records_its_loss(tmp_path):
    result = configure(tmp_path)
    seen: list[float] = []

    class Custom(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)  # no labels: the output carries no loss
            loss = torch.nn.functional.cross_entropy(outputs.logits, labels) * 3.0
            tt.current_step().record_loss(loss)
            tt.current_step().record_batch(flops=1234)  # the user's own FLOPs win over the estimate
            seen.append(float(loss.detach().double()))
            return (loss, outputs) if return_outputs else loss

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                                          report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, max_grad_norm=0.0)
    trainer = Custom(model=tiny_bert(), args=args, train_dataset=Data(), callbacks=[TorchtraceCallback()])
    trainer.train()
    # The Trainer calls compute_loss in evaluation too, where no step is open: the documented
    # call does nothing there (it raised AttributeError on None).
    metrics = trainer.evaluate(Data(8))
    assert math.isfinite(metrics["eval_loss"]) and len(seen) == 3 + 1  # one evaluation batch of 8
    seen = seen[:3]
    spans = read_spans(result.spans_path)
    assert [s["attributes"][semconv.LOSS] for s in spans] == pytest.approx(seen, rel=1e-6)
    assert [s["attributes"][semconv.FLOPS] for s in spans] == [1234] * 3
    assert [s["attributes"][semconv.SAMPLES] for s in spans] == [4] * 3  # the framework's, where the user gave none


def test_custom_compute_loss_under_gradient_accumulation_gives_the_whole_steps_values(tmp_path):
    """With ``gradient_accumulation_steps=2`` the Trainer calls ``compute_loss`` once per
    micro-batch, each recording its loss and its batch. The step gets the mean of its
    micro-batches' losses and the sum of their counts (computed here by hand). Before, each
    call replaced the last: the step's loss was its last micro-batch's and its samples and
    FLOPs half the step's (4 and 4000, not 8 and 8000)."""
    result = configure(tmp_path)
    seen: list[float] = []

    class Custom(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = torch.nn.functional.cross_entropy(outputs.logits, labels) * 3.0
            rows = inputs["input_ids"].shape[0]
            tt.current_step().record_loss(loss)
            tt.current_step().record_batch(samples=rows, flops=1000.0 * rows)
            seen.append(float(loss.detach().double()))
            return (loss, outputs) if return_outputs else loss

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                                          gradient_accumulation_steps=2, report_to=[], use_cpu=True,
                                          save_strategy="no", logging_strategy="no", disable_tqdm=True)
    Custom(model=tiny_bert(), args=args, train_dataset=Data(), callbacks=[TorchtraceCallback()]).train()
    spans = read_spans(result.spans_path)
    expected = [(seen[2 * i] + seen[2 * i + 1]) / 2 for i in range(3)]
    assert [s["attributes"][semconv.LOSS] for s in spans] == pytest.approx(expected, rel=1e-6)
    assert [s["attributes"][semconv.SAMPLES] for s in spans] == [8] * 3
    assert [s["attributes"][semconv.FLOPS] for s in spans] == [8000.0] * 3


class PaddedData(Data):
    """Sequences of 8 token ids with an attention mask: row i has 3 + i % 6 real tokens."""

    def __getitem__(self, i):
        mask = torch.zeros(8, dtype=torch.long)
        mask[: 3 + i % 6] = 1
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": self.labels[i]}


def test_samples_and_non_padding_tokens_over_accumulated_micro_batches(tmp_path):
    result = configure(tmp_path)
    steps, batch, accumulate = 3, 4, 2
    args = dict(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=batch, report_to=[],
                use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, max_grad_norm=0.0,
                seed=0, data_seed=0, gradient_accumulation_steps=accumulate, learning_rate=3e-4)
    seen: list[int] = []  # the rows the Trainer fed, from a spy on the model's inputs

    model = tiny_bert()
    model.register_forward_hook(lambda m, a, kw, out: seen.extend(kw["attention_mask"].sum(dim=1).tolist())
                                if m.training else None, with_kwargs=True)
    transformers.Trainer(model=model, args=transformers.TrainingArguments(**args), train_dataset=PaddedData(),
                         callbacks=[TorchtraceCallback()]).train()
    spans = read_spans(result.spans_path)
    assert len(spans) == steps and len(seen) == steps * batch * accumulate
    per_step = batch * accumulate
    for i, span in enumerate(spans):
        assert span["attributes"][semconv.SAMPLES] == per_step
        assert span["attributes"][semconv.TOKENS] == sum(seen[i * per_step:(i + 1) * per_step])  # a plain count
        assert span["attributes"][semconv.LR] == pytest.approx(3e-4 * (1 - i / steps), rel=1e-6)  # linear decay


def test_tokens_agree_with_the_trainers_own_non_padding_count(tmp_path):
    """The Trainer's own count, ``include_num_input_tokens_seen="non_padding"`` (the attention
    mask's sum over every micro-batch it fed), beside torchtrace's: the same total."""
    configure(tmp_path)
    args = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, report_to=[],
                use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, max_grad_norm=0.0,
                seed=0, data_seed=0, gradient_accumulation_steps=2, include_num_input_tokens_seen="non_padding")
    trainer = transformers.Trainer(model=tiny_bert(), args=transformers.TrainingArguments(**args),
                                   train_dataset=PaddedData(), callbacks=[TorchtraceCallback()])
    trainer.train()
    tt.flush()
    tokens = [r["tokens"] for r in get_runtime().history.steps()]
    assert len(tokens) == 3
    if trainer.state.num_input_tokens_seen == 3 * 2 * 4 * 8:  # every id: a Trainer without "non_padding"
        pytest.skip(f"transformers {transformers.__version__} counts padding tokens too")
    assert 0 < sum(tokens) == trainer.state.num_input_tokens_seen < 3 * 2 * 4 * 8  # less than with the padding


class SlowOptimizer(transformers.TrainerCallback):
    """Plants 30 ms in every optimizer step (a post-hook on the torch optimizer)."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.register_step_post_hook(lambda *a: time.sleep(0.03))


def test_phases_of_a_trainer_step(tmp_path):
    """Forward and backward from the model's own marks, the optimizer from the Trainer's
    optimizer hooks: its planted 30 ms land in the optimizer phase, not in backward."""
    result = configure(tmp_path)
    train(tmp_path, [SlowOptimizer(), TorchtraceCallback()], steps=4)
    spans = read_spans(result.spans_path)
    assert len(spans) == 4
    for span in spans:
        a = span["attributes"]
        assert a[semconv.PHASE_OPTIMIZER_S] >= 0.03  # the planted sleep is optimizer time
        assert 0 < a[semconv.PHASE_FORWARD_S] and 0 < a[semconv.PHASE_BACKWARD_S]
        phases = a[semconv.PHASE_FORWARD_S] + a[semconv.PHASE_BACKWARD_S] + a[semconv.PHASE_OPTIMIZER_S]
        assert phases <= (span["end_unix_ns"] - span["start_unix_ns"]) / 1e9


def test_phases_of_a_trainer_step_with_gradient_accumulation(tmp_path):
    """Two micro-batches a step, each with a planted 20 ms forward (a pre-hook on the model)
    and 40 ms backward (a backward hook on its classifier): forward is both calls' time, and
    the first micro-batch's backward is backward time, not forward.

    Reference: each call's time from the model's first pre-hook to its last forward hook,
    and the time from each call's end to the next call's start or to the optimizer step (a
    callback after torchtrace's). The model's own compute on this CPU took 2-20 ms a call
    (measured), so the planted sleeps only bound the phases from below."""
    times: dict[str, list[float]] = {"pre": [], "post": [], "optimizer": []}

    def pre(*_):
        times["pre"].append(time.perf_counter())
        time.sleep(0.02)

    class Optimizer(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, *args, **kwargs):
            times["optimizer"].append(time.perf_counter())

    result = configure(tmp_path)
    model = tiny_bert()
    model.register_forward_pre_hook(pre, prepend=True)
    model.register_forward_hook(lambda *_: times["post"].append(time.perf_counter()))
    model.classifier.register_full_backward_hook(lambda *a: time.sleep(0.04))
    train(tmp_path, [TorchtraceCallback(), Optimizer()], steps=3, model=model, gradient_accumulation_steps=2)
    spans = read_spans(result.spans_path)
    assert len(spans) == 3 and len(times["pre"]) == len(times["post"]) == 6
    for i, span in enumerate(spans[1:], start=1):  # the first step's time is its FLOP count's
        a = span["attributes"]
        (pre1, pre2), (post1, post2) = times["pre"][2 * i:2 * i + 2], times["post"][2 * i:2 * i + 2]
        forward = (post1 - pre1) + (post2 - pre2)
        backward = (pre2 - post1) + (times["optimizer"][i] - post2)
        assert 0.04 <= forward <= a[semconv.PHASE_FORWARD_S] < forward + 0.01, (a, forward)
        assert 0.08 <= a[semconv.PHASE_BACKWARD_S] < backward + 0.01 and a[semconv.PHASE_BACKWARD_S] > backward - 0.01, \
            (a, backward)


def _params_outside_embeddings(model) -> int:
    embeddings = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)}
    return sum(p.numel() for name, p in model.named_parameters() if name not in embeddings)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_flops_are_the_trainers_estimate_and_give_mfu(tmp_path, accumulation):
    """Each step's FLOPs: 6 x tokens x parameters outside the embeddings, over its
    micro-batches (the Trainer's own total_flos formula), against a plain count of the
    model's parameters; with a configured peak, the MFU gauge follows."""
    result = configure(tmp_path, peak_flops=1e9)
    model = tiny_bert()
    train(tmp_path, [TorchtraceCallback()], steps=4, model=model, gradient_accumulation_steps=accumulation)
    spans = read_spans(result.spans_path)
    expected = 6 * (4 * 8 * accumulation) * _params_outside_embeddings(model)
    assert [s["attributes"][semconv.FLOPS] for s in spans] == [expected] * 4
    samples = scrape(result.metrics_url)
    assert value(samples, "torchtrace_flops_total", operation="train_step") == 4 * expected
    assert value(samples, "torchtrace_mfu_ratio", operation="train_step") > 0


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_mfus_peak_is_taken_at_the_trainers_precision(tmp_path, monkeypatch, precision):
    """With ``bf16=True`` the Trainer runs its forward under a bfloat16 autocast that is closed
    again when the step ends, and its FLOPs are an estimate (no count sees the operands), so the
    callback says the precision: the peak is the bfloat16 one. Before, it was the float32 peak
    of the weights, and MFU read twice too high on an H100."""
    table = {torch.bfloat16: 4e9, torch.float32: 1e9}  # stands for a device's row of the peak table
    monkeypatch.setattr("torchtrace.measure.peaks.peak_flops", lambda device, dtype, override=None: table.get(dtype))
    configure(tmp_path)
    try:
        dtypes = []
        model = tiny_bert()
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        linear.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
        train(tmp_path, [TorchtraceCallback()], steps=3, model=model, bf16=precision == "bf16")
        assert dtypes[0] == (torch.bfloat16 if precision == "bf16" else torch.float32)  # the Trainer's autocast ran
        rt = tt.api.get_runtime()
        expected = table[torch.bfloat16 if precision == "bf16" else torch.float32]
        assert rt.throughput.ledger.peak_of("train_step") == expected
        tp = rt.throughput.ledger.throughput("train_step")
        assert tp.mfu == pytest.approx(tp.flops_per_s / expected, rel=1e-9)
    finally:
        tt.shutdown()


def test_a_vision_model_gets_counted_flops_not_the_token_estimate(tmp_path):
    """The Trainer's formula (6 x main input elements x parameters) takes every element of the
    main input for a token: for a ViT's pixel_values that was 214 times FlopCounterMode's count
    of the same step, and MFU with it. A floating-point main input gets no estimate: the
    FLOPs are those counted on the shapes of the model's call (the first step runs under the
    counter), within 10 % of FlopCounterMode's count of the same forward and backward; its
    samples count too."""
    from torch.utils.flop_counter import FlopCounterMode

    result = configure(tmp_path, peak_flops=1e9)
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, num_labels=3)
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg)

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"pixel_values": torch.randn(3, 32, 32, generator=g), "labels": torch.tensor(i % 3)}

    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0])
    with FlopCounterMode(display=False, custom_mapping=RULES) as counted:  # (with the CPU attention rule)
        model(pixel_values=x, labels=y).loss.backward()
    model.zero_grad(set_to_none=True)
    formula = 6 * x.numel() * model.num_parameters(exclude_embeddings=True)
    assert formula > 100 * counted.get_total_flops()  # what the estimate would have said
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                                          report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=Images(), callbacks=[TorchtraceCallback()]).train()
    spans = read_spans(result.spans_path)
    assert len(spans) == 3
    flops = [s["attributes"].get(semconv.FLOPS) for s in spans]
    assert all(f is not None and abs(f / counted.get_total_flops() - 1) < 0.10 for f in flops), flops
    assert [s["attributes"][semconv.SAMPLES] for s in spans] == [4, 4, 4]
    samples = scrape(result.metrics_url)
    assert value(samples, "torchtrace_mfu_ratio", operation="train_step") > 0  # the configured peak
    assert value(samples, "torchtrace_samples_total", operation="train_step") == 12


@pytest.mark.parametrize("eval_on_start", [False, True])
def test_evaluation_and_checkpoints_between_steps_are_their_own_badput(tmp_path, monkeypatch, eval_on_start):
    """The Trainer evaluates every 2 steps and saves every 3: that time is evaluation and
    checkpoint badput, not data wait. Reference: the time spent inside ``Trainer.evaluate``
    and ``Trainer._save_checkpoint``, timed by wrapping them (each slowed by a planted sleep
    so that it is clearly more than the loop's own work between steps). With
    ``eval_on_start``, the evaluation before the first step is evaluation too, not startup."""
    configure(tmp_path)
    spent = {"evaluate": 0.0, "save": 0.0}

    def timed(key, original, pause):
        def run(self, *args, **kwargs):
            t0 = time.perf_counter()
            time.sleep(pause)
            try:
                return original(self, *args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0
        return run

    monkeypatch.setattr(transformers.Trainer, "evaluate", timed("evaluate", transformers.Trainer.evaluate, 0.05))
    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint",
                        timed("save", transformers.Trainer._save_checkpoint, 0.03))
    try:
        train(tmp_path, [TorchtraceCallback()], steps=6, eval_strategy="steps", eval_steps=2,
              save_strategy="steps", save_steps=3, eval_dataset=Data(8), per_device_eval_batch_size=4,
              eval_on_start=eval_on_start)
        rt = tt.api.get_runtime()
        badput = rt.throughput.ledger.closed().badput
        # 3 evaluations (steps 2, 4, 6; one more at the start) and 2 saves (steps 3, 6). The
        # booking ends at the callback (inside the call, a little before it returns) and holds
        # the Trainer's own work before the call (logging): within a few ms of the calls' time.
        assert spent["evaluate"] >= (4 if eval_on_start else 3) * 0.05 and spent["save"] >= 2 * 0.03
        assert badput["evaluation"] == pytest.approx(spent["evaluate"], abs=0.03)
        assert badput["checkpoint"] == pytest.approx(spent["save"], abs=0.03)
        assert badput["data_wait"] < 0.05
    finally:
        tt.shutdown()


def test_a_compiled_trainer_model_keeps_its_telemetry(tmp_path):
    """``torch_compile=True``: the loss (from the forward hook, now inside compiled code), the
    gradient norm, samples and FLOPs are as without compilation; the forward runs inside the
    compiled code, so the steps have the optimizer phase only (documented)."""
    result = configure(tmp_path)
    spy = Spy()
    train(tmp_path, [spy, TorchtraceCallback()], steps=3, torch_compile=True, torch_compile_backend="eager")
    spans = read_spans(result.spans_path)
    assert [s["attributes"][semconv.LOSS] for s in spans] == pytest.approx(spy.losses, rel=1e-6)
    assert [s["attributes"][semconv.GRAD_NORM] for s in spans] == pytest.approx(spy.norms, rel=1e-5)
    assert [s["attributes"][semconv.SAMPLES] for s in spans] == [4] * 3
    assert all(semconv.FLOPS in s["attributes"] for s in spans)
    phases = [k for k in spans[-1]["attributes"] if k.startswith("torchtrace.phase.")]
    assert phases == ["torchtrace.phase.optimizer_s"]


class Packed(torch.utils.data.Dataset):
    """24 token sequences of lengths 3-17, for a padding-free collator."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(2)
        self.rows = [torch.randint(1, 64, (int(n),), generator=g).tolist()
                     for n in torch.randint(3, 18, (24,), generator=g)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def test_a_padding_free_trainer_counts_sequences_as_samples(tmp_path):
    """The Trainer with DataCollatorWithFlattening (each micro-batch one packed row), 4
    sequences a micro-batch, 2 micro-batches a step, one epoch of 24 sequences in 3 steps:
    each step's samples are its 8 sequences (before: 2, one per packed row), and the run's
    tokens are every sequence's length, against a plain count over the dataset."""
    from transformers import DataCollatorWithFlattening, GPT2Config, GPT2LMHeadModel

    result = configure(tmp_path)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=512,
                                       bos_token_id=0, eos_token_id=0))
    data = Packed()
    kw = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, report_to=[],
              use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
              gradient_accumulation_steps=2)
    transformers.Trainer(model=model, args=transformers.TrainingArguments(**kw), train_dataset=data,
                         data_collator=DataCollatorWithFlattening(), callbacks=[TorchtraceCallback()]).train()
    spans = read_spans(result.spans_path)
    assert [s["attributes"][semconv.SAMPLES] for s in spans] == [8, 8, 8]
    assert sum(s["attributes"][semconv.TOKENS] for s in spans) == sum(len(row) for row in data.rows)


def test_a_plain_loop_over_gpt2_padded_to_the_longest_gets_every_steps_flops(tmp_path):
    """A Hugging Face model in the user's own loop (no Trainer), each batch padded to its
    longest sequence: nearly every step a new shape. Every step's FLOPs equal FlopCounterMode's
    on that step, with far fewer counted steps than shapes (before: 32 counted, every later
    shape without FLOPs)."""
    import copy
    import random

    from torch.utils.flop_counter import FlopCounterMode
    from transformers import BatchEncoding, GPT2Config, GPT2LMHeadModel

    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=128,
                                       bos_token_id=0, eos_token_id=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def collate(lengths):
        ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            ids[i, :n] = torch.randint(1, 64, (n,))
            mask[i, :n] = 1
        return BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": ids.clone()})

    def step_of(m, o):
        def train_step(batch):
            o.zero_grad()
            out = m(**batch)
            out.loss.backward()
            o.step()
            return out.loss
        return train_step

    step = tt.debug_operation(name="train_step", model=model, optimizer=opt)(step_of(model, opt))
    rng = random.Random(0)
    batches = [collate([rng.randint(3, 120) for _ in range(4)]) for _ in range(70)]
    for batch in batches:
        step(batch)
    rt = tt.api.get_runtime()
    records = rt.history.steps()[-len(batches):]
    reference = {}
    for batch in batches:
        shape = tuple(batch["input_ids"].shape)
        if shape not in reference:
            twin = copy.deepcopy(model)
            with FlopCounterMode(display=False) as counter:
                step_of(twin, torch.optim.AdamW(twin.parameters(), lr=1e-3))(batch)
            reference[shape] = counter.get_total_flops()
    assert len(reference) > 32
    assert [r.get("flops") for r in records] == [reference[tuple(b["input_ids"].shape)] for b in batches]
    assert rt.throughput.flops.counts <= 5 + 2 + len(reference) // 8 + 1


class RaiseAt(transformers.TrainerCallback):
    """Raises from the model's forward at its ``at``-th call (an out-of-memory in a real run):
    the exception leaves the Trainer's loop between two callbacks, and no callback hears of it."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.register_forward_hook(self._forward)

    def _forward(self, module, inputs, output):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError(f"planted: out of memory at forward call {self.at}")


def test_a_trainer_that_raises_mid_step_leaves_no_open_step_behind(tmp_path):
    """A notebook's path: ``trainer.train()`` raises inside a step, the user catches it and goes
    on. Before, the Trainer's step stayed the thread's open step for good: ``current_step()``
    returned it, every later span was its child (one trace), and the step that raised was
    never recorded. Now it ends, with the error, as soon as torchtrace looks again, and a new
    Trainer and a plain step after it run as if nothing had happened."""
    result = configure(tmp_path)
    with pytest.raises(RuntimeError, match="planted"):
        train(tmp_path, [RaiseAt(3), TorchtraceCallback()], steps=5)
    assert not tt.current_step()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tt.debug_operation(name="manual", model=model, optimizer=opt)
    def step(x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    for _ in range(3):
        step(torch.randn(8, 4))
    train(tmp_path, [TorchtraceCallback()], steps=2)
    spans = read_spans(result.spans_path)
    assert [(s["name"], s["attributes"][semconv.STEP]) for s in spans] == \
        [("train_step", 0), ("train_step", 1), ("train_step", 2)] + [("manual", i) for i in range(3)] + \
        [("train_step", 0), ("train_step", 1)]  # (a new Trainer's steps are numbered as it numbers them)
    assert [s["status"] for s in spans] == ["UNSET", "UNSET", "ERROR"] + ["UNSET"] * 5
    assert [s["parent_span_id"] for s in spans] == [None] * 8  # none a child of the dead step
    assert not tt.current_step()


def test_shutdown_after_a_trainer_raised_records_the_step_it_raised_in(tmp_path):
    result = configure(tmp_path)
    spans_path = result.spans_path
    with pytest.raises(RuntimeError, match="planted"):
        train(tmp_path, [RaiseAt(2), TorchtraceCallback()], steps=5)
    tt.shutdown()
    spans = [json.loads(line) for line in spans_path.read_text().splitlines()]
    assert [(s["attributes"][semconv.STEP], s["status"]) for s in spans] == [(0, "UNSET"), (1, "ERROR")]
    assert [e["attributes"]["exception.type"] for e in spans[1]["events"]] == ["RuntimeError"]
    assert tt.current_step() is not None and not tt.current_step()


def test_a_users_own_step_inside_a_trainer_step_is_nested_not_ended(tmp_path):
    """The check for a dead Trainer step runs when a step opens inside another: a step of the
    user's own inside the Trainer's (here around the forward) must leave the Trainer's open."""
    result = configure(tmp_path)

    class Inner(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            model.register_forward_pre_hook(self.open)
            model.register_forward_hook(self.close)

        def open(self, module, inputs):
            tt.debug_context("inner").__enter__()

        def close(self, module, inputs, output):
            tt.current_step().__exit__(None, None, None)

    train(tmp_path, [Inner(), TorchtraceCallback()], steps=3)
    spans = read_spans(result.spans_path)
    outer = [s for s in spans if s["name"] == "train_step"]
    inner = [s for s in spans if s["name"] == "inner"]
    assert [s["status"] for s in outer] == ["UNSET"] * 3 and len(inner) == 3
    assert [s["parent_span_id"] for s in inner] == [s["span_id"] for s in outer]


class _LMData(torch.utils.data.Dataset):
    """16 token sequences of length 8 whose labels are their ids (a causal LM's batch)."""

    def __init__(self) -> None:
        self.ids = torch.randint(1, 64, (16, 8), generator=torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.mark.parametrize("accumulation", [1, 4])
def test_a_causal_lms_loss_under_accumulation_is_the_trainers(tmp_path, accumulation):
    """A causal LM is given ``num_items_in_batch``: each micro-batch's loss is divided by the
    whole step's tokens, so the step's loss is their sum, which the Trainer logs. The spans'
    losses equal the Trainer's logged ones and the sum of the model's outputs (before, under
    accumulation of 4: a quarter of them)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    result = configure(tmp_path)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    outputs = []
    handle = model.register_forward_hook(lambda m, a, out: outputs.append(float(out.loss.detach().double())))
    kw = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=1, report_to=[],
              use_cpu=True, save_strategy="no", logging_strategy="steps", logging_steps=1, disable_tqdm=True,
              seed=0, data_seed=0, gradient_accumulation_steps=accumulation)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**kw), train_dataset=_LMData(),
                                   callbacks=[TorchtraceCallback()])
    trainer.train()
    handle.remove()
    losses = [s["attributes"][semconv.LOSS] for s in read_spans(result.spans_path)]
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    sums = [sum(outputs[i * accumulation:(i + 1) * accumulation]) for i in range(3)]
    assert len(losses) == len(logged) == 3
    assert losses == pytest.approx(sums, rel=1e-6)
    assert losses == pytest.approx(logged, abs=1e-4)  # (the Trainer logs its loss rounded)


def test_a_resumed_trainer_goes_on_counting_steps(tmp_path):
    """Resumed from its checkpoint at step 2 in a new run (a new process's), the steps are
    numbered 2 and 3, as the Trainer's, not 0 and 1 again."""
    first = configure(tmp_path / "first")
    out = tmp_path / "out"
    kw = dict(output_dir=str(out), per_device_train_batch_size=4, report_to=[], use_cpu=True, logging_strategy="no",
              disable_tqdm=True, max_grad_norm=0.0, seed=0, data_seed=0, save_strategy="steps", save_steps=2)
    transformers.Trainer(model=tiny_bert(), args=transformers.TrainingArguments(max_steps=2, **kw),
                         train_dataset=Data(), callbacks=[TorchtraceCallback()]).train()
    tt.shutdown()
    assert [s["attributes"][semconv.STEP] for s in read_spans(first.spans_path)] == [0, 1]
    resumed = configure(tmp_path / "resumed")
    transformers.Trainer(model=tiny_bert(), args=transformers.TrainingArguments(max_steps=4, **kw),
                         train_dataset=Data(), callbacks=[TorchtraceCallback()]).train(
        resume_from_checkpoint=str(out / "checkpoint-2"))
    tt.flush()
    assert [s["attributes"][semconv.STEP] for s in read_spans(resumed.spans_path)] == [2, 3]


class _TwoPasses(transformers.Trainer):
    """R-Drop: the model runs twice on each micro-batch (dropout differs), the loss is both."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        first, second = model(**inputs), model(**inputs)
        loss = (first.loss + second.loss) / 2
        return (loss, first) if return_outputs else loss


def test_a_compute_loss_that_runs_the_model_twice_counts_its_batch_once(tmp_path):
    """Each step's samples, tokens and FLOP estimate are its micro-batches', counted once
    however many times the model ran on them (before: twice), against a plain count."""
    result = configure(tmp_path)
    kw = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, report_to=[],
              use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, max_grad_norm=0.0,
              seed=0, data_seed=0, gradient_accumulation_steps=2)
    model = tiny_bert()
    _TwoPasses(model=model, args=transformers.TrainingArguments(**kw), train_dataset=Data(),
               callbacks=[TorchtraceCallback()]).train()
    spans = read_spans(result.spans_path)
    params = model.num_parameters(exclude_embeddings=True)
    assert [s["attributes"][semconv.SAMPLES] for s in spans] == [8, 8, 8]  # 2 micro-batches of 4
    assert [s["attributes"][semconv.TOKENS] for s in spans] == [64, 64, 64]  # of 8 ids each, no mask
    assert [s["attributes"][semconv.FLOPS] for s in spans] == [6 * 64 * params] * 3


def test_a_saved_checkpoint_reaches_the_black_box(tmp_path):
    class Saves(transformers.TrainerCallback):
        steps: list[int] = []

        def on_save(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    configure(tmp_path)
    rt = get_runtime()
    train(tmp_path, [Saves(), TorchtraceCallback()], steps=5, save_strategy="steps", save_steps=2,
          save_only_model=True)
    # save_only_model: the model goes through safetensors, no torch.save; on_save still tells
    # the black box which step the last checkpoint holds: the last one finished, counted from 0
    # (the Trainer's count of steps less one).
    assert Saves.steps[:2] == [2, 4]
    assert rt.rank_state.fields["checkpoint_step"] == Saves.steps[-1] - 1
    assert rt.throughput.ledger.closed().badput["checkpoint"] > 0
    tt.shutdown()


class _StepLosses(transformers.Trainer):
    """Keeps what each ``training_step`` returns: the loss the Trainer backpropagated (divided by
    the accumulation steps where the Trainer divides) and adds to the loss it logs."""

    returned: list[float]

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.returned.append(float(loss.double()))
        return loss


def _shifted_cross_entropy(outputs, labels, num_items_in_batch=None):
    """A ``compute_loss_func``: the causal LM's next-token cross-entropy, a mean per micro-batch."""
    logits = outputs.logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _lm_trainer(tmp_path, how, accumulation, callbacks):
    """A tiny GPT-2 trained 3 steps by a Trainer that computes the loss outside the model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    kw = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2, report_to=[],
              use_cpu=True, save_strategy="no", logging_strategy="steps", logging_steps=1, disable_tqdm=True,
              seed=0, data_seed=0, gradient_accumulation_steps=accumulation,
              label_smoothing_factor=0.1 if how == "label_smoothing" else 0.0)
    trainer = _StepLosses(model=model, args=transformers.TrainingArguments(**kw), train_dataset=_LMData(),
                          callbacks=callbacks,
                          compute_loss_func=_shifted_cross_entropy if how == "compute_loss_func" else None)
    trainer.returned = []
    trainer.train()
    return trainer


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("how", ["label_smoothing", "compute_loss_func"])
def test_a_loss_the_trainer_computes_outside_the_model_is_the_steps_loss(tmp_path, how, accumulation):
    """With ``label_smoothing_factor=0.1`` or a ``compute_loss_func`` the Trainer takes the labels
    away from the model and computes the loss itself: the model's output has none. Before, the
    spans had no loss at all (``[None, None, None]`` while the Trainer logged ``[3.4146, 3.4326,
    3.4292]``). Now each step's loss is what the Trainer's ``training_step`` returned for its
    micro-batches, summed (what it logs), and the weights are those of the run without
    torchtrace, bit for bit."""
    result = configure(tmp_path)
    traced = _lm_trainer(tmp_path, how, accumulation, [TorchtraceCallback()])
    plain = _lm_trainer(tmp_path, how, accumulation, [])
    losses = [s["attributes"].get(semconv.LOSS) for s in read_spans(result.spans_path)]
    returned = traced.returned
    steps = [sum(returned[i * accumulation:(i + 1) * accumulation]) for i in range(3)]
    logged = [entry["loss"] for entry in traced.state.log_history if "loss" in entry]
    assert len(losses) == len(logged) == 3 and len(returned) == 3 * accumulation
    assert losses == pytest.approx(steps, rel=1e-6)
    assert losses == pytest.approx(logged, abs=1e-4)  # (the Trainer logs its loss rounded)
    for a, b in zip(plain.model.parameters(), traced.model.parameters()):
        assert torch.equal(a, b)
    # The Trainer's training_step is its own again once training ended.
    assert traced.training_step.__func__ is _StepLosses.training_step


class _TimedCheckpoints(transformers.Trainer):
    """Times the Trainer's own checkpoint methods, the reference: a save (model, optimizer,
    scheduler, random states, arguments, state) is one ``_save_checkpoint``; a resume is its
    four loads (model, optimizer and scheduler, scaler, random states)."""

    saves: list[float]
    loads: list[float]

    def _timed(self, into, method, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    def _save_checkpoint(self, model, trial):
        return self._timed(self.saves, super()._save_checkpoint, model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        return self._timed(self.loads, super()._load_from_checkpoint, resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        return self._timed(self.loads, super()._load_optimizer_and_scheduler, checkpoint)

    def _load_scaler(self, checkpoint):
        return self._timed(self.loads, super()._load_scaler, checkpoint)

    def _load_rng_state(self, checkpoint):
        return self._timed(self.loads, super()._load_rng_state, checkpoint)


class _StopAt(transformers.TrainerCallback):
    """Ends training once the Trainer has counted ``at`` steps (a job killed there); keeps the
    Trainer's step count at each save."""

    def __init__(self, at: int | None = None) -> None:
        self.at = at
        self.saved_at: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        self.saved_at.append(state.global_step)


def _checkpointing_trainer(tmp_path, steps, callbacks, save_steps=2):
    """A tiny GPT-2 saving full checkpoints (model, optimizer, scheduler, random states) every
    ``save_steps`` steps into ``tmp_path / "out"``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    kw = dict(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=1, report_to=[],
              use_cpu=True, save_strategy="steps", save_steps=save_steps, logging_strategy="no",
              disable_tqdm=True, seed=0, data_seed=0)
    trainer = _TimedCheckpoints(model=model, args=transformers.TrainingArguments(**kw), train_dataset=_LMData(),
                                callbacks=callbacks)
    trainer.saves, trainer.loads = [], []
    return trainer


def test_a_trainer_checkpoint_is_one_save_timed_whole(tmp_path):
    """A Trainer checkpoint writes the model (safetensors), the optimizer, the scheduler, the
    random states and the arguments. It is one save, timed from its start to its end: the
    histogram's count and sum are the Trainer's ``_save_checkpoint`` calls and their time.
    Before: 4 saves each (each ``torch.save``'d file), and the model's write not timed."""
    configure(tmp_path)
    rt = get_runtime()
    stop = _StopAt()
    trainer = _checkpointing_trainer(tmp_path, 6, [stop, TorchtraceCallback()])
    trainer.train()
    assert stop.saved_at == [2, 4, 6] and len(trainer.saves) == 3
    assert rt.metrics.value("torchtrace_checkpoint_seconds_count", {"kind": "save"}) == 3
    seconds = rt.metrics.value("torchtrace_checkpoint_seconds_sum", {"kind": "save"})
    assert sum(trainer.saves) <= seconds <= sum(trainer.saves) * 1.05 + 0.005
    assert rt.rank_state.fields["checkpoint_seconds"]["save"] == pytest.approx(seconds)
    # Goodput books each save once, as checkpoint time (with what came between the step and it).
    assert sum(trainer.saves) <= rt.throughput.ledger.snapshot(time.perf_counter()).badput["checkpoint"] \
        <= sum(trainer.saves) + 0.1
    # The last checkpoint holds the last step finished before it: the Trainer's count less one.
    assert rt.rank_state.fields["checkpoint_step"] == stop.saved_at[-1] - 1 == 5
    assert "_save_checkpoint" not in vars(trainer)  # the Trainer's own again once training ended
    tt.shutdown()


def test_a_trainers_resume_is_one_load(tmp_path):
    """``train(resume_from_checkpoint=...)`` loads the model, the optimizer and scheduler, the
    scaler and the random states at three moments of its start: one load, of their time
    together. Before: 4 loads (the model's safetensors file and each ``torch.load``)."""
    configure(tmp_path / "first")
    _checkpointing_trainer(tmp_path, 2, [TorchtraceCallback()]).train()
    tt.shutdown()
    configure(tmp_path / "resumed")
    rt = get_runtime()
    trainer = _checkpointing_trainer(tmp_path, 4, [TorchtraceCallback()])
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert len(trainer.loads) == 4
    assert rt.metrics.value("torchtrace_checkpoint_seconds_count", {"kind": "load"}) == 1
    seconds = rt.metrics.value("torchtrace_checkpoint_seconds_sum", {"kind": "load"})
    assert sum(trainer.loads) <= seconds <= sum(trainer.loads) * 1.05 + 0.005
    assert rt.rank_state.fields["checkpoint_seconds"]["load"] == pytest.approx(seconds)
    assert not {"_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state"} & set(vars(trainer))
    tt.shutdown()


def test_a_restarted_trainers_lost_steps_are_the_steps_it_repeats(tmp_path, monkeypatch):
    """Attempt 0 saves at the Trainer's step 4 (after steps 0 to 3) and stops after step 6;
    attempt 1 resumes from that checkpoint. The steps it repeats, from its first step (the
    Trainer's, 4) to attempt 0's last (6), are attempt 0's lost steps: 3. Before: 2 (the
    black box held the Trainer's count of steps, 4, for the last step finished, 3)."""
    from torchtrace.job.story import job_story

    first = configure(tmp_path, run_id="job")
    stop = _StopAt(at=7)
    _checkpointing_trainer(tmp_path, 12, [stop, TorchtraceCallback()], save_steps=4).train()
    assert stop.saved_at == [4]
    root = get_runtime().run_root
    tt.shutdown()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # (the launcher's restart: attempt 1 in this process)
    resumed = configure(tmp_path, run_id="job")
    _checkpointing_trainer(tmp_path, 8, [TorchtraceCallback()], save_steps=4).train(
        resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    tt.shutdown()
    repeated = [s["attributes"][semconv.STEP] for s in read_spans(resumed.spans_path)]
    last = [s["attributes"][semconv.STEP] for s in read_spans(first.spans_path)][-1]
    attempts = job_story(root)["attempts"]
    assert [a["attempt"] for a in attempts] == [0, 1] and attempts[0]["last_step"] == last == 6
    assert attempts[0]["checkpoint_step"] == 3
    assert attempts[0]["lost_steps"] == len([s for s in repeated if s <= last]) == 3
