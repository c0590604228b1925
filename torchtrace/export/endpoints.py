"""Which URL each OTLP signal goes to, by the OpenTelemetry spec's rules.

- A signal-specific endpoint (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
  ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``) is that signal's full URL: used as given.
- A base endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``, and the ``otlp_endpoint`` and
  ``otlp_metrics_endpoint`` settings given to ``configure()``) gets ``/v1/traces`` or
  ``/v1/metrics`` appended. A base that already ends in one of them (a full URL passed to
  the setting) has it replaced by the signal's own.
- One signal's specific endpoint is never used for the other.

gRPC takes only the host and port of an endpoint; its path means nothing there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtrace.config.env import SignalEndpoint

if TYPE_CHECKING:
    from torchtrace.config import Settings

_SIGNAL_PATHS = ("/v1/traces", "/v1/metrics")


def signal_url(endpoint: str, signal: str) -> str:
    """The URL an HTTP exporter of ``signal`` (``traces`` or ``metrics``) posts to.

    >>> signal_url("http://collector:4318/", "metrics")
    'http://collector:4318/v1/metrics'
    >>> signal_url("http://collector:4318/v1/traces", "metrics")
    'http://collector:4318/v1/metrics'
    >>> signal_url(SignalEndpoint("http://collector:4318/api/otlp/traces"), "traces")
    'http://collector:4318/api/otlp/traces'
    """
    if isinstance(endpoint, SignalEndpoint):
        return str(endpoint)
    base = endpoint.rstrip("/")
    for path in _SIGNAL_PATHS:
        if base.endswith(path):
            base = base[: -len(path)]
    return f"{base}/v1/{signal}"


def metrics_endpoint(settings: Settings) -> str | None:
    """Where metrics are pushed: ``otlp_metrics_endpoint``, else ``otlp_endpoint`` unless that
    is the traces URL from ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (then nowhere)."""
    if settings.otlp_metrics_endpoint:
        return settings.otlp_metrics_endpoint
    if isinstance(settings.otlp_endpoint, SignalEndpoint):
        return None
    return settings.otlp_endpoint
