"""Which URL each OTLP signal is sent to, by the OpenTelemetry spec's rules: a signal-specific
endpoint (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, ..._METRICS_ENDPOINT) is used as given; the
generic OTEL_EXPORTER_OTLP_ENDPOINT gets /v1/traces or /v1/metrics appended; one signal's
URL is never used for the other."""

from __future__ import annotations

import http.server
import threading

import pytest
import torch

import torchtrace as tt
from tests.fixtures import HttpOtlpReceiver
from torchtrace.api import get_runtime


@pytest.fixture
def otel_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _train(steps: int = 2) -> None:
    model = torch.nn.Linear(4, 1)
    for _ in range(steps):
        with tt.debug_context("train_step", model=model) as step:
            step.record_loss(model(torch.ones(2, 4)).pow(2).mean())


class _PathRecorder(http.server.ThreadingHTTPServer):
    """Answers 200 to every POST and records its path: a collector behind a custom path."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server name)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recorder.paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                return None

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def _configure(tmp_path, **kwargs) -> None:
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, metrics_exporter="otlp",
                 metrics_export_interval_s=60, **kwargs)


def test_a_signal_specific_url_is_used_as_given(tmp_path, otel_env):
    rec = _PathRecorder()
    try:
        otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rec.url + "/api/otlp/traces")
        otel_env.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", rec.url + "/api/otlp/metrics")
        _configure(tmp_path)
        _train()
        tt.shutdown()
    finally:
        rec.close()
    assert set(rec.paths) == {"/api/otlp/traces", "/api/otlp/metrics"}, rec.paths


def test_the_traces_url_is_never_used_for_metrics(tmp_path, otel_env, caplog):
    with HttpOtlpReceiver() as rx:
        otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.traces_url)
        _configure(tmp_path)
        assert get_runtime().metrics_pusher is None
        _train()
        tt.shutdown()
        assert len(rx.spans()) == 2 and rx.metric_requests() == []
    assert "no OTLP endpoint" in caplog.text


def test_the_generic_endpoint_gets_each_signals_path(tmp_path, otel_env):
    with HttpOtlpReceiver() as rx:
        otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint + "/")
        otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.traces_url)  # and the traces URL beside it
        _configure(tmp_path)
        _train()
        tt.shutdown()
        assert len(rx.spans()) == 2 and len(rx.metric_requests()) == 1


@pytest.mark.parametrize("given", ["{base}", "{base}/v1/traces"])
def test_the_otlp_endpoint_setting_is_a_base_url_for_both_signals(tmp_path, otel_env, given):
    with HttpOtlpReceiver() as rx:
        _configure(tmp_path, otlp_endpoint=given.format(base=rx.endpoint))
        _train()
        tt.shutdown()
        assert len(rx.spans()) == 2 and len(rx.metric_requests()) == 1
