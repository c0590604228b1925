"""The leak detector: robust slope, state round trip, and the leak zoo (two leaks flagged with
their tensors named, a clean loop of the same length never flagged)."""

from __future__ import annotations

import importlib
import itertools
import json
import math
import random
import statistics

import pytest
import torch

import torchtrace as tt
from torchtrace import semconv
from torchtrace.api import get_runtime
from torchtrace.probes import find_probe
from torchtrace.probes.leaks import LeakProbe
from torchtrace.record import growth as leaks

memory_tracking = importlib.import_module("torchtrace.probes.leaks")  # the package exports a function of that name

WINDOW = 16
CONFIRM = 4
STEPS = 44  # warm-up window + slope window + confirmation, with margin
_CACHE: list = []


def test_theil_sen_matches_brute_force_and_ignores_outliers():
    xs = list(range(12))
    ys = [1000 * x + (50_000 if x == 7 else 0) + (x % 3) for x in xs]
    ref = statistics.median((ys[j] - ys[i]) / (xs[j] - xs[i]) for i, j in itertools.combinations(range(12), 2))
    assert leaks.theil_sen_slope(xs, ys) == ref
    assert 990 <= ref <= 1010  # one spike does not move it
    assert leaks.theil_sen_slope([1], [5]) is None


def test_growth_tracker_sustained_and_round_trip():
    tr = leaks.GrowthTracker(window=8, threshold=100, warmup=2)
    for step in range(2):
        tr.add(step, 10 ** 9)  # warm-up samples are ignored
    for step in range(2, 10):
        tr.add(step, 1000 * step)
    assert tr.slope == 1000 and tr.sustained()
    clone = leaks.GrowthTracker(window=4)
    clone.load_state_dict(json.loads(json.dumps(tr.state_dict())))
    assert clone.state_dict() == tr.state_dict() and clone.slope == tr.slope and clone.sustained()
    for step in range(10, 40):  # both go on alike after the round trip: same slopes, same verdicts
        value = 1000 * step if step < 20 else 20_000
        assert (clone.add(step, value), clone.sustained()) == (tr.add(step, value), tr.sustained())
    assert not tr.sustained() and tr.slope == 0
    flat = leaks.GrowthTracker(window=8, threshold=100, warmup=0)
    for step in range(8):
        flat.add(step, 5000 if step == 4 else 0)  # one jump, no trend
    assert not flat.sustained()
    with pytest.raises(ValueError, match="window"):
        leaks.GrowthTracker(window=2)


@pytest.mark.parametrize("multiple", [1.5, 2, 4, 10, 26])
def test_time_to_sustained_falls_as_the_leak_grows(multiple):
    # Sampled every step, default window (32 steps) and warm-up (32 steps): a leak at m times
    # the threshold has taken the bytes of a whole window at the threshold after 32/m steps;
    # never fewer than a quarter window (8 steps) of evidence.
    threshold = leaks.DEFAULT_THRESHOLD
    tr = leaks.GrowthTracker(threshold=threshold)
    found = None
    for step in range(200):
        tr.add(step, 10 ** 8 + int(multiple * threshold * step) + (step % 3) * 4096)
        if tr.sustained():
            found = step
            break
    expected = 32 + max(8, math.ceil(32 / multiple))
    assert found is not None and abs(found - expected) <= 1, (multiple, found, expected)
    assert tr.slope == pytest.approx(multiple * threshold, rel=0.02)


def test_a_leak_that_starts_mid_window_is_called_on_its_own_evidence():
    # After 100 flat steps the window is full of flat samples; the leak's own recent stretch
    # decides, so the time still falls as the leak grows, and the rate is the leak's own.
    threshold = leaks.DEFAULT_THRESHOLD
    delays = {}
    for multiple in (1.5, 2, 4, 10, 26):
        tr = leaks.GrowthTracker(threshold=threshold)
        for step in range(300):
            tr.add(step, 10 ** 8 + (int(multiple * threshold * (step - 100)) if step >= 100 else 0))
            if tr.sustained():
                delays[multiple] = step - 100
                break
        assert 0 < delays[multiple] <= max(8, math.ceil(32 / multiple)) + 5, delays
        assert tr.rate() == pytest.approx(multiple * threshold, rel=0.02)
        assert tr.slope <= tr.rate()  # the window's slope may still be diluted by the flat steps
    assert list(delays.values()) == sorted(delays.values(), reverse=True), delays


def test_a_leak_in_chunks_or_under_noise_is_still_called():
    threshold = leaks.DEFAULT_THRESHOLD
    rng = random.Random(0)
    chunky = leaks.GrowthTracker(threshold=threshold)  # 50x every 5th step: 10x on average
    noisy = leaks.GrowthTracker(threshold=threshold)  # 2x under +-1 MB of scatter
    found: dict[str, int] = {}
    for step in range(200):
        chunky.add(step, 10 ** 8 + 50 * threshold * (step // 5))
        noisy.add(step, 10 ** 8 + 2 * threshold * step + rng.randint(-4 * threshold, 4 * threshold))
        for name, tr in (("chunky", chunky), ("noisy", noisy)):
            if name not in found and tr.sustained():
                found[name] = step
    assert found["chunky"] <= 32 + 25 and found["noisy"] <= 32 + 32, found


def test_one_or_two_jumps_anywhere_are_not_a_leak_noise_neither():
    threshold = leaks.DEFAULT_THRESHOLD
    rng = random.Random(0)
    for size in (4, 32, 2000):  # Adam's state for a 16 MB model is a jump of 32x the threshold
        for first in range(30, 110, 3):
            for second in (None, first + 2, first + 9):
                tr = leaks.GrowthTracker(threshold=threshold)
                for step in range(140):
                    jumps = (step >= first) + (second is not None and step >= second)
                    tr.add(step, 10 ** 8 + jumps * size * threshold + rng.randint(-20_000, 20_000))
                    assert not tr.sustained(), (size, first, second, step)
    noisy = leaks.GrowthTracker(threshold=threshold)
    for step in range(5000):  # i.i.d. scatter of +-8x the threshold (+-2 MB) around a flat heap
        noisy.add(step, 10 ** 8 + rng.randint(-8 * threshold, 8 * threshold))
        assert not noisy.sustained(), step
    assert abs(noisy.slope) < threshold


def test_suspicion_and_the_stride_of_extra_samples():
    threshold = 1000
    tr = leaks.GrowthTracker(window=32, threshold=threshold, warmup=0)
    for step in range(0, 64 * 6, 64):  # sparse samples of a flat heap
        tr.add(step, 10 ** 6)
    assert not tr.suspected() and not tr.wants_samples(64 * 6)
    tr.add(64 * 6, 10 ** 6 + 9 * threshold)  # a quarter window's evidence (8000) beyond the trend
    assert tr.suspected() and tr.pair_slope < threshold
    assert tr.stride() == 8  # suspected at the threshold's rate: 32 steps of evidence, 5 samples
    assert not tr.wants_samples(64 * 6 + 7) and tr.wants_samples(64 * 6 + 8)
    tr.add(64 * 6 + 2, 10 ** 6 + 9 * threshold + 20 * threshold)  # 10x over two steps
    assert tr.suspected() and tr.stride() == 2
    drift = leaks.GrowthTracker(window=32, threshold=threshold, warmup=0)
    for step in range(0, 64 * 12, 64):  # a steady half-threshold drift, sampled every 64 steps
        drift.add(step, 10 ** 6 + 500 * step)
    drift.refresh()
    drift.add(64 * 12, 10 ** 6 + 500 * 64 * 12)
    assert drift.pair_excess == pytest.approx(0) and not drift.suspected()


def test_window_spans_steps_and_keeps_five_samples_however_sparse():
    tr = leaks.GrowthTracker(window=32, threshold=100, warmup=0)
    for step in range(0, 64 * 10, 64):  # one sample every 64 steps
        tr.add(step, 1000 * step)
    assert [s for s, _ in tr.samples] == [64 * k for k in range(5, 10)]
    assert tr.slope == 1000 and tr.sustained()
    dense = leaks.GrowthTracker(window=32, threshold=100, warmup=0)
    for step in range(100):
        dense.add(step, 0)
    assert [s for s, _ in dense.samples] == list(range(99 - 32, 100))  # the last 32 steps


@pytest.fixture(autouse=True)
def _heap_sampled_every_step(monkeypatch, request):
    # These tests are about what the detector finds, so the heap is sampled every step however
    # fragmented this test process's heap is (the sampling policy has its own test).
    if request.node.name != "test_a_costly_heap_sample_is_spread_over_steps_and_keeps_the_slope":
        monkeypatch.setattr(memory_tracking, "HEAP_FREE_S", 10.0)


def test_a_costly_heap_sample_is_spread_over_steps_and_keeps_the_slope(tmp_path, monkeypatch):
    import time

    from torchtrace.measure import memory as mem_measure

    step_no = [0]
    calls = []

    # A fragmented heap: 15 ms of CPU a call (the walk); grows 300 KB per step. (At 3 ms, steps
    # slowed past 9 ms by a busy machine earned a shorter gap, and one sample more.)
    def costly_heap():
        end = time.thread_time() + 0.015
        while time.thread_time() < end:
            pass
        calls.append(step_no[0])
        return 10_000_000 + 300_000 * step_no[0]

    monkeypatch.setattr(mem_measure, "heap_in_use_bytes", costly_heap)
    tt.configure(level="advanced", prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False,
                 leak_window=4, leak_threshold_bytes=10 ** 9)
    try:
        probe = find_probe(get_runtime(), LeakProbe)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        steps = 700
        for i in range(steps):
            step_no[0] = i
            with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                opt.zero_grad()
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
        # A step under 47 ms cannot give 0.5 % of itself to a 15 ms sample: one every 64 steps.
        assert probe.heap_every == memory_tracking.HEAP_MAX_GAP
        assert len(calls) <= 2 + 1 + steps // memory_tracking.HEAP_MAX_GAP  # the first call is a warm-up
        gaps = {b - a for a, b in zip(calls[2:], calls[3:])}
        assert gaps == {memory_tracking.HEAP_MAX_GAP}
        assert probe.trackers["cpu"].slope == pytest.approx(300_000)  # still bytes per step
        assert step.record.anomalies == []
    finally:
        tt.shutdown()


def _configure(tmp_path):
    return tt.configure(level="advanced", prometheus_port=0, run_dir=str(tmp_path), strict=True,
                        register_atexit=False, leak_window=WINDOW, leak_threshold_bytes=64 * 1024,
                        leak_confirm_steps=CONFIRM)


def _run(kind: str) -> tuple[int | None, list]:
    """A small loop whose step leaks ~256 KiB of activations in two ways, or nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 16), torch.randn(16, 4)
    losses = []
    _CACHE.clear()
    flagged = None
    records = []
    for i in range(STEPS):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            opt.zero_grad()
            h = model[1](model[0](x))
            loss = torch.nn.functional.mse_loss(model[2](h), y)
            loss.backward(retain_graph=kind == "loss")
            step.record_loss(loss)
            opt.step()
            if kind == "loss":
                losses.append(loss)  # keeps every step's graph alive
            elif kind == "cache":
                _CACHE.append(h.detach().clone())  # a global activation cache
        records.append(step.record)
        if flagged is None and semconv.MEMORY_LEAK in step.record.anomaly_kinds:
            flagged = i
    _CACHE.clear()
    return flagged, records


def test_loss_kept_with_graph_is_flagged(tmp_path):
    result = _configure(tmp_path)
    flagged, records = _run("loss")
    assert flagged is not None and flagged <= 2 * WINDOW + CONFIRM + 4
    leak = next(a for a in records[flagged].anomalies if a.kind == semconv.MEMORY_LEAK)
    assert leak.data["bytes_per_step"] > 64 * 1024
    report = find_probe(get_runtime(), LeakProbe).reports[-1]
    groups = {(tuple(g["shape"]), g["grad_fn"]) for g in report["tensors"]}
    assert ((), "MseLossBackward0") in groups  # the kept loss itself
    assert ((16, 4096), "TanhBackward0") in groups  # the activation its graph retains
    loss_group = next(g for g in report["tensors"] if g["grad_fn"] == "MseLossBackward0")
    assert loss_group["graph_bytes_each"] >= 16 * 4096 * 4
    assert "grad_fn=MseLossBackward0" in leak.detail
    tt.flush()
    spans = [json.loads(l) for l in result.spans_path.read_text().splitlines()]
    ev = [e for s in spans for e in s["events"] if e["name"] == semconv.EVENT_MEMORY_LEAK]
    assert ev and any("MseLossBackward0" in t for t in ev[0]["attributes"][semconv.MEMORY_LEAK_TENSORS])
    import urllib.request

    text = urllib.request.urlopen(result.metrics_url, timeout=5).read().decode()
    line = next(l for l in text.splitlines() if l.startswith(semconv.M_MEMORY_GROWTH + "{"))
    assert 'device="cpu"' in line and float(line.rsplit(" ", 1)[1]) != 0
    tt.shutdown()


def test_global_activation_cache_is_flagged_with_its_shape_and_site(tmp_path):
    _configure(tmp_path)
    flagged, records = _run("cache")
    assert flagged is not None and flagged <= 2 * WINDOW + CONFIRM + 4
    report = find_probe(get_runtime(), LeakProbe).reports[-1]
    top = report["tensors"][0]
    assert top["shape"] == [16, 4096] and top["grad_fn"] is None
    assert top["count_growth"] >= CONFIRM
    assert any(s["site"].startswith(__file__) for s in report["sites"])  # Python allocation site in this file
    tt.shutdown()


def test_clean_loop_is_never_flagged(tmp_path):
    _configure(tmp_path)
    flagged, records = _run("clean")
    assert flagged is None
    assert all(semconv.MEMORY_LEAK not in r.anomaly_kinds for r in records)
    assert find_probe(get_runtime(), LeakProbe).flagged == 0
    tt.shutdown()


def test_level_change_ends_an_investigation_and_its_tracemalloc(tmp_path):
    # Leak for a while so the slow path starts, then switch to OFF (no step is recorded
    # there): the investigation and the tracemalloc it started must end at the switch.
    import tracemalloc

    assert not tracemalloc.is_tracing()
    _configure(tmp_path)
    probe = find_probe(get_runtime(), LeakProbe)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    kept = []
    for _ in range(3 * WINDOW):
        with tt.debug_context("train_step", model=model, optimizer=opt):
            opt.zero_grad()
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            kept.append(torch.randn(64 * 1024))  # 256 KiB a step
        if probe.investigation is not None:
            break
    assert probe.investigation is not None and tracemalloc.is_tracing()
    get_runtime().set_level("off")
    assert probe.investigation is None and not tracemalloc.is_tracing()
    tt.shutdown()


def test_detector_off_at_basic(tt_runtime):
    probe = find_probe(get_runtime(), LeakProbe)
    for i in range(5):
        with tt.debug_context("s"):
            pass
    assert probe.trackers == {}


def test_leak_settings_validated():
    with pytest.raises(ValueError, match="leak_threshold_bytes"):
        tt.configure(leak_threshold_bytes=-1, prometheus_port="off", write_files=False)


def test_leak_window_validated():
    with pytest.raises(ValueError, match="leak_window=2 is not valid; accepted values: an integer >= 4"):
        tt.configure(leak_window=2, prometheus_port="off", write_files=False)
