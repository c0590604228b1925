"""Transport security checks for the collector endpoints torchtrace talks to."""

from __future__ import annotations

import ipaddress
import logging
from urllib.parse import urlsplit

from torchtrace.errors import get_logger

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
