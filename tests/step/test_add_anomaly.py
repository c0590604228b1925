"""A caller's own anomaly joins the step's record: counted once, on the span, in the history."""

from __future__ import annotations

import pytest
import torch

import torchtrace as tt
from tests.helpers import read_spans
from torchtrace import semconv
from torchtrace.api import get_runtime


def test_an_added_anomaly_is_counted_spanned_and_kept(tt_runtime):
    with tt.debug_context("train_step") as step:
        step.add_anomaly(semconv.LOSS_SPIKE, "loss 9.0 over 3 sigma", {"loss": 9.0})
    rt = get_runtime()
    assert step.record.anomaly_kinds == ["loss_spike"]
    labels = {"run_id": rt.settings.run_id, "rank": "0", "operation": "train_step", "kind": "loss_spike"}
    assert rt.metrics.registry.get_sample_value("torchtrace_anomalies_total", labels) == 1
    tt.flush()
    [span] = [s for s in read_spans(tt_runtime.spans_path) if s["name"] == "train_step"]
    assert span["attributes"][semconv.ANOMALY_KINDS] == ["loss_spike"]
    events = [e for e in rt.history.events() if e.event_type == "anomaly"]
    assert len(events) == 1 and events[0].as_dict()["event_type"] == "anomaly"
    assert events[0].data["data"] == {"loss": 9.0}


def test_an_unknown_kind_is_refused_where_it_is_added(tt_runtime):
    with tt.debug_context("train_step") as step:
        with pytest.raises(ValueError, match="kind='spike' is not valid; accepted values: nonfinite_loss"):
            step.add_anomaly("spike", "?")
    assert step.record.anomalies == []


def test_a_seed_monitor_inside_a_step_puts_its_spike_on_the_step(tt_runtime):
    monitor = tt.TrainingDebugger(window=10, min_history=5)
    model = torch.nn.Linear(2, 1)
    losses = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 50.0]
    for i, value in enumerate(losses):
        with tt.debug_context("train_step", model=model) as step:
            loss = model(torch.ones(1, 2)).sum() * 1e-3 + value
            loss.backward()
            monitor.monitor_training_step(model, loss, step=i)
    assert step.record.anomaly_kinds == ["loss_spike"]
    rt = get_runtime()
    labels = {"run_id": rt.settings.run_id, "rank": "0", "kind": "loss_spike"}
    total = sum(s.value for f in rt.metrics.registry.collect() if f.name == "torchtrace_anomalies"
                for s in f.samples if s.name.endswith("_total") and s.labels.get("kind") == "loss_spike")
    assert total == 1, labels
