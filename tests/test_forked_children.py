"""Processes forked from a configured process that train: Hogwild workers (PyTorch's
mnist_hogwild example: ``configure()`` in the parent, ``model.share_memory()``, the steps in
``multiprocessing.Process`` workers), a ``multiprocessing.Pool`` of trials, ranks started with
``start_method="fork"`` or by Accelerate's ``notebook_launcher``.

Such a child inherits its parent's runtime, whose threads, server and exporters do not run in
it: its steps were measured and then dropped (a Hogwild job's run said 0 steps). Each one that
runs a step now sets torchtrace up for itself at that step, with the parent's settings and job
id: a run of its own beside the parent's, or, for ranks of a process group, the run the ranks
share. A forked DataLoader worker still keeps its parent's runtime (tests/test_fork_once.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="the fork start method")]

HOGWILD = r"""
import os, sys, torch, torch.multiprocessing as mp, torchtrace as tt


def train(worker, model):
    torch.manual_seed(worker)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(20):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            opt.zero_grad()
            x = torch.randn(8, 4) * (float("nan") if (worker == 1 and i == 7) else 1.0)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            step.record_loss(loss)
    sys.stdout.write(f"worker {worker} {os.getpid()} {bool(torch.isfinite(model.weight).all())}\n")  # (one write)
    sys.stdout.flush()


if __name__ == "__main__":
    run = tt.configure(service_name="hogwild", prometheus_port=0, run_dir=sys.argv[1], guard="skip")
    print("parent", run.run_id, os.getpid(), flush=True)
    model = torch.nn.Linear(4, 1)
    model.share_memory()
    workers = [mp.get_context("fork").Process(target=train, args=(w, model)) for w in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print("exit codes", [w.exitcode for w in workers], flush=True)
"""


RAISES = r"""
import sys, torch, torch.multiprocessing as mp, torchtrace as tt


def train(worker):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(10):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            opt.zero_grad()
            loss = model(torch.randn(8, 4)).pow(2).mean()
            if worker == 1 and i == 5:
                raise ValueError("a bad batch")
            loss.backward()
            opt.step()
            step.record_loss(loss)


if __name__ == "__main__":
    run = tt.configure(service_name="raises", prometheus_port="off", run_dir=sys.argv[1])
    print("parent", run.run_id, flush=True)
    workers = [mp.get_context("fork").Process(target=train, args=(w,)) for w in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
        print("worker", w.pid, w.exitcode, flush=True)
"""


def _run(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "runs"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _reports(tmp_path: Path) -> dict[str, dict]:
    return {str(p.relative_to(tmp_path / "runs")): json.loads(p.read_text())
            for p in (tmp_path / "runs").rglob("report*.json")}


def _spans(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "spans.jsonl").read_text().splitlines()]


def test_hogwild_workers_each_trace_their_steps_in_a_run_of_their_own(tmp_path):
    """Two forked workers train one shared model, 20 steps each; worker 1's eighth input is
    NaN, and under the script's ``guard="skip"`` that update is not applied, so the shared
    weights stay finite for both. Each worker's run (``<parent's run id>-pid<pid>``) has its
    20 steps, spans and black box, under the parent's job id; the parent's own run has none."""
    proc = _run(tmp_path, HOGWILD)
    lines = proc.stdout.splitlines()
    parent_id = next(line.split()[1] for line in lines if line.startswith("parent"))
    pids = {line.split()[1]: line.split()[2] for line in lines if line.startswith("worker")}
    assert sorted(line.split()[3] for line in lines if line.startswith("worker")) == ["True", "True"], lines
    assert "exit codes [0, 0]" in lines
    reports = _reports(tmp_path)
    assert sorted(reports) == sorted([f"{parent_id}/report.json"] + [f"{parent_id}-pid{pid}/report.json"
                                                                      for pid in pids.values()]), sorted(reports)
    assert reports[f"{parent_id}/report.json"]["totals"]["steps"] == 0
    for worker, pid in pids.items():
        run = tmp_path / "runs" / f"{parent_id}-pid{pid}"
        report = reports[f"{run.name}/report.json"]
        assert report["run_id"] == run.name and report["service_name"] == "hogwild"
        assert report["guard"]["policy"] == "skip" and report["totals"]["steps"] == 20, report["totals"]
        assert report["totals"]["skipped_steps"] == (1 if worker == "1" else 0), report["totals"]
        (attempt,) = report["job"]["attempts"]
        assert report["job"]["job_id"] == parent_id, report["job"]
        assert (attempt["ended"], attempt["last_step"]) == ("completed", 19), attempt
        spans = _spans(run)
        assert [s["attributes"]["torchtrace.step"] for s in spans] == list(range(20))
        assert {s["resource"]["torchtrace.job_id"] for s in spans} == {parent_id}
        assert (run / "state.json").exists()
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


POOL = r"""
import os, sys, torch, multiprocessing as mp, torchtrace as tt


def trial(lr):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for i in range(10):
        with tt.debug_context(f"trial_lr{lr}", model=model, optimizer=opt) as step:
            opt.zero_grad()
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            step.record_loss(loss)
    return lr, os.getpid()


if __name__ == "__main__":
    run = tt.configure(service_name="trials", prometheus_port=0, run_dir=sys.argv[1])
    print("parent", run.run_id, flush=True)
    for rounds in range(int(sys.argv[3])):
        if sys.argv[2] == "with":  # the pool's exit terminates its workers (SIGTERM)
            with mp.get_context("fork").Pool(2) as pool:
                done = pool.map(trial, [0.1, 0.01, 0.001])
        else:
            pool = mp.get_context("fork").Pool(2)
            done = pool.map(trial, [0.1, 0.01, 0.001])
            pool.close()
            pool.join()
        for lr, pid in done:
            print("trial", lr, pid, flush=True)
"""


@pytest.mark.parametrize("ending, rounds", [("close", 1), ("with", 4)])
def test_a_pool_of_trials_traces_each_worker_in_a_run_of_its_own(tmp_path, ending, rounds):
    """Three trials of 10 steps on a fork ``multiprocessing.Pool`` of 2 workers: each worker's
    run holds the steps of the trials it ran, under the trial's operation name, and its report.
    Ended by ``close()``/``join()`` the workers end as completed. Ended by the pool's ``with``
    block, ``terminate()`` sends SIGTERM as the workers shut torchtrace down (they saw the end of
    the tasks): each still writes its report, and its black box says how it ended."""
    proc = _run(tmp_path, POOL, ending, str(rounds))
    lines = proc.stdout.splitlines()
    parent_id = next(line.split()[1] for line in lines if line.startswith("parent"))
    trials: dict[str, list[str]] = {}
    for line in lines:
        if line.startswith("trial"):
            trials.setdefault(line.split()[2], []).append(f"trial_lr{line.split()[1]}")
    assert sum(map(len, trials.values())) == 3 * rounds
    reports = _reports(tmp_path)
    assert sorted(reports) == sorted([f"{parent_id}/report.json"] + [f"{parent_id}-pid{pid}/report.json"
                                                                      for pid in trials]), sorted(reports)
    for pid, names in trials.items():
        run = tmp_path / "runs" / f"{parent_id}-pid{pid}"
        report = reports[f"{run.name}/report.json"]
        assert report["totals"]["steps"] == 10 * len(names), (pid, report["totals"])
        assert sorted({s["name"] for s in _spans(run)}) == sorted(set(names))
        (attempt,) = report["job"]["attempts"]
        assert attempt["ended"] in (("completed",) if ending == "close" else ("completed", "preempted")), attempt


RANKS = r"""
import os, sys, torch, torch.distributed as dist, torchtrace as tt


def train(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(6):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            opt.zero_grad()
            x = torch.ones(2, 4) * (float("nan") if (rank == 1 and i == 2) else 1.0)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            step.record_loss(loss)
    tt.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    run = tt.configure(service_name="forked-ranks", prometheus_port="off", run_dir=sys.argv[1], guard="skip")
    print("parent", run.run_id, flush=True)
    torch.multiprocessing.start_processes(train, args=(int(sys.argv[2]),), nprocs=2, start_method="fork")
"""


def test_ranks_started_with_fork_share_one_run(tmp_path):
    """``torch.multiprocessing.start_processes(..., start_method="fork")`` from a configured
    parent: the two ranks write into one run, as the ranks of a world of 2, with the parent's
    settings and job id (rank 1's NaN step is skipped under ``guard="skip"``), beside the parent's
    own run."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = _run(tmp_path, RANKS, str(port))
    parent_id = next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("parent"))
    reports = _reports(tmp_path)
    (shared,) = {name.split("/")[0] for name in reports if "/report.rank" in name}
    assert sorted(reports) == sorted([f"{parent_id}/report.json", f"{shared}/report.rank0.json",
                                      f"{shared}/report.rank1.json"]), sorted(reports)
    for rank in (0, 1):
        report = reports[f"{shared}/report.rank{rank}.json"]
        assert (report["rank"], report["world_size"]) == (rank, 2)
        assert report["guard"]["policy"] == "skip" and report["totals"]["steps"] == 6, report["totals"]
        # DDP's all-reduce carries rank 1's NaN into rank 0's gradients: both skip that update,
        # so the replicas stay alike; the NaN loss is rank 1's alone.
        assert report["totals"]["skipped_steps"] == 1 and report["anomalies_by_kind"]["nonfinite_grad"] == 1
        assert report["anomalies_by_kind"].get("nonfinite_loss", 0) == rank, report["anomalies_by_kind"]
        assert report["job"]["job_id"] == parent_id


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="Python 3.13 runs multiprocessing's finalizers after it "
                    "has handled the target's exception: the end is not seen (torchtrace/api.py)")
def test_a_worker_whose_target_raises_ends_as_an_exception(tmp_path):
    """``multiprocessing`` catches the exception that ends a worker's target and prints it, so
    no ``sys.excepthook`` runs there: the black box said ``completed``. Now the worker whose
    sixth step raised ends as ``exception``, at that step, and the other as ``completed``."""
    proc = _run(tmp_path, RAISES)
    lines = proc.stdout.splitlines()
    parent_id = next(line.split()[1] for line in lines if line.startswith("parent"))
    codes = dict(line.split()[1:] for line in lines if line.startswith("worker"))
    assert sorted(codes.values()) == ["0", "1"], lines
    reports = _reports(tmp_path)
    for pid, code in codes.items():
        report = reports[f"{parent_id}-pid{pid}/report.json"]
        (attempt,) = report["job"]["attempts"]
        if code == "1":
            assert (attempt["ended"], attempt["detail"], attempt["last_step"]) == ("exception", "ValueError", 5)
            assert (report["totals"]["steps"], report["totals"]["failed_steps"]) == (6, 1), report["totals"]
        else:
            assert (attempt["ended"], report["totals"]["steps"]) == ("completed", 10), (attempt, report["totals"])


NOTEBOOK = r"""
import sys, torch, torchtrace as tt
from accelerate import Accelerator, notebook_launcher


def train():
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    for i in range(5):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            opt.zero_grad()
            loss = model(torch.ones(2, 4)).pow(2).mean()
            accelerator.backward(loss)
            opt.step()
            step.record_loss(loss)


if __name__ == "__main__":
    run = tt.configure(service_name="notebook", prometheus_port="off", run_dir=sys.argv[1])
    print("parent", run.run_id, flush=True)
    notebook_launcher(train, num_processes=2)  # (torchelastic's agent, its workers forked)
"""


def test_accelerates_notebook_launcher_ranks_share_one_run(tmp_path):
    """Accelerate's ``notebook_launcher`` (training from a Jupyter notebook whose earlier cell
    configured torchtrace) forks its ranks through torchelastic's agent: their 5 steps each
    were dropped (the run said 0 steps). Now both ranks are in one run, of a world of 2."""
    proc = _run(tmp_path, NOTEBOOK)
    parent_id = next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("parent"))
    reports = _reports(tmp_path)
    (shared,) = {name.split("/")[0] for name in reports if "/report.rank" in name}
    for rank in (0, 1):
        report = reports[f"{shared}/report.rank{rank}.json"]
        assert (report["rank"], report["world_size"], report["totals"]["steps"]) == (rank, 2, 5), report["totals"]
        assert report["job"]["job_id"] == parent_id
