"""A step runs only the code its features need: the probes a BASIC step has no feature for are
not called at all, and the gradient check's optimizer hook is kept across steps, not registered
and removed on each (issue 52: step entry; issue 46: the files one step enters)."""

from __future__ import annotations

import math
import os
import sys

import torch

import torchtrace as tt
from tests.benchmarks import load

step_path = load("step_path")
PROBES = os.path.join(step_path.PACKAGE_DIR, "probes")
IDLE_AT_BASIC = {os.path.join(PROBES, f"{name}.py") for name in ("activations", "leaks", "memory", "profiler")}


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, name: str = "train") -> None:
    with tt.debug_context(name, model=model, optimizer=optimizer) as scope:
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        scope.record_loss(loss)
        optimizer.step()


def test_a_basic_step_calls_no_code_of_the_probes_it_has_no_feature_for(tt_runtime):
    for counted in (step_path.count_operation(warm=5, steps=3, everything=False),
                    step_path.count_context(warm=5, steps=3, everything=False)):
        entered = counted.files()
        assert os.path.join(PROBES, "forensics.py") in entered  # (the counter sees the probes it runs)
        assert not entered & IDLE_AT_BASIC, sorted(entered & IDLE_AT_BASIC)


def test_memory_tracking_and_a_level_change_bring_their_probes_back(tt_runtime):
    model, optimizer = _model_and_optimizer()
    x = torch.randn(4, 8)
    _step(model, optimizer, x, name="outside")  # before the block: the probe list without the memory probe
    with tt.memory_tracking() as trk:  # the memory probe samples every step inside the block
        for _ in range(3):
            _step(model, optimizer, x, name="tracked")
    samples = [(s["operation"], s["step"]) for s in trk.samples if s["operation"] in ("outside", "tracked")]
    assert samples[-3:] == [("tracked", 0), ("tracked", 1), ("tracked", 2)]
    _step(model, optimizer, x, name="outside")  # after the block: no sample
    assert [s["operation"] for s in trk.samples][-1] == "tracked"
    tt.api.get_runtime().set_level("advanced")  # the leak detector's level: its probe is asked again
    counter = step_path.PathCounter(everything=False)
    sys.setprofile(counter)
    try:
        _step(model, optimizer, x)
    finally:
        sys.setprofile(None)
    assert os.path.join(PROBES, "leaks.py") in counter.files()


def test_the_optimizer_keeps_one_hook_of_torchtraces_across_steps_and_none_after_shutdown(tt_runtime):
    model, optimizer = _model_and_optimizer()
    x = torch.randn(4, 8)
    users = tuple(optimizer._optimizer_step_pre_hooks)  # torch's ordered dict of pre-hooks, by handle id
    inside = []
    for _ in range(4):
        with tt.debug_context("train", model=model, optimizer=optimizer):
            inside.append(tuple(optimizer._optimizer_step_pre_hooks))
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
        assert tuple(optimizer._optimizer_step_pre_hooks) == inside[0]  # none registered for one step only
    assert len(set(inside)) == 1 and len(inside[0]) > len(users)
    tt.shutdown()
    assert tuple(optimizer._optimizer_step_pre_hooks) == users


def test_a_step_inside_another_on_the_same_optimizer_is_measured_by_both(tt_runtime):
    model, optimizer = _model_and_optimizer()
    x = torch.randn(4, 8)
    with tt.debug_context("outer", model=model, optimizer=optimizer) as outer:
        with tt.debug_context("inner", model=model, optimizer=optimizer) as inner:
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            expected = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
            optimizer.step()
    tt.flush()
    for scope in (outer, inner):
        assert scope.record is not None and scope.record.grad_norm is not None
        assert math.isclose(scope.record.grad_norm, expected, rel_tol=1e-5)


def test_an_operation_pinned_at_its_own_level_keeps_its_probe_lists(tt_runtime):
    """Steps of the runtime's level and of an operation pinned at another alternate: each set of
    features gets its probe lists once, not on every change between them."""
    from torchtrace.probes.base import Probe

    class Asked(Probe):
        name = "asked"

        def __init__(self) -> None:
            self.asked = 0
            self.finished = 0

        def wanted(self, features) -> bool:
            self.asked += 1
            return True

        def finish(self, scope, state, record, values) -> None:
            self.finished += 1

    probe = tt.api.get_runtime().probes.add(Asked())
    model, optimizer = _model_and_optimizer()
    x = torch.randn(4, 8)
    pinned = tt.debug_operation(name="pinned", model=model, optimizer=optimizer, level="advanced")(_step)
    for _ in range(2):  # warm: each set of features is asked for once
        _step(model, optimizer, x)
        pinned(model, optimizer, x, name="pinned-inner")
    asked = probe.asked
    for _ in range(5):
        _step(model, optimizer, x)
        pinned(model, optimizer, x, name="pinned-inner")
    tt.flush()
    assert probe.asked == asked <= 3  # the runtime's features, the pinned operation's (and its inner step's)
    assert probe.finished == 3 * 7  # every step ran it: the plain ones, the pinned ones and the steps inside them
