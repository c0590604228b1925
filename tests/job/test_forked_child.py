"""A child forked from a configured process (a user's ``os.fork()``) can end, and can set
torchtrace up for itself, without waiting forever for its parent's threads: the hang watch's
faulthandler dump and the metrics server are not running in the child, and stopping them there
used to wait for threads it does not have."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.job.helpers import clean_env

SCRIPT = r"""
import os, sys, time, torch, torchtrace as tt

parent_dir, child_dir = sys.argv[1], sys.argv[2]
tt.configure(service_name="parent", prometheus_port=0, run_dir=parent_dir)  # (exit handler on: the default)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def steps(n):
    for _ in range(n):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = model(torch.ones(2, 4)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            step.record_loss(loss)

steps(3)
time.sleep(1.5)  # the watchdog has ticked since: faulthandler's dump is armed

def wait(pid, what):
    deadline = time.time() + 20
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print(what, "exit", os.waitstatus_to_exitcode(status), flush=True)
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print(what, "hung", flush=True)

pid = os.fork()
if pid == 0:  # shutdown(), then torchtrace of its own
    tt.shutdown()
    tt.configure(service_name="child", prometheus_port=0, run_dir=child_dir, register_atexit=False)
    steps(2)
    tt.shutdown()
    os._exit(0)
wait(pid, "shutdown-child")

pid = os.fork()
if pid == 0:  # the end of a script: the exit handler shuts torchtrace down
    sys.exit(0)
wait(pid, "exiting-child")

steps(2)  # the parent goes on as before
tt.shutdown()
print("parent done", flush=True)
"""


def _run(tmp_path: Path, text: str, *args: Path) -> subprocess.CompletedProcess:
    """Run the script ``text`` with ``args``, in ``tmp_path``, without the caller's torchtrace settings."""
    script = tmp_path / "script.py"
    script.write_text(text)
    return subprocess.run([sys.executable, str(script), *[str(a) for a in args]], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_ends_and_configures_without_waiting_for_its_parents_threads(tmp_path):
    done = _run(tmp_path, SCRIPT, tmp_path / "parent", tmp_path / "child")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "shutdown-child exit 0" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "exiting-child exit 0" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "parent done" in done.stdout
    # The parent's run is whole (its five steps, its report); the child's own run has its two.
    parent = json.loads(next((tmp_path / "parent").glob("*/report.json")).read_text())
    child = json.loads(next((tmp_path / "child").glob("*/report.json")).read_text())
    assert parent["totals"]["steps"] == 5, parent["totals"]
    assert child["totals"]["steps"] == 2, child["totals"]


BARE_FORK = r"""
import os, sys, torch, torchtrace as tt

tt.configure(service_name="parent", prometheus_port="off", run_dir=sys.argv[1], run_id="bare")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for shut_down in (True, False):
    pid = os.fork()
    if pid == 0:  # a child that trains (torchtrace sets it up at its first step) and ends with os._exit
        for _ in range(2):
            with tt.debug_context("train_step", model=model, optimizer=opt):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
        if shut_down:
            tt.shutdown()
        os._exit(0)
    os.waitpid(pid, 0)
    print(pid, shut_down, flush=True)
tt.shutdown()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_bare_fork_child_that_ends_with_os_exit_is_told_by_its_shutdown(tmp_path):
    """``os._exit`` runs no exit handler: a child that calls ``shutdown()`` first ends
    ``completed``; one that does not is read as ``killed``, and the detail names ``os._exit``
    among the causes (docs/jobs.md)."""
    from torchtrace.job.ending import how_ended
    from torchtrace.job.state import read_states

    done = _run(tmp_path, BARE_FORK, tmp_path / "runs")
    assert done.returncode == 0, done.stderr[-3000:]
    children = dict(line.split() for line in done.stdout.splitlines())
    ends = {}
    for pid, shut_down in children.items():
        (state,) = read_states(tmp_path / "runs" / f"bare-pid{pid}")
        ends[shut_down] = how_ended(state)
    assert ends["True"] == ("completed", None)
    (told,) = read_states(tmp_path / "runs" / f"bare-pid{next(p for p, s in children.items() if s == 'True')}")
    assert told["step"] == 1  # its two steps, numbered 0 and 1: the shutdown wrote the box
    assert ends["False"][0] == "killed" and "os._exit" in ends["False"][1]
