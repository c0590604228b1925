"""The stacks of a rank's forked children (its DataLoader workers), asked for at a hang.

Real forks: a child made while the file is watched dumps its stack on the signal; a child
that replaced itself by ``exec`` since (its handler gone: the signal would end it) and a
process that is not this one's child are never signalled. The end-to-end case (a DataLoader
worker stuck in ``__getitem__``, seen in the hang file, the stack file and ``torchtrace
why``) is in tests/job/test_hangs.py."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from torchtrace.job import workers
from torchtrace.job.workers import WORKERS

pytestmark = pytest.mark.skipif(workers.SIGNAL is None or not hasattr(os, "register_at_fork"),
                                reason="real-time signals and fork: Linux")


def stuck_in_a_read(ready) -> None:
    ready.set()
    while True:
        time.sleep(0.2)  # a read from a store that never answers


def _wait_announced(path, pid: int) -> None:
    deadline = time.monotonic() + 10
    while f"torchtrace worker {pid} " not in path.read_text():
        assert time.monotonic() < deadline, path.read_text()
        time.sleep(0.02)


@pytest.fixture
def watched(tmp_path):
    assert WORKERS.file is None  # (no runtime of another test watches)
    path = tmp_path / "workers.txt"
    WORKERS.watch(path)
    yield path
    WORKERS.unwatch()


def test_a_forked_child_is_asked_where_it_is(watched):
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    child = context.Process(target=stuck_in_a_read, args=(ready,), daemon=True)
    child.start()
    try:
        assert ready.wait(10)
        _wait_announced(watched, child.pid)
        time.sleep(0.3)  # (past ready.set(), in its loop)
        [found] = WORKERS.collect(None)
        assert found["pid"] == child.pid
        assert (found["where"]["file"], found["where"]["function"]) == (__file__, "stuck_in_a_read")
        assert "time.sleep" in open(__file__).read().splitlines()[found["where"]["line"] - 1]
        # Only the child's own frames: not this test's, which forked it.
        assert not any(f["function"].startswith("test_") for f in found["stack"])
        assert child.is_alive()
    finally:
        child.kill()
        child.join(10)
    WORKERS.unwatch()
    assert watched.exists()  # a file that holds a stack asked for stays


def test_a_child_that_exec_ed_or_is_not_ours_is_never_signalled(watched):
    pid = os.fork()
    if pid == 0:  # the child: announced by the fork hook, then another program
        os.execv("/bin/sleep", ["sleep", "30"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _wait_announced(watched, pid)
        with open(watched, "a") as fh:  # a process that is not a forked child of ours, announced all the same
            fh.write(f"torchtrace worker {other.pid} 1\n")
        time.sleep(0.3)  # (the exec has happened)
        assert WORKERS.collect(None) == []
        assert os.waitpid(pid, os.WNOHANG) == (0, 0) and other.poll() is None  # both still run
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        other.kill()
        other.wait(10)


def test_a_run_that_asked_nothing_leaves_no_file(watched):
    context = multiprocessing.get_context("fork")
    child = context.Process(target=time.sleep, args=(0.1,))
    child.start()
    child.join(10)
    assert watched.exists()
    WORKERS.unwatch()
    assert not watched.exists()
