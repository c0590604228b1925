"""Exact span accounting: emitted = exported + dropped (by reason) + queued + in flight, for
the gRPC and the HTTP exporter, against a dead, a black-holed and a slow collector, at any
moment and after shutdown. Real receivers and sockets on loopback (tests/fixtures)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

import torchtrace as tt
from tests.fixtures import BlackHole, GrpcOtlpReceiver, HttpOtlpReceiver, dead_port
from torchtrace.api import get_runtime

PROTOCOLS = ["grpc", "http/protobuf"]
SPANS = 50
EXPORT_TIMEOUT_S = 2.0


def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)


@contextlib.contextmanager
def _collector(state: str, protocol: str):
    """(endpoint, receiver or None) for a collector in ``state``."""
    if state == "dead":
        yield f"http://127.0.0.1:{dead_port()}", None
    elif state == "black_hole":
        with BlackHole() as hole:
            yield hole.endpoint, None
    else:
        receiver_cls = GrpcOtlpReceiver if protocol == "grpc" else HttpOtlpReceiver
        with receiver_cls() as rx:
            rx.set_delay({"slow": 30.0, "slowish": 0.3, "healthy": 0.0}[state])
            yield rx.endpoint, rx


def _balance(snapshot: dict) -> int:
    """emitted minus everything accounted for; 0 when the books balance."""
    return snapshot["emitted"] - (snapshot["exported"] + sum(snapshot["dropped"].values()) + snapshot["queued"]
                                  + snapshot["in_flight"])


def _emit(rt, n: int, pause_every: int = 10) -> None:
    for i in range(n):
        rt.tracer.start_span("s", attributes={"i": i}).end()
        if i % pause_every == pause_every - 1:
            time.sleep(0.02)  # let the worker take batches of several sizes


def _wait_for_worker(proc, timeout_s: float) -> None:
    """Wait until ``proc``'s export thread has ended (every call it made has returned), at
    most ``timeout_s``."""
    worker = proc._worker
    if worker is not None:
        worker.join(timeout_s)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("state", ["dead", "black_hole", "slow", "slowish", "healthy"])
def test_every_span_is_accounted_for_at_any_moment_and_after_shutdown(tmp_path, monkeypatch, protocol, state):
    _clean_env(monkeypatch)
    with _collector(state, protocol) as (endpoint, rx):
        result = tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True,
                              otlp_endpoint=endpoint, otlp_protocol=protocol, export_timeout_s=EXPORT_TIMEOUT_S,
                              shutdown_timeout_s=1.0 if state != "slowish" else 8.0)
        rt = get_runtime()
        file_proc, otlp_proc = rt.processors
        otlp_proc.schedule_delay_s = 0.05
        # Snapshots taken from another thread while spans are emitted and exported.
        imbalances: list[tuple[dict, int]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                for proc in (file_proc, otlp_proc):
                    snap = proc.accounting()
                    if _balance(snap):
                        imbalances.append((snap, _balance(snap)))
                time.sleep(0.001)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            _emit(rt, SPANS)
            time.sleep(0.3)
            mid = otlp_proc.accounting()
            t0 = time.monotonic()
            tt.shutdown()
            shutdown_s = time.monotonic() - t0
        finally:
            stop.set()
            watcher.join()
        after = otlp_proc.accounting()
        received = len(rx.spans()) if rx is not None else 0
        # Nothing changes later, when an abandoned export call finally returns: it returns on
        # the export thread, within the export timeout (the file processor's thread is idle).
        # Once that thread has ended nothing can change, so wait for it rather than the
        # timeout and a second every time.
        _wait_for_worker(otlp_proc, EXPORT_TIMEOUT_S + 1.0)
        later = otlp_proc.accounting()
        received_later = len(rx.spans()) if rx is not None else 0
    report = __import__("json").loads(result.report_path.read_text())
    print(f"\n{protocol} {state}: mid-run {mid}; after shutdown ({shutdown_s:.2f} s) {after}; received {received}")
    assert imbalances == []
    assert after["emitted"] == SPANS == file_proc.accounting()["emitted"]
    assert after["queued"] == 0 and after["in_flight"] == 0, after
    assert after["exported"] + sum(after["dropped"].values()) == SPANS, after
    assert later == after
    # What the collector acknowledged is what was counted exported.
    assert after["exported"] == received == received_later
    if state in ("dead", "black_hole", "slow"):
        assert after["exported"] == 0
        assert shutdown_s < 2.0
    else:
        assert after["exported"] == SPANS and after["dropped"] == {}
    # The report (written at the end of shutdown) and the metric carry the same numbers.
    exported = sum(p.accounting()["exported"] for p in rt.processors)
    dropped = sum(sum(p.accounting()["dropped"].values()) for p in rt.processors)
    assert report["telemetry"]["spans_exported"] == exported
    assert sum(report["telemetry"]["spans_dropped"].values()) == dropped
    metric = sum(s.value for f in rt.metrics.registry.collect() if f.name == "torchtrace_spans_dropped"
                 for s in f.samples if s.name.endswith("_total"))
    assert metric == dropped


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shutdown_ends_an_export_hanging_on_a_black_hole(tmp_path, monkeypatch, protocol):
    """The HTTP exporter's own shutdown closes only idle connections: a request waiting on a
    black hole went on until its timeout, after the report had been written, and its spans
    were counted nowhere (``in flight`` in every report). Shutdown now cancels it, as
    closing the gRPC channel does, and counts it."""
    _clean_env(monkeypatch)
    with BlackHole() as hole:
        tt.configure(prometheus_port="off", write_files=False, register_atexit=False, strict=True,
                     otlp_endpoint=hole.endpoint, otlp_protocol=protocol, export_timeout_s=30.0)
        proc = get_runtime().processors[0]
        _emit(get_runtime(), 5, pause_every=100)
        deadline = time.monotonic() + 5
        while proc.accounting()["in_flight"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        before = proc.accounting()
        assert before["in_flight"] >= 1 and before["in_flight"] + before["queued"] == 5
        t0 = time.monotonic()
        tt.shutdown()
        took = time.monotonic() - t0
        worker = proc._worker
        if worker is not None:
            worker.join(1.0)
        assert worker is None or not worker.is_alive(), "the export call still hangs on the black hole"
    assert took < 1.5
    # The call in flight ended as a failed export (not abandoned); the queue was dropped at shutdown.
    expected = {"export_failed": before["in_flight"], "shutdown": before["queued"]}
    assert proc.accounting() == {"exporter": "otlp_grpc" if protocol == "grpc" else "otlp_http", "emitted": 5,
                                 "exported": 0, "dropped": {k: v for k, v in expected.items() if v}, "queued": 0,
                                 "in_flight": 0}
