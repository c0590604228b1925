"""A job of three attempts under one TORCHTRACE_JOB_ID: killed, preempted, completed.

Real processes, real SIGKILL and SIGTERM, real torch.save/torch.load. The references are the
trainer's own timestamps (tests/job/trainer.py writes them), not torchtrace's.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.job.helpers import clean_env, events, start, wait_ready
from torchtrace.job.story import job_story

# The module's fixture does its costly work once per process: its tests share one xdist worker
# (its scope is the session: xdist may hand a worker the group's tests with other tests between them).
pytestmark = pytest.mark.xdist_group("restarts")


def _run_attempts(tmp_path):
    run_dir, ckpt, log = tmp_path / "runs", tmp_path / "ckpt", tmp_path / "log.jsonl"
    ckpt.mkdir()
    env = clean_env(TORCHTRACE_JOB_ID="job48", TORCHTRACE_RUN_DIR=str(run_dir))
    base = {"log": str(log), "ckpt_dir": str(ckpt), "step_s": 0.03, "last": 200, "blob_mb": 16}
    marks = {"t0": time.time()}
    # Attempt 0: checkpoints at 40 and 80, SIGKILLed after step 95.
    p = start({**base, "save_at": [40, 80], "stop_at": 95}, env)
    assert wait_ready(p) == 95
    time.sleep(1.2)  # (over two black-box periods: the box has step 95; the death is at a moment of its own)
    marks["kill"] = time.time()
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL
    # Attempt 1: resumes from 80, checkpoints at 120, SIGTERM after step 130.
    p = start({**base, "resume": 80, "save_at": [120], "stop_at": 130}, env)
    assert wait_ready(p) == 130
    time.sleep(0.3)
    marks["term"] = time.time()
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(30) == -signal.SIGTERM
    marks["term_exit"] = time.time()
    # Attempt 2: resumes from 120 and completes step 200.
    p = start({**base, "resume": 120}, env)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    marks["end"] = time.time()
    return run_dir / "job48", events(log), marks


@pytest.fixture(scope="session")  # once a worker: a module fixture ran again when xdist ran tests between
def job(tmp_path_factory):
    return _run_attempts(tmp_path_factory.mktemp("job"))


def _by_pid(evs):
    pids = []
    for e in evs:
        if e["pid"] not in pids:
            pids.append(e["pid"])
    return [[e for e in evs if e["pid"] == pid] for pid in pids]


def _reference(evs, marks):
    """The hand-computed timeline from the trainer's own timestamps."""
    a0, a1, a2 = _by_pid(evs)

    def step_end(att, n):
        return next(e["end"] for e in att if e["ev"] == "step" and e["step"] == n)

    def save_end(att, n):
        return next(e["t"] for e in att if e["ev"] == "save" and e["step"] == n)

    def configured(att):
        return next(e["t"] for e in att if e["ev"] == "configured")

    lost = (step_end(a0, 95) - save_end(a0, 80)) + (step_end(a1, 130) - save_end(a1, 120))
    restart = (configured(a1) - marks["kill"]) + (configured(a2) - marks["term"])
    checkpoint = sum(e["s"] for e in evs if e["ev"] in ("save", "load"))
    kept = [e for e in a0 if e["ev"] == "step" and e["step"] <= 80] + \
        [e for e in a1 if e["ev"] == "step" and e["step"] <= 120] + [e for e in a2 if e["ev"] == "step"]
    assert sorted(e["step"] for e in kept) == list(range(201))
    productive = sum(e["end"] - e["start"] for e in kept)
    wall = marks["end"] - marks["t0"]
    return {"lost": lost, "restart": restart, "checkpoint": checkpoint, "goodput": productive / wall}


def _check(story, ref):
    attempts = story["attempts"]
    assert [(a["attempt"], a["ended"], a["last_step"]) for a in attempts] == [
        (0, "killed", 95), (1, "preempted", 130), (2, "completed", 200)]
    assert attempts[1]["detail"] == "SIGTERM"
    assert [a["lost_steps"] for a in attempts] == [15, 10, 0]
    bad = story["badput"]
    assert bad["lost_progress"] == pytest.approx(ref["lost"], rel=0.25)
    assert bad["restart"] == pytest.approx(ref["restart"], rel=0.25)
    assert bad["checkpoint"] == pytest.approx(ref["checkpoint"], rel=0.30)
    assert story["goodput"] == pytest.approx(ref["goodput"], rel=0.10)


def test_job_story_tells_three_attempts_apart(job):
    root, evs, marks = job
    ref = _reference(evs, marks)
    story = job_story(root)
    assert story["job_id"] == "job48"
    _check(story, ref)


def test_the_last_report_carries_the_same_job_section(job):
    root, evs, marks = job
    report = json.loads((root / "attempt-2" / "report.json").read_text())
    assert report["job"]["attempt"] == 2
    _check(report["job"], _reference(evs, marks))


def test_each_attempt_has_files_of_its_own(job):
    root, evs, marks = job
    assert (root / "spans.jsonl").exists() and (root / "attempt-1" / "spans.jsonl").exists()
    steps = []
    for directory in (root, root / "attempt-1", root / "attempt-2"):
        lines = [json.loads(line) for line in (directory / "spans.jsonl").read_text().splitlines()]
        steps.append(sorted(s["attributes"]["torchtrace.step"] for s in lines))
    # Attempt 0's file holds what was exported before the SIGKILL (the exporter's last batch may
    # be lost); the SIGTERMed attempt 1 holds every step it finished.
    assert steps[0] == list(range(len(steps[0]))) and steps[0][-1] >= 80
    assert steps[1] == list(range(81, 131))
    assert steps[2] == list(range(121, 201))
    # A killed attempt writes no report; the others write their own.
    assert not (root / "report.json").exists()
    assert json.loads((root / "attempt-1" / "report.json").read_text())["totals"]["steps"] == 50
