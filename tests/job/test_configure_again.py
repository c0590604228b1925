"""``configure()`` again in one process under the same run id and run directory goes on with
the run.

A notebook cell run twice, or a script that sets torchtrace up once with defaults and again
with its settings, configures one process twice; under torchrun (or a named ``run_id``) both
set-ups have the same run id, and the process keeps its attempt. Before, the second set-up
started the run over in the same directory: its steps were numbered from 0 again (two spans
of one run with one step number, and one trace id under ``shared_step_trace``), its report
held only its own steps, and the attempt's story took the first set-up's steps for start-up
time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.job.helpers import clean_env
from torchtrace.job.story import job_story

SCRIPT = r"""
import json, sys, time, torch, torchtrace as tt

run_dir = sys.argv[1]
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def steps(n):
    for _ in range(n):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = model(torch.ones(2, 4)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            step.record_loss(loss)
            time.sleep(0.05)

settings = dict(service_name="again", run_id="nb", run_dir=run_dir, prometheus_port="off")
tt.configure(**settings)
first_started = tt.api.get_runtime().started_unix
steps(3)
tt.configure(**settings)          # a cell run again: the runtime before is shut down first
steps(2)
tt.shutdown()
tt.configure(**settings)          # shut down, then set up again under the same run id
steps(2)
tt.configure(**dict(settings, run_id="other"))  # another run id: a run of its own
steps(2)
tt.configure(**dict(settings, run_id="other", run_dir=run_dir + "/elsewhere"))  # another directory: the same
steps(2)
tt.shutdown()
print(json.dumps({"first_started": first_started}))
"""


def _run(tmp_path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=clean_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["attributes"]["torchtrace.step"] for line in (run / "spans.jsonl").read_text().splitlines()]


def test_the_same_run_id_configured_again_goes_on_with_the_run(tmp_path):
    out = _run(tmp_path)
    run = tmp_path / "nb"
    assert _steps(run) == list(range(7))  # numbered on across the three set-ups
    report = json.loads((run / "report.json").read_text())
    assert report["totals"]["steps"] == 7 and report["operations"] == {"train_step": 7}
    assert [s["step"] for s in report["steps"]] == list(range(7))
    assert report["started_unix"] == out["first_started"]
    box = json.loads((run / "state.json").read_text())
    assert box["steps_finished"] == 7 and box["first_step"] == 0 and box["step"] == 6
    assert box["started"] == out["first_started"] and box["ended"] == "completed"
    attempt, = job_story(run)["attempts"]
    assert attempt["configured"] == out["first_started"]
    assert attempt["productive_s"] >= 0.3  # seven steps of 0.05 s, the earlier set-ups' among them


def test_another_run_id_or_directory_in_the_same_process_starts_a_run_of_its_own(tmp_path):
    _run(tmp_path)
    for run in (tmp_path / "other", tmp_path / "elsewhere" / "other"):
        assert _steps(run) == [0, 1]
        report = json.loads((run / "report.json").read_text())
        assert report["totals"]["steps"] == 2 and report["operations"] == {"train_step": 2}
