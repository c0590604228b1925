"""terminal_report / html_report of a finished run, and the report subcommand hook."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics

import pytest

from torchtrace.reporting import add_report_subcommand, html_report, terminal_report
from torchtrace.reporting.cli import main as report_main
from torchtrace.reporting.runfiles import chart_steps, load_run
from torchtrace.reporting.terminal import sparkline

from .run_fixture import NAN_STEP, STEPS, make_run


def _embedded(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="tt-data">(.*?)</script>', html, re.S)
    assert m, "no embedded data"
    return json.loads(m.group(1))


@pytest.fixture
def run(tmp_path, tiny_model):
    return make_run(tmp_path, tiny_model)


def test_load_run_steps_match_history(run):
    run_dir, history_steps = run
    data = load_run(run_dir)
    assert [s["step"] for s in data.steps] == list(range(STEPS))
    for mine, ref in zip(data.steps, history_steps):
        if ref["step"] == NAN_STEP:
            assert math.isnan(mine["loss"]) and mine["anomalies"] == ["nonfinite_loss"]
        else:
            assert mine["loss"] == ref["loss"] and mine["grad_norm"] == ref["grad_norm"]
            assert mine["anomalies"] == []
        assert mine["memory"]["rss_bytes"] == ref["memory"]["rss_bytes"]
    anomalies = [e for e in data.events if e["type"] == "anomaly"]
    assert [(e["data"]["step"], e["data"]["kind"]) for e in anomalies] == [(NAN_STEP, "nonfinite_loss")]
    assert data.problems == []


def test_terminal_report(run):
    run_dir, history_steps = run
    text = terminal_report(run_dir)
    assert text.startswith(f"torchtrace run {run_dir.name}  service report-test  rank 0/1  level basic\n")
    assert f"  steps: {STEPS} (train_step {STEPS})" in text
    durations = sorted(s["duration_s"] for s in load_run(run_dir).steps)
    assert f"median {statistics.median(durations) * 1e3:.2f} ms" in text
    first, last = history_steps[0]["loss"], history_steps[-1]["loss"]
    finite = [s["loss"] for s in history_steps if s["step"] != NAN_STEP]
    assert f"  loss: first {first:.4g}, last {last:.4g}, min {min(finite):.4g}, max {max(finite):.4g}, " \
           f"non-finite at 1 step(s)" in text
    assert f"  anomalies: 1 step(s), rate {100 / STEPS:.2f} %: nonfinite_loss 1" in text
    assert f"    step {NAN_STEP} train_step: nonfinite_loss: loss is nan" in text
    assert f"  telemetry: {STEPS} spans exported, 0 dropped, internal errors none" in text


def test_html_report_is_self_contained_and_holds_the_run(run):
    run_dir, history_steps = run
    html = html_report(run_dir)
    assert html.startswith("<!DOCTYPE html>")
    # nothing is fetched from anywhere: no external scripts, styles, images or fonts
    assert not re.search(r'(src|href)\s*=', html)
    assert "@import" not in html and "url(" not in html
    data = _embedded(html)
    assert [s["step"] for s in data["steps"]] == list(range(STEPS))
    assert [s["loss"] for s in data["steps"]] == [
        "NaN" if s["step"] == NAN_STEP else s["loss"] for s in history_steps]
    assert data["summary"]["run_id"] == run_dir.name
    assert data["summary"]["totals"]["steps"] == STEPS
    assert data["training"]["anomaly_steps"] == 1 and data["training"]["anomaly_rate"] == 1 / STEPS
    assert data["settings"]["service_name"] == "report-test"
    assert data["settings"]["debug_token"] is None
    assert [(e["data"]["step"], e["data"]["kind"]) for e in data["events"] if e["type"] == "anomaly"] == [
        (NAN_STEP, "nonfinite_loss")]


def test_html_report_escapes_hostile_names(tmp_path):
    (tmp_path / "r").mkdir()
    span = {"name": "x", "start_unix_ns": 1, "end_unix_ns": 2, "attributes": {
        "torchtrace.step": 0, "torchtrace.operation": "</script><script>alert(1)</script>", "torchtrace.loss": 1.0},
        "events": []}
    (tmp_path / "r" / "spans.jsonl").write_text(json.dumps(span) + "\n{broken\n")
    html = html_report(tmp_path / "r")
    assert "<script>alert(1)" not in html
    data = _embedded(html)
    assert data["steps"][0]["operation"] == "</script><script>alert(1)</script>"
    assert data["problems"] == ["spans.jsonl: 1 unreadable line(s) skipped"]


def test_chart_steps_thins_but_keeps_anomalies():
    steps = [{"step": i, "anomalies": ["loss_spike"] if i == 7777 else []} for i in range(12000)]
    thinned = chart_steps(steps, limit=1000)
    assert 1000 <= len(thinned) <= 1001
    assert any(s["step"] == 7777 for s in thinned)
    assert [s["step"] for s in thinned] == sorted(s["step"] for s in thinned)
    assert chart_steps(steps[:10], limit=1000) == steps[:10]


def test_not_a_run_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no report.json or spans.jsonl"):
        terminal_report(tmp_path)
    assert report_main(["report", str(tmp_path)]) == 2


def test_report_subcommand_hook(run, tmp_path, capsys):
    run_dir, _ = run
    parser = argparse.ArgumentParser(prog="torchtrace")
    sub = parser.add_subparsers(dest="command", required=True)
    add_report_subcommand(sub)
    out = tmp_path / "out" / "report.html"
    args = parser.parse_args(["report", str(run_dir), "--html", str(out)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"torchtrace run {run_dir.name}") and printed.endswith(f"HTML report: {out}\n")
    assert out.read_text() == html_report(run_dir)
    assert _embedded(out.read_text())["summary"]["run_id"] == run_dir.name
    assert os.stat(out).st_mode & 0o777 == 0o600


def test_sparkline():
    assert sparkline([0.0, 1.0, float("nan"), None], width=4) == "▁█! "
    assert sparkline([]) == ""
    assert len(sparkline(list(map(float, range(500))), width=40)) == 40
