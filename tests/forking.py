"""Processes forked from one that has done the slow imports once (torch: 2-3 s a process on a
loaded 2-core machine), for tests that need a fresh process per case.

``FORK_RUN`` is Python source to put in such a parent's script: ``fork_run(target, *args)``
runs ``target(*args)`` in a forked child, its output in files of its own, and returns
``{"returncode", "stdout", "stderr"}``; a child that raises prints its traceback and returns
1. The child ends with ``os._exit``: nothing of the parent's runs in it after the target.
:func:`run_group` starts the parent in a process group of its own and ends the whole group
when it is done or out of time, so a child that hangs does not outlive the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Sequence

FORK_RUN = r'''
def fork_run(target, *args):
    import os, sys, tempfile, traceback
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush(); sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
            code = 0
            try:
                target(*args)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0); err.seek(0)
        return {"returncode": os.waitstatus_to_exitcode(status), "stdout": out.read(), "stderr": err.read()}
'''


def run_group(cmd: Sequence[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)``, with
    ``cmd`` and every process it forks in a process group that is killed at the end."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        # (a child still running: hung, or left behind by a parent that ended early)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
