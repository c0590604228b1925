"""Spans: a private TracerProvider, a bounded batch processor, and the exporters.

The processor follows four rules: a bounded queue that drops and counts when full (never
blocks the training thread); one daemon worker thread, started lazily; rebuilt state in a
forked child, which exports nothing it inherited; and shutdown that respects a deadline
whatever the exporter does.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import format_span_id, format_trace_id

from torchtrace import files
from torchtrace.files import JsonLinesFile

logger = logging.getLogger(__name__)

DropCallback = Callable[[str, int], None]


class BoundedBatchSpanProcessor(SpanProcessor):
    """Batches finished spans to one exporter from a background thread.

    Args:
        exporter: where batches go.
        max_queue: spans held at most; more are dropped and reported as ``queue_full``.
        on_drop: ``on_drop(reason, count)`` for every lost span (queue_full, export_failed,
            shutdown).
        schedule_delay_s: the longest a span waits before its batch is sent.
        max_batch: spans per export call.
    """

    def __init__(self, exporter: SpanExporter, max_queue: int = 4096, on_drop: DropCallback | None = None,
                 schedule_delay_s: float = 1.0, max_batch: int = 512) -> None:
        self.exporter = exporter
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.schedule_delay_s = schedule_delay_s
        self._on_drop = on_drop or (lambda reason, n: None)
        self.on_error: Callable[[BaseException], None] | None = None
        self.exported = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self._init_state()
        self._pid = os.getpid()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (p := ref()) and p._after_fork())

    def _init_state(self) -> None:
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._worker: threading.Thread | None = None
        self._shutdown = False
        self._flush_requests = 0
        self._in_flight = 0
        self._exiting = False
        self._failing = False  # the last export failed: a flush at shutdown would only wait
        self._export_started: float | None = None

    def _after_fork(self) -> None:
        # A forked child (a DataLoader worker) must not export its parent's spans, nor any
        # of its own: the parent owns the run's telemetry.
        self._init_state()
        self._shutdown = True
        self._pid = os.getpid()

    def _drop(self, reason: str, count: int) -> None:
        if count <= 0:
            return
        self.dropped[reason] += count
        try:
            self._on_drop(reason, count)
        except Exception:  # the drop counter must never raise into on_end
            logger.debug("drop callback failed", exc_info=True)

    # ------------------------------------------------------------ SpanProcessor
    def on_start(self, span, parent_context=None) -> None:  # noqa: D401 - SDK signature
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if self._shutdown:
            if os.getpid() == self._pid:
                self._drop("shutdown", 1)
            return
        with self._cond:
            if len(self._queue) >= self.max_queue:
                full = True
            else:
                full = False
                self._queue.append(span)
                if self._worker is None:
                    if self._exiting:  # at interpreter exit no thread is started
                        self._queue.pop()
                        full = True
                    else:
                        self._start_worker()
                if len(self._queue) >= self.max_batch:
                    self._cond.notify()
        if full:
            if self._exiting and self._worker is None:
                self._export_inline_or_drop([span])
            else:
                self._drop("queue_full", 1)

    def _start_worker(self) -> None:
        self._worker = threading.Thread(target=self._run, name="torchtrace-span-export", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._shutdown and not self._flush_requests:
                    self._cond.wait(self.schedule_delay_s)
                if self._shutdown and not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
                self._in_flight = len(batch)
                if not self._queue:
                    self._flush_requests = 0
                    self._cond.notify_all()
            if batch:
                self._export(batch)
            with self._cond:
                self._in_flight = 0
                self._cond.notify_all()

    def _export(self, batch: list[ReadableSpan]) -> None:
        self._export_started = time.monotonic()
        try:
            result = self.exporter.export(batch)
        except Exception as exc:  # an exporter bug must not kill the worker
            (logger.debug if self.on_error else logger.warning)(
                "span exporter %s raised %s; %d span(s) lost", type(self.exporter).__name__,
                           type(exc).__name__, len(batch))
            result = SpanExportResult.FAILURE
            if self.on_error is not None:
                try:
                    self.on_error(exc)
                except Exception:
                    pass
        self._export_started = None
        if result == SpanExportResult.SUCCESS:
            self.exported += len(batch)
            self._failing = False
        else:
            self._failing = True
            self._drop("export_failed", len(batch))

    def collector_unhealthy(self, stuck_after_s: float = 0.5) -> bool:
        """The last export failed, or the current one has hung for ``stuck_after_s``."""
        started = self._export_started
        return self._failing or (started is not None and time.monotonic() - started > stuck_after_s)

    def prepare_exit(self) -> None:
        """Interpreter exit: from now on no thread is started; a processor without a worker
        writes local (file) exports inline and drops network ones as ``shutdown``."""
        self._exiting = True

    def _export_inline_or_drop(self, batch: list[ReadableSpan]) -> None:
        if isinstance(self.exporter, JsonLinesSpanExporter):
            self._export(batch)
        else:
            self._drop("shutdown", len(batch))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000.0
        with self._cond:
            if self._worker is None or self._shutdown:
                return not self._queue
            self._flush_requests += 1
            self._cond.notify_all()
            while self._queue or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def shutdown(self, timeout_s: float = 3.0) -> None:  # type: ignore[override]
        """Flush what fits in ``timeout_s``, count the rest as dropped, stop the exporter."""
        if self._shutdown:
            return
        deadline = time.monotonic() + timeout_s
        if self.collector_unhealthy():
            flush_s = min(0.05, timeout_s * 0.7)  # waiting on a dead collector only delays exit
        else:
            flush_s = timeout_s * 0.7
        flush_deadline = time.monotonic() + max(0.0, flush_s)
        while True:
            # Flush in short slices; give up early once the collector looks dead or stuck.
            left = flush_deadline - time.monotonic()
            if self.force_flush(int(max(0.0, min(0.05, left)) * 1000)) or left <= 0:
                break
            if self.collector_unhealthy(stuck_after_s=0.3):
                break
        with self._cond:
            self._shutdown = True
            left = len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._drop("shutdown", left)
        worker = self._worker
        if worker is not None:
            # A worker stuck in a network call is abandoned (it is a daemon thread).
            join_s = deadline - time.monotonic()
            if self.collector_unhealthy():
                join_s = min(join_s, 0.05)
            worker.join(max(0.0, join_s))
        if self._exiting:
            # No new thread at exit: stop the exporter inline. The SDK's exporters only set a
            # flag and close their channel or session here, which also cancels a stuck call.
            self._stop_exporter()
            return
        stopper = threading.Thread(target=self._stop_exporter, name="torchtrace-exporter-stop", daemon=True)
        stopper.start()
        stopper.join(max(0.05, deadline - time.monotonic()))

    def _stop_exporter(self) -> None:
        try:
            self.exporter.shutdown()
        except Exception:
            logger.debug("exporter shutdown failed", exc_info=True)


def span_to_dict(span: ReadableSpan) -> dict:
    """A finished span as a plain dict (the spans.jsonl line format)."""
    doc = _span_fields(span)
    doc["resource"] = _resource(span.resource)[0]
    return doc


def _mapping(attributes) -> dict:
    """Span or event attributes as a dict. The SDK hands out a read-only view of its bounded
    attribute mapping, whose ``copy()`` is one C-level dict copy; ``dict(view)`` would go
    through the mapping's Python ``__getitem__`` once per key (about 4 µs for a step span)."""
    if not attributes:
        return {}
    if isinstance(attributes, dict):
        return attributes
    copy = getattr(attributes, "copy", None)
    if copy is not None:
        out = copy()
        if isinstance(out, dict):
            return out
    return dict(attributes)


def _span_fields(span: ReadableSpan) -> dict:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "trace_id": format_trace_id(ctx.trace_id),
        "span_id": format_span_id(ctx.span_id),
        "parent_span_id": format_span_id(parent.span_id) if parent is not None else None,
        "name": span.name,
        "start_unix_ns": span.start_time,
        "end_unix_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        # Tuples (sequence attributes) are written as JSON arrays.
        "attributes": _mapping(span.attributes),
        "events": [{"name": e.name, "time_unix_ns": e.timestamp, "attributes": _mapping(e.attributes)}
                   for e in span.events],
    }


_RESOURCES: dict[int, tuple[Any, dict, str]] = {}


def _resource(resource) -> tuple[dict, str]:
    """The resource's attributes as a dict and as strict JSON text, built once per resource
    (every span of a run shares it)."""
    if resource is None:
        return {}, "{}"
    hit = _RESOURCES.get(id(resource))
    if hit is None or hit[0] is not resource:
        if len(_RESOURCES) > 16:
            _RESOURCES.clear()
        attrs = dict(resource.attributes)
        hit = _RESOURCES[id(resource)] = (resource, attrs, files.dumps(attrs))
    return hit[1], hit[2]


def span_line(span: ReadableSpan) -> bytes:
    """One spans.jsonl line: :func:`span_to_dict` as strict JSON. Attribute keys are strings and
    values JSON types, so the C encoder takes the document; only a non-finite float sends it
    to the strict path. The resource's text is made once and joined on."""
    doc = _span_fields(span)
    try:
        text = json.dumps(doc, allow_nan=False)
    except (ValueError, TypeError):
        text = files.dumps(doc)
    return (text[:-1] + ', "resource": ' + _resource(span.resource)[1] + "}\n").encode("utf-8")


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to a JSON-lines file (the embedded default)."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.file = JsonLinesFile(path, max_bytes)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        written = self.file.write_lines([span_line(s) for s in spans])
        return SpanExportResult.SUCCESS if written == len(spans) else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def otlp_span_exporter(endpoint: str, protocol: str, timeout_s: float, headers=None,
                       ca_file: str | None = None) -> SpanExporter:
    """The SDK's OTLP exporter for ``protocol`` ("grpc" or "http/protobuf").

    ``endpoint`` is the base endpoint, as in ``OTEL_EXPORTER_OTLP_ENDPOINT``; for HTTP,
    ``/v1/traces`` is appended unless the path already ends with it. TLS follows the scheme:
    https uses TLS (``ca_file``, or ``OTEL_EXPORTER_OTLP_CERTIFICATE``, names a CA file),
    http does not.
    """
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        insecure = endpoint.startswith("http://")
        credentials = None
        if not insecure and ca_file:
            import grpc

            with open(ca_file, "rb") as fh:
                credentials = grpc.ssl_channel_credentials(root_certificates=fh.read())
        return GrpcExporter(endpoint=endpoint, insecure=insecure, credentials=credentials, timeout=timeout_s,
                            headers=dict(headers) if headers else None)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    url = endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    session = None
    if url.startswith("https://") and ca_file:
        session = _pinned_ca_session(ca_file)
    return HttpExporter(endpoint=url, timeout=timeout_s, headers=dict(headers) if headers else None,
                        certificate_file=ca_file if session is not None else None, session=session)


def _pinned_ca_session(ca_file: str):
    """A requests session that verifies with ``ca_file`` even when REQUESTS_CA_BUNDLE is set
    (requests lets that variable override a session's own ``verify``)."""
    import requests

    class PinnedSession(requests.Session):
        def merge_environment_settings(self, url, proxies, stream, verify, cert):
            merged = super().merge_environment_settings(url, proxies, stream, verify, cert)
            merged["verify"] = ca_file
            return merged

    session = PinnedSession()
    session.verify = ca_file
    return session


def tracer_provider(resource: Resource) -> TracerProvider:
    """A private provider: torchtrace never replaces the application's global one.

    Attribute values (user-given ones included) are cut to ``MAX_ATTRIBUTE_LENGTH`` characters.
    """
    from opentelemetry.sdk.trace import SpanLimits

    from torchtrace import semconv

    limits = SpanLimits(max_attribute_length=semconv.MAX_ATTRIBUTE_LENGTH,
                        max_span_attribute_length=semconv.MAX_ATTRIBUTE_LENGTH)
    return TracerProvider(resource=resource, shutdown_on_exit=False, span_limits=limits)
