"""torchtrace_overhead_seconds_total: torchtrace's own time on the training thread, checked
against an independent measurement (instrumented loop minus bare loop)."""

from __future__ import annotations

import statistics
import time

import torch

import torchtrace as tt
from torchtrace import api, semconv


def _overhead_total(rt) -> float:
    value = rt.metrics.registry.get_sample_value(
        semconv.M_OVERHEAD, {"run_id": rt.settings.run_id, "rank": str(rt.identity.rank)})
    assert value is not None, "the overhead counter is not exported"
    return value


def _many_tensor_model(n: int = 400) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(4)) for _ in range(n))
    for p in model:
        p.grad = torch.randn(4)
    return model


def test_overhead_is_counted_and_below_step_time(tt_runtime):
    rt = api.get_runtime()
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8)

    @tt.debug_operation(model=model, optimizer=opt)
    def train_step():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    train_step()
    before = _overhead_total(rt)
    t0 = time.perf_counter()
    for _ in range(20):
        train_step()
    wall = time.perf_counter() - t0
    spent = _overhead_total(rt) - before
    assert 0 < spent < wall
    rec = rt.history.last_record
    assert 0 < rec.overhead_s < rec.duration_s + spent  # the span attribute is part of the total
    # The scrape shows the same counter.
    text = rt.metrics.registry.get_sample_value(semconv.M_OVERHEAD, {"run_id": rt.settings.run_id, "rank": "0"})
    assert text == _overhead_total(rt)


def test_overhead_matches_instrumented_minus_bare(tt_runtime):
    """On a step that does almost nothing, torchtrace is most of the time: its self-measured
    overhead must roughly equal the loop's extra wall time (loose bounds; medians of 5)."""
    rt = api.get_runtime()
    model = _many_tensor_model()
    one = torch.ones(())

    def body():
        return one * 2

    def instrumented():
        with tt.debug_context("tiny", model=model) as scope:
            scope.record_loss(body())

    for _ in range(5):
        body()
        instrumented()
    selfs, deltas = [], []
    steps = 30
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(steps):
            body()
        bare = time.perf_counter() - t0
        before = _overhead_total(rt)
        t0 = time.perf_counter()
        for _ in range(steps):
            instrumented()
        inst = time.perf_counter() - t0
        selfs.append((_overhead_total(rt) - before) / steps)
        deltas.append((inst - bare) / steps)
    s, d = statistics.median(selfs), statistics.median(deltas)
    print(f"self {s * 1e6:.1f} us, added {d * 1e6:.1f} us")
    assert s > 0 and d > 0
    # torchtrace measures itself from inside __enter__/__exit__: it must account for most of
    # the added time, and never claim more than was added.
    assert 0.5 * d <= s <= 1.1 * d, f"self-measured {s * 1e6:.1f} us/step vs added {d * 1e6:.1f} us/step"
    rec = rt.history.last_record
    assert rec.grad_norm is not None and len(rec.grad_names) == 400
