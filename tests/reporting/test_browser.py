"""The live page and the HTML report in headless Chromium: screenshots, drawn data, anomalies.

Screenshots go to ``$TORCHTRACE_ARTIFACTS_DIR`` or ``artifacts/`` at the repository root.
"""

from __future__ import annotations

import html as html_lib
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from torchtrace.reporting.htmlreport import write_html_report

from ..conftest import require_binary
from ..export.debug_helpers import Trainer, runtime
from .run_fixture import NAN_STEP, STEPS, make_run

pytestmark = pytest.mark.realserver
ROOT = Path(__file__).resolve().parents[2]


def artifacts_dir() -> Path:
    path = Path(os.environ.get("TORCHTRACE_ARTIFACTS_DIR") or ROOT / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def chromium(binary: str, url: str, screenshot: Path, profile: Path) -> subprocess.Popen:
    """Start headless Chromium rendering ``url``: it dumps the DOM to stdout and writes a screenshot."""
    args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", f"--screenshot={screenshot}", "--dump-dom",
            "--window-size=1280,1100", "--virtual-time-budget=5000", url]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def page_state(dom: str) -> dict:
    m = re.search(r'<pre id="tt-state"[^>]*>(.*?)</pre>', dom, re.S)
    assert m, "the page never rendered its state:\n" + dom[-2000:]
    return json.loads(html_lib.unescape(m.group(1)))


def canvas_points(dom: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r'<canvas id="chart-([a-z_]+)"[^>]*?data-points="(\d+)"', dom)}


def test_live_page_in_chromium_while_training(tt_runtime, tiny_model, tmp_path):
    binary = require_binary("chromium")
    rt = runtime()
    trainer = Trainer(tiny_model, nan_at=(NAN_STEP,))
    trainer.run(STEPS)
    shot = artifacts_dir() / "live_page.png"
    shot.unlink(missing_ok=True)
    proc = chromium(binary, f"{rt.server.url}/", shot, tmp_path / "profile")
    deadline = time.monotonic() + 60
    try:
        while proc.poll() is None and time.monotonic() < deadline:  # training goes on while the page polls
            trainer.step()
            time.sleep(0.005)
        dom, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    state = page_state(dom)
    assert state["renders"] >= 2, state  # it polled and redrew
    assert state["level"] == "basic"
    n = state["steps"]
    assert STEPS <= n <= trainer.i
    # every chart drew every step it was given; the NaN step is a marker, not a point
    assert state["charts"] == {"loss": n - 1, "grad_norm": n - 1, "step_time": n, "memory": n}
    assert canvas_points(dom) == state["charts"]
    assert {"step": NAN_STEP, "kind": "nonfinite_loss"} in state["anomalies"]
    assert 'data-kind="nonfinite_loss"' in dom and "loss is nan" in dom
    assert shot.exists() and shot.stat().st_size > 10_000
    print(f"\nlive page screenshot: {shot} ({n} steps drawn, {state['renders']} renders)")


def test_html_report_in_chromium(tmp_path, tiny_model):
    binary = require_binary("chromium")
    run_dir, _ = make_run(tmp_path, tiny_model)
    out = artifacts_dir() / "report.html"
    write_html_report(run_dir, out)
    shot = artifacts_dir() / "report.png"
    shot.unlink(missing_ok=True)
    proc = chromium(binary, out.resolve().as_uri(), shot, tmp_path / "profile")
    dom, _ = proc.communicate(timeout=60)
    state = page_state(dom)
    assert state["steps"] == STEPS
    assert state["charts"] == {"loss": STEPS - 1, "grad_norm": STEPS - 1, "step_time": STEPS, "memory": STEPS}
    assert canvas_points(dom) == state["charts"]
    assert state["anomalies"] == [{"step": NAN_STEP, "kind": "nonfinite_loss"}]
    assert "service_name" in dom and "report-test" in dom  # the configuration table
    assert shot.exists() and shot.stat().st_size > 10_000
    print(f"\nHTML report screenshot: {shot}")
