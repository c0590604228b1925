"""benchmark_optimizations, optimize_training_loop and PyTorchOptimizer."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchtrace as tt
from tests.helpers import read_spans, scrape, value
from tests.optimize.models import DeepMLP, batches
from torchtrace import semconv
from torchtrace.optimize.benchmark import BenchmarkResults, ModeResult, _compare

M = tt.OptimizationMode


def _parse(table: str) -> dict[str, list[str]]:
    rows = {}
    for line in table.splitlines()[2:]:
        cells = line.split()
        if cells and cells[0] in semconv.OPTIMIZATION_MODES:
            rows[cells[0]] = cells
    return rows


def _plain_losses(model, data, steps, lr):
    """NONE's reference: a hand-written loop on another copy."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    out = []
    for i in range(steps):
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def test_benchmark_table_speedups_follow_from_its_medians_and_nothing_leaks(tt_runtime):
    torch.manual_seed(0)
    model = DeepMLP(depth=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = batches(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    buf = io.StringIO()
    res = tt.benchmark_optimizations(model, data, opt, F.mse_loss,
                                     modes=[M.AMP, M.MEMORY_EFFICIENT, M.COMPILATION],
                                     warmup=1, steps=4, compile_backend="eager", file=buf)
    table = buf.getvalue()
    rows = _parse(table)
    assert list(rows) == ["none", "amp", "memory_efficient", "compilation"]  # NONE first, the reference
    base = float(rows["none"][2])
    for mode, cells in rows.items():
        assert cells[1] == "ok"
        median, speedup = float(cells[2]), float(cells[4].rstrip("x"))
        # Printed to 1e-4 ms and 1e-3: the printed speedup lies within the rounding bounds.
        lo = (base - 5e-5) / (median + 5e-5) - 5e-4
        hi = (base + 5e-5) / (median - 5e-5) + 5e-4
        assert lo <= speedup <= hi, (mode, base, median, speedup)
        r = res[mode]
        assert cells[2] == f"{r.median_s * 1e3:.4f}" and len(r.step_times_s) == 4
        t = sorted(r.step_times_s)
        assert r.median_s == pytest.approx((t[1] + t[2]) / 2, rel=1e-12)
    # Same start, same batches, same seed: NONE reproduces a hand-written loop exactly,
    # checkpointing and eager-backend compilation agree with it, AMP within bfloat16 tolerance.
    ref = _plain_losses(model, data, 5, 0.05)
    assert res["none"].losses == pytest.approx(ref, rel=1e-6, abs=0)
    assert res["memory_efficient"].max_abs_loss_diff <= 1e-6
    assert res["compilation"].max_abs_loss_diff <= 1e-6
    assert 0 < res["amp"].max_abs_loss_diff <= 0.02 * max(ref)
    assert res["memory_efficient"].memory_saving > 0  # saved activations, measured
    assert res["memory_efficient"].memory_kind == "saved_activations"
    for k, v in model.state_dict().items():  # the user's model was not trained
        assert torch.equal(v, before[k])
    assert "forward" not in model.blocks[0].__dict__
    # The same numbers as spans and metrics.
    spans = [s for s in read_spans(tt_runtime.spans_path) if s["name"] == "benchmark_optimizations.mode"]
    by_mode = {s["attributes"][semconv.OPT_MODE]: s["attributes"] for s in spans}
    assert by_mode["amp"][semconv.BENCH_SPEEDUP] == pytest.approx(res["amp"].speedup)
    assert by_mode["memory_efficient"][semconv.BENCH_MEMORY_BYTES] == res["memory_efficient"].memory_bytes
    samples = scrape(tt_runtime.metrics_url)
    assert value(samples, semconv.M_OPT_SPEEDUP, mode="amp") == pytest.approx(res["amp"].speedup)
    assert value(samples, semconv.M_OPT_STEP_SECONDS, mode="none") == pytest.approx(res["none"].median_s)
    assert value(samples, semconv.M_OPT_MEMORY, mode="memory_efficient") == res["memory_efficient"].memory_bytes


class AutocastHater(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("this op has no bfloat16 kernel")
        return self.lin(x)


def test_a_failing_mode_is_reported_and_the_others_still_run(tt_runtime):
    buf = io.StringIO()
    res = tt.benchmark_optimizations(AutocastHater(), batches(2), lambda p: torch.optim.SGD(p, lr=0.1),
                                     F.mse_loss, modes=["amp", "memory_efficient"], warmup=0, steps=2, file=buf)
    assert not res["amp"].ok and res["amp"].error == "RuntimeError: this op has no bfloat16 kernel"
    assert res["amp"].speedup is None
    assert res["memory_efficient"].ok and res["memory_efficient"].applied == []
    assert "no repeated blocks" in res["memory_efficient"].skipped["activation_checkpointing"]
    rows = _parse(buf.getvalue())
    assert rows["amp"][1] == "FAILED" and "no bfloat16 kernel" in buf.getvalue()
    span = [s for s in read_spans(tt_runtime.spans_path) if s["name"] == "benchmark_optimizations.mode"
            and s["attributes"][semconv.OPT_MODE] == "amp"][0]
    assert span["status"] == "ERROR"
    assert span["attributes"][semconv.BENCH_ERROR] == "RuntimeError: this op has no bfloat16 kernel"


def test_slower_and_hungrier_modes_are_reported_as_such():
    base = ModeResult(M.NONE, median_s=0.001, memory_bytes=1000, losses=[1.0, 2.0])
    _compare(base, None)
    slow = ModeResult(M.AMP, median_s=0.002, memory_bytes=1500, losses=[1.5, 2.0])
    _compare(slow, base)
    assert slow.speedup == 0.5 and slow.memory_saving == -0.5 and slow.max_abs_loss_diff == 0.5
    out = BenchmarkResults(device="cpu", warmup=0, steps=2, results={M.NONE: base, M.AMP: slow})
    row = _parse(out.table())["amp"]
    assert row[2:7] == ["2.0000", "-", "0.500x", "0.001", "-50.0%"]


def test_optimize_training_loop_trains_in_place_and_times_the_run(tt_runtime):
    torch.manual_seed(0)
    model = DeepMLP(depth=2)
    ref_model = copy.deepcopy(model)
    data = batches(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out = tt.optimize_training_loop(model, data, opt, F.mse_loss, epochs=2, mode="memory_efficient")
    ref = _plain_losses(ref_model, data, 6, 0.05)
    assert out["steps"] == 6 and out["total_time_s"] > 0
    assert out["epoch_mean_loss"] == pytest.approx([sum(ref[:3]) / 3, sum(ref[3:]) / 3], rel=1e-6)
    assert out["final_loss"] == pytest.approx(ref[-1], rel=1e-6)
    assert out["optimization"]["applied"] == ["activation_checkpointing"]
    span = [s for s in read_spans(tt_runtime.spans_path) if s["name"] == "optimize_training_loop"][0]
    assert span["attributes"][semconv.TRAIN_STEPS] == 6


def test_pytorch_optimizer_is_a_thin_wrapper():
    popt = tt.PyTorchOptimizer("amp")
    model = nn.Linear(8, 4)
    assert popt.optimize_model(model).report.applied == ["amp"]
    res = popt.benchmark_optimizations(model, batches(1), torch.optim.SGD(model.parameters(), lr=0.1),
                                       F.mse_loss, modes=["amp"], warmup=0, steps=1, print_table=False)
    assert list(m.value for m in res.results) == ["none", "amp"]
    out = popt.optimize_training_loop(model, batches(2), torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    assert out["mode"] == "amp" and out["steps"] == 2


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="steps"):
        tt.benchmark_optimizations(nn.Linear(8, 4), batches(1), lambda p: torch.optim.SGD(p, lr=0.1),
                                   F.mse_loss, steps=0)
    with pytest.raises(ValueError, match="modes='turbo'"):
        tt.benchmark_optimizations(nn.Linear(8, 4), batches(1), lambda p: torch.optim.SGD(p, lr=0.1),
                                   F.mse_loss, modes=["turbo"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_benchmark_with_float16_amp_and_compilation():  # pragma: no cover - no GPU in CI
    torch.manual_seed(0)
    model = DeepMLP(d=64, depth=4).cuda()
    buf = io.StringIO()
    res = tt.benchmark_optimizations(model, batches(3), torch.optim.AdamW(model.parameters(), lr=1e-3),
                                     F.mse_loss, modes=["amp", "compilation", "full_optimization"],
                                     warmup=3, steps=10, file=buf)
    assert res["amp"].applied == ["amp"] and res["amp"].memory_kind == "cuda_peak_allocated"
    assert all(r.ok for r in res.results.values()), buf.getvalue()
    assert res["amp"].max_abs_loss_diff < 0.05


def test_results_are_a_mapping_with_the_seeds_keys():
    """Issue 20: .items() on benchmark_optimizations' result raised AttributeError."""
    model = nn.Linear(8, 4)
    res = tt.benchmark_optimizations(model, batches(2), lambda p: torch.optim.SGD(p, lr=0.1), F.mse_loss,
                                     modes=["amp"], warmup=1, steps=3, print_table=False)
    assert [m for m, _ in res.items()] == ["none", "amp"] and list(res) == res.keys() and len(res) == 2
    for mode, result in res.items():
        assert "error" not in result
        assert result["total_time"] == pytest.approx(sum(res[mode].step_times_s))
        assert result["speedup_factor"] == res[mode].speedup and result["memory_savings"] == res[mode].memory_saving
    assert "amp" in res and "compilation" not in res and "turbo" not in res
    def broken_loss(out, y):
        raise RuntimeError("loss failed")

    failing = tt.benchmark_optimizations(model, batches(1), lambda p: torch.optim.SGD(p, lr=0.1), broken_loss,
                                         modes=["amp"], warmup=0, steps=1, print_table=False)
    for _, result in failing.items():  # a failed mode never wins min(results.items(), key=total_time)
        assert "loss failed" in result["error"] and result["total_time"] == float("inf")


def test_the_benchmark_leaves_the_global_generators_where_it_found_them():
    """``benchmark_optimizations`` seeds each mode's training (``seed=``), which reset torch's
    global generator: a script that benchmarked, then trained, drew other dropout masks and
    other shuffles than without the benchmark (its next ``torch.rand`` read the seeded
    generator's). Now the generators (torch's, Python's, NumPy's) are as it found them."""
    import random

    import numpy as np

    model = DeepMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    tt.benchmark_optimizations(model, batches(), opt, F.mse_loss, modes=["none"], warmup=0, steps=1,
                               measure_memory=False, print_table=False)
    drawn = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(drawn[0], expected[0]) and drawn[1:] == expected[1:]
