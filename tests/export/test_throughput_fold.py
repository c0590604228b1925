"""The throughput series kept unfolded until a scrape (or KEEP_STEPS steps) against the one
addition per step they stand for: counters, FLOPs (bit for bit), the last learning rates; and
the data-wait and phase histograms' sums against bucketing FOLD_EVERY steps with either at a
time, and the rest at a scrape (bit for bit too)."""

from __future__ import annotations

import random

import pytest

from torchtrace import semconv
from torchtrace.export.metrics import Metrics
from torchtrace.export.step_metrics import FOLD_EVERY, KEEP_STEPS
from torchtrace.record.step import StepRecord


def _values(m: Metrics) -> dict[tuple, float]:
    wanted = {semconv.M_SAMPLES, semconv.M_TOKENS, semconv.M_FLOPS, semconv.M_LEARNING_RATE,
              semconv.M_DATA_WAIT + "_sum", semconv.M_DATA_WAIT + "_count",
              semconv.M_STEP_PHASE + "_sum", semconv.M_STEP_PHASE + "_count"}
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


class _Histograms:
    """The data-wait and phase sums and counts of one operation, bucketed the step-at-a-time way:
    the steps with either kept, and added FOLD_EVERY of them at a time or at a scrape."""

    def __init__(self) -> None:
        self.pending: list = []
        self.wait: list[float] | None = None  # [sum, count]
        self.phases: dict[str, list[float]] | None = None

    def step(self, r: StepRecord) -> None:
        if r.data_wait_s is not None or r.phases:
            self.pending.append((r.data_wait_s, r.phases))
            if len(self.pending) >= FOLD_EVERY:
                self.fold()

    def fold(self) -> None:
        entries, self.pending = self.pending, []
        waits = [w for w, _ in entries if w is not None]
        if waits:
            self.wait = self.wait or [0.0, 0]
            self.wait[0] += sum(waits)
            self.wait[1] += len(waits)
        runs = [p for _, p in entries if p]
        if runs:
            self.phases = self.phases or {p: [0.0, 0] for p in semconv.PHASES}
            for phase, acc in self.phases.items():
                values = [run[phase] for run in runs if phase in run]
                acc[0] += sum(values)
                acc[1] += len(values)


@pytest.mark.parametrize("seed", range(4))
def test_folded_series_equal_a_step_at_a_time(seed):
    rng = random.Random(seed)
    m = Metrics("run", 0, "0", "basic")
    ops = ["train_step", "eval_step"]
    seen: dict[str, list[StepRecord]] = {op: [] for op in ops}
    hists = {op: _Histograms() for op in ops}
    for i in range(5 * KEEP_STEPS + 11):
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
        if rng.random() < 0.6:  # of all magnitudes: a sum's rounding tells how the values were batched
            rec.data_wait_s = rng.uniform(0, 10.0) * 10.0 ** -rng.randrange(0, 8)
        if rng.random() < 0.6:
            rec.phases = {p: rng.uniform(0, 3.0) * 10.0 ** -rng.randrange(0, 8) for p in semconv.PHASES
                          if rng.random() < 0.9}
        seen[op].append(rec)
        hists[op].step(rec)
        m.observe_step(rec)
        if rng.random() < 0.002 or i in (FOLD_EVERY - 1, KEEP_STEPS + 1):
            _check(m, seen, hists)
    _check(m, seen, hists)


def _check(m: Metrics, seen: dict[str, list[StepRecord]], hists: dict[str, _Histograms]) -> None:
    got = _values(m)
    for op, h in hists.items():  # a scrape buckets what is pending
        h.fold()
        labels = {"run_id": "run", "rank": "0", "operation": op}
        wait = [got.get((semconv.M_DATA_WAIT + end, tuple(sorted(labels.items())))) for end in ("_sum", "_count")]
        assert wait == (h.wait or [None, None])
        for phase in semconv.PHASES:
            key = tuple(sorted({**labels, "phase": phase}.items()))
            sums = [got.get((semconv.M_STEP_PHASE + end, key)) for end in ("_sum", "_count")]
            assert sums == (h.phases[phase] if h.phases else [None, None]), phase
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
