"""Profiler windows: Chrome trace per window, ProfilerStep per profiled step, path and top ops on spans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import torchtrace as tt
from torchtrace import semconv
from torchtrace.api import get_runtime
from torchtrace.probes import find_probe
from torchtrace.probes.profiler import ProfilerProbe, ProfileSchedule, cap_trace


def _spans(result) -> list[dict]:
    tt.flush()
    return [json.loads(line) for line in result.spans_path.read_text().splitlines()]


def _train(model, steps, start=0, nan_at=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    for i in range(start, start + steps):
        with tt.debug_context("train_step", model=model, optimizer=opt) as step:
            loss = model(x).pow(2).mean()
            if nan_at == i:
                loss = loss * float("nan")
            loss.backward()
            step.record_loss(loss)
            opt.step()
            opt.zero_grad()


def _profiler_steps(path) -> list[str]:
    doc = json.loads(open(path).read())
    return sorted({e["name"] for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")})


def test_window_writes_trace_with_one_profiler_step_per_step(tt_runtime, tiny_model, tmp_path):
    out = tmp_path / "prof" / "t.json"
    with tt.profiling(out, ProfileSchedule(steps=[2], active=3)) as res:
        _train(tiny_model, 7)
    assert len(res["windows"]) == 1
    path = res["path"]
    assert _profiler_steps(path) == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    spans = _spans(tt_runtime)
    by_step = {s["attributes"][semconv.STEP]: s for s in spans if s["name"] == "train_step"}
    for step in (2, 3, 4):
        assert by_step[step]["attributes"][semconv.PROFILE_TRACE_PATH] == path
        assert by_step[step]["attributes"][semconv.PROFILE_REASON] == "schedule"
    for step in (0, 1, 5, 6):
        assert semconv.PROFILE_TRACE_PATH not in by_step[step]["attributes"]
    ops = [e for e in by_step[4]["events"] if e["name"] == semconv.EVENT_PROFILE_OP]
    assert 1 <= len(ops) <= 10
    names = [e["attributes"][semconv.PROFILE_OP_NAME] for e in ops]
    assert any("addmm" in n or "linear" in n for n in names)
    selfs = [e["attributes"][semconv.PROFILE_OP_SELF_CPU_US] for e in ops]
    assert selfs == sorted(selfs, reverse=True)  # ordered by self time (no device time on CPU)
    assert not any(e["name"] == semconv.EVENT_PROFILE_OP for e in by_step[3]["events"])


def test_window_never_exceeds_step_cap_and_rate_limit(tt_runtime, tiny_model, tmp_path):
    sched = ProfileSchedule(every=4, active=50, max_window_steps=2, max_windows=2)
    with tt.profiling(tmp_path / "p" / "x.json", sched) as res:
        _train(tiny_model, 20)
    assert len(res["windows"]) == 2  # max_windows
    assert [w["steps"] for w in res["windows"]] == [[0, 1], [4, 5]]
    for w in res["windows"]:
        assert len(_profiler_steps(w["path"])) == 2


def test_trace_size_cap(tmp_path):
    path = tmp_path / "trace.json"
    events = [{"ph": "X", "name": f"op{i}", "dur": i, "ts": i, "pid": 1, "tid": 1, "args": {"pad": "x" * 100}}
              for i in range(500)]
    events.append({"ph": "X", "name": "ProfilerStep#7", "dur": 1, "ts": 0, "pid": 1, "tid": 1})
    path.write_text(json.dumps({"traceEvents": events}))
    dropped = cap_trace(path, 8192)
    doc = json.loads(path.read_text())
    assert path.stat().st_size <= 8192
    assert dropped == 501 - len(doc["traceEvents"]) > 0
    kept = [e["name"] for e in doc["traceEvents"]]
    assert "ProfilerStep#7" in kept
    durs = [e["dur"] for e in doc["traceEvents"] if e["name"] != "ProfilerStep#7"]
    assert min(durs) > max(set(range(500)) - set(durs))  # the longest events are the ones kept


def test_trace_size_cap_holds_when_a_gpus_header_alone_is_larger(tmp_path):
    """On an H100 the trace of a two-step window on a tiny model kept 7,649 bytes under a
    6,000-byte cap with every event dropped: the device properties and the metadata events
    (one per GPU stream) were kept whole. The cap holds: they go first, the steps stay."""
    path = tmp_path / "trace.json"
    device = {"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85017493504, "pad": "p" * 5000}
    meta = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": t, "args": {"name": f"stream {t} " + "s" * 60}}
            for t in range(60)]
    steps = [{"ph": "X", "name": f"ProfilerStep#{i}", "dur": 5, "ts": i * 10, "pid": 1, "tid": 1} for i in (0, 1)]
    ops = [{"ph": "X", "name": f"op{i}", "dur": i, "ts": i, "pid": 1, "tid": 1} for i in range(300)]
    path.write_text(json.dumps({"schemaVersion": 1, "deviceProperties": [device], "traceEvents": meta + steps + ops}))
    cap_trace(path, 4096)
    doc = json.loads(path.read_text())
    assert path.stat().st_size <= 4096
    assert [e["name"] for e in doc["traceEvents"] if e["name"].startswith("ProfilerStep#")] == ["ProfilerStep#0",
                                                                                              "ProfilerStep#1"]
    assert doc["schemaVersion"] == 1 and "deviceProperties" not in doc
    assert doc["torchtrace_dropped_events"] == len(meta) + len(steps) + len(ops) - len(doc["traceEvents"])


def test_capped_window_on_disk(tt_runtime, tiny_model, tmp_path):
    with tt.profiling(tmp_path / "c" / "x.json", ProfileSchedule(steps=[0], active=2, max_trace_bytes=6000)) as res:
        _train(tiny_model, 3)
    path = res["path"]
    assert open(path).read() and len(open(path).read().encode()) <= 6000
    assert _profiler_steps(path) == ["ProfilerStep#0", "ProfilerStep#1"]


def test_anomaly_triggers_window(tt_runtime, tiny_model, tmp_path):
    with tt.profiling(tmp_path / "a" / "x.json", ProfileSchedule(on_anomaly=True, active=1, min_interval_steps=10)) as res:
        _train(tiny_model, 6, nan_at=2)
    assert [(w["reason"], w["steps"]) for w in res["windows"]] == [("anomaly", [3])]


def test_profiling_mode_uses_default_schedule(tmp_path):
    tt.configure(mode="profiling", prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False)
    model = torch.nn.Linear(8, 2)
    _train(model, 8)
    probe = find_probe(get_runtime(), ProfilerProbe)
    assert [w["steps"] for w in probe.windows] == [[5, 6]]
    assert probe.windows[0]["path"].startswith(str(tmp_path))
    tt.shutdown()


def test_a_users_own_profiler_is_left_running(tmp_path, caplog):
    """The user profiles the steps with torch.profiler themselves while torchtrace runs in
    profiling mode: opening a window would end their session (their profile came back empty).
    torchtrace's window steps aside, says so once, and opens again once theirs has ended."""
    tt.configure(mode="profiling", prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False)
    model = torch.nn.Linear(8, 2)
    with caplog.at_level("WARNING", logger="torchtrace"):
        with torch.profiler.profile() as theirs:
            _train(model, 8)
    names = {e.key for e in theirs.key_averages()}
    assert "aten::addmm" in names or "aten::linear" in names, sorted(names)[:20]
    probe = find_probe(get_runtime(), ProfilerProbe)
    assert probe.windows == []
    assert len([r for r in caplog.records if "a profiler is already running" in r.getMessage()]) == 1
    probe.armed = "anomaly"  # a trigger after their profiler ended: the window opens
    _train(model, 2, start=8)
    assert [w["steps"] for w in probe.windows] == [[8, 9]]
    tt.shutdown()


def test_level_change_turns_default_windows_off(tmp_path):
    tt.configure(mode="profiling", prometheus_port="off", run_dir=str(tmp_path), strict=True, register_atexit=False)
    rt = get_runtime()
    rt.set_level("basic", "none")
    _train(torch.nn.Linear(8, 2), 8)
    assert find_probe(rt, ProfilerProbe).windows == []
    tt.shutdown()


def test_manual_block_profiles_everything(tt_runtime, tiny_model, tmp_path):
    out = tmp_path / "m.json"
    dbg = tt.PyTorchDebugger()
    with dbg.profiling(output_file=out) as res:
        _train(tiny_model, 2)
        torch.ones(3) + 1
    assert res["path"] == str(out)
    assert _profiler_steps(out) == ["ProfilerStep#0", "ProfilerStep#1"]


def test_manual_block_without_runtime(tmp_path):
    tt.configure(disabled=True)
    with tt.profiling(tmp_path / "n.json") as res:
        torch.ones(3).sum()
    assert json.loads(open(res["path"]).read())["traceEvents"]


def test_schedule_validation():
    with pytest.raises(ValueError, match="active"):
        ProfileSchedule(active=0)
    with pytest.raises(ValueError, match="max_trace_bytes"):
        ProfileSchedule(max_trace_bytes=10)


def test_step_time_regression_arms_a_window(tt_runtime):
    from types import SimpleNamespace

    from torchtrace.levels import Features
    from torchtrace.record.step import StepRecord

    probe = find_probe(get_runtime(), ProfilerProbe)
    saved = probe.open_schedule(ProfileSchedule(regression_factor=3.0, regression_window=16))
    scope = SimpleNamespace(features=Features(), step=0)

    def feed(duration):
        probe.finish(scope, None, StepRecord("s", 0, "basic", 0, duration_s=duration), None)

    for _ in range(8):
        feed(0.010)
    feed(0.029)  # under 3x the median
    assert probe.armed is None
    feed(0.031)
    assert probe.armed == "regression"
    probe.restore(saved)


def test_nested_step_is_part_of_the_profiled_step(tt_runtime, tiny_model, tmp_path):
    with tt.profiling(tmp_path / "n" / "x.json", ProfileSchedule(steps=[0], active=1)) as res:
        with tt.debug_context("outer"):
            with tt.debug_context("inner"):
                tiny_model(torch.ones(1, 8))
    assert _profiler_steps(res["path"]) == ["ProfilerStep#0"]
    assert res["windows"][0]["steps"] == [0]


def test_a_user_chosen_trace_directory_keeps_its_permissions(tt_runtime, tmp_path):
    shared = tmp_path / "shared-traces"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with tt.profiling(shared / "block.json") as res:
        with tt.debug_context("train_step"):
            torch.ones(4).sum()
    assert (shared.stat().st_mode & 0o777) == 0o755
    assert (Path(res["path"]).stat().st_mode & 0o777) == 0o600
    assert not [p for p in shared.iterdir() if p.name.endswith(".tmp")]


def test_a_symlink_at_the_trace_path_is_replaced_not_followed(tt_runtime, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "traces"
    out.mkdir()
    (out / "block.json").symlink_to(victim)
    with tt.profiling(out / "block.json"):
        torch.ones(4).sum()
    assert victim.read_text() == "keep me"
    assert not (out / "block.json").is_symlink()


class _Boom(Exception):
    pass


def test_an_exception_in_the_block_passes_through_and_the_trace_is_still_written(tt_runtime, tiny_model, tmp_path):
    probe = find_probe(get_runtime(), ProfilerProbe)
    before = (probe.schedule, probe.output, probe.window)
    boom = _Boom("user's own")
    out = tmp_path / "b.json"
    with pytest.raises(_Boom) as caught:
        with tt.profiling(out) as res:
            _train(tiny_model, 1)
            raise boom
    assert caught.value is boom
    assert res["path"] == str(out) and _profiler_steps(out) == ["ProfilerStep#0"]
    assert (probe.schedule, probe.output, probe.window) == before


def test_an_exception_in_a_scheduled_block_passes_through_and_the_probe_is_restored(tt_runtime, tiny_model, tmp_path):
    probe = find_probe(get_runtime(), ProfilerProbe)
    before = (probe.schedule, probe.output, probe.window)
    boom = _Boom("user's own")
    with pytest.raises(_Boom) as caught:
        with tt.profiling(tmp_path / "s" / "x.json", ProfileSchedule(steps=[1], active=5)) as res:
            _train(tiny_model, 3)
            raise boom
    assert caught.value is boom
    assert [w["steps"] for w in res["windows"]] == [[1, 2]]
    assert res["path"] == res["windows"][0]["path"] and Path(res["path"]).exists()
    assert (probe.schedule, probe.output, probe.window) == before


def test_an_exception_in_a_block_without_runtime_passes_through_and_the_trace_is_still_written(tmp_path):
    tt.configure(disabled=True)
    boom = _Boom("user's own")
    with pytest.raises(_Boom) as caught:
        with tt.profiling(tmp_path / "n.json") as res:
            torch.ones(3).sum()
            raise boom
    assert caught.value is boom
    assert json.loads(open(res["path"]).read())["traceEvents"]


def test_a_schedule_without_runtime_fails_before_the_block_runs(tmp_path):
    tt.configure(disabled=True)
    ran = []
    with pytest.raises(RuntimeError, match="configured torchtrace runtime"):
        with tt.profiling(tmp_path / "x.json", ProfileSchedule(steps=[0], active=1)):
            ran.append(1)
    assert ran == []
