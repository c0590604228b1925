"""The reports say what happened to the run: a cleared history, how the run ended, a job's
attempts, where a NaN came from. Each test compares the report with what the run itself
recorded (the history before and after, the black box, the forensic report's own fields)."""

from __future__ import annotations

import html as html_lib
import json
import re
import signal
import subprocess
import sys
import textwrap
import time

import torch

import torchtrace as tt
from torchtrace.job.story import job_story
from torchtrace.reporting.cli import run_list
from torchtrace.reporting.htmlreport import html_report
from torchtrace.reporting.runfiles import find_runs
from torchtrace.reporting.terminal import terminal_report

from ..export.debug_helpers import call, runtime
from ..job.helpers import clean_env

TOKEN = "report-truth-token-0123456789"


def _embedded(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="tt-data">(.*?)</script>', html, re.S)
    assert m, "no embedded data"
    return json.loads(m.group(1))


def _cleared_run(tmp_path, steps: int = 20, nan_at: int = 3, clear_at: int = 10):
    """``steps`` decorated steps under guard=skip, a NaN loss at ``nan_at``, ``POST /debug/clear``
    before ``clear_at``. Returns (run dir, the history's totals just before the clear applied,
    its totals at the end)."""
    result = tt.configure(service_name="cleared", prometheus_port=0, run_dir=str(tmp_path / "runs"), strict=True,
                          register_atexit=False, guard="skip", debug_token=TOKEN)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @tt.debug_operation(model=model, optimizer=opt)
    def train_step(x, s):
        opt.zero_grad()
        loss = model(x).pow(2).mean() * (float("nan") if s == nan_at else 1.0)
        loss.backward()
        opt.step()
        return loss

    before: dict = {}
    for s in range(steps):
        if s == clear_at:
            tt.flush()
            before = dict(runtime().history.totals)
            status, _, body = call(result.prometheus_port, "POST", "/debug/clear", {"Authorization": f"Bearer {TOKEN}"})
            assert status == 202, body
        train_step(torch.randn(16, 8), s)
    tt.flush()
    after = dict(runtime().history.totals)
    tt.shutdown()
    return tmp_path / "runs" / result.run_id, before, after


def test_after_a_clear_both_reports_count_every_step_and_say_where_the_clear_was(tmp_path):
    """A NaN at step 3 (skipped), ``POST /debug/clear`` before step 10, 20 steps. Before, the
    terminal said "steps: 20 (train_step 10)" and the HTML cards "10 steps, 0 anomalous steps,
    0 skipped updates" beside the skipped NaN of step 3 in the list: report.json's totals start
    at the clear, the spans do not. Now both reports count the 20 steps of spans.jsonl (1
    anomalous, 1 non-finite, 1 skipped: the history's counts before the clear plus after it)
    and say that the history was cleared before step 10."""
    run_dir, before, after = _cleared_run(tmp_path)
    assert before["steps"] == 10 and after["steps"] == 10  # what report.json holds: the steps since the clear
    whole = {k: before.get(k, 0) + after.get(k, 0)
             for k in ("steps", "anomaly_steps", "nonfinite_steps", "skipped_steps")}
    assert whole == {"steps": 20, "anomaly_steps": 1, "nonfinite_steps": 1, "skipped_steps": 1}
    text = terminal_report(run_dir)
    assert "  steps: 20 (train_step 20)" in text, text
    assert "  anomalies: 1 step(s), rate 5.00 %" in text
    said = ("the debug history was cleared (POST /debug/clear) before step 10 of train_step: report.json's "
            "totals and timeline count from there (10 steps); this report counts all 20 steps in spans.jsonl")
    assert f"  note: {said}\n" in text
    data = _embedded(html_report(run_dir))
    totals = data["summary"]["totals"]
    assert {k: totals[k] for k in whole} == whole
    assert data["summary"]["operations"] == {"train_step": 20}
    assert data["summary"]["anomalies_by_kind"] == {"nonfinite_grad": 1, "nonfinite_loss": 1}
    assert data["training"]["anomaly_rate"] == 1 / 20
    assert data["notes"] == [said]
    listed = run_list("runs", find_runs(run_dir.parent))
    assert "# 10 steps, 0 anomalous, started " in listed and "(counted since a POST /debug/clear" in listed


_KILLED = textwrap.dedent("""
    import json, os, signal, sys, time, torch, torchtrace as tt
    tt.configure(prometheus_port="off", run_dir=sys.argv[1], run_id="job", register_atexit=False)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @tt.debug_operation(model=model, optimizer=opt)
    def train_step(x):
        opt.zero_grad(); loss = model(x).pow(2).mean(); loss.backward(); opt.step(); return loss

    for _ in range(6):
        train_step(torch.randn(8, 4))
    tt.flush()
    state = os.path.join(sys.argv[1], "job", "state.json")
    deadline = time.time() + 30
    while time.time() < deadline:  # the black box is rewritten every half second: wait for the last step in it
        try:
            if json.load(open(state)).get("step") == 5:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _status(html: str) -> str:
    m = re.search(r'<span class="badge" id="tt-status">([^<]*)</span>', html)
    assert m, "no status badge"
    return html_lib.unescape(m.group(1))


def test_a_killed_attempt_a_running_one_and_the_job_listing_say_how_each_stands(tmp_path):
    """Attempt 0 is SIGKILLed after 6 steps (0-5); attempt 1 of the same run id trains 3 steps.
    Before, every HTML report's header said "finished · N steps" (the killed attempt's "finished
    · 6 steps" above a job section saying "killed at step 5"), its goodput card said "No
    throughput accounting in this run" though the black box holds the attempt's ledger, and
    ``torchtrace report FOLDER`` listed the run directory but not its ``attempt-1/``. Now the
    header says what the job's story says of the attempt (killed at step 5, running, finished),
    the card shows the black box's ledger up to its last write, and the listing names both."""
    runs = tmp_path / "runs"
    killed = subprocess.run([sys.executable, "-c", _KILLED, str(runs)], env=clean_env(), capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run_dir = runs / "job"
    ending = next(a for a in job_story(run_dir)["attempts"] if a["attempt"] == 0)
    assert (ending["ended"], ending["last_step"]) == ("killed", 5)
    page = html_report(run_dir)
    assert _status(page) == "killed at step 5 · 6 steps"
    box = json.loads((run_dir / "state.json").read_text())
    goodput = _embedded(page)["summary"]["throughput"]
    assert (goodput["wall_s"], goodput["productive_s"], goodput["badput_s"]) == \
        (box["wall_s"], box["productive_s"], box["badput_s"])
    assert goodput["goodput_ratio"] == box["productive_s"] / box["wall_s"]
    assert goodput["counted"].startswith("up to the black box's last write (state.json, ")
    assert "  goodput: " in terminal_report(run_dir)

    tt.configure(prometheus_port="off", run_dir=str(runs), run_id="job", register_atexit=False, strict=True)
    model = torch.nn.Linear(4, 1)
    for _ in range(3):
        with tt.debug_context("train_step", model=model):
            model(torch.randn(8, 4)).sum().backward()
    tt.flush()
    attempt = run_dir / "attempt-1"
    deadline = time.time() + 30
    while time.time() < deadline and json.loads((attempt / "state.json").read_text()).get("step") != 2:
        time.sleep(0.1)
    assert _status(html_report(attempt)) == "running (step 2) · 3 steps"
    tt.shutdown()
    assert _status(html_report(attempt)) == "finished · 3 steps"
    assert [run.path for run in find_runs(runs)] == [run_dir, attempt]


class _NoEps(torch.nn.Module):
    """x / rms(x) without an epsilon: an all-zero row becomes 0/0 = NaN."""

    def forward(self, x):
        return x / x.pow(2).mean(-1, keepdim=True).sqrt()


ACCUMULATE = 4


def accumulation_run(tmp_path):
    """One decorated call per micro-batch, ``optimizer.step()`` every 4th (guard=skip); micro-step
    5 (the second of the second window) has an all-zero row: its forward makes the NaN, and
    micro-step 7 carries the NaN gradients it accumulated into the update it skips."""
    result = tt.configure(service_name="accumulate", prometheus_port="off", run_dir=str(tmp_path / "runs"),
                          strict=True, register_atexit=False, guard="skip")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), _NoEps(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @tt.debug_operation(name="micro_step", model=model, optimizer=opt)
    def micro(x, last):
        loss = model(x).pow(2).mean() / ACCUMULATE
        loss.backward()
        if last:
            opt.step()
            opt.zero_grad()
        return loss

    g = torch.Generator().manual_seed(1)
    for i in range(3 * ACCUMULATE):
        x = torch.randn(8, 16, generator=g)
        if i == ACCUMULATE + 1:
            x[0] = 0
        micro(x, i % ACCUMULATE == ACCUMULATE - 1)
    tt.shutdown()
    return tmp_path / "runs" / result.run_id


def test_a_carried_over_gradient_and_a_nan_in_the_batch_are_told_as_the_forensic_report_tells_them(tmp_path):
    """Before, a gradient NaN carried into an update printed "step 7 micro_step: unknown: born
    in ?" and a NaN in the batch "input: born in the model's root module (Normalised)", as if
    the model had made it. Now each line says what the report's fields say: ``carried_over``
    (its names, from an earlier step since the last update) and ``cause: input`` with the
    model's input (the batch) holding the value before any module ran."""
    run_dir = accumulation_run(tmp_path)
    reports = {r["step"]: r for r in json.loads((run_dir / "report.json").read_text())["forensics"]["reports"]}
    carried = reports[ACCUMULATE + 3]
    assert carried["cause"] == "unknown" and carried["carried_over"] == ["0.weight", "2.weight", "2.bias"]
    text = terminal_report(run_dir)
    assert (f"    step {ACCUMULATE + 3} micro_step: carried over: non-finite gradients from before this step "
            "(3: 0.weight, 2.weight, 2.bias), accumulated since the last update by an earlier step, whose report "
            "names the origin; this step's replay was finite\n") in text, text
    assert "born in ?" not in text

    from .run_fixture import INPUT_NAN_STEP, make_run

    fixture_dir, _ = make_run(tmp_path / "input")
    batch = next(r for r in json.loads((fixture_dir / "report.json").read_text())["forensics"]["reports"]
                 if r["step"] == INPUT_NAN_STEP)
    assert (batch["cause"], batch["module"], batch["inputs"]["nan_count"]) == ("input", "", 1)
    assert (f"    step {INPUT_NAN_STEP} train_step: input: came in with the batch: the model's input (Normalised) "
            "held 1 NaN/Inf before any module ran\n") in terminal_report(fixture_dir)
