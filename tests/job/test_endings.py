"""How an attempt ended, as its black box and the job story tell it: an exception, a signal
handler that could not be installed, the signal wrapper's bookkeeping, and job_story's
arithmetic on black boxes written by hand."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

import torchtrace as tt
from tests.job.helpers import clean_env
from torchtrace.job.signals import SignalGuard
from torchtrace.job.state import read_states
from torchtrace.job.story import story_of

_RAISES = textwrap.dedent("""
    import sys, torchtrace as tt
    tt.configure(prometheus_port="off", record_exception_messages=sys.argv[1] == "1")
    for step in range(10):
        with tt.debug_context("train_step", step=step):
            if step == 7:
                raise ValueError("the batch was empty: secret-token-123")
""")


@pytest.mark.parametrize("messages", ["0", "1"])
def test_an_exception_is_told_with_its_type_and_step(tmp_path, messages):
    env = clean_env(TORCHTRACE_RUN_ID="exc", TORCHTRACE_RUN_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _RAISES, messages], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and "ValueError" in done.stderr  # Python's own hook still printed it
    (state,) = read_states(tmp_path / "exc")
    # The step that raised is finished too (a failed step's record), so it is the last step.
    assert (state["ended"], state["end_step"], state["step"]) == ("exception", 7, 7)
    report = json.loads((tmp_path / "exc" / "report.json").read_text())
    (attempt,) = report["job"]["attempts"]
    assert (attempt["ended"], attempt["last_step"]) == ("exception", 7)
    if messages == "1":
        assert attempt["detail"] == "ValueError: the batch was empty: secret-token-123"
    else:  # messages are opt-in, as for spans: the type only
        assert attempt["detail"] == "ValueError"
        assert "secret-token-123" not in (tmp_path / "exc" / "state.json").read_text()


_EXITS = textwrap.dedent("""
    import math, sys, torch, torchtrace as tt
    tt.configure(prometheus_port="off")
    code = {"1": 1, "0": 0, "none": None, "text": "no data left", "caught": 1}[sys.argv[1]]
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        try:
            with tt.debug_context("train_step", model=model, optimizer=opt):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                if step == 3:  # the engine's check of a loss that is not finite (DeiT, MAE, DETR)
                    print("Loss is nan, stopping training")
                    sys.exit(code)
                opt.zero_grad(); loss.backward(); opt.step()
        except SystemExit:
            if sys.argv[1] != "caught":
                raise
""")


@pytest.mark.parametrize("how", ["1", "text", "0", "none", "caught"])
def test_sys_exit_inside_a_step_is_the_processs_end(tmp_path, how):
    """The engines of DeiT, MAE and DETR call ``sys.exit(1)`` inside their loop when the loss is
    not finite. Before, the process's black box said ``completed`` (no exception hook sees a
    SystemExit), so ``torchtrace why`` found nothing wrong with a job its launcher saw fail. A
    status of 0 (or none) is a clean end: that step is no failed step either. An exit the
    script catches (and trains on) ends nothing."""
    env = clean_env(TORCHTRACE_RUN_ID="exit", TORCHTRACE_RUN_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _EXITS, how], env=env, capture_output=True, text=True,
                          timeout=300)
    failed = how in ("1", "text")
    assert done.returncode == (1 if failed else 0), done.stderr
    (state,) = read_states(tmp_path / "exit")
    report = json.loads((tmp_path / "exit" / "report.json").read_text())
    spans = [json.loads(line) for line in (tmp_path / "exit" / "spans.jsonl").read_text().splitlines()]
    if how == "caught":
        assert (state["ended"], state["step"]) == ("completed", 5)
        assert report["totals"]["failed_steps"] == 1  # (the step the exit left)
        return
    assert state["step"] == 3 and spans[-1]["attributes"]["torchtrace.step"] == 3
    if failed:
        detail = "SystemExit: 1" if how == "1" else "SystemExit"  # (a message only with record_exception_messages)
        assert (state["ended"], state["end_detail"], state["end_step"]) == ("exception", detail, 3)
        assert spans[-1]["status"] == "ERROR" and report["totals"]["failed_steps"] == 1
        (attempt,) = report["job"]["attempts"]
        assert (attempt["ended"], attempt["detail"]) == ("exception", detail)
    else:
        assert state["ended"] == "completed"
        assert spans[-1]["status"] != "ERROR" and report["totals"]["failed_steps"] == 0


_CRASHES = textwrap.dedent("""
    import ctypes, os, sys, time, torch, torchtrace as tt
    tt.configure(prometheus_port="off")

    def train_step(step):
        with tt.debug_context("train_step", step=step):
            torch.ones(3).sum()
            if step == 3:
                time.sleep(1.0)  # (the black box's writer says step 3 is running)
                crash()

    def crash():
        if sys.argv[1] == "segfault":
            ctypes.string_at(0)  # (a C extension reading a null pointer)
        os.abort()  # (a C++ check that failed: gloo's EnforceNotMet, a CUDA assert)

    for step in range(5):
        train_step(step)
""")


@pytest.mark.parametrize("how, told", [("segfault", "Segmentation fault"), ("abort", "Aborted")])
def test_a_process_that_crashed_is_told_apart_from_one_killed(tmp_path, how, told):
    """A segmentation fault in a C extension, or an abort (a failed C++ check: gloo's
    collective mismatch, a CUDA device assert), ends the process without any Python code running:
    its black box said nothing and ``torchtrace why`` read it as ``killed`` ("SIGKILL, a crash
    of the interpreter, or os._exit"), with no stack. Now faulthandler writes the crash into the
    rank's stack file, and ``why`` names the fatal error and shows where the training thread was."""
    from torchtrace.cli.why import render, why

    env = clean_env(TORCHTRACE_RUN_ID="crash", TORCHTRACE_RUN_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _CRASHES, how], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode < 0, done.stderr  # (ended by the signal)
    report = why(tmp_path / "crash")
    (rank,), (attempt,) = report["ranks"], report["job"]["attempts"]
    assert (attempt["ended"], attempt["detail"]) == ("killed", f"crashed: Fatal Python error: {told}")
    assert (rank["condition"], rank["step"], rank["in_step"]) == ("gone", 3, True)
    assert report["verdict"] == "died" and report["culprit_ranks"] == [0]
    assert rank["stack_source"] == "crash"
    line = 14 if how == "segfault" else 15
    assert rank["stack"][:2] == [f"<string>:{line} in crash", "<string>:10 in train_step"], rank["stack"]
    assert report["reason"] == f"rank 0 crashed (Fatal Python error: {told})"
    assert f"ended killed (crashed: Fatal Python error: {told})" in render(report)


def test_a_run_that_did_not_crash_leaves_no_stack_file(tmp_path):
    env = clean_env(TORCHTRACE_RUN_ID="fine", TORCHTRACE_RUN_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _CRASHES.replace("step == 3", "step == 99"), "segfault"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "fine").glob("stacks*")) == []
    assert read_states(tmp_path / "fine")[0]["ended"] == "completed"


def test_configure_off_the_main_thread_says_it_cannot_handle_signals(tmp_path, caplog):
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.WARNING):
        thread = threading.Thread(target=tt.configure, kwargs=dict(prometheus_port="off", run_dir=str(tmp_path),
                                                                   register_atexit=False))
        thread.start()
        thread.join()
    try:
        assert any("outside the main thread" in r.getMessage() for r in caplog.records)
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        tt.shutdown()


def test_a_handler_set_after_install_is_chained_and_given_back():
    calls = []
    guard = SignalGuard(lambda signum, terminal: calls.append(("torchtrace", terminal)))
    previous = signal.getsignal(signal.SIGTERM)
    assert "SIGTERM" in guard.install()
    try:
        def app(signum, frame):
            calls.append(("app", signum))

        assert signal.signal(signal.SIGTERM, app) is previous
        assert signal.getsignal(signal.SIGTERM) is app
        signal.raise_signal(signal.SIGTERM)
        assert calls == [("torchtrace", False), ("app", signal.SIGTERM)]
    finally:
        guard.restore()
    assert signal.signal is not guard._signal and signal.getsignal(signal.SIGTERM) is app
    signal.signal(signal.SIGTERM, previous)


def test_an_ignored_signal_stays_ignored():
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        guard = SignalGuard(lambda signum, terminal: None)
        assert "SIGTERM" not in guard.install()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        guard.restore()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _box(attempt, **fields):
    base = {"job_id": "j", "attempt": attempt, "rank": 0, "world_size": 1, "pid": 1, "host": "elsewhere"}
    return {**base, **fields}


def test_job_story_by_hand():
    """Three attempts with round numbers: each quantity is checked against the sum by hand."""
    states = [
        # Attempt 0: process start 0, configure 2, checkpoint at 40 s (productive 30), last step
        # at 55 s (productive 42), SIGKILLed: last heartbeat at 56, writer period 1 s.
        _box(0, process_started=0.0, started=2.0, step=95, step_time=55.0, time=56.0, period_s=1.0,
             checkpoint_step=80, checkpoint_time=40.0, checkpoint_productive_s=30.0, productive_s=42.0,
             badput_s={"startup": 1.0, "checkpoint": 2.0}, first_step_seconds=3.0, step_seconds=0.5,
             ended=None),
        # Attempt 1: process start 60, configure 61.5, preempted at 90 after its checkpoint at 85.
        _box(1, process_started=60.0, started=61.5, step=130, step_time=89.0, checkpoint_step=120,
             checkpoint_time=85.0, checkpoint_productive_s=18.0, productive_s=21.0,
             badput_s={"checkpoint": 1.0}, ended="preempted", end_detail="SIGTERM", end_time=90.0),
        # Attempt 2: configure 95, completes at 130 with 30 s productive.
        _box(2, process_started=94.0, started=95.0, step=200, step_time=129.0, productive_s=30.0,
             badput_s={"checkpoint": 0.5}, ended="completed", end_time=130.0),
    ]
    story = story_of(states)
    assert [(a["ended"], a["last_step"]) for a in story["attempts"]] == [
        ("killed", 95), ("preempted", 130), ("completed", 200)]
    bad = story["badput"]
    assert bad["restart"] == pytest.approx((61.5 - 56.5) + (95.0 - 90.0))
    assert bad["lost_progress"] == pytest.approx((55.0 - 40.0) + (89.0 - 85.0))
    assert bad["compile"] == pytest.approx(2.5)
    assert bad["checkpoint"] == pytest.approx(3.5)
    assert bad["startup"] == pytest.approx(1.0 + 2.0)  # attempt 0's own, plus its process start to configure
    productive = (42.0 - 12.0 - 2.5) + (21.0 - 3.0) + 30.0
    assert story["productive_s"] == pytest.approx(productive)
    assert story["wall_s"] == pytest.approx(130.0)
    assert story["goodput"] == pytest.approx(productive / 130.0)
    assert [a["lost_steps"] for a in story["attempts"]] == [15, 10, 0]


def test_a_forked_child_only_chains_the_signal(tmp_path):
    import os

    marker = tmp_path / "worked"
    guard = SignalGuard(lambda signum, terminal: marker.write_text(str(os.getpid())))
    guard.install()
    try:
        pid = os.fork()
        if pid == 0:  # the child: its SIGTERM ends it by the default action, with no torchtrace work
            try:
                signal.raise_signal(signal.SIGTERM)
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
    finally:
        guard.restore()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert not marker.exists()  # the parent's flush and report were not run in the child


_SAVE_AND_EXIT = textwrap.dedent("""
    import os, signal, sys, torch, torchtrace as tt
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # the "save and exit" handler
    tt.configure(prometheus_port="off")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        with tt.debug_context("train_step", model=model, optimizer=opt):
            if step == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # the preemption, before the step's work
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
""")


def test_a_sigterm_whose_handler_exits_in_a_step_interrupts_that_step(tmp_path):
    """A SIGTERM in the middle of step 5, and the application's handler calls ``sys.exit(0)``
    there: the attempt was preempted and lost step 5, as with SIGTERM's default action. Before,
    the handler's clean exit made step 5 a finished, productive step (``interrupted_step``
    none, 6 steps)."""
    env = clean_env(TORCHTRACE_RUN_ID="term", TORCHTRACE_RUN_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _SAVE_AND_EXIT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    (state,) = read_states(tmp_path / "term")
    assert (state["ended"], state["end_detail"]) == ("preempted", "SIGTERM")
    assert (state["step"], state.get("interrupted_step")) == (4, 5)
    report = json.loads((tmp_path / "term" / "report.json").read_text())
    assert report["totals"]["steps"] == 5 and report["totals"]["failed_steps"] == 0


def test_the_time_after_the_last_step_is_other_in_the_job_as_in_the_run(tmp_path):
    """0.6 s of work after the last step (a final export, an upload) before ``shutdown()``: the
    run's goodput books it as ``other`` (docs/throughput.md). The job's, read from the black box,
    booked it as ``data_wait`` (0.6 s, as if the input pipeline had stalled): the box was
    written for the last time before the run's ledger closed the tail. Both agree now."""
    import time

    import torch

    tt.configure(prometheus_port="off", run_dir=str(tmp_path), run_id="tail", register_atexit=False)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(10):
        with tt.debug_context("train_step", model=model, optimizer=opt):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    time.sleep(0.6)
    tt.shutdown()
    report = json.loads((tmp_path / "tail" / "report.json").read_text())
    run, job = report["throughput"]["badput_s"], report["job"]["badput"]
    assert run["other"] >= 0.6 and run["data_wait"] < 0.3, run
    assert job["other"] == pytest.approx(run["other"], abs=0.05) and job["data_wait"] < 0.3, job
