"""The demo command, as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_demo_with_injected_nan_and_explosion(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torchtrace.cli", "demo", "--steps", "120", "--inject", "nan@50",
         "--inject", "explode@80", "--port", "0", "--run-dir", str(tmp_path), "--no-progress"],
        capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "metrics:  http://127.0.0.1:" in out and "summary" in out
    assert "skipped updates       1" in out
    report = json.loads(next(tmp_path.glob("*/report.json")).read_text())
    assert report["totals"]["steps"] == 120
    assert report["totals"]["skipped_steps"] == 1
    assert report["anomalies_by_kind"]["nonfinite_loss"] == 1
    assert report["anomalies_by_kind"]["grad_explosion"] >= 1
    spans = [json.loads(l) for l in next(tmp_path.glob("*/spans.jsonl")).read_text().splitlines()]
    assert len(spans) == 120
    assert [s["attributes"]["torchtrace.step"] for s in spans if s["status"] == "ERROR"] == [50]


def test_demo_rejects_bad_injection(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torchtrace.cli", "demo", "--inject", "boom@3", "--port", "off",
                           "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nan@STEP, explode@STEP" in proc.stderr


def test_quickstart_example_runs(tmp_path):
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "examples" / "quickstart.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(next(tmp_path.glob("torchtrace-runs/*/report.json")).read_text())
    assert report["totals"]["steps"] == 100 and report["operations"] == {"train_step": 100}


def test_report_command_on_a_demo_run(tmp_path):
    demo = subprocess.run([sys.executable, "-m", "torchtrace.cli", "demo", "--steps", "30", "--inject", "nan@10",
                           "--port", "off", "--run-dir", str(tmp_path), "--no-progress"],
                          capture_output=True, text=True, timeout=110)
    assert demo.returncode == 0, demo.stderr
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    out = tmp_path / "out.html"
    proc = subprocess.run([sys.executable, "-m", "torchtrace.cli", "report", str(run), "--html", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "nonfinite_loss" in proc.stdout and run.name in proc.stdout
    html = out.read_text()
    assert "<script" in html and "http://" not in html.split("<body", 1)[1].split("</body>")[0].replace(
        "http://127.0.0.1", "")
