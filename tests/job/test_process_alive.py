"""Whether the process that wrote a black box still runs: one answer for the job's verdict
(``culprit``), a rank's end (``ending``) and a restart's attempt number (``identity``).

Two processes a pid can name without being the writer: a zombie (ended, not yet reaped by
its launcher) and a new process that was given the dead writer's pid. Both are gone.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from torchtrace.job import culprit
from torchtrace.job.ending import how_ended
from torchtrace.job.identity import choose_attempt, process_alive, process_start_time


@pytest.fixture
def zombie():
    """A child that has ended and is not reaped: its pid still names a process table entry."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    started = process_start_time(pid)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                break
        time.sleep(0.01)
    else:
        pytest.fail("the child did not end")
    yield {"pid": pid, "process_started": started, "time": time.time(), "ended": None, "rank": 0}
    os.waitpid(pid, 0)


def _box(**fields):
    return {"pid": os.getpid(), "process_started": process_start_time(), "time": time.time(), "ended": None,
            "rank": 0, **fields}


def test_the_writer_running_is_alive():
    assert process_alive(_box()) is True
    assert how_ended(_box()) == (None, None)
    assert culprit.condition(_box(phase="forward", progress=time.time(), hang_timeout_s=60.0), time.time()) \
        == "running"


def test_a_zombie_writer_is_gone(zombie):
    assert process_alive(zombie) is False
    assert how_ended(zombie)[0] == "killed"
    assert culprit.condition(zombie, time.time()) == "gone"


def test_a_pid_that_names_another_process_now_is_gone():
    reused = _box(process_started=process_start_time() - 3600.0)  # this pid, an hour before this process
    assert process_alive(reused) is False
    assert how_ended(reused)[0] == "killed"
    assert culprit.condition(reused, time.time()) == "gone"


def test_a_writer_of_another_host_cannot_be_asked():
    elsewhere = _box(host=socket.gethostname() + "-elsewhere", pid=2 ** 22 + 12345)
    assert process_alive(elsewhere) is None
    assert how_ended(elsewhere) == (None, None)  # its heartbeat is fresh: running, as far as anyone here knows
    assert culprit.condition(elsewhere, time.time()) != "gone"


def test_a_restart_finds_the_zombie_writers_slot_taken(tmp_path, zombie):
    """A torchrun restart whose earlier rank is a zombie not reaped yet: the box is an earlier
    attempt's, so the new process takes the next attempt."""
    (tmp_path / "state.json").write_text(json.dumps(zombie), encoding="utf-8")
    assert choose_attempt(tmp_path, "state.json") == 1
