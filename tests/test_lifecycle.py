"""Processes, ports and repeated set-ups: nothing leaks, nothing collides, off means off."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch

import torchtrace as tt
from tests.fixtures import GrpcOtlpReceiver
from tests.forking import FORK_RUN, run_group
from torchtrace.api import get_runtime

ROOT = Path(__file__).resolve().parents[1]


def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)


def _sockets() -> int:
    return len(psutil.Process().net_connections(kind="inet"))


def _one_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tt.debug_context("train_step", model=model, optimizer=opt) as step:
        loss = model(torch.ones(2, 8)).pow(2).mean()
        loss.backward()
        step.record_loss(loss)
        opt.step()


def test_twenty_configure_shutdown_cycles_leave_no_threads_or_sockets(tmp_path, tiny_model, monkeypatch):
    _clean_env(monkeypatch)
    with GrpcOtlpReceiver() as rx:
        # Warm-up cycle: gRPC starts process-wide threads once, on first use.
        tt.configure(prometheus_port=0, run_dir=str(tmp_path), otlp_endpoint=rx.endpoint, otlp_protocol="grpc",
                     metrics_exporter="both", register_atexit=False, strict=True)
        _one_step(tiny_model)
        tt.shutdown()
        threads0 = {t.ident for t in threading.enumerate()}
        sockets0 = _sockets()
        for i in range(20):
            result = tt.configure(prometheus_port=0, run_dir=str(tmp_path), otlp_endpoint=rx.endpoint,
                                  otlp_protocol="grpc", metrics_exporter="both", register_atexit=False, strict=True)
            assert result.metrics_url is not None
            _one_step(tiny_model)
            tt.shutdown()
        rx.wait_for_spans(21, timeout=10)
        for t in threading.enumerate():
            if t.name.startswith("torchtrace"):
                t.join(2.0)
        leaked = [t.name for t in threading.enumerate() if t.ident not in threads0 and t.is_alive()
                  and t.name.startswith("torchtrace")]
        assert not leaked
        # Our own threads are gone; gRPC's internal pool may differ by a few, never by 20.
        assert len([t for t in threading.enumerate() if t.ident not in threads0]) < 5
        assert _sockets() <= sockets0 + 2


def test_disabled_means_no_threads_sockets_files_or_patches(tmp_path, tiny_model):
    script = r"""
import os, sys, threading, psutil, torch, torchtrace as tt
before_t = threading.active_count(); before_s = len(psutil.Process().net_connections(kind="inet"))
tt.configure(run_dir=sys.argv[1], otlp_endpoint="http://127.0.0.1:9")
model = torch.nn.Linear(3, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
@tt.debug_operation(model=model)
def step(x):
    return model(x).sum()
for _ in range(5):
    with tt.debug_context("train_step", model=model, optimizer=opt) as s:
        l = model(torch.ones(2, 3)).sum(); l.backward(); s.record_loss(l); opt.step()
    step(torch.ones(2, 3))
tt.flush(); tt.shutdown()
from torch.optim import lr_scheduler, optimizer as optimizer_module
patched = [getattr(f, "__torchtrace_wrapped__", False) for f in (
    torch.nn.utils.clip_grad_norm_, torch.amp.GradScaler.scale, lr_scheduler.LRScheduler.step,
    torch.optim.swa_utils.AveragedModel.update_parameters)] + [bool(optimizer_module._global_optimizer_pre_hooks)]
print(threading.active_count() - before_t, len(psutil.Process().net_connections(kind="inet")) - before_s,
      any(t.name.startswith("torchtrace") for t in threading.enumerate()), any(patched))
"""
    variants = (("TORCHTRACE_DISABLED", "1"), ("OTEL_SDK_DISABLED", "true"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    forker = run_group([sys.executable, "-c", FORK_RUN + _FORKER, script, str(tmp_path)]
                       + [f"{var}={value}" for var, value in variants], env=env, cwd=tmp_path, timeout=240)
    assert forker.returncode == 0, forker.stderr
    runs = json.loads(forker.stdout.splitlines()[-1])
    for var, _ in variants:
        run_dir = tmp_path / var
        out = runs[var]
        assert out["returncode"] == 0, out["stderr"]
        # ... and torch is left as it was: no wrapped functions, no global optimizer hook.
        assert out["stdout"].split() == ["0", "0", "False", "False"], (var, out["stdout"])
        assert not run_dir.exists()
        assert not (tmp_path / "torchtrace-runs").exists()


# Runs the script once per ``VAR=value``, each in a process of its own forked from this one,
# which has imported what the script imports before torchtrace (torch, psutil) and nothing
# else: torchtrace is imported in the child, under the variable, as in a process started with
# it. (Two processes started whole took 10 s on a loaded 2-core machine, importing torch each.)
_FORKER = r"""
import json, os, sys
import psutil, torch
import torch._dynamo  # (torch's own: the script's first optimizer step would import it)

script, where = sys.argv[1], sys.argv[2]

def run(var, value):
    os.environ[var] = value
    sys.argv = ["-c", os.path.join(where, var)]
    exec(compile(script, "<script>", "exec"), {"__name__": "__main__"})

runs = {}
for variant in sys.argv[3:]:
    var, value = variant.split("=", 1)
    runs[var] = fork_run(run, var, value)
print(json.dumps(runs))
"""


@pytest.mark.parametrize("policy", ["next", "ephemeral", "off"])
def test_port_in_use_is_handled_by_policy(tmp_path, tiny_model, monkeypatch, caplog, policy):
    _clean_env(monkeypatch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        caplog.set_level(logging.WARNING)
        result = tt.configure(prometheus_port=port, port_policy=policy, run_dir=str(tmp_path), strict=True,
                              register_atexit=False)
        _one_step(tiny_model)  # training goes on
        served = result.prometheus_port
        summary_url = get_runtime().summary()["telemetry"]["metrics_url"]
        tt.shutdown()
    assert f"port {port} is in use" in caplog.text
    if policy == "off":
        assert served is None and summary_url is None
    else:
        assert served is not None and served != port
        assert summary_url.endswith(f":{served}/metrics")
        if policy == "next":  # the following ports first (one of them is free here)
            assert port < served < port + 16


def test_server_binds_loopback_by_default_and_warns_on_wildcard(tmp_path, monkeypatch, caplog):
    _clean_env(monkeypatch)
    tt.configure(prometheus_port=0, run_dir=str(tmp_path), register_atexit=False)
    assert get_runtime().server._httpd.server_address[0] == "127.0.0.1"
    tt.shutdown()
    caplog.set_level(logging.WARNING)
    tt.configure(prometheus_port=0, prometheus_host="0.0.0.0", run_dir=str(tmp_path), register_atexit=False)
    tt.shutdown()
    assert "reachable from other machines" in caplog.text


def test_dataloader_fork_workers_neither_hang_nor_duplicate_spans(tmp_path, tiny_model, monkeypatch):
    _clean_env(monkeypatch)
    result = tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            # A worker that opens a step of its own must not export anything.
            with tt.debug_context("in_worker"):
                pass
            return torch.ones(8) * i

    loader = torch.utils.data.DataLoader(Data(), batch_size=4, num_workers=2,
                                         multiprocessing_context="fork", timeout=60)
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
    for epoch in range(2):
        for x in loader:
            with tt.debug_context("train_step", model=tiny_model, optimizer=opt) as step:
                loss = tiny_model(x).pow(2).mean()
                loss.backward()
                step.record_loss(loss)
                opt.step()
                opt.zero_grad()
    spans_path = result.spans_path
    tt.shutdown()
    from torchtrace.files import read_json_lines

    lines = read_json_lines(spans_path)
    names = [d["name"] for d in lines]
    assert names.count("train_step") == 8
    assert "in_worker" not in names
    assert len({d["span_id"] for d in lines}) == len(lines)


def test_shutdown_after_a_disabled_configure_lets_the_next_use_start_afresh(tmp_path, monkeypatch):
    """configure(disabled=True) then shutdown(): torchtrace is unconfigured again, and its first
    use configures it from the environment (as in a fresh process). Before, the disabled flag
    outlived shutdown and every later use in the process recorded nothing (the seed trainer's
    steps had no runtime)."""
    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHTRACE_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHTRACE_PROMETHEUS_PORT", "off")
    tt.configure(disabled=True)
    assert tt.api.get_runtime() is None
    tt.shutdown()
    assert tt.api.get_runtime() is not None
    tt.shutdown()
    monkeypatch.setenv("TORCHTRACE_DISABLED", "1")  # the environment still decides
    assert tt.api.get_runtime() is None
    tt.shutdown()


def test_a_wrapper_the_application_puts_over_torchtraces_stays_after_shutdown(tmp_path):
    """An application wraps GradScaler.step, a scheduler's step, clip_grad_norm_ and
    init_process_group while torchtrace is configured (``functools.wraps`` copies torchtrace's
    marker onto its wrapper): at shutdown its wrappers stay where it put them and still run.
    Before, shutdown put back its wrapper's ``__wrapped__``: torchtrace's own, left installed,
    and the application's wrapper gone."""
    import functools

    import torch.distributed as dist

    saved = (torch.amp.GradScaler.step, torch.optim.lr_scheduler.LRScheduler.step, torch.nn.utils.clip_grad_norm_,
             dist.init_process_group)
    calls: list[str] = []

    def counted(f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            calls.append(f.__name__)
            return f(*args, **kwargs)
        return wrapper

    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False)
    try:
        torch.amp.GradScaler.step = counted(torch.amp.GradScaler.step)
        torch.optim.lr_scheduler.LRScheduler.step = counted(torch.optim.lr_scheduler.LRScheduler.step)
        torch.nn.utils.clip_grad_norm_ = counted(torch.nn.utils.clip_grad_norm_)
        dist.init_process_group = counted(dist.init_process_group)
        applications = (torch.amp.GradScaler.step, torch.optim.lr_scheduler.LRScheduler.step,
                        torch.nn.utils.clip_grad_norm_, dist.init_process_group)
        tt.shutdown()
        assert (torch.amp.GradScaler.step, torch.optim.lr_scheduler.LRScheduler.step,
                torch.nn.utils.clip_grad_norm_, dist.init_process_group) == applications
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
        calls.clear()  # (a scheduler steps once as it is made)
        model(torch.ones(1, 2)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scheduler.step()
        assert calls == ["clip_grad_norm_", "step", "step"]
    finally:
        tt.shutdown()
        (torch.amp.GradScaler.step, torch.optim.lr_scheduler.LRScheduler.step, torch.nn.utils.clip_grad_norm_,
         dist.init_process_group) = saved
