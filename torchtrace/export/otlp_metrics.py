"""OTLP metrics push: the Prometheus registry's instruments, sent to a collector.

A 1,000-rank job should not need 1,000 scrape targets. With ``metrics_exporter="otlp"``
(or ``"both"``) a background thread converts the private registry's ``collect()`` output
into an ``ExportMetricsServiceRequest`` every ``metrics_export_interval_s`` and sends it
over gRPC or HTTP/protobuf, each call bounded by its own deadline.

Name mapping (so that a collector's Prometheus exporter gives back the scraped names):

- a counter ``torchtrace_steps_total`` is sent as the monotonic cumulative sum
  ``torchtrace_steps``; the collector appends ``_total``;
- a histogram or gauge keeps its Prometheus name; names ending in ``_seconds`` carry the
  unit ``s`` and names ending in ``_bytes`` the unit ``By``, which the collector maps back
  to the suffix already present (it never doubles it); every other metric has no unit;
- labels become data point attributes with the same keys (``run_id``, ``rank``, ...).
"""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import threading
import time
import urllib.error
import weakref
from typing import Any, Mapping
from urllib.parse import urlsplit

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from prometheus_client import CollectorRegistry

from torchtrace.errors import get_logger
from torchtrace.export.endpoints import signal_url
from torchtrace.export.transport import grpc_channel_options
from torchtrace.job.signals import start_thread

logger = get_logger(__name__)

_CUMULATIVE = metrics_pb2.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE


def _unit(name: str) -> str:
    if name.endswith("_seconds"):
        return "s"
    if name.endswith("_bytes"):
        return "By"
    return ""


def _any_value(value: object) -> common_pb2.AnyValue:
    if isinstance(value, bool):
        return common_pb2.AnyValue(bool_value=value)
    if isinstance(value, int):
        return common_pb2.AnyValue(int_value=value)
    if isinstance(value, float):
        return common_pb2.AnyValue(double_value=value)
    return common_pb2.AnyValue(string_value=str(value))


def _attrs(labels: Mapping[str, Any]) -> list[common_pb2.KeyValue]:
    return [common_pb2.KeyValue(key=str(k), value=_any_value(v)) for k, v in labels.items()]


def _key(labels: Mapping[str, str], drop: str | None = None) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k != drop))


def registry_to_request(registry: CollectorRegistry, resource: Mapping[str, Any], start_unix_ns: int,
                        now_unix_ns: int | None = None) -> metrics_service_pb2.ExportMetricsServiceRequest:
    """Convert one ``registry.collect()`` to an OTLP request (cumulative temporality)."""
    now = now_unix_ns if now_unix_ns is not None else time.time_ns()
    out: list[metrics_pb2.Metric] = []
    for family in registry.collect():
        metric = _family_metric(family, start_unix_ns, now)
        if metric is not None:
            out.append(metric)
    scope = metrics_pb2.ScopeMetrics(scope=common_pb2.InstrumentationScope(name="torchtrace"), metrics=out)
    rm = metrics_pb2.ResourceMetrics(resource=resource_pb2.Resource(attributes=_attrs(resource)),
                                     scope_metrics=[scope])
    return metrics_service_pb2.ExportMetricsServiceRequest(resource_metrics=[rm])


def _family_metric(family, start_unix_ns: int, now: int) -> metrics_pb2.Metric | None:
    """One metric family as an OTLP metric; None for a family without points or of another type."""
    created: dict[tuple, int] = {}
    for s in family.samples:
        if s.name.endswith("_created"):
            created[_key(s.labels)] = int(s.value * 1e9)
    if family.type == "counter":
        points = [metrics_pb2.NumberDataPoint(
            attributes=_attrs(s.labels), start_time_unix_nano=created.get(_key(s.labels), start_unix_ns),
            time_unix_nano=now, as_double=float(s.value))
            for s in family.samples if s.name == family.name + "_total"]
        if points:
            return metrics_pb2.Metric(name=family.name, description=family.documentation,
                                      unit=_unit(family.name),
                                      sum=metrics_pb2.Sum(data_points=points, is_monotonic=True,
                                                          aggregation_temporality=_CUMULATIVE))
    elif family.type == "gauge":
        points = [metrics_pb2.NumberDataPoint(attributes=_attrs(s.labels), time_unix_nano=now,
                                              as_double=float(s.value))
                  for s in family.samples if s.name == family.name]
        if points:
            return metrics_pb2.Metric(name=family.name, description=family.documentation,
                                      unit=_unit(family.name), gauge=metrics_pb2.Gauge(data_points=points))
    elif family.type == "histogram":
        points = _histogram_points(family, created, start_unix_ns, now)
        if points:
            return metrics_pb2.Metric(name=family.name, description=family.documentation,
                                      unit=_unit(family.name),
                                      histogram=metrics_pb2.Histogram(data_points=points,
                                                                      aggregation_temporality=_CUMULATIVE))
    return None


def _histogram_points(family, created: dict[tuple, int], start_unix_ns: int,
                      now: int) -> list[metrics_pb2.HistogramDataPoint]:
    """A histogram family's series as data points (bucket counts per bucket, not cumulative)."""
    series: dict[tuple, dict[str, Any]] = {}
    for s in family.samples:
        if s.name.endswith("_created"):
            continue
        key = _key(s.labels, drop="le")
        entry = series.setdefault(key, {"labels": {k: v for k, v in s.labels.items() if k != "le"},
                                        "buckets": [], "count": 0.0, "sum": 0.0})
        if s.name == family.name + "_bucket":
            entry["buckets"].append((float(s.labels["le"]), s.value))
        elif s.name == family.name + "_count":
            entry["count"] = s.value
        elif s.name == family.name + "_sum":
            entry["sum"] = s.value
    points = []
    for key, entry in series.items():
        buckets = sorted(entry["buckets"])
        bounds = [b for b, _ in buckets if b != float("inf")]
        counts, previous = [], 0.0
        for _, cumulative in buckets:
            counts.append(int(cumulative - previous))
            previous = cumulative
        points.append(metrics_pb2.HistogramDataPoint(
            attributes=_attrs(entry["labels"]), start_time_unix_nano=created.get(key, start_unix_ns),
            time_unix_nano=now, count=int(entry["count"]), sum=float(entry["sum"]),
            bucket_counts=counts, explicit_bounds=bounds))
    return points


class _GrpcSender:
    def __init__(self, endpoint: str, headers: Mapping[str, str] | None, ca_file: str | None,
                 connect_s: float) -> None:
        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc

        target = urlsplit(endpoint).netloc.rpartition("@")[2]  # gRPC takes host:port; a path means nothing
        if endpoint.startswith("https://"):
            root = open(ca_file, "rb").read() if ca_file else None
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=root),
                                                options=grpc_channel_options(connect_s))
        else:
            self._channel = grpc.insecure_channel(target, options=grpc_channel_options(connect_s))
        self._stub = metrics_service_pb2_grpc.MetricsServiceStub(self._channel)
        self._metadata = [(k.lower(), v) for k, v in (headers or {}).items()]

    def send(self, request, timeout_s: float) -> None:
        self._stub.Export(request, timeout=timeout_s, metadata=self._metadata or None)

    def close(self) -> None:
        self._channel.close()


class _HttpSender:
    """POSTs each push on a connection of its own, all of it (connect, send, answer) within
    the push's deadline; :meth:`close` shuts down the socket of a push in flight, which then
    fails at once, and refuses new ones."""

    def __init__(self, endpoint: str, headers: Mapping[str, str] | None, ca_file: str | None,
                 connect_s: float) -> None:
        self.url = signal_url(endpoint, "metrics")
        parts = urlsplit(self.url)
        self._address = (parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
        self._path = parts.path or "/"
        self._headers = {"Content-Type": "application/x-protobuf", **(headers or {})}
        self._context = ssl.create_default_context(cafile=ca_file) if parts.scheme == "https" else None
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._closed = False

    def send(self, request, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        conn = self._connect(timeout_s)
        try:
            conn.sock.settimeout(max(0.001, deadline - time.monotonic()))
            conn.request("POST", self._path, body=request.SerializeToString(), headers=self._headers)
            conn.sock.settimeout(max(0.001, deadline - time.monotonic()))
            response = conn.getresponse()
            response.read()
        finally:
            with self._lock:
                self._conn = None
            conn.close()
        if not 200 <= response.status < 300:
            raise urllib.error.HTTPError(self.url, response.status, response.reason, response.headers, None)

    def _connect(self, timeout_s: float) -> http.client.HTTPConnection:
        host, port = self._address
        if self._context is not None:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(host, port, timeout=timeout_s,
                                                                           context=self._context)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        with self._lock:
            if self._closed:
                raise ConnectionAbortedError("metrics sender closed")
            self._conn = conn
        conn.connect()
        with self._lock:  # a close() during the connect found no socket to shut down
            if self._closed:
                conn.close()
                raise ConnectionAbortedError("metrics sender closed")
        return conn

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a push blocked on it; it then fails at once
            except OSError:
                pass


class OtlpMetricsPusher:
    """Pushes the registry every ``interval_s`` from one daemon thread; never blocks the caller.

    Args:
        registry: the Prometheus registry to convert.
        endpoint: the collector's endpoint; the URL posted to over HTTP follows the spec's rules
            (:func:`torchtrace.export.endpoints.signal_url`).
        protocol: ``grpc`` or ``http/protobuf``.
        resource: resource attributes (service.name, run id, rank, ...).
        interval_s: seconds between pushes.
        timeout_s: deadline of one push.
        headers: sent with every push; never logged.
        ca_file: CA bundle for an https endpoint.
        connect_s: the longest one gRPC connection attempt may take (default: ``timeout_s``).
    """

    def __init__(self, registry: CollectorRegistry, endpoint: str, protocol: str, resource: Mapping[str, Any],
                 interval_s: float = 10.0, timeout_s: float = 5.0, headers: Mapping[str, str] | None = None,
                 ca_file: str | None = None, connect_s: float | None = None) -> None:
        self.registry = registry
        self.resource = dict(resource)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.start_unix_ns = time.time_ns()
        sender_cls = _GrpcSender if protocol == "grpc" else _HttpSender
        self._sender = sender_cls(endpoint, headers, ca_file, connect_s if connect_s is not None else timeout_s)
        self.pushes = 0
        self.failures = 0
        self._last_failed = False
        self._closing = False  # shutdown is closing the sender: a push it cuts off is no collector failure
        self._failure_kinds: set[str] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (p := ref()) and p._after_fork())  # type: ignore[func-returns-value]

    def _after_fork(self) -> None:
        # A forked worker pushes nothing: the parent owns the run's metrics.
        self._thread = None
        self._stop = threading.Event()
        self._stop.set()
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread = start_thread(self._run, "torchtrace-metrics-push")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.push_once(self.timeout_s)

    def push_once(self, timeout_s: float) -> bool:
        """One push within ``timeout_s``; failures are counted and logged once per kind."""
        if os.getpid() != self._pid:
            return False
        deadline = time.monotonic() + timeout_s
        with self._lock:
            try:
                request = registry_to_request(self.registry, self.resource, self.start_unix_ns)
                # The request's build counts against the push's deadline, which is never exceeded.
                left = deadline - time.monotonic()
                if left < 0.01:
                    raise TimeoutError("no time left to push")
                self._sender.send(request, left)
            except Exception as exc:  # a collector problem must never reach the training thread
                self.failures += 1
                self._last_failed = True
                kind = type(exc).__name__
                if self._closing:
                    logger.debug("torchtrace OTLP metrics push ended by shutdown (%s)", kind)
                elif kind not in self._failure_kinds:
                    self._failure_kinds.add(kind)
                    logger.warning("torchtrace OTLP metrics push failed (%s); further failures are counted", kind)
                return False
            self.pushes += 1
            self._last_failed = False
            return True

    def shutdown(self, timeout_s: float) -> None:
        """One last push within ``timeout_s``, then stop; never starts a thread."""
        if self._stop.is_set():
            return
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(max(0.0, min(0.2, deadline - time.monotonic())))
        left = deadline - time.monotonic()
        # A final push, unless the collector is failing or a push is still hanging on it.
        if not self._last_failed and left > 0.05 and self._lock.acquire(timeout=min(left, 0.1)):
            self._lock.release()
            self.push_once(deadline - time.monotonic())
        self._closing = True
        try:
            self._sender.close()  # ends a push still in flight: no thread or socket outlives shutdown
        except Exception:
            logger.debug("metrics sender close failed", exc_info=True)
        if thread is not None and thread.is_alive():
            thread.join(max(0.0, deadline - time.monotonic()))
