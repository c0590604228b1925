"""Step spans: opened at a step's entry, filled from the finished record, ended into the exporters.

A step's span is a :class:`StepSpan`: a full OpenTelemetry span for the user's code inside the
step (it is the current span, so the user's own spans become its children, and
``get_current_span().set_attribute(...)`` works), but cheap for the training thread. The SDK's
span checks every attribute as it is set (about 3 µs each) and builds its read-only view at
``end()``; torchtrace's own attributes are typed by construction, so a StepSpan stores them as
they are, checks only what user code sets, and leaves the conversion to the SDK's
``ReadableSpan`` to the exporter thread (:func:`readable`), the throughput attributes too (the
step hands their values over; the span sets them when first read). It reads like a
``ReadableSpan`` (``name``, ``attributes``, ``events``, ``status``, ...), so ``spans.jsonl`` is
written from it directly.

A root step span under the SDK's default sampler (no span around the step: a plain training
loop) decides nothing at entry: it is sampled, and its ids are drawn when first read, by a child
span or, at the latest, the step's end (:meth:`StepSpan.get_span_context`). Step
entry is on the critical path of a GPU that waits for the host; the step's end runs with the
step's work queued (issue 52).

:func:`apply_record` is the one place a finished :class:`~torchtrace.record.step.StepRecord`
becomes span attributes, events and status.
"""

from __future__ import annotations

import json
import math
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.sampling import DEFAULT_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from torchtrace import semconv
from torchtrace._version import __version__
from torchtrace.record.step import StepRecord, capped
from torchtrace.semconv import DATA_WAIT_S, FLOPS, LR, SAMPLES, TOKENS

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.trace import Span
    from opentelemetry.util.types import AnyValue, AttributeValue

SCOPE = InstrumentationScope("torchtrace", __version__)
_UNSET = Status(StatusCode.UNSET)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
MAX_USER_ATTRIBUTES = 128
# A span's ids are drawn once, whichever thread reads them first. Reentrant: a signal handler
# that reads them on the thread drawing them must not wait for that thread. A forked child gets
# a new one: the thread that held its parent's at the fork does not exist in the child.
_FIRST_READ = threading.RLock()


def _new_lock_in_child() -> None:
    global _FIRST_READ
    _FIRST_READ = threading.RLock()


os.register_at_fork(after_in_child=_new_lock_in_child)


class SpanEvent:
    """An event of a step span: what ``Event`` holds, without checking torchtrace's own values."""

    __slots__ = ("name", "attributes", "timestamp")

    def __init__(self, name: str, attributes: dict[str, Any], timestamp: int) -> None:
        self.name = name
        self.attributes = attributes
        self.timestamp = timestamp


class StepSpan(trace.Span):
    """The span of one step. Made by :func:`open_span`; ended by the runtime once the record is
    finished (``end`` hands it to ``sink``, the runtime's span processors).

    ``context`` None: a sampled root span whose ids ``ids`` draws when they are first read, in
    the trace ``trace_id`` (0: a new trace).
    """

    __slots__ = ("name", "_context", "_ids", "parent", "resource", "start_time", "end_time", "_own", "_user",
                 "_events", "status", "_sink", "instrumentation_scope")

    def __init__(self, name: str, context: SpanContext | None, parent: SpanContext | None, resource: Resource,
                 attributes: dict[str, Any], start_time: int, sink: Callable[["StepSpan"], None],
                 ids: tuple[IdGenerator, int] | None = None) -> None:
        self.name = name
        self._context = context
        self._ids = ids
        self.parent = parent
        self.resource = resource
        self.start_time = start_time
        self.end_time: int | None = None
        self._own = attributes
        self._user: BoundedAttributes | None = None
        self._events: list[SpanEvent] = []
        self.status = _UNSET
        self._sink = sink
        self.instrumentation_scope = SCOPE

    # ------------------------------------------------------------ the user's span API
    def get_span_context(self) -> SpanContext:
        context = self._context
        return context if context is not None else self._draw_ids()

    def _draw_ids(self) -> SpanContext:
        """The context of a root span opened without one: its ids, drawn once (two threads that
        read them first get the same)."""
        with _FIRST_READ:
            if self._context is None:
                assert self._ids is not None  # (a span is opened with a context or with its ids' source)
                ids, trace_id = self._ids
                drawn = SpanContext(trace_id or ids.generate_trace_id(), ids.generate_span_id(),
                                    is_remote=False, trace_flags=_SAMPLED)
                if self._context is None:  # (unless a signal handler on this thread drew them meanwhile)
                    self._context = drawn
            return self._context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        if self.end_time is not None:
            return
        if self._user is None:
            self._user = BoundedAttributes(MAX_USER_ATTRIBUTES, immutable=False,
                                           max_value_len=semconv.MAX_ATTRIBUTE_LENGTH)
        self._user[key] = value  # checked and cut like the SDK's span does it

    def set_attributes(self, attributes: Mapping[str, AnyValue]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(self, name: str, attributes: Mapping[str, AnyValue] | None = None,
                  timestamp: int | None = None) -> None:
        if self.end_time is not None:
            return
        self._events.append(SpanEvent(name, clean_attributes(attributes or {}), timestamp or _now()))

    def add_link(self, context: SpanContext, attributes: Mapping[str, AnyValue] | None = None) -> None:
        return None  # step spans carry no links

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self.end_time is not None:
            return
        self.status = status if isinstance(status, Status) else Status(status, description)

    def record_exception(self, exception: BaseException, attributes: Mapping[str, AnyValue] | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        attrs: dict[str, AnyValue] = {"exception.type": type(exception).__qualname__}
        attrs.update(attributes or {})
        self.add_event("exception", attrs, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time or _now()
        if self.get_span_context().trace_flags.sampled:
            self._sink(self)

    # ------------------------------------------------------------ read like a ReadableSpan
    @property
    def context(self) -> SpanContext:
        return self.get_span_context()

    @property
    def attributes(self) -> dict[str, Any]:
        if not self._user:
            return self._own
        merged = dict(self._own)
        merged.update(self._user)
        return merged

    @property
    def events(self) -> list[SpanEvent]:
        return self._events

    @property
    def kind(self) -> trace.SpanKind:
        return trace.SpanKind.INTERNAL

    @property
    def links(self) -> tuple:
        return ()


def clean_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """User-given span attributes, checked and cut as the SDK does it (invalid ones dropped)."""
    return dict(BoundedAttributes(MAX_USER_ATTRIBUTES, attributes, max_value_len=semconv.MAX_ATTRIBUTE_LENGTH))


def _now() -> int:
    import time

    return time.time_ns()


def open_span(tracer_provider: TracerProvider, name: str, attributes: dict[str, Any], start_ns: int,
              sink: Callable[[StepSpan], None], trace_id: int = 0, around: Context | None = None) -> trace.Span:
    """A step span, child of the span current in the context ``around`` (default: the current
    context) if there is one, sampled by the provider's sampler.

    ``trace_id``: forced (one trace per step across ranks) when the step is a root span.
    """
    if around is not None and not around and tracer_provider.sampler is DEFAULT_ON:
        # Nothing around the step (an empty context) and the default sampler: a sampled root
        # span, whose ids are drawn when first read.
        return StepSpan(name, None, None, tracer_provider.resource, attributes, start_ns, sink,
                        (tracer_provider.id_generator, trace_id))
    parent: SpanContext | None
    parent = trace.get_current_span(around).get_span_context()
    if not parent.is_valid:
        parent = None
        trace_id = trace_id or tracer_provider.id_generator.generate_trace_id()
    else:
        trace_id = parent.trace_id
    ids = tracer_provider.id_generator
    sampler = tracer_provider.sampler
    if sampler is DEFAULT_ON:  # the SDK's default: sampled unless a parent says otherwise
        sampled = parent is None or parent.trace_flags.sampled
        context = SpanContext(trace_id, ids.generate_span_id(), is_remote=False,
                              trace_flags=_SAMPLED if sampled else _NOT_SAMPLED,
                              trace_state=parent.trace_state if parent is not None else None)
        recording = sampled
    else:  # OTEL_TRACES_SAMPLER or a configured sampler decides
        decision = sampler.should_sample(None, trace_id, name, trace.SpanKind.INTERNAL, attributes)
        context = SpanContext(trace_id, ids.generate_span_id(), is_remote=False,
                              trace_flags=_SAMPLED if decision.decision.is_sampled() else _NOT_SAMPLED,
                              trace_state=decision.trace_state)
        recording = decision.decision.is_recording()
    if not recording:
        return trace.NonRecordingSpan(context)
    return StepSpan(name, context, parent, tracer_provider.resource, attributes, start_ns, sink)


def readable(span: ReadableSpan | StepSpan) -> ReadableSpan:
    """The SDK's ``ReadableSpan`` of a step span (on the exporter thread); other spans as they are."""
    if not isinstance(span, StepSpan):
        return span
    return ReadableSpan(name=span.name, context=span.get_span_context(), parent=span.parent,
                        resource=span.resource, attributes=span.attributes,
                        events=[Event(e.name, e.attributes, e.timestamp) for e in span.events],
                        status=span.status, start_time=span.start_time, end_time=span.end_time,
                        instrumentation_scope=span.instrumentation_scope)


# ---------------------------------------------------------------- record -> span
def _finite(v: float) -> float:
    return v if math.isfinite(v) else float("nan")


def apply_record(span: Span, record: StepRecord, exc: BaseException | None, exception_messages: bool) -> None:
    """Set the record's attributes, events and status on its span, and end the span."""
    step_span = span if isinstance(span, StepSpan) else None
    attrs: dict[str, Any] = step_span._own if step_span is not None else {}
    _health(attrs, record)
    _throughput(attrs, record)
    now = record.end_unix_ns
    found: list[tuple[str, dict[str, Any]]] = []
    for anomaly in record.anomalies:
        detail = anomaly.detail[:semconv.MAX_ATTRIBUTE_LENGTH]
        found.append((semconv.EVENT_ANOMALY, {semconv.EVENT_ANOMALY_KIND: anomaly.kind,
                                              semconv.EVENT_ANOMALY_DETAIL: detail}))
    _probe_events(found, attrs, record)
    if exc is not None:
        event = {"exception.type": type(exc).__qualname__}
        if exception_messages:
            event["exception.message"] = str(exc)[:semconv.MAX_ATTRIBUTE_LENGTH]
        found.append(("exception", event))
        status = Status(StatusCode.ERROR, type(exc).__qualname__)
    elif record.nonfinite:
        status = Status(StatusCode.ERROR, "non-finite step: " + ", ".join(record.anomaly_kinds))
    else:
        status = None
    if step_span is not None:
        step_span._events.extend(SpanEvent(name, a, now) for name, a in found)
        if status is not None:
            step_span.status = status
    else:  # a span of another kind (the SDK's): through its own API
        span.set_attributes(attrs)
        for name, a in found:
            span.add_event(name, a, now)
        if status is not None:
            span.set_status(status)
    span.end(end_time=record.end_unix_ns)


def _health(attrs: dict[str, Any], record: StepRecord) -> None:
    if record.loss is not None:
        attrs[semconv.LOSS] = record.loss
    if record.grad_norm is not None:
        attrs[semconv.GRAD_NORM] = record.grad_norm
        attrs[semconv.GRAD_NORM_SCOPE] = record.grad_norm_scope
        attrs[semconv.GRAD_PARAM_COUNT] = len(record.grad_names)
        attrs[semconv.GRAD_NONFINITE_COUNT] = len(record.grad_nonfinite_params)
        if record.grad_nonfinite_params:
            attrs[semconv.GRAD_NONFINITE_PARAMS] = capped(record.grad_nonfinite_params)
        if record.grad_exploded_params:
            attrs[semconv.GRAD_EXPLODED_PARAMS] = capped(record.grad_exploded_params)
        if record.grad_vanished_params:
            attrs[semconv.GRAD_VANISHED_PARAMS] = capped(record.grad_vanished_params)
    if record.param_checked:
        attrs[semconv.PARAM_CHECKED] = True
    if record.param_nonfinite_params:
        attrs[semconv.PARAM_NONFINITE_PARAMS] = capped(record.param_nonfinite_params)
    if record.update_ratio is not None:
        attrs[semconv.UPDATE_RATIO] = record.update_ratio
    if record.update_ratio_max_param is not None:
        attrs[semconv.UPDATE_RATIO_MAX] = record.update_ratio_max
        attrs[semconv.UPDATE_RATIO_MAX_PARAM] = record.update_ratio_max_param[:200]
    if record.anomalies:
        attrs[semconv.ANOMALY_KINDS] = record.anomaly_kinds
    mem = record.memory
    rss = mem.get("rss_bytes")
    if rss is not None:
        attrs[semconv.MEMORY_RSS_BYTES] = rss
    if mem.get("cuda_allocated_bytes") is not None:
        attrs[semconv.MEMORY_CUDA_ALLOCATED_BYTES] = mem["cuda_allocated_bytes"]
        attrs[semconv.MEMORY_CUDA_RESERVED_BYTES] = mem["cuda_reserved_bytes"]
        attrs[semconv.MEMORY_CUDA_PEAK_BYTES] = mem["cuda_peak_allocated_bytes"]
    if record.memory_growth is not None:
        attrs[semconv.MEMORY_GROWTH_BYTES_PER_STEP] = record.memory_growth
    if record.skipped:
        attrs[semconv.STEP_SKIPPED] = True
    if record.scaler_overflow:
        attrs[semconv.STEP_SCALER_OVERFLOW] = True
    if record.guard_peer_nonfinite:
        attrs[semconv.GUARD_PEER_NONFINITE] = True
    if record.rank_skew is not None:
        attrs[semconv.RANK_STEP_SKEW], attrs[semconv.RANK_SLOWEST] = record.rank_skew
    attrs[semconv.OVERHEAD_SECONDS] = record.overhead_s


_PHASE_ATTRIBUTES = dict(zip(semconv.PHASES, (semconv.PHASE_FORWARD_S, semconv.PHASE_BACKWARD_S,
                                               semconv.PHASE_OPTIMIZER_S)))


def _throughput(attrs: dict[str, Any], record: StepRecord) -> None:
    """The record's throughput attributes (batch, FLOPs, learning rate, data wait, phases) on ``attrs``."""
    if record.samples is not None:
        attrs[SAMPLES] = record.samples
    if record.tokens is not None:
        attrs[TOKENS] = record.tokens
    if record.flops is not None:
        attrs[FLOPS] = record.flops
    if record.lr:
        attrs[LR] = record.lr[0]
    if record.data_wait_s is not None:
        attrs[DATA_WAIT_S] = record.data_wait_s
    if record.phases:
        for phase, seconds in record.phases.items():
            key = _PHASE_ATTRIBUTES.get(phase)
            if key is not None:
                attrs[key] = seconds


def _probe_events(found: list, attrs: dict[str, Any], record: StepRecord) -> None:
    """Span attributes and events of the probes' findings (profiler, activations, forensics, OOM, leak)."""
    profile = record.profile
    if profile is not None:
        attrs[semconv.PROFILE_TRACE_PATH] = profile["path"]
        attrs[semconv.PROFILE_WINDOW] = profile["window"]
        attrs[semconv.PROFILE_REASON] = profile["reason"]
        if profile.get("truncated"):
            attrs[semconv.PROFILE_TRUNCATED] = profile["truncated"]
        for op in profile.get("top_ops", ()):
            found.append((semconv.EVENT_PROFILE_OP, {
                semconv.PROFILE_OP_NAME: op["name"][:200], semconv.PROFILE_OP_SELF_CPU_US: op["self_cpu_us"],
                semconv.PROFILE_OP_CPU_US: op["cpu_us"], semconv.PROFILE_OP_SELF_DEVICE_US: op["self_device_us"],
                semconv.PROFILE_OP_CALLS: op["calls"]}))
    rows = record.activations
    if rows:
        cap = semconv.MAX_NAMES_PER_ATTRIBUTE
        event: dict[str, Any] = {
            semconv.ACTIVATION_LAYERS: [r["name"][:200] for r in rows[:cap]],
            semconv.ACTIVATION_MEAN: [_finite(r["mean"]) for r in rows[:cap]],
            semconv.ACTIVATION_STD: [_finite(r["std"]) for r in rows[:cap]],
            semconv.ACTIVATION_MIN: [_finite(r["min"]) for r in rows[:cap]],
            semconv.ACTIVATION_MAX: [_finite(r["max"]) for r in rows[:cap]],
            semconv.ACTIVATION_NONFINITE: [r["nonfinite"] for r in rows[:cap]],  # 1 = held NaN/Inf
        }
        bad = [r["name"] for r in rows if r["nonfinite"]]
        if bad:
            event[semconv.ACTIVATION_NONFINITE_LAYERS] = capped(bad)
        found.append((semconv.EVENT_ACTIVATIONS, event))
    if record.forensics is not None:
        found.append((semconv.EVENT_FORENSICS, flat(record.forensics, semconv.FORENSICS_PREFIX)))
    if record.oom is not None:
        found.append((semconv.EVENT_OOM, flat(record.oom, semconv.FORENSICS_PREFIX)))
    leak = record.leak
    if leak is not None:
        event = {semconv.EVENT_ANOMALY_DETAIL: leak["detail"][:semconv.MAX_ATTRIBUTE_LENGTH],
                 semconv.MEMORY_GROWTH_BYTES_PER_STEP: leak["bytes_per_step"]}
        if leak.get("tensor_lines"):
            event[semconv.MEMORY_LEAK_TENSORS] = leak["tensor_lines"]
        if leak.get("site_lines"):
            event[semconv.MEMORY_LEAK_SITES] = leak["site_lines"]
        found.append((semconv.EVENT_MEMORY_LEAK, event))


def flat(report: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Span-event attributes from a report: scalars as they are, nested values as capped JSON."""
    out: dict[str, Any] = {}
    for key, value in report.items():
        if value is None:
            continue
        name = prefix + key
        if isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
            out[name] = value[: semconv.MAX_ATTRIBUTE_LENGTH] if isinstance(value, str) else value
        else:
            out[name] = json.dumps(value, default=str)[: semconv.MAX_ATTRIBUTE_LENGTH]
    return out
