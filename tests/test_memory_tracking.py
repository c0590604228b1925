"""Memory samples per step, snapshots and their comparison, weakly tracked tensors, clear_memory."""

from __future__ import annotations

import gc

import torch

import torchtrace as tt
from torchtrace.measure.snapshots import MemoryTracker, compare, tracker


def test_snapshot_compare_and_census():
    trk = MemoryTracker()
    a = trk.take_snapshot("a", census=True)
    keep = [torch.zeros(37, 41) for _ in range(3)]
    b = trk.take_snapshot("b", census=True)
    diff = b.compare(a)
    assert diff["from"] == "a" and diff["to"] == "b" and diff["rss_bytes"] is not None
    group = next(g for g in diff["growing_tensors"] if g["shape"] == [37, 41])
    assert group["count_growth"] == 3 and group["bytes_growth"] == 3 * 37 * 41 * 4
    assert compare(a, b) == diff
    assert b.as_dict()["tensor_count"] >= 3
    del keep


def test_track_tensor_is_weak():
    trk = MemoryTracker()
    t = torch.ones(10, 10)
    trk.track_tensor(t, "ones")
    s1 = trk.take_snapshot("with")
    assert trk.tracked()["ones"] == {"alive": True, "bytes": 400, "shape": [10, 10], "dtype": "float32",
                                     "device": "cpu", "freed_unix": None}
    del t
    gc.collect()
    info = trk.tracked()["ones"]
    assert info["alive"] is False and info["freed_unix"] is not None
    s2 = trk.take_snapshot("without")
    assert s2.compare(s1)["tracked_freed"] == ["ones"]


def test_memory_tracking_samples_each_step(tt_runtime):
    trk = tracker()
    n0 = len(trk.samples)
    with tt.memory_tracking() as t:
        for i in range(3):
            with tt.debug_context("s"):
                pass
    assert t is trk and len(trk.samples) - n0 == 3
    assert [s["step"] for s in list(trk.samples)[-3:]] == [0, 1, 2]
    assert "start" in trk.snapshots and "end" in trk.snapshots
    with tt.debug_context("s"):
        pass
    assert len(trk.samples) - n0 == 3  # not tracking outside the block at BASIC
    assert trk.summary()["rss_max"] > 0


def test_memory_profiling_mode_samples(tmp_path):
    tt.configure(mode="memory_profiling", prometheus_port="off", run_dir=str(tmp_path), strict=True,
                 register_atexit=False)
    n0 = len(tracker().samples)
    with tt.debug_context("s"):
        pass
    assert len(tracker().samples) == n0 + 1
    tt.shutdown()


def test_debugger_memory_api():
    dbg = tt.PyTorchDebugger()
    a = dbg.take_memory_snapshot("x")
    t = torch.ones(3)
    dbg.track_tensor(t, "t")
    b = dbg.take_memory_snapshot("y")
    assert dbg.compare_memory_snapshots(a, b)["tracked_new"] == ["t"]
    freed = dbg.clear_memory()
    assert "rss_bytes" in freed
    assert tt.clear_memory().keys() >= {"rss_bytes"}
    with dbg.memory_tracking() as trk:
        assert trk.active
    types = [e.event_type for e in dbg.history.events()]
    assert "memory_snapshot" in types and "memory_cleared" in types


def test_public_names_import():
    for name in ("profiling", "ProfileSchedule", "memory_tracking", "take_memory_snapshot", "track_tensor",
                 "clear_memory", "debug_forward_pass", "debug_backward_pass", "inspect_model", "debug_training_step",
                 "MemorySnapshot", "MemoryTracker"):
        assert name in tt.__all__ and getattr(tt, name) is not None


def test_memory_tracking_enabled_false_records_nothing(tt_runtime, tiny_model):
    trk = MemoryTracker()
    with tt.memory_tracking(trk, enabled=False):
        with tt.debug_context("train_step", model=tiny_model):
            pass
    assert trk.snapshots == {} and len(trk.samples) == 0
    with tt.memory_tracking(trk, True):  # the seeds' positional enabled
        with tt.debug_context("train_step", model=tiny_model):
            pass
    assert list(trk.snapshots) == ["start", "end"]


def test_model_bytes_and_memory_profile_against_a_plain_count():
    from torchtrace.tools.memory import memory_profile, model_bytes

    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(shared, torch.nn.BatchNorm1d(4), shared)  # tied: counted once
    model(torch.randn(3, 4)).sum().backward()
    params = {id(p): p for p in model.parameters()}.values()
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    b_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert model_bytes(model) == {"parameters": p_bytes, "gradients": p_bytes, "buffers": b_bytes,
                                  "total": 2 * p_bytes + b_bytes}
    prof = memory_profile(model)
    import psutil

    assert prof["total"] == 2 * p_bytes + b_bytes
    assert prof["cpu_memory"] == 100.0 * prof["rss_bytes"] / psutil.virtual_memory().total
    assert prof["gpu_memory"] is None or prof["gpu_memory"] == prof["cuda_allocated_bytes"] / 2 ** 20


def test_retained_bytes_count_each_storage_once():
    # TanhBackward0 saves its own output (already in bytes_growth) and the Linear's
    # AddmmBackward0 saves a view of the weight (kept by the model, not by the graph): neither
    # is retained by keeping the output. What is: the output and the input the graph saved.
    lin = torch.nn.Linear(256, 1024)
    keep = []
    for _ in range(3):
        torch.tanh(lin(torch.randn(64, 256, requires_grad=True))).sum().backward()  # warm-up
    gc.collect()
    a = tt.take_memory_snapshot("a", census=True)
    for _ in range(8):
        keep.append(torch.tanh(lin(torch.randn(64, 256, requires_grad=True))))
    b = tt.take_memory_snapshot("b", census=True)
    g = next(t for t in b.compare(a)["growing_tensors"] if t["grad_fn"] == "TanhBackward0")
    own, saved_input = 64 * 1024 * 4, 64 * 256 * 4
    assert g["count_growth"] == 8 and g["graph_bytes_each"] == saved_input
    assert g["retained_bytes_growth"] == 8 * (own + saved_input)
