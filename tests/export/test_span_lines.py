"""spans.jsonl lines: the fast encoder writes exactly what the strict encoder of the span's
dict writes, for finite and non-finite values, sequences and events."""

from __future__ import annotations

import json
import math

import pytest

import torchtrace as tt
from torchtrace import api, files
from torchtrace.export import tracing


@pytest.fixture()
def tracer(tmp_path):
    tt.configure(service_name="lines", prometheus_port="off", run_dir=str(tmp_path), write_files=False,
                 register_atexit=False)
    yield api.get_runtime().tracer
    tt.shutdown()


@pytest.mark.parametrize("attributes,event", [
    ({"a": 1.0, "b": 2, "c": "s", "d": True, "e": (1.0, 2.5)}, None),
    ({"loss": float("nan"), "seq": (1.0, float("-inf"))}, {"v": float("inf"), "w": (1, 2)}),
    ({}, {"names": ("x", "y")}),
])
def test_fast_line_equals_the_strict_encoding(tracer, attributes, event):
    parent = tracer.start_span("outer")
    from opentelemetry import trace
    span = tracer.start_span("step", context=trace.set_span_in_context(parent), attributes=attributes)
    if event is not None:
        span.add_event("ev", event)
    span.end()
    parent.end()
    line = tracing.span_line(span)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    text = line.decode()
    def no_bare_constants(token):
        raise AssertionError(f"non-strict JSON token {token}")
    json.loads(text, parse_constant=no_bare_constants)
    assert json.loads(text) == json.loads(files.dumps(tracing.span_to_dict(span)))
    doc = json.loads(text)
    assert doc["parent_span_id"] == format(parent.get_span_context().span_id, "016x")
    assert doc["resource"]["service.name"] == "lines"
    # The attributes themselves, against what the span was given (not through span_to_dict).
    def plain(values):
        return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()
                if all(not isinstance(x, float) or math.isfinite(x) for x in (v if isinstance(v, tuple) else (v,)))}
    assert set(doc["attributes"]) == set(attributes)
    assert {k: doc["attributes"][k] for k in plain(attributes)} == plain(attributes)
    if event is not None:
        assert set(doc["events"][0]["attributes"]) == set(event)
        assert {k: doc["events"][0]["attributes"][k] for k in plain(event)} == plain(event)
