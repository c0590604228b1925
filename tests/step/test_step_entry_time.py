"""Step entry is short: from entering a step to the first operation of the user's code, at
most 20 µs beyond the same code without torchtrace (median over many steps; the machine this
runs on is shared, so a robust statistic).

The timer is ``benchmarks/step_entry.py``'s: a dispatch mode timestamps the first aten
operation on a marker tensor, the user's first operation in the step; the clock starts just
before ``debug_context(...)`` is called. The bare step (a block without torchtrace) measures the
dispatch mode's own cost, which is subtracted. The benchmark compares the same with the
OpenTelemetry SDK's span in one run.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import pytest

from tests.benchmarks import load

LIMIT_S = 20e-6
bench = load("step_entry")


def _median_entry(runner, steps: int) -> float:
    return statistics.median(runner() for _ in range(steps))


@pytest.mark.xfail(strict=False, reason=(
    "issue 52 point 2 is open: on the 2-core container step entry adds 29 us with debug_context and 35 us "
    "with debug_operation (benchmarks/step_entry.py, 2026-11-30 session 32, 3 runs against 33 and 40 us at "
    "dafae9f before the step span's ids were drawn when first read); the OpenTelemetry SDK's own "
    "start_as_current_span adds 23 us in the same runs. Each part stubbed alone saves: throughput.start 5 us, "
    "the gradient check's hook 2.7, the argument checks 2.2, probes.enter 2.1; those four and the span stubbed "
    "at once, entry still adds 17 us"))
def test_step_entry_reaches_the_users_first_operation_within_20_us(tt_runtime):
    toy = bench.Toy()
    bare, step = bench.entry_runner("bare", toy), bench.entry_runner("context", toy)
    _median_entry(step, 50)  # warm: first-step work (hooks, caches) is not step entry
    added = _median_entry(step, 400) - _median_entry(bare, 400)
    assert added <= LIMIT_S, f"step entry adds {added * 1e6:.1f} µs"


def test_the_timer_sees_a_slow_entry():
    """The timer can fail: an entry that sleeps 1 ms reads as about 1 ms."""

    @contextlib.contextmanager
    def slow():
        time.sleep(1e-3)
        yield

    toy = bench.Toy()
    slow_step = bench.timed(toy, bench.in_block(toy, slow))
    assert _median_entry(slow_step, 20) - _median_entry(bench.entry_runner("bare", toy), 20) > LIMIT_S
