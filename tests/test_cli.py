"""The demo command, as a user runs it: a real subprocess, in a pipe and in a pseudo-terminal."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pty
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtrace.cli import main as cli_main
from torchtrace.cli.console import CLEAR_LINE, Console, logs_through
from torchtrace.cli.demo import Fault, check_faults, parse_fault

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def demo(tmp_path, *args: str, timeout: float = 110) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchtrace.cli", "demo", "--port", "0", "--run-dir",
                           str(tmp_path / "runs"), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env=ENV)


def only_run(tmp_path) -> Path:
    (run,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    return run


@pytest.mark.timeout(150)
def test_demo_tells_the_story_in_a_pipe(tmp_path):
    proc = demo(tmp_path, "--steps", "120", "--inject", "nan@50", "--inject", "explode@80")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "\r" not in out and "\x1b" not in out  # no bar drawn into a pipe
    # what is measured, and where to watch, before the first step
    assert "measured every step: the loss; the global and per-tensor gradient norms" in out
    assert "samples, FLOPs (counted once per input shape), learning rate" in " ".join(out.split())
    page = re.search(r"live page:  (http://127\.0\.0\.1:\d+/)\n  token:      (\S+)", out)
    assert page and len(page.group(2)) >= 32, out
    assert out.index("token:") < out.index("step 19 (20/120 done)")
    # the NaN: found at its step, its producer named, the update skipped, training recovering, in that order
    lines = out.splitlines()
    found = next(i for i, l in enumerate(lines) if "step 50: NaN found (" in l and "). Forensic replay: born in layer "
                                                     "`norm` (InputNorm)" in l)
    skipped = next(i for i, l in enumerate(lines) if "step 50: update skipped (guard skip)" in l)
    recovered = next(i for i, l in enumerate(lines) if re.search(r">> step 51: training recovered: loss \d", l))
    progress_before = next(i for i, l in enumerate(lines) if l.startswith("  step 39 (40/120 done)"))
    progress_after = next(i for i, l in enumerate(lines) if l.startswith("  step 59 (60/120 done)"))
    assert progress_before < found < skipped < recovered < progress_after  # each event when it happens
    assert "WARNING torchtrace: step 80 train_step: grad_explosion: " in out  # torchtrace's own log lines, whole
    # the NaN story is told once: the narration's line, with what was non-finite, and no raw
    # ERROR/WARNING log line about the same step (nor a continuation saying it again)
    about_the_nan = [l for l in lines[progress_before:progress_after] if re.search(r"\bstep 50\b", l) and re.search(r"nan|nonfinite|forensic", l, re.I)]
    assert len(about_the_nan) == 1 and about_the_nan[0] == lines[found], about_the_nan
    assert "(nonfinite_grad, nonfinite_loss, nonfinite_output)" in lines[found], lines[found]
    assert not [l for l in lines if l.startswith(("ERROR", "WARNING")) and re.search(r"nonfinite|forensics", l)]
    # the summary: anomaly kinds on their own row
    assert re.search(r"\n  anomalies by kind  grad_explosion \d+, .*nonfinite_loss 1", out)
    assert "\n  forensic replays   1 (budget 3)\n" in out and "\n  skipped updates    1\n" in out
    # where to look next: a report command that works as printed
    cmd = re.search(r"HTML report:  (.+)\n", out).group(1)
    assert cmd.endswith(" --html report.html") and only_run(tmp_path).name in cmd
    rep = subprocess.run(shlex.split(cmd), cwd=tmp_path, capture_output=True, text=True, timeout=60, env=ENV)
    assert rep.returncode == 0, rep.stderr
    assert "forensic reports: 1" in rep.stdout and (tmp_path / "report.html").stat().st_size > 10_000
    # the files agree
    report = json.loads((only_run(tmp_path) / "report.json").read_text())
    assert report["totals"]["steps"] == 120 and report["totals"]["skipped_steps"] == 1
    assert report["forensics"]["replays"] == 1
    (f,) = report["forensics"]["reports"]
    assert (f["step"], f["cause"], f["module"], f["module_type"]) == (50, "forward", "norm", "InputNorm")
    assert report["anomalies_by_kind"]["grad_explosion"] >= 1
    spans = [json.loads(l) for l in (only_run(tmp_path) / "spans.jsonl").read_text().splitlines()]
    assert len(spans) == 120
    assert [s["attributes"]["torchtrace.step"] for s in spans if s["status"] == "ERROR"] == [50]
    # the summary's throughput row: the run's own window, against a plain count over its last 20 spans
    row = re.search(r"\n  throughput +([\d,]+) samples/s, [\d.,]+ [kMGTP]?FLOP/s, no MFU \(this device's peak is unknown",
                    out)
    tp = report["throughput"]["operations"]["train_step"]
    assert row and int(row.group(1).replace(",", "")) == round(tp["samples_per_s"]), out
    # A step's cycle is its data wait plus its duration: from the end of the step before to its
    # own end. (A span's start is stamped before torchtrace's own start of the step, which the
    # data wait also holds: span time plus data wait counts that twice, 4.7 % under load.)
    last = spans[-20:]
    cycles = sum(b["end_unix_ns"] - a["end_unix_ns"] for a, b in zip(spans[-21:], last)) / 1e9
    assert tp["samples_per_s"] == pytest.approx(sum(s["attributes"]["torchtrace.samples"] for s in last) / cycles,
                                                 rel=0.01)
    # ... and where the wall time went: the skipped update and the replay among the rest
    # (the rest comes largest first: startup leads when it holds torch's first imports, not always)
    goodput = re.search(r"\n  goodput +\d+% of wall time in applied updates; the rest: (.*)\n", out)
    assert goodput, out
    assert {"startup", "forensics", "skipped_step"} <= {part.split()[0] for part in goodput.group(1).split(", ")}


@pytest.mark.timeout(120)
def test_demo_names_an_input_nan_as_a_data_problem(tmp_path):
    proc = demo(tmp_path, "--steps", "12", "--inject", "nan-input@5", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"step 5: NaN found \(nonfinite_\w+(, nonfinite_\w+)*\)\. Forensic replay: it came in with the "
                     r"input batch \(1 NaN/Inf value\(s\)\), before any layer ran", proc.stdout.replace("\n     ", " "))
    assert "/12 done)" not in proc.stdout  # --no-progress
    report = json.loads((only_run(tmp_path) / "report.json").read_text())
    assert [r["cause"] for r in report["forensics"]["reports"]] == ["input"]


@pytest.mark.timeout(120)
def test_demo_under_guard_raise_stops_and_still_names_the_producer(tmp_path):
    proc = demo(tmp_path, "--steps", "15", "--inject", "nan@5", "--guard", "raise", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.replace("\n     ", " ")
    assert re.search(r"step 5: NaN found \(nonfinite_\w+(, nonfinite_\w+)*\)\. Forensic replay: born in layer "
                     r"`norm` \(InputNorm\)", out), out
    assert ">> step 5: training stopped by guard raise: " in out and "; stopped at step 5\n" in out
    report = json.loads((only_run(tmp_path) / "report.json").read_text())
    assert report["totals"]["steps"] == 6 and report["forensics"]["replays"] == 1


@pytest.mark.timeout(120)
def test_demo_in_a_terminal_keeps_log_lines_off_the_bar(tmp_path):
    """A real pseudo-terminal: every log or event line starts on a cleared line and ends whole."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "torchtrace.cli", "demo", "--steps", "60", "--inject", "nan@30",
                             "--inject", "explode@45",
                             "--port", "off", "--run-dir", str(tmp_path / "runs"), "--hold", "0"],
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=tmp_path, env=ENV)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(10) == 0
    raw = b"".join(chunks).decode().replace("\r\n", "\n")
    assert "[" + "#" * 30 + "] 60/60" in raw  # the bar was drawn, and its last state kept
    for marker in ("WARNING torchtrace: step 45", "  >> step 30: NaN found", "  >> step 30: update skipped"):
        assert marker in raw, raw
        for m in re.finditer(re.escape(marker), raw):
            before = raw[max(0, m.start() - len(CLEAR_LINE)):m.start()]
            assert before == CLEAR_LINE or raw[m.start() - 1] == "\n", repr(raw[m.start() - 80:m.end()])
    # no bar text directly followed by a log line on the same line
    assert not re.search(r"loss +[-\d.na]+(WARNING|ERROR|  >>)", raw)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_redraws_the_bar_under_a_log_record():
    out = FakeTerminal()
    console = Console(out, bar=True, min_interval_s=0)
    with logs_through(console):
        console.progress("[##..] 2/4")
        logging.getLogger("torchtrace.forensics").error("step %s: born in %s", 2, "norm")
        logging.getLogger("torchtrace").info("not shown: below WARNING")
    console.end_progress()
    assert out.getvalue() == (CLEAR_LINE + "[##..] 2/4" + CLEAR_LINE + "ERROR torchtrace.forensics: step 2: born in "
                              "norm\n" + "[##..] 2/4" + "\n")
    assert logging.getLogger("torchtrace").propagate is True  # restored


def test_console_in_a_pipe_writes_whole_lines_only():
    out = io.StringIO()
    console = Console(out, bar=False)
    console.progress("[##..] 2/4")
    console.line("event")
    console.end_progress()
    assert out.getvalue() == "event\n"


def test_parse_fault_refuses_what_would_never_fire():
    assert parse_fault("nan@120", 300) == Fault("nan", 120)
    assert parse_fault("nan-input@0", 1) == Fault("nan-input", 0)
    with pytest.raises(ValueError, match=r"step 500 is never reached with --steps 20 \(steps are numbered 0 to 19\)"):
        parse_fault("nan@500", 20)
    with pytest.raises(ValueError, match="step 20 is never reached"):
        parse_fault("explode@20", 20)
    for bad in ("boom@3", "nan", "nan@", "nan@-1", "nan@1.5", "@3"):
        with pytest.raises(ValueError, match="accepted values: nan@STEP, nan-input@STEP, explode@STEP"):
            parse_fault(bad, 300)
    with pytest.raises(ValueError, match="two faults at step 7"):
        check_faults([Fault("nan", 7), Fault("explode", 7)])


@pytest.mark.parametrize("args, message", [
    (["--inject", "boom@3"], "nan@STEP, nan-input@STEP, explode@STEP"),
    (["--steps", "20", "--inject", "nan@500"], "step 500 is never reached with --steps 20"),
    (["--inject", "nan@5", "--inject", "explode@5"], "two faults at step 5"),
    (["--steps", "0"], "--steps=0 is not valid; accepted values: a positive integer"),
    (["--hold", "-1"], "--hold=-1.0 is not valid"),
    (["--level", "loud"], "level='loud' is not valid; accepted values: off, basic, advanced, extreme"),
    (["--guard", "maybe"], "guard='maybe' is not valid; accepted values:"),
    (["--run-dir", "/dev/null/runs"], "--run-dir='/dev/null/runs' is not valid: /dev/null is not a directory"),
])
def test_demo_refuses_bad_arguments(tmp_path, args, message, capsys):
    """The command's own entry point, in this process: exit status 2, one line naming the setting."""
    status = cli_main(["demo", "--port", "off", "--run-dir", str(tmp_path / "runs"), *args])
    err = capsys.readouterr().err
    assert status == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()  # refused before any run started


PROGRESS = re.compile(r"^  step (\d+) \((\d+)/(\d+) done\)  loss (\S+)$", re.M)


@pytest.mark.timeout(120)
def test_demo_progress_lines_number_steps_as_the_narration_and_the_report(tmp_path):
    """A progress line read "step 50/150 loss 0.9682" above ">> step 50: NaN found": the
    loss was step 49's. Each line now names the step (from 0, as everywhere) whose loss it shows."""
    proc = demo(tmp_path, "--steps", "12", "--inject", "nan-input@5")
    assert proc.returncode == 0, proc.stderr
    lines = PROGRESS.findall(proc.stdout)
    assert [(int(s), int(n)) for s, n, _, _ in lines] == [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12)], lines
    steps = {s["step"]: s for s in json.loads((only_run(tmp_path) / "report.json").read_text())["steps"]}
    for step, _, _, loss in lines:
        want = steps[int(step)]["loss"]
        assert loss == ("nan" if not isinstance(want, float) or math.isnan(want) else f"{want:.4f}"), (step, loss)


@pytest.mark.timeout(120)
def test_demo_at_level_off_shows_its_own_loss_and_promises_no_spans(tmp_path):
    """Level off measures nothing: every progress line said "loss nan" and the header promised
    spans, metrics and report lines, then the summary said "steps 0 of 12"."""
    proc = demo(tmp_path, "--steps", "12", "--level", "off", "--inject", "nan@6")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    losses = {int(s): float(loss) for s, _, _, loss in PROGRESS.findall(out)}
    assert sorted(losses) == [1, 3, 5, 7, 9, 11] and all(math.isfinite(losses[s]) for s in (1, 3, 5)), out
    assert "Each step is one span" not in out and "line in the run report" not in out
    assert "no spans, no step metrics and no step lines in the run report" in " ".join(out.split()), out
    assert re.search(r"\n  steps +12 of 12, run bare \(level off: torchtrace measured none of them\)\n", out), out
    assert not (only_run(tmp_path) / "spans.jsonl").exists()


@pytest.mark.timeout(120)
def test_demo_hold_after_training_is_no_hang(tmp_path):
    """The demo's --hold kept the live page up after the last step and, 30 s into it, the
    watchdog reported a training hang (hang.json, stacks.txt, a hang span, report hangs: 1),
    and the report's goodput counted the hold as badput. The demo now says training is over
    (``tt.idle()``): a hold longer than the hang timeout records no hang."""
    env = {**ENV, "TORCHTRACE_HANG_TIMEOUT_S": "2"}
    proc = subprocess.run([sys.executable, "-m", "torchtrace.cli", "demo", "--port", "0", "--run-dir",
                           str(tmp_path / "runs"), "--steps", "20", "--hold", "5", "--no-progress"],
                          capture_output=True, text=True, timeout=100, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "The live page stays up for 5 s" in proc.stdout
    assert "hang" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    run = only_run(tmp_path)
    assert not (run / "hang.json").exists() and not (run / "stacks.txt").exists()
    report = json.loads((run / "report.json").read_text())
    assert report["hangs"]["hangs"] == 0
    assert report["throughput"]["badput_s"]["other"] < 2.0, report["throughput"]["badput_s"]


@pytest.mark.timeout(120)
def test_demo_prints_absolute_paths_and_takes_a_relative_run_dir_from_the_users_directory(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torchtrace.cli", "demo", "--port", "off", "--run-dir", "rel",
                           "--steps", "3", "--no-progress"], capture_output=True, text=True, timeout=100,
                          cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr
    (run,) = (tmp_path / "rel").iterdir()
    assert f"  run files:  {run}/ (" in proc.stdout, proc.stdout
    cmd = re.search(r"HTML report:  (.+)\n", proc.stdout).group(1)
    assert cmd == f"{sys.executable} -m torchtrace.cli report {run} --html report.html", cmd


def test_demo_script_runs_the_demo_from_the_users_directory(tmp_path):
    """scripts/demo.sh went into the checkout before starting the demo: a relative --run-dir
    (and the default ./torchtrace-runs) landed there, not where the user ran it."""
    checkout, user = tmp_path / "checkout", tmp_path / "user"
    (checkout / "scripts").mkdir(parents=True)
    (checkout / ".venv" / "bin").mkdir(parents=True)
    user.mkdir()
    (checkout / "scripts" / "demo.sh").write_text((ROOT / "scripts" / "demo.sh").read_text())
    (checkout / "scripts" / "setup.sh").write_text("#!/bin/sh\necho setup in $PWD\n")
    (checkout / ".venv" / "bin" / "torchtrace").write_text('#!/bin/sh\necho "torchtrace in $PWD: $*"\n')
    for script in ("scripts/demo.sh", "scripts/setup.sh", ".venv/bin/torchtrace"):
        (checkout / script).chmod(0o755)
    done = subprocess.run([str(checkout / "scripts" / "demo.sh"), "--run-dir", "runs"], cwd=user,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert f"torchtrace in {user}: demo --run-dir runs" in done.stdout, done.stdout


def test_quickstart_example_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(next(tmp_path.glob("torchtrace-runs/*/report.json")).read_text())
    assert report["totals"]["steps"] == 100 and report["operations"] == {"train_step": 100}
    run_dir = next(tmp_path.glob("torchtrace-runs/*"))
    assert f"torchtrace report {run_dir.relative_to(tmp_path)} --html report.html" in proc.stdout, proc.stdout


def test_a_command_whose_reader_went_away_ends_without_a_traceback(tmp_path):
    """``torchtrace why DIR | head -1``: the reader closes the pipe; the command ends quietly,
    as a process that SIGPIPE ended reports it (128 + 13), and says nothing on stderr."""
    (tmp_path / "state.rank0.json").write_text(json.dumps({"rank": 0, "attempt": 0, "ended": "completed"}))
    read_end, write_end = os.pipe()
    os.close(read_end)  # (gone before the command writes: every write fails)
    try:
        done = subprocess.run([sys.executable, "-m", "torchtrace.cli", "why", str(tmp_path)], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120, cwd=tmp_path, env=ENV)
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert done.stderr == ""
