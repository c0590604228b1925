"""benchmarks/feature_costs.py: each stub takes away exactly the part it names (else the cost
it prints would be some other part's), and the script runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forking import FORK_RUN, run_group

ROOT = Path(__file__).resolve().parents[2]
# One worker runs this module under pytest-xdist, so its module-scoped launch runs once.
pytestmark = pytest.mark.xdist_group("feature_costs")

# One process per part: a stub is for the rest of the process. Each part's process is forked
# from one that has imported torch, torchtrace and feature_costs and done nothing else (the
# imports took most of a process's time: 8 of them, 3-6 s each on a loaded 2-core machine);
# the child configures torchtrace, stubs its part, trains a small MLP for three steps and
# prints the last record, the last span's attributes and the metric sums.
PARTS = ["none", "key", "clock", "ledger", "metrics", "spans", "seam", "lr"]
_PROBE = r"""
import json, sys, tempfile
sys.path.insert(0, sys.argv[1])
import torch, torchtrace as tt
from torchtrace.api import get_runtime
import feature_costs
# What configure() and a first step import in any process, imported here once for all parts.
import torch._dynamo, torchtrace.step.setup, torchtrace.step.runtime, torchtrace.export.server

def probe(part):
    tt.configure(service_name="probe", level="basic", prometheus_port=0, run_dir=tempfile.mkdtemp(),
                 register_atexit=False)
    if part != "none":
        feature_costs.stub(part)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rt = get_runtime()
    @tt.debug_operation(name="train_step", model=model, optimizer=opt)
    def step(x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss
    for n in (4, 6, 4):
        step(torch.randn(n, 8))
    rt.flush(5.0)
    last = rt.history.steps()[-1]
    spans = [json.loads(line) for line in open(rt.spans_path)]
    attrs = spans[-1]["attributes"]
    list(rt.metrics.steps.collect())  # a scrape: the step series' throughput values are added up then
    op = rt.metrics.steps._by_name["train_step"]
    print(json.dumps({"record": {k: last.get(k) for k in ("samples", "flops", "data_wait_s", "phases")},
                      "span": sorted(k for k in attrs if k.startswith("torchtrace.") and k.split(".")[1] in
                                     ("samples", "flops", "lr", "data_wait_s", "phase")),
                      "metrics": [op.samples, op.flops, op.lr], "shapes": len(rt.throughput.flops)}))

print(json.dumps({part: fork_run(probe, part) for part in sys.argv[2:]}))
"""


@pytest.fixture(scope="session")  # once a worker: a module fixture ran again when xdist ran tests between
def probes() -> dict:
    """Each part's probe: its return code, output and errors."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    proc = run_group([sys.executable, "-c", FORK_RUN + _PROBE, str(ROOT / "benchmarks"), *PARTS], env=env,
                     timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _probe(probes: dict, part: str) -> dict:
    got = probes[part]
    assert got["returncode"] == 0, got["stderr"][-3000:]
    return json.loads(got["stdout"].strip().splitlines()[-1])


@pytest.fixture(scope="session")  # once a worker: a module fixture ran again when xdist ran tests between
def unstubbed(probes) -> dict:
    return _probe(probes, "none")


def test_with_nothing_stubbed_every_part_is_there(unstubbed):
    record = unstubbed["record"]
    assert record["samples"] == 4 and record["flops"] > 0 and unstubbed["metrics"][2] == [0.05]
    assert record["data_wait_s"] is not None and set(record["phases"]) == {"forward", "backward", "optimizer"}
    assert len(unstubbed["span"]) >= 7 and unstubbed["metrics"][0] == 14 and unstubbed["shapes"] == 2


@pytest.mark.parametrize("part", PARTS[1:])
def test_each_stub_takes_away_its_part_and_only_that(probes, unstubbed, part):
    got = _probe(probes, part)
    expected = json.loads(json.dumps(unstubbed))
    if part == "key":  # one key for every batch size: one FLOP count, the first batch's
        expected["shapes"] = 1
        expected["record"]["samples"], expected["metrics"][0] = 4, 12
        got["record"]["flops"] = expected["record"]["flops"] = None  # the first shape's, not this one's
        got["metrics"][1] = expected["metrics"][1] = None
    elif part == "clock":
        expected["record"]["phases"] = None
        expected["span"] = [k for k in expected["span"] if ".phase." not in k]
    elif part == "ledger":
        expected["record"]["data_wait_s"] = None
        expected["span"] = [k for k in expected["span"] if "data_wait" not in k]
    elif part == "metrics":
        expected["metrics"] = [None, None, None]
    elif part == "spans":
        expected["span"] = []
    elif part == "seam":  # no forward marks: where the backward began is not known either
        expected["record"]["phases"] = {"optimizer": 0.0}
        expected["span"] = [k for k in expected["span"] if not k.endswith(("forward_s", "backward_s"))]
    elif part == "lr":
        expected["metrics"][2] = None
        expected["span"] = [k for k in expected["span"] if k != "torchtrace.lr"]
    for side in (got, expected):  # times differ from run to run: compare which are there
        side["record"]["data_wait_s"] = side["record"]["data_wait_s"] is not None
        side["record"]["phases"] = sorted(side["record"]["phases"] or [])
    assert got == expected


def test_the_script_runs_and_prints_one_line_per_part():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "feature_costs.py"), "--quick", "--stub", "none,all"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert [row.split()[0] for row in rows] == ["none", "all"]
    assert all(row.count(" us") >= 2 for row in rows)  # the features and the A/A pair, each in us
