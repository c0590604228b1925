"""ADVANCED's parameter check: every ``param_check_interval`` steps, and on every step whose
loss or gradients are non-finite, whatever the cadence. The names of non-finite parameters
are checked against a plain loop over the parameters."""

from __future__ import annotations

import contextlib

import pytest
import torch

import torchtrace as tt
from tests.helpers import read_spans
from torchtrace import semconv
from torchtrace.record import readout


def _configure(tmp_path, **kw):
    return tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False,
                        level=kw.pop("level", "advanced"), **kw)


@contextlib.contextmanager
def _training(tmp_path, **kw):
    """torchtrace configured with ``kw``, a fresh model and its SGD optimizer; shut down after."""
    result = _configure(tmp_path, **kw)
    try:
        model = _model()
        yield result, model, torch.optim.SGD(model.parameters(), lr=0.01)
    finally:
        tt.shutdown()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _nonfinite_by_loop(model) -> list[str]:
    return [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]


def _step(model, opt, poison=None):
    with tt.debug_context("train_step", model=model, optimizer=opt) as step:
        opt.zero_grad()
        if poison is not None:
            with torch.no_grad():
                poison()
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
    return step.record


def test_checked_every_interval_steps_and_spans_say_so(tmp_path):
    with _training(tmp_path, param_check_interval=3, update_ratio_interval=0) as (result, model, opt):
        records = [_step(model, opt) for _ in range(8)]
        assert [r.param_checked for r in records] == [i % 3 == 0 for i in range(8)]
        assert all(r.param_nonfinite_params == [] for r in records)
        assert _nonfinite_by_loop(model) == []
        tt.flush()
        spans = read_spans(result.spans_path)
        checked = [s["attributes"][semconv.STEP] for s in spans if s["attributes"].get(semconv.PARAM_CHECKED)]
        assert checked == [0, 3, 6]


def test_update_ratio_steps_are_checked_too(tmp_path):
    with _training(tmp_path, param_check_interval=100, update_ratio_interval=4) as (result, model, opt):
        records = [_step(model, opt) for _ in range(9)]
        assert [i for i, r in enumerate(records) if r.param_checked] == [0, 4, 8]
        assert [i for i, r in enumerate(records) if r.update_ratio is not None] == [0, 4, 8]


def test_a_bad_step_off_the_cadence_names_the_nonfinite_parameters(tmp_path):
    with _training(tmp_path, param_check_interval=1000, update_ratio_interval=0) as (result, model, opt):
        for _ in range(3):
            assert not _step(model, opt).nonfinite
        reads = readout.reads()
        rec = _step(model, opt, poison=lambda: model[2].weight.view(-1)[1].fill_(float("nan")))
        assert readout.reads() - reads == 2  # the step's read and the anomaly path's parameter read
        assert rec.step == 3 and rec.param_checked
        expected = _nonfinite_by_loop(model)
        assert "2.weight" in expected  # the NaN gradient spread to every tensor through the SGD update
        assert rec.param_nonfinite_params == expected
        assert rec.anomaly_kinds == [semconv.NONFINITE_GRAD, semconv.NONFINITE_PARAM]


def test_a_skipped_bad_step_leaves_the_parameters_finite(tmp_path):
    with _training(tmp_path, param_check_interval=1000, update_ratio_interval=0, guard="skip") as (result, model, opt):
        _step(model, opt)
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            opt.zero_grad()
            (model(torch.randn(3, 4)).sum() * float("inf")).backward()
            opt.step()
        rec = step.record
        assert rec.skipped and rec.param_checked and rec.param_nonfinite_params == []
        assert _nonfinite_by_loop(model) == []


def test_basic_never_checks_parameters(tmp_path):
    with _training(tmp_path, level="basic", param_check_interval=1) as (result, model, opt):
        records = [_step(model, opt) for _ in range(3)]
        records.append(_step(model, opt, poison=lambda: model[2].bias.fill_(float("nan"))))
        assert not any(r.param_checked for r in records)
        assert records[-1].nonfinite and records[-1].param_nonfinite_params == []


def test_interval_one_checks_every_step(tmp_path):
    with _training(tmp_path, param_check_interval=1, update_ratio_interval=0) as (result, model, opt):
        assert all(_step(model, opt).param_checked for _ in range(4))


@pytest.mark.parametrize("bad", [0, -2, 2.5, "often"])
def test_bad_interval_is_rejected_naming_the_setting(tmp_path, bad):
    with pytest.raises(ValueError, match="param_check_interval.*positive integer"):
        _configure(tmp_path, param_check_interval=bad)


def test_the_environment_sets_the_interval_and_a_bad_value_is_named_and_ignored(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCHTRACE_PARAM_CHECK_INTERVAL", "5")
    _configure(tmp_path)
    try:
        assert tt.api.get_runtime().settings.param_check_interval == 5
    finally:
        tt.shutdown()
    monkeypatch.setenv("TORCHTRACE_PARAM_CHECK_INTERVAL", "sometimes")
    with caplog.at_level("WARNING", logger="torchtrace"):
        _configure(tmp_path)
    try:
        assert tt.api.get_runtime().settings.param_check_interval == 10
        assert any("TORCHTRACE_PARAM_CHECK_INTERVAL" in r.getMessage() and "positive integer" in r.getMessage()
                   for r in caplog.records)
    finally:
        tt.shutdown()
