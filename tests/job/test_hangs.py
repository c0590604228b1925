"""Hangs in one process (docs/hangs.md, RELIABILITY promise 32): a real training script in a
subprocess gets stuck in its forward, its DataLoader, a GIL-holding regular expression or a
busy loop; the watchdog must flag it with the user's line, /metrics must keep answering
where the GIL allows, and SIGTERM and Ctrl-C must still end the process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from torchtrace.cli.why import render, why
from torchtrace.job import stacks

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("hang_worker.py")


def start(case: str, run_dir: Path, timeout: str | None = "3", **env: str) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_", "TORCH_FR"))}
    environ.update(PYTHONPATH=str(ROOT), HANG_CASE=case, HANG_RUN_DIR=str(run_dir), **env)
    if timeout is not None:
        environ["HANG_TIMEOUT"] = timeout
    return subprocess.Popen([sys.executable, str(WORKER)], env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(predicate, seconds: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the worker ended early: {proc.returncode}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"not seen within {seconds} s")


def read_line(proc: subprocess.Popen, prefix: str) -> str:
    for line in proc.stdout:
        if line.startswith(prefix):
            return line.split(" ", 1)[1].strip()
    raise AssertionError(f"no {prefix} line: {proc.stderr.read()[-3000:]}")


def hang_file(run_dir: Path):
    found = list(run_dir.glob("*/hang.json"))
    return json.loads(found[0].read_text()) if found else None


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("torchtrace_stalled_seconds", "torchtrace_hangs_total", "torchtrace_phase{")):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0] + (("[" + name.split('phase="')[1].split('"')[0] + "]") if "phase=" in name else "")
            out[key] = float(value)
    return out


def stop(proc: subprocess.Popen) -> None:
    """Kill the worker and its DataLoader workers (its session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate(timeout=30)


def user_frame(frames: list[dict], function: str) -> dict:
    first = frames[0]
    assert first["user"] and first["file"] == str(WORKER) and first["function"] == function, frames[:3]
    return first


def test_forward_sleeping_forever_is_flagged_within_60s_with_default_settings(tmp_path):
    proc = start("forward", tmp_path, timeout=None)
    try:
        url = read_line(proc, "METRICS")
        hanging = float(read_line(proc, "HANGING"))
        finding = wait_for(lambda: hang_file(tmp_path), 75, proc)
        # The adaptive timeout (steps of ~10 ms): the 30 s floor, flagged on the next tick.
        assert finding["timeout_s"] == 30.0
        assert finding["time"] - hanging < 60.0
        assert finding["phase"] == "forward" and finding["step"] == 5
        frame = user_frame(finding["stack"], "forward")
        assert "time.sleep" in WORKER.read_text().splitlines()[frame["line"] - 1]
        metrics = scrape(url)  # /metrics still answers
        assert metrics["torchtrace_hangs_total"] == 1.0
        assert metrics["torchtrace_stalled_seconds"] > 30.0
        assert metrics["torchtrace_phase[forward]"] == 1.0
        report = why(tmp_path)
        assert report["verdict"] == "hang" and report["culprit_ranks"] == [0]
        assert report["ranks"][0]["phase"] == "forward" and "in forward" in report["ranks"][0]["where"]
    finally:
        stop(proc)


def test_dataloader_worker_that_never_returns_is_flagged_in_data_wait(tmp_path):
    proc = start("loader", tmp_path)
    try:
        url = read_line(proc, "METRICS")
        finding = wait_for(lambda: hang_file(tmp_path), 60, proc)
        assert finding["phase"] == "data_wait" and finding["last_step"] == 4
        assert finding["stalled_s"] < 3.0 + 3.0
        frame = user_frame(finding["stack"], "train")
        assert "enumerate(loader)" in WORKER.read_text().splitlines()[frame["line"] - 1]
        assert scrape(url)["torchtrace_phase[data_wait]"] == 1.0
        debug = json.loads(urllib.request.urlopen(url.replace("/metrics", "/debug/hang"), timeout=5).read())
        assert debug["hangs"] == 1 and debug["finding"]["phase"] == "data_wait"
        assert debug["stalled_s"] > debug["timeout_s"] == 3.0
        summary = json.loads(urllib.request.urlopen(url.replace("/metrics", "/debug/summary"), timeout=5).read())
        assert summary["hangs"]["last"]["phase"] == "data_wait"
        # The line that hangs is in the DataLoader's worker process: its stack, asked for.
        [worker] = finding["workers"]
        assert _parent_of(worker["pid"]) == proc.pid
        frame = user_frame(worker["stack"], "__getitem__")
        assert "time.sleep" in WORKER.read_text().splitlines()[frame["line"] - 1]
        assert worker["where"] == frame
        assert f"worker process {worker['pid']}" in next(tmp_path.glob("*/stacks.txt")).read_text()
        report = why(tmp_path)
        assert report["ranks"][0]["workers"] == [{"pid": worker["pid"], "where": stacks.where(frame)}]
        assert f"DataLoader worker {worker['pid']}: {stacks.where(frame)}" in render(report)
    finally:
        stop(proc)


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_python_busy_loop_is_flagged(tmp_path):
    proc = start("busy", tmp_path)
    try:
        url = read_line(proc, "METRICS")
        finding = wait_for(lambda: hang_file(tmp_path), 60, proc)
        assert finding["phase"] == "forward" and finding["source"] == "watchdog"
        frame = user_frame(finding["stack"], "forward")
        assert "n += 1" in WORKER.read_text().splitlines()[frame["line"] - 1] or "while True" in \
            WORKER.read_text().splitlines()[frame["line"] - 1]
        assert scrape(url)["torchtrace_hangs_total"] == 1.0
    finally:
        stop(proc)


def test_gil_holding_hang_leaves_every_threads_stack_in_the_run_directory(tmp_path):
    # In the first step, well within a second of configure(): before the watchdog's first tick
    # (faulthandler was armed only by ticks, so a hang this early left no dump; a fast run of
    # this test at step 5 once met it too).
    proc = start("regex", tmp_path, HANG_AT="0")
    try:
        read_line(proc, "METRICS")
        hanging = float(read_line(proc, "HANGING"))
        # No Python thread runs: faulthandler's C thread dumps the stacks a little after the timeout.
        # It writes them thread by thread, the training thread last: wait for the whole dump.
        dump = wait_for(lambda: [p for p in tmp_path.glob("*/stacks.txt")
                                 if "Timeout (" in (t := p.read_text()) and f'File "{WORKER}", line' in t], 60, proc)
        assert time.time() - hanging < 3.0 + 3.0 + 5.0
        text = dump[0].read_text()
        assert f'File "{WORKER}", line' in text and "in forward" in text
        assert text.count("Thread 0x") >= 3  # the training thread, the black box writer, the watchdog...
        # The heartbeat stopped with the GIL held, the process lives: why calls it a hang.
        report = wait_for(lambda: (r := why(tmp_path))["verdict"] == "hang" and r, 30, proc)
        rank = report["ranks"][0]
        assert rank["condition"] == "silent" and report["culprit_ranks"] == [0]
        assert rank["stack_source"] == "faulthandler" and "in forward" in rank["where"]
    finally:
        stop(proc)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_still_end_a_hung_process(tmp_path, sig):
    proc = start("forward", tmp_path, timeout="2")
    try:
        read_line(proc, "METRICS")
        wait_for(lambda: hang_file(tmp_path), 60, proc)
        proc.send_signal(sig)
        proc.wait(timeout=30)  # (it ends in 1-2 s; 10 s was once not enough beside three test workers)
        assert proc.returncode != 0
    finally:
        stop(proc)


@pytest.mark.parametrize("case", ["slow_first", "checkpoint", "evaluation", "unmarked_evaluation"])
def test_no_false_alarm(tmp_path, case):
    # A 2 s timeout: the first steps and marked checkpoint/evaluation steps keep their allowance;
    # an evaluation loop the script does not mark (4 s of calls of the model) makes progress.
    proc = start(case, tmp_path, timeout="2", HANG_STEPS="8")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "DONE" in out
    assert not list(tmp_path.glob("*/hang.json")), err[-2000:]
    assert why(tmp_path)["verdict"] == "completed"


def test_an_unmarked_evaluation_whose_forward_never_returns_is_still_a_hang(tmp_path):
    """The calls of the model between steps are progress, not an allowance: a forward of an
    unmarked evaluation loop that never returns is flagged after the timeout, between steps,
    at the model's frame."""
    proc = start("stuck_evaluation", tmp_path, timeout="2")
    try:
        stuck_at = float(read_line(proc, "HANGING"))
        finding = wait_for(lambda: hang_file(tmp_path), 30, proc)
        assert finding["step"] is None and finding["last_step"] == 3, finding
        assert 2.0 <= finding["time"] - stuck_at < 10.0, finding
        user_frame(finding["stack"], "forward")
    finally:
        stop(proc)


def test_no_false_alarm_on_steps_of_three_seconds_with_the_adaptive_timeout(tmp_path):
    proc = start("slow_steps", tmp_path, timeout=None, HANG_STEPS="4")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert not list(tmp_path.glob("*/hang.json"))
    state = json.loads(next(tmp_path.glob("*/state.json")).read_text())
    # The adaptive timeout learnt from 3 s steps: ten times the period, above the floor.
    assert state["hang_timeout_s"] >= 30.0 and state["ended"] == "completed"


def test_on_hang_abort_writes_everything_and_exits_non_zero(tmp_path):
    proc = start("forward", tmp_path, timeout="2", TORCHTRACE_ON_HANG="abort")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 124, err[-3000:]
    state = json.loads(next(tmp_path.glob("*/state.json")).read_text())
    assert state["ended"] == "hang" and state["hangs"] == 1
    assert not list(tmp_path.glob("*/workers.*"))  # no worker was asked: no file left
    report = json.loads(next(tmp_path.glob("*/report.json")).read_text())
    assert report["hangs"]["hangs"] == 1 and report["hangs"]["last"]["phase"] == "forward"
    spans = [json.loads(line) for line in next(tmp_path.glob("*/spans.jsonl")).read_text().splitlines()]
    hang_spans = [s for s in spans if s["name"] == "torchtrace.hang"]
    assert len(hang_spans) == 1 and hang_spans[0]["attributes"]["torchtrace.hang.phase"] == "forward"
    assert len([s for s in spans if s["name"] == "train_step"]) == 5  # the steps before it, all written
    verdict = why(tmp_path)
    assert verdict["verdict"] == "hang" and verdict["job"]["attempts"][0]["ended"] == "hang"
    # The job's time is counted once: the stretch from the last step to the abort is the hang's,
    # not also the "other" the run's end booked it as.
    job = verdict["job"]
    booked = job["productive_s"] + sum(job["badput"].values())
    assert job["badput"]["hang"] >= 2.0 and booked == pytest.approx(job["wall_s"], abs=0.6), job


def test_on_hang_abort_ends_the_dataloader_worker_that_hung(tmp_path):
    """``os._exit`` skips the interpreter's exit, which ends a process's daemonic children: a
    DataLoader worker stuck in ``__getitem__`` lived on after the abort, an orphan that each
    restart of the job added to. The abort ends them as that exit would have."""
    proc = start("loader", tmp_path, timeout="2", TORCHTRACE_ON_HANG="abort")
    try:
        assert proc.wait(120) == 124  # (not communicate: an orphan worker would hold its pipes open)
        [worker] = hang_file(tmp_path)["workers"]
        wait_for(lambda: not Path(f"/proc/{worker['pid']}").exists() or _state_of(worker["pid"]) == "Z", 10)
    finally:
        stop(proc)


def _state_of(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
