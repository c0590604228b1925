"""A step span's throughput attributes against the plain reading of the record: the same
names, values and order, whichever fields a step has and whatever its phases."""

from __future__ import annotations

import random

import pytest

from torchtrace import semconv
from torchtrace.export import spans
from torchtrace.record.step import StepRecord

_PHASE_KEYS = {"forward": semconv.PHASE_FORWARD_S, "backward": semconv.PHASE_BACKWARD_S,
               "optimizer": semconv.PHASE_OPTIMIZER_S}


def _reference(record: StepRecord) -> list[tuple[str, object]]:
    attrs: dict[str, object] = {"before": 1}
    if record.samples is not None:
        attrs[semconv.SAMPLES] = record.samples
    if record.tokens is not None:
        attrs[semconv.TOKENS] = record.tokens
    if record.flops is not None:
        attrs[semconv.FLOPS] = record.flops
    if record.lr:
        attrs[semconv.LR] = record.lr[0]
    if record.data_wait_s is not None:
        attrs[semconv.DATA_WAIT_S] = record.data_wait_s
    for phase, seconds in (record.phases or {}).items():
        if phase in _PHASE_KEYS:
            attrs[_PHASE_KEYS[phase]] = seconds
    return list(attrs.items())


@pytest.mark.parametrize("seed", range(3))
def test_throughput_attributes_equal_the_plain_reading(seed):
    rng = random.Random(seed)
    names = list(_PHASE_KEYS) + ["data", "custom"]
    for i in range(500):
        rec = StepRecord(operation="train_step", step=i, level="basic", start_unix_ns=1)
        rec.samples = rng.choice([None, 0, 32])
        rec.tokens = rng.choice([None, 0, 4096])
        rec.flops = rng.choice([None, 0.0, 1.5e9])
        rec.lr = rng.choice([None, [], [0.1], [0.2, 0.3]])
        rec.data_wait_s = rng.choice([None, 0.0, 0.004])
        rec.phases = rng.choice([None, {}, {p: rng.random() for p in rng.sample(names, rng.randrange(1, 6))}])
        attrs: dict[str, object] = {"before": 1}
        spans._throughput(attrs, rec)
        assert list(attrs.items()) == _reference(rec), rec


def _span(sink: list) -> spans.StepSpan:
    from opentelemetry.trace import SpanContext

    context = SpanContext(1, 2, is_remote=False, trace_flags=spans._SAMPLED)
    return spans.StepSpan("train_step", context, None, None, {"torchtrace.step": 1}, 1, sink.append)


@pytest.mark.parametrize("seed", range(3))
def test_a_step_spans_attributes_are_those_set_in_order_on_the_training_thread(seed):
    """A step span's attributes are those the training thread set, in its order: the step's
    health, its throughput, then the probes' findings."""
    rng = random.Random(seed)
    for i in range(300):
        rec = StepRecord(operation="train_step", step=i, level="basic", start_unix_ns=1, end_unix_ns=5,
                         loss=rng.choice([None, 0.5]), memory={"rss_bytes": 10})
        rec.samples = rng.choice([None, 32])
        rec.flops = rng.choice([None, 1.5e9])
        rec.lr = rng.choice([None, [0.1]])
        rec.data_wait_s = rng.choice([None, 0.004])
        rec.phases = rng.choice([None, {"forward": 0.1, "backward": 0.2, "optimizer": 0.3}])
        if rng.random() < 0.2:
            rec.profile = {"path": "/tmp/p.json", "window": 3, "reason": "scheduled", "top_ops": []}
        want: dict[str, object] = {"torchtrace.step": 1}
        spans._health(want, rec)
        spans._throughput(want, rec)
        spans._probe_events([], want, rec)
        sink: list = []
        span = _span(sink)
        if rng.random() < 0.3:
            span.set_attribute("user.key", 3)
            want["user.key"] = 3
        spans.apply_record(span, rec, None, False)
        assert sink == [span]
        assert list(span.attributes.items()) == list(want.items())
        assert list(span.attributes.items()) == list(want.items())  # read again: set once
        assert list(spans.readable(span).attributes.items()) == list(want.items())
