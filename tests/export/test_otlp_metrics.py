"""OTLP metrics push reaches a real receiver with the Prometheus instruments' names and values."""

from __future__ import annotations

import time

import pytest
import torch

import torchtrace as tt
from tests.fixtures import BlackHole, GrpcOtlpReceiver, HttpOtlpReceiver
from tests.fixtures.otlp_decode import decode_metrics
from torchtrace.api import get_runtime
from torchtrace.export.otlp_metrics import OtlpMetricsPusher, registry_to_request


def _train(model, steps: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = model(torch.ones(4, 8)).pow(2).mean()
            loss.backward()
            step.record_loss(loss)
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach().to(torch.float64)))
    return losses


@pytest.mark.parametrize("receiver_cls,protocol", [(GrpcOtlpReceiver, "grpc"), (HttpOtlpReceiver, "http/protobuf")])
def test_metrics_reach_a_real_receiver(tmp_path, tiny_model, receiver_cls, protocol):
    with receiver_cls() as rx:
        tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False,
                     metrics_exporter="otlp", otlp_metrics_endpoint=rx.endpoint, otlp_protocol=protocol,
                     metrics_export_interval_s=60)
        rt = get_runtime()
        assert rt.server is None  # otlp only: no scrape target
        losses = _train(tiny_model, 5)
        rt.finish_deferred(block=True)
        tt.shutdown()  # the final push happens within the shutdown deadline
        metrics = {m.name: m for m in rx.metrics()}
    steps = metrics["torchtrace_steps"]
    assert steps.kind == "sum" and steps.is_monotonic and steps.temporality.endswith("CUMULATIVE")
    [point] = steps.points
    assert point.value == 5.0
    assert point.attributes == {"run_id": rt.settings.run_id, "rank": "0", "operation": "train_step"}
    assert metrics["torchtrace_loss"].kind == "gauge"
    assert metrics["torchtrace_loss"].points[0].value == pytest.approx(losses[-1], rel=1e-6)
    hist = metrics["torchtrace_step_duration_seconds"]
    assert hist.kind == "histogram" and hist.unit == "s"
    [hp] = hist.points
    assert hp.count == 5 and sum(hp.bucket_counts) == 5
    assert len(hp.bucket_counts) == len(hp.explicit_bounds) + 1
    assert metrics["torchtrace_memory_bytes"].unit == "By"
    assert {p.attributes["reason"] for p in metrics["torchtrace_spans_dropped"].points} == {
        "queue_full", "export_failed", "shutdown"}
    assert steps.resource["torchtrace.run_id"] == rt.settings.run_id


def test_conversion_matches_the_registry_exactly():
    from prometheus_client import CollectorRegistry, Counter, Histogram

    reg = CollectorRegistry()
    c = Counter("x_events", "h", ["a"], registry=reg)
    c.labels("p").inc(3)
    h = Histogram("x_seconds", "h", ["a"], buckets=(0.1, 1.0), registry=reg)
    for v in (0.05, 0.5, 0.7, 5.0):
        h.labels("p").observe(v)
    [m_c, m_h] = decode_metrics(registry_to_request(reg, {"service.name": "s"}, 1, 2))
    assert (m_c.name, m_c.points[0].value, m_c.points[0].attributes) == ("x_events", 3.0, {"a": "p"})
    hp = m_h.points[0]
    assert (hp.bucket_counts, hp.explicit_bounds, hp.count, hp.sum) == ((1, 2, 1), (0.1, 1.0), 4, pytest.approx(6.25))


def test_push_to_a_black_hole_respects_its_deadline():
    from prometheus_client import CollectorRegistry

    with BlackHole() as hole:
        pusher = OtlpMetricsPusher(CollectorRegistry(), hole.endpoint, "http/protobuf", {}, interval_s=60,
                                   timeout_s=5.0)
        pusher.start()
        t0 = time.monotonic()
        pusher.shutdown(0.5)
        elapsed = time.monotonic() - t0
    assert pusher.failures == 1 and pusher.pushes == 0
    assert elapsed < 2.0, elapsed  # a 5 s export timeout is cut to the shutdown deadline
