"""Transport settings: plaintext warnings, header secrecy, certificate and exporter settings."""

from __future__ import annotations

import json
import logging
import os

import pytest

import torchtrace as tt
from torchtrace.api import get_runtime
from torchtrace.config import Settings
from torchtrace.export.transport import is_loopback_host, warn_if_plaintext


@pytest.mark.parametrize("host,expected", [("127.0.0.1", True), ("127.8.9.1", True), ("localhost", True),
                                           ("[::1]", True), ("::1", True), ("10.0.0.5", False),
                                           ("collector.example", False), ("", False)])
def test_is_loopback_host(host, expected):
    assert is_loopback_host(host) is expected


def test_plaintext_warning_only_for_remote_http(caplog):
    caplog.set_level(logging.WARNING)
    assert warn_if_plaintext("http://user:pw@collector.invalid:4318/v1/traces?k=v", "otlp_endpoint")
    assert not warn_if_plaintext("https://collector.invalid:4318", "otlp_endpoint")
    assert not warn_if_plaintext("http://127.0.0.1:4318", "otlp_endpoint")
    assert "collector.invalid:4318" in caplog.text
    assert "pw" not in caplog.text and "k=v" not in caplog.text


def test_auth_headers_are_never_logged_or_written(tmp_path, monkeypatch, caplog):
    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)
    secret = "Bearer s3cr3t-header-value"
    caplog.set_level(logging.DEBUG)
    result = tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False,
                          otlp_endpoint="http://collector.invalid:4318", otlp_headers={"authorization": secret})
    rt = get_runtime()
    text = repr(rt.settings) + json.dumps(rt.report(), default=str)
    tt.shutdown()
    assert "plaintext" in caplog.text
    text += caplog.text + result.report_path.read_text()
    assert "s3cr3t" not in text
    assert json.loads(result.report_path.read_text())["settings"]["otlp_headers"] == "<set>"


def test_new_settings_validate_and_read_the_environment(tmp_path):
    with pytest.raises(ValueError, match="metrics_exporter.*prometheus, otlp, both, none"):
        Settings.resolve({"metrics_exporter": "pull"}, environ={})
    with pytest.raises(ValueError, match="metrics_export_interval_s"):
        Settings.resolve({"metrics_export_interval_s": 0}, environ={})
    with pytest.raises(ValueError, match="otlp_certificate.*readable PEM file"):
        Settings.resolve({"otlp_certificate": str(tmp_path / "missing.pem")}, environ={})
    with pytest.raises(ValueError, match="otlp_metrics_endpoint"):
        Settings.resolve({"otlp_metrics_endpoint": "collector:4317"}, environ={})
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    s = Settings.resolve({}, environ={"TORCHTRACE_METRICS_EXPORTER": "OTLP", "TORCHTRACE_METRICS_EXPORT_INTERVAL": "2.5",
                                      "OTEL_EXPORTER_OTLP_CERTIFICATE": str(ca),
                                      "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert (s.metrics_exporter, s.metrics_export_interval_s, s.otlp_certificate, s.otlp_metrics_endpoint) == (
        "otlp", 2.5, str(ca), "http://127.0.0.1:4318")
    # A bad environment value is logged and replaced by the default.
    assert Settings.resolve({}, environ={"TORCHTRACE_METRICS_EXPORTER": "pull"}).metrics_exporter == "prometheus"
    assert Settings.resolve({}, environ={}).shutdown_timeout_s == 1.0
