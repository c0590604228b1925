"""Throughput windows and the goodput ledger over long random runs: what they find does not
depend on when they are read, saved or restored. Random runs, compared exactly: every data
wait, finding, total, window and state."""

from __future__ import annotations

import random

import pytest

from torchtrace.record.goodput import CHECKPOINT, EVALUATION, OTHER, TRAIN, FinishedStep, GoodputLedger
from torchtrace.record.throughput import Finding, OperationWindow, RuleSettings

RULES = RuleSettings(window=5, warmup_steps=3, min_baseline_windows=2, stall_window=6, stall_min_steps=4)


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
def test_a_window_read_and_restored_midway_finds_what_one_left_alone_finds(seed):
    rng = random.Random(seed + 1000)
    settings = RULES if seed % 2 else RuleSettings(window=7, warmup_steps=0, min_baseline_windows=1, stall_window=3,
                                                   stall_min_steps=2, stall_min_wait_s=0.0)
    read, alone = OperationWindow(settings), OperationWindow(settings)
    found = []
    for i, step in enumerate(window_steps(seed)):
        got, want = read.add(*step), alone.add(*step)
        assert got == want, f"step {i}"
        found += [f.kind for f in got]
        if rng.random() < 0.03:  # a read changes nothing
            same_window(read, alone)
        if rng.random() < 0.01:  # a restart from a saved state
            restored = OperationWindow(settings)
            restored.load_state_dict(read.state_dict())
            read = restored
    assert {"throughput_drop", "data_stall"} <= set(found)  # both rules are exercised
    same_window(read, alone)


def ledger_run(seed: int, n: int = 700) -> list[tuple]:
    """Events for a ledger: ``("step", FinishedStep)``, as the step pipeline
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
        out.append(("step", FinishedStep(start, end, rng.random() < 0.95, rng.random() < 0.02,
                                          rng.choice([8, 8, None]), rng.choice([None, 512]), 10**6, kind, operation,
                                          enclosing, holds, entered, left, device_cycle)))
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
def test_a_ledger_read_at_random_points_books_what_one_never_read_books(seed):
    """Steps as the step pipeline sends them (torchtrace's own time around each, nested steps,
    pauses, replays): the same data waits and findings, step by step, and the same totals,
    throughput and state whenever read; a restore into both ends with the same state."""
    rng = random.Random(seed + 2000)
    read, alone = GoodputLedger(0.0, rules=RULES), GoodputLedger(0.0, rules=RULES)
    found, steps = [], 0
    for event in ledger_run(seed):
        if event[0] == "pause":
            read.pause(event[1])
            alone.pause(event[1])
        elif event[0] == "replay":
            read.add_forensics(*event[1:])
            alone.add_forensics(*event[1:])
        else:
            step = event[1]
            steps += 1
            got, want = read.add_step(step), alone.add_step(step)
            assert got == want
            found += [f.kind for f in got.findings if isinstance(f, Finding)]
            if rng.random() < 0.02:
                same_ledger(read, alone, step.end + 0.001, step.end + 0.0005)
            if steps == 600:  # a restore into ledgers that counted already
                state = alone.state_dict()
                read.load_state_dict(state)
                alone.load_state_dict(state)
    assert {"throughput_drop", "data_stall"} <= set(found)
    same_ledger(read, alone, 1e4, None)


def test_own_time_rounded_past_the_gap_is_cut_to_it():
    """(start - entered) + (left - last) can round past start - last: the step's data wait is
    then 0.0, never negative, and the gap is torchtrace's own time (other)."""
    ledger = GoodputLedger(0.0, rules=RULES)
    ledger.add_step(FinishedStep(0.1, 0.463, samples=8, entered=0.1))
    account = ledger.add_step(FinishedStep(1.291, 1.3, samples=8, entered=0.987, left=0.987))
    assert account.data_wait_s == 0.0
    assert ledger.closed().badput["data_wait"] == 0.0
    assert ledger.closed().badput["other"] == pytest.approx(1.291 - 0.463, abs=1e-12)
