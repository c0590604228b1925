"""The OpenTelemetry SDK exporters' log lines, routed into torchtrace's own log.

Against a dead collector the SDK's OTLP exporters log every retry ("Transient error ...
retrying in 0.82s") and every failed batch, and those lines reach the application's console.
For the exporters torchtrace runs, on its own threads, the records are taken off the SDK's
loggers and handed to the exporter's owner (:class:`~torchtrace.export.tracing.BoundedBatchSpanProcessor`),
which turns the first into one torchtrace warning and the rest into DEBUG lines; the spans
they cost are counted in ``torchtrace_spans_dropped_total{reason="export_failed"}``. An
application's own exporters, on its own threads, log as before.

>>> install()
>>> route_thread(lambda record: None)
>>> unroute_thread()
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

__all__ = ["SDK_EXPORTER_LOGGERS", "install", "route_thread", "unroute_thread"]

SDK_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.common.http",
)
"""The loggers the SDK's OTLP span exporters write their retries and failures to."""

Sink = Callable[[logging.LogRecord], None]

# Thread ident -> the sink of the torchtrace exporter that runs on that thread.
_sinks: dict[int, Sink] = {}
_lock = threading.Lock()


class _Router(logging.Filter):
    """Takes a record off the SDK's logger when a torchtrace exporter thread wrote it."""

    def filter(self, record: logging.LogRecord) -> bool:
        sink = _sinks.get(record.thread) if record.thread is not None else None
        if sink is None:
            return True
        try:
            sink(record)
        except Exception:  # a sink's failure must not become the SDK's (nor print anything)
            pass
        return False


_router = _Router()


def install() -> None:
    """Put the router on the SDK's exporter loggers (once; idempotent)."""
    with _lock:
        for name in SDK_EXPORTER_LOGGERS:
            sdk_logger = logging.getLogger(name)
            if _router not in sdk_logger.filters:
                sdk_logger.addFilter(_router)


def route_thread(sink: Sink) -> None:
    """Records the SDK's exporters write on the calling thread go to ``sink`` from now on."""
    with _lock:
        _sinks[threading.get_ident()] = sink


def unroute_thread() -> None:
    """The calling thread's records go back to the SDK's loggers."""
    with _lock:
        _sinks.pop(threading.get_ident(), None)
