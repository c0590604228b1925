"""The data-wait and phase histograms against a plain count, across the steps that are kept
unbucketed until a scrape (or FOLD_EVERY steps) and those bucketed already."""

from __future__ import annotations

import math
import random

import pytest

from torchtrace import semconv
from torchtrace.export.metrics import Metrics
from torchtrace.export.step_metrics import FOLD_EVERY
from torchtrace.record.step import StepRecord


def _scrape(m: Metrics, family: str) -> dict[tuple, dict[str, float]]:
    """{labels without le: {le or 'sum'/'count': value}} of one histogram family."""
    out: dict[tuple, dict[str, float]] = {}
    for fam in m.registry.collect():
        if fam.name != family:
            continue
        for s in fam.samples:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            slot = s.labels.get("le", s.name.rsplit("_", 1)[-1])
            out.setdefault(key, {})[slot] = s.value
    return out


def _expected(values: list[float]) -> dict[str, float]:
    out = {}
    for bound in semconv.DATA_WAIT_BUCKETS:
        out[repr(float(bound))] = sum(1 for v in values if v <= bound)
    out["+Inf"] = len(values)
    out["count"] = len(values)
    out["sum"] = math.fsum(values)
    return out


@pytest.mark.parametrize("scrape_at", [[], [10], [FOLD_EVERY - 1, FOLD_EVERY + 5], [100]])
def test_wait_and_phase_histograms_hold_every_step(scrape_at):
    rng = random.Random(3)
    m = Metrics("run", 0, "0", "basic")
    waits, phases = [], {p: [] for p in semconv.PHASES}
    n = 2 * FOLD_EVERY + 23
    for i in range(n):
        rec = StepRecord(operation="train_step", step=i, level="basic", start_unix_ns=1, end_unix_ns=2,
                         duration_s=0.01, memory={})
        if i:  # the first step has no data wait
            # exact bucket bounds too: a value equal to a bound belongs to that bound's bucket
            rec.data_wait_s = rng.choice([0.0, rng.uniform(0, 0.003), rng.uniform(0.01, 3.0),
                                          rng.choice(semconv.DATA_WAIT_BUCKETS)])
            waits.append(rec.data_wait_s)
        if i % 7:  # some steps without phases (the forward was not seen)
            rec.phases = {p: rng.uniform(0, 0.2) for p in semconv.PHASES if not (p == "optimizer" and i % 5 == 0)}
            for p, v in rec.phases.items():
                phases[p].append(v)
        m.observe_step(rec)
        if i in scrape_at:
            _scrape(m, semconv.M_DATA_WAIT)
    got = _scrape(m, semconv.M_DATA_WAIT)
    (wait_hist,) = got.values()
    assert wait_hist == pytest.approx(_expected(waits), abs=1e-9)
    by_phase = {dict(k)["phase"]: v for k, v in _scrape(m, semconv.M_STEP_PHASE).items()}
    assert set(by_phase) == set(semconv.PHASES)
    for p in semconv.PHASES:
        assert by_phase[p] == pytest.approx(_expected(phases[p]), abs=1e-9), p


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_batch_of_values_lands_where_each_value_alone_would(seed):
    """``observe_all`` (the folded batch, which starts at the smallest value's bucket and stops
    once every value is placed) against ``observe`` one value at a time: zeros, exact bounds,
    values past the last bound, batches of one and of none."""
    from torchtrace.export.step_metrics import _Histogram

    rng = random.Random(seed)
    bounds = semconv.DATA_WAIT_BUCKETS
    for _ in range(400):
        values = [rng.choice([0.0, rng.choice(bounds), rng.uniform(0, 1e-3), rng.uniform(0, 400.0), 1e9])
                  for _ in range(rng.choice([0, 1, 3, FOLD_EVERY]))]
        batch, one_by_one = _Histogram(bounds), _Histogram(bounds)
        batch.observe_all(values)
        for v in values:
            one_by_one.observe(v)
        assert batch.counts == one_by_one.counts, values
        assert batch.total == pytest.approx(one_by_one.total)
