"""A restart with the same run id never mixes attempts (issue 53, item 3): each attempt writes
its own files, a torn last line never gets the next line glued on, and ``torchtrace report``
tells the attempts apart."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.job.helpers import clean_env
from torchtrace import files

_STEPS = textwrap.dedent("""
    import os, signal, sys, torchtrace as tt
    tt.configure(prometheus_port="off")
    for i in range(int(sys.argv[1])):
        with tt.debug_context("train_step"):
            pass
    if sys.argv[2] == "kill":
        tt.flush()
        os.kill(os.getpid(), signal.SIGKILL)
""")


# Each run is a process of its own, forked from one that has imported torchtrace and done
# nothing else (importing torch was most of a run's time: 2-3 s each on a loaded 2-core
# machine). The child takes the run's environment, runs _STEPS as ``python -c`` would, and ends
# as such a process does: killed by _STEPS, or at the end of the script (its threads joined,
# its exit handlers run).
_FORKER = textwrap.dedent("""
    import json, os, sys
    import torchtrace
    for line in sys.stdin:
        run = json.loads(line)
        pid = os.fork()
        if pid == 0:
            break
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
    else:
        raise SystemExit(0)
    os.environ.clear()
    os.environ.update(run["env"])
    for fd, path in ((1, run["stdout"]), (2, run["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["-c", *run["argv"]]
    exec(compile(run["script"], "<string>", "exec"), {"__name__": "__main__"})
""")


class _Runs:
    """Runs of _STEPS, each a process forked from one started once (see _FORKER)."""

    def __init__(self, where, timeout_s: float = 300.0) -> None:
        self.where, self.timeout_s = where, timeout_s
        self.count = 0
        # (a session of its own: the forked runs share its process group, which close() ends)
        self.forker = subprocess.Popen([sys.executable, "-c", _FORKER], env=clean_env(), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, start_new_session=True)

    def __call__(self, env, steps, end="exit") -> subprocess.CompletedProcess:
        self.count += 1
        out, err = self.where / f"run-{self.count}.out", self.where / f"run-{self.count}.err"
        run = {"env": env, "argv": [str(steps), end], "script": _STEPS, "stdout": str(out), "stderr": str(err)}
        self.forker.stdin.write(json.dumps(run) + "\n")
        self.forker.stdin.flush()
        # (one line per run, read whole: nothing is left in the pipe's buffer between runs)
        ready, _, _ = select.select([self.forker.stdout], [], [], self.timeout_s)
        if not ready:
            self.close()
            raise subprocess.TimeoutExpired(run["argv"], self.timeout_s, err.read_text())
        answer = self.forker.stdout.readline()
        assert answer, f"the forking process ended with {self.forker.wait()}"
        return subprocess.CompletedProcess(run["argv"], int(answer), out.read_text(), err.read_text())

    def close(self) -> None:
        """End the forking process and any run still going."""
        try:
            self.forker.stdin.close()
            self.forker.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.forker.pid, signal.SIGKILL)
            self.forker.wait()


@pytest.fixture
def run(tmp_path_factory):
    runs = _Runs(tmp_path_factory.mktemp("runs"))
    yield runs
    runs.close()


def test_a_file_with_a_torn_tail_gets_a_fresh_line(tmp_path):
    path = tmp_path / "spans.jsonl"
    path.write_bytes(b'{"whole": 1}\n{"torn": ')  # what a process killed mid-write leaves
    out = files.JsonLinesFile(path, 1 << 20)
    assert out.write_many([{"next": 2}]) == 1
    out.close()
    assert path.read_bytes() == b'{"whole": 1}\n{"torn": \n{"next": 2}\n'
    assert files.read_json_lines(path) == [{"whole": 1}, {"next": 2}]


def test_a_restart_with_the_same_run_id_writes_files_of_its_own(tmp_path, run):
    env = clean_env(TORCHTRACE_RUN_ID="same", TORCHTRACE_RUN_DIR=str(tmp_path))
    first = run(env, 4, "kill")
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    root = tmp_path / "same"
    with open(root / "spans.jsonl", "ab") as fh:
        fh.write(b'{"name": "train_step", "torn')  # the killed exporter's last write, cut short
    before = (root / "spans.jsonl").read_bytes()
    second = run(env, 3)
    assert second.returncode == 0, second.stderr[-2000:]
    assert (root / "spans.jsonl").read_bytes() == before  # attempt 0's file is left as it was
    assert not (root / "report.json").exists()  # the killed attempt wrote none; nobody wrote it since
    spans = files.read_json_lines(root / "attempt-1" / "spans.jsonl")
    assert len(spans) == 3
    assert {(s["resource"]["torchtrace.job_id"], s["resource"]["torchtrace.attempt"]) for s in spans} == {("same", 1)}
    report = json.loads((root / "attempt-1" / "report.json").read_text())
    assert report["totals"]["steps"] == 3 and report["telemetry"]["spans_exported"] == 3
    assert [(a["attempt"], a["ended"]) for a in report["job"]["attempts"]] == [(0, "killed"), (1, "completed")]
    # The next attempt tells how the one before ended: in its log and its report's events.
    assert "this is attempt 1; attempt 0 of job same ended killed at step 3" in second.stderr
    (told,) = [e for e in report["events"] if e["type"] == "previous_attempt"]
    assert (told["data"]["ended"], told["data"]["last_step"]) == ("killed", 3)
    # A third, completed run again: attempt-2, and attempt-1's report is not overwritten.
    assert run(env, 2).returncode == 0
    assert json.loads((root / "attempt-1" / "report.json").read_text())["totals"]["steps"] == 3
    assert json.loads((root / "attempt-2" / "report.json").read_text())["totals"]["steps"] == 2


def test_torchtrace_report_tells_the_attempts_apart(tmp_path, run, capsys):
    from torchtrace.cli import main as cli_main

    env = clean_env(TORCHTRACE_RUN_ID="rep", TORCHTRACE_RUN_DIR=str(tmp_path))
    assert run(env, 5).returncode == 0
    assert run(env, 2).returncode == 0
    root = tmp_path / "rep"

    def report(path):
        # (in this process: the command's code is the same, without a second import of torch;
        # tests/test_cli.py runs the report command as a user does)
        capsys.readouterr()
        assert cli_main(["report", str(path)]) == 0
        return capsys.readouterr().out

    first, second = report(root), report(root / "attempt-1")
    assert "steps: 5" in first and "steps: 2" in second
    assert "2 attempt(s); this report shows attempt 0 only" in first
    assert "this report shows attempt 1 only" in second
    assert "attempt 0 (.): completed at step 4" in second and "attempt 1 (attempt-1/): completed at step 1" in second


def test_one_run_without_restarts_keeps_todays_names(tmp_path, run):
    env = clean_env(TORCHTRACE_RUN_ID="one", TORCHTRACE_RUN_DIR=str(tmp_path))
    assert run(env, 2).returncode == 0
    names = sorted(p.name for p in (tmp_path / "one").iterdir() if not p.name.startswith("."))
    assert names == ["report.json", "spans.jsonl", "state.json"]  # (no hang: no stack file left behind)
    assert os.path.getsize(tmp_path / "one" / "state.json") < 4096


def test_the_job_series_on_metrics(tmp_path):
    import torchtrace as tt
    from tests.helpers import scrape, value

    for attempt in range(2):
        result = tt.configure(prometheus_port=0, run_dir=str(tmp_path), run_id="m", register_atexit=False)
        if attempt == 0:
            # Attempt 0 is over once its process is: a black box of a pid that is gone.
            box = json.loads((tmp_path / "m" / "state.json").read_text())
            tt.shutdown()
            box.update(pid=2**22 + 1, ended=None)
            (tmp_path / "m" / "state.json").write_text(json.dumps(box))
    for step in range(3):
        with tt.debug_context("train_step"):
            time.sleep(0.01)
    time.sleep(0.7)  # (the black box's writer refreshes the attempt's goodput every 0.5 s)
    samples = scrape(result.metrics_url)
    assert value(samples, "torchtrace_job_attempt") == 1
    assert 0 < value(samples, "torchtrace_job_goodput_ratio") < 1
    assert value(samples, "torchtrace_checkpoint_seconds_count", kind="save") == 0
    tt.shutdown()


def test_the_html_report_draws_the_attempts(tmp_path, run):
    from torchtrace.reporting.htmlreport import html_report

    env = clean_env(TORCHTRACE_RUN_ID="html", TORCHTRACE_RUN_DIR=str(tmp_path))
    assert run(env, 3, "kill").returncode == -signal.SIGKILL
    assert run(env, 2).returncode == 0
    page = html_report(tmp_path / "html" / "attempt-1")
    assert 'id="tt-job"' in page and page.count('class="tt-attempt"') == 2
    assert "attempt 0: killed at step 2" in page and "attempt 1: completed at step 1" in page
    # A run that never restarted gets the same card with its one attempt.
    assert run(clean_env(TORCHTRACE_RUN_ID="one", TORCHTRACE_RUN_DIR=str(tmp_path)), 2).returncode == 0
    assert html_report(tmp_path / "one").count('class="tt-attempt"') == 1
