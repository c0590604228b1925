"""The step pipeline's short ways give what its general paths give.

``RunThroughput.start`` takes a short way for a step like the one before (same operation,
model and optimizer, no GradScaler, the marks in the model's seam); every other step takes
``_start``. A random run of steps (shapes, models, operations, evaluation steps, nested
steps, record_batch, frozen parameters, level changes) is recorded twice, with the short way
and with it shut off: every record's throughput fields are the same.
"""

from __future__ import annotations

import random

import pytest
import torch

import torchtrace as tt
from torchtrace.api import get_runtime
from torchtrace.step import throughput as throughput_module

_FIELDS = ("operation", "kind", "samples", "tokens", "flops", "flops_counted", "lr", "exception_type")


def _run(tmp_path, seed: int) -> list[dict]:
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
        for _ in range(160):
            name = rng.choice(["train0"] * 6 + ["train1"] * 2 + ["eval0", "eval1", "nested", "given", "level",
                                                                   "freeze", "rate"])
            x = torch.randn(rng.choice([8, 8, 8, 4]), 16)
            if name == "nested":
                with tt.debug_context("epoch", model=models[0]):
                    steps["train0"](x)
            elif name == "given":
                steps["train0"](x, given=rng.choice([3, 5]))
            elif name == "level":
                rt.set_level("off")
                steps["train0"](x)
                rt.set_level("basic")
            elif name == "freeze":
                models[0][0].weight.requires_grad_(not models[0][0].weight.requires_grad)
            elif name == "rate":
                opts[0].param_groups[0]["lr"] *= 0.5
            else:
                steps[name](x)
        rt.finish_deferred(block=True)
        return [{k: row.get(k) for k in _FIELDS} | {"phases": sorted(row.get("phases") or ())}
                for row in rt.history.steps()]
    finally:
        tt.shutdown()


@pytest.mark.parametrize("seed", [0, 1])
def test_the_short_way_of_a_step_like_the_one_before_gives_what_the_general_path_gives(tmp_path, monkeypatch, seed):
    general = throughput_module.RunThroughput._start
    long_ways = []

    def counted(self, scope, parent):
        long_ways.append(scope.name)
        return general(self, scope, parent)

    monkeypatch.setattr(throughput_module.RunThroughput, "_start", counted)
    fast = _run(tmp_path / "fast", seed)
    assert len(long_ways) < len(fast) - 20  # the short way was taken (else the comparison below shows nothing)

    def always_general(self, scope, parent):
        try:
            return general(self, scope, parent)
        finally:
            self._fast = throughput_module._NO_FAST  # start() never takes the short way

    monkeypatch.setattr(throughput_module.RunThroughput, "_start", always_general)
    slow = _run(tmp_path / "slow", seed)
    assert len(fast) == len(slow) > 100
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert a == b, (i, a, b)
