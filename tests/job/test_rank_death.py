"""torchrun, 2 ranks, rank 1 SIGKILLed after step 30: the job view names rank 1 as the rank
that died, at step 30, and shows rank 0's end as the consequence."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.job.helpers import clean_env, events, start
from torchtrace.job.state import read_states
from torchtrace.job.story import job_story

TORCHRUN = Path(sys.executable).with_name("torchrun")


def test_the_rank_that_died_first_is_named(tmp_path):
    if not TORCHRUN.exists():
        pytest.skip("torchrun is not installed beside this Python")
    run_dir, log = tmp_path / "runs", tmp_path / "log.jsonl"
    (tmp_path / "ckpt").mkdir()
    env = clean_env(TORCHTRACE_RUN_ID="two", TORCHTRACE_RUN_DIR=str(run_dir))
    cmd = [str(TORCHRUN), "--nproc-per-node=2", "--max-restarts=0", "--monitor-interval=0.2"]
    p = start({"log": str(log), "ckpt_dir": str(tmp_path / "ckpt"), "step_s": 0.01, "last": 200, "dist": True,
               "kill_at": 30, "kill_rank": 1}, env, cmd)
    out, err = p.communicate(timeout=300)
    assert p.returncode != 0
    assert [e["step"] for e in events(log) if e["ev"] == "self_kill"] == [30]
    story = job_story(run_dir / "two")
    (attempt,) = story["attempts"]
    assert attempt["cause"]["rank"] == 1 and attempt["cause"]["ended"] == "killed"
    assert attempt["cause"]["last_step"] == 30
    # The attempt's own last step is rank 0's, as its other numbers are: the step it waited in
    # for rank 1 (which raised when rank 1 died, or was stopped), or the one before.
    (box0,) = [s for s in read_states(run_dir / "two") if s["rank"] == 0]
    assert (attempt["ended"], attempt["last_step"]) == ("killed", box0["step"]) and box0["step"] in (30, 31)
    ranks = {r["rank"]: r for r in attempt["ranks"]}
    assert ranks[1]["last_step"] == 30 and ranks[1]["consequence"] is False
    assert ranks[0]["ended"] in ("preempted", "exception") and ranks[0]["consequence"] is True
    # A SIGKILLed rank's end is estimated (half a writer period after its last heartbeat); what
    # is known is that rank 0 ended after rank 1 was last seen alive.
    (box1,) = [s for s in read_states(run_dir / "two") if s["rank"] == 1]
    assert ranks[0]["end"] > max(box1["time"], box1["step_time"])
