"""A script that calls ``configure()`` at its top level (as examples/quickstart.py does) and
starts processes with spawn or forkserver: each such process runs the script's top level again
as it starts, that ``configure()`` with it.

- DataLoader workers never run a step: they set up no torchtrace of their own (no run
  directory, server, black box or threads), however many epochs start them again.
- ``torch.multiprocessing.spawn`` ranks that run steps have them traced with the settings the
  script gave, as the rank the process group says they are.

With no run id named, the ranks of one spawn share one run directory, so each rank's watchdog
and ``torchtrace why`` see every rank (a rank that never reaches the collective is named), and
a second spawn from the same parent is a run of its own, not a restart of the first.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtrace.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]

LOADER = r"""
import sys, torch, torchtrace as tt

run = tt.configure(service_name="spawned", prometheus_port=0, run_dir=sys.argv[1], guard="skip")
sys.stdout.write(f"configured {run.enabled}\n")  # (one write: the workers' lines never interleave)
sys.stdout.flush()


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((4,), float(i)), torch.ones(1)


if __name__ == "__main__":
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Data(), batch_size=4, num_workers=2, multiprocessing_context=sys.argv[2])
    for epoch in range(2):  # (each epoch starts its workers again)
        for x, y in loader:
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                step.record_loss(loss)
    tt.shutdown()
    print("done", flush=True)
"""

RANKS = r"""
import os, sys, torch, torch.distributed as dist, torchtrace as tt

SETTINGS = dict(service_name="spawned", prometheus_port="off", run_dir=sys.argv[1], guard="skip")
if sys.argv[4] != "-":
    SETTINGS["run_id"] = sys.argv[4]
if sys.argv[3] == "top":
    tt.configure(**SETTINGS)


def train(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if sys.argv[3] == "inside":  # the pattern of PyTorch's DDP tutorial: set up after the group
        tt.configure(**SETTINGS)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(4):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            opt.zero_grad()
            x = torch.ones(2, 4) * (float("nan") if (rank == 1 and i == 2) else 1.0)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            step.record_loss(loss)
    sys.stdout.write(f"rank {rank} finite {bool(torch.isfinite(model.weight).all())}\n")  # (one write: no interleaving)
    sys.stdout.flush()
    tt.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[3] == "main":  # set up here only: a spawned rank does not run this block
        tt.configure(**SETTINGS)
    else:
        tt.shutdown()  # this process trains nothing: its ranks do
    for port in sys.argv[2].split(","):  # one launch per port
        torch.multiprocessing.spawn(train, args=(int(port),), nprocs=2)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "runs"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_dataloader_workers_set_up_no_torchtrace_of_their_own(tmp_path, start_method):
    proc = _run(tmp_path, LOADER, start_method)
    lines = proc.stdout.splitlines()
    # The main process is configured; each worker's call (2 workers, 2 epochs) is put off to a
    # step it never runs.
    assert sorted(lines) == ["configured False"] * 4 + ["configured True", "done"], lines
    (run,) = (tmp_path / "runs").iterdir()  # one run: the main process's, none per worker and epoch
    assert sorted(p.name for p in run.iterdir()) == ["report.json", "spans.jsonl", "state.json"]
    report = json.loads((run / "report.json").read_text())
    assert report["totals"]["steps"] == 8 and report["guard"]["policy"] == "skip", report["totals"]
    assert "torchtrace" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("where, run_id", [("top", "job"), ("top", None), ("inside", None), ("main", None)])
def test_spawned_ranks_trace_their_steps_with_the_scripts_settings_in_one_run(tmp_path, capsys, where, run_id):
    """Two ranks of ``torch.multiprocessing.spawn``, the script's ``configure()`` at its top level,
    in the ranks' function after ``init_process_group``, or under ``if __name__ == "__main__":``
    before the spawn (which a spawned rank does not run: it takes the arguments its parent
    offers), with a run id or none: both ranks
    write in one run directory, as the ranks of a world of 2 (not rank 0 twice, nor a second
    attempt). A NaN on rank 1's third step: under the script's ``guard="skip"`` that update is
    not applied, and rank 1's report says so. ``torchtrace why`` sees both ranks."""
    proc = _run(tmp_path, RANKS, str(_free_port()), where, run_id or "-")
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 finite True", "rank 1 finite True"], proc.stdout
    (run,) = {p.parent for p in (tmp_path / "runs").rglob("report.rank*.json")}
    if run_id is not None:
        assert run == tmp_path / "runs" / run_id
    assert not any(p.name.startswith("attempt-") for p in run.iterdir())  # two ranks, not two attempts of one
    reports = {p.name: json.loads(p.read_text()) for p in run.glob("report.rank*.json")}
    assert sorted(reports) == ["report.rank0.json", "report.rank1.json"], sorted(p.name for p in run.iterdir())
    for name, report in reports.items():
        assert report["rank"] == int(name[len("report.rank")]) and report["world_size"] == 2
        assert report["guard"]["policy"] == "skip" and report["totals"]["steps"] == 4
        assert report["service_name"] == "spawned"
    assert reports["report.rank1.json"]["totals"]["skipped_steps"] == 1
    assert reports["report.rank0.json"]["totals"]["nonfinite_steps"] == 0
    capsys.readouterr()
    assert cli_main(["why", str(run)]) == 0
    said = capsys.readouterr().out
    assert said.startswith("verdict: completed (every rank completed)"), said
    assert [line.split(":")[0] for line in said.splitlines() if line.startswith("rank ")] == ["rank 0", "rank 1"], said


@pytest.mark.slow
def test_a_second_spawn_from_the_same_process_is_a_run_of_its_own(tmp_path):
    """Two launches from one parent (a script that trains then launches again, a notebook run
    twice), no run id named: the second launch's ranks find the first's black boxes, ended,
    where their shared run id points, and write a run of their own beside it, not a second
    attempt of the first (a restart, which would count towards a crash loop)."""
    ports = f"{_free_port()},{_free_port()}"
    proc = _run(tmp_path, RANKS, ports, "inside", "-")
    assert sum(line.startswith("rank") for line in proc.stdout.splitlines()) == 4, proc.stdout
    runs = sorted({p.parent for p in (tmp_path / "runs").rglob("report.rank*.json")})
    assert len(runs) == 2 and runs[1].name == runs[0].name + "-2", runs
    for run in runs:
        assert sorted(p.name for p in run.glob("report.rank*.json")) == ["report.rank0.json", "report.rank1.json"]
        assert not any(p.name.startswith("attempt-") for p in run.iterdir())


POOL = r"""
import os, sys, torch, multiprocessing as mp, torchtrace as tt


def trial(lr):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for i in range(5):
        with tt.debug_context(f"trial_lr{lr}", model=model, optimizer=opt) as step:
            opt.zero_grad()
            x = torch.randn(8, 4) * (float("nan") if i == 2 else 1.0)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            step.record_loss(loss)
    headers = tt.api.get_runtime().settings.otlp_headers
    return lr, os.getpid(), bool(torch.isfinite(model.weight).all()), headers is None


if __name__ == "__main__":
    run = tt.configure(service_name="sweep", prometheus_port="off", run_dir=sys.argv[1], guard="skip",
                       otlp_headers={"authorization": "secret"})
    print("parent", run.run_id, flush=True)
    with mp.get_context(sys.argv[2]).Pool(2) as pool:
        for lr, pid, finite, no_headers in pool.map(trial, [0.1, 0.01, 0.001]):
            print("trial", lr, pid, finite, no_headers, flush=True)
    tt.shutdown()
    print("offer left", "TORCHTRACE_PARENT_SETTINGS" in os.environ, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_a_spawned_pool_of_trials_takes_the_settings_its_parent_was_configured_with(tmp_path, start_method):
    """``configure()`` under ``if __name__ == "__main__":``, then a spawn (or forkserver) Pool of
    trials: the workers run the script as ``__mp_main__``, where that call never runs. Each
    worker is set up at its first step with its parent's arguments (before, with the defaults:
    another service name, the guard's ``warn``), in a run ``<parent's run id>-pid<pid>`` under the
    parent's job id, as a forked worker is. The NaN batch of each trial is skipped under the
    parent's ``guard="skip"``. The OTLP headers, a secret, are not handed down."""
    proc = _run(tmp_path, POOL, start_method)
    lines = proc.stdout.splitlines()
    parent_id = next(line.split()[1] for line in lines if line.startswith("parent"))
    trials = [line.split()[1:] for line in lines if line.startswith("trial")]
    assert len(trials) == 3 and all(finite == no_headers == "True" for _, _, finite, no_headers in trials), lines
    assert "offer left False" in lines
    runs = {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/report.json")}
    workers = {pid for _, pid, _, _ in trials}
    assert sorted(runs) == sorted([parent_id] + [f"{parent_id}-pid{pid}" for pid in workers]), sorted(runs)
    for pid in workers:
        report = runs[f"{parent_id}-pid{pid}"]
        ran = sum(1 for _, p, _, _ in trials if p == pid)
        assert report["service_name"] == "sweep" and report["guard"]["policy"] == "skip"
        assert report["totals"]["steps"] == 5 * ran and report["totals"]["skipped_steps"] == ran, report["totals"]
        assert report["job"]["job_id"] == parent_id


HANG = r"""
import sys, time, torch, torch.distributed as dist, torchtrace as tt

tt.configure(prometheus_port="off", run_dir=sys.argv[1], hang_timeout_s=4)


def train(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(40):
        with tt.debug_context("train_step", model=model, optimizer=opt) as scope:
            while rank == 1 and step == 5:
                time.sleep(0.2)  # rank 1's input never comes; rank 0 waits in DDP's all-reduce
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            scope.record_loss(loss)
        time.sleep(0.3)


if __name__ == "__main__":
    tt.shutdown()
    torch.multiprocessing.spawn(train, args=(int(sys.argv[2]),), nprocs=2)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_spawned_rank_that_never_reaches_the_collective_is_named(tmp_path):
    """Rank 1 of a ``torch.multiprocessing.spawn`` job stops before its forward at step 5: each
    rank's watchdog names it from the other's black box in their shared run directory, and so
    does ``torchtrace why``."""
    script = tmp_path / "train.py"
    script.write_text(HANG)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    runs = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, str(script), str(runs), str(port)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while len(list(runs.glob("*/hang.rank*.json"))) < 2:
            assert time.monotonic() < deadline, "two hang files not written in time"
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        (run,) = {p.parent for p in runs.glob("*/hang.rank*.json")}  # one run directory for both ranks
        for rank in (0, 1):
            finding = json.loads((run / f"hang.rank{rank}.json").read_text())
            assert finding["peers"]["culprit_ranks"] == [1], finding
        out = subprocess.run([sys.executable, "-m", "torchtrace.cli", "why", str(run), "--json"], env=env,
                             capture_output=True, text=True, timeout=60)
        report = json.loads(out.stdout)
        assert report["verdict"] == "hang" and report["culprit_ranks"] == [1], report
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)


RAISES = r"""
import sys, time, torch, torch.distributed as dist, torchtrace as tt


def train(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tt.configure(prometheus_port="off", run_dir=sys.argv[1], run_id="raises")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:
        time.sleep(float(sys.argv[3]))  # a rank slow to start: its peer waits in the first collective
    for i in range(6):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            opt.zero_grad()
            loss = model(torch.ones(2, 4)).pow(2).mean()
            if rank == 1 and i == 3:
                raise ValueError("a bad batch")
            loss.backward()
            opt.step()
            step.record_loss(loss)
    tt.shutdown()


if __name__ == "__main__":
    try:
        torch.multiprocessing.spawn(train, args=(int(sys.argv[2]),), nprocs=2)
    except Exception as exc:
        print("spawn raised", type(exc).__name__, flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info >= (3, 13), reason="Python 3.13 runs multiprocessing's finalizers after it "
                    "has handled the target's exception: the end is not seen (torchtrace/api.py)")
@pytest.mark.parametrize("rank0_late_s", [0.0, 4.0])
def test_a_spawned_rank_that_raises_ends_as_an_exception(tmp_path, capsys, rank0_late_s):
    """``torch.multiprocessing.spawn`` catches a rank's exception, hands it to the parent and ends
    the rank with ``sys.exit(1)``: no ``sys.excepthook`` runs, and the rank's black box said
    ``completed``. Now it says ``exception`` (ValueError) at the step that raised, and ``why``
    names the rank.

    With rank 0 late to start, rank 1's watchdog saw it waiting in the first collective (the
    settings' agreement); it raised before the next look, and its last black box still said the
    collective was in progress: ``why`` read a hang (CI, stop 75). The last look that ends a
    process reads the collectives again."""
    proc = _run(tmp_path, RAISES, str(_free_port()), str(rank0_late_s))
    assert "spawn raised ProcessRaisedException" in proc.stdout
    run = tmp_path / "runs" / "raises"
    states = {p.name: json.loads(p.read_text()) for p in run.glob("state.rank*.json")}
    rank1 = states["state.rank1.json"]
    assert (rank1["ended"], rank1["end_detail"], rank1["end_step"]) == ("exception", "ValueError", 3), rank1
    assert states["state.rank0.json"]["ended"] in ("completed", "preempted")  # (spawn may SIGTERM it as it ends)
    capsys.readouterr()
    cli_main(["why", str(run)])
    said = capsys.readouterr().out
    assert said.startswith("verdict: died (rank 1 ended with an exception)\nculprit ranks: 1"), said
