"""The report grows with the steps it keeps, not with the model's parameter names (issue 53, item 1).

The audit: a diverged 5,000-tensor model at 1,000 steps wrote 4.83 MB, 9.9 MB with 91-character
names and 13.8 MB with 131. Each retained step and event now keeps at most
``NAME_CHARS`` characters of names per list and of text per message (``history.NAME_CHARS``),
so a step summary is bounded by about 1.4 KB and a non-finite gradient event by about
2.5 KB whatever the names: 40 steps with two events each stay under 40 x (1.4 + 2 x 2.5) KB
plus the report's fixed part. Short names (``p12``) fit the budget whole, as before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import torchtrace as tt

STEPS = 40
NAME_CHARS = 512  # torchtrace.record.history.NAME_CHARS, the characters of names one list keeps
PER_STEP_BOUND = 1400 + 2 * 2500  # a step summary and its two anomaly events, in bytes
FIXED_BOUND = 64 * 1024  # settings, totals, throughput, telemetry, the last step in full


class Named(torch.nn.Module):
    """``tensors`` parameter tensors named ``p<i>_`` padded with x to ``name_len`` characters."""

    def __init__(self, tensors: int, name_len: int) -> None:
        super().__init__()
        for i in range(tensors):
            self.register_parameter(f"p{i}_".ljust(name_len, "x"), torch.nn.Parameter(torch.randn(2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(list(self.parameters())) * x


def _report(tmp_path: Path, tensors: int, name_len: int) -> tuple[int, dict, list[str]]:
    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            os.environ.pop(name)
    torch.manual_seed(0)
    model = Named(tensors, name_len)
    names = [n for n, _ in model.named_parameters()]
    # (foreach: one update for the 5,000 tensors, not 5,000; what torchtrace records is the same)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    run_dir = tmp_path / f"runs-{tensors}-{name_len}"
    tt.configure(prometheus_port=None, run_dir=str(run_dir), register_atexit=False, forensics=False,
                 history_size=STEPS)
    x = torch.ones(2 * tensors)
    for _ in range(STEPS):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = (model(x) * float("nan")).sum()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            step.record_loss(loss)
            opt.step()
    tt.shutdown()
    [path] = list(run_dir.glob("*/report*.json"))
    return path.stat().st_size, json.loads(path.read_text()), names


@pytest.mark.slow
def test_report_size_grows_with_steps_not_with_names_or_model_size(tmp_path, caplog):
    caplog.set_level("ERROR")  # 80 anomaly warnings per run are not the subject here
    sizes, reports = {}, {}
    for tensors, name_len in ((500, 4), (5000, 4), (5000, 91), (5000, 131)):
        sizes[(tensors, name_len)], *reports[(tensors, name_len)] = _report(tmp_path, tensors, name_len)
    print("report bytes at", STEPS, "steps:", {f"{t} tensors, {n}-char names": s for (t, n), s in sizes.items()})
    for (tensors, _), (report, names) in reports.items():
        # The names are still there, whole, and the count of those left out is stated.
        last = report["steps"][-1]
        kept = last["grad_nonfinite_params"]
        assert kept and kept[0] == names[0]
        assert set(kept) <= set(names)
        assert len(kept) + last["grad_nonfinite_params_omitted"] == tensors == last["grad_nonfinite_count"]
        assert sum(len(n) for n in kept) <= NAME_CHARS
        grad_events = [e for e in report["events"] if e["data"].get("kind") == "nonfinite_grad"]
        assert grad_events and names[0] in grad_events[-1]["message"]
        assert len(report["steps"]) == STEPS
    short = sizes[(5000, 4)]
    # Names of 91 and 131 characters cost no more than a quarter over 4-character ones (the
    # audit's 131-character names tripled the report) ...
    assert sizes[(5000, 91)] <= 1.25 * short and sizes[(5000, 131)] <= 1.25 * short, sizes
    # ... ten times the tensors cost no more than a quarter more ...
    assert short <= 1.25 * sizes[(500, 4)], sizes
    # ... and every report is within the stated bound per retained step.
    for size in sizes.values():
        assert size <= FIXED_BOUND + STEPS * PER_STEP_BOUND, sizes
