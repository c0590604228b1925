"""Ranks that a configured process starts itself (Lightning's launcher for ``devices=N``: the
user's script, configured at its top, is rank 0 and starts the other ranks with its
environment, which names no global rank) share its run: one run directory, with each rank's
black box under its own rank's name. Processes it starts that are not such ranks, and ranks
started by anyone else, keep runs of their own.

The full Lightning job is ``tests/integrations/test_lightning_ddp.py``; here a parent process
starts children the way that launcher does (``subprocess.Popen`` with a copy of its environment
plus LOCAL_RANK, NODE_RANK, WORLD_SIZE)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.job.helpers import RANK_SCRIPT, clean_env
from torchtrace.distributed import identity
from torchtrace.job.identity import LAUNCHER_RUN, launched_rank_run_id

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, sys, torchtrace as tt
from torchtrace.distributed.identity import identity
from torchtrace.job.identity import offer_run_id_ahead
if os.environ.get("OFFER_AHEAD"):  # a rank that builds its Lightning callback before it is configured
    offer_run_id_ahead(identity().rank, identity().distributed)
result = tt.configure(prometheus_port="off", run_dir=sys.argv[1], register_atexit=False)
rt = tt.api.get_runtime()
first = {"run_id": rt.settings.run_id, "rank": rt.identity.rank, "spans": str(result.spans_path)}
tt.configure(prometheus_port="off", run_dir=sys.argv[1], register_atexit=False)  # configured again
first["again"] = tt.api.get_runtime().settings.run_id
tt.shutdown()
print(json.dumps(first))
"""

PARENT = r"""
import json, os, subprocess, sys, torchtrace as tt
run_dir, child = sys.argv[1], sys.argv[2]
def start(extra, via_shell=False):
    env = dict(os.environ, **extra)
    command = [sys.executable, "-c", child, run_dir]
    if via_shell:  # a grandchild: the shell is its parent (it waits on it: "; true")
        command = ["/bin/sh", "-c", '"$0" -c "$1" "$2"; true', *command[:1], child, run_dir]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])
tt.configure(prometheus_port="off", run_dir=run_dir, register_atexit=False)
own = tt.api.get_runtime().settings.run_id
launched = {"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
found = {
    "rank1": start(launched),
    "rank0": start(dict(launched, LOCAL_RANK="0")),
    "not_a_rank": start({}),
    "named": start(dict(launched, TORCHTRACE_RUN_ID="named-run")),
    "grandchild": start(launched, via_shell=True),
}
tt.shutdown()
found["after_shutdown"] = start(launched)
print(json.dumps({"own": own, "found": found, "left": os.environ.get("TORCHTRACE_LAUNCHER_RUN")}))
"""


def _launch(script: str, run_dir: Path) -> dict:
    """Run ``script`` (a launching process, given ``run_dir`` and :data:`CHILD`) in an environment
    that names no rank, run id or launcher; its last line of output, read as JSON."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHTRACE_", "OTEL_", "TORCHELASTIC_")) and k not in ("RANK", "LOCAL_RANK",
                                                                                      "WORLD_SIZE", "NODE_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", script, str(run_dir), CHILD], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_ranks_a_configured_process_starts_share_its_run(tmp_path):
    out = _launch(PARENT, tmp_path)
    own, found = out["own"], out["found"]
    rank1 = found["rank1"]
    assert rank1["run_id"] == rank1["again"] == own and rank1["rank"] == 1
    assert Path(rank1["spans"]) == tmp_path / own / "spans.rank1.jsonl"  # beside rank 0's files, its own names
    assert found["rank0"]["run_id"] != own  # rank 0 may be a new job's first process
    assert found["not_a_rank"]["run_id"] != own  # a process of its own
    assert found["named"]["run_id"] == "named-run"  # a run id named wins
    assert found["grandchild"]["run_id"] != own and found["grandchild"]["rank"] == 1  # started by a shell
    assert found["after_shutdown"]["run_id"] != own  # the offer ends with the run
    assert out["left"] is None


AHEAD = r"""
import json, os, subprocess, sys, torchtrace as tt
from torchtrace.distributed.identity import identity
from torchtrace.job.identity import offer_run_id_ahead
run_dir, child = sys.argv[1], sys.argv[2]
offer_run_id_ahead(identity().rank, identity().distributed)  # TorchtraceCallback() before the launcher runs
offered = os.environ["TORCHTRACE_LAUNCHER_RUN"]
offer_run_id_ahead(identity().rank, identity().distributed)  # a second callback
second = os.environ["TORCHTRACE_LAUNCHER_RUN"]
launched = {"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "OFFER_AHEAD": "1"}
env = dict(os.environ, **launched)
rank1 = json.loads(subprocess.run([sys.executable, "-c", child, run_dir], env=env, capture_output=True, text=True,
                                  check=True).stdout.strip().splitlines()[-1])
os.environ.update(TORCHTRACE_RUN_DIR=run_dir, TORCHTRACE_PROMETHEUS_PORT="off")
with tt.debug_context("train_step"):  # the first step sets torchtrace up from the environment
    pass
first = tt.api.get_runtime().settings.run_id
tt.configure(prometheus_port="off", run_dir=run_dir, register_atexit=False)  # configured again: a run of its own
again = tt.api.get_runtime().settings.run_id
tt.shutdown()
print(json.dumps({"offered": offered, "second": second, "rank1": rank1, "first": first, "again": again}))
"""


def test_a_run_id_offered_before_configure_is_the_run_of_the_process_and_the_ranks_it_starts(tmp_path):
    """A Lightning callback is built before Lightning's launcher starts the other ranks, and
    torchtrace sets itself up at the first step, after that: the id offered when the callback
    was built is the run of the first process and of the rank it starts; a rank that builds its
    own callback keeps its parent's offer."""
    out = _launch(AHEAD, tmp_path)
    assert out["second"] == out["offered"]  # one offer a process
    offered_id = out["offered"].partition(" ")[2]
    assert out["first"] == offered_id and out["rank1"]["run_id"] == offered_id and out["rank1"]["rank"] == 1
    assert out["rank1"]["again"] == offered_id
    assert out["again"] != offered_id  # the offer was spent by the first configuration
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({offered_id, out["again"]})


def test_a_launcher_that_names_no_global_rank_gives_the_first_nodes_processes_their_local_rank():
    assert identity({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}).rank == 1
    assert identity({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}).rank == 1
    assert identity({"LOCAL_RANK": "1", "NODE_RANK": "1", "WORLD_SIZE": "4"}).rank == 0  # unknown until the group
    assert identity({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}).rank == 3  # torchrun's
    assert identity({"LOCAL_RANK": "2"}).rank == 0  # a world of one


def _offer_from_the_parent() -> str | None:
    """In a child: the run id a rank 1 would take from an offer its parent made."""
    return launched_rank_run_id(1, True, {LAUNCHER_RUN: f"{os.getppid()} parent-run"})


def test_ranks_multiprocessing_starts_keep_the_run_id_they_share():
    """A ``multiprocessing`` rank does not take its parent's offer: it shares the run id of its
    launch (``spawned_run_id``), which rank 0 computes alike, where the offer would reach only
    the ranks other than 0."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_offer_from_the_parent) is None
    assert launched_rank_run_id(1, True, {LAUNCHER_RUN: f"{os.getppid()} parent-run"}) == "parent-run"


def test_a_settings_offer_holds_the_arguments_json_can_hold_and_no_secret(monkeypatch):
    from torchtrace.job.identity import PARENT_SETTINGS, offer_settings, settings_offer, take_back_settings
    from torchtrace.levels import DebugLevel

    monkeypatch.delenv(PARENT_SETTINGS, raising=False)
    offer_settings({"level": DebugLevel.ADVANCED, "run_dir": Path("/runs"), "guard": "skip", "service_name": None,
                    "resource_attributes": {"team": "nlp", "when": object()}, "otlp_headers": {"auth": "secret"},
                    "debug_token": "token", "run_id": "mine", "job_id": "job"}, "run-1", "job-1")
    offer = settings_offer(os.getpid())
    assert offer is not None and (offer.run_id, offer.job_id) == ("run-1", "job-1")
    assert offer.args == {"level": "advanced", "run_dir": "/runs", "guard": "skip"}
    assert settings_offer(os.getpid() + 1) is None  # another process's offer
    take_back_settings()
    assert PARENT_SETTINGS not in os.environ


def test_the_agent_run_id_is_for_torchrun_ranks_whose_rendezvous_names_none():
    from torchtrace.job.identity import agent_run_id

    assert agent_run_id({}) is None  # not torchrun
    assert agent_run_id({"TORCHELASTIC_RUN_ID": "job-42"}) is None  # the rendezvous names the run
    first = agent_run_id({"TORCHELASTIC_RUN_ID": "none"})
    assert first is not None and first == agent_run_id({"TORCHELASTIC_RUN_ID": "none"})  # alike for every rank
    stamp, _, digest = first.rpartition("-")
    assert len(digest) == 6 and time.strptime(stamp, "%Y%m%d-%H%M%S")


def test_the_ranks_srun_starts_share_the_job_steps_run(tmp_path):
    """``srun --ntasks=2 python train.py``: Slurm starts each rank itself, no torchrun. Each rank
    took a run id of its own before, so their black boxes lay apart, where neither the watchdog
    nor ``torchtrace why`` saw the other rank. Now the ranks of a job step share
    ``slurm-<job>.<step>``."""
    import socket

    from torchtrace.cli.why import why

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = clean_env(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID=str(rank),
                        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["slurm-4242.0"]
    report = why(tmp_path / "slurm-4242.0")
    assert report["verdict"] == "completed" and sorted(r["rank"] for r in report["ranks"]) == [0, 1]
    assert report["job"]["job_id"] == "4242"


def test_a_slurm_step_of_one_task_or_of_independent_processes_keeps_run_ids_of_their_own():
    from torchtrace.job.identity import slurm_step_run_id

    step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3", "SLURM_NTASKS": "4"}
    assert slurm_step_run_id(True, step) == "slurm-4242.3"
    assert slurm_step_run_id(False, step) is None  # four independent trials
    assert slurm_step_run_id(True, dict(step, SLURM_NTASKS="1")) is None
    assert slurm_step_run_id(True, {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4"}) is None  # salloc, outside srun
    assert slurm_step_run_id(True, {}) is None


def test_a_rank_that_takes_a_shared_run_id_warns_of_a_bad_variable_once(monkeypatch, caplog):
    """A rank whose run id is the one its launcher's ranks share resolves its settings twice
    (the second time with that id); each bad variable was named twice in its log."""
    import logging

    from torchtrace import api

    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_", "SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(name, raising=False)
    for name, value in {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
                        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCHTRACE_GUARD": "skipp",
                        "TORCHTRACE_GAURD": "skip"}.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING):
        settings = api._settings({})
    assert settings.run_id == "slurm-4242.0"
    assert sorted(r.getMessage().split(":")[0] for r in caplog.records) == [
        "ignoring TORCHTRACE_GAURD", "ignoring TORCHTRACE_GUARD"]
