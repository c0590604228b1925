"""Transport security checks for the collector endpoints torchtrace talks to."""

from __future__ import annotations

import ipaddress
import logging
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from torchtrace.errors import get_logger
from torchtrace.export.endpoints import metrics_endpoint

if TYPE_CHECKING:
    from torchtrace.config import Settings

logger = get_logger(__name__)

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_loopback_host(host: str | None) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if not host:
        return False
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_plaintext(endpoint: str, setting: str) -> bool:
    """Log a warning when ``endpoint`` is plain http to a host other than this machine.

    Returns True when a warning was given. Only scheme, host and port are logged: never a
    path, query or credentials.
    """
    try:  # configure has parsed the endpoint already; this never raises whatever it is given
        parts = urlsplit(endpoint)
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        logger.debug("torchtrace %s is not a URL; no transport check", setting)
        return False
    if parts.scheme != "http" or is_loopback_host(parts.hostname):
        return False
    logger.warning("torchtrace %s is plaintext http to %s%s: telemetry and headers travel unencrypted; "
                   "use https:// (with otlp_certificate for a private CA)", setting, parts.hostname, port)
    return True


class _NoHeaderEcho(logging.Filter):
    """Drops the OpenTelemetry SDK's "Header format invalid" warning, which prints the
    malformed entry of ``OTEL_EXPORTER_OTLP_HEADERS`` (a secret, often) in full. torchtrace
    has parsed that variable already and named the bad entry by its position."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Header format invalid")


_SDK_HEADER_LOGGER = "opentelemetry.util.re"
_header_filter = _NoHeaderEcho()


def hide_sdk_header_echo() -> None:
    """Install (once) the filter that keeps the SDK from logging header values.

    The SDK's exporters read ``OTEL_EXPORTER_OTLP_HEADERS`` themselves (the HTTP one always,
    the gRPC one when no headers are passed) and warn about a malformed entry by printing it.
    """
    sdk_logger = logging.getLogger(_SDK_HEADER_LOGGER)
    if _header_filter not in sdk_logger.filters:
        sdk_logger.addFilter(_header_filter)


def connect_timeout_s(export_timeout_s: float, shutdown_timeout_s: float) -> float:
    """How long one gRPC connection attempt may take (TCP, TLS, the HTTP/2 greeting).

    gRPC keeps a connection attempt going after its channel is closed, until the attempt's
    own deadline: 20 s by default, so against a collector that accepts and never answers, a
    socket outlived every shutdown by 10 to 25 s. A quarter of the shutdown deadline (at
    least 0.2 s, at most the export timeout) lets the last attempt end before shutdown
    returns; a collector more than about 50 ms away (four round trips with TLS) needs a
    longer ``shutdown_timeout_s``.

    >>> connect_timeout_s(5.0, 1.0)
    0.25
    """
    return min(export_timeout_s, max(0.2, 0.25 * shutdown_timeout_s))


def grpc_channel_options(connect_s: float) -> tuple[tuple[str, int], ...]:
    """Channel options that bound every connection attempt, and the wait between two, by ``connect_s``.

    gRPC gives an attempt the larger of its minimum connect timeout and the next backoff, so
    all three are set.
    """
    ms = max(1, int(connect_s * 1000))
    return (("grpc.min_reconnect_backoff_ms", ms), ("grpc.initial_reconnect_backoff_ms", ms),
            ("grpc.max_reconnect_backoff_ms", ms))


def _open_sockets_to(endpoint: str) -> int:
    """This process's TCP sockets to the endpoint's port (and address, when it is an IP literal)."""
    import psutil

    parts = urlsplit(endpoint)
    port, host = parts.port, (parts.hostname or "").strip("[]")
    try:
        ip = str(ipaddress.ip_address(host))
    except ValueError:
        ip = None
    count = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.raddr and conn.raddr.port == port and (ip is None or _plain_ip(conn.raddr.ip) == ip):
            count += 1
    return count


def _plain_ip(address: str) -> str:
    """``::ffff:127.0.0.1`` (gRPC's dual-stack sockets) as ``127.0.0.1``; other addresses as given."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    mapped = getattr(parsed, "ipv4_mapped", None)
    return str(mapped or parsed)


_SETTLED_S = 0.05  # no socket for this long: no attempt is left to start


def wait_for_disconnect(endpoint: str, deadline: float) -> int:
    """Wait, at most until ``deadline`` (monotonic), for the sockets to ``endpoint`` to close.

    Called after torchtrace's gRPC channels are closed: a connection attempt still running
    ends at its deadline (see :func:`connect_timeout_s`). Returns the sockets still open; a
    socket of the application's own to the same collector keeps the wait to the deadline.
    """
    # gRPC may start one more attempt just after the channel closes (its backoff timer was
    # already due): the count must stay at zero for a moment, not just read zero once.
    zero_since: float | None = None
    try:
        while True:
            left = _open_sockets_to(endpoint)
            now = time.monotonic()
            if left:
                zero_since = None
            elif zero_since is None:
                zero_since = now
            if (zero_since is not None and now - zero_since >= _SETTLED_S) or now >= deadline:
                return left
            time.sleep(min(0.02, max(0.0, deadline - now)))
    except Exception:  # psutil may be unable to read this process's sockets: nothing to wait for
        logger.debug("could not list this process's sockets", exc_info=True)
        return 0


def wait_for_grpc_disconnect(settings: Settings, pushes_metrics: bool, deadline: float) -> None:
    """After the gRPC channels of ``settings``' collectors are closed: wait for their sockets.

    A connection attempt that a closed channel left running ends within its bound
    (:func:`connect_timeout_s`); HTTP exporters close their sockets themselves.
    """
    if settings.otlp_protocol != "grpc":
        return
    endpoints = {settings.otlp_endpoint}
    if pushes_metrics:
        endpoints.add(metrics_endpoint(settings))
    for endpoint in sorted(e for e in endpoints if e):
        wait_for_disconnect(endpoint, deadline)
