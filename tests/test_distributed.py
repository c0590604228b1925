"""Single-process parts of torchtrace.distributed: identity, files, ports, skew, trace ids."""

from __future__ import annotations

import collections
import json
import socket

import pytest
import torch

import torchtrace as tt
from torchtrace import distributed as d
from torchtrace.config import Settings
from torchtrace.distributed.collectives import STATE
from torchtrace.export.server import TelemetryServer
from torchtrace.export.trace_ids import step_trace_id
from torchtrace.measure import gradients as grad_measure
from torchtrace.probes.straggler import StepSpan, held_since_ns, own_mean_seconds, own_step_seconds, skew
from torchtrace.record.policy import agree_any


def test_identity_from_torchrun_environment():
    ident = d.identity({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                        "GROUP_RANK": "1"})
    assert (ident.rank, ident.local_rank, ident.world_size, ident.local_world_size, ident.node_rank) == (3, 1, 4, 2, 1)
    assert ident.distributed and len(ident.instance_id) == 32
    assert d.identity({"RANK": "3"}).instance_id != ident.instance_id
    single = d.identity({"RANK": "x"})
    assert (single.rank, single.world_size, single.distributed) == (0, 1, False)


def test_rank_file_names_never_collide():
    names = {d.rank_file_name("spans", ".jsonl", d.Identity(rank=r, world_size=4)) for r in range(4)}
    assert names == {f"spans.rank{r}.jsonl" for r in range(4)}
    assert d.rank_file_name("report", ".json", d.Identity()) == "report.json"


def test_port_fallback_strides_by_local_world_size():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", base))
    blocker.listen(1)
    server = TelemetryServer(__import__("prometheus_client").CollectorRegistry(), "127.0.0.1")
    try:
        port = server.start(base, "next", stride=4)
        assert port not in (base, base + 1, base + 2, base + 3)  # other local ranks' ports are never taken
        if base < port < base + 4 * 64:
            assert (port - base) % 4 == 0
    finally:
        server.stop()
        blocker.close()


def test_skew_is_slowest_over_median():
    assert skew([1.0, 1.0, 1.0]) == 1.0
    assert skew([1.0, 2.0, 4.0]) == 2.0
    assert skew([0.0, 0.0]) == 1.0


@pytest.mark.parametrize("times", [
    [0.00705, 0.03266],                # two ranks 4.63x apart (the probe's torchrun run)
    [0.01, 0.03], [0.03, 0.01],
    [0.01, 0.01, 0.01, 0.05],          # an even world, one straggler
    [0.02, 0.01, 0.04, 0.03, 0.05, 0.06],
    [1.0, 2.0, 4.0], [3.0, 1.0, 1.0, 1.0, 2.0],  # odd worlds: the median is a rank already
])
def test_skew_divides_by_a_real_rank_the_lower_median(times):
    # The "median rank" is a rank: the lower of the two middle ones when the world is even (with
    # two ranks, the faster one), so two ranks 4.63x apart read 4.63, not max over their mean
    # (which can never reach 2 and kept RankStraggler quiet on a 3x straggler).
    lower_middle = sorted(times)[(len(times) - 1) // 2]
    assert lower_middle in times
    assert skew(times) == pytest.approx(max(times) / lower_middle)


MS = 1_000_000  # nanoseconds


def _entry(record_id: int, created_ms: float) -> dict:
    return {"record_id": record_id, "time_created_ns": int(created_ms * MS), "profiling_name": "gloo:all_reduce"}


def test_own_step_time_ends_at_the_last_collective_before_the_backward_ended():
    # DDP's buckets at 20 and 55 ms, a collective after the backward (the user's loss average) at 80 ms.
    step = StepSpan(start_ns=0, backward_end_ns=70 * MS, wall_s=0.09)
    assert own_step_seconds([20 * MS, 55 * MS, 80 * MS], 0, step) == pytest.approx(0.055)
    assert own_step_seconds([80 * MS], 0, step) == pytest.approx(0.09)  # none inside: no wait, the wall time
    assert own_step_seconds([-5 * MS], 0, step) == pytest.approx(0.09)  # (the step before's)


def test_a_step_older_than_what_the_recorder_holds_has_no_own_time():
    step = StepSpan(start_ns=100 * MS, backward_end_ns=150 * MS, wall_s=0.06)
    assert own_step_seconds([], 120 * MS, step) is None  # the ring dropped what it entered
    assert own_step_seconds([140 * MS], 120 * MS, step) == pytest.approx(0.04)  # its last one is still held
    assert own_step_seconds([], 100 * MS, step) == pytest.approx(0.06)


def test_the_recorder_holds_everything_until_it_drops_its_first_entry():
    assert held_since_ns([]) == 0
    assert held_since_ns([_entry(0, 5), _entry(1, 9)]) == 0
    assert held_since_ns([_entry(7, 5), _entry(8, 9)]) == 5 * MS


def test_own_mean_leaves_out_torchtrace_own_collectives(monkeypatch):
    steps = [StepSpan(0, 70 * MS, 0.08), StepSpan(100 * MS, 170 * MS, 0.08)]
    entries = [_entry(0, 10), _entry(1, 60), _entry(2, 110), _entry(3, 150)]
    assert own_mean_seconds(entries, steps) == pytest.approx((0.06 + 0.05) / 2)
    # The collective at 60 ms was torchtrace's own (a guard's agreement run with throughput off).
    monkeypatch.setattr(STATE, "spans", collections.deque([(59 * MS, 61 * MS)]))
    assert own_mean_seconds(entries, steps) == pytest.approx((0.01 + 0.05) / 2)


def test_own_mean_falls_back_to_wall_time():
    steps = [StepSpan(0, 70 * MS, 0.08), StepSpan(100 * MS, 170 * MS, 0.06)]
    assert own_mean_seconds(None, steps) == pytest.approx(0.07)  # no recorder
    assert own_mean_seconds([], steps) == pytest.approx(0.07)  # no collective in any step
    assert own_mean_seconds([_entry(9, 500)], steps) == pytest.approx(0.07)  # none known any more


def test_two_ranks_three_times_apart_cross_the_straggler_threshold():
    assert skew([0.01, 0.03]) == pytest.approx(3.0)
    assert skew([0.01, 0.016]) > 1.5


def test_settings_for_distributed_features():
    s = Settings.resolve({}, environ={"TORCHTRACE_SHARED_STEP_TRACE": "1", "TORCHTRACE_RANK_SKEW_INTERVAL": "off"})
    assert s.shared_step_trace is True and s.rank_skew_interval is None
    assert Settings.resolve({}, environ={}).rank_skew_interval == 50
    with pytest.raises(ValueError, match="rank_skew_interval"):
        Settings.resolve({"rank_skew_interval": 0}, environ={})
    with pytest.raises(ValueError, match="shared_step_trace"):
        Settings.resolve({"shared_step_trace": "maybe"}, environ={})


def test_shared_step_trace_ids_are_derived_from_run_and_step(tmp_path):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), run_id="run-a", shared_step_trace=True,
                 register_atexit=False, strict=True)
    for _ in range(2):
        with tt.debug_context("train_step") as step:
            with tt.debug_context("inner") as inner:
                pass
    assert step.record.trace_id == format(step_trace_id("run-a", "train_step", 1), "032x")
    assert inner.record.trace_id == step.record.trace_id  # nested spans stay in the step's trace
    assert step_trace_id("run-a", "train_step", 1) != step_trace_id("run-a", "train_step", 2)
    assert step_trace_id("run-b", "train_step", 1) != step_trace_id("run-a", "train_step", 1)
    tt.shutdown()
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), run_id="run-a", register_atexit=False)
    with tt.debug_context("train_step", step=1) as plain:
        pass
    assert plain.record.trace_id != format(step_trace_id("run-a", "train_step", 1), "032x")


def test_single_process_norms_are_global_and_issue_no_collective(tt_runtime, tiny_model):
    before = dict(STATE.counts)
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
    with tt.debug_context("train_step", model=tiny_model, optimizer=opt) as step:
        tiny_model(torch.randn(3, 8)).sum().backward()
        opt.step()
    assert step.record.grad_norm_scope == "global"
    assert dict(STATE.counts) == before
    assert agree_any(True) is True and agree_any(False) is False
    report = json.loads(json.dumps(tt.api.get_runtime().summary()["distributed"]))
    assert report["world_size"] == 1 and report["rank_skew"] is None


def test_dtensor_on_a_one_rank_mesh_needs_no_collective(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.randn(6, 3, dtype=torch.float64)
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 3, dtype=torch.float64), mesh, [Shard(0)]))
        p.grad = distribute_tensor(g, mesh, [Shard(0)])
        stats = grad_measure.gradient_norms([grad_measure.ParamRef("w", p)])
        assert stats.scope == "global"
        assert float(stats.total) == pytest.approx(float(g.norm()), rel=1e-12)
    finally:
        dist.destroy_process_group()
