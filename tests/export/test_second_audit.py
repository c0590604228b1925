"""What the second outside audit found in the export layer (issue 53, items 2 and 4-7; issue 50,
item 8), each against real parts: a real socket server, a black hole, a dead port, the real
OTLP exporters."""

from __future__ import annotations

import logging
import socket
import time

import psutil
import pytest
import torch

import torchtrace as tt
from tests.fixtures import BlackHole, dead_port
from torchtrace.api import get_runtime
from torchtrace.export.tracing import BoundedBatchSpanProcessor
from torchtrace.reporting import terminal

from .debug_helpers import Trainer

SECRET = "s3cr3t-Tok3n-9f2b"


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)
    return monkeypatch


class _CaptureAll(logging.Handler):
    """Every record of every logger, formatted with its arguments, as the console would show it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name} {record.levelname} {record.getMessage()}")


@pytest.fixture
def all_logs():
    handler = _CaptureAll()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old_level)


def _train(n: int = 20) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = model(torch.ones(2, 4)).pow(2).mean()
            loss.backward()
            step.record_loss(loss)
            opt.step()
            opt.zero_grad()


# ------------------------------------------------------------------ item 6: two Host headers
def _raw_request(port: int, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return data


def test_two_host_headers_get_400_over_a_real_socket(tt_runtime):
    port = get_runtime().server.port
    one = _raw_request(port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert one.startswith(b"HTTP/1.1 200"), one[:80]
    for path in (b"/metrics", b"/debug/summary"):
        two = _raw_request(port, b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n"
                           b"Connection: close\r\n\r\n")
        assert two.startswith(b"HTTP/1.1 400"), two[:80]
        # Even two equal Host headers: RFC 7230 5.4 asks for 400 whenever there is more than one.
        same = _raw_request(port, b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert same.startswith(b"HTTP/1.1 400"), same[:80]
        assert b"connection: close" in same.lower()


# ------------------------------------------------------------------ item 5: a failing drop counter
class _FailingExporter:
    """An exporter whose every export fails (a collector that refuses)."""

    def export(self, batch):
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.FAILURE

    def shutdown(self):
        return None


def _spans(n: int):
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("t")
    out = []
    for i in range(n):
        span = tracer.start_span(f"s{i}")
        span.end()
        out.append(span)
    return out


def test_a_failing_drop_counter_is_an_internal_error_logged_once_and_its_counts_are_kept(caplog):
    calls = {"n": 0, "counted": 0}

    def flaky_counter(reason: str, n: int) -> None:
        calls["n"] += 1
        if calls["n"] <= 3:
            raise RuntimeError("metric backend broken")
        calls["counted"] += n

    errors: list[BaseException] = []
    proc = BoundedBatchSpanProcessor(_FailingExporter(), max_queue=4, on_drop=flaky_counter, schedule_delay_s=0.01)
    proc.on_error = errors.append
    caplog.set_level(logging.DEBUG, logger="torchtrace")
    spans = _spans(10)
    for span in spans[:8]:
        proc.on_end(span)  # 4 queued (then exported and failed), the rest queue_full
    time.sleep(0.3)
    for span in spans[8:]:
        proc.on_end(span)
    proc.shutdown(1.0)
    acc = proc.accounting()
    lost = sum(acc["dropped"].values())
    assert lost == 10 and acc["exported"] == 0
    # Every failure of the counter reaches the internal-error callback, which counts and logs it.
    assert len(errors) == 3 and all(isinstance(e, RuntimeError) for e in errors)
    # The drops the counter missed while it failed are handed to it once it works again.
    assert calls["counted"] == lost


def test_a_failing_drop_counter_without_an_error_callback_logs_a_warning_once(caplog):
    def broken(reason: str, n: int) -> None:
        raise RuntimeError("metric backend broken")

    proc = BoundedBatchSpanProcessor(_FailingExporter(), max_queue=2, on_drop=broken, schedule_delay_s=0.01)
    caplog.set_level(logging.DEBUG, logger="torchtrace")
    for span in _spans(6):
        proc.on_end(span)
    proc.shutdown(0.5)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "drop" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]


def test_a_failing_drop_counter_in_a_runtime_counts_an_internal_error(clean_env, tmp_path):
    """The audit: 48 spans dropped while /metrics showed 0 and no internal error."""
    tt.configure(prometheus_port=0, run_dir=str(tmp_path / "runs"), otlp_endpoint=f"http://127.0.0.1:{dead_port()}",
                 otlp_protocol="grpc", register_atexit=False, span_queue_size=8)
    rt = get_runtime()
    real = rt.metrics.spans_dropped
    failures = {"left": 2}

    class Flaky:
        def labels(self, *values):
            if failures["left"] > 0:
                failures["left"] -= 1
                raise RuntimeError("counter broken")
            return real.labels(*values)

    rt.metrics.spans_dropped = Flaky()
    _train(30)
    processors = list(rt.processors)
    metrics = rt.metrics
    tt.shutdown()
    dropped = sum(sum(p.accounting()["dropped"].values()) for p in processors)
    assert dropped >= 1
    assert metrics.value("torchtrace_internal_errors_total", {"component": "tracing"}) >= 1
    shown = sum(metrics.value("torchtrace_spans_dropped_total", {"reason": r}) or 0
                for r in ("queue_full", "export_failed", "shutdown"))
    assert shown == dropped


# ------------------------------------------------------------------ item 4: malformed OTLP headers
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_malformed_otlp_headers_variable_never_shows_its_secret(clean_env, tmp_path, capfd, all_logs, protocol):
    # A colon instead of '=' is the common mistake; the SDK's warning printed the whole entry.
    clean_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"x-ok=fine,Authorization: Bearer {SECRET}")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", f"api-key {SECRET}")
    tt.configure(prometheus_port=None, run_dir=str(tmp_path / "runs"), otlp_endpoint=f"http://127.0.0.1:{dead_port()}",
                 otlp_protocol=protocol, metrics_exporter="otlp", register_atexit=False)
    _train(3)
    tt.shutdown()
    out, err = capfd.readouterr()
    text = "\n".join(all_logs.lines) + out + err
    for path in (tmp_path / "runs").rglob("*"):
        if path.is_file():
            text += path.read_text(errors="replace")
    assert SECRET not in text
    named = [line for line in all_logs.lines if "OTEL_EXPORTER_OTLP_TRACES_HEADERS" in line]
    assert named, all_logs.lines
    assert any("not shown" in line for line in named)


def test_otlp_headers_from_the_environment_are_parsed_by_torchtrace(clean_env):
    from torchtrace.config import Settings

    clean_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", "Authorization=Bearer%20abc,x-team = ml ")
    assert Settings.resolve({}).otlp_headers == {"authorization": "Bearer abc", "x-team": "ml"}
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-only=traces")
    assert Settings.resolve({}).otlp_headers == {"x-only": "traces"}
    with pytest.raises(ValueError) as info:
        Settings.resolve({"otlp_headers": {"authorization": f"Bearer {SECRET}\r\nX-Evil: 1"}})
    assert "otlp_headers" in str(info.value) and SECRET not in str(info.value)


# ------------------------------------------------------------------ item 2: the shutdown deadline
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_shutdown_keeps_its_deadline_with_metrics_pushed_to_a_black_hole(clean_env, tmp_path, protocol):
    """Was 1.11-1.16 s against shutdown_timeout_s=1.0: the final push took all the time and the
    report was written after it. A model with many parameters makes the report's write cost."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(400)])
    with BlackHole() as hole:
        tt.configure(prometheus_port=None, run_dir=str(tmp_path / "runs"), otlp_endpoint=hole.endpoint,
                     otlp_protocol=protocol, metrics_exporter="otlp", metrics_export_interval_s=30.0,
                     shutdown_timeout_s=1.0, register_atexit=False, level="advanced")
        trainer = Trainer(torch.nn.Sequential(torch.nn.Linear(8, 4)))
        trainer.model = model
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for i in range(30):
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                loss = model(torch.ones(2, 4)).sum() * (float("nan") if i % 2 else 1.0)
                loss.backward()
                step.record_loss(loss)
                opt.zero_grad()
        t0 = time.monotonic()
        tt.shutdown()
        elapsed = time.monotonic() - t0
    print(f"shutdown with metrics pushed to a black hole over {protocol}: {elapsed:.3f} s (deadline 1.0 s)")
    assert elapsed < 1.0, elapsed


# ------------------------------------------------------------------ item 7: sockets after shutdown
def _sockets_to(port: int) -> int:
    return sum(1 for c in psutil.Process().net_connections(kind="tcp") if c.raddr and c.raddr.port == port)


def test_no_socket_to_a_black_holed_grpc_collector_outlives_shutdown(clean_env, tmp_path):
    counts = []
    with BlackHole() as hole:
        for cycle in range(4):
            tt.configure(prometheus_port=None, run_dir=str(tmp_path / f"runs{cycle}"), otlp_endpoint=hole.endpoint,
                         otlp_protocol="grpc", metrics_exporter="otlp", metrics_export_interval_s=0.2,
                         register_atexit=False)
            _train(20)
            time.sleep(0.3)
            t0 = time.monotonic()
            tt.shutdown()
            elapsed = time.monotonic() - t0
            counts.append(_sockets_to(hole.port))
            assert elapsed < 1.0, elapsed
        accepted = hole.connections
    print(f"sockets to the black hole right after each shutdown: {counts}; connections accepted: {accepted}")
    assert accepted >= 4, "the black hole was reached"
    assert counts == [0, 0, 0, 0]


# ------------------------------------------------------------------ issue 50, item 8: a dead collector
def test_a_dead_collector_keeps_the_console_quiet_and_the_summary_per_sink(clean_env, tmp_path, capfd, all_logs):
    port = dead_port()
    for protocol in ("grpc", "http/protobuf"):
        all_logs.lines.clear()
        tt.configure(prometheus_port=None, run_dir=str(tmp_path / protocol.replace("/", "_")),
                     otlp_endpoint=f"http://127.0.0.1:{port}", otlp_protocol=protocol, export_timeout_s=3.0,
                     register_atexit=False)
        rt = get_runtime()
        for proc in rt.processors:
            proc.schedule_delay_s = 0.05
        _train(50)
        time.sleep(1.5)  # several exports fail, and the SDK's exporters retry within them
        metrics = rt.metrics
        tt.shutdown()
        summary_text = terminal.terminal_report(rt.run_path)
        out, err = capfd.readouterr()
        console = out + err + "\n".join(line for line in all_logs.lines if not line.startswith("torchtrace"))
        assert "Transient error" not in console and "Failed to export" not in console, console[-2000:]
        own = [line for line in all_logs.lines if line.startswith("torchtrace") and "collector" in line
               and "WARNING" in line]
        assert len(own) == 1, own
        assert metrics.value("torchtrace_internal_errors_total", {"component": "tracing"}) == 0
        failed = metrics.value("torchtrace_spans_dropped_total", {"reason": "export_failed"}) or 0
        assert failed >= 1
        # Per sink: the file got every span, the collector none.
        assert "file: 50 exported" in summary_text, summary_text
        assert f"otlp_{'grpc' if protocol == 'grpc' else 'http'}: 0 exported, 50 dropped" in summary_text, summary_text
        assert "50 spans exported, 50 dropped" not in summary_text
