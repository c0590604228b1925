"""What only a CUDA GPU can show: throughput, MFU, mixed precision's skipped steps, memory and
out-of-memory on the device, each against a reference computed another way (CUDA events,
FlopCounterMode, the allocator's own counters, the scaler's own scale).

Skipped without CUDA (CI has none); run on a GPU machine with
``python -m pytest tests/test_cuda_paths.py -rs``. The timings the first test prints are in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import contextlib
import math
import pickle

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import torchtrace as tt
from torchtrace import semconv
from torchtrace.api import get_runtime
from torchtrace.measure.peaks import find_accelerator
from torchtrace.record import events, readout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _configure(tmp_path, **kw):
    return tt.configure(prometheus_port="off", run_dir=str(tmp_path / "runs"), register_atexit=False, strict=True,
                        **kw)


def _device_peak(precision: str) -> float | None:
    row = find_accelerator(torch.cuda.get_device_name())
    return row.flops.get(precision) if row is not None else None


def _stack(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)]).cuda()


def test_bf16_mfu_against_cuda_events_and_the_flop_counter(tmp_path):
    """A GPU-sized bf16 step (the AMP recipe: autocast inside the step) under sync debug
    "error": samples/s and FLOP/s against the device time CUDA events measure over the same
    steps, FLOPs against FlopCounterMode, the peak against the device's bf16 row. (Run on an
    H100 with host-time rates, 2026-11-27: 5-10 % off, so the rates became device time.)"""
    _configure(tmp_path)
    try:
        width, depth, rows = 4096, 8, 2048
        model = _stack(width, depth)
        opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)
        x = torch.randn(rows, width, device="cuda")

        def body(batch):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(batch)
            out.float().pow(2).mean().backward()
            opt.step()

        with FlopCounterMode(display=False) as counter:
            body(x)
        reference_flops = counter.get_total_flops()
        step = tt.debug_operation(name="train_step", model=model, optimizer=opt)(body)
        for _ in range(40):  # the counted step, then enough steps for the launch queue to fill
            step(x)
        measured = 60
        # An event after every step: the reference is taken over the very steps of torchtrace's
        # window (its last N), as the step time varies when other processes share the GPU.
        after = [torch.cuda.Event(enable_timing=True) for _ in range(measured + 1)]
        reads = readout.reads()
        created = events.TIMING.created, events.LANDED.created
        after[0].record()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(measured):
                step(x)
                after[i + 1].record()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        after[-1].synchronize()
        tt.flush()
        rt = get_runtime()
        assert readout.reads() - reads == measured
        # The phase marks and the landed marks reuse finished steps' events: before, every
        # step made five timing events and one more.
        made = events.TIMING.created - created[0], events.LANDED.created - created[1]
        print(f"\nevents made during the {measured} measured steps (timing, landed): {made}")
        assert made[0] < measured and made[1] < measured
        last = rt.history.steps()[-1]
        assert last["flops"] == pytest.approx(reference_flops, rel=0.02)
        tp = rt.throughput.ledger.throughput("train_step")
        assert 0 < tp.steps < measured
        device_s = after[-1 - tp.steps].elapsed_time(after[-1]) / 1e3 / tp.steps
        print(f"\n{torch.cuda.get_device_name()}: device {device_s * 1e3:.3f} ms/step; torchtrace "
              f"{tp.seconds / tp.steps * 1e3:.3f} ms/step over its last {tp.steps}; "
              f"{tp.flops_per_s / 1e12:.1f} TFLOP/s (reference {reference_flops / device_s / 1e12:.1f}); "
              f"MFU {tp.mfu}; peak {rt.throughput.ledger.peak_of('train_step')}")
        # The rates are in device time (the steps' CUDA marks): the same steps' rate as CUDA
        # events measure it around them. (With host cycles they were 5-10 % off on an H100; in
        # device time, 410.7 TFLOP/s against 410.2 there, on 2026-11-27.)
        assert tp.samples_per_s == pytest.approx(rows / device_s, rel=0.05)
        assert tp.flops_per_s == pytest.approx(reference_flops / device_s, rel=0.05)
        peak = _device_peak("bf16")
        if peak is None:
            pytest.skip(f"no peak row for {torch.cuda.get_device_name()}")
        assert rt.throughput.ledger.peak_of("train_step") == peak
        assert tp.mfu == pytest.approx(tp.flops_per_s / peak, rel=1e-9)
        assert 0.05 < tp.mfu < 1.0
    finally:
        tt.shutdown()


def test_fp16_gradscaler_overflow_steps_are_skipped_steps_on_the_gpu(tmp_path):
    """float16 with a GradScaler that starts too high: the scaler skips the first updates. The
    scaler's sign rides in the step's one host read (no sync), the steps it skipped are
    skipped_step badput, the peak is the fp16 row (the step's batch is handed over: FLOPs are
    counted, so there is a peak). Reference: the scaler's own scale, read after
    each step, which drops exactly on the steps it skipped."""
    _configure(tmp_path)
    try:
        model = _stack(512, 4)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 40, growth_interval=1000)
        x = torch.randn(256, 512, device="cuda")
        records, overflowed = [], []
        reads = readout.reads()
        for _ in range(30):
            scale = scaler.get_scale()
            with tt.debug_context("train_step", model=model, optimizer=opt, scaler=scaler, inputs=x) as s:
                opt.zero_grad()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).float().pow(2).mean() * 1e3
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            records.append(s)
            overflowed.append(scaler.get_scale() < scale)
        tt.flush()
        assert readout.reads() - reads == 30
        assert 0 < sum(overflowed) < 30
        got = [s.record.scaler_overflow for s in records]
        assert got == overflowed
        section = get_runtime().summary()["throughput"]
        skipped = sum(s.record.duration_s for s, o in zip(records, overflowed) if o)
        assert section["badput_s"]["skipped_step"] == pytest.approx(skipped, abs=1e-3)
        assert records[-1].record.flops == pytest.approx(6 * 256 * 512 * 512 * 4 - 2 * 256 * 512 * 512, rel=0.02)
        peak = _device_peak("fp16")
        if peak is not None:
            assert get_runtime().throughput.ledger.peak_of("train_step") == peak
    finally:
        tt.shutdown()


def fused_adamw_under_a_scaler(device: str, traced: bool, steps: int = 8) -> tuple[list, list]:
    """Steps of a fused AdamW stepped by an enabled GradScaler under float16 autocast, and for
    each: without torchtrace, the float64 norm of the gradients the fused kernel applies (the
    scaled gradients divided by the scale, read before ``scaler.step``); with it, the step's
    record. The scaler hands the fused optimizer the scaled gradients and ``grad_scale``; the
    kernel unscales them. Traced steps run under ``set_sync_debug_mode("error")`` on CUDA.
    (``tests/step/test_loss_scaler.py`` shows the same on the CPU.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(device, init_scale=1024.0)
    x = torch.randn(256, 64, device=device)
    out = []
    for _ in range(steps):
        debug = torch.cuda.set_sync_debug_mode if traced and device == "cuda" else None
        if debug is not None:
            debug("error")
        try:
            with tt.debug_context("train_step", model=model, optimizer=opt, inputs=x) if traced \
                    else contextlib.nullcontext() as s:
                opt.zero_grad(set_to_none=True)
                with torch.autocast(device, dtype=torch.float16):
                    loss = model(x).float().pow(2).mean()
                scaler.scale(loss).backward()
                if not traced:
                    scale = scaler.get_scale()  # (a host read: the reference run only)
                    out.append(math.sqrt(sum(float((p.grad.double() / scale).pow(2).sum())
                                             for p in model.parameters())))
                scaler.step(opt)
                scaler.update()
        finally:
            if debug is not None:
                debug(0)
        if traced:
            out.append(s)
    return out, [p.detach().clone() for p in model.parameters()]


def test_a_fused_adamw_stepped_by_a_scaler_records_the_unscaled_norm_without_a_sync(tmp_path):
    reference, weights = fused_adamw_under_a_scaler("cuda", traced=False)
    _configure(tmp_path)
    try:
        reads = readout.reads()
        scopes, traced_weights = fused_adamw_under_a_scaler("cuda", traced=True)
        tt.flush()
        assert readout.reads() - reads == len(scopes)
        assert [s.record.grad_norm for s in scopes] == [pytest.approx(r, rel=1e-4) for r in reference]
        assert all(torch.equal(a, b) for a, b in zip(weights, traced_weights))
    finally:
        tt.shutdown()


def test_learning_rates_held_in_device_tensors_ride_in_the_steps_one_read(tmp_path):
    """A capturable Adam whose rates are CUDA tensors, two groups (one a tensor, one a float),
    a scheduler that overwrites the tensor in place after each update: every step's record has
    the rates that update used (reference: the groups' rates read before the update, a sync the
    test makes outside the step), with the step's one read and no synchronisation."""
    _configure(tmp_path)
    try:
        model = _stack(64, 2)
        opt = torch.optim.Adam([{"params": model[0].parameters(), "lr": torch.tensor(0.01, device="cuda")},
                                {"params": model[1].parameters(), "lr": 0.002}], capturable=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        x = torch.randn(32, 64, device="cuda")
        records, seen = [], []
        reads = readout.reads()
        for _ in range(6):
            seen.append([float(g["lr"]) for g in opt.param_groups])  # the rates this update uses
            torch.cuda.set_sync_debug_mode("error")
            try:
                with tt.debug_context("train_step", model=model, optimizer=opt, inputs=x) as s:
                    opt.zero_grad()
                    model(x).pow(2).mean().backward()
                    opt.step()
                    sched.step()  # fills the rate tensor in place
            finally:
                torch.cuda.set_sync_debug_mode(0)
            records.append(s)
        tt.flush()
        assert readout.reads() - reads == 6
        assert [s.record.lr for s in records] == [pytest.approx(r, rel=1e-6) for r in seen]
        assert seen[-1] == pytest.approx([0.0025, 0.0005])
        lr = get_runtime().metrics.value("torchtrace_learning_rate", {"operation": "train_step", "group": "0"})
        assert lr == pytest.approx(0.0025)
    finally:
        tt.shutdown()


def test_micro_batch_phases_are_device_time_against_cuda_events(tmp_path):
    """Four micro-batches a step, each a forward and a backward, then the update, under sync
    debug "error": forward is the four forwards' device time and backward the rest up to the
    update (reference: CUDA events the test records around each call and before the update),
    with the step's one read, and the pauses' events reused from step to step."""
    _configure(tmp_path)
    try:
        model = _stack(2048, 4)
        opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)
        x = torch.randn(2048, 2048, device="cuda")
        marks: list[list] = []

        @tt.debug_operation(name="train_step", model=model, optimizer=opt)
        def step(batch):
            opt.zero_grad(set_to_none=True)
            mine = []
            for micro in batch.chunk(4):
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record()
                out = model(micro)
                after.record()
                out.pow(2).mean().backward()
                mine += [before, after]
            update = torch.cuda.Event(enable_timing=True)
            update.record()
            opt.step()
            marks.append(mine + [update])

        for _ in range(5):  # the counted step, and the event pools' first events
            step(x)
        measured = 20
        reads, created = readout.reads(), events.TIMING.created
        marks.clear()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(measured):
                step(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        tt.flush()
        assert readout.reads() - reads == measured
        assert events.TIMING.created - created < measured
        rows = get_runtime().history.steps()[-measured:]
        for row, mine in zip(rows, marks):
            pairs = list(zip(mine[0:-1:2], mine[1:-1:2]))
            forward = sum(a.elapsed_time(b) for a, b in pairs) / 1e3
            backward = (sum(b.elapsed_time(a) for (_, b), (a, _) in zip(pairs, pairs[1:]))
                        + pairs[-1][1].elapsed_time(mine[-1])) / 1e3
            phases = row["phases"]
            assert phases["forward"] == pytest.approx(forward, rel=0.05, abs=5e-5), (phases, forward)
            assert phases["backward"] == pytest.approx(backward, rel=0.05, abs=5e-5), (phases, backward)
            assert phases["backward"] > phases["forward"]
    finally:
        tt.shutdown()


def test_a_context_without_inputs_gets_its_models_flops_without_a_sync(tmp_path):
    """``debug_context(model=...)`` with no ``inputs=`` on a GPU: keyed by the model's call,
    the steps after a count have FLOPs within 10 % of FlopCounterMode's count of the same
    step, a new shape's step is counted by the step after it, all under sync debug "error"
    with the step's one read each."""
    _configure(tmp_path)
    try:
        model = _stack(1024, 3)
        opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)

        def body(x):
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()

        reference = {}
        for rows in (256, 128):
            with FlopCounterMode(display=False) as counted:
                body(torch.randn(rows, 1024, device="cuda"))
            reference[rows] = counted.get_total_flops()
        batches = [torch.randn(rows, 1024, device="cuda") for rows in (256, 256, 256, 128, 128, 128)]
        torch.cuda.synchronize()
        reads, records = readout.reads(), []
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x in batches:
                with tt.debug_context("train_step", model=model, optimizer=opt) as step:
                    body(x)
                records.append(step.record)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        tt.flush()
        assert readout.reads() - reads == len(batches)
        assert [r.flops_counted for r in records] == [True, False, False, False, True, False]
        assert records[3].flops is None
        for r, x in zip(records, batches):
            if r is not records[3]:
                assert r.flops == pytest.approx(reference[x.shape[0]], rel=0.10)
    finally:
        tt.shutdown()


def test_step_memory_is_the_allocators_own_counters(tmp_path):
    """The step record's CUDA memory: the allocator's counters at the step's end (read on the
    host, no sync); a tensor the step keeps shows in allocated, its temporary in the peak."""
    _configure(tmp_path)
    try:
        kept = []
        mib = 2 ** 20
        for _ in range(3):
            with tt.debug_context("train_step") as s:
                kept.append(torch.empty(64 * mib, dtype=torch.uint8, device="cuda"))
                tmp = torch.empty(256 * mib, dtype=torch.uint8, device="cuda")
                del tmp
            allocated, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        tt.flush()
        mem = s.record.memory
        assert mem["device"] == f"cuda:{torch.cuda.current_device()}"
        assert abs(mem["cuda_allocated_bytes"] - allocated) < mib
        assert mem["cuda_peak_allocated_bytes"] == peak
        assert mem["cuda_peak_allocated_bytes"] >= mem["cuda_allocated_bytes"] + 256 * mib - mib
        assert mem["cuda_reserved_bytes"] >= mem["cuda_allocated_bytes"]
    finally:
        tt.shutdown()


@pytest.mark.parametrize("guard", ["raise", "skip"])
def test_a_real_cuda_oom_is_recorded_with_a_snapshot(tmp_path, guard):
    """A real out-of-memory on the device inside a step: recorded with the allocator's
    statistics and, while the user records memory history, a snapshot that loads; re-raised,
    or with guard="skip" the batch dropped and the next step trains."""
    _configure(tmp_path, guard=guard)
    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        model = _stack(256, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 256, device="cuda")
        too_big = torch.cuda.get_device_properties(0).total_memory * 2

        @tt.debug_operation(model=model, optimizer=opt)
        def train_step(batch, extra):
            opt.zero_grad()
            model(batch).sum().backward()
            torch.empty(extra, dtype=torch.uint8, device="cuda")
            opt.step()

        if guard == "raise":
            with pytest.raises(torch.OutOfMemoryError):
                train_step(x, too_big)
        else:
            train_step(x, too_big)
        tt.flush()
        rec = get_runtime().history.last_record
        assert semconv.OOM in rec.anomaly_kinds and rec.exception_type == "OutOfMemoryError"
        assert rec.oom["cuda"]["num_ooms"] >= 1 and rec.oom["action"] == ("skipped" if guard == "skip" else "raised")
        with open(rec.oom["snapshot"], "rb") as f:
            assert "segments" in pickle.load(f)
        if guard == "skip":
            assert all(p.grad is None for p in model.parameters())
            train_step(x, 16)
            tt.flush()
            assert get_runtime().history.last_record.grad_norm is not None
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        tt.shutdown()
