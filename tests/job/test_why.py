"""``torchtrace why`` on run directories written by hand: the verdict, the culprit, each rank's
stack with the user's frames first, the text and the JSON, the job's attempts."""

from __future__ import annotations

import json
import os
import time

import pytest

from torchtrace.cli import main
from torchtrace.cli.why import render, why


def _write(run, rank, **fields):
    box = {"pid": os.getpid(), "rank": rank, "world_size": 2, "attempt": 0, "ended": None, "time": time.time(),
           "progress": time.time() - 50, "phase": "collective", "current_step": 7, "step": 6,
           "hang_timeout_s": 30.0, "collective_seq": 12}
    box.update(fields)
    (run / f"state.rank{rank}.json").write_text(json.dumps(box))
    return box


def test_why_names_the_culprit_with_its_stack_user_frames_first(tmp_path, capsys):
    run = tmp_path / "run1"
    run.mkdir()
    since = time.time() - 50
    _write(run, 0, progress=since, hang={"since": since})
    _write(run, 1, progress=since, hang={"since": since}, phase="data_wait", collective_seq=11)
    frames = [{"file": "/home/u/train.py", "line": 25, "function": "make_batch", "user": True},
              {"file": "/usr/lib/python3.11/threading.py", "line": 331, "function": "wait", "user": False}]
    (run / "hang.rank1.json").write_text(json.dumps({"since": since, "source": "watchdog", "stack": frames}))
    report = why(tmp_path)
    assert report["verdict"] == "hang" and report["culprit_ranks"] == [1]
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert ranks[1]["stack"] == ["/home/u/train.py:25 in make_batch",
                                 "/usr/lib/python3.11/threading.py:331 in wait [library]"]
    assert ranks[0]["phase"] == "collective" and ranks[0]["collective"]["seq"] == 12
    text = render(report)
    assert text.splitlines()[:3] == ["verdict: hang (not inside collective #12 that the others entered)",
                                     "culprit ranks: 1",
                                     text.splitlines()[2]]
    assert text.splitlines()[2].startswith("rank 1 [culprit]: hung, step 7 (in progress), phase data_wait")
    assert main(["why", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["culprit_ranks"] == [1]
    assert [(a["attempt"], a["ended"], a["last_step"]) for a in report["job"]["attempts"]] == [(0, None, 6)]


def test_job_section_tells_attempts_apart(tmp_path):
    (tmp_path / "a0").mkdir()
    (tmp_path / "a1").mkdir()
    _write(tmp_path / "a0", 0, attempt=0, ended="exception", step=40)
    _write(tmp_path / "a0", 1, attempt=0, pid=2 ** 22 + 4321, step=41)  # gone: killed
    _write(tmp_path / "a1", 0, attempt=1, ended="completed", step=90)
    _write(tmp_path / "a1", 1, attempt=1, ended="completed", step=90)
    attempts = why(tmp_path)["job"]["attempts"]
    # Attempt 0: rank 0 raised, rank 1's process is gone without a word (killed); a later
    # attempt followed, so attempt 0 is over. Attempt 1 completed on both ranks.
    assert [(a["attempt"], sorted(r["ended"] for r in a["ranks"])) for a in attempts] == [
        (0, ["exception", "killed"]), (1, ["completed", "completed"])]
    assert attempts[0]["ended"] in ("exception", "killed") and attempts[1]["ended"] == "completed"
    assert attempts[1]["last_step"] == 90
    assert why(tmp_path)["verdict"] == "completed"  # the latest attempt


def test_a_job_its_scheduler_stopped_is_preempted_not_running(tmp_path):
    """Every rank ended by SIGTERM (a preemption, torchrun passing on the agent's stop) or one
    rank completed and the other stopped: the job is over, and it was stopped, not stalled."""
    for rank in (0, 1):
        _write(tmp_path, rank, ended="preempted", end_detail="SIGTERM", phase="idle", current_step=None)
    report = why(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("preempted", [])
    assert "SIGTERM" in report["reason"] and "ranks 0, 1" in report["reason"], report["reason"]
    _write(tmp_path, 0, ended="completed", phase="idle", current_step=None)
    report = why(tmp_path)
    assert report["verdict"] == "preempted" and "rank 1 " in report["reason"], report["reason"]
    assert render(report).splitlines()[:4] == ["verdict: preempted (rank 1 stopped by SIGTERM)", "culprit ranks: none",
                                               "rank 0: ended completed, step 6 (finished), collective #12",
                                               "rank 1: ended preempted (SIGTERM), step 6 (finished), collective #12"]


def test_a_rank_stopped_while_the_others_run_is_named_not_called_stalled(tmp_path):
    """Rank 1 stopped by a SIGINT (a user's ^C on one node) while rank 0 still trains: the job
    runs on, and the reason names the stopped rank."""
    _write(tmp_path, 0, phase="forward", progress=time.time() - 0.5)
    _write(tmp_path, 1, ended="preempted", end_detail="SIGINT", phase="idle", current_step=None)
    report = why(tmp_path)
    assert report["verdict"] == "running"
    assert report["reason"] == "rank 1 ended preempted (SIGINT); the others run", report["reason"]


def test_a_job_whose_ranks_ended_in_ways_torchtrace_does_not_know_is_ended(tmp_path):
    """Black boxes of a later torchtrace that name an ending this one does not know: over, and
    said as the boxes say it."""
    for rank in (0, 1):
        _write(tmp_path, rank, ended="drained", phase="idle", current_step=None)
    report = why(tmp_path)
    assert (report["verdict"], report["reason"]) == ("ended", "every rank ended: ranks 0, 1 drained")


def test_why_on_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    assert main(["why", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_directory_of_several_jobs_is_read_as_its_newest_job(tmp_path, capsys):
    """``torchtrace why torchtrace-runs`` (the run_dir, holding a directory per run) reads the
    newest job, and says so. Before, its verdict and ranks were taken from every job's black
    boxes together: an old run's dead rank made a newer, completed run read as died."""
    old, new = tmp_path / "run-old", tmp_path / "run-new"
    old.mkdir()
    new.mkdir()
    gone = dict(job_id="run-old", attempt=1, started=time.time() - 3600, pid=2 ** 22 + 4321,
                time=time.time() - 3000, progress=time.time() - 3000, phase="forward", step=3, current_step=4)
    _write(old, 0, **gone)  # a two-rank job, restarted once, whose processes are gone
    _write(old, 1, **gone)
    _write(new, 0, world_size=1, job_id="run-new", started=time.time() - 60, ended="completed", step=90,
           current_step=None, phase="idle")
    report = why(tmp_path)
    assert report["verdict"] == "completed" and report["culprit_ranks"] == []
    assert [(r["rank"], r["step"]) for r in report["ranks"]] == [(0, 90)]
    assert report["job"]["job_id"] == "run-new" and report["jobs"] == ["run-new", "run-old"]
    assert render(report).splitlines()[0] == (f"job run-new, the newest of 2 under {tmp_path} (also: run-old); "
                                              "give its directory to read one other")
    assert why(old)["verdict"] == "died" and why(old)["jobs"] == ["run-old"]
    assert render(why(new)).splitlines()[0].startswith("verdict: completed")


def test_a_directory_of_many_jobs_names_a_few_of_the_others():
    report = {"path": "runs", "jobs": [f"run{i}" for i in range(9, -1, -1)], "verdict": "completed", "reason": None,
              "culprit_ranks": [], "ranks": [], "job": {"attempts": []}}
    assert render(report).splitlines()[0] == ("job run9, the newest of 10 under runs (also: run8, run7, run6, run5, "
                                              "run4 and 4 more); give its directory to read one other")


def test_a_rank_that_completed_is_in_no_collective(tmp_path):
    """A completed rank whose flight recorder's last look still held a collective in flight (the
    job's last one, or destroy_process_group's) was shown "in progress" by ``torchtrace why``."""
    for rank in (0, 1):
        _write(tmp_path, rank, ended="completed", step=59, current_step=None, phase="idle", collective_seq=1,
               collective_op="gloo:all_gather", collective_group="default_pg", collective_active=rank == 1)
    report = why(tmp_path)
    assert [r["collective"]["active"] for r in report["ranks"]] == [False, False]
    assert "in progress" not in render(report)


def test_a_job_whose_boxes_all_completed_but_some_ranks_have_none_says_so(tmp_path):
    """Rank 0 of two completed and rank 1 left no black box (it never set torchtrace up, or it
    ran on a host whose files are not here). The verdict said "every rank completed"."""
    _write(tmp_path, 0, ended="completed", step=59, current_step=None, phase="idle")
    report = why(tmp_path)
    assert report["verdict"] == "completed"
    assert report["reason"] == "rank 0 completed; 1 of 2 ranks have a black box"


def test_an_attempt_that_ended_says_where_its_last_checkpoint_was(tmp_path):
    """A preempted job is resumed from its last checkpoint: the attempt's line says which step
    that was, or that torchtrace saw none saved (a restart would begin again)."""
    for rank in (0, 1):
        _write(tmp_path, rank, ended="preempted", end_detail="SIGTERM", phase="idle", current_step=None,
               step=2287, checkpoint_step=2000 if rank == 0 else None)
    assert render(why(tmp_path)).splitlines()[-1] == (
        "attempt 0: ended preempted (SIGTERM), rank 0 first, last step 2287, last checkpoint at step 2000")
    for rank in (0, 1):
        _write(tmp_path, rank, ended="preempted", end_detail="SIGTERM", phase="idle", current_step=None, step=9)
    assert render(why(tmp_path)).splitlines()[-1] == (
        "attempt 0: ended preempted (SIGTERM), rank 0 first, last step 9, no checkpoint saved that torchtrace saw")
    for rank in (0, 1):
        _write(tmp_path, rank, ended="completed", phase="idle", current_step=None, step=9)
    assert render(why(tmp_path)).splitlines()[-1] == "attempt 0: ended completed, rank 0 first, last step 9"


def _hung_then_torn_down(tmp_path, rank1_end: dict):
    """Boxes as a real run left them (``torchrun`` of two DDP ranks, rank 1 with fewer batches):
    rank 0 waits in the backward's all_reduce, rank 1, out of data, in a barrier; both flagged
    hung; then the launcher tore the job down: rank 1 ran its SIGTERM handler, rank 0, stuck in
    the C call, could not and was killed."""
    since = time.time() - 60
    hang = {"since": since, "detected": since + 4, "phase": "collective", "timeout_s": 4.0, "source": "watchdog"}
    # Its last write counted the stretch since its last step as data wait (0.3 s before that).
    _write(tmp_path, 0, pid=2 ** 22 + 4321, step=4, current_step=5, phase="backward", step_time=since - 0.001,
           progress=since, time=since + 49, collective_seq=11, collective_op="gloo:all_reduce",
           collective_active=True, hang=dict(hang, step=5), badput_s={"data_wait": 49.301, "other": 0.01})
    _write(tmp_path, 1, step=4, current_step=None, phase="idle", step_time=since + 5e-6, progress=since + 49.5,
           time=since + 49.5, end_time=since + 49.5, collective_seq=11, collective_op="gloo:barrier",
           collective_active=True, hang=dict(hang, step=None), peers_gone=[0], **rank1_end)
    frames = [{"file": "/home/u/train.py", "line": 40, "function": "<module>", "user": True},
              {"file": "/usr/lib/torch/distributed/c10d.py", "line": 4100, "function": "barrier", "user": False}]
    (tmp_path / "hang.rank1.json").write_text(json.dumps({"since": since, "source": "watchdog", "stack": frames}))


def test_a_hung_job_its_launcher_tore_down_is_a_hang_not_a_death(tmp_path):
    """Before, rank 0 (killed while stuck) was the culprit of a job that "died"; the hang, which
    both watchdogs had flagged 45 s earlier, was not in the verdict."""
    _hung_then_torn_down(tmp_path, {"ended": "preempted", "end_detail": "SIGTERM"})
    report = why(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("hang", [1])
    # The job's time: the stretch stuck is hang, not the data wait rank 0's last write counted.
    bad, (attempt,) = report["job"]["badput"], report["job"]["attempts"]
    assert (attempt["ended"], attempt["detail"]) == ("hang", "stuck, then killed")
    assert render(report).splitlines()[-1] == ("attempt 0: ended hang (stuck, then killed), rank 0 first, "
                                               "last step 4, no checkpoint saved that torchtrace saw")
    assert bad["hang"] == pytest.approx(attempt["end"] - (time.time() - 60 - 0.001), abs=0.5)
    assert bad["hang"] > 49 and bad["data_wait"] == pytest.approx(0.3, abs=0.02) and bad["other"] == 0
    # Where the rank that ran its SIGTERM handler was stuck until then: the watchdog's stack.
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert ranks[1]["stack"] == ["/home/u/train.py:40 in <module>", "/usr/lib/torch/distributed/c10d.py:4100 in barrier "
                                 "[library]"]
    assert report["reason"] == ("ranks in different collectives at #11 (rank 0 gloo:all_reduce, rank 1 gloo:barrier); "
                                "behind the other ranks (step, phase); then rank 0 gone (killed while stuck), "
                                "rank 1 stopped by SIGTERM")


def test_a_hung_rank_whose_collective_finally_raised_is_still_a_hang(tmp_path):
    """The collective's own timeout (NCCL's, ten minutes by default) ends a stuck rank with an
    exception long after torchtrace flagged the hang."""
    _hung_then_torn_down(tmp_path, {"ended": "exception", "end_detail": "DistBackendError"})
    report = why(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("hang", [1])
    assert report["reason"].endswith("then rank 0 gone (killed while stuck), rank 1 ended with an exception")


def test_a_rank_that_died_while_the_others_ran_is_still_the_culprit_of_their_hang(tmp_path):
    """The order that stays a death: rank 1 was killed as it trained (no hang of its own), and
    rank 0 hung waiting for it."""
    since = time.time() - 60
    _write(tmp_path, 0, step=4, current_step=5, progress=since, step_time=since - 1, time=time.time(),
           hang={"since": since, "detected": since + 4, "step": 5})
    _write(tmp_path, 1, pid=2 ** 22 + 4321, step=4, current_step=5, phase="forward", progress=since + 0.5,
           step_time=since - 1, time=since + 0.5)
    report = why(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("died", [1])


def test_ranks_the_guard_stopped_name_the_rank_whose_own_loss_was_not_finite(tmp_path):
    """``guard="raise"`` under DDP, a NaN in rank 1's batch: every rank raises NonFiniteError at
    the same step, by the guard's agreed decision (a real torchrun run left these boxes). The
    culprit is the rank whose own loss was non-finite, not whichever raised a hair first, and
    no rank raised "in a collective that failed"."""
    for rank, loss, end in ((0, 0.0089, 0.0003), (1, "NaN", 0.0)):
        _write(tmp_path, rank, ended="exception", end_detail="NonFiniteError", step=5, current_step=None,
               phase="idle", loss=loss, end_time=time.time() - 5 + end)
    report = why(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("died", [1])
    assert report["reason"] == ("the guard (guard='raise') stopped ranks 0, 1 with NonFiniteError at step 5; "
                                "rank 1 had a non-finite loss of its own")
    # A NaN born in the backward leaves every loss finite: every rank is named.
    for rank, end in ((0, 0.0), (1, 0.0003)):
        _write(tmp_path, rank, ended="exception", end_detail="NonFiniteError", step=5, current_step=None,
               phase="idle", loss=0.01, end_time=time.time() - 5 + end)
    report = why(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("died", [0, 1])
    assert report["reason"].endswith("no rank's own loss was non-finite (its gradients were)")


def test_a_rank_in_a_long_checkpoint_save_is_the_culprit_of_the_others_wait(tmp_path):
    """Rank 1 saves a checkpoint to storage that stopped answering (its checkpoint phase has a
    long allowance: its watchdog says nothing), while rank 0 waits for it in the next step's
    all_reduce and is flagged hung. Before, rank 0 was the culprit, "stuck", of its own wait
    (a real torchrun run left these boxes)."""
    since = time.time() - 20
    _write(tmp_path, 0, progress=since, step=4, current_step=5, phase="backward", collective_seq=11,
           collective_op="gloo:all_reduce", collective_active=True, hang_timeout_s=4.0,
           hang={"since": since, "detected": since + 4, "step": 5})
    _write(tmp_path, 1, progress=since, step=4, current_step=None, phase="checkpoint", collective_seq=10,
           collective_op="gloo:all_reduce", collective_active=False, hang_timeout_s=600.0)
    report = why(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("hang", [1]), report["reason"]
    assert report["reason"] == "not inside collective #11 that the others entered"


def test_a_single_rank_stuck_says_in_what(tmp_path):
    """One process whose DataLoader worker never answers, stopped with ^C (a real run left
    such a box): the reason said only "stuck"."""
    since = time.time() - 30
    (tmp_path / "state.json").write_text(json.dumps({
        "pid": os.getpid(), "rank": 0, "world_size": 1, "attempt": 0, "ended": "preempted", "end_detail": "SIGINT",
        "time": since + 12, "progress": since + 12, "phase": "idle", "current_step": None, "step": 9,
        "step_time": since - 0.001, "hang_timeout_s": 3.0,
        "hang": {"since": since, "detected": since + 3, "step": None, "phase": "data_wait"}}))
    report = why(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("hang", [0])
    assert report["reason"] == "stuck in data_wait; then rank 0 stopped by SIGINT"


def test_a_step_that_raised_is_not_the_boxs_last_finished_step(tmp_path):
    """A hung rank's collective finally raises (gloo's own timeout): the step it raised in is
    the box's last step, but it did not finish. Before, its end after the hang was flagged read
    as the rank coming out of the hang, and the job's verdict named the rank that waited as the
    culprit of a death."""
    import torch

    import torchtrace as tt
    from torchtrace.api import get_runtime
    from torchtrace.job import ending

    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    try:
        model = torch.nn.Linear(2, 1)
        fields = get_runtime().rank_state.fields
        for i in range(3):
            if i == 2:
                fields["hang"] = {"since": finished_at, "detected": time.time(), "step": 2}  # noqa: F821
            try:
                with tt.debug_context("train_step", model=model):
                    model(torch.ones(1, 2)).sum().backward()
                    if i == 2:
                        raise RuntimeError("[gloo] Timed out waiting 12000ms for recv operation to complete")
            except RuntimeError:
                pass
            if i == 1:
                finished_at = fields["finished_time"]
        assert fields["step"] == 2 and fields["finished_time"] == finished_at
        assert ending.hung_to_the_end(fields)
    finally:
        tt.shutdown()


def _timed_out(tmp_path, flagged: bool, failed_step_as: str = "other"):
    """Boxes as a real ``torchrun`` run left them (``/tmp/probeJ/hang.py``: two DDP ranks over
    gloo, rank 1 sleeps in its data loading at step 10): rank 0 waits in the backward's
    all_reduce, collective #16, until gloo's own timeout (30 s) raises in it; then the launcher
    stops rank 1, still loading, at #15, with SIGTERM. ``flagged``: both watchdogs flagged the
    hang (a 5 s hang timeout) before gloo's timeout; else (a 10 s process-group timeout under
    the 30 s hang timeout) nobody did. ``failed_step_as``: the badput class rank 0's last write
    booked its 30 s step that raised as (skipped_step before the goodput fix)."""
    t0 = time.time() - 100
    hang = {"since": t0 + 0.0006, "detected": t0 + 5.49, "timeout_s": 5.0, "source": "watchdog"}
    rank0 = dict(ended="exception", end_detail="RuntimeError", end_step=10, step=10, current_step=None, phase="idle",
                 step_time=t0 + 30.004, finished_time=t0, end_time=t0 + 30.013, time=t0 + 30.027,
                 progress=t0 + 30.026, collective_seq=16, collective_op="gloo:all_reduce", collective_active=True,
                 started=t0 - 4.6, first_step_start=t0 - 0.61, productive_s=0.6,
                 badput_s={"startup": 4.0, "data_wait": 0.024, "skipped_step": 0.0, "other": 0.011})
    rank0["badput_s"][failed_step_as] += 30.0035
    rank1 = dict(ended="preempted", end_detail="SIGTERM", step=9, current_step=None, phase="idle",
                 step_time=t0 - 0.0008, finished_time=t0 - 0.0008, end_time=t0 + 33.448, time=t0 + 33.45,
                 progress=t0 + 33.45, collective_seq=15, collective_op="gloo:all_reduce", collective_active=False,
                 started=t0 - 4.6)
    if flagged:
        rank0.update(hang_timeout_s=5.0, hang=dict(hang, step=10, phase="collective"))
        rank1.update(hang_timeout_s=5.0, hang=dict(hang, step=None, phase="data_wait"))
    _write(tmp_path, 0, **rank0)
    _write(tmp_path, 1, **rank1)
    return rank0, rank1


@pytest.mark.parametrize("failed_step_as", ["other", "skipped_step"])
def test_a_flagged_hang_the_collectives_timeout_ended_is_hang_badput(tmp_path, failed_step_as):
    """The hang is booked from rank 0's last step that finished to the attempt's end (the 30 s
    in the all_reduce gloo's timeout ended, then the launcher's teardown), and that stretch is
    no other badput. Before, it counted from the end of the step that raised: 3.4 s of hang
    (the teardown only), and the 30 s stayed skipped_step (a real run's job section: hang
    0.009 s, skipped_step 30.0 s). Reference: the boxes' own times."""
    rank0, rank1 = _timed_out(tmp_path, flagged=True, failed_step_as=failed_step_as)
    report = why(tmp_path)
    bad, (attempt,) = report["job"]["badput"], report["job"]["attempts"]
    assert (attempt["ended"], attempt["detail"]) == ("hang", "stuck, then exception")
    assert attempt["end"] == rank1["end_time"]
    assert bad["hang"] == pytest.approx(rank1["end_time"] - rank0["finished_time"], abs=1e-6)
    # What rank 0's last write counted from its last finished step to its end (30.013 s, the
    # step that raised and the wait before it) is the hang's, taken out of the classes it was in.
    assert bad["other"] + bad["data_wait"] + bad["skipped_step"] == pytest.approx(
        0.011 + 0.024 + 30.0035 - 30.013, abs=1e-6)
    if failed_step_as == "other":
        assert bad["skipped_step"] == 0.0


def test_a_collective_timeout_shorter_than_the_hang_timeout_is_a_hang_of_the_rank_behind(tmp_path):
    """gloo's 10 s timeout ends rank 0's wait in all_reduce #16 before either watchdog's 30 s
    hang timeout flags anything; rank 1, stuck in its data loading at #15, is stopped by the
    launcher after. Before, the verdict was "died (rank 0 ended with an exception)", culprit rank
    0, the rank that waited. Reference: the boxes' collective counts (rank 1 never reached #16,
    and was alive after rank 0's end) and times."""
    rank0, rank1 = _timed_out(tmp_path, flagged=False)
    report = why(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("hang", [1])
    assert report["reason"] == ("not inside collective #16 that the others entered; then rank 0 ended with an "
                                "exception, rank 1 stopped by SIGTERM")
    bad, (attempt,) = report["job"]["badput"], report["job"]["attempts"]
    assert (attempt["ended"], attempt["detail"]) == ("hang", "stuck, then exception")
    assert bad["hang"] == pytest.approx(rank1["end_time"] - rank0["finished_time"], abs=1e-6)


@pytest.mark.parametrize("rank1_end", ["raised first", "killed"])
def test_a_collective_that_failed_because_its_peer_died_is_still_a_death(tmp_path, rank1_end):
    """The same boxes, but rank 1 ended before rank 0's collective failed: it raised an error of
    its own in its data loading, or was SIGKILLed there (its pid gone, its last heartbeat before
    rank 0's end). Rank 0's collective failed for want of a dead peer, not of a stuck one: the
    verdict stays died, culprit rank 1."""
    rank0, rank1 = _timed_out(tmp_path, flagged=False)
    if rank1_end == "raised first":
        _write(tmp_path, 1, **dict(rank1, ended="exception", end_detail="ValueError", end_time=rank0["end_time"] - 20,
                                   time=rank0["end_time"] - 20))
    else:
        _write(tmp_path, 1, **dict(rank1, pid=2 ** 22 + 4321, ended=None, end_detail=None, end_time=None,
                                   time=rank0["end_time"] - 20))
    report = why(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("died", [1]), report["reason"]
    assert report["job"]["attempts"][0]["ended"] == ("exception" if rank1_end == "raised first" else "killed")


def test_an_attempts_last_step_is_rank_0s_as_its_lost_steps_are(tmp_path):
    """torchrun restarted a DDP job whose rank 1 was SIGKILLed in step 17 (``/tmp/probeJ``'s
    restart.py --how kill): rank 1's box, last rewritten after step 14, is up to a writer period
    old; rank 0 finished step 17, then raised in the barrier after it. Before, the attempt's line
    took the killed rank's stale step ("last step 14, last checkpoint at step 14": nothing lost)
    while its lost_steps, from rank 0's box as docs/jobs.md says, were 3. Reference: rank 0's
    box's step and checkpoint."""
    (tmp_path / "a0").mkdir()
    (tmp_path / "a2").mkdir()
    now = time.time()
    rank0 = _write(tmp_path / "a0", 0, ended="exception", end_detail="RuntimeError", step=17, current_step=None,
                   phase="idle", step_time=now - 20.4, end_time=now - 20.35, time=now - 20.34, checkpoint_step=14,
                   checkpoint_time=now - 20.73, started=now - 30)
    _write(tmp_path / "a0", 1, pid=2 ** 22 + 4321, step=14, current_step=None, phase="idle", step_time=now - 20.73,
           time=now - 20.72, started=now - 30)  # gone: killed
    for rank in (0, 1):
        _write(tmp_path / "a2", rank, attempt=2, ended="completed", step=14, current_step=None, phase="idle",
               step_time=now - 1, end_time=now - 0.5, time=now - 0.5, started=now - 10)
    report = why(tmp_path)
    attempt = report["job"]["attempts"][0]
    assert attempt["cause"]["rank"] == 1 and attempt["cause"]["last_step"] == 14
    assert (attempt["last_step"], attempt["lost_steps"]) == (rank0["step"], rank0["step"] - rank0["checkpoint_step"])
    assert render(report).splitlines()[-2] == (
        "attempt 0: ended killed (no shutdown and no signal handler ran (SIGKILL, a crash of the interpreter, or "
        "os._exit)), rank 1 first, last step 17, last checkpoint at step 14")


def test_a_step_that_raised_is_told_as_raised_not_finished(tmp_path):
    """Rank 0's step 10 raised (gloo's timeout in its all_reduce): its box's last step, but not
    a finished one. Before, its line said "step 10 (finished)". Reference: the box's own times
    (its last step ended after its last step that finished)."""
    _timed_out(tmp_path, flagged=False)
    lines = {line.split(":")[0]: line for line in render(why(tmp_path)).splitlines()}
    assert lines["rank 0"] == ("rank 0: ended exception (RuntimeError), step 10 (raised), collective #16 "
                               "gloo:all_reduce in progress")
    assert lines["rank 1 [culprit]"].startswith("rank 1 [culprit]: ended preempted (SIGTERM), step 9 (finished), ")


def test_the_timed_out_ranks_own_report_already_tells_the_hang(tmp_path):
    """Rank 0 writes its report.json as it ends, while rank 1 still sleeps in its data loading
    (alive, its box last rewritten up to 0.5 s before rank 0's end): the job section it writes
    tells the hang already. Before (a real run), it said the attempt ended with an exception,
    and its 10 s in the timed-out all_reduce were other badput, no hang. Reference: the boxes'
    own times."""
    rank0, rank1 = _timed_out(tmp_path, flagged=False)
    _write(tmp_path, 1, **dict(rank1, ended=None, end_detail=None, end_time=None, time=rank0["end_time"] - 0.3,
                               progress=rank1["step_time"], phase="data_wait"))
    report = why(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("hang", [1])
    bad, (attempt,) = report["job"]["badput"], report["job"]["attempts"]
    assert (attempt["ended"], attempt["end"]) == ("hang", rank0["end_time"])
    assert bad["hang"] == pytest.approx(rank0["end_time"] - rank0["finished_time"], abs=1e-6)


def test_a_path_that_is_not_a_run_is_refused_not_called_running(tmp_path, capsys):
    """``why /``, ``why`` of a plain folder or of a file said ``verdict: running (no black box
    found)``: a job that is not there is not running."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "file.txt").write_text("x")
    for path in (tmp_path / "notes", tmp_path / "file.txt"):
        for json_flag in ([], ["--json"]):
            assert main(["why", str(path), *json_flag]) == 2
            out, err = capsys.readouterr()
            assert out == "" and "holds no black box" in err and "not a run directory" in err, err
