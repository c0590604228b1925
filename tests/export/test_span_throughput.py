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
