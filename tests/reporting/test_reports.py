"""terminal_report / html_report of a finished run, and the report subcommand hook."""

from __future__ import annotations

import argparse
import collections
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

from .run_fixture import BAD_STEPS, INPUT_NAN_STEP, NAN_STEP, STEPS, make_run


def _embedded(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="tt-data">(.*?)</script>', html, re.S)
    assert m, "no embedded data"
    return json.loads(m.group(1))


@pytest.fixture
def run(tmp_path):
    return make_run(tmp_path)


def test_load_run_steps_match_history(run):
    run_dir, history_steps = run
    data = load_run(run_dir)
    assert [s["step"] for s in data.steps] == list(range(STEPS))
    for mine, ref in zip(data.steps, history_steps):
        if ref["step"] in BAD_STEPS:
            assert math.isnan(mine["loss"]) and not math.isfinite(mine["grad_norm"])
        else:
            assert mine["loss"] == ref["loss"] and mine["grad_norm"] == ref["grad_norm"]
        assert sorted(mine["anomalies"]) == sorted(ref["anomalies"])
        assert mine["skipped"] is ref["skipped"] is (ref["step"] in BAD_STEPS)
        assert mine["memory"]["rss_bytes"] == ref["memory"]["rss_bytes"]
    anomalies = [(e["data"]["step"], e["data"]["kind"]) for e in data.events if e["type"] == "anomaly"]
    expected = [(s["step"], k) for s in history_steps for k in s["anomalies"]]
    assert sorted(anomalies) == sorted(expected) and {s for s, _ in anomalies} == set(BAD_STEPS)
    assert [(f["step"], f["cause"], f["module"]) for f in data.forensics] == [
        (NAN_STEP, "forward", "norm"), (INPUT_NAN_STEP, "input", "")]
    assert data.problems == []


def _three_sources(run_dir) -> tuple[list, list, list]:
    report = json.loads((run_dir / "report.json").read_text())
    section = report["forensics"]["reports"]
    timeline = [e for e in report["events"] if e["type"] == "forensics"]
    spans = [json.loads(line) for line in (run_dir / "spans.jsonl").read_text().splitlines()]
    events = [ev for sp in spans for ev in sp["events"] if ev["name"] == "torchtrace.forensics"]
    return section, timeline, events


def test_each_replay_is_one_entry_though_the_files_tell_it_three_times(run):
    run_dir, _ = run
    section, timeline, span_events = _three_sources(run_dir)
    assert len(section) == len(timeline) == len(span_events) == 2  # what the reports must not add up
    data = load_run(run_dir)
    assert [f["step"] for f in data.forensics] == list(BAD_STEPS)
    assert [e["data"]["step"] for e in _embedded(html_report(run_dir))["events"] if e["type"] == "forensics"] == \
        list(BAD_STEPS)
    text = terminal_report(run_dir)
    assert "  forensic reports: 2 (one per replayed step" in text
    assert f"    step {NAN_STEP} train_step: forward: born in norm (_Norm); input finite, output 8 NaN/Inf\n" in text
    assert f"    step {INPUT_NAN_STEP} train_step: input: came in with the batch: the model's input (Normalised) " \
           f"held 1 NaN/Inf before any module ran\n" in text


def test_forensics_read_back_from_the_spans_alone(run):
    run_dir, _ = run
    section, _, _ = _three_sources(run_dir)
    (run_dir / "report.json").unlink()
    data = load_run(run_dir)
    assert len(data.forensics) == 2
    for mine, ref in zip(data.forensics, section):
        for key in ("step", "operation", "cause", "module", "module_type", "kind", "inputs", "outputs",
                    "nonfinite_grads"):
            assert mine[key] == ref[key], key
    assert "  forensic reports: 2 " in terminal_report(run_dir)


def test_terminal_report(run):
    run_dir, history_steps = run
    text = terminal_report(run_dir)
    assert text.startswith(f"torchtrace run {run_dir.name}  service report-test  rank 0/1  level basic\n")
    assert f"  steps: {STEPS} (train_step {STEPS})" in text
    durations = sorted(s["duration_s"] for s in load_run(run_dir).steps)
    assert f"median {statistics.median(durations) * 1e3:.2f} ms" in text
    first, last = history_steps[0]["loss"], history_steps[-1]["loss"]
    finite = [s["loss"] for s in history_steps if s["step"] not in BAD_STEPS]
    assert f"  loss: first {first:.4g}, last {last:.4g}, min {min(finite):.4g}, max {max(finite):.4g}, " \
           f"non-finite at 2 step(s)" in text
    kinds = collections.Counter(k for s in history_steps for k in s["anomalies"])
    assert f"  anomalies: 2 step(s), rate {200 / STEPS:.2f} %: " \
           + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) in text
    assert f"  skipped updates: 2 (step {NAN_STEP}, {INPUT_NAN_STEP})\n" in text
    assert f"    step {NAN_STEP} train_step: nonfinite_loss: loss is nan" in text
    assert f"  telemetry: spans file: {STEPS} exported; internal errors none" in text


def test_terminal_report_says_how_fast_and_where_the_time_went(run):
    """The throughput and goodput lines: the report's last window of 32-sample batches, and its
    wall time split, with the skipped updates and the replays among the badput."""
    run_dir, _ = run
    text = terminal_report(run_dir)
    section = json.loads((run_dir / "report.json").read_text())["throughput"]
    window = section["operations"]["train_step"]
    assert window["samples_per_s"] == pytest.approx(32 * window["steps"] / window["seconds"])  # a plain count
    rate = re.search(r"\n  throughput: ([\d,]+) samples/s, [\d.,]+ [kMGTP]?FLOP/s, no MFU \(this device's peak is unknown: "
                     r"set peak_flops\), over the last (\d+) steps\n", text)
    assert rate, text
    assert int(rate.group(1).replace(",", "")) == round(window["samples_per_s"])
    assert int(rate.group(2)) == window["steps"]
    badput = section["badput_s"]
    assert badput["skipped_step"] > 0 and badput["forensics"] > 0  # the two bad steps: skipped, then replayed
    assert section["productive_s"] + sum(badput.values()) == pytest.approx(section["wall_s"])
    goodput = re.search(r"\n  goodput: (\d+)% of wall time in applied updates; the rest: (.*)\n", text)
    assert goodput, text
    assert int(goodput.group(1)) == round(100 * section["goodput_ratio"])
    named = [part.split(" ")[0] for part in goodput.group(2).split(", ")]
    assert named == sorted((k for k, v in badput.items() if v > 0), key=lambda k: -badput[k])


def test_throughput_rows_say_why_there_is_no_mfu_and_scale_the_flop_rate():
    """An operation without FLOPs (a validation pass) has no MFU for that reason, not for an
    unknown peak, and one without a batch says how to give it; FLOP/s are printed in the unit that keeps them readable (a small model's
    8 MFLOP/s read "0.00 GFLOP/s"), and parse back to the section's figure."""
    from torchtrace.reporting.summary import throughput_rows

    units = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
    ops = {"train_step": {"steps": 20, "samples_per_s": 2529.0, "flops_per_s": 8.093e6, "mfu": None},
           "validation": {"steps": 3, "samples_per_s": None, "flops_per_s": None, "mfu": None},
           "big": {"steps": 20, "samples_per_s": 10.0, "flops_per_s": 3.957e14, "mfu": 0.4}}
    rows = dict(throughput_rows({"operations": ops}))
    assert rows["throughput validation"] == "no samples/s (no batch in the step's arguments or its model's " \
                                            "call: give inputs= or record_batch(samples=...)), no MFU (no " \
                                            "FLOPs: none counted or given for this operation), over the last 3 steps"
    assert "this device's peak is unknown: set peak_flops" in rows["throughput train_step"]
    assert "MFU 40.0%" in rows["throughput big"]
    for name in ("train_step", "big"):
        value, unit = re.search(r"([\d.,]+) ([kMGTP]?)FLOP/s", rows[f"throughput {name}"]).groups()
        assert float(value.replace(",", "")) * units[unit] == pytest.approx(ops[name]["flops_per_s"], rel=5e-3)
        assert 1 <= float(value.replace(",", "")) < 1000


def test_non_finite_rates_are_printed_not_a_crash(run):
    """report.json writes a non-finite number as a strict-JSON string ("Infinity", "NaN"): the
    throughput and goodput rows print it by name (an MFU over a peak of 1e-320, FLOPs that
    overflowed), and the finite figures beside it as before; `torchtrace report` prints the run."""
    from torchtrace.reporting.summary import throughput_rows

    ops = {"train_step": {"steps": 20, "samples_per_s": 640.0, "tokens_per_s": "NaN", "flops_per_s": "Infinity",
                          "mfu": "Infinity"}}
    rows = dict(throughput_rows({"operations": ops, "goodput_ratio": "NaN",
                                 "badput_s": {"data_wait": "Infinity", "startup": 0.05}}))
    assert rows["throughput"] == ("NaN tokens/s, 640 samples/s, Infinity FLOP/s, MFU Infinity, "
                                  "over the last 20 steps")
    assert rows["goodput"] == "NaN of wall time in applied updates; the rest: data_wait Infinity, startup 50 ms"
    run_dir, _ = run
    report = json.loads((run_dir / "report.json").read_text())
    window = report["throughput"]["operations"]["train_step"]
    window["mfu"] = "Infinity"
    (run_dir / "report.json").write_text(json.dumps(report))
    text = terminal_report(run_dir)
    assert f"{round(window['samples_per_s']):,} samples/s" in text and "MFU Infinity" in text, text


def test_one_huge_flops_figure_leaves_the_rest_of_the_throughput_section(tmp_path):
    """record_batch(flops=1e307) every step (a valid, finite number): the FLOP rate overflows
    to Infinity, and report.json still has goodput, badput and the samples rate (a plain
    count of the 4-row batches over the window's seconds); nothing is an internal error."""
    import torch

    import torchtrace as tt
    from torchtrace.api import get_runtime

    tt.configure(run_dir=str(tmp_path), run_id="huge", prometheus_port="off", register_atexit=False, strict=True)
    try:
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        @tt.debug_operation(model=model, optimizer=opt)
        def train_step(x):
            tt.current_step().record_batch(flops=1e307)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

        for _ in range(25):
            train_step(torch.randn(4, 8))
        errors = get_runtime().errors.total
    finally:
        tt.shutdown()
    assert errors == 0
    section = json.loads((tmp_path / "huge" / "report.json").read_text())["throughput"]
    window = section["operations"]["train_step"]
    assert window["flops_per_s"] == "Infinity"
    assert window["samples_per_s"] == pytest.approx(4 * window["steps"] / window["seconds"])
    assert 0 < section["goodput_ratio"] <= 1 and "badput_s" in section
    text = terminal_report(tmp_path / "huge")
    assert "Infinity FLOP/s" in text and "\n  goodput: " in text, text


def test_html_report_is_self_contained_and_holds_the_run(run):
    run_dir, history_steps = run
    html = html_report(run_dir)
    assert html.startswith("<!DOCTYPE html>")
    # nothing is fetched from anywhere: no external scripts, styles, images or fonts
    assert not re.search(r'(src|href)\s*=\s*"(?!#)', html)
    assert "@import" not in html and "url(" not in html
    data = _embedded(html)
    assert [s["step"] for s in data["steps"]] == list(range(STEPS))
    assert [s["loss"] for s in data["steps"]] == [
        "NaN" if s["step"] in BAD_STEPS else s["loss"] for s in history_steps]
    assert [s["step"] for s in data["steps"] if s["skipped"]] == list(BAD_STEPS)
    assert data["summary"]["run_id"] == run_dir.name
    assert data["summary"]["totals"]["steps"] == STEPS
    assert data["training"]["anomaly_steps"] == 2 and data["training"]["anomaly_rate"] == 2 / STEPS
    assert data["settings"]["service_name"] == "report-test"
    assert data["settings"]["debug_token"] is None
    assert {e["data"]["step"] for e in data["events"] if e["type"] == "anomaly"} == set(BAD_STEPS)
    # the configuration is folded away, its size on the fold
    assert re.search(r'<details class="config" id="tt-config"><summary>Configuration: '
                     rf'<span id="tt-settings-count">{len(data["settings"])}</span> settings', html)


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


@pytest.mark.parametrize("n", [1001, 5001, 6000, 12000, 12345])
def test_chart_steps_keeps_the_first_and_the_last_step(n):
    """The HTML report's "last loss" card reads the last charted step: thinned without it, a
    run of 6000 steps said its last loss was step 5998's."""
    steps = [{"step": i, "loss": float(i), "anomalies": []} for i in range(n)]
    thinned = chart_steps(steps, limit=1000)
    assert (thinned[0]["step"], thinned[-1]["step"]) == (0, n - 1)
    assert len(thinned) <= 1000


def test_chart_steps_keeps_each_operations_last_step():
    steps = [{"step": i, "operation": "eval_step" if i % 100 == 37 else "train_step", "anomalies": []}
             for i in range(6000)]
    thinned = chart_steps(steps, limit=1000)
    last = {s["operation"]: s["step"] for s in thinned}
    assert last == {"train_step": 5999, "eval_step": 5937}


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
