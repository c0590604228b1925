"""The application's logging configuration cannot break torchtrace (RELIABILITY.md promise 1).

A handler whose ``emit`` raises (instead of calling ``handleError``) makes every log call that
reaches it raise. torchtrace logs on the training thread (non-finite steps, the live page's
address, its own caught failures): none of those calls may raise out, lose a step's record or
be counted as torchtrace's own internal error.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import torchtrace as tt
from tests.conftest import TinyNet
from torchtrace.api import get_runtime


class _RaisingHandler(logging.Handler):
    def emit(self, record):
        raise RuntimeError("the application's handler failed")


@pytest.fixture
def raising_root_handler(monkeypatch):
    """Installs (when called) a raising handler on the root logger at DEBUG; removed afterwards."""
    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)
    root = logging.getLogger()
    handler = _RaisingHandler()
    old_level = root.level

    def install():
        root.setLevel(logging.DEBUG)
        root.addHandler(handler)

    yield install
    root.removeHandler(handler)
    root.setLevel(old_level)


def _train(model, opt, steps, nan_at):
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(4, 8, generator=g)
        if i == nan_at:
            x[0, 0] = float("nan")
        with tt.debug_context("train_step", model=model, optimizer=opt,
                              replay=lambda x=x: model(x).pow(2).mean()) as step:
            loss = model(x).pow(2).mean()
            loss.backward()
            step.record_loss(loss)
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("installed", ["before_configure", "after_configure"])
def test_raising_handler_neither_raises_nor_loses_records(raising_root_handler, tmp_path, installed):
    if installed == "before_configure":
        raising_root_handler()
    tt.configure(prometheus_port=0, run_dir=str(tmp_path), register_atexit=False)  # logs the live page at INFO
    if installed == "after_configure":
        raising_root_handler()
    try:
        torch.manual_seed(0)
        model = TinyNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        _train(model, opt, 20, nan_at=5)  # the NaN step logs warnings and a forensic finding
        tt.flush()
        rt = get_runtime()
        assert rt.metrics.value("torchtrace_steps_total", {"operation": "train_step"}) == 20
        assert rt.errors.by_component == {}
    finally:
        tt.shutdown()


@pytest.mark.parametrize("mode", ["anomaly_detection", "full_debug"])
def test_warnings_as_errors_keep_anomaly_mode_working(tmp_path, monkeypatch, mode):
    """``warnings.simplefilter("error")`` (or ``-W error``) in the application: turning autograd's
    anomaly mode on for a step must not raise a warning that aborts torchtrace's step set-up."""
    import warnings

    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), mode=mode, register_atexit=False)
    seen = []
    try:
        torch.manual_seed(0)
        model = TinyNet()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                with tt.debug_context("train_step", model=model) as step:
                    seen.append(torch.is_anomaly_enabled())
                    loss = model(torch.randn(4, 8)).pow(2).mean()
                    loss.backward()
                    step.record_loss(loss)
        tt.flush()
        assert get_runtime().errors.by_component == {}
    finally:
        tt.shutdown()
    assert seen == [True, True, True]
    assert not torch.is_anomaly_enabled()
