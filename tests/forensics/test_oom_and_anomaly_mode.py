"""Out of memory inside a step; explicit anomaly detection and its state restoration."""

from __future__ import annotations

import warnings

import pytest
import torch

import torchtrace as tt
from tests.conftest import TinyNet
from torchtrace import semconv
from torchtrace.api import get_runtime


def _configure(tmp_path, **kw):
    return tt.configure(service_name="t", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                        register_atexit=False, **kw)


def _oom_step():
    @tt.debug_operation
    def train_step(model, batch, opt):
        opt.zero_grad()
        model(batch).sum().backward()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return train_step


@pytest.mark.parametrize("guard", ["warn", "raise"])
def test_oom_is_recorded_then_reraised(guard, tmp_path):
    _configure(tmp_path, guard=guard)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(torch.OutOfMemoryError):
        _oom_step()(model, torch.randn(2, 8), opt)
    rt = get_runtime()
    rec = rt.history.last_record
    assert semconv.OOM in rec.anomaly_kinds and rec.exception_type == "OutOfMemoryError"
    info = rt.summary()["forensics"]["ooms"][0]
    assert info["action"] == "raised" and info["memory"]["rss_bytes"] > 0
    assert rt.metrics.registry.get_sample_value("torchtrace_anomalies_total", {
        "run_id": rt.settings.run_id, "rank": "0", "operation": "train_step", "kind": "oom"}) == 1


def test_oom_with_skip_drops_the_batch_and_frees_gradients(tmp_path):
    _configure(tmp_path, guard="skip")
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert _oom_step()(model, torch.randn(2, 8), opt) is None
    rt = get_runtime()
    rec = rt.history.last_record
    assert rec.skipped and semconv.OOM in rec.anomaly_kinds
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with tt.debug_context("after", model=model, optimizer=opt):  # training goes on
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    assert rt.history.totals["steps"] == 2


def test_anomaly_detection_modes_restore_previous_state():
    def bad_backward():
        x = torch.zeros(3, requires_grad=True)
        torch.sqrt(x * 0 - 1).sum().backward()  # NaN born in SqrtBackward... and forward

    assert not torch.is_anomaly_enabled()
    with pytest.raises(RuntimeError, match="returned nan"):
        with tt.anomaly_detection("detect"):
            assert torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
            bad_backward()
    assert not torch.is_anomaly_enabled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tt.anomaly_detection("warn"):
            bad_backward()
    assert any(issubclass(w.category, RuntimeWarning) and "autograd anomaly" in str(w.message) for w in caught)
    with pytest.raises(tt.NonFiniteError):
        with tt.anomaly_detection("raise"):
            bad_backward()
    torch.set_anomaly_enabled(True, False)  # a previous state that is not the default is restored
    try:
        with tt.anomaly_detection("detect"):
            assert torch.is_anomaly_check_nan_enabled()
        assert torch.is_anomaly_enabled() and not torch.is_anomaly_check_nan_enabled()
    finally:
        torch.set_anomaly_enabled(False)
    with pytest.raises(ValueError, match="accepted values: detect, warn, raise"):
        with tt.anomaly_detection("loud"):
            pass


def test_debug_mode_anomaly_detection_wraps_the_step(tmp_path):
    _configure(tmp_path, mode=tt.DebugMode.ANOMALY_DETECTION)
    seen = []
    with tt.debug_context("step"):
        seen.append((torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()))
    assert seen == [(True, True)] and not torch.is_anomaly_enabled()


def test_forensics_settings_are_validated():
    with pytest.raises(ValueError, match="forensics_max_replays=-1 .*an integer >= 0"):
        tt.configure(forensics_max_replays=-1, prometheus_port="off", write_files=False)
    with pytest.raises(ValueError, match="forensics='maybe'"):
        tt.configure(forensics="maybe", prometheus_port="off", write_files=False)


def _cpu_oom_step():
    @tt.debug_operation
    def train_step(model, batch, opt):
        opt.zero_grad()
        model(batch).sum().backward()
        torch.empty(1 << 60, dtype=torch.uint8)  # 1 EiB: the CPU allocator always refuses it
        opt.step()
    return train_step


@pytest.mark.parametrize("guard", ["warn", "raise", "skip"])
def test_the_cpu_allocators_failure_is_an_oom_under_each_guard(guard, tmp_path):
    _configure(tmp_path, guard=guard)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if guard == "skip":
        assert _cpu_oom_step()(model, torch.randn(2, 8), opt) is None
    else:
        with pytest.raises(RuntimeError, match="DefaultCPUAllocator: can't allocate memory"):
            _cpu_oom_step()(model, torch.randn(2, 8), opt)
    rec = get_runtime().history.last_record
    assert semconv.OOM in rec.anomaly_kinds
    info = get_runtime().summary()["forensics"]["ooms"][0]
    assert info["action"] == ("skipped" if guard == "skip" else "raised")
    if guard == "skip":
        assert rec.skipped and all(p.grad is None for p in model.parameters())
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_is_oom_is_narrow():
    from torchtrace.forensics.oom import is_oom

    assert is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                               "can't allocate memory: you tried to allocate 35184372088832 bytes."))
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x7 and 8x4)"))
    assert not is_oom(ValueError("DefaultCPUAllocator: can't allocate memory"))
