"""GoodputLedger: the timeline partition against a hand-computed timeline and a tick-by-tick sweep."""

from __future__ import annotations

import json
import random

import pytest

from torchtrace import semconv
from torchtrace.record.goodput import (
    CHECKPOINT,
    EVALUATION,
    OTHER,
    TRAIN,
    FinishedStep,
    Goodput,
    GoodputLedger,
)
from torchtrace.record.throughput import RuleSettings

approx = pytest.approx


def total(g: Goodput) -> float:
    return g.productive_s + sum(g.badput.values())


def test_hand_computed_timeline_with_a_skipped_step_a_slow_loader_and_a_replay():
    ledger = GoodputLedger(configured_at=0.0)
    waits = [
        ledger.add_step(FinishedStep(5.0, 6.0)).data_wait_s,  # startup 5 s, then productive 1
        ledger.add_step(FinishedStep(6.2, 7.2)).data_wait_s,  # loader 0.2 s
        ledger.add_step(FinishedStep(9.2, 10.2, applied=False)).data_wait_s,  # slow loader 2 s; skipped step 1 s
    ]
    ledger.add_forensics(10.3, 10.8)  # the skipped step's replay, between steps
    waits += [
        ledger.add_step(FinishedStep(11.0, 12.0)).data_wait_s,  # gap 0.8 s = replay 0.5 + wait 0.3
        ledger.add_step(FinishedStep(12.5, 14.5, kind=EVALUATION, operation="eval")).data_wait_s,
        ledger.add_step(FinishedStep(14.5, 15.5, kind=CHECKPOINT, operation="save")).data_wait_s,
        ledger.add_step(FinishedStep(16.0, 17.0)).data_wait_s,
    ]
    assert waits == [None, approx(0.2), approx(2.0), approx(0.8), approx(0.5), approx(0.0), approx(0.5)]
    closed = ledger.closed()
    assert closed.wall_s == approx(17.0) and closed.productive_s == approx(4.0)
    assert closed.badput == approx({"startup": 5.0, "data_wait": 0.2 + 2.0 + 0.3 + 0.5 + 0.5, "skipped_step": 1.0,
                                    "forensics": 0.5, "checkpoint": 1.0, "evaluation": 2.0, "other": 0.0})
    now = ledger.snapshot(now=18.0)  # one more second since the last step: data wait so far
    assert now.wall_s == approx(18.0) and now.badput["data_wait"] == approx(4.5)
    assert now.ratio == approx(4.0 / 18.0)
    assert total(now) == approx(now.wall_s, abs=1e-12) and total(closed) == approx(closed.wall_s, abs=1e-12)
    assert set(now.badput) == set(semconv.BADPUT_KINDS)
    assert ledger.closed() == closed  # a snapshot changes nothing


def test_a_pause_is_no_class_and_no_wall_time():
    """Measuring stops at 3.5 (level off) and the next measured step starts at 100: the half
    second before the pause is data wait as usual; 3.5-100 is not counted anywhere, the step
    after it has no data wait, and the snapshot does not decay while paused. Hand-computed."""
    ledger = GoodputLedger(configured_at=0.0)
    ledger.add_step(FinishedStep(1.0, 2.0))
    ledger.add_step(FinishedStep(2.5, 3.0))
    ledger.pause(3.5)
    during = [ledger.snapshot(now=t) for t in (10.0, 60.0)]
    assert during[0] == during[1]
    assert during[0].wall_s == approx(3.5) and during[0].badput["data_wait"] == approx(1.0)
    assert ledger.add_step(FinishedStep(100.0, 101.0)).data_wait_s is None
    assert ledger.add_step(FinishedStep(101.5, 102.0)).data_wait_s == approx(0.5)
    g = ledger.closed()
    assert g.productive_s == approx(3.0) and g.wall_s == approx(3.5 + 2.0)
    assert g.badput["startup"] == approx(1.0) and g.badput["data_wait"] == approx(0.5 + 0.5 + 0.5)
    assert total(g) == approx(g.wall_s, abs=1e-12)
    ledger.pause(103.0)
    ledger.pause(150.0)  # a second pause changes nothing
    assert ledger.snapshot(now=200.0).wall_s == approx(g.wall_s + 1.0)


def test_the_time_after_the_last_step_until_shutdown_is_other_not_data_wait():
    """Data wait runs from one step's end to the next one's start: after the last step no step
    follows, so the stretch up to shutdown (saving the model, a demo's page kept open) is
    other. Hand-computed; the snapshot said data wait while a next step could still come."""
    ledger = GoodputLedger(configured_at=0.0)
    ledger.add_step(FinishedStep(1.0, 2.0))
    ledger.add_step(FinishedStep(2.5, 3.0))
    assert ledger.snapshot(now=9.0).badput["data_wait"] == approx(0.5 + 6.0)  # (while the run goes on)
    ledger.pause(10.0, last=True)
    for g in (ledger.snapshot(now=12.0), ledger.closed()):
        assert g.wall_s == approx(10.0) and g.productive_s == approx(1.5)
        assert g.badput["startup"] == approx(1.0) and g.badput["data_wait"] == approx(0.5)
        assert g.badput["other"] == approx(7.0) and total(g) == approx(g.wall_s, abs=1e-12)
    # Measuring stopped earlier (level off at 4.0), then the run ended: 3.0-4.0 is other, the rest in no class.
    ledger = GoodputLedger(configured_at=0.0)
    ledger.add_step(FinishedStep(1.0, 3.0))
    ledger.pause(4.0)
    ledger.pause(50.0, last=True)
    g = ledger.snapshot(now=60.0)
    assert g.wall_s == approx(4.0) and g.badput["other"] == approx(1.0) and g.badput["data_wait"] == 0.0
    # A replay between the last step and shutdown stays forensics; no step at all: startup to the end.
    ledger = GoodputLedger(configured_at=0.0)
    ledger.add_step(FinishedStep(1.0, 2.0))
    ledger.add_forensics(2.5, 3.5)
    ledger.pause(5.0, last=True)
    assert ledger.closed().badput == approx({"startup": 1.0, "data_wait": 0.0, "skipped_step": 0.0, "forensics": 1.0,
                                             "checkpoint": 0.0, "evaluation": 0.0, "other": 2.0})
    ledger = GoodputLedger(configured_at=0.0)
    ledger.pause(5.0, last=True)
    assert ledger.snapshot(now=8.0).badput["startup"] == approx(5.0) and ledger.snapshot(now=8.0).wall_s == approx(5.0)


def test_a_pause_before_the_first_step_keeps_the_startup_before_it():
    ledger = GoodputLedger(configured_at=0.0)
    ledger.pause(2.0)  # configured at level off; turned on much later
    ledger.add_step(FinishedStep(50.0, 51.0))
    g = ledger.closed()
    assert g.badput["startup"] == approx(2.0) and g.productive_s == approx(1.0) and g.wall_s == approx(3.0)


def test_before_the_first_step_everything_is_startup():
    ledger = GoodputLedger(configured_at=10.0)
    g = ledger.snapshot(now=12.5)
    assert g.badput["startup"] == 2.5 and g.productive_s == 0.0 and g.ratio == 0.0
    assert ledger.closed().wall_s == 0.0 and ledger.closed().ratio is None


def test_other_operations_and_nested_steps():
    ledger = GoodputLedger(configured_at=0.0)
    ledger.add_step(FinishedStep(1.0, 2.0, kind=OTHER, operation="log"))
    ledger.add_step(FinishedStep(3.0, 4.0, operation="inner"))  # nested in the next one
    ledger.add_step(FinishedStep(2.5, 6.0, kind=EVALUATION, operation="outer"))
    g = ledger.closed()
    # [2, 2.5] wait; [2.5, 3] belongs to no finished step yet when counted: data wait;
    # [3, 4] inner; [4, 6] outer's remainder. Nothing counted twice.
    assert g.badput["other"] == 1.0 and g.badput["data_wait"] == approx(1.0) and g.productive_s == 1.0
    assert g.badput["evaluation"] == approx(2.0) and g.wall_s == 6.0 and total(g) == approx(6.0)


def test_a_replay_reported_late_is_taken_from_the_next_instants():
    ledger = GoodputLedger(configured_at=0.0)
    ledger.add_step(FinishedStep(0.0, 4.0, applied=False))
    ledger.add_forensics(1.0, 3.0)  # inside the step already counted as skipped
    before = ledger.closed()
    assert before.badput["forensics"] == 0.0 and before.badput["skipped_step"] == 4.0
    ledger.add_step(FinishedStep(4.5, 7.0))  # 0.5 s wait then 2.5 s productive: 2 s repaid from them
    g = ledger.closed()
    assert g.badput["forensics"] == approx(2.0) and total(g) == approx(g.wall_s)
    assert g.badput["skipped_step"] == 4.0  # counts never go down
    assert g.badput["data_wait"] + g.productive_s == approx(1.0)


def test_replay_inside_a_step_reported_before_the_step_ends():
    ledger = GoodputLedger(configured_at=0.0)
    ledger.add_forensics(2.0, 3.0)
    ledger.add_step(FinishedStep(1.0, 4.0, applied=False))
    g = ledger.closed()
    assert g.badput == approx({"startup": 1.0, "data_wait": 0.0, "skipped_step": 2.0, "forensics": 1.0,
                               "checkpoint": 0.0, "evaluation": 0.0, "other": 0.0})


def sweep(configured: int, steps: list[tuple[int, int, str]], replays: list[tuple[int, int]], now: int) -> dict:
    """The reference: classify each tick of [configured, now) in a plain loop."""
    counts = {k: 0 for k in ("productive", *semconv.BADPUT_KINDS)}
    first = min(s for s, _, _ in steps)
    for tick in range(configured, now):
        if any(a <= tick < b for a, b in replays):
            counts["forensics"] += 1
        elif (cls := next((c for a, b, c in steps if a <= tick < b), None)) is not None:
            counts[cls] += 1
        else:
            counts["startup" if tick < first else "data_wait"] += 1
    return counts


@pytest.mark.parametrize("seed", range(25))
def test_random_timelines_against_a_tick_by_tick_sweep(seed):
    rng = random.Random(seed)
    t, steps, events = rng.randrange(0, 50), [], []
    configured = rng.randrange(0, t + 1)
    for _ in range(rng.randrange(1, 40)):
        t += rng.randrange(0, 20)  # wait
        start, t = t, t + rng.randrange(1, 30)
        kind = rng.choice([TRAIN, TRAIN, TRAIN, CHECKPOINT, EVALUATION, OTHER])
        applied = rng.random() < 0.8
        cls = ("productive" if applied else "skipped_step") if kind == TRAIN else kind
        replay = None
        if rng.random() < 0.2 and t - start >= 2:  # a replay inside the step, reported before it ends
            a = rng.randrange(start, t - 1)
            replay = (a, rng.randrange(a + 1, t))
            events.append(("replay", replay))
        steps.append((start, t, cls))
        events.append(("step", FinishedStep(start, t, applied=applied, kind=kind, operation=kind)))
        if rng.random() < 0.2:  # a replay after the step, before the next one starts
            a = t + rng.randrange(0, 3)
            replay = (a, a + rng.randrange(1, 5))
            events.append(("replay", replay))
            t = replay[1] + rng.randrange(0, 3)
    replays = [e[1] for e in events if e[0] == "replay"]
    ledger = GoodputLedger(configured_at=configured)
    for kind, event in events:
        ledger.add_step(event) if kind == "step" else ledger.add_forensics(*event)
    now = t + rng.randrange(0, 10)
    expected = sweep(configured, steps, replays, now)
    g = ledger.snapshot(now=now)
    assert g.productive_s == approx(expected.pop("productive"), abs=1e-9)
    assert g.badput == approx(expected, abs=1e-9)
    assert g.wall_s == now - configured and total(g) == approx(g.wall_s, abs=1e-9)


def test_closed_counts_only_grow_while_steps_arrive():
    rng = random.Random(7)
    ledger = GoodputLedger(configured_at=0.0)
    t, last = 0.0, ledger.closed()
    for i in range(300):
        t += rng.expovariate(20)
        start, t = t, t + rng.expovariate(10)
        ledger.add_step(FinishedStep(start, t, applied=rng.random() < 0.9, kind=rng.choice([TRAIN, EVALUATION])))
        if i % 17 == 0:
            ledger.add_forensics(t - 0.01 * rng.random(), t + 0.02)  # partly late
        g = ledger.closed()
        assert g.productive_s >= last.productive_s
        assert all(g.badput[k] >= last.badput[k] - 1e-12 for k in g.badput)
        assert total(g) == approx(g.wall_s, abs=1e-9)
        last = g


def test_peaks_by_operation_and_a_configured_peak_over_a_restored_one():
    ledger = GoodputLedger(configured_at=0.0)
    for i in range(4):
        ledger.add_step(FinishedStep(1.0 + i, 1.5 + i, flops=10**9, operation="train_step"))
        ledger.add_step(FinishedStep(1.6 + i, 1.8 + i, flops=10**8, kind="evaluation", operation="evaluate"))
    ledger.set_peak("train_step", 4e9)
    ledger.set_peak("evaluate", 1e9)
    train, evaluate = ledger.throughput("train_step"), ledger.throughput("evaluate")
    assert train.mfu == approx(train.flops_per_s / 4e9) and evaluate.mfu == approx(evaluate.flops_per_s / 1e9)
    saved = {**ledger.state_dict(), "peak_flops": 2e9}  # as a run configured with peak_flops=2e9 saves it
    assert GoodputLedger(configured_at=0.0, peak_flops=3e9).peak_of("evaluate") == 3e9
    configured = GoodputLedger(configured_at=0.0, peak_flops=3e9)
    configured.load_state_dict(saved)
    assert configured.peak_of("train_step") == 3e9  # this process's configuration wins
    restored = GoodputLedger(configured_at=0.0)
    restored.load_state_dict(saved)
    assert restored.peak_of("train_step") == 2e9
    assert GoodputLedger(configured_at=0.0).peak_of("train_step") is None


def test_state_round_trip_restores_totals_and_baselines():
    rules = RuleSettings(window=5, warmup_steps=0, min_baseline_windows=2, baseline_windows=4)
    one = GoodputLedger(configured_at=0.0, peak_flops=1e6, rules=rules)
    t = 1.0
    for _ in range(30):
        one.add_step(FinishedStep(t, t + 0.1, samples=8, tokens=256, flops=10_000))
        t += 0.12
    last_end = t - 0.02
    one.add_forensics(t - 0.05, t + 0.01)  # partly counted already (a debt), partly still to come
    state = json.loads(json.dumps(one.state_dict()))  # JSON-able
    two = GoodputLedger(configured_at=last_end, rules=RuleSettings())  # a new process, resumed at once
    two.load_state_dict(state)
    assert two.closed() == one.closed() and two.rules == rules and two.peak_flops == 1e6
    assert two.throughput("train_step") == one.throughput("train_step")
    # the same steps from here on: the same findings, the same windows, the same totals
    fresh = GoodputLedger(configured_at=last_end, rules=rules)
    found = {}
    for name, ledger in (("one", one), ("two", two), ("fresh", fresh)):
        s, found[name] = t, []
        for i in range(12):
            step = FinishedStep(s, s + (0.1 if i < 2 else 0.3), samples=8, tokens=256, flops=10_000)
            found[name] += [(i, f.kind) for f in ledger.add_step(step).findings]
            s = step.end + 0.02
    assert found["one"] == found["two"] == [(9, "throughput_drop")]  # the second low window in a row
    assert found["fresh"] == []  # without the restored baseline the drop is not seen
    assert one.throughput("train_step") == two.throughput("train_step")
    a, b = one.closed(), two.closed()
    assert b.wall_s == approx(a.wall_s) and b.productive_s == approx(a.productive_s)
    assert b.badput["forensics"] == approx(a.badput["forensics"]) == approx(0.06)


def test_a_state_saved_before_window_entries_kept_the_host_cycle_loads():
    """Checkpoints written before a window entry held its host cycle (a sixth field, for GPU
    steps whose rates use device time) load with the cycle as the host's."""
    one = GoodputLedger(configured_at=0.0, rules=RuleSettings(window=5))
    t = 1.0
    for _ in range(8):
        one.add_step(FinishedStep(t, t + 0.1, samples=8))
        t += 0.15
    state = json.loads(json.dumps(one.state_dict()))
    windows = [w for w in _dicts_with(state, "entries")]
    assert windows and all(len(e) == 6 for w in windows for e in w["entries"])
    for w in windows:
        w["entries"] = [e[:5] for e in w["entries"]]
    two = GoodputLedger(configured_at=t, rules=RuleSettings(window=5))
    two.load_state_dict(state)
    assert two.throughput("train_step") == one.throughput("train_step")


def _dicts_with(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            yield obj
        for v in obj.values():
            yield from _dicts_with(v, key)
    elif isinstance(obj, list):
        for v in obj:
            yield from _dicts_with(v, key)


def test_loading_into_a_ledger_that_already_counted_keeps_every_second():
    saved = GoodputLedger(configured_at=0.0)
    saved.add_step(FinishedStep(2.0, 5.0))
    ledger = GoodputLedger(configured_at=100.0)
    ledger.add_step(FinishedStep(101.0, 104.0, applied=False))
    ledger.load_state_dict(saved.state_dict())
    g = ledger.snapshot(now=106.0)
    assert g.wall_s == 5.0 + 6.0 and total(g) == approx(g.wall_s)
    assert (g.productive_s, g.badput["startup"], g.badput["skipped_step"], g.badput["data_wait"]) == (3.0, 3.0, 3.0, 2.0)


def test_bad_state_and_bad_kind_are_refused():
    ledger = GoodputLedger(configured_at=0.0)
    with pytest.raises(ValueError, match="version"):
        ledger.load_state_dict({"version": 99})
    with pytest.raises(ValueError, match="kind='training'.*train, checkpoint, evaluation, other"):
        ledger.add_step(FinishedStep(1.0, 2.0, kind="training"))


@pytest.mark.parametrize("module", ["torchtrace.record.goodput", "torchtrace.record.goodput_types",
                                    "torchtrace.record.throughput"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


def _random_run(seed: int, n: int = 600) -> list[tuple]:
    """Steps of two training operations and an evaluation, with a slow-down, loader stalls,
    overlaps and steps left out of throughput: ``(start, end, applied, excluded, samples,
    tokens, flops, kind, operation)``."""
    rng = random.Random(seed)
    t, out = 0.5, []
    for i in range(n):
        operation, kind = rng.choice([("train_step", TRAIN)] * 6 + [("aux_step", TRAIN), ("eval", EVALUATION)])
        slow = 3.0 if 200 <= i < 320 else 1.0
        wait = rng.choice([0.0, 0.001, 0.002]) if not 400 <= i < 460 else rng.choice([0.05, 0.001])
        start = t + wait
        end = start + slow * rng.uniform(0.01, 0.012)
        if rng.random() < 0.02:
            start -= 0.005  # overlaps the step before
        out.append((start, end, rng.random() < 0.95, rng.random() < 0.01, 8, rng.choice([None, 512]),
                    10**6, kind, operation))
        t = end
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reads_between_steps_change_nothing_they_find(seed):
    """A ledger read (a scrape: ``snapshot``) at random points between its steps finds what a
    ledger that is never read finds: the same findings on the same steps, the same data waits,
    totals and windows."""
    rules = RuleSettings(window=5, warmup_steps=3, min_baseline_windows=2, stall_window=6, stall_min_steps=4)
    at_once, posted = GoodputLedger(0.0, rules=rules), GoodputLedger(0.0, rules=rules)
    rng = random.Random(seed + 100)
    expect, got = [], []
    for i, step in enumerate(_random_run(seed)):
        a = at_once.add_step(FinishedStep(*step))
        expect.append((a.data_wait_s, [f.kind for f in a.findings]))
        wait, findings = posted.add_step(FinishedStep(*step))
        got.append((wait, [f.kind for f in findings]))
        if rng.random() < 0.05:
            posted.snapshot(step[1] + 0.001)
    kinds = [k for _, found in expect for k in found]
    assert semconv.THROUGHPUT_DROP in kinds and semconv.DATA_STALL in kinds  # the run exercises both rules
    assert got == expect
    assert posted.closed() == at_once.closed()
    for operation in ("train_step", "aux_step", "eval"):
        assert posted.throughput(operation) == at_once.throughput(operation)
    assert posted.state_dict() == at_once.state_dict()


def test_posted_steps_with_a_scraping_thread_lose_nothing():
    """A scrape on another thread reads the ledger while the step thread posts: every finding
    still comes back with its own step, and the totals match a ledger that is never read."""
    import threading

    rules = RuleSettings(window=5, warmup_steps=3, min_baseline_windows=2, stall_window=6, stall_min_steps=4)
    at_once, posted = GoodputLedger(0.0, rules=rules), GoodputLedger(0.0, rules=rules)
    run = _random_run(7, n=3000)
    expect = [[f.kind for f in at_once.add_step(FinishedStep(*step)).findings] for step in run]
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            posted.snapshot(1e9)
            posted.throughput("train_step")

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        got = [[f.kind for f in posted.add_step(FinishedStep(*step)).findings] for step in run]
    finally:
        stop.set()
        scraper.join()
    assert sum(map(len, expect)) >= 5
    assert got == expect
    assert posted.closed() == at_once.closed()


def test_time_inside_an_operation_that_no_step_inside_covers_is_that_operations():
    """Hand-computed: an evaluation pass from 10 to 20 holds two evaluation steps (12-13,
    15-16) and loads between them; an epoch from 20 to 40 holds two training steps (22-25,
    28-31) and then validates until 40 without a step; a training step from 40 to 50 holds
    a loss function decorated on its own (43-44)."""
    ledger = GoodputLedger(configured_at=0.0)
    ledger.add_step(FinishedStep(5.0, 8.0))
    evaluation = (10.0, "evaluation")
    ledger.add_step(FinishedStep(12.0, 13.0, kind=EVALUATION, operation="eval_step", enclosing=evaluation))
    ledger.add_step(FinishedStep(15.0, 16.0, kind=EVALUATION, operation="eval_step", enclosing=evaluation))
    ledger.add_step(FinishedStep(10.0, 20.0, kind=EVALUATION, operation="evaluate"))
    ledger.add_step(FinishedStep(22.0, 25.0))  # inside the epoch: its gaps are data wait, as without it
    ledger.add_step(FinishedStep(28.0, 31.0))
    ledger.add_step(FinishedStep(20.0, 40.0, operation="epoch", holds_steps=True))
    ledger.add_step(FinishedStep(43.0, 44.0, operation="loss", enclosing=(40.0, "productive")))
    ledger.add_step(FinishedStep(40.0, 50.0))
    g = ledger.closed()
    # startup 0-5; productive 5-8, 22-25, 28-31, 40-50; data wait 8-10, 20-22, 25-28, 31-40;
    # evaluation 10-20.
    assert g.badput["startup"] == approx(5.0)
    assert g.productive_s == approx(3.0 + 3.0 + 3.0 + 10.0)
    assert g.badput["data_wait"] == approx(2.0 + 2.0 + 3.0 + 9.0)
    assert g.badput["evaluation"] == approx(10.0)
    assert g.wall_s == 50.0 and total(g) == approx(50.0)


def test_an_enclosed_step_with_a_replay_before_it_counts_every_second_once():
    ledger = GoodputLedger(configured_at=0.0)
    ledger.add_step(FinishedStep(0.0, 2.0))
    ledger.add_forensics(3.0, 5.0)  # between the steps, inside the evaluation pass below
    ledger.add_step(FinishedStep(6.0, 7.0, kind=EVALUATION, operation="eval_step", enclosing=(2.5, "evaluation")))
    g = ledger.closed()
    assert g.badput["data_wait"] == approx(0.5) and g.badput["forensics"] == approx(2.0)
    assert g.badput["evaluation"] == approx(1.5 + 1.0) and total(g) == approx(7.0)
