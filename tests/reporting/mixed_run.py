"""Steps of several operations in one run: training, then an evaluation pass, then a checkpoint.

40 training steps (``train_step``, batches of 8 after a 5 ms wait), then an evaluation pass (``eval_pass``,
kind ``evaluation``) holding 3 evaluation steps (``eval_step``, batches of 256, a loss 100
times the training one), then a checkpoint (``save``, kind ``checkpoint``) slower than any
training step. The evaluation steps are numbered 0..2 after training step 39, their rate is
far above training's, and the checkpoint's time is the longest of the run: each one, drawn or
counted with the training steps, would misreport training.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import torchtrace as tt

TRAIN_STEPS = 40
EVAL_STEPS = 3
CHECKPOINT_S = 0.06


def train_for(model: torch.nn.Module, opt: torch.optim.Optimizer, g: torch.Generator, steps: int) -> None:
    for _ in range(steps):
        time.sleep(0.005)  # a data loader's wait: training's rate counts it, evaluation's batches come at once
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        with tt.debug_context("train_step", model=model, optimizer=opt, inputs=x) as scope:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            scope.record_loss(loss)
            opt.step()


def evaluate_and_save(model: torch.nn.Module, g: torch.Generator) -> None:
    with tt.debug_context("eval_pass", kind="evaluation"):
        for _ in range(EVAL_STEPS):
            x, y = torch.randn(256, 8, generator=g), torch.randn(256, 4, generator=g)
            with tt.debug_context("eval_step", model=model, kind="evaluation", inputs=x) as scope, torch.no_grad():
                scope.record_loss(100 * torch.nn.functional.mse_loss(model(x), y))
    with tt.debug_context("save", kind="checkpoint"):
        time.sleep(CHECKPOINT_S)


def run_mixed_steps() -> None:
    """The run's steps (training, the evaluation pass, the checkpoint), in the configured runtime."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    train_for(model, opt, g, TRAIN_STEPS)
    evaluate_and_save(model, g)


def make_mixed_run(tmp_path: Path) -> Path:
    """Run, shut down, and return the run directory."""
    result = tt.configure(service_name="mixed-test", prometheus_port="off", run_dir=str(tmp_path / "runs"),
                          register_atexit=False, strict=True)
    run_mixed_steps()
    tt.shutdown()
    return Path(result.run_dir)


def spans_of(run_dir: Path, operation: str) -> list[dict]:
    """The step spans of ``operation`` straight from spans.jsonl, in time order (the reference)."""
    out = []
    for line in (run_dir / "spans.jsonl").read_text().splitlines():
        span = json.loads(line)
        if span["attributes"].get("torchtrace.operation") == operation:
            out.append(span)
    return sorted(out, key=lambda s: s["start_unix_ns"])


def cycle_rate(span: dict) -> float:
    """Samples per second of the step's cycle: its time plus the data wait before it."""
    a = span["attributes"]
    seconds = (span["end_unix_ns"] - span["start_unix_ns"]) / 1e9 + (a.get("torchtrace.data_wait_s") or 0.0)
    return a["torchtrace.samples"] / seconds
