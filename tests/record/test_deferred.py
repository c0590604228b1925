"""Deferred finishing: a step whose device values have not reached the host yet is finished
later, without waiting, and loses nothing.

On a GPU, readout.start() begins a non-blocking copy and the step's record is finished when
the copy has landed (at a later step boundary), or at flush/shutdown by waiting for it. Here the
copy is simulated on CPU by a Pending that reports "not landed" until the test lands it, so the
GPU's bookkeeping runs on a machine without one.
"""

from __future__ import annotations

import math

import pytest
import torch

import torchtrace as tt
from tests.helpers import read_spans
from torchtrace import api
from torchtrace.record import readout


class InFlight:
    """A readout.Pending whose copy lands only when the test says so."""

    def __init__(self, real: readout.Pending) -> None:
        self.real = real
        self.landed = False
        self.early_results = 0  # result() asked for before the copy landed: a wait on a GPU

    def ready(self) -> bool:
        return self.landed

    def result(self) -> list[float]:
        if not self.landed:
            self.early_results += 1
        return self.real.result()


@pytest.fixture()
def in_flight(monkeypatch, tmp_path):
    tt.configure(service_name="deferred", prometheus_port="off", run_dir=str(tmp_path), strict=True,
                 register_atexit=False, forensics=False, run_id="r")
    started: list[InFlight] = []
    real_start = readout.start

    def start(values):
        pending = InFlight(real_start(values))
        started.append(pending)
        return pending

    monkeypatch.setattr(readout, "start", start)
    yield started
    tt.shutdown()


def _model_and_step(poison_at: int | None = None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(12, 6), torch.randn(12, 1)

    def step(i: int) -> tuple[float, float]:
        """One instrumented step; returns its loss and global gradient norm in float64."""
        poisoned = i == poison_at
        with tt.debug_context("train_step", model=model, optimizer=opt) as scope:
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if poisoned:
                loss = loss * float("nan")
            loss.backward()
            scope.record_loss(loss)
            ref = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
            before = [p.detach().clone() for p in model.parameters()] if poisoned else []
            opt.step()
            with torch.no_grad():  # the user drops a poisoned update
                for p, b in zip(model.parameters(), before):
                    p.copy_(b)
        return float(loss.detach().double()), ref

    return step


def test_a_step_in_flight_is_finished_at_a_later_boundary_without_waiting(in_flight):
    rt = api.get_runtime()
    step = _model_and_step()
    expected = {0: step(0)}
    assert len(in_flight) == 1
    # Nothing has landed: the record is held, its span still open, and nobody waited.
    assert rt.history.totals.get("steps", 0) == 0 and rt.history.last_record is None
    expected[1] = step(1)  # step 0's copy is still in flight at step 1's boundary
    assert rt.history.totals.get("steps", 0) == 0
    in_flight[0].landed = True
    expected[2] = step(2)  # step 0 lands: finished at step 2's boundary; step 1 is next in line
    assert [r["step"] for r in rt.history.steps()] == [0]
    assert all(p.early_results == 0 for p in in_flight), "a step waited for a copy in flight"

    in_flight[1].landed = True
    in_flight[2].landed = True
    expected[3] = step(3)
    assert [r["step"] for r in rt.history.steps()] == [0, 1, 2]
    assert all(p.early_results == 0 for p in in_flight)

    # Step 3's copy never landed by itself: flush waits for it, and nothing is lost.
    spans = {s["attributes"]["torchtrace.step"]: s for s in read_spans(rt.spans_path)}
    assert sorted(spans) == [0, 1, 2, 3]
    assert [p.early_results for p in in_flight] == [0, 0, 0, 1]  # the one wait, at flush
    for n, (loss, norm) in expected.items():
        attrs = spans[n]["attributes"]
        assert attrs["torchtrace.loss"] == pytest.approx(loss, rel=1e-6)
        assert attrs["torchtrace.grad.norm"] == pytest.approx(norm, rel=1e-5)
    # A late finish keeps the step's own times: each step ended before the next began.
    for n in range(3):
        assert spans[n]["end_unix_ns"] <= spans[n + 1]["start_unix_ns"]


def test_a_non_finite_step_finished_late_is_still_flagged(in_flight):
    rt = api.get_runtime()
    step = _model_and_step(poison_at=1)
    for i in range(4):
        step(i)
        for pending in in_flight:  # each copy lands during the next step
            pending.landed = pending is not in_flight[-1]
    # Step 2 landed after step 3 began, so it waits for the next boundary (or the flush).
    assert [r["step"] for r in rt.history.steps()] == [0, 1]
    assert all(p.early_results == 0 for p in in_flight)
    rt.flush()
    recent = {r["step"]: r for r in rt.history.steps()}
    assert sorted(recent) == [0, 1, 2, 3]
    assert rt.history.totals["nonfinite_steps"] == 1
    assert {"nonfinite_loss", "nonfinite_grad"} <= set(recent[1]["anomalies"])
    assert recent[0]["anomalies"] == [] and recent[2]["anomalies"] == []
    assert recent[1]["grad_nonfinite_params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    spans = {s["attributes"]["torchtrace.step"]: s for s in read_spans(rt.spans_path)}
    assert spans[1]["status"] == "ERROR" and spans[0]["status"] == "UNSET" and spans[2]["status"] == "UNSET"


@pytest.mark.parametrize("guard", ["warn", "skip"])
def test_max_consecutive_bad_steps_stops_a_run_whose_records_finish_late(monkeypatch, tmp_path, guard):
    """``max_consecutive_bad_steps`` stops any run, whatever the guard. On a GPU the record that
    reaches the limit is finished during a later step, after its own step ended: the error is
    raised at the end of the step that finished it. Before, it was set on the late record's
    own step, which had ended, and never raised: a diverged GPU run went on."""
    tt.configure(service_name="deferred", prometheus_port="off", run_dir=str(tmp_path), strict=True,
                 register_atexit=False, forensics=False, guard=guard, max_consecutive_bad_steps=2)
    started: list[InFlight] = []
    real_start = readout.start
    monkeypatch.setattr(readout, "start", lambda values: started.append(InFlight(real_start(values))) or started[-1])
    try:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        raised = []
        for i in range(6):
            try:
                with tt.debug_context("train_step", model=model, optimizer=opt) as scope:
                    opt.zero_grad()
                    loss = model(torch.randn(3, 4)).sum() * float("nan")
                    loss.backward()
                    scope.record_loss(loss)
                    opt.step()
            except tt.NonFiniteError as err:
                raised.append((i, err.step))
            for pending in started:  # each copy lands during the next step
                pending.landed = pending is not started[-1]
        # Step 1 (the second bad step in a row) lands during step 2 and is finished at step 3's end.
        assert raised[0] == (3, 1)
        if guard == "warn":  # (skip reads the gradients before the update: its documented wait)
            assert all(p.early_results == 0 for p in started)
    finally:
        tt.shutdown()
