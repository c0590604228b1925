"""Throughput windows, MFU, and the throughput_drop and data_stall rules: no false alarm on a
noisy steady run, an alarm within the stated number of steps for a 2x slow-down and for a
planted 50 ms loader sleep (simulated, and with a real DataLoader and a real model)."""

from __future__ import annotations

import random
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from torchtrace import semconv
from torchtrace.record.goodput import EVALUATION, FinishedStep, GoodputLedger
from torchtrace.record.throughput import (
    STALL_WINDOW,
    WARMUP_STEPS,
    WINDOW,
    OperationWindow,
    RuleSettings,
)

approx = pytest.approx


def run(ledger: GoodputLedger, durations: list[float], waits: list[float], **fields) -> list[tuple[int, str]]:
    """Feed back-to-back steps (wait, then step) to the ledger; (index, kind) of every finding."""
    t, found = 0.0, []
    for i, (d, w) in enumerate(zip(durations, waits)):
        t += w
        found += [(i, f.kind) for f in ledger.add_step(FinishedStep(t, t + d, **fields)).findings]
        t += d
    return found


def noisy(rng: random.Random, n: int, step: float = 0.1, wait: float = 0.002, sigma: float = 0.1) -> tuple:
    durations = [step * rng.lognormvariate(0, sigma) for _ in range(n)]
    waits = [wait * rng.lognormvariate(0, 0.5) for _ in range(n)]
    return durations, waits


# ---------------------------------------------------------------- windows and MFU


def test_window_rates_against_a_plain_computation():
    ledger = GoodputLedger(configured_at=0.0, peak_flops=5e9)
    rng = random.Random(1)
    rows, t = [], 0.0
    for i in range(WINDOW + 7):
        wait, dur = rng.uniform(0, 0.05), rng.uniform(0.05, 0.2)
        samples, tokens, flops = rng.randrange(1, 64), rng.randrange(100, 5000), rng.randrange(10**8, 10**9)
        excluded = i == 3  # the FLOP-counting step: slow, left out
        ledger.add_step(FinishedStep(t + wait, t + wait + dur * (5 if excluded else 1), excluded=excluded,
                                     samples=samples, tokens=tokens, flops=flops))
        if not excluded:
            rows.append((dur + (wait if i else 0.0), wait if i else 0.0, samples, tokens, flops))
        t += wait + dur * (5 if excluded else 1)
    last = rows[-WINDOW:]
    seconds = sum(r[0] for r in last)
    tp = ledger.throughput("train_step")
    assert tp.steps == WINDOW and tp.seconds == approx(seconds)
    assert tp.samples_per_s == approx(sum(r[2] for r in last) / seconds)
    assert tp.tokens_per_s == approx(sum(r[3] for r in last) / seconds)
    assert tp.flops_per_s == approx(sum(r[4] for r in last) / seconds)
    assert tp.mfu == approx(sum(r[4] for r in last) / seconds / 5e9)
    assert tp.data_wait_share == approx(sum(r[1] for r in last) / seconds)


def test_mfu_needs_flops_and_a_peak():
    assert GoodputLedger(0.0).throughput("train_step") is None
    no_peak = GoodputLedger(0.0)
    no_peak.add_step(FinishedStep(0.0, 1.0, samples=2, flops=10))
    assert no_peak.throughput("train_step").flops_per_s == 10 and no_peak.throughput("train_step").mfu is None
    no_flops = GoodputLedger(0.0, peak_flops=1e12)
    no_flops.add_step(FinishedStep(0.0, 1.0, samples=2))
    tp = no_flops.throughput("train_step")
    assert tp.mfu is None and tp.flops_per_s is None and tp.tokens_per_s is None and tp.samples_per_s == 2


def test_steps_known_in_part_divide_by_their_own_time():
    w = OperationWindow(RuleSettings(window=4))
    w.add(1.0, 0.0, samples=10, tokens=None, flops=None)
    w.add(1.0, 0.0, samples=None, tokens=None, flops=None)  # a batch it could not read
    assert w.throughput().samples_per_s == 10.0


def test_an_operation_of_another_kind_in_between_is_not_data_wait():
    ledger = GoodputLedger(configured_at=0.0)
    ledger.add_step(FinishedStep(0.0, 1.0))
    ledger.add_step(FinishedStep(1.0, 31.0, kind=EVALUATION, operation="eval"))  # 30 s of evaluation
    ledger.add_step(FinishedStep(31.0, 32.0, kind=EVALUATION, operation="eval"))
    account = ledger.add_step(FinishedStep(32.5, 33.5))
    assert account.data_wait_s == 0.5  # the contract's data wait: since the previous step of any operation
    assert ledger.throughput("train_step").data_wait_share == 0.0  # but not this operation's input pipeline
    assert ledger.throughput("eval").seconds == 31.0  # 30 + 1, the wait before it was training


def test_training_operations_that_alternate_wait_for_their_data():
    """A GAN's discriminator and generator steps alternate: the loader's wait before each
    discriminator step follows a generator step (another operation, the same kind). It is the
    discriminator's input pipeline, and a loader that makes it wait is a data stall."""
    ledger = GoodputLedger(configured_at=0.0, rules=RuleSettings(stall_window=4, stall_min_steps=4))
    found, t = [], 0.0
    for _ in range(5):
        t += 0.3  # the loader: 0.3 s before the discriminator's step
        found += ledger.add_step(FinishedStep(t, t + 0.1, operation="train_d")).findings
        found += ledger.add_step(FinishedStep(t + 0.1, t + 0.2, operation="train_g")).findings
        t += 0.2
    assert ledger.throughput("train_d").data_wait_share == pytest.approx(1.2 / 1.7)  # (the first has no wait)
    assert ledger.throughput("train_g").data_wait_share == 0.0
    assert [f.kind for f in found] == [semconv.DATA_STALL]


# ---------------------------------------------------------------- no false alarms


@pytest.mark.parametrize("seed", range(5))
def test_no_alarm_on_a_steady_noisy_run_with_an_odd_slow_step(seed):
    rng = random.Random(seed)
    durations, waits = noisy(rng, 3000)
    for i in range(150, 3000, 97):
        durations[i] *= 6  # a slow step now and then (a GC pause, a checkpoint flush)
    for i in range(200, 3000, 331):
        waits[i] = 2.0  # a slow batch now and then
    found = run(GoodputLedger(0.0), durations, waits, samples=32, tokens=32 * 512)
    assert found == []


def test_warmup_steps_are_not_judged():
    durations = [1.0] * WARMUP_STEPS + [0.1] * 200  # compilation, then the real pace
    assert run(GoodputLedger(0.0), durations, [0.0] * len(durations), samples=8) == []


# ---------------------------------------------------------------- alarms


@pytest.mark.parametrize("unit", ["tokens", "samples", "steps"])
def test_a_two_times_slowdown_is_reported_within_three_windows(unit):
    rng = random.Random(3)
    start = 600
    durations, waits = noisy(rng, 800)
    durations = [d * (2 if i >= start else 1) for i, d in enumerate(durations)]
    fields = {"tokens": {"samples": 8, "tokens": 4096}, "samples": {"samples": 8}, "steps": {}}[unit]
    found = run(GoodputLedger(0.0), durations, waits, **fields)
    drops = [i for i, kind in found if kind == semconv.THROUGHPUT_DROP]
    assert drops and drops[0] >= start and drops[0] - start < (RuleSettings().drop_windows + 1) * WINDOW
    assert all(kind == semconv.THROUGHPUT_DROP for _, kind in found)


def test_a_lasting_slowdown_becomes_the_new_baseline():
    durations = [0.1] * 400 + [0.2] * 600
    found = run(GoodputLedger(0.0), durations, [0.0] * 1000, samples=8)
    assert 1 <= len(found) <= RuleSettings().baseline_windows // 2 + 1
    assert found[-1][0] < 400 + (RuleSettings().baseline_windows // 2 + 2) * WINDOW


def test_a_planted_50ms_loader_sleep_is_a_stall_within_the_window():
    rng = random.Random(5)
    start = 300
    durations, waits = noisy(rng, 400, step=0.02)
    waits = [w + (0.05 if i >= start else 0.0) for i, w in enumerate(waits)]
    found = run(GoodputLedger(0.0), durations, waits, samples=8)
    stalls = [i for i, kind in found if kind == semconv.DATA_STALL]
    assert stalls and start <= stalls[0] < start + STALL_WINDOW
    gaps = [b - a for a, b in zip(stalls, stalls[1:])]
    assert gaps and min(gaps) >= STALL_WINDOW  # reported again only after a fresh window


def test_long_waits_are_a_stall_even_for_long_steps():
    durations, waits = [60.0] * 30, [0.5] * 10 + [6.0] * 20  # 6 s is 9 % of a step, over 5 s
    stalls = [i for i, k in run(GoodputLedger(0.0), durations, waits, samples=8) if k == semconv.DATA_STALL]
    assert stalls and 10 <= stalls[0] < 10 + STALL_WINDOW


def test_rules_watch_training_only():
    durations, waits = [0.02] * 100, [0.2] * 100  # evaluation waits a lot: not a training stall
    assert run(GoodputLedger(0.0), durations, waits, kind=EVALUATION, operation="eval") == []


class SlowLoader(Dataset):
    """Batches of 64 x 256; from item ``slow_from`` on, each item sleeps ``sleep_s`` first."""

    def __init__(self, n: int, slow_from: int, sleep_s: float) -> None:
        self.n, self.slow_from, self.sleep_s = n, slow_from, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i >= self.slow_from:
            time.sleep(self.sleep_s)
        return torch.randn(64, 256)


@pytest.fixture
def one_thread():
    """One intra-op thread: on a busy shared CPU, two threads make a millisecond step take 250 ms."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_real_loader_with_a_planted_sleep_measures_the_wait_and_reports_a_stall(one_thread):
    torch.manual_seed(0)
    # a step of a few milliseconds: the healthy loader's own cost is a small share of it
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    healthy, slow, sleep_s = 30, 15, 0.05
    loader = DataLoader(SlowLoader(healthy + slow, healthy, sleep_s), batch_size=None, num_workers=0)
    ledger = GoodputLedger(configured_at=time.perf_counter())
    accounts = []
    for x in loader:
        start = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        accounts.append(ledger.add_step(FinishedStep(start, time.perf_counter(), samples=x.shape[0])))
    waits = [a.data_wait_s for a in accounts]
    assert sorted(waits[1:healthy])[healthy // 2] < sleep_s / 5  # healthy: the loader costs little
    assert all(sleep_s <= w < sleep_s + 0.5 for w in waits[healthy:])  # the planted sleep, measured
    stalls = [i for i, a in enumerate(accounts) for f in a.findings if f.kind == semconv.DATA_STALL]
    assert stalls and healthy <= stalls[0] < healthy + STALL_WINDOW
    assert ledger.snapshot(time.perf_counter()).badput["data_wait"] >= slow * sleep_s


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("kwargs,name,accepted", [
    ({"window": 0}, "window", "integer >= 1"),
    ({"warmup_steps": -1}, "warmup_steps", "integer >= 0"),
    ({"drop_ratio": 1.5}, "drop_ratio", "between 0 and 1"),
    ({"stall_share": 0}, "stall_share", "between 0 and 1"),
    ({"stall_seconds": -2.0}, "stall_seconds", "positive"),
    ({"baseline_windows": 2, "min_baseline_windows": 3}, "min_baseline_windows", "<= baseline_windows"),
    ({"stall_window": 5, "stall_min_steps": 6}, "stall_min_steps", "<= stall_window"),
    ({"window": 2.5}, "window", "integer >= 1"),
])
def test_bad_rule_settings_name_the_setting(kwargs, name, accepted):
    with pytest.raises(ValueError, match=f"{name}=.*{accepted}"):
        RuleSettings(**kwargs)


def test_one_slow_window_is_not_a_drop():
    """A shared machine's load spike slows one window; the next is back to pace: no drop."""
    durations = [0.1] * 300 + [0.3] * WINDOW + [0.1] * 200
    assert run(GoodputLedger(0.0), durations, [0.0] * len(durations), samples=8) == []


def test_flops_past_the_float_range_make_an_infinite_rate_not_an_error():
    """Given FLOPs so large (1e307 per step) that their sum passes the float range: the FLOP
    rate and MFU are infinite, and the other rates are those of a plain count, not lost."""
    import math

    w = OperationWindow(RuleSettings(window=20))
    for _ in range(20):
        w.add(duration=0.04, wait=0.01, samples=4, tokens=32, flops=int(1e307))
    tp = w.throughput(peak_flops=1e12)
    assert tp.samples_per_s == pytest.approx(20 * 4 / (20 * 0.05)) and tp.tokens_per_s == pytest.approx(32 / 0.05)
    assert math.isinf(tp.flops_per_s) and math.isinf(tp.mfu)
    assert tp.data_wait_share == pytest.approx(0.2)


def test_the_docs_state_every_data_stall_threshold():
    """docs/throughput.md's data_stall rule names each threshold the rule applies, the 10 ms
    floor included: a user whose loader waits 6 ms before each 12 ms step (a third of the
    time) read that every step waited, saw the DataLoaderStall share rule fire and no
    data_stall anomaly, because waits under the floor never count."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "throughput.md").read_text()
    bullet = text.split("- `data_stall`:", 1)[1].split("\n\n", 1)[0]
    bullet = " ".join(bullet.split())
    s = RuleSettings()
    assert f"{s.stall_share:.0%}" in bullet and f"{s.stall_seconds:g} s" in bullet
    assert f"{s.stall_min_wait_s * 1e3:g} ms" in bullet, bullet
    assert f"{s.stall_min_steps} waiting steps among the last {s.stall_window}" in bullet
    # and the floor is what the rule does: 6 ms before each 12 ms step never stalls
    w = OperationWindow(RuleSettings())
    assert not any(f for _ in range(40) for f in w.add(0.012, 0.006, 8, None, None))
    w = OperationWindow(RuleSettings())
    assert any(f.kind == semconv.DATA_STALL for _ in range(40) for f in w.add(0.012, 0.011, 8, None, None))
