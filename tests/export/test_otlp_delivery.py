"""What ``flush()`` and ``shutdown()`` promise about OTLP delivery, against the real receivers:
flush says False when a collector refused the spans; shutdown waits for a slow collector that
answers within the deadline; no metrics push thread or socket outlives shutdown."""

from __future__ import annotations

import threading
import time

import grpc
import psutil
import pytest
import torch

import torchtrace as tt
from tests.fixtures import BlackHole, GrpcOtlpReceiver, HttpOtlpReceiver
from torchtrace.api import get_runtime

RECEIVERS = [("grpc", GrpcOtlpReceiver, grpc.StatusCode.INVALID_ARGUMENT), ("http/protobuf", HttpOtlpReceiver, 400)]


def _train(model, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = model(torch.ones(4, 8)).pow(2).mean()
            loss.backward()
            step.record_loss(loss)
            opt.step()
            opt.zero_grad()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol, receiver_cls, refusal", RECEIVERS)
def test_flush_is_false_when_the_collector_refuses_the_spans(protocol, receiver_cls, refusal, tmp_path, tiny_model):
    with receiver_cls() as rx:
        rx.fail_always(refusal)  # not retryable: each export fails at once
        tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False,
                     otlp_endpoint=rx.endpoint, otlp_protocol=protocol)
        _train(tiny_model, 3)
        assert tt.flush(5) is False
        assert tt.flush(5) is False  # nothing new to send, but the last export failed
        rx.clear_faults()
        _train(tiny_model, 2)
        assert tt.flush(5) is True
        tt.shutdown()
        assert len(rx.spans()) == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol, receiver_cls", [(p, cls) for p, cls, _ in RECEIVERS])
def test_shutdown_waits_for_a_slow_collector_that_answers_within_the_deadline(protocol, receiver_cls, tmp_path,
                                                                               tiny_model):
    with receiver_cls() as rx:
        rx.set_delay(0.5)  # every answer after 0.5 s: slow, but well inside the 1.0 s deadline
        tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False,
                     otlp_endpoint=rx.endpoint, otlp_protocol=protocol, shutdown_timeout_s=1.0)
        _train(tiny_model, 3)
        assert tt.flush(5) is True  # the collector has answered once: it is slow, not dead
        _train(tiny_model, 4)
        tt.flush(0)  # the last batch goes out now...
        time.sleep(0.35)  # ...and has been in flight longer than a stuck call's 0.3 s at shutdown
        proc = next(p for p in get_runtime().processors if p.exporter_kind.startswith("otlp"))
        t0 = time.monotonic()
        tt.shutdown()
        elapsed = time.monotonic() - t0
        assert proc.accounting()["exported"] == 7, proc.accounting()
        assert len(rx.spans()) == 7
    assert elapsed < 1.1, elapsed


def _sockets_to(port: int) -> list:
    return [c for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port]


@pytest.mark.timeout(60)
def test_no_metrics_push_thread_or_socket_outlives_shutdown(tmp_path, tiny_model):
    with BlackHole() as hole:
        tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False,
                     metrics_exporter="otlp", otlp_metrics_endpoint=hole.endpoint, otlp_protocol="http/protobuf",
                     metrics_export_interval_s=0.2, export_timeout_s=5.0, shutdown_timeout_s=1.0)
        _train(tiny_model, 2)
        deadline = time.monotonic() + 5
        while not _sockets_to(hole.port) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _sockets_to(hole.port), "no push reached the black hole"
        t0 = time.monotonic()
        tt.shutdown()
        elapsed = time.monotonic() - t0
        threads = [t.name for t in threading.enumerate() if t.name == "torchtrace-metrics-push"]
        assert threads == [] and _sockets_to(hole.port) == [], (threads, _sockets_to(hole.port))
    assert elapsed < 1.1, elapsed
