"""Step entry is short: from entering a step to the first operation of the user's code, at
most 20 µs beyond the same code without torchtrace (median over many steps; the machine this
runs on is shared, so a robust statistic).

A dispatch mode timestamps the first aten operation on a marker tensor, the user's first
operation in the step; the clock starts just before ``debug_context(...)`` is entered. The
bare loop (no step) measures the dispatch mode's own cost, which is subtracted.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchtrace as tt

LIMIT_S = 20e-6


class FirstOp(TorchDispatchMode):
    """The time of the first aten operation on ``marker`` since the mode was armed."""

    def __init__(self, marker: torch.Tensor) -> None:
        super().__init__()
        self.marker = marker
        self.at: float | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.at is None and args and args[0] is self.marker:
            self.at = time.perf_counter()
        return func(*args, **(kwargs or {}))


def _entry_times(enter, steps: int) -> list[float]:
    """Seconds from before ``enter()`` to the user's first operation, one value a step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    marker = torch.zeros(1)
    times = []
    for _ in range(steps):
        watch = FirstOp(marker)
        with watch:
            t0 = time.perf_counter()
            with enter(model, opt):
                marker.add_(1.0)
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
        times.append(watch.at - t0)
    return times


def _bare(model, opt):
    return contextlib.nullcontext()


def _step(model, opt):
    return tt.debug_context("train_step", model=model, optimizer=opt)


@pytest.mark.xfail(strict=False, reason=(
    "issue 52 point 2 is open: on the 2-core container step entry adds 54 us with debug_context and 66 us "
    "with debug_operation (benchmarks/step_entry.py, 2026-11-29, 370 rounds); the OpenTelemetry SDK's own "
    "start_as_current_span adds 33 us in the same run, above this test's 20 us on its own. Where the "
    "context's entry goes: debug_context(...) construction 8.7 us, open_span 8.2, throughput.start 6.7, "
    "GradientCheck.hook 4.8 (a step pre-hook registered and removed every step), probes.enter 2.9"))
def test_step_entry_reaches_the_users_first_operation_within_20_us(tt_runtime):
    _entry_times(_step, 50)  # warm: first-step work (hooks, caches) is not step entry
    bare = statistics.median(_entry_times(_bare, 400))
    step = statistics.median(_entry_times(_step, 400))
    added = step - bare
    assert added <= LIMIT_S, f"step entry adds {added * 1e6:.1f} µs (bare {bare * 1e6:.1f} µs)"


def test_the_timer_sees_a_slow_entry():
    """The timer can fail: an entry that sleeps 1 ms reads as about 1 ms."""

    @contextlib.contextmanager
    def slow(model, opt):
        time.sleep(1e-3)
        yield

    assert statistics.median(_entry_times(slow, 20)) - statistics.median(_entry_times(_bare, 20)) > LIMIT_S
