"""A step the end of its process interrupts: its work is lost, not data wait.

A SIGKILL (the OOM killer, a node lost) or a SIGTERM (a preemption) that comes while a step
runs throws that step's work away: the next attempt repeats it from the last checkpoint. Real
processes; the references are the trainer's own timestamps (tests/job/trainer.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.job.helpers import clean_env, events, start, wait_ready
from torchtrace.cli.why import render, why
from torchtrace.job.story import job_story

HOLD_S = 1.5  # how long the held step runs before the signal: three black-box writes


@pytest.mark.parametrize("signum, ended", [(signal.SIGKILL, "killed"), (signal.SIGTERM, "preempted"),
                                           (signal.SIGINT, "preempted")])
def test_a_step_the_signal_interrupts_is_lost_progress_not_data_wait(tmp_path, signum, ended):
    run_dir, ckpt, log = tmp_path / "runs", tmp_path / "ckpt", tmp_path / "log.jsonl"
    ckpt.mkdir()
    env = clean_env(TORCHTRACE_JOB_ID="held", TORCHTRACE_RUN_DIR=str(run_dir))
    base = {"log": str(log), "ckpt_dir": str(ckpt), "step_s": 0.05, "blob_mb": 1}
    # Attempt 0 saves after step 3 and is stopped inside step 6; attempt 1 resumes from 3.
    p = start({**base, "save_at": [3], "hold_in_step_at": 6, "last": 10}, env)
    assert wait_ready(p) == 6
    time.sleep(HOLD_S)
    killed_at = time.time()
    os.kill(p.pid, signum)
    p.wait(30)
    p = start({**base, "resume": 3, "last": 8}, env)
    assert p.wait(120) == 0, p.stderr.read()[-3000:]

    evs = events(log)
    saved = next(e["t"] for e in evs if e["ev"] == "save")
    held = next(e for e in evs if e["ev"] == "held")
    story = job_story(run_dir / "held")
    first, second = story["attempts"]
    assert (first["ended"], first["last_step"], second["ended"]) == (ended, 5, "completed")
    # Lost: from the save to the signal, the interrupted step 6 included (1.5 s of it), which
    # the next attempt repeats. Before, it stopped at step 5's end, and step 6 was data wait.
    # (A SIGKILLed process's end is estimated, to about 0.25 s: docs/jobs.md.)
    reference = killed_at - saved
    assert first["lost_progress_s"] == pytest.approx(reference, abs=0.3)
    assert story["badput"]["lost_progress"] == pytest.approx(reference, abs=0.3)
    # The trainer waits for no data: what torchtrace books as data wait is its own steps' gaps.
    assert story["badput"]["data_wait"] < 0.2
    assert killed_at - held["start"] > HOLD_S
    # The attempt's line names the step it lost in the middle, and where the next one resumed.
    assert (first["interrupted_step"], second["interrupted_step"]) == (6, None)
    line = render(why(run_dir)).splitlines()[-2]
    assert line.startswith(f"attempt 0: ended {ended}") and line.endswith(
        ", last step 5, step 6 interrupted, last checkpoint at step 3"), line
