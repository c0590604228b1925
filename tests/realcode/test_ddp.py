"""Real-code suite, DDP: 2 ranks under real ``torchrun`` (gloo on CPU), the four planted faults
on rank 1 (the learning rate on both), under ``warn`` and ``skip``, all in one launch.

What must hold: the job ends (no collective mismatch, no hang); every rank takes the same
skip decision on the same step and the weights stay identical across ranks; the report names
the rank and the module where the value was born, and rank 0 does not blame a module of its
own for a NaN that reached it through DDP's all-reduce. The same for the issue's own job, DDP
and torchtrace at their defaults, one launch per guard.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.realcode import models

# The module's fixture does its costly work once per process: its tests share one xdist worker.
pytestmark = pytest.mark.xdist_group("realcode_ddp")

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_ddp_worker.py")
BAD_STEP = 3
EXPECTED = {  # fault -> (cause, module) on the rank where it was planted
    "inf_weight": ("parameter", "h.0.mlp.c_fc"),
    "attention_overflow": ("forward", "h.0.attn"),
    "nan_input": ("input", ""),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path, *args: str, worker: Path = WORKER) -> subprocess.CompletedProcess:
    """The worker on 2 ranks under real torchrun; asserts the job ended well."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{_free_port()}", "--max_restarts=0", str(worker), str(out), *args]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="session")  # once a worker: a module fixture ran again when xdist ran tests between
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    _torchrun(out)
    return [json.loads((out / f"ddp.rank{r}.json").read_text()) for r in (0, 1)]


CASES = [f"{g}/{f}" for g in ("warn", "skip") for f in models.FAULTS]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_same_decision_and_identical_weights_on_every_rank(ranks, case):
    guard, fault = case.split("/")
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["decisions"] == r1["decisions"]
    bad = BAD_STEP + 1 if fault == "huge_lr" else BAD_STEP
    first = next(d for d in r0["decisions"] if d["nonfinite"])
    assert first["step"] == bad
    assert first["skipped"] is (guard == "skip")
    assert r0["identical"] and r1["identical"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_report_names_the_rank_and_module_where_the_value_was_born(ranks, case):
    guard, fault = case.split("/")
    (rep0,), (rep1,) = ranks[0][case]["reports"], ranks[1][case]["reports"]
    if fault == "huge_lr":
        # Both ranks applied the same huge update: each finds its own head blown up past
        # float32's extreme magnitude, and the overflow it made in the loss the root computes.
        for rep, rank in ((rep0, 0), (rep1, 1)):
            assert (rep["cause"], rep["module"], rep["rank"], rep["step"]) == ("parameter", "lm_head", rank,
                                                                                BAD_STEP + 1)
            assert rep["extreme_params"][0]["name"] == rep["largest_params"][0]["name"] == "lm_head.weight"
            assert (rep["found_in"]["cause"], rep["found_in"]["module"]) == ("forward", "")
        return
    cause, module = EXPECTED[fault]
    assert (rep1["cause"], rep1["module"], rep1["rank"], rep1["step"]) == (cause, module, 1, BAD_STEP)
    # Rank 0's own replay (DDP's sync off) found everything finite: not its module.
    assert rep0["cause"] == "peer" and rep0["module"] is None and rep0["rank"] == 0
    if guard == "skip":  # the ranks agreed the step is bad: each learns where it was born
        for rep in (rep0, rep1):
            assert (rep["origin_rank"], rep["origin_cause"], rep["origin_module"]) == (1, cause, module)
    else:  # warn issues no collective: rank 0 says it came from another rank
        assert "origin_rank" not in rep0


@pytest.mark.timeout(300)
def test_a_replay_on_one_rank_alone_issues_no_collective(ranks):
    """Rank 0 has no replay budget, so rank 1 replays alone: the job ends, rank 1 names the input."""
    r0, r1 = ranks[0]["lonely/nan_input"], ranks[1]["lonely/nan_input"]
    assert r0["reports"] == []
    (report,) = r1["reports"]
    assert (report["cause"], report["module"], report["rank"]) == ("input", "", 1)
    assert r0["decisions"] == r1["decisions"] and r0["identical"] and r1["identical"]


@pytest.mark.timeout(300)
def test_accumulation_under_no_sync_names_the_rank_where_the_nan_was_born(ranks):
    """Four micro-batches a step, three under ``no_sync()``, ``model=`` the module DDP wraps: a
    NaN in rank 1's second micro-batch reaches rank 0 in the last one's all-reduce. Both ranks
    skip that step alone and stay identical; rank 0's replay finds everything finite on its
    side, and its report's sentence (the line logged and put on the span) says where the value
    was born, as its ``origin_*`` fields do; before, it read "origin not found"."""
    from torchtrace.probes.forensics import sentence

    r0, r1 = ranks[0]["accumulate/nan_input"], ranks[1]["accumulate/nan_input"]
    assert r0["decisions"] == r1["decisions"] and r0["identical"] and r1["identical"]
    assert [d["step"] for d in r0["decisions"] if d["skipped"]] == [BAD_STEP]
    (rep0,), (rep1,) = r0["reports"], r1["reports"]
    assert (rep1["cause"], rep1["module"], rep1["rank"]) == ("input", "", 1)
    assert (rep0["origin_rank"], rep0["origin_cause"], rep0["origin_module"]) == (1, "input", "")
    text = sentence(rep0)
    assert "born on rank 1" in text and "input" in text, text
    assert "origin not found" not in text, text


@pytest.mark.timeout(300)
def test_uneven_inputs_under_join_train_as_without_torchtrace(ranks):
    """``Join`` with uneven inputs: once rank 0 has joined, rank 1's collectives are matched by
    DDP's shadow ones only. torchtrace's own (the guard's agreement, the straggler check) met
    them and gloo aborted the job ("Received data size doesn't match expected size"); now it
    issues none inside ``Join``, and the run is the plain loop's, loss for loss."""
    for rank in (0, 1):
        plain, traced = ranks[rank]["join/plain"], ranks[rank]["join/skip"]
        assert traced["losses"] == plain["losses"] and len(plain["losses"]) == (3 if rank == 0 else 6)
        assert traced["identical"] and plain["identical"]


@pytest.mark.timeout(300)
def test_fsdp1_is_not_replayed_on_one_rank(ranks):
    """FSDP's first API keeps its shards in plain tensors: a replay on rank 1 alone (its loss
    NaN, every gradient finite) ran the forward's all-gather by itself, which paired with
    rank 0's next one: both ranks trained on wrong values (step 4's loss 0.2075 against 0.2088
    on rank 1), then the job died. Now it is not replayed, and says why; the losses are the
    plain loop's, step by step."""
    for rank in (0, 1):
        plain, traced = ranks[rank]["fsdp1/plain"], ranks[rank]["fsdp1/warn"]
        assert traced["losses"][:BAD_STEP] == plain["losses"][:BAD_STEP]
        assert traced["losses"][BAD_STEP + 1:] == plain["losses"][BAD_STEP + 1:]
        assert traced["identical"] and plain["identical"]
    assert ranks[0]["fsdp1/warn"]["reports"] == []
    (report,) = ranks[1]["fsdp1/warn"]["reports"]
    assert report["replayed"] is False and "sharded" in report["tried"], report


@pytest.mark.timeout(300)
def test_fsdp1_gradient_norms_are_said_to_be_the_ranks_shards(ranks):
    """FSDP's first API: each rank's norms are of its flat shard, not of the whole model: the
    span says ``local`` (it said ``global``, the whole tensors' scope, with a norm of half the
    model on each rank)."""
    for rank in (0, 1):
        scopes = ranks[rank]["fsdp1/warn"]["scopes"]
        assert scopes and set(scopes) == {"local"}, scopes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("guard", ["warn", "skip"])
def test_one_nan_on_one_rank_at_the_defaults_does_not_kill_the_job(tmp_path, guard):
    """The issue's job: DDP and torchtrace at their defaults, an Inf weight on rank 1 before
    step 15. Both ranks' gradients turn NaN through the all-reduce, so both replay; before the
    fix their replays differed (rank 1 found the parameter, rank 0 went on to a second,
    anomaly-mode pass whose backward all-reduced alone): under ``skip`` the guard's next
    all_reduce met a gradient bucket (gloo::EnforceNotMet, "collective mismatch", SIGABRT),
    under ``warn`` the ranks drifted one collective apart until gloo's timeout."""
    _torchrun(tmp_path, "one_nan", guard)
    case = f"one_nan/{guard}"
    r0, r1 = (json.loads((tmp_path / f"one_nan.rank{r}.json").read_text())[case] for r in (0, 1))
    assert r0["decisions"] == r1["decisions"] and r0["identical"] and r1["identical"]
    bad = [d for d in r0["decisions"] if d["nonfinite"]]
    assert bad[0]["step"] == 15 and all(d["skipped"] is (guard == "skip") for d in bad)
    (rep0,), (rep1,) = r0["reports"], r1["reports"]
    assert (rep1["cause"], rep1["module"], rep1["rank"], rep1["step"]) == ("parameter", "h.0.mlp.c_fc", 1, 15)
    assert (rep0["cause"], rep0["module"], rep0["rank"]) == ("peer", None, 0)
    assert r0["internal_errors"] == r1["internal_errors"] == 0


@pytest.mark.timeout(300)
def test_the_shards_zero_sends_between_ranks_are_no_checkpoint(tmp_path):
    """``ZeroRedundancyOptimizer.consolidate_state_dict`` sends each rank's shard to rank 0 as
    ``torch.save``'d bytes (and rank 0 reads them with ``torch.load``). Before, each such call
    counted as a checkpoint: rank 1, which saved nothing, had a save at step 1 in its black box
    (``torchtrace why`` would resume it from there), and both ranks booked checkpoint time. Only
    rank 0's own ``torch.save`` to a file is a checkpoint."""
    _torchrun(tmp_path, worker=Path(__file__).with_name("_zero_worker.py"))
    r0, r1 = (json.loads((tmp_path / f"zero.rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == {"counted": {"save": 1, "load": 0}, "checkpoint_step": 1}, r0
    assert r1 == {"counted": {"save": 0, "load": 0}, "checkpoint_step": None}, r1
    assert (tmp_path / "checkpoint.pt").exists()


@pytest.mark.timeout(300)
def test_a_script_that_configures_rank_0_alone_guards_every_rank_alike(tmp_path):
    """``if rank == 0: tt.configure(guard="skip")``, as scripts set up their logging on the
    main process: rank 1 is configured from its environment at its first step (``warn``).
    Before, rank 0's guard agreement at the first update met DDP's bucket rebuild on rank 1:
    gloo timed out and the job died. Now the ranks compare the settings that decide
    torchtrace's collectives at their first step and follow rank 0's, saying so; the Inf
    weight on rank 1 is skipped on both ranks, which stay identical."""
    proc = _torchrun(tmp_path, "rank0_only")
    case = "rank0_only/skip"
    r0, r1 = (json.loads((tmp_path / f"rank0_only.rank{r}.json").read_text())[case] for r in (0, 1))
    assert r0["guard"] == r1["guard"] == "skip"
    assert r0["decisions"] == r1["decisions"] and r0["identical"] and r1["identical"]
    assert [d["step"] for d in r0["decisions"] if d["skipped"]] == [BAD_STEP]
    assert r0["internal_errors"] == r1["internal_errors"] == 0
    said = proc.stdout + proc.stderr
    assert "guard: rank 0 'skip', rank 1 'warn'" in said, said[-3000:]


@pytest.mark.timeout(300)
def test_evaluations_and_checkpoints_on_rank_0_alone_issue_no_collective(tmp_path):
    """DDP scripts evaluate and save on rank 0 alone; marked as the docs show
    (``debug_context(kind="evaluation")``, ``kind="checkpoint"``). Before, the skew check
    counted them as steps: at the save's interval-th call (50 at the defaults) rank 0 alone
    issued its all_reduce, which met a DDP bucket on rank 1 (gloo: "op.preamble.length <=
    op.nbytes. 36 vs 8", the job aborted). Only training steps are counted now, and the ranks'
    settings are compared at their first training step, not at rank 0's evaluation (which a
    barrier follows)."""
    _torchrun(tmp_path, "rank0_ops")
    r0, r1 = (json.loads((tmp_path / f"rank0_ops.rank{r}.json").read_text()) for r in (0, 1))
    assert r0["identical"] and r1["identical"]
    assert len(r0["losses"]) == len(r1["losses"]) == 6
    assert r0["collectives"] == r1["collectives"] == {"settings": 1, "guard": 6, "skew": 3}
