"""The leak detector: robust slope, state round trip, and the leak zoo (two leaks flagged with
their tensors named, a clean loop of the same length never flagged)."""

from __future__ import annotations

import importlib
import itertools
import json
import statistics

import pytest
import torch

import torchtrace as tt
from torchtrace import semconv
from torchtrace.api import get_runtime
from torchtrace.record import growth as leaks
from torchtrace.probes.leaks import LeakProbe

memory_tracking = importlib.import_module("torchtrace.probes.leaks")  # the package exports a function of that name
from torchtrace.probes import find_probe

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
    flat = leaks.GrowthTracker(window=8, threshold=100, warmup=0)
    for step in range(8):
        flat.add(step, 5000 if step == 4 else 0)  # one jump, no trend
    assert not flat.sustained()
    with pytest.raises(ValueError, match="window"):
        leaks.GrowthTracker(window=2)


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

    def costly_heap():  # a fragmented heap: 3 ms a call; grows 300 KB per step
        time.sleep(0.003)
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
        # A ~1 ms step cannot give 0.5 % of itself to a 3 ms sample: one sample every 64 steps.
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
