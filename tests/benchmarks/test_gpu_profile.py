"""benchmarks/gpu_profile.py's arithmetic on a trace made by hand (the script itself needs CUDA)."""

from __future__ import annotations

import pytest

from tests.benchmarks import load


def test_busy_time_is_the_length_of_the_union_of_intervals():
    bench = load("gpu_profile")
    assert bench.busy_time([]) == 0.0
    assert bench.busy_time([(0.0, 10.0), (5.0, 12.0), (20.0, 21.0), (11.0, 11.5)]) == 13.0
    assert bench.busy_time([(3.0, 4.0), (0.0, 10.0)]) == 10.0


def test_a_round_is_split_into_busy_idle_and_the_host_time_at_its_ends():
    """Two rounds of 2 steps: kernels at 100-400 and 600-900 µs of a 1,000 µs round (first kernel
    after 100 µs, last ending 100 µs before the round ends, 200 µs idle between them), and a
    copy inside the second kernel. Per step: wall 500, busy 300, idle 100."""
    bench = load("gpu_profile")
    events = []
    for start in (0.0, 5000.0):
        events.append({"name": "round", "cat": "user_annotation", "ph": "X", "ts": start, "dur": 1000.0})
        events.append({"name": "gemm", "cat": "kernel", "ph": "X", "ts": start + 100, "dur": 300.0})
        events.append({"name": "norm", "cat": "kernel", "ph": "X", "ts": start + 600, "dur": 300.0})
        events.append({"name": "Memcpy DtoH", "cat": "gpu_memcpy", "ph": "X", "ts": start + 700, "dur": 10.0})
        events.append({"name": "aten::mm", "cat": "cpu_op", "ph": "X", "ts": start + 50, "dur": 40.0})
    events.append({"name": "outside", "cat": "kernel", "ph": "X", "ts": 3000.0, "dur": 50.0})
    out = bench.summarise(events, steps=2)
    assert out["wall"] == 500.0 and out["busy"] == 300.0 and out["idle_inside"] == 100.0
    assert out["to_first_kernel"] == 100.0 and out["after_last_kernel"] == 100.0
    assert out["ops"] == pytest.approx({"gemm": 150.0, "norm": 150.0, "Memcpy DtoH": 5.0})


def test_entry_latency_sees_torchtrace_before_the_steps_body(tt_runtime):
    """On the CPU: a BASIC step reaches its body later than the bare step does, and the bare
    step's entry is a function call away."""
    import torch

    bench = load("gpu_profile")
    args = type("Args", (), {"gpt": False, "gpu_model": False, "quick": True, "only_mlp": True})()
    wl = bench.overhead.workloads(args, torch.device("cpu"))[0]
    bare_first, bare_later = bench.entry_latency(wl, "bare", 30, 2, lambda: None)
    basic_first, basic_later = bench.entry_latency(wl, "basic", 30, 2, lambda: None)
    assert 0 < bare_first < 50 and 0 < bare_later < 50
    assert basic_later > bare_later + 2
    assert "step" not in vars(wl)  # the body is the workload's own again
