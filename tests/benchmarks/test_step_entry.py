"""benchmarks/step_entry.py: every variant's entry is timed from real steps, and the table pairs
the variants with the bare step and the OpenTelemetry span within rounds."""

from __future__ import annotations

import statistics

import pytest

from tests.benchmarks import load


@pytest.mark.usefixtures("tt_runtime")
def test_each_variant_times_real_steps_and_torchtrace_reaches_the_first_operation_later():
    bench = load("step_entry")
    medians = bench.run(seconds=0.0, steps=3)
    assert set(medians) == set(bench.VARIANTS)
    assert all(len(rounds) >= 5 for rounds in medians.values())  # the least number of rounds
    assert all(0 < entry < 0.1 for rounds in medians.values() for entry in rounds)
    # torchtrace opens a span, hooks the optimizer and starts its probes before the body runs.
    bare = statistics.median(medians["bare"])
    assert statistics.median(medians["context"]) > bare
    assert statistics.median(medians["operation"]) > bare


def test_the_table_pairs_within_rounds():
    bench = load("step_entry")
    medians = {"bare": [10e-6, 20e-6, 10e-6], "otel": [40e-6, 50e-6, 40e-6],
               "context": [60e-6, 70e-6, 60e-6], "operation": [70e-6, 80e-6, 70e-6]}
    text = bench.table(medians)
    context = next(line for line in text.splitlines() if line.startswith("context"))
    # +bare: 50 in every round; -otel: 20 in every round (pairing keeps the shared drift out).
    assert "+50.0" in context and "[+50.0, +50.0]" in context
    assert "+20.0" in context and "[+20.0, +20.0]" in context
