"""Open labels stay bounded: 10,000 distinct names never make more series than the caps."""

from __future__ import annotations

import collections

import torch

import torchtrace as tt
from torchtrace import semconv
from torchtrace.api import get_runtime
from torchtrace.export.metrics import MAX_LABEL_VALUES, OVERFLOW, Metrics
from torchtrace.record.step import StepRecord


def _series_per_family(registry) -> dict[str, int]:
    out: dict[str, set] = collections.defaultdict(set)
    for family in registry.collect():
        for sample in family.samples:
            out[family.name].add(tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le")))
    return {name: len(sets) for name, sets in out.items()}


def test_ten_thousand_module_names_stay_under_every_cap():
    m = Metrics("run", 0, "0", "basic")
    caps = m.series_caps()
    for i in range(10_000):
        name = f"model.layers.{i}.attn.q_proj"
        rec = StepRecord(operation=name, step=i, level="basic", start_unix_ns=1, end_unix_ns=2, duration_s=0.01,
                         memory={"rss_bytes": 1, "device": f"cuda:{i}", "cuda_allocated_bytes": 1,
                                 "cuda_reserved_bytes": 1, "cuda_peak_allocated_bytes": 1})
        rec.loss = 1.0
        rec.grad_norm = 1.0
        rec.memory_slopes = {name: 1.0}
        m.observe_step(rec)
        m.count_anomaly(name, name)  # a kind outside the closed set
        m.count_anomaly(name, semconv.ANOMALY_KINDS_ALL[i % len(semconv.ANOMALY_KINDS_ALL)])
        m.drop_spans(name, 1)
        m.internal_error(name)
    seen = _series_per_family(m.registry)
    for family, cap in caps.items():
        assert seen.get(family, 0) <= cap, (family, seen.get(family), cap)
    # The overflow series took the rest: the step counter still counts every step.
    steps = {s.labels["operation"]: s.value for f in m.registry.collect() if f.name == "torchtrace_steps"
             for s in f.samples if s.name.endswith("_total")}
    assert len(steps) == MAX_LABEL_VALUES + 1
    assert steps[OVERFLOW] == 10_000 - MAX_LABEL_VALUES
    assert sum(steps.values()) == 10_000
    assert seen["torchtrace_steps"] == caps["torchtrace_steps"]


def test_operation_names_through_steps_are_capped(tt_runtime):
    rt = get_runtime()
    for i in range(300):
        with tt.debug_context(f"op_{i}"):
            pass
    rt.finish_deferred(block=True)
    seen = _series_per_family(rt.metrics.registry)
    caps = rt.metrics.series_caps()
    for family, cap in caps.items():
        assert seen.get(family, 0) <= cap, family


def test_documented_series_count_for_one_operation(tt_runtime, tiny_model):
    """docs/reliability.md: a BASIC CPU job with one operation exports 55 label sets per rank, and each
    further operation 27; 3 more where CUDA is in use (in a process that used a GPU before, as on
    a GPU machine running the whole suite, the memory gauge has the device's series too); and
    one counter each for samples, tokens, FLOPs an operation reports (here samples and FLOPs: the
    batch of the model's call, and the FLOPs counted on its shapes)."""
    rt = get_runtime()
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
    for _ in range(3):
        with tt.debug_context("train_step", model=tiny_model, optimizer=opt) as step:
            loss = tiny_model(torch.ones(4, 8)).pow(2).mean()
            loss.backward()
            step.record_loss(loss)
            opt.step()
            opt.zero_grad()
    rt.finish_deferred(block=True)
    seen = _series_per_family(rt.metrics.registry)
    cuda = 3 if torch.cuda.is_initialized() else 0  # allocated, reserved, peak_allocated (docs: a CUDA device adds 3)
    # steps, duration, loss, grad_norm, grad_nonfinite, last_step, memory{cpu,rss}, spans_dropped x3 reasons,
    # overhead, build_info, rank skew; and the counters created at zero for alert rules: anomalies for
    # every kind, skipped steps for the operation, internal errors for every component.
    expected = {"torchtrace_steps": 1, "torchtrace_step_duration_seconds": 1, "torchtrace_loss": 1,
                "torchtrace_grad_norm": 1, "torchtrace_grad_nonfinite_tensors": 1,
                "torchtrace_last_step_timestamp_seconds": 1, "torchtrace_memory_bytes": 1 + cuda,
                "torchtrace_spans_dropped": 3, "torchtrace_overhead_seconds": 1, "torchtrace_build_info": 1,
                "torchtrace_rank_step_skew": 1, "torchtrace_anomalies": len(semconv.ANOMALY_KINDS_ALL),
                "torchtrace_skipped_steps": 1, "torchtrace_internal_errors": len(semconv.COMPONENTS),
                "torchtrace_badput_seconds": len(semconv.BADPUT_KINDS), "torchtrace_goodput_ratio": 1,
                "torchtrace_learning_rate": 1, "torchtrace_data_wait_seconds": 1,
                "torchtrace_step_phase_seconds": len(semconv.PHASES),
                "torchtrace_samples": 1, "torchtrace_flops": 1,  # "samples, tokens and FLOPs add one counter each"
                # the hang series (docs/hangs.md): one phase series per phase
                "torchtrace_stalled_seconds": 1, "torchtrace_hang_timeout_seconds": 1, "torchtrace_hangs": 1,
                "torchtrace_collectives": 1, "torchtrace_phase": len(semconv.TRAINING_PHASES),
                # the job's 4: attempt, job goodput, checkpoint time by kind (save, load)
                "torchtrace_job_attempt": 1, "torchtrace_job_goodput_ratio": 1, "torchtrace_checkpoint_seconds": 2}
    assert {k: v for k, v in seen.items() if v} == expected
    assert sum(expected.values()) - 2 - 4 == 68 + cuda
    # docs/reliability.md: each extra operation adds 28 (6 gauges and histograms, every anomaly
    # kind, skipped, learning rate, data wait, 3 phases).
    with tt.debug_context("finetune_step", model=tiny_model, optimizer=opt) as step:
        loss = tiny_model(torch.ones(4, 8)).pow(2).mean()
        loss.backward()
        step.record_loss(loss)
        opt.step()
    rt.finish_deferred(block=True)
    added = sum(_series_per_family(rt.metrics.registry).values()) - 68 - 4 - 2 - cuda
    assert added - 2 == 6 + len(semconv.ANOMALY_KINDS_ALL) + 1 + 1 + 1 + len(semconv.PHASES) == 28  # and samples, FLOPs
