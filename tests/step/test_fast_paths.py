"""A random run of steps against a hand count: every record's throughput figures.

Shapes, two models, operations, evaluation steps, nested steps, record_batch, frozen
parameters, learning-rate changes and level changes, in a random order: each record's samples,
phases and FLOPs are what the test counts for that step by hand (FLOPs of the two linear
layers' matrix products, forward and backward, for the parameters that train).
"""

from __future__ import annotations

import random

import pytest
import torch

import torchtrace as tt
from torchtrace.api import get_runtime


def _flops(rows: int, train: bool, first_weight_trains: bool) -> int:
    """Linear(16, 32) -> ReLU -> Linear(32, 4), ``rows`` rows: 2 * m * n * k per matrix product."""
    forward = 2 * rows * 16 * 32 + 2 * rows * 32 * 4
    if not train:
        return forward
    second = 2 * rows * 32 * 4 * 2  # its weight's gradient and its input's (the first layer's output)
    first = 2 * rows * 16 * 32 if first_weight_trains else 0  # its weight's gradient (the input needs none)
    return forward + second + first


@pytest.mark.parametrize("seed", [0, 1])
def test_a_random_run_of_steps_records_the_figures_counted_by_hand(tmp_path, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    try:
        models = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
                  for _ in range(2)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.01 * (i + 1)) for i, m in enumerate(models)]
        steps = {}
        for i, (model, opt) in enumerate(zip(models, opts)):
            def train(x, model=model, opt=opt, given=None):
                if given is not None:
                    tt.current_step().record_batch(samples=given)
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()

            def evaluate(x, model=model):
                with torch.no_grad():
                    model(x)

            steps[f"train{i}"] = tt.debug_operation(name=f"train{i}", model=model, optimizer=opt)(train)
            steps[f"eval{i}"] = tt.debug_operation(name=f"eval{i}", model=model, kind="evaluation")(evaluate)
        rt = get_runtime()
        expected = []  # (operation, samples, flops) of each recorded step, in order

        def expect(operation: str, rows: int, samples: int | None = None) -> None:
            i = int(operation[-1])
            train = operation.startswith("train")
            trains = i == 1 or models[0][0].weight.requires_grad
            expected.append((operation, samples if samples is not None else rows, _flops(rows, train, trains)))

        toggles = 0
        for _ in range(160):
            name = rng.choice(["train0"] * 6 + ["train1"] * 2 + ["eval0", "eval1", "nested", "given", "level",
                                                                   "freeze", "rate"])
            rows = rng.choice([8, 8, 8, 4])
            x = torch.randn(rows, 16)
            if name == "nested":
                with tt.debug_context("epoch", model=models[0]):
                    steps["train0"](x)
                expect("train0", rows)
                expected.append(("epoch", None, None))
            elif name == "given":
                given = rng.choice([3, 5])
                steps["train0"](x, given=given)
                expect("train0", rows, given)
            elif name == "level":
                rt.set_level("off")
                steps["train0"](x)
                rt.set_level("basic")
            elif name == "freeze":
                if toggles < 6:  # (past 8 recounts an operation keeps its last count)
                    toggles += 1
                    models[0][0].weight.requires_grad_(not models[0][0].weight.requires_grad)
            elif name == "rate":
                opts[0].param_groups[0]["lr"] *= 0.5
            else:
                steps[name](x)
                expect(name, rows)
        rt.finish_deferred(block=True)
        records = rt.history.steps()
    finally:
        tt.shutdown()
    assert len(records) == len(expected) > 100
    with_flops = 0
    for i, (row, (operation, samples, flops)) in enumerate(zip(records, expected)):
        assert row["operation"] == operation, i
        if operation == "epoch":  # it holds a training step: no FLOPs of its own
            assert row.get("flops") is None, i
            continue
        assert row.get("samples") == samples, (i, row)
        # A step whose trained parameters changed since the count has none; the next is counted again.
        if row.get("flops") is not None:
            with_flops += 1
            assert row["flops"] == flops, (i, row)
        assert row.get("phases") and "forward" in row["phases"], (i, row)
    assert with_flops > len(expected) * 0.8
