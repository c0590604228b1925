"""The HTTP server beside the training job: ``/metrics`` and any routes added to it.

It binds 127.0.0.1 unless told otherwise, warns on a wildcard bind, handles a port in use
by policy, and runs in daemon threads that never touch training state. Any local client can
connect without a token, so what one can make the process hold is bounded: request heads
(:data:`MAX_HEAD_BYTES`, :data:`MAX_HEADER_LINES`), connections (:data:`MAX_CONNECTIONS`),
and time (:data:`IDLE_TIMEOUT_S`, :data:`HEAD_DEADLINE_S`), besides the accept pace.
"""

from __future__ import annotations

import errno
import http.server
import os
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from torchtrace.errors import get_logger
from torchtrace.export.pacing import RequestPacer
from torchtrace.job.signals import start_thread

logger = get_logger(__name__)

# A route handler gets the request handler and returns (status, content type, body bytes).
Handler = Callable[[http.server.BaseHTTPRequestHandler], "tuple[int, str, bytes]"]
NEXT_PORT_TRIES = 16
MAX_BODY_BYTES = 64 * 1024


@dataclass
class Route:
    method: str
    path: str  # exact path, or a prefix ending with "/"
    handler: Handler


MAX_HEAD_BYTES = 16 * 1024
"""Largest request head (request line and headers) read from a client; more: 431 and close."""
MAX_HEADER_LINES = 64
"""Most header lines in one request; more: 431 and close."""
MAX_CONNECTIONS = 32
"""Connections served at once. A new one beyond this replaces the connection that has waited
longest for its request head (a slow or idle client); when every connection is busy with a
request, the new one gets 503 and is closed without a thread."""
IDLE_TIMEOUT_S = 5.0
"""A connection that sends nothing for this long is closed (between requests, or mid-head)."""
HEAD_DEADLINE_S = 10.0
"""A request head not complete after this long is cut, however slowly it trickles in."""
_EVICT_AFTER_S = 0.5  # a connection younger than this is never replaced by a newcomer


class _HeadTooLarge(Exception):
    """The request head went over a byte, line or time limit."""


class _LimitedReader:
    """The connection's buffered reader, with the request head's budget on ``readline``.

    ``http.server`` reads the request line and each header with ``readline`` (up to 64 KB a
    line and 100 lines: 6.4 MB a request, held at once by the header parser). Here the whole
    head may use :data:`MAX_HEAD_BYTES` and :data:`MAX_HEADER_LINES`; bodies are read with
    ``read`` by the routes, which bound them themselves.
    """

    def __init__(self, raw) -> None:
        self._raw = raw
        self.reset()

    def reset(self) -> None:
        self.bytes_left = MAX_HEAD_BYTES
        self.lines_left = MAX_HEADER_LINES + 2  # the request line and the blank line that ends the head

    def readline(self, size: int = -1) -> bytes:
        if self.lines_left <= 0:
            raise _HeadTooLarge("too many header lines")
        limit = self.bytes_left + 1 if size is None or size < 0 else min(size, self.bytes_left + 1)
        line = self._raw.readline(limit)
        self.lines_left -= 1
        self.bytes_left -= len(line)
        if self.bytes_left < 0:
            raise _HeadTooLarge("request head too large")
        return line

    def __getattr__(self, name: str):
        return getattr(self._raw, name)


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
    max_connections = MAX_CONNECTIONS
    _next_accept = 0.0

    def server_activate(self) -> None:
        super().server_activate()
        self._conn_lock = threading.Lock()
        # Open connections: socket -> [phase, since]; phase "head" (waiting for a request
        # head) or "busy" (serving one). Stopping the server also ends keep-alive connections:
        # a scraper must not go on reading a stopped run's registry through one.
        self._conns: dict[socket.socket, list] = {}
        self.refused = 0
        self.evicted = 0
        self.reaped = 0

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

    def process_request(self, request, client_address) -> None:
        now = time.monotonic()
        victim = None
        with self._conn_lock:
            full = len(self._conns) >= self.max_connections
            if full:
                waiting = [(state[1], sock) for sock, state in self._conns.items()
                           if state[0] == "head" and now - state[1] >= _EVICT_AFTER_S]
                if waiting:
                    victim = min(waiting, key=lambda item: item[0])[1]
                    del self._conns[victim]
                    self.evicted += 1
                    full = False
                else:
                    self.refused += 1
            if not full:
                self._conns[request] = ["head", now]
        if victim is not None:
            _hang_up(victim)
        if full:
            _send_and_close(request, b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                     b"Connection: close\r\nRetry-After: 1\r\n\r\n")
            return
        super().process_request(request, client_address)

    def set_phase(self, request, phase: str) -> None:
        with self._conn_lock:
            state = self._conns.get(request)
            if state is not None:
                state[0], state[1] = phase, time.monotonic()

    def service_actions(self) -> None:
        """Called by ``serve_forever`` between polls: cut request heads past their deadline."""
        now = time.monotonic()
        with self._conn_lock:
            late = [sock for sock, (phase, since) in self._conns.items()
                    if phase == "head" and now - since > HEAD_DEADLINE_S]
        for sock in late:
            self.reaped += 1
            _hang_up(sock)

    def shutdown_request(self, request) -> None:
        with self._conn_lock:
            self._conns.pop(request, None)
        super().shutdown_request(request)

    def open_connections(self) -> int:
        with self._conn_lock:
            return len(self._conns)

    def close_connections(self) -> None:
        with self._conn_lock:
            conns = list(self._conns)
        for conn in conns:
            _hang_up(conn)


def _hang_up(sock: socket.socket) -> None:
    """End a connection from any thread: its handler's next read sees end of file."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _send_and_close(sock: socket.socket, data: bytes) -> None:
    """Answer without a thread: one non-blocking send (a short answer fits the socket
    buffer; a client that does not read loses it), then close."""
    try:
        sock.setblocking(False)
        sock.send(data)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _Handler(http.server.BaseHTTPRequestHandler):
    """The request handler's settings and typed parts; :func:`_make_handler` adds the routes."""

    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S  # a silent client holds only its own thread, and only this long
    # The head and the body are two writes: with Nagle on, the body waited 40 ms for the
    # client's delayed ACK on every request of a kept-alive connection.
    disable_nagle_algorithm = True
    # Its server is a _Server; its reader, the one setup() wraps (typeshed says BufferedIOBase:
    # the wrapper has the reading methods http.server calls).
    server: _Server
    rfile: _LimitedReader  # type: ignore[assignment]

    def setup(self) -> None:
        super().setup()
        self.rfile = _LimitedReader(self.rfile)


def _make_handler(server: "TelemetryServer") -> type[_Handler]:
    class RequestHandler(_Handler):
        def handle_one_request(self) -> None:
            self.rfile.reset()
            self.server.set_phase(self.connection, "head")
            cpu0 = time.thread_time()
            try:
                super().handle_one_request()
            except _HeadTooLarge as exc:
                _refuse_head(self, exc)
            finally:
                server.pacer.charge(time.thread_time() - cpu0)

        def log_message(self, fmt, *args):  # quiet: no per-request logging
            return

        def _dispatch(self, method: str) -> None:
            self.server.set_phase(self.connection, "busy")
            try:
                with server.pacer.turn():  # one route at a time, the server busy a bounded share
                    status, ctype, body, headers = server.handle(method, self)
            except Exception:
                logger.debug("telemetry server route failed", exc_info=True)
                status, ctype, body, headers = 500, "text/plain; charset=utf-8", b"internal error\n", {}
            _respond(self, method, status, ctype, body, headers)

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


def _refuse_head(handler: http.server.BaseHTTPRequestHandler, exc: Exception) -> None:
    """A request head over a limit: answer 431 and close the connection."""
    handler.close_connection = True
    logger.debug("telemetry server: %s; connection closed", exc)
    try:
        handler.wfile.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
                            b"Connection: close\r\n\r\n")
    except OSError:
        pass


def _respond(handler: http.server.BaseHTTPRequestHandler, method: str, status: int, ctype: str, body: bytes,
             headers: dict[str, str]) -> None:
    """Send a route's answer: status, the common headers, the route's headers, the body (none to HEAD).

    A request that came with a body ends its connection: a body no route read must not be
    parsed as the next request (a request hidden in a body would pass a proxy's path rules)."""
    if handler.headers.get("Content-Length", "0").strip() not in ("", "0") or handler.headers.get("Transfer-Encoding"):
        headers = {**headers, "Connection": "close"}
    handler.send_response(status)
    handler.send_header("Content-Type", ctype)
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("Cache-Control", "no-store")
    handler.send_header("X-Content-Type-Options", "nosniff")
    for k, v in headers.items():
        handler.send_header(k, v)
    handler.end_headers()
    if method != "HEAD":
        handler.wfile.write(body)


class TelemetryServer:
    """Serves ``/metrics`` from a registry, plus routes added with :meth:`add_route`."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1") -> None:
        self.registry = registry
        self.host = host
        self.port: int | None = None
        self.routes: list[Route] = []
        self.pacer = RequestPacer()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self.add_route("GET", "/metrics", self._metrics)

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        self.routes.append(Route(method.upper(), path, handler))

    def _metrics(self, request) -> tuple[int, str, bytes]:
        encoder, ctype = choose_encoder(request.headers.get("Accept"))
        return 200, ctype, encoder(self.registry)

    def handle(self, method: str, request) -> tuple[int, str, bytes, dict]:
        if len(request.headers.get_all("Host") or ()) > 1:  # RFC 7230 5.4; the route checks read the first only
            return 400, "text/plain; charset=utf-8", b"more than one Host header\n", {"Connection": "close"}
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
            self._thread = start_thread(httpd.serve_forever, "torchtrace-http", poll_interval=0.2)
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
        # The listening socket shut down wakes serve_forever's select now (Linux), not at its next
        # 0.2 s poll; the accept that fails then is ignored.
        _hang_up(httpd.socket)
        httpd.shutdown()
        httpd.server_close()
        httpd.close_connections()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._thread = None
