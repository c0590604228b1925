"""What a step's loss can be, and what happens to each kind (issue: silent loss handling)."""

from __future__ import annotations

import collections
import logging

import numpy as np
import pytest
import torch

import torchtrace as tt
from torchtrace.api import get_runtime
from torchtrace.measure.loss import classify_loss, extract_loss


def _returning(value):
    @tt.debug_operation(name="train_step")
    def step():
        return value
    step()
    tt.flush()
    return get_runtime().history.last_record


@pytest.mark.parametrize("value, expected", [(0.25, 0.25), (3, 3.0), ({"loss": 1.5}, 1.5),
                                             (torch.tensor(0.5, dtype=torch.float64), 0.5)])
def test_numbers_and_scalars_are_recorded(tt_runtime, value, expected):
    assert _returning(value).loss == expected


@pytest.mark.parametrize("value", [np.float32(0.375), np.float16(0.375), np.float64(0.375)])
def test_a_returned_numpy_scalar_is_recorded_as_record_loss_would(tt_runtime, value):
    # np.float64 is a float subclass; np.float32 and np.float16 are not, and were dropped
    # without a word when returned, though record_loss took them.
    assert _returning(value).loss == 0.375


def test_a_float_loss_given_to_record_loss(tt_runtime):
    with tt.debug_context("train_step") as step:
        step.record_loss(0.125)
    assert step.record.loss == 0.125


@pytest.mark.parametrize("loss, words", [
    (torch.ones(16, 1), "shape [16, 1] is not a scalar"),
    (torch.tensor(True), "dtype torch.bool is not a number"),
    (torch.tensor(3), "dtype torch.int64 is not a number"),
])
def test_non_losses_are_refused_with_one_warning_per_operation(tmp_path, caplog, loss, words):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    try:
        caplog.set_level(logging.WARNING, logger="torchtrace")
        for _ in range(3):
            with tt.debug_context("train_step") as step:
                step.record_loss(loss)
            assert step.record.loss is None
        said = [r.getMessage() for r in caplog.records if "loss was not recorded" in r.getMessage()]
        assert len(said) == 1 and words in said[0]
        assert get_runtime().errors.total == 0
    finally:
        tt.shutdown()


def test_a_non_scalar_returned_loss_is_not_cut_to_its_first_element(tmp_path, caplog):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    try:
        caplog.set_level(logging.WARNING, logger="torchtrace")
        record = _returning(torch.arange(16.0).reshape(16, 1))
        assert record.loss is None
        assert any("shape [16, 1]" in r.getMessage() for r in caplog.records)
    finally:
        tt.shutdown()


def test_a_model_on_the_meta_device_counts_no_internal_error(tmp_path, caplog):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=False, level="advanced")
    try:
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                loss = model(torch.ones(4, 8, device="meta")).mean()
                loss.backward()
                step.record_loss(loss)
                opt.step()
        rt = get_runtime()
        assert rt.errors.total == 0, rt.errors.by_component
        assert rt.history.totals["steps"] == 3
        assert step.record.loss is None and step.record.grad_norm is None
    finally:
        tt.shutdown()


def test_classify_and_extract_against_their_rules():
    assert classify_loss(torch.tensor([2.5])).tensor.item() == 2.5
    assert classify_loss(1).number == 1.0
    assert classify_loss(True).problem == "a loss of type bool is not a number"
    assert classify_loss("0.5").problem == "a loss of type str is not a number"
    assert classify_loss(object()).problem.startswith("a loss of type object")
    assert classify_loss(torch.ones(2, device="meta")).problem.startswith("a loss of shape [2]")
    assert classify_loss(torch.ones((), device="meta")).problem == "a loss on the meta device holds no value"
    assert extract_loss(True) is None  # a bool returned by a step is no loss

    class Out:
        loss = torch.tensor(0.75)
    assert extract_loss(Out()).item() == 0.75
    assert extract_loss({"logits": 1}) is None
    # A named tuple that names its loss gives it, as an object with .loss does; a plain tuple's
    # order is no convention ((loss, logits) in one codebase, (logits, loss) in another).
    named = collections.namedtuple("Output", "logits loss")
    assert extract_loss(named(torch.ones(2), torch.tensor(0.5))).item() == 0.5
    assert extract_loss((torch.tensor(0.5), torch.ones(2)))[0].item() == 0.5  # (the tuple, judged no loss)
    assert classify_loss(extract_loss(collections.namedtuple("Pair", "a b")(1.0, 2.0))).problem is not None


def test_a_failure_under_anomaly_detection_records_its_kind(tmp_path):
    """DebugMode.ANOMALY_DETECTION: the step's RuntimeError from detect_anomaly is recorded as a
    nonfinite_grad anomaly naming the backward op, and re-raised unchanged."""
    import warnings

    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True,
                 mode="anomaly_detection")
    try:
        x = torch.tensor([-1.0, 4.0], requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(RuntimeError, match="returned nan values"):
                with tt.debug_context("train_step") as step:
                    torch.sqrt(x).sum().backward()
        kinds = step.record.anomaly_kinds
        assert kinds == ["nonfinite_grad"]
        assert step.record.anomalies[0].data["op"] == "SqrtBackward0"
        assert step.record.exception_type == "RuntimeError"
        assert not torch.is_anomaly_enabled()
    finally:
        tt.shutdown()


def test_an_evaluation_that_returns_its_predictions_warns_of_no_loss(tmp_path, caplog):
    """``@debug_operation(kind="evaluation")`` on a function returning the model's outputs
    (a tensor of many values): predictions, not a loss; nothing is recorded and nothing said.
    A training step returning the same is still told that its loss was not recorded, and an
    evaluation returning a scalar still has it as its loss."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    try:
        caplog.set_level(logging.WARNING, logger="torchtrace")
        outputs = torch.randn(8, 3)
        for kind in ("evaluation", "train"):
            predict = tt.debug_operation(name=f"predict_{kind}", kind=kind)(lambda: outputs)
            for _ in range(2):
                predict()
            assert get_runtime().history.last_record.loss is None
        said = [r.getMessage() for r in caplog.records if "loss was not recorded" in r.getMessage()]
        assert len(said) == 1 and "predict_train" in said[0]
        evaluate = tt.debug_operation(name="evaluate", kind="evaluation")(lambda: torch.tensor(0.75))
        evaluate()
        tt.flush()
        assert get_runtime().history.last_record.loss == 0.75
    finally:
        tt.shutdown()


def test_a_training_step_returning_a_tuple_is_told_its_loss_was_not_recorded(tmp_path, caplog):
    """``return loss, logits`` gave the step no loss and said nothing; which item is the loss is
    the user's to say, so torchtrace warns once (a training step only: an evaluation returning
    its predictions and labels has no loss to give)."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    try:
        caplog.set_level(logging.WARNING, logger="torchtrace")
        loss, logits = torch.tensor(0.5), torch.randn(4, 3)
        for kind in ("evaluation", "train"):
            step = tt.debug_operation(name=f"step_{kind}", kind=kind)(lambda: (loss, logits))
            for _ in range(2):
                step()
            tt.flush()
            assert get_runtime().history.last_record.loss is None
        said = [r.getMessage() for r in caplog.records if "loss was not recorded" in r.getMessage()]
        assert len(said) == 1 and "step_train" in said[0] and "record_loss" in said[0], said
        assert get_runtime().errors.total == 0
    finally:
        tt.shutdown()
