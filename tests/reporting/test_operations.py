"""A run with training, evaluation and checkpoint operations: the charts, their cards and the
terminal report show the training operation, and say so; the others are not drawn on its axis.

The references are read straight from spans.jsonl, not through the reports' own loader.
"""

from __future__ import annotations

import re

import pytest

import torchtrace as tt
from torchtrace.reporting.htmlreport import write_html_report
from torchtrace.reporting.terminal import terminal_report

from ..conftest import require_binary
from ..export.debug_helpers import runtime
from .mixed_run import CHECKPOINT_S, EVAL_STEPS, TRAIN_STEPS, cycle_rate, make_mixed_run, run_mixed_steps, spans_of
from .test_browser import assert_round_ticks, canvas_attrs, chromium, page_state, render

CHARTS = ("loss", "grad_norm", "step_time", "memory", "throughput")


def _card_value(dom: str, chart: str) -> tuple[str | None, float]:
    """The card's operation and its "last" figure, as the page shows them."""
    text = re.search(rf'<span id="last-{chart}">([^<]*)</span>', dom).group(1)
    m = re.fullmatch(r"(?:(\S+) · )?last ([-0-9.,e+]+)(?: samples/s| tokens/s| ms| MiB)?", text)
    assert m, text
    return m.group(1), float(m.group(2).replace(",", ""))


def _assert_training_charts(dom: str, steps: int, last_train: dict) -> None:
    # the throughput card's last value is training's last step rate, not evaluation's
    assert _card_value(dom, "throughput")[1] == pytest.approx(cycle_rate(last_train), rel=1e-3)
    assert _card_value(dom, "loss")[1] == pytest.approx(last_train["attributes"]["torchtrace.loss"], rel=1e-3)
    state = page_state(dom)
    assert state["charts"] == {c: steps for c in CHARTS}  # no evaluation, pass or checkpoint step drawn
    for chart in CHARTS:
        attrs = canvas_attrs(dom, chart)
        assert_round_ticks([int(t) for t in attrs["data-xticks"].split(",")], 0, steps - 1)
        assert attrs.get("data-operation") == "train_step"
        assert _card_value(dom, chart)[0] == "train_step"
    assert state.get("operation") == "train_step"


def test_html_report_charts_the_training_operation(tmp_path):
    binary = require_binary("chromium")
    run_dir = make_mixed_run(tmp_path)
    train = spans_of(run_dir, "train_step")
    assert len(train) == TRAIN_STEPS and len(spans_of(run_dir, "eval_step")) == EVAL_STEPS
    # the evaluation rate is far above training's: shown as training's, it would be a clear misreport
    assert cycle_rate(spans_of(run_dir, "eval_step")[-1]) > 3 * cycle_rate(train[-1])
    out = tmp_path / "report.html"
    write_html_report(run_dir, out)
    dom = render(binary, out, tmp_path)
    _assert_training_charts(dom, TRAIN_STEPS, train[-1])
    # the operations left out of the charts are named, with their step counts
    assert page_state(dom)["others"] == {"eval_step": EVAL_STEPS, "eval_pass": 1, "save": 1}
    note = re.search(r'<p [^>]*id="tt-operations"[^>]*>(.*?)</p>', dom, re.S).group(1)
    assert "train_step" in note and "eval_step" in note and "save" in note
    # the summary's last loss is training's too, not the checkpoint's (which has none)
    m = re.search(r"<b>([^<]*)</b><span>last loss \(train_step\)</span>", dom)
    assert m and float(m.group(1)) == pytest.approx(train[-1]["attributes"]["torchtrace.loss"], rel=1e-3), m


def test_terminal_report_step_time_and_loss_are_the_training_operation(tmp_path):
    run_dir = make_mixed_run(tmp_path)
    train = spans_of(run_dir, "train_step")
    durations_ms = [(s["end_unix_ns"] - s["start_unix_ns"]) / 1e6 for s in train]
    assert max(durations_ms) < CHECKPOINT_S * 1e3  # the checkpoint is the slowest step of the run
    text = terminal_report(run_dir)
    m = re.search(r"  step time train_step: median [0-9.]+ ms, p95 [0-9.]+ ms, max ([0-9.]+) ms", text)
    assert m, text
    assert float(m.group(1)) == pytest.approx(max(durations_ms), abs=0.01)
    losses = [s["attributes"]["torchtrace.loss"] for s in train]
    m = re.search(r"  loss train_step: first (\S+), last (\S+), min (\S+), max (\S+)\n", text)
    assert m, text
    assert [float(v.rstrip(",")) for v in m.groups()] == pytest.approx(
        [losses[0], losses[-1], min(losses), max(losses)], rel=1e-3)


@pytest.mark.parametrize("steps, expected", [
    ([], None),
    ([{"operation": "a"}], "a"),
    # the training kind wins over more steps of another kind; a missing kind is training (older files)
    ([{"operation": "ev", "kind": "evaluation"}] * 5 + [{"operation": "tr"}] * 2, "tr"),
    ([{"operation": "tr", "kind": "train"}] * 3 + [{"operation": "ev", "kind": "evaluation"}] * 4, "tr"),
    # among training operations the one with the most steps; a tie goes to the one seen first
    ([{"operation": "epoch"}] + [{"operation": "step"}] * 3, "step"),
    ([{"operation": "b"}, {"operation": "a"}, {"operation": "a"}, {"operation": "b"}], "b"),
    # no training operation at all: the one with the most steps
    ([{"operation": "ev", "kind": "evaluation"}] * 2 + [{"operation": "ck", "kind": "checkpoint"}], "ev"),
])
def test_main_operation_rule(steps, expected):
    from torchtrace.reporting.summary import main_operation

    assert main_operation(steps) == expected


def test_live_page_charts_the_training_operation(tt_runtime, tmp_path):
    binary = require_binary("chromium")
    rt = runtime()
    run_mixed_steps()
    tt.flush()
    history = rt.history.steps()
    last_train = [s for s in history if s["operation"] == "train_step"][-1]
    ref = {"attributes": {"torchtrace.samples": last_train["samples"], "torchtrace.loss": last_train["loss"],
                          "torchtrace.data_wait_s": last_train.get("data_wait_s")},
           "start_unix_ns": 0, "end_unix_ns": round(last_train["duration_s"] * 1e9)}
    proc = chromium(binary, f"{rt.server.url}/", tmp_path / "live.png", tmp_path / "profile")
    try:
        dom, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    _assert_training_charts(dom, TRAIN_STEPS, ref)
    # the step summaries the page reads carry each step's kind
    assert [s.get("kind") for s in history if s["operation"] == "eval_step"] == ["evaluation"] * EVAL_STEPS
