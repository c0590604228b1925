"""Real ``torchrun`` jobs (2 ranks, gloo on CPU): rank identity, files and ports, global
gradient norms under FSDP2/DTensor, guard agreement, stragglers, and a crashing rank.

Starting torch in two processes is the slow part (several seconds on a 2-core machine), so
the worker scenarios run one after the other inside a single launch.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# One worker runs this module under pytest-xdist, so its module-scoped launch runs once.
pytestmark = pytest.mark.xdist_group("torchrun")
WORKER = Path(__file__).with_name("_worker.py")
LAUNCH_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], tmp: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{_free_port()}", "--max_restarts=0", *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    return proc, time.monotonic() - t0


@pytest.fixture(scope="session")  # once a worker: a module fixture ran again when xdist ran tests between
def worker(tmp_path_factory):
    """One launch: shard, guard, minibatches, skew, then crash (rank 1 raises; the job must end,
    not hang)."""
    out = tmp_path_factory.mktemp("worker")
    proc, wall = _torchrun([str(WORKER), str(out), "shard", "guard", "minibatches", "skew", "crash"], out)

    def load(scenario: str) -> list[dict]:
        results = []
        for r in (0, 1):
            path = out / f"{scenario}.rank{r}.json"
            assert path.exists(), f"{path.name} missing; torchrun output:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            results.append(json.loads(path.read_text()))
        return results

    return {"proc": proc, "wall": wall, "load": load, "out": out}


@pytest.mark.timeout(200)
def test_global_grad_norm_fsdp2_and_dtensor_match_single_process(worker):
    for r, res in enumerate(worker["load"]("shard")):
        assert res["rank"] == r
        ref, ref_per = res["ref_total"], res["ref_per"]
        # DTensor directly (Shard(0) and Replicate): replicated tensors are not double counted.
        assert res["dtensor_scope"] == "global"
        assert abs(res["dtensor_total"] - ref) / ref < 1e-5
        for got, want in zip(res["dtensor_per"], ref_per):
            assert abs(got - want) / want < 1e-5
        # The local shard norm alone is wrong (what per-shard reporting would show).
        assert abs(res["local_only_total"] - ref) / ref > 1e-2
        # FSDP2 fully_shard: the recorded global norm equals the unsharded reference.
        assert "fsdp_error" not in res, res.get("fsdp_error")
        assert res["fsdp_scope"] == "global"
        assert abs(res["fsdp_total"] - ref) / ref < 1e-5
        for got, want in zip(res["fsdp_per"], ref_per):
            assert abs(got - want) / want < 1e-5
        assert res["fsdp_names"] == ["encoder.weight", "encoder.bias", "head.weight", "head.bias"]
        # FLOPs counted on the FSDP2 step: this rank's batch through the whole model
        assert res["fsdp_samples"] == 6 and res["fsdp_flops"] == res["fsdp_flops_ref"] > 0
        # One all_reduce per recorded step: one for the direct DTensor call, one for the FSDP step;
        # and the ranks' settings gathered once, at the first step.
        assert res["collectives"] == {"grad_norm": 2, "settings": 1}


@pytest.mark.timeout(200)
def test_nan_on_one_rank_makes_every_rank_skip_or_raise_in_the_same_step(worker):
    r0, r1 = worker["load"]("guard")
    for res in (r0, r1):
        assert res["skip"]["skipped"] == [3]
        assert res["skip"]["params_equal"] and res["skip"]["params_finite"]
        assert res["raise"]["raised_at"] == 2
        assert res["raise"]["params_equal"]
    assert "another rank" in r0["raise"]["message"]
    assert "another rank" not in r1["raise"]["message"]


@pytest.mark.timeout(200)
def test_a_nan_on_one_rank_in_a_later_minibatch_is_skipped_on_every_rank(worker):
    """A step that names only its DDP model, updating once per minibatch: the NaN rank 1 alone
    sees in a later minibatch is agreed on, and both ranks drop that update and the step's
    later ones. Before, only the first update of such a step was guarded: the NaN update was
    applied on rank 1, and the next minibatch's all-reduce made every rank's parameters NaN."""
    r0, r1 = worker["load"]("minibatches")
    for res in (r0, r1):
        assert [r["skipped"] for r in res["records"]] == [False, True]
        assert res["params_equal"] and res["params_finite"]
    assert r0["records"][1]["peer"] and not r1["records"][1]["peer"]


@pytest.mark.timeout(200)
def test_slowed_rank_shows_in_skew_and_metrics_carry_rank(worker):
    results = worker["load"]("skew")
    for r, res in enumerate(results):
        last = res["rank_skew"]
        assert last["slowest_rank"] == 1
        times = last["step_seconds_by_rank"]
        # The median rank of two is the faster one (the lower median), so the skew is the
        # slowest rank's time over the other's, not over the two ranks' mean.
        assert res["skew_gauge"] == pytest.approx(max(times) / min(times))
        assert res["skew_gauge"] > 2  # rank 1 sleeps 50 ms per step, rank 0 computes ~1 ms
        # No collective in the steps (independent models), so no rank waited: own time is wall time.
        assert last["own_seconds_by_rank"] == pytest.approx(times)
        assert res["collectives"]["skew"] == 2  # 8 steps, every 4
        assert res["steps_lines"] and all(f'rank="{r}"' in ln for ln in res["steps_lines"])
    assert results[0]["metrics_port"] != results[1]["metrics_port"]


@pytest.mark.timeout(200)
def test_a_rank_that_raises_does_not_hang_the_other(worker):
    proc = worker["proc"]
    assert proc.returncode != 0
    assert "rank 1 fails on purpose" in proc.stderr + proc.stdout
    assert worker["wall"] < LAUNCH_TIMEOUT_S
    assert not (worker["out"] / "crash.rank0.json").exists()


@pytest.mark.timeout(200)
def _ddp_example_flops() -> int:
    """FLOPs of one step of examples/ddp_train.py's model and batch, counted the reference way."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    x = torch.randn(32, 16)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
    return counter.get_total_flops()


def test_example_ddp_train_under_torchrun(tmp_path):
    base = _free_port()
    blocker = socket.socket()
    try:
        blocker.bind(("127.0.0.1", base))  # rank 0's port is taken: its fallback must skip rank 1's
        blocker.listen(1)
    except OSError:
        blocker.close()
        pytest.skip("could not occupy a port")
    try:
        proc, _ = _torchrun([str(ROOT / "examples" / "ddp_train.py"), "--steps", "10", "--port", str(base),
                             "--run-dir", "runs", "--run-id", "ex1", "--shared-trace"], tmp_path)
    finally:
        blocker.close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "ex1"
    ports, traces = {}, {}
    for r in (0, 1):
        report = json.loads((run / f"report.rank{r}.json").read_text())
        assert (report["rank"], report["world_size"], report["local_rank"]) == (r, 2, r)
        assert report["totals"]["steps"] == 10
        ports[r] = int(report["telemetry"]["metrics_url"].rsplit(":", 1)[1].split("/")[0])
        spans = [json.loads(line) for line in (run / f"spans.rank{r}.jsonl").read_text().splitlines()]
        assert len(spans) == 10
        for span in spans:
            assert span["resource"]["torchtrace.rank"] == r
            assert span["resource"]["torchtrace.world_size"] == 2
            assert span["attributes"]["torchtrace.rank"] == r
            assert span["attributes"]["torchtrace.grad.norm_scope"] == "global"
            assert math.isfinite(span["attributes"]["torchtrace.grad.norm"])
        traces[r] = {s["attributes"]["torchtrace.step"]: s["trace_id"] for s in spans}
        ids = {s["resource"]["service.instance.id"] for s in spans}
        assert len(ids) == 1
        # throughput on every rank: this rank's batch, FLOPs counted once (against FlopCounterMode
        # on the same model outside DDP), the three phases, and goodput in the report
        assert all(s["attributes"]["torchtrace.samples"] == 32 for s in spans)
        assert {s["attributes"]["torchtrace.flops"] for s in spans} == {_ddp_example_flops()}
        assert all(s["attributes"]["torchtrace.phase.optimizer_s"] > 0 and s["attributes"]["torchtrace.phase.forward_s"]
                   > 0 and s["attributes"]["torchtrace.phase.backward_s"] > 0 for s in spans)
        section = report["throughput"]
        assert 0 < section["goodput_ratio"] < 1 and section["operations"]["train_step"]["samples_per_s"] > 0
        assert section["productive_s"] + sum(section["badput_s"].values()) == pytest.approx(section["wall_s"])
    assert ports[1] == base + 1 and ports[0] == base + 2  # base + local rank; fallback strides by 2
    assert traces[0] == traces[1] and len(set(traces[0].values())) == 10  # one trace per step, all ranks
    assert sorted(p.name for p in run.iterdir()) == ["report.rank0.json", "report.rank1.json",
                                                      "spans.rank0.jsonl", "spans.rank1.jsonl",
                                                      # the black boxes (no hang: no stack files left behind)
                                                      "state.rank0.json", "state.rank1.json"]


def test_the_example_runs_two_ranks_of_a_one_gpu_machine_on_the_cpu():
    """On an H200 machine (one GPU) the example put rank 1 on cuda:1 and failed with "invalid
    device ordinal": the ranks of a node now take a GPU each only when there is one for each."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_train", ROOT / "examples" / "ddp_train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    pick = example.pick_device
    assert [pick("auto", 1, r, 2).type for r in (0, 1)] == ["cpu", "cpu"]
    assert [str(pick("auto", 2, r, 2)) for r in (0, 1)] == ["cuda:0", "cuda:1"]
    assert str(pick("auto", 8, 3, 4)) == "cuda:3" and pick("auto", 0, 0, 1).type == "cpu"
    assert pick("cpu", 8, 1, 2).type == "cpu" and str(pick("cuda", 1, 0, 2)) == "cuda:0"


def test_ranks_torchrun_gave_no_rendezvous_id_share_one_run(tmp_path):
    """``torchrun --rdzv-backend=c10d --rdzv-endpoint=...`` without ``--rdzv-id`` gives its
    ranks ``TORCHELASTIC_RUN_ID=none``. Each rank took a run id of its own before: their black
    boxes lay in two run directories, where neither the watchdog nor ``torchtrace why`` saw the
    other rank. Now the ranks take one run id from their agent, and ``why`` reads both."""
    from tests.job.helpers import RANK_SCRIPT
    from torchtrace.cli.why import why

    script = tmp_path / "train.py"
    script.write_text(RANK_SCRIPT)
    proc, _ = _torchrun([str(script), str(tmp_path / "runs")], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, [p.name for p in runs]
    assert sorted(p.name for p in runs[0].glob("state*.json")) == ["state.rank0.json", "state.rank1.json"]
    report = why(runs[0])
    assert report["verdict"] == "completed" and sorted(r["rank"] for r in report["ranks"]) == [0, 1]
    assert "rendezvous id" not in proc.stderr  # one host: every rank is in the run, nothing to warn of


@pytest.mark.timeout(200)
def test_ranks_the_guard_stopped_are_told_by_the_rank_whose_loss_was_not_finite(tmp_path):
    """``guard="raise"`` stops every rank at the step a NaN entered rank 1's batch. Before,
    ``torchtrace why`` blamed whichever rank raised first and said the other raised "in a
    collective that failed for want of it"."""
    from torchtrace.cli.why import why

    proc, _ = _torchrun([str(Path(__file__).with_name("guard_raise_worker.py")), str(tmp_path / "runs")], tmp_path)
    assert proc.returncode != 0 and "NonFiniteError" in proc.stderr, proc.stderr[-3000:]
    report = why(tmp_path / "runs")
    assert (report["verdict"], report["culprit_ranks"]) == ("died", [1]), report["reason"]
    assert report["reason"] == ("the guard (guard='raise') stopped ranks 0, 1 with NonFiniteError at step 3; "
                                "rank 1 had a non-finite loss of its own")
