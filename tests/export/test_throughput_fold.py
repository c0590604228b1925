"""The throughput series kept unfolded until a scrape (or FOLD_EVERY steps) against the one
addition per step they stand for: counters, FLOPs (bit for bit), the last learning rates."""

from __future__ import annotations

import random

import pytest

from torchtrace import semconv
from torchtrace.export.metrics import Metrics
from torchtrace.export.step_metrics import FOLD_EVERY
from torchtrace.record.step import StepRecord


def _values(m: Metrics) -> dict[tuple, float]:
    wanted = {semconv.M_SAMPLES, semconv.M_TOKENS, semconv.M_FLOPS, semconv.M_LEARNING_RATE}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in m.registry.collect() for s in fam.samples if s.name in wanted}


def _reference(records: list[StepRecord]) -> dict[str, object]:
    """What each series holds after ``records``, a step at a time (the step metrics' old way)."""
    samples = tokens = flops = lr = None
    for r in records:
        if r.samples is not None:
            samples = (samples or 0) + r.samples
        if r.tokens is not None:
            tokens = (tokens or 0) + r.tokens
        if r.flops is not None:
            flops = (flops or 0.0) + r.flops
        if r.lr:
            lr = r.lr
    return {"samples": samples, "tokens": tokens, "flops": flops, "lr": lr}


@pytest.mark.parametrize("seed", range(4))
def test_folded_series_equal_a_step_at_a_time(seed):
    rng = random.Random(seed)
    m = Metrics("run", 0, "0", "basic")
    ops = ["train_step", "eval_step"]
    seen: dict[str, list[StepRecord]] = {op: [] for op in ops}
    for i in range(3 * FOLD_EVERY + 11):
        op = rng.choice(ops)
        rec = StepRecord(operation=op, step=i, level="basic", start_unix_ns=1, end_unix_ns=2, duration_s=0.01,
                         memory={})
        if rng.random() < 0.8:
            rec.samples = rng.randrange(0, 64)
        if rng.random() < 0.3:
            rec.tokens = rng.randrange(0, 4096)
        if rng.random() < 0.7:
            rec.flops = rng.choice([rng.uniform(0, 1e12), 0.1, 1e-3, 3, 0.0])
        rec.lr = rng.choice([None, [], [rng.random()], [rng.random(), rng.random()]])
        if rng.random() < 0.2:
            rec.data_wait_s = rng.uniform(0, 0.01)
        seen[op].append(rec)
        m.observe_step(rec)
        if rng.random() < 0.05 or i == FOLD_EVERY - 1:
            _check(m, seen)
    _check(m, seen)


def _check(m: Metrics, seen: dict[str, list[StepRecord]]) -> None:
    got = _values(m)
    for op, records in seen.items():
        want = _reference(records)
        labels = {"run_id": "run", "rank": "0", "operation": op}

        def value(name: str, **more: str) -> float | None:
            return got.get((name, tuple(sorted({**labels, **more}.items()))))

        assert value(semconv.M_SAMPLES) == want["samples"]
        assert value(semconv.M_TOKENS) == want["tokens"]
        flops = value(semconv.M_FLOPS)
        assert (flops is None) == (want["flops"] is None)
        if flops is not None:
            assert flops == want["flops"]  # the same additions in the same order: bit for bit
        rates = want["lr"] or []
        for i, rate in enumerate(rates):
            assert value(semconv.M_LEARNING_RATE, group=str(i)) == rate
        assert value(semconv.M_LEARNING_RATE, group=str(len(rates))) is None
