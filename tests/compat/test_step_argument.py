"""``check_gradients``' step, given positionally or by keyword, is one Python int (issue 46:
typing the seed argument parser found that a numpy integer given as ``step=`` came back
unconverted, and reached the run's report as the string "3")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

import torchtrace as tt
from torchtrace import PyTorchDebugger
from torchtrace.compat.settings import check_arguments


def test_a_numpy_step_is_a_python_int_by_keyword_as_positionally():
    _, by_keyword, _ = check_arguments(step=np.int64(3))
    _, positional, _ = check_arguments(np.int64(3))
    assert (by_keyword, type(by_keyword)) == (3, int)
    assert (positional, type(positional)) == (3, int)


def test_the_reports_anomaly_event_holds_the_keyword_step_as_a_number(tt_runtime):
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    model.weight.grad[0, 0] = float("nan")
    report = PyTorchDebugger().check_gradients(model, step=np.int64(3))
    assert type(report["step"]) is int
    tt.shutdown()
    run_report = json.loads((Path(tt_runtime.run_dir) / "report.json").read_text())
    steps = [e["data"]["step"] for e in run_report["events"] if e["type"] == "anomaly"]
    assert steps == [3]
