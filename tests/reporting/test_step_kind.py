"""Each step's kind (train, evaluation, checkpoint, other) reaches its summary and its span, so
the reports can tell the training operation from an evaluation pass or a checkpoint."""

from __future__ import annotations

from torchtrace.reporting.runfiles import load_run

from .mixed_run import EVAL_STEPS, TRAIN_STEPS, make_mixed_run, spans_of

KINDS = {"train_step": "train", "eval_step": "evaluation", "eval_pass": "evaluation", "save": "checkpoint"}


def test_kind_in_spans_and_in_the_report_steps(tmp_path):
    run_dir = make_mixed_run(tmp_path)
    # spans: the kind is named unless it is the default, train
    for op, kind in KINDS.items():
        spans = spans_of(run_dir, op)
        assert spans and {s["attributes"].get("torchtrace.operation.kind") for s in spans} == \
            {None if kind == "train" else kind}, op
    # the report's step summaries (the history) and the steps read back from the spans
    data = load_run(run_dir)
    assert {s["operation"]: s["kind"] for s in data.report["steps"]} == KINDS
    assert {s["operation"]: s["kind"] for s in data.steps} == KINDS
    assert [s["operation"] for s in data.steps].count("train_step") == TRAIN_STEPS
    assert [s["operation"] for s in data.steps].count("eval_step") == EVAL_STEPS
