"""SIGTERM (a preemption) loses nothing: every finished step's span, the report, ``preempted``
in the black box, the application's handler, and the process ends within 2 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.netfaults import BlackHole
from tests.job.helpers import clean_env, events, start, wait_ready
from torchtrace.job.state import read_states

TORCHRUN = Path(sys.executable).with_name("torchrun")


def _preempt(tmp_path, cmd=None, sig=signal.SIGTERM, **config):
    run_dir, log = tmp_path / "runs", tmp_path / "log.jsonl"
    (tmp_path / "ckpt").mkdir()
    env = clean_env(TORCHTRACE_RUN_ID="pre", TORCHTRACE_RUN_DIR=str(run_dir))
    p = start({"log": str(log), "ckpt_dir": str(tmp_path / "ckpt"), "step_s": 0.005, "last": 1000,
               "stop_at": 49, **config}, env, cmd)
    assert wait_ready(p) == 49
    sent = time.time()
    os.killpg(p.pid, sig) if cmd else os.kill(p.pid, sig)
    code = p.wait(30)
    return run_dir / "pre", code, time.time() - sent, events(log), sent


def _assert_nothing_lost(root, steps=50, sig="SIGTERM"):
    spans = [json.loads(line) for line in (root / "spans.jsonl").read_text().splitlines()]
    assert sorted(s["attributes"]["torchtrace.step"] for s in spans) == list(range(steps))
    report = json.loads((root / "report.json").read_text())
    assert report["totals"]["steps"] == steps
    assert report["job"]["attempts"][0]["ended"] == "preempted"
    (state,) = read_states(root)
    assert (state["ended"], state["end_detail"], state["step"]) == ("preempted", sig, steps - 1)


def test_sigterm_with_the_default_action(tmp_path):
    root, code, took, _, _ = _preempt(tmp_path)
    assert code == -signal.SIGTERM  # ended by the signal, as without torchtrace
    assert took < 2.0
    _assert_nothing_lost(root)


def test_sighup_loses_nothing_and_ends_the_process_as_it_would_have(tmp_path):
    """A run in a terminal whose session closed (an ssh connection lost, without nohup or tmux):
    the hangup ended the process with nothing flushed, and the black box said "killed"."""
    root, code, took, _, _ = _preempt(tmp_path, sig=signal.SIGHUP)
    assert code == -signal.SIGHUP
    assert took < 2.0
    _assert_nothing_lost(root, sig="SIGHUP")


def test_a_run_under_nohup_still_ignores_the_hangup(tmp_path):
    run_dir, log = tmp_path / "runs", tmp_path / "log.jsonl"
    (tmp_path / "ckpt").mkdir()
    env = clean_env(TORCHTRACE_RUN_ID="pre", TORCHTRACE_RUN_DIR=str(run_dir))
    p = start({"log": str(log), "ckpt_dir": str(tmp_path / "ckpt"), "step_s": 0.005, "last": 1000, "stop_at": 49},
              env, ["nohup", sys.executable])
    try:
        assert wait_ready(p) == 49
        os.killpg(p.pid, signal.SIGHUP)
        time.sleep(1.0)
        assert p.poll() is None  # ignored, as nohup asked
        (state,) = read_states(run_dir / "pre")
        assert state["ended"] is None
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(30)
    _assert_nothing_lost(run_dir / "pre")


@pytest.mark.parametrize("when", ["handler", "handler_after"])
def test_the_applications_handler_still_runs(tmp_path, when):
    root, code, took, evs, sent = _preempt(tmp_path, **{when: True})
    assert code == 143  # the application's handler ended the process its own way
    (called,) = [e for e in evs if e["ev"] == "app_handler"]
    assert called["signum"] == signal.SIGTERM
    # torchtrace's part is done within 2 s; after that, sys.exit's own interpreter teardown
    # (seconds with torch loaded on this machine, with or without torchtrace) is the application's.
    assert called["t"] - sent < 2.0
    _assert_nothing_lost(root)


def test_sigterm_under_torchrun(tmp_path):
    if not TORCHRUN.exists():
        pytest.skip("torchrun is not installed beside this Python")
    cmd = [str(TORCHRUN), "--nproc-per-node=1", "--max-restarts=0", "--monitor-interval=0.1"]
    root, code, took, evs, sent = _preempt(tmp_path, cmd)
    _assert_nothing_lost(root)
    (state,) = read_states(root)
    assert state["end_time"] - sent < 2.0  # the worker's own end, whatever the agent does after
    assert took < 30.0 and code != 0


_SHUTS_DOWN = r"""
import sys, torch, torchtrace as tt

tt.configure(prometheus_port=None, run_dir=sys.argv[1], run_id="held", otlp_endpoint=sys.argv[2],
             otlp_protocol="http/protobuf", metrics_exporter="otlp", metrics_export_interval_s=30.0,
             shutdown_timeout_s=3.0, register_atexit=False)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(10):
    with tt.debug_context("train_step", model=model, optimizer=opt) as step:
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        opt.step()
        step.record_loss(loss)
print("shutting down", flush=True)
tt.shutdown()  # the collector never answers: the final metrics push waits for most of the 3 s deadline
print("shut down", flush=True)
"""


def test_a_sigterm_during_shutdown_ends_the_process_once_shutdown_has_ended(tmp_path):
    """A SIGTERM while torchtrace shuts down (a pool's ``terminate()`` as its workers end, a
    launcher tearing down a job that is finishing) used to end the process in the middle: here
    0.5 s in, as the final metrics push to a collector that never answers waits (2.6 s), the
    report's second write (the final export counts) never came. Now the signal takes effect as shutdown ends,
    within its deadline: the report is final, and the process still ends by the signal."""
    run_dir = tmp_path / "runs"
    with BlackHole() as hole:
        proc = subprocess.Popen([sys.executable, "-c", _SHUTS_DOWN, str(run_dir), hole.endpoint], env=clean_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "shutting down", proc.stderr.read()[-3000:]
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    assert "shut down" not in out  # the script did not go on past the signal
    assert took < 3.0, took  # within shutdown's deadline
    report = json.loads((run_dir / "held" / "report.json").read_text())
    # The final write: the collector's 10 spans, never acknowledged, counted as dropped, and the
    # final push as failed.
    telemetry = report["telemetry"]
    (otlp,) = [e for e in telemetry["span_exporters"] if e["exporter"] == "otlp_http"]
    assert sum(otlp["dropped"].values()) == 10 and otlp["queued"] == otlp["in_flight"] == 0, otlp
    assert telemetry["metrics_push_failures"] == 1, telemetry
    assert report["job"]["attempts"][0]["ended"] == "completed"  # (shutdown had begun: it had said so)
