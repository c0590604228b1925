"""Hangs across ranks (docs/hangs.md): a real ``torchrun`` job of 3 ranks, gloo, DDP on CPU.

Rank 2 stops in its input code before its forward while ranks 0 and 1 wait in DDP's
gradient all-reduce; then, in a second job, rank 2 is SIGKILLed mid-step. ``torchtrace why``
must name rank 2 from the run directory alone, with its stack, and show the others inside
the collective with its sequence number; after the kill, ranks 0 and 1 each record rank 2 in
their black box's ``peers_gone``.
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

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("hang_ddp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, tmp: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_", "TORCH_FR"))}
    env.update(PYTHONPATH=str(ROOT), HANG_MODE=mode, HANG_RUN_DIR=str(tmp / "runs"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=3",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{_free_port()}", f"--rdzv_id=hang-{mode}",
           "--max_restarts=0", str(WORKER)]
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _why(tmp: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "torchtrace.cli", "why", str(tmp / "runs"), "--json"],
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _end(proc: subprocess.Popen, tmp: Path) -> tuple[str, str]:
    """Kill torchrun and its workers (their pids are in the black boxes: torchrun gives each
    worker a process group of its own)."""
    pids = [proc.pid]
    for path in (tmp / "runs").glob("*/state.rank*.json"):
        try:
            pids.append(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.communicate(timeout=60)


@pytest.mark.timeout(240)
def test_rank_stuck_in_its_input_is_named_while_the_others_wait_in_the_all_reduce(tmp_path):
    proc = _launch("stop", tmp_path)
    try:
        deadline = time.monotonic() + 150
        while len(list((tmp_path / "runs").glob("*/hang.rank*.json"))) < 3:
            assert time.monotonic() < deadline, "three hang files not written in time"
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        report = _why(tmp_path)  # while the job is still hung
        assert report["verdict"] == "hang"
        assert report["culprit_ranks"] == [2]
        ranks = {r["rank"]: r for r in report["ranks"]}
        culprit = ranks[2]
        assert culprit["phase"] == "data_wait" and culprit["step"] == 8 and culprit["in_step"]
        assert culprit["stack"][0].startswith(f"{WORKER}:") and culprit["stack"][0].endswith("in make_batch")
        for r in (0, 1):
            # Inside DDP's all-reduce (issued from C++, seen through the flight recorder).
            assert ranks[r]["phase"] == "collective" and ranks[r]["collective"]["active"]
            assert ranks[r]["collective"]["op"] == "gloo:all_reduce"
            assert ranks[r]["collective"]["seq"] > culprit["collective"]["seq"]
            assert ranks[r]["step"] == 8
        assert ranks[0]["collective"]["seq"] == ranks[1]["collective"]["seq"]
        # Every rank's watchdog named the same culprit, from the black boxes alone.
        for r in (0, 1, 2):
            finding = json.loads(next((tmp_path / "runs").glob(f"*/hang.rank{r}.json")).read_text())
            assert finding["peers"]["culprit_ranks"] == [2]
            assert finding["stalled_s"] < 4.0 + 4.0  # hang_timeout_s=4, ticks of 1 s
        # The launcher tears the hung job down: SIGTERM, which rank 2 (in Python) handles, and
        # SIGKILL for ranks 0 and 1, stuck in the C all-reduce where no handler runs. It was a
        # hang, and stays one (before, the killed ranks were the culprits of a job that "died").
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        report = _why(tmp_path)
        assert (report["verdict"], report["culprit_ranks"]) == ("hang", [2]), report["reason"]
        assert "; then " in report["reason"] and "2 stopped by SIGTERM" in report["reason"], report["reason"]
    finally:
        _end(proc, tmp_path)


@pytest.mark.timeout(240)
def test_a_rank_in_a_checkpoint_save_that_never_ends_is_named_while_the_others_wait(tmp_path):
    """Its checkpoint phase has a long allowance (its own watchdog says nothing for minutes),
    but the others wait for it in the next all_reduce: it is the culprit, not they."""
    proc = _launch("save", tmp_path)
    try:
        deadline = time.monotonic() + 150
        while len(list((tmp_path / "runs").glob("*/hang.rank*.json"))) < 2:
            assert time.monotonic() < deadline, "two hang files not written in time"
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        report = _why(tmp_path)
        assert (report["verdict"], report["culprit_ranks"]) == ("hang", [2]), report["reason"]
        ranks = {r["rank"]: r for r in report["ranks"]}
        assert ranks[2]["phase"] == "checkpoint" and ranks[2]["condition"] == "running"
        assert report["reason"].startswith("not inside collective #")
    finally:
        _end(proc, tmp_path)


@pytest.mark.timeout(240)
def test_rank_sigkilled_mid_step_is_named_gone_by_the_others(tmp_path):
    proc = _launch("kill", tmp_path)
    try:
        proc.wait(timeout=150)
    finally:
        out, err = _end(proc, tmp_path)
    assert proc.returncode != 0
    report = _why(tmp_path)
    assert report["verdict"] == "died"
    assert report["culprit_ranks"] == [2], report["reason"]
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert ranks[2]["condition"] == "gone" and ranks[2]["ended"] is None
    states = {json.loads(p.read_text())["rank"]: json.loads(p.read_text())
              for p in (tmp_path / "runs").glob("*/state.rank*.json")}
    # The others named it gone themselves: their collective failed when its socket closed,
    # and whatever ended them then (the exception, torchrun's SIGTERM, shutdown) looked at the
    # peers before its last write, however soon after the kill.
    for r in (0, 1):
        assert states[r].get("peers_gone") == [2], {q: (s.get("ended"), s.get("peers_gone")) for q, s in states.items()}
    assert [a["ended"] for a in report["job"]["attempts"]] == ["killed"]
