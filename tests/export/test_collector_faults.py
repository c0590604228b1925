"""Collector faults never reach training: dead port, black hole, UNAVAILABLE, restarts, TLS.

Real gRPC/HTTP receivers and sockets on loopback (tests/fixtures).
"""

from __future__ import annotations

import statistics
import time

import grpc
import psutil
import pytest
import torch

import torchtrace as tt
from tests.fixtures import BlackHole, GrpcOtlpReceiver, HttpOtlpReceiver, dead_port, make_tls_certs, openssl_available
from torchtrace.api import get_runtime


def _configure(tmp_path, endpoint: str, protocol: str = "grpc", **extra):
    settings = dict(prometheus_port="off", write_files=False, run_dir=str(tmp_path), strict=True,
                    register_atexit=False, otlp_endpoint=endpoint, otlp_protocol=protocol, export_timeout_s=0.5)
    settings.update(extra)
    tt.configure(**settings)
    rt = get_runtime()
    [proc] = rt.processors
    return rt, proc


def test_100k_spans_to_a_dead_port_keep_memory_bounded_and_every_span_counted(tmp_path):
    rt, proc = _configure(tmp_path, f"http://127.0.0.1:{dead_port()}", span_queue_size=2048)
    rss0 = psutil.Process().memory_info().rss
    emitted = 100_000
    longest = 0
    for i in range(emitted):
        rt.tracer.start_span("s", attributes={"i": i}).end()
        if i % 1000 == 0:
            longest = max(longest, len(proc._queue))
    growth = psutil.Process().memory_info().rss - rss0
    tt.shutdown()
    if proc._worker is not None:
        proc._worker.join(5.0)  # the abandoned in-flight batch is counted when it fails
    assert longest <= 2048
    assert growth < 64 * 2**20, growth  # 100k unbounded spans would hold several hundred MB
    received = 0
    assert proc.exported == received
    assert sum(proc.dropped.values()) + received == emitted
    assert proc.dropped["queue_full"] > 0
    dropped_metric = sum(s.value for f in rt.metrics.registry.collect() if f.name == "torchtrace_spans_dropped"
                         for s in f.samples if s.name.endswith("_total"))
    assert dropped_metric == emitted
    assert sum(rt.summary()["telemetry"]["spans_dropped"].values()) == emitted


def test_dropped_plus_received_equals_emitted_with_a_live_receiver(tmp_path):
    with GrpcOtlpReceiver() as rx:
        rt, proc = _configure(tmp_path, rx.endpoint, span_queue_size=256, export_timeout_s=5.0)
        emitted = 20_000
        for i in range(emitted):
            rt.tracer.start_span("s").end()
        tt.shutdown(timeout_s=20.0)
        received = len(rx.spans())
    assert received == proc.exported
    assert proc.dropped["queue_full"] + proc.dropped["export_failed"] + proc.dropped["shutdown"] + received == emitted


def test_export_resumes_when_the_receiver_restarts_on_the_same_port(tmp_path):
    with GrpcOtlpReceiver() as rx:
        rt, proc = _configure(tmp_path, rx.endpoint, export_timeout_s=1.0)
        for i in range(3):
            with tt.debug_context("before"):
                pass
        rx.wait_for_spans(3, timeout=10)
        rx.stop()
        for i in range(3):
            with tt.debug_context("during"):
                pass
        tt.flush(timeout_s=3.0)
        rx.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(s.name == "after" for s in rx.spans()):
            with tt.debug_context("after"):
                pass
            time.sleep(0.2)
        names = [s.name for s in rx.spans()]
        tt.shutdown()
    assert names.count("before") == 3
    assert "after" in names
    assert proc.dropped["export_failed"] >= 1 or "during" in names


def _step_times(model, steps: int = 150) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.ones(16, 8)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = model(x).pow(2).mean()
            loss.backward()
            step.record_loss(loss)
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times[20:]


def test_step_time_does_not_depend_on_the_collector(tmp_path, tiny_model):
    """Medians per collector state; a blocking exporter would add 0.5-1 s per batch."""
    results = {}
    with GrpcOtlpReceiver() as healthy, GrpcOtlpReceiver() as unavailable, BlackHole() as hole:
        unavailable.fail_always(grpc.StatusCode.UNAVAILABLE, retry_after=0.2)
        states = {"healthy": healthy.endpoint, "dead_port": f"http://127.0.0.1:{dead_port()}",
                  "black_hole": hole.endpoint, "unavailable": unavailable.endpoint}
        for name, endpoint in states.items():
            _configure(tmp_path, endpoint, export_timeout_s=2.0, span_queue_size=64)
            get_runtime().processors[0].max_batch = 8  # export often, so faults are hit often
            results[name] = _step_times(tiny_model)
            tt.shutdown()
    base = statistics.median(results["healthy"])
    report = {k: round(statistics.median(v) / base, 2) for k, v in results.items()}
    print("median step time relative to a healthy collector:", report)
    for name, times in results.items():
        # Generous: the machine is shared; a stall would be hundreds of times the median.
        assert statistics.median(times) < 3 * base + 0.002, (name, report)
        assert max(times) < 0.4, (name, max(times))


@pytest.mark.skipif(not openssl_available(), reason="needs openssl to make certificates")
@pytest.mark.parametrize("receiver_cls,protocol", [(GrpcOtlpReceiver, "grpc"), (HttpOtlpReceiver, "http/protobuf")])
def test_tls_receiver_fails_without_the_ca_and_succeeds_with_it(tmp_path, receiver_cls, protocol):
    certs = make_tls_certs(tmp_path / "certs")
    with receiver_cls(server_cert_pem=certs.cert_pem, server_key_pem=certs.key_pem) as rx:
        assert rx.endpoint.startswith("https://")
        rt, proc = _configure(tmp_path, rx.endpoint, protocol, metrics_exporter="otlp",
                              metrics_export_interval_s=60)
        with tt.debug_context("untrusted"):
            pass
        tt.shutdown(timeout_s=5.0)
        assert rx.spans() == [] and rx.metrics() == []
        assert proc.dropped["export_failed"] == 1 and proc.exported == 0
        assert rt.metrics.spans_dropped.labels(rt.settings.run_id, "0", "export_failed")._value.get() == 1
        assert rt.metrics_pusher.failures == 1 and rt.metrics_pusher.pushes == 0

        rt, proc = _configure(tmp_path, rx.endpoint, protocol, otlp_certificate=str(certs.ca_path),
                              metrics_exporter="otlp", metrics_export_interval_s=60)
        with tt.debug_context("trusted"):
            pass
        tt.shutdown(timeout_s=5.0)
        assert [s.name for s in rx.spans()] == ["trusted"]
        assert proc.exported == 1
        assert rt.metrics_pusher.pushes == 1 and rt.metrics_pusher.failures == 0
        assert any(m.name == "torchtrace_steps" for m in rx.metrics())
