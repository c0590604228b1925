"""The live page and the HTML report in headless Chromium: screenshots, drawn data, anomalies.

Screenshots go to ``$TORCHTRACE_ARTIFACTS_DIR`` when it is set (CI keeps them), else to the
test's temporary directory: the suite writes nothing into the checkout.
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
from torchtrace.reporting.page import LIVE_STEPS
from torchtrace.reporting.terminal import terminal_report

from ..conftest import require_binary
from ..export.debug_helpers import Trainer, runtime
from .run_fixture import BAD_STEPS, INPUT_NAN_STEP, NAN_STEP, STEPS, make_run

pytestmark = pytest.mark.realserver


def artifacts_dir(tmp_path: Path) -> Path:
    path = Path(os.environ.get("TORCHTRACE_ARTIFACTS_DIR") or tmp_path / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def significant_digits(text: str) -> int:
    """``"36,224"`` -> 5, ``"407.1"`` -> 4, ``"0.1903"`` -> 4, ``"1.5e-05"`` -> 2."""
    mantissa = text.replace(",", "").lstrip("-").split("e")[0]
    return len(mantissa.replace(".", "").lstrip("0")) or 1


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
    shot = artifacts_dir(tmp_path) / "live_page.png"
    shot.unlink(missing_ok=True)
    proc = chromium(binary, f"{rt.server.url}/", shot, tmp_path / "profile")
    deadline = time.monotonic() + 60
    try:
        while proc.poll() is None and time.monotonic() < deadline:  # training goes on while the page polls
            if trainer.i < LIVE_STEPS:  # (past it, the NaN step would leave the page's window of steps)
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
    assert state["charts"] == {"loss": n - 1, "grad_norm": n - 1, "step_time": n, "memory": n, "throughput": n}
    assert canvas_points(dom) == state["charts"]
    assert state["goodput"] >= 2  # productive time and at least one kind of badput (startup)
    assert {"step": NAN_STEP, "kind": "nonfinite_loss"} in state["anomalies"]
    assert 'data-kind="nonfinite_loss"' in dom and "loss is nan" in dom
    assert shot.exists() and shot.stat().st_size > 10_000
    print(f"\nlive page screenshot: {shot} ({n} steps drawn, {state['renders']} renders)")


def render(binary: str, html_file: Path, tmp_path: Path, shot: Path | None = None) -> str:
    """The DOM of ``html_file`` after headless Chromium ran its scripts."""
    shot = shot or tmp_path / "shot.png"
    proc = chromium(binary, html_file.resolve().as_uri(), shot, tmp_path / f"profile-{html_file.stem}")
    dom, _ = proc.communicate(timeout=60)
    return dom


def canvas_attrs(dom: str, chart: str) -> dict[str, str]:
    m = re.search(rf'<canvas id="chart-{chart}"([^>]*)>', dom)
    assert m, chart
    return dict(re.findall(r'(data-[a-z]+)="([^"]*)"', m.group(1)))


def assert_round_ticks(ticks: list[int], first: int, last: int) -> None:
    """Ticks at multiples of 1, 2 or 5 times a power of ten, inside the steps, 3 to 10 of them."""
    assert 3 <= len(ticks) <= 10, ticks
    gaps = {b - a for a, b in zip(ticks, ticks[1:])}
    assert len(gaps) == 1, ticks
    gap = gaps.pop()
    assert gap > 0 and int(str(gap).rstrip("0") or "0") in (1, 2, 5), ticks
    assert all(t % gap == 0 for t in ticks) and first <= ticks[0] < first + gap and last - gap < ticks[-1] <= last


def test_html_report_in_chromium(tmp_path):
    binary = require_binary("chromium")
    run_dir, _ = make_run(tmp_path)
    out = artifacts_dir(tmp_path) / "report.html"
    write_html_report(run_dir, out)
    shot = artifacts_dir(tmp_path) / "report.png"
    shot.unlink(missing_ok=True)
    dom = render(binary, out, tmp_path, shot)
    state = page_state(dom)
    good = STEPS - len(BAD_STEPS)
    assert state["steps"] == STEPS
    assert state["charts"] == {"loss": good, "grad_norm": good, "step_time": STEPS, "memory": STEPS,
                               "throughput": STEPS}
    assert canvas_points(dom) == state["charts"]
    # one entry per replay, the same count as the terminal report
    assert state["forensics"] == [
        {"step": NAN_STEP, "operation": "train_step", "cause": "forward", "module": "norm"},
        {"step": INPUT_NAN_STEP, "operation": "train_step", "cause": "input", "module": ""}]
    assert len(re.findall(r'<div class="forensic" id="forensic-\d+"', dom)) == 2
    assert "  forensic reports: 2 " in terminal_report(run_dir)
    assert re.search(r"<b>2</b><span>forensic replays</span>", dom)
    assert len(re.findall(r'<a href="#forensic-7"', dom)) == 1  # linked once, not under every row
    # skipped updates: on every chart, and on each anomaly row of those steps
    assert state["skipped"] == list(BAD_STEPS)
    for chart in ("loss", "grad_norm", "step_time", "memory", "throughput"):
        attrs = canvas_attrs(dom, chart)
        assert attrs["data-skipped"] == ",".join(map(str, BAD_STEPS))
        assert attrs["data-xlabel"] == "step"
        assert_round_ticks([int(t) for t in attrs["data-xticks"].split(",")], 0, STEPS - 1)
        assert state["axes"][chart]["xticks"] == attrs["data-xticks"]
    assert {c: canvas_attrs(dom, c)["data-ylabel"] for c in state["axes"]} == {
        "loss": "loss", "grad_norm": "L2 norm", "step_time": "ms", "memory": "MiB", "throughput": "samples/s"}
    # the cards' last values: 4 significant digits, or a whole number in groups of three from
    # 1,000 up (not "last 36223.9683/s"), with their unit
    units = {"loss": "", "grad_norm": "", "step_time": " ms", "memory": " MiB", "throughput": " samples/s"}
    for chart, unit in units.items():
        text = re.search(rf'<span id="last-{chart}">([^<]*)</span>', dom).group(1)
        m = re.fullmatch(r"train_step · last (\S+)" + re.escape(unit), text)
        assert m and re.fullmatch(r"-?(\d{1,3}(,\d{3})+|\d{1,3}(\.\d+)?|\d\.\d+e-\d+)", m.group(1)), text
        assert significant_digits(m.group(1)) <= 4 or "." not in m.group(1), text
    # the goodput bar: productive time, and each kind of badput this run had (skipped updates
    # included), its segments' widths adding up to the whole wall time
    kinds = re.findall(r'<span class="gseg g-([a-z_]+)" data-kind="[a-z_]+"', dom)
    assert kinds[0] == "productive" and "skipped_step" in kinds and state["goodput"] == len(kinds)
    widths = [float(w) for w in re.findall(r'class="gseg[^"]*"[^>]*style="width: ([0-9.]+)%', dom)]
    assert len(widths) == len(kinds) and abs(sum(widths) - 100) < 0.5
    # its legend: one key per segment, in the segment's own colour, no two kinds alike
    legend = state["goodput_legend"]
    assert [k["kind"] for k in legend] == kinds
    assert all(k["swatch"] == k["segment"] for k in legend), legend
    assert len({k["segment"] for k in legend}) == len(legend), legend
    rows = re.findall(r'<tr class="anomaly" data-kind="([a-z_]+)" data-step="(\d+)" data-skipped="([01])">', dom)
    assert rows and all((int(step) in BAD_STEPS) == (flag == "1") for _, step, flag in rows)
    assert dom.count('<span class="badge skip">skipped</span>') == len(rows)
    # the configuration is there, folded
    assert re.search(r'<details class="config" id="tt-config"><summary>', dom)
    assert "service_name" in dom and "report-test" in dom
    assert shot.exists() and shot.stat().st_size > 10_000
    print(f"\nHTML report screenshot: {shot}")


def _memory_run(path: Path, rss_mib: list[float]) -> Path:
    """A run directory whose spans hold only steps and their RSS."""
    path.mkdir()
    lines = []
    for i, mib in enumerate(rss_mib):
        start = 1_000_000_000 * (i + 1)
        lines.append(json.dumps({"name": "train_step", "start_unix_ns": start, "end_unix_ns": start + 5_000_000,
                                 "attributes": {"torchtrace.step": i, "torchtrace.operation": "train_step",
                                                "torchtrace.loss": 1.0 / (i + 1),
                                                "torchtrace.memory.rss_bytes": int(mib * 2**20)}, "events": []}))
    (path / "spans.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_memory_axis_keeps_noise_flat_and_shows_a_leak(tmp_path):
    """Allocator noise of 0.8 MiB fills a twentieth of the axis at most; a 100 MiB climb fills most of it."""
    binary = require_binary("chromium")
    noise = [300 + 0.8 * ((i * 7919) % 13) / 12 for i in range(200)]
    leak = [300 + 0.5 * i for i in range(200)]
    for name, series, low, high in (("noise", noise, 0.0, 0.05), ("leak", leak, 0.5, 1.0)):
        run = _memory_run(tmp_path / name, series)
        out = tmp_path / f"{name}.html"
        write_html_report(run, out)
        attrs = canvas_attrs(render(binary, out, tmp_path), "memory")
        ylo, yhi = map(float, attrs["data-yrange"].split(","))
        assert ylo <= min(series) and max(series) <= yhi, (name, attrs)
        share = (max(series) - min(series)) / (yhi - ylo)
        assert low <= share <= high, (name, share, attrs)
        assert_round_ticks([int(t) for t in attrs["data-xticks"].split(",")], 0, 199)


def test_throughput_axis_names_tokens_when_the_steps_count_them(tmp_path):
    """A language model's steps count tokens: the axis and the card say tokens/s, and the last
    figure is the last step's tokens over its cycle (duration plus data wait), computed here."""
    binary = require_binary("chromium")
    run = tmp_path / "lm"
    run.mkdir()
    lines = []
    for i in range(30):
        start = 1_000_000_000 * (i + 1)
        lines.append(json.dumps({"name": "train_step", "start_unix_ns": start, "end_unix_ns": start + 40_000_000,
                                 "attributes": {"torchtrace.step": i, "torchtrace.operation": "train_step",
                                                "torchtrace.loss": 1.0, "torchtrace.samples": 8,
                                                "torchtrace.tokens": 8 * 1024, "torchtrace.data_wait_s": 0.01},
                                 "events": []}))
    (run / "spans.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "lm.html"
    write_html_report(run, out)
    dom = render(binary, out, tmp_path)
    attrs = canvas_attrs(dom, "throughput")
    assert attrs["data-ylabel"] == "tokens/s"
    # tick labels in thousands ("160k"), not "1.6e+5"
    assert all(re.fullmatch(r"0|\d{1,3}(\.\d+)?k", t) for t in attrs["data-yticks"].split(",")), attrs
    card = re.search(r'<span id="last-throughput">([^<]*)</span>', dom).group(1)
    assert card == f"train_step · last {round(8 * 1024 / 0.05):,} tokens/s", card  # 163,840


def test_the_report_card_counts_spans_per_sink(tmp_path):
    """Two sinks, the file with every span and a dead collector with none: the card shows each
    sink's books, as the terminal report does, not one sum that counts every span twice."""
    binary = require_binary("chromium")
    run_dir, _ = make_run(tmp_path)
    report_file = Path(run_dir) / "report.json"
    report = json.loads(report_file.read_text())
    report["telemetry"]["span_exporters"] = [
        {"exporter": "file", "emitted": STEPS, "exported": STEPS, "dropped": {}},
        {"exporter": "otlp_grpc", "emitted": STEPS, "exported": 0, "dropped": {"export_failed": 5, "shutdown": 15}}]
    report["telemetry"]["spans_exported"] = STEPS
    report["telemetry"]["spans_dropped"] = {"export_failed": 5, "shutdown": 15}
    report_file.write_text(json.dumps(report))
    out = write_html_report(run_dir, tmp_path / "report.html")
    dom = render(binary, out, tmp_path)
    cards = report_cards(dom)
    assert cards["spans exported / dropped (file)"] == f"{STEPS} / 0", cards
    assert cards["spans exported / dropped (otlp_grpc)"] == "0 / 20", cards
    assert "spans exported / dropped" not in cards  # no sum over the sinks
    assert f"file: {STEPS} exported; otlp_grpc: 0 exported, 20 dropped" in terminal_report(run_dir)


def test_the_report_card_counts_the_updates_the_loss_scaler_skipped(tmp_path):
    """float16 whose scale starts too high: the scaler skips updates until the scale backs off.
    The card says how many, as the terminal report does; a run without such steps shows no card."""
    import torch

    import torchtrace as tt
    from torchtrace.api import get_runtime

    from ..step.test_loss_scaler import STEPS as SCALER_STEPS
    from ..step.test_loss_scaler import _body, _setup

    binary = require_binary("chromium")
    result = tt.configure(service_name="scaler", prometheus_port="off", run_dir=str(tmp_path / "runs"),
                          strict=True, register_atexit=False)
    model, opt, scaler, x = _setup(False, 2.0 ** 24)
    scales = []
    for _ in range(SCALER_STEPS):
        scales.append(scaler.get_scale())
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            step.record_loss(_body(model, opt, scaler, x, clip=False))
    skipped = get_runtime().history.totals["scaler_overflow_steps"]
    tt.shutdown()
    assert skipped >= 2 and isinstance(opt, torch.optim.AdamW)
    assert skipped >= sum(later < now for now, later in zip(scales, scales[1:]))  # (the scale backed off)
    dom = render(binary, write_html_report(tmp_path / "runs" / result.run_id, tmp_path / "scaler.html"), tmp_path)
    assert report_cards(dom)["skipped by the loss scaler"] == str(skipped)
    plain_dir, _ = make_run(tmp_path / "plain")
    plain = report_cards(render(binary, write_html_report(plain_dir, tmp_path / "plain.html"), tmp_path))
    assert "skipped updates" in plain and "skipped by the loss scaler" not in plain, plain


def report_cards(dom: str) -> dict[str, str]:
    """The report card's figures, by label."""
    return {label: value for value, label in re.findall(r'<div class="stat"><b>([^<]*)</b><span>([^<]*)</span>', dom)}


def test_the_html_report_tells_each_forensic_report_as_the_terminal_does(tmp_path):
    """The page's sentence is the terminal's rule written again in JavaScript: for a carried-over
    gradient NaN (before: "unknown: born in ?") and a forward NaN, the text Chromium draws is the
    terminal report's line for the same step."""
    from .test_report_truth import accumulation_run

    binary = require_binary("chromium")
    run_dir = accumulation_run(tmp_path)
    dom = html_lib.unescape(render(binary, write_html_report(run_dir, tmp_path / "accumulate.html"), tmp_path))
    drawn = dict(re.findall(r'<div class="forensic" id="forensic-\d+" data-step="(\d+)".*?<p><b>[^<]*</b>([^<]*)</p>',
                            dom))
    text = terminal_report(run_dir)
    assert sorted(drawn) == ["5", "7"], drawn
    for step, sentence in drawn.items():
        assert f"    step {step} micro_step: {sentence}\n" in text, (sentence, text)
    assert drawn["7"].startswith("carried over: non-finite gradients from before this step (3: ")
