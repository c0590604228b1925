"""An OTLP/HTTP span exporter whose shutdown also ends a request in flight.

The SDK's HTTP exporter closes its requests session at shutdown, and closing a session
closes only idle pooled connections: a request waiting on a collector that never answers
(a black hole) went on until its timeout, after torchtrace's report had been written, and
its spans were neither exported nor dropped. :func:`abortable_session` tracks every
connection it opens; its ``abort()`` shuts them all, busy or idle, and refuses new ones,
so the call fails at once, as a gRPC call does when its channel is closed.
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def _sdk_http_exporter():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter


class HttpSpanExporter(SpanExporter):
    """The SDK's OTLP/HTTP span exporter (``kwargs`` are its own, ``session`` required),
    whose ``shutdown`` also aborts a request in flight.

    >>> exporter = HttpSpanExporter(endpoint="http://127.0.0.1:4318/v1/traces", session=abortable_session())
    >>> exporter.shutdown()
    """

    def __init__(self, **kwargs: Any) -> None:
        self._session = kwargs["session"]
        self._inner = _sdk_http_exporter()(**kwargs)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self._inner.export(spans)

    def shutdown(self) -> None:
        try:
            self._inner.shutdown()  # sets the exporter's stop flag: no retry after this
        finally:
            self._session.abort()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def abortable_session(ca_file: str | None = None):
    """A requests session whose ``abort()`` shuts every connection it opened, busy or idle,
    and refuses new ones. With ``ca_file`` it verifies with that CA even when
    REQUESTS_CA_BUNDLE is set (requests lets that variable override a session's ``verify``).

    >>> session = abortable_session()
    >>> session.abort()
    """
    import weakref

    import requests

    live: "weakref.WeakSet[Any]" = weakref.WeakSet()
    aborted = threading.Event()
    adapter = _tracking_adapter(live, aborted)

    class AbortableSession(requests.Session):
        def __init__(self) -> None:
            super().__init__()
            self.mount("http://", adapter())
            self.mount("https://", adapter())

        def merge_environment_settings(self, url, proxies, stream, verify, cert):
            merged = super().merge_environment_settings(url, proxies, stream, verify, cert)
            if ca_file:
                merged["verify"] = ca_file
            return merged

        def abort(self) -> None:
            aborted.set()
            for conn in list(live):
                sock = getattr(conn, "sock", None)
                if sock is None:
                    continue
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    session = AbortableSession()
    if ca_file:
        session.verify = ca_file
    return session


def _tracking_adapter(live, aborted: threading.Event):
    """A requests adapter class whose connection pools add every connection they open to
    ``live`` and refuse to open one once ``aborted`` is set."""
    from requests.adapters import HTTPAdapter
    from urllib3.connection import HTTPConnection, HTTPSConnection
    from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

    def tracked(base):
        class Tracked(base):  # type: ignore[misc, valid-type]
            def connect(self):
                if aborted.is_set():
                    raise ConnectionAbortedError("torchtrace exporter shut down")
                live.add(self)
                return super().connect()

        return Tracked

    class HttpPool(HTTPConnectionPool):
        ConnectionCls = tracked(HTTPConnection)

    class HttpsPool(HTTPSConnectionPool):
        ConnectionCls = tracked(HTTPSConnection)

    class Adapter(HTTPAdapter):
        def init_poolmanager(self, *args, **kwargs):
            super().init_poolmanager(*args, **kwargs)
            self.poolmanager.pool_classes_by_scheme = {"http": HttpPool, "https": HttpsPool}

    return Adapter
