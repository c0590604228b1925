"""The HTTP server beside the training job: ``/metrics`` and any routes added to it.

It binds 127.0.0.1 unless told otherwise, warns on a wildcard bind, handles a port in use
by policy, and runs in daemon threads that never touch training state.
"""

from __future__ import annotations

import errno
import http.server
import logging
import os
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

logger = logging.getLogger(__name__)

# A route handler gets the request handler and returns (status, content type, body bytes).
Handler = Callable[[http.server.BaseHTTPRequestHandler], "tuple[int, str, bytes]"]
NEXT_PORT_TRIES = 16
MAX_BODY_BYTES = 64 * 1024


@dataclass
class Route:
    method: str
    path: str  # exact path, or a prefix ending with "/"
    handler: Handler


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    # On POSIX, SO_REUSEADDR lets a restarted server bind over connections still in
    # TIME_WAIT (a scrape just before shutdown); it never lets two live listeners share a
    # port there. On Windows it would, so it stays off.
    allow_reuse_address = os.name == "posix"
    request_queue_size = 64
    # Connections accepted per second at most. Each costs Python time under the GIL that the
    # training thread then waits for; a client reconnecting in a tight loop (measured: 1,800
    # connections a second from one process) would otherwise take a whole core and slow
    # every step. Past the pace, connections wait in the kernel's backlog. A scraper or a
    # person uses a handful a minute.
    max_accept_rate = 100.0
    _next_accept = 0.0

    def get_request(self):
        now = time.monotonic()
        wait = self._next_accept - now
        if wait > 0:
            time.sleep(wait)  # in the accept thread, without the GIL; at most 1/rate
        self._next_accept = max(now, self._next_accept) + 1.0 / self.max_accept_rate
        return super().get_request()

    def handle_error(self, request, client_address) -> None:
        # A client that hangs up or sends garbage is not worth a traceback on stderr.
        logger.debug("telemetry server: error serving a request", exc_info=True)

    # Open connections are tracked so that stopping the server also ends keep-alive
    # connections: a scraper must not go on reading a stopped run's registry through one.
    def process_request(self, request, client_address) -> None:
        with _conn_lock:
            self.__dict__.setdefault("_conns", set()).add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with _conn_lock:
            self.__dict__.setdefault("_conns", set()).discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with _conn_lock:
            conns = list(self.__dict__.get("_conns", ()))
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


_conn_lock = threading.Lock()


def _make_handler(server: "TelemetryServer"):
    class RequestHandler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 10  # a slow client holds only its own thread, and only this long

        def log_message(self, fmt, *args):  # quiet: no per-request logging
            return

        def _dispatch(self, method: str) -> None:
            try:
                status, ctype, body, headers = server.handle(method, self)
            except Exception:
                logger.debug("telemetry server route failed", exc_info=True)
                status, ctype, body, headers = 500, "text/plain; charset=utf-8", b"internal error\n", {}
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(body)

        def do_GET(self):
            self._dispatch("GET")

        def do_HEAD(self):
            self._dispatch("HEAD")

        def do_POST(self):
            self._dispatch("POST")

        def do_PUT(self):
            self._dispatch("PUT")

        def do_DELETE(self):
            self._dispatch("DELETE")

        def do_PATCH(self):
            self._dispatch("PATCH")

        def do_OPTIONS(self):
            self._dispatch("OPTIONS")

    return RequestHandler


class TelemetryServer:
    """Serves ``/metrics`` from a registry, plus routes added with :meth:`add_route`."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1") -> None:
        self.registry = registry
        self.host = host
        self.port: int | None = None
        self.routes: list[Route] = []
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self.add_route("GET", "/metrics", self._metrics)

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        self.routes.append(Route(method.upper(), path, handler))

    def _metrics(self, request) -> tuple[int, str, bytes]:
        encoder, ctype = choose_encoder(request.headers.get("Accept"))
        return 200, ctype, encoder(self.registry)

    def handle(self, method: str, request) -> tuple[int, str, bytes, dict]:
        path = request.path.split("?", 1)[0]
        matched = [r for r in self.routes
                   if r.path == path or (r.path.endswith("/") and r.path != "/" and path.startswith(r.path))]
        if not matched:
            return 404, "text/plain; charset=utf-8", b"not found\n", {}
        for route in matched:
            if route.method == method or (method == "HEAD" and route.method == "GET"):
                result = route.handler(request)
                if len(result) == 3:
                    return (*result, {})
                return result
        allow = ", ".join(sorted({r.method for r in matched}))
        return 405, "text/plain; charset=utf-8", b"method not allowed\n", {"Allow": allow}

    def start(self, port: int, policy: str = "next", stride: int = 1) -> int | None:
        """Bind and serve. Returns the port, or None when the port policy gave up.

        ``policy`` decides what a taken port leads to: ``next`` tries the following ports
        then an ephemeral one, ``ephemeral`` takes any free port, ``off`` serves nothing.
        ``stride`` spaces the following ports (the local world size under torchrun, so the
        fallbacks of local rank r are r + k * stride and never another rank's port).
        """
        if self.host in ("0.0.0.0", "::", ""):
            logger.warning("torchtrace metrics server binds %r: reachable from other machines", self.host)
        candidates = [port]
        if port != 0 and policy == "next":
            candidates += [port + i * max(stride, 1) for i in range(1, NEXT_PORT_TRIES)
                           if port + i * max(stride, 1) <= 65535] + [0]
        elif port != 0 and policy == "ephemeral":
            candidates.append(0)
        last_error: OSError | None = None
        for candidate in candidates:
            try:
                family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
                _Server.address_family = family
                httpd = _Server((self.host, candidate), _make_handler(self))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                last_error = exc
                continue
            self._httpd = httpd
            self.port = httpd.server_address[1]
            if candidate != port:
                logger.warning("torchtrace metrics port %d is in use; serving on %d instead", port, self.port)
            self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                            name="torchtrace-http", daemon=True)
            self._thread.start()
            return self.port
        logger.warning("torchtrace metrics port %d is in use and the port policy is %r: no metrics server (%s)",
                       port, policy, last_error)
        return None

    @property
    def url(self) -> str | None:
        if self.port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout_s: float = 2.0) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        httpd.close_connections()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._thread = None
