"""The examples a user runs first, run as the user runs them: a fresh process in an empty folder,
``python examples/<name>.py``. Each must finish, and what it says it shows must be in its files.
(``examples/quickstart.py`` is run in tests/test_cli.py; ``examples/ddp_train.py`` under torchrun in
tests/distributed/test_torchrun.py.)"""

from __future__ import annotations

import ast
import decimal
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "TQDM_DISABLE": "1"}


def _run(example: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / example), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _files(proc: subprocess.CompletedProcess, cwd: Path) -> tuple[list[dict], dict]:
    """The spans and the report the example names on its last line (``spans: ... report: ...``)."""
    found = re.search(r"^spans: (\S+) report: (\S+)$", proc.stdout, re.MULTILINE)
    assert found, proc.stdout[-2000:]
    spans = [json.loads(line) for line in (cwd / found.group(1)).read_text().splitlines()]
    return spans, json.loads((cwd / found.group(2)).read_text())


def _healthy_training(spans: list[dict], report: dict, steps: int, params: int) -> None:
    train = [s["attributes"] for s in spans if s["name"] == "train_step"]
    assert [a["torchtrace.step"] for a in train] == list(range(steps))
    for attrs in train:
        assert math.isfinite(attrs["torchtrace.loss"]) and math.isfinite(attrs["torchtrace.grad.norm"]), attrs
        assert attrs["torchtrace.grad.norm"] > 0 and attrs["torchtrace.grad.param_count"] == params, attrs
        assert attrs["torchtrace.grad.nonfinite_count"] == 0
    assert report["totals"]["nonfinite_steps"] == 0 and report["anomalies_by_kind"] == {}, report["totals"]
    assert report["telemetry"]["internal_errors"] == {} and not any(report["telemetry"]["spans_dropped"].values()), \
        report["telemetry"]


def test_lightning_callback_example(tmp_path):
    """Two epochs of 16 batches: a span per batch with the norm of all four of the regressor's
    gradients, and the validation batches as spans of their own."""
    proc = _run("lightning_callback.py", tmp_path)
    spans, report = _files(proc, tmp_path)
    _healthy_training(spans, report, steps=32, params=4)
    assert sum(s["name"] == "validation_step" for s in spans) == 2 * 4  # 512 samples in batches of 128


def test_transformers_callback_example(tmp_path):
    """50 optimizer steps of a small BERT: a span per step whose norm, before the callback's
    clipping, is the one the Trainer logs every 25 steps. (The Trainer's is its
    ``clip_grad_norm_`` with no limit, which inside the step reuses torchtrace's norms: this
    checks that the two numbers a user compares agree, not the norm itself, which
    tests/step/test_clipping_equality.py checks against torch's.)"""
    proc = _run("transformers_callback.py", tmp_path)
    spans, report = _files(proc, tmp_path)
    _healthy_training(spans, report, steps=50, params=41)  # BERT's 41 trainable tensors at this size
    logged = [ast.literal_eval(m) for m in re.findall(r"\{'loss': [^}]*\}", proc.stdout + proc.stderr)]
    norms = [s["attributes"]["torchtrace.grad.norm"] for s in spans if s["name"] == "train_step"]
    assert len(logged) == 2, logged
    for entry, norm in zip(logged, [norms[24], norms[49]]):
        assert _agrees_to_its_digits(str(entry["grad_norm"]), norm), (entry, norm)


def _agrees_to_its_digits(printed: str, value: float) -> bool:
    """Whether ``printed`` is ``value`` to the digits it shows: the Trainer's console log
    writes 4 significant digits (``1.134`` for 1.1337), older releases wrote more."""
    last_digit = 10.0 ** decimal.Decimal(printed).as_tuple().exponent
    return abs(float(printed) - value) <= 0.5 * last_digit * (1 + 1e-9)


def test_optimize_benchmark_example(tmp_path):
    """Every mode runs; the modes that keep float32 arithmetic (compiled with aot_eager, or
    checkpointed) train the same losses as none; bfloat16 AMP stays close to them."""
    _run("optimize_benchmark.py", tmp_path, "--backend", "aot_eager", "--width", "64", "--depth", "2",
         "--steps", "5", "--json", "out.json")
    results = json.loads((tmp_path / "out.json").read_text())["modes"]
    assert set(results) == {"none", "amp", "compilation", "memory_efficient", "full_optimization"}
    assert all(r["ok"] and r["error"] is None for r in results.values()), results
    for mode in ("compilation", "memory_efficient"):
        assert results[mode]["max_abs_loss_diff"] < 1e-5, results[mode]
    for mode in ("amp", "full_optimization"):
        assert results[mode]["max_abs_loss_diff"] < 0.05, results[mode]
