"""``torchtrace report PATH`` where PATH is not one run: the folder of runs lists them; a path
that does not exist says so."""

from __future__ import annotations

import json
import shlex
import time

import torch

import torchtrace as tt
from torchtrace.cli import main as cli_main


def small_run(parent, steps: int, nan_at: int | None = None):
    """A finished run of ``steps`` steps under ``parent``; its directory."""
    result = tt.configure(service_name="listing", prometheus_port="off", run_dir=str(parent), register_atexit=False,
                          strict=True)
    model = torch.nn.Linear(4, 1)
    for i in range(steps):
        model.zero_grad()
        with tt.debug_context("train_step", model=model) as step:
            loss = model(torch.randn(3, 4)).pow(2).mean() * (float("nan") if i == nan_at else 1.0)
            loss.backward()
            step.record_loss(loss)
    tt.shutdown()
    return result.run_dir


def test_a_folder_of_runs_lists_them_with_the_command_for_each(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = small_run(tmp_path / "torchtrace-runs", 3)
    time.sleep(0.01)
    second = small_run(tmp_path / "torchtrace-runs", 5, nan_at=2)
    assert cli_main(["report", "torchtrace-runs"]) == 0
    out, err = capsys.readouterr()
    assert "no report.json" not in out + err and err == ""
    lines = out.splitlines()
    assert lines[0] == "torchtrace-runs holds 2 runs (oldest first); report one with:"
    commands = [line for line in lines if "torchtrace report " in line]
    assert [shlex.split(c.split("#")[0])[-1] for c in commands] == [f"torchtrace-runs/{first.name}",
                                                                   f"torchtrace-runs/{second.name}"]
    # each with its own numbers, read back from its report.json
    for command, run in zip(commands, (first, second)):
        totals = json.loads((run / "report.json").read_text())["totals"]
        assert f"# {totals['steps']} steps, {totals['anomaly_steps']} anomalous" in command, command
    assert "# 5 steps, 1 anomalous" in commands[1]
    # and a command as listed works
    assert cli_main(shlex.split(commands[1].split("#")[0])[1:]) == 0
    assert "listing" in capsys.readouterr().out


def test_html_from_a_folder_of_runs_is_refused_after_the_list(tmp_path, capsys):
    small_run(tmp_path / "runs", 2)
    assert cli_main(["report", str(tmp_path / "runs"), "--html", str(tmp_path / "r.html")]) == 2
    out, err = capsys.readouterr()
    assert "holds 1 run" in out
    assert "--html needs one run's directory" in err and not (tmp_path / "r.html").exists()


def test_a_path_that_does_not_exist_gets_its_own_message(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path / "nothere")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"torchtrace report: {tmp_path / 'nothere'}: no such file or directory\n"


def test_a_folder_with_no_run_in_it_says_so(tmp_path, capsys):
    (tmp_path / "empty" / "notes").mkdir(parents=True)
    assert cli_main(["report", str(tmp_path / "empty")]) == 2
    out, err = capsys.readouterr()
    assert "no report.json or spans.jsonl" in err and "no run directory in it either" in err


def test_an_html_path_that_cannot_be_written_names_html_not_the_run(tmp_path, capsys):
    """A folder, a path under /proc, a file under a read-only place: a traceback before, or a
    message that blamed the run directory (which was fine)."""
    run = small_run(tmp_path / "runs", 2)
    (tmp_path / "a_folder").mkdir()
    for out in (tmp_path / "a_folder", "/proc/nope/x.html", "/proc/self/x.html"):
        assert cli_main(["report", str(run), "--html", str(out)]) == 2, out
        said, err = capsys.readouterr()
        assert "listing" in said  # the terminal report still came
        assert err.startswith(f"torchtrace report: --html {out}: cannot write the page there ("), err
        assert "Traceback" not in err and "run directory" not in err
