"""A step its data runs out in: ``next(batches)`` inside the step raises ``StopIteration`` at an
epoch's end, and the loop around the step catches it.

The exception is the loop's signal, not a failure of training. A step that had done nothing
yet when its data ran out is no step: it leaves no span and no record, and its number is the
next step's. A step that trained and then ran out (it fetches the next batch at its end) is a
step like any other. Either way the ``StopIteration`` reaches the loop unchanged.
"""

from __future__ import annotations

import pytest
import torch

import torchtrace as tt
from tests.helpers import read_spans, scrape
from torchtrace import semconv
from torchtrace.api import get_runtime
from torchtrace.export.debug_summary import history_training_summary


def batches(n):
    torch.manual_seed(0)
    return iter([torch.randn(4, 8) for _ in range(n)])


def epoch_fetching_first(model, opt, n):
    """The usual loop without ``for``: fetch inside the step; the empty last step ends the epoch."""
    it = batches(n)
    while True:
        try:
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                x = next(it)
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                step.record_loss(loss)
                opt.step()
        except StopIteration:
            return


def test_the_empty_step_that_ends_an_epoch_leaves_no_span_and_no_failure(tt_runtime, tiny_model):
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.01)
    epoch_fetching_first(tiny_model, opt, 3)
    epoch_fetching_first(tiny_model, opt, 2)
    spans = read_spans(tt_runtime.spans_path)
    assert [s["attributes"][semconv.STEP] for s in spans] == [0, 1, 2, 3, 4]  # numbered on, no gaps
    assert [s["status"] for s in spans] == ["UNSET"] * 5
    assert all(semconv.LOSS in s["attributes"] for s in spans)
    totals = get_runtime().history.totals
    assert (totals["steps"], totals["failed_steps"]) == (5, 0)
    summary = history_training_summary(get_runtime())
    assert (summary["total_steps"], summary["failed_steps"]) == (5, 0)
    scraped = scrape(tt_runtime.metrics_url)
    counted = [value for key, value in scraped.items()
               if isinstance(key, tuple) and key[0] == semconv.M_STEPS and ("operation", "train_step") in key[1]]
    assert counted == [5]


def test_a_step_that_fetches_its_next_batch_at_its_end_is_recorded_when_the_data_runs_out(tt_runtime, tiny_model):
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.01)
    it = batches(3)
    x = next(it)
    steps = 0
    with pytest.raises(StopIteration):
        while True:
            with tt.debug_context("train_step", model=tiny_model, optimizer=opt) as step:
                opt.zero_grad()
                loss = tiny_model(x).pow(2).mean()
                loss.backward()
                step.record_loss(loss)
                opt.step()
                steps += 1
                x = next(it)  # the last step trained, then found no next batch
    spans = read_spans(tt_runtime.spans_path)
    assert steps == 3
    assert [s["attributes"][semconv.STEP] for s in spans] == [0, 1, 2]
    assert [s["status"] for s in spans] == ["UNSET"] * 3
    last = spans[-1]
    assert semconv.LOSS in last["attributes"] and semconv.GRAD_NORM in last["attributes"]
    assert not [e for e in last["events"] if e["name"] == "exception"]
    totals = get_runtime().history.totals
    assert (totals["steps"], totals["failed_steps"]) == (3, 0)


def test_a_decorated_step_that_runs_out_of_data_hands_the_stop_on_unchanged(tt_runtime, tiny_model):
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.01)
    it = batches(2)

    @tt.debug_operation(model=tiny_model, optimizer=opt)
    def train_step():
        x = next(it)
        opt.zero_grad()
        loss = tiny_model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    losses = []
    stop = None
    while stop is None:
        try:
            losses.append(train_step())
        except StopIteration as caught:
            stop = caught
    assert len(losses) == 2 and type(stop) is StopIteration
    train_step_after = batches(1)
    it = train_step_after
    train_step()  # the next epoch's first step takes the number the empty one gave back
    spans = read_spans(tt_runtime.spans_path)
    assert [s["attributes"][semconv.STEP] for s in spans] == [0, 1, 2]
    assert [s["status"] for s in spans] == ["UNSET"] * 3
    assert get_runtime().history.totals["failed_steps"] == 0


def test_another_exception_still_fails_the_step(tt_runtime, tiny_model):
    with pytest.raises(LookupError):
        with tt.debug_context("train_step", model=tiny_model):
            raise LookupError("not a data end")
    (span,) = read_spans(tt_runtime.spans_path)
    assert span["status"] == "ERROR"
    assert get_runtime().history.totals["failed_steps"] == 1


def test_an_epoch_its_steps_ran_in_is_recorded_when_the_data_runs_out_of_it(tt_runtime, tiny_model):
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.01)
    it = batches(2)
    with pytest.raises(StopIteration):
        with tt.debug_context("epoch"):
            while True:
                with tt.debug_context("train_step", model=tiny_model, optimizer=opt):
                    x = next(it)
                    opt.zero_grad()
                    tiny_model(x).pow(2).mean().backward()
                    opt.step()
    spans = read_spans(tt_runtime.spans_path)
    assert sorted((s["name"], s["attributes"][semconv.STEP]) for s in spans) == [
        ("epoch", 0), ("train_step", 0), ("train_step", 1)]
    assert [s["status"] for s in spans] == ["UNSET"] * 3
    assert get_runtime().history.totals["failed_steps"] == 0


def test_a_bare_step_that_finds_no_data_is_no_step(tt_runtime):
    it = iter(())
    with pytest.raises(StopIteration):
        with tt.debug_context("load"):
            next(it)
    with tt.debug_context("load") as step:
        step.record_loss(1.5)
    spans = read_spans(tt_runtime.spans_path)
    assert [(s["attributes"][semconv.STEP], s["attributes"][semconv.LOSS]) for s in spans] == [(0, 1.5)]
