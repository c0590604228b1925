"""SIGTERM (a preemption) loses nothing: every finished step's span, the report, ``preempted``
in the black box, the application's handler, and the process ends within 2 s."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.job.helpers import clean_env, events, start, wait_ready
from torchtrace.job.state import read_states

TORCHRUN = Path(sys.executable).with_name("torchrun")


def _preempt(tmp_path, cmd=None, **config):
    run_dir, log = tmp_path / "runs", tmp_path / "log.jsonl"
    (tmp_path / "ckpt").mkdir()
    env = clean_env(TORCHTRACE_RUN_ID="pre", TORCHTRACE_RUN_DIR=str(run_dir))
    p = start({"log": str(log), "ckpt_dir": str(tmp_path / "ckpt"), "step_s": 0.005, "last": 1000,
               "stop_at": 49, **config}, env, cmd)
    assert wait_ready(p) == 49
    sent = time.time()
    os.killpg(p.pid, signal.SIGTERM) if cmd else os.kill(p.pid, signal.SIGTERM)
    code = p.wait(30)
    return run_dir / "pre", code, time.time() - sent, events(log), sent


def _assert_nothing_lost(root, steps=50):
    spans = [json.loads(line) for line in (root / "spans.jsonl").read_text().splitlines()]
    assert sorted(s["attributes"]["torchtrace.step"] for s in spans) == list(range(steps))
    report = json.loads((root / "report.json").read_text())
    assert report["totals"]["steps"] == steps
    assert report["job"]["attempts"][0]["ended"] == "preempted"
    (state,) = read_states(root)
    assert (state["ended"], state["end_detail"], state["step"]) == ("preempted", "SIGTERM", steps - 1)


def test_sigterm_with_the_default_action(tmp_path):
    root, code, took, _, _ = _preempt(tmp_path)
    assert code == -signal.SIGTERM  # ended by the signal, as without torchtrace
    assert took < 2.0
    _assert_nothing_lost(root)


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
