"""The short ways of the hot path against the long ones: a throughput window whose usual steps
leave their rule state pending (``OperationWindow.add``) against one that applies it step by
step. Random runs, compared exactly: every finding, window and state."""

from __future__ import annotations

import random

import pytest

from torchtrace.record.throughput import OperationWindow, RuleSettings

RULES = RuleSettings(window=5, warmup_steps=3, min_baseline_windows=2, stall_window=6, stall_min_steps=4)


class StepByStep(OperationWindow):
    """The reference: each step's rule state applied as it comes (a plain loop, no pending steps)."""

    def add(self, duration, wait, samples, tokens, flops, rules=True, device_cycle=None):
        duration, wait = max(duration, 0.0), max(wait, 0.0)
        cycle = duration + wait
        rated = device_cycle if device_cycle is not None and device_cycle > 0.0 else cycle
        self.entries.append((rated, wait, samples, tokens, flops, cycle))
        self.seen += 1
        if not rules:
            return ()
        s, found = self.settings, []
        if self.seen > s.warmup_steps and rated > 0:
            if self.unit is None:
                self.unit = "tokens" if tokens is not None else "samples" if samples is not None else "steps"
            amount = {"tokens": tokens, "samples": samples, "steps": 1}[self.unit]
            if amount is not None:
                self.rates.append(amount / rated)
                if len(self.rates) >= s.window:
                    found.append(self._judge_window())
        waited = cycle > 0 and (wait > s.stall_share * cycle and wait >= s.stall_min_wait_s or wait > s.stall_seconds)
        self.waited.append(waited)
        if waited and len(self.waited) >= s.stall_window:
            found.append(self._stall())
        return tuple(f for f in found if f is not None)

    def _settle(self, until: int) -> None:
        pass  # nothing is ever pending


def window_steps(seed: int, n: int = 400) -> list[tuple]:
    """``add``'s arguments: a slow-down, loader stalls, waits around the stall thresholds,
    steps without a batch or a positive cycle, device cycles, steps without rules."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        slow = 2.5 if 150 <= i < 260 else 1.0
        duration = rng.choice([slow * rng.uniform(0.01, 0.012)] * 12 + [0.0, -0.001])
        wait = rng.choice([0.0, 0.001, 0.009, 0.011, 0.02] + ([0.05] * 8 if 300 <= i < 340 else []) + [6.0, -0.1])
        samples = rng.choice([8] * 10 + [None])
        tokens = rng.choice([None] * 6 + [512] * 3 + [0])
        device_cycle = rng.choice([None] * 6 + [slow * 0.011, 0.0, -1.0])
        out.append((duration, wait, samples, tokens, 10**6, rng.random() < 0.93, device_cycle))
    return out


def same_window(a: OperationWindow, b: OperationWindow) -> None:
    assert a.state_dict() == b.state_dict()
    assert a.throughput(1e9) == b.throughput(1e9)


@pytest.mark.parametrize("seed", range(6))
def test_pending_rule_state_finds_what_step_by_step_finds(seed):
    rng = random.Random(seed + 1000)
    settings = RULES if seed % 2 else RuleSettings(window=7, warmup_steps=0, min_baseline_windows=1, stall_window=3,
                                                   stall_min_steps=2, stall_min_wait_s=0.0)
    lazy, eager = OperationWindow(settings), StepByStep(settings)
    found = []
    for i, step in enumerate(window_steps(seed)):
        got, want = lazy.add(*step), eager.add(*step)
        assert got == want, f"step {i}"
        found += [f.kind for f in got]
        if rng.random() < 0.03:  # a read settles what is pending: nothing changes
            same_window(lazy, eager)
        if rng.random() < 0.01:  # a restart from a saved state
            state = eager.state_dict()
            lazy, eager = OperationWindow(settings), StepByStep(settings)
            lazy.load_state_dict(state)
            eager.load_state_dict(state)
    assert {"throughput_drop", "data_stall"} <= set(found)  # both rules are exercised
    same_window(lazy, eager)
