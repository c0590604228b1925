"""Spans reach a real OTLP receiver (gRPC and HTTP/protobuf) with the resource from OTEL_* variables."""

from __future__ import annotations

import pytest
import torch

import torchtrace as tt
from tests.fixtures import GrpcOtlpReceiver, HttpOtlpReceiver
from torchtrace import semconv


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol, receiver_cls", [("grpc", GrpcOtlpReceiver), ("http/protobuf", HttpOtlpReceiver)])
def test_spans_arrive_over_both_protocols_with_resource_from_environment(protocol, receiver_cls, tmp_path,
                                                                         monkeypatch, tiny_model):
    with receiver_cls() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "trainer-svc")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging,team=ml")
        result = tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False)
        assert result.settings.otlp_protocol == protocol
        opt = torch.optim.SGD(tiny_model.parameters(), lr=0.01)
        for i in range(3):
            with tt.debug_context("train_step", model=tiny_model, optimizer=opt) as step:
                loss = tiny_model(torch.randn(4, 8)).pow(2).mean()
                if i == 1:
                    loss = loss * float("nan")
                opt.zero_grad()
                loss.backward()
                step.record_loss(loss)
                opt.step()
        assert tt.flush(10)
        spans = receiver.wait_for_spans(3, timeout=10)
        tt.shutdown()
    assert [s.name for s in spans] == ["train_step"] * 3
    res = spans[0].resource
    assert res["service.name"] == "trainer-svc"
    assert res["deployment.environment"] == "staging" and res["team"] == "ml"
    assert res[semconv.RESOURCE_RUN_ID] == result.run_id
    assert res[semconv.RESOURCE_WORLD_SIZE] == 1
    assert [s.attributes[semconv.STEP] for s in spans] == [0, 1, 2]
    bad = spans[1]
    assert any(e.name == semconv.EVENT_ANOMALY for e in bad.events)
    assert bad.status_code == "STATUS_CODE_ERROR"
    assert spans[0].status_code == "STATUS_CODE_UNSET" and not spans[0].events


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collector", ["up", "down"])
@pytest.mark.parametrize("protocol, receiver_cls", [("grpc", GrpcOtlpReceiver), ("http/protobuf", HttpOtlpReceiver)])
def test_exporting_to_a_collector_leaves_pythons_global_random_alone(protocol, receiver_cls, collector, tmp_path,
                                                                    tiny_model):
    """The SDK's exporters draw their retry backoff's jitter from the global ``random`` (the
    HTTP one before every attempt, the gRPC one before every retry): with torchtrace they draw
    from a generator of its own, so a script's ``random`` sequence (its data order) is the same
    with export on as without torchtrace; at shutdown the SDK's modules have the module back."""
    import random
    import sys

    random.seed(0)
    expected = [random.random() for _ in range(3)]
    with receiver_cls() as receiver:
        endpoint = receiver.endpoint if collector == "up" else f"http://127.0.0.1:{_closed_port()}"
        tt.configure(prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False,
                     otlp_endpoint=endpoint, otlp_protocol=protocol, export_timeout_s=2.0)
        random.seed(0)
        try:
            opt = torch.optim.SGD(tiny_model.parameters(), lr=0.01)
            for _ in range(3):
                with tt.debug_context("train_step", model=tiny_model, optimizer=opt) as step:
                    loss = tiny_model(torch.randn(4, 8)).pow(2).mean()
                    opt.zero_grad()
                    loss.backward()
                    step.record_loss(loss)
                    opt.step()
                tt.flush(3)
            if collector == "up":
                assert len(receiver.wait_for_spans(3, timeout=10)) == 3
        finally:
            tt.shutdown()
    assert [random.random() for _ in range(3)] == expected
    sdk = [sys.modules.get(name) for name in ("opentelemetry.exporter.otlp.common.http",
                                              "opentelemetry.exporter.otlp.proto.grpc.exporter")]
    assert all(module.random is random for module in sdk if module is not None and hasattr(module, "random"))
