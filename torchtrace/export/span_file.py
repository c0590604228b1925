"""The spans.jsonl file: one finished span per line as strict JSON, and the exporter that writes it.

Re-exported by :mod:`torchtrace.export.tracing`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import format_span_id, format_trace_id

from torchtrace import files
from torchtrace.files import JsonLinesFile


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
    assert ctx is not None  # (an ended span has its context)
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
    """Appends finished spans to a JSON-lines file (the embedded default).

    Only whole lines reach the file (see :class:`~torchtrace.files.JsonLinesFile`), and
    :attr:`last_written` says how many of a failed batch did, so the processor counts
    exactly the spans that are not in the file as lost.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.file = JsonLinesFile(path, max_bytes)
        self.last_written = 0  # spans of the last batch that are in the file

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write ``spans``; FAILURE when the size cap or a write error kept any out, and then
        :attr:`last_written` says how many are in the file."""
        self.last_written = 0
        self.last_written = self.file.write_lines([span_line(s) for s in spans])
        return SpanExportResult.SUCCESS if self.last_written == len(spans) else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
