"""A real OOM kill: a training process in a memory-limited cgroup is killed by the kernel, and
its black box and the cgroup's count tell a host OOM kill from any other SIGKILL.

Needs root and a writable memory cgroup (v1: ``memory.limit_in_bytes``; v2: ``memory.max``);
skipped with the reason elsewhere, but failed when TORCHTRACE_REQUIRE_SERVERS=1 (CI).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.conftest import servers_required
from tests.job.helpers import clean_env
from torchtrace.job.ending import HOST_OOM
from torchtrace.job.story import job_story

LIMIT = 700 * 1024 * 1024

_GREEDY = textwrap.dedent("""
    import sys, time, torch, torchtrace as tt
    tt.configure(prometheus_port="off")
    hoard = []
    for step in range(10_000):
        with tt.debug_context("train_step", step=step):
            hoard.append(torch.ones(5 * 1024 * 1024))  # 20 MB a step, kept: memory runs away
            time.sleep(0.1)
""")


def _unavailable(reason: str) -> None:
    if servers_required():
        pytest.fail(f"the OOM test must run in CI: {reason}")
    pytest.skip(reason)


@contextlib.contextmanager
def _memory_cgroup(limit: int):
    """A fresh memory cgroup with ``limit`` bytes: yields the file a process writes its pid to."""
    if os.geteuid() != 0:
        _unavailable("creating a cgroup needs root")
    name = f"torchtrace-oom-{uuid.uuid4().hex[:8]}"
    v1 = Path("/sys/fs/cgroup/memory")
    v2 = Path("/sys/fs/cgroup")
    if (v1 / "memory.limit_in_bytes").exists():
        group = v1 / name
        limit_file, extra = "memory.limit_in_bytes", ("memory.memsw.limit_in_bytes",)
    elif (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.controllers").read_text().split():
        group = v2 / name
        limit_file, extra = "memory.max", ("memory.swap.max",)
        try:
            (v2 / "cgroup.subtree_control").write_text("+memory")
        except OSError:
            pass
    else:
        _unavailable("no memory cgroup controller is mounted (v1 memory or v2 with memory)")
    try:
        group.mkdir()
        (group / limit_file).write_text(str(limit))
    except OSError as exc:
        _unavailable(f"cannot create a memory cgroup here: {exc}")
    for name in extra:  # no swap to escape into, where the knob exists
        with contextlib.suppress(OSError):
            (group / name).write_text(str(limit) if name.endswith("limit_in_bytes") else "0")
    try:
        yield group / "cgroup.procs"
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()


def _run_in_cgroup(code: str, run_dir: Path, run_id: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``code`` in a fresh process inside a memory cgroup of :data:`LIMIT` bytes; its
    result, and the job's story read while the cgroup is there (the next attempt of a
    restarted container runs in it)."""
    env = clean_env(TORCHTRACE_RUN_ID=run_id, TORCHTRACE_RUN_DIR=str(run_dir))
    with _memory_cgroup(LIMIT) as procs:
        def enter_cgroup():
            procs.write_text(str(os.getpid()))

        proc = subprocess.run([sys.executable, "-c", code], env=env, preexec_fn=enter_cgroup,
                              capture_output=True, text=True, timeout=600)
        return proc, job_story(run_dir / run_id)


def test_a_host_oom_kill_is_named(tmp_path):
    proc, story = _run_in_cgroup(_GREEDY, tmp_path / "runs", "oom")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    (attempt,) = story["attempts"]
    assert attempt["ended"] == "killed"
    assert attempt["detail"].startswith(HOST_OOM), attempt["detail"]
    assert attempt["last_step"] is not None and attempt["last_step"] > 0


def test_a_plain_sigkill_is_not_an_oom_kill(tmp_path):
    run_dir = tmp_path / "runs"
    env = clean_env(TORCHTRACE_RUN_ID="plain", TORCHTRACE_RUN_DIR=str(run_dir))
    code = textwrap.dedent("""
        import os, signal, time, torchtrace as tt
        tt.configure(prometheus_port="off")
        time.sleep(0.7)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    (attempt,) = job_story(run_dir / "plain")["attempts"]
    assert attempt["ended"] == "killed" and HOST_OOM not in attempt["detail"]


_GREEDY_WORKER = textwrap.dedent("""
    import time, torch, torchtrace as tt
    tt.configure(prometheus_port="off")

    class Hoarding(torch.utils.data.Dataset):
        def __init__(self):
            self.hoard = []

        def __len__(self):
            return 10_000

        def __getitem__(self, i):
            self.hoard.append(torch.ones(5 * 1024 * 1024))  # 20 MB an item, kept in the worker
            return torch.randn(4)

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in torch.utils.data.DataLoader(Hoarding(), batch_size=None, num_workers=1):
        with tt.debug_context("train_step", model=model, optimizer=opt):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            time.sleep(0.05)
""")


def test_a_dataloader_worker_the_kernel_killed_is_named_beside_the_exception(tmp_path):
    """The kernel kills the DataLoader worker that hoards memory; the training process gets
    PyTorch's ``RuntimeError: DataLoader worker (pid N) is killed by signal`` (or ``exited
    unexpectedly``, or a ``ConnectionResetError`` from the dead worker's socket) and ends with
    it. Its end says the exception and that the kernel counted an OOM kill in its cgroup while
    it ran (the message itself is not recorded by default)."""
    proc, story = _run_in_cgroup(_GREEDY_WORKER, tmp_path / "runs", "worker-oom")
    assert proc.returncode == 1, proc.stderr[-2000:]
    (attempt,) = story["attempts"]
    assert attempt["ended"] == "exception", attempt
    # What the parent raises depends on when it notices: the worker's death (RuntimeError), or
    # a connection the killed worker held (ConnectionResetError, while a batch was passed).
    error, note = attempt["detail"].split("; ", 1)
    assert error in ("RuntimeError", "ConnectionResetError"), (attempt["detail"], proc.stderr[-2000:])
    assert note.startswith("the kernel counted 1 OOM kill in the memory cgroup while it ran"), attempt["detail"]
