"""The OpenTelemetry SDK's OTLP span exporters, set up the way torchtrace needs them.

Re-exported by :mod:`torchtrace.export.tracing`.
"""

from __future__ import annotations

import random
import sys
from typing import Mapping

from opentelemetry.sdk.trace.export import SpanExporter

from torchtrace.export.endpoints import signal_url
from torchtrace.export.http_session import HttpSpanExporter, abortable_session
from torchtrace.export.span_ids import own_random
from torchtrace.export.transport import grpc_channel_options, hide_sdk_header_echo

__all__ = ["otlp_span_exporter", "restore_sdk_jitter"]

#: The SDK's modules that draw their retry backoff's jitter from the module-level ``random``.
_JITTER_MODULES = ("opentelemetry.exporter.otlp.common.http", "opentelemetry.exporter.otlp.proto.grpc.exporter")


def private_sdk_jitter() -> None:
    """The SDK's OTLP exporters draw from a generator of torchtrace's own where they would draw
    from Python's global ``random`` (their backoff's jitter: the HTTP exporter before every
    attempt, the gRPC one before every retry). Those draws, on the export thread at moments
    nobody controls, moved the sequence a training script shuffles its data with. Undone by
    :func:`restore_sdk_jitter` at ``shutdown()``."""
    for name in _JITTER_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "random", None) is random:
            module.random = own_random()  # type: ignore[attr-defined]  # (a Random has the module's functions)


def restore_sdk_jitter() -> None:
    """The SDK's modules draw from Python's ``random`` again."""
    for name in _JITTER_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "random", None) is own_random():
            module.random = random  # type: ignore[attr-defined]


def otlp_span_exporter(endpoint: str, protocol: str, timeout_s: float, headers: Mapping[str, str] | None = None,
                       ca_file: str | None = None, connect_s: float | None = None) -> SpanExporter:
    """The SDK's OTLP exporter for ``protocol`` ("grpc" or "http/protobuf").

    ``endpoint`` is the setting ``otlp_endpoint`` (already parsed); for HTTP, the URL posted
    to follows the spec's rules (:func:`torchtrace.export.endpoints.signal_url`): a base gets
    ``/v1/traces``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is used as given. TLS follows the
    scheme: https uses TLS (``ca_file``, or ``OTEL_EXPORTER_OTLP_CERTIFICATE``, names a CA
    file), http does not. Both exporters'
    ``shutdown()`` ends a call in flight at once: the gRPC one by closing its channel, the
    HTTP one by closing the connections its session holds, idle or busy. ``connect_s`` bounds
    each gRPC connection attempt (:func:`torchtrace.export.transport.connect_timeout_s`).
    """
    hide_sdk_header_echo()
    exporter = _sdk_exporter(endpoint, protocol, timeout_s, headers, ca_file, connect_s)
    private_sdk_jitter()  # (after the import the exporter made)
    return exporter


def _sdk_exporter(endpoint: str, protocol: str, timeout_s: float, headers: Mapping[str, str] | None,
                  ca_file: str | None, connect_s: float | None) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        insecure = endpoint.startswith("http://")
        credentials = None
        if not insecure and ca_file:
            import grpc

            with open(ca_file, "rb") as fh:
                credentials = grpc.ssl_channel_credentials(root_certificates=fh.read())
        options = grpc_channel_options(connect_s if connect_s is not None else timeout_s)
        return GrpcExporter(endpoint=endpoint, insecure=insecure, credentials=credentials, timeout=timeout_s,
                            # (the exporter's stub allows only string values; gRPC takes ints too)
                            headers=dict(headers) if headers else None,
                            channel_options=options)  # type: ignore[arg-type]
    url = signal_url(endpoint, "traces")
    pinned = ca_file if url.startswith("https://") and ca_file else None
    session = abortable_session(pinned)
    return HttpSpanExporter(endpoint=url, timeout=timeout_s, headers=dict(headers) if headers else None,
                             certificate_file=pinned, session=session)
