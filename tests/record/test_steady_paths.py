"""The short ways of the hot path against the long ones: a throughput window whose usual steps
leave their rule state pending (``OperationWindow.add``) against one that applies it step by
step, and the ledger's steady steps (``GoodputLedger.post``) against its general path. Random
runs, compared exactly: every data wait, finding, total, window and state."""

from __future__ import annotations

import random

import pytest

from torchtrace.record.goodput import CHECKPOINT, EVALUATION, OTHER, TRAIN, GoodputLedger
from torchtrace.record.throughput import Finding, OperationWindow, RuleSettings

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


def ledger_run(seed: int, n: int = 700) -> list[tuple]:
    """Events for a ledger: ``("post", args)`` with post's 14 arguments, as the step pipeline
    sends them (torchtrace's own time around each step), ``("pause", now)`` and
    ``("replay", start, end)``. Two training operations and others, skipped and excluded
    steps, steps inside an operation (an evaluation pass, an epoch), times out of order,
    overlapping steps, a slow-down and stalls."""
    rng = random.Random(seed)
    t, left, out = 0.5, None, []
    for i in range(n):
        operation, kind = rng.choice([("train_step", TRAIN)] * 30 + [("aux_step", TRAIN), ("eval", EVALUATION),
                                                                     ("save", CHECKPOINT), ("log", OTHER)])
        slow = 3.0 if 250 <= i < 380 else 1.0
        wait = rng.choice([0.0, 0.0005, 0.002, 0.02]) if not 450 <= i < 520 else rng.choice([0.05, 0.001])
        entered = t + wait * rng.choice([0.5, 0.9, 1.0])
        start = entered + rng.choice([0.0, 0.0001])
        end = start + slow * rng.uniform(0.01, 0.012)
        enclosing, holds = None, False
        r = rng.random()
        if r < 0.03:
            start -= 0.005  # overlaps the step before
        elif r < 0.05:
            entered, left = start + 0.001, None  # out of order, or not known
        elif r < 0.07:
            enclosing = (t - rng.choice([0.0, 0.01]), rng.choice(["productive", "evaluation"]))
        elif r < 0.08:
            holds = True
        elif r < 0.09:
            entered = None
        elif r < 0.10:
            out.append(("pause", t + wait / 2))
        elif r < 0.12:
            out.append(("replay", t + wait / 4, t + wait / 3 + rng.choice([0.0, 0.05])))
        device_cycle = rng.choice([None, None, 0.011])
        out.append(("post", (start, end, rng.random() < 0.95, rng.random() < 0.02, rng.choice([8, 8, None]),
                             rng.choice([None, 512]), 10**6, kind, operation, device_cycle, enclosing, holds,
                             entered, left)))
        left = end + rng.choice([0.0, 0.0001, 0.0002, 0.0001, 0.0002])
        t = left if rng.random() < 0.97 else end  # (torchtrace is done with a step before the next one)
    return out


def same_ledger(a: GoodputLedger, b: GoodputLedger, now: float, left: float | None) -> None:
    assert a.closed() == b.closed()
    assert a.snapshot(now, left) == b.snapshot(now, left)
    for operation in ("train_step", "aux_step", "eval", "save", "log"):
        assert a.throughput(operation) == b.throughput(operation)
    assert a.state_dict() == b.state_dict()


@pytest.mark.parametrize("seed", range(6))
def test_steady_steps_book_what_the_general_path_books(seed):
    """``post`` (its short way for the steady steps, pending window state) against ``_post``
    alone with windows that apply every step: the same data waits and findings, step by step,
    and the same totals, throughput and state whenever read."""
    rng = random.Random(seed + 2000)
    fast, general = GoodputLedger(0.0, rules=RULES), GoodputLedger(0.0, rules=RULES)
    general._window = lambda operation: general._windows.setdefault(operation, StepByStep(RULES))
    found, general_steps, posts = [], [], 0
    long_way = fast._post
    fast._post = lambda *args: general_steps.append(args) or long_way(*args)
    for event in ledger_run(seed):
        if event[0] == "pause":
            fast.pause(event[1])
            general.pause(event[1])
        elif event[0] == "replay":
            fast.add_forensics(*event[1:])
            general.add_forensics(*event[1:])
        else:
            args = event[1]
            posts += 1
            got, want = fast.post(*args), general._post(*args)
            assert got == want
            found += [f.kind for f in got[1] if isinstance(f, Finding)]
            if rng.random() < 0.02:
                same_ledger(fast, general, args[1] + 0.001, args[1] + 0.0005)
            if posts == 600:  # a restore (into ledgers that counted already) ends the steady run
                state = general.state_dict()
                fast.load_state_dict(state)
                general.load_state_dict(state)
    assert {"throughput_drop", "data_stall"} <= set(found)
    assert 150 < len(general_steps) < posts - 250  # both ways are exercised
    same_ledger(fast, general, 1e4, None)


def test_own_time_rounded_past_the_gap_is_cut_to_it_on_the_short_way_too():
    """(start - entered) + (left - last) can round past start - last: own_time cuts it there."""
    fast, general = GoodputLedger(0.0, rules=RULES), GoodputLedger(0.0, rules=RULES)
    steps = [(0.1, 0.463, True, False, 8, None, None, TRAIN, "train_step", None, None, False, 0.1, None),
             (1.291, 1.3, True, False, 8, None, None, TRAIN, "train_step", None, None, False, 0.987, 0.987)]
    for args in steps:
        assert fast.post(*args) == general._post(*args)
    assert fast._steady == "train_step"
    same_ledger(fast, general, 2.0, None)
    assert fast.closed().badput["data_wait"] == 0.0
