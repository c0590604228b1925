"""The overhead benchmark's --quick mode runs and prints its table (nothing about time)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks import load

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_benchmark_prints_the_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--quick"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "ms/step" in out and "ratio" in out
    for workload in ("mlp-", "encoder-", "tensors-"):
        assert workload in out, out
    for variant in ("bare", "devfloor", "off", "basic", "advanced", "extreme", "marks", "least", "ideal", "seed", "anomaly"):
        assert any(line.split()[:1] == [variant] for line in out.splitlines()), f"no {variant} row:\n{out}"
    assert "OFF decorated call" in out
    assert "torchtrace_overhead_seconds_total" in out
    assert "throughput features (basic - basic-nothr, paired per round)" in out
    assert "A/A (basic - basic-aa, the same step twice)" in out and "throughput features: " in out
    assert "least phase capture (marks - floor" in out
    assert "least capture (least - floor: marks plus the shape key" in out
    assert "ideal features (ideal - floor: least plus the leanest per-step processing)" in out
    assert "BASIC beyond the device floor (basic - devfloor, paired per round)" in out


def test_the_device_floor_step_reads_the_loss_and_every_gradient_norm():
    """``devfloor``'s step keeps the loss and each gradient's norm for the host, the values a
    check must see, against float64 norms of the gradients taken by a plain loop."""
    import torch

    bench = load("overhead")
    torch.manual_seed(0)
    wl = bench.Workload("mlp", bench.MLP(6, layers=3), lambda d: (torch.randn(4, 6), torch.randn(4, 6)),
                        bench._mse, torch.device("cpu"))
    floor = bench.DeviceFloor(wl)
    wl.optimizer.param_groups[0]["lr"] = 0.0  # the gradients stay those the values were taken from
    loss = floor.step(wl.model, wl.batch)
    grads = [p.grad.double() for p in wl.model.parameters()]
    expected = [float(loss.detach())] + [float(torch.sqrt((g * g).sum())) for g in grads]
    assert len(floor.values) == 1 + 6
    assert floor.values == pytest.approx(expected, rel=1e-6)


def test_median_interval_holds_the_true_median_and_tells_a_shift_from_noise():
    """The bootstrap interval against the normal theory's one for the median of N(0, 1)
    samples: half-width 1.96 * 1.2533 / sqrt(n)."""
    import random

    bench = load("overhead")
    rng = random.Random(7)
    values = [rng.gauss(0.0, 1.0) for _ in range(400)]
    lo, hi = bench.median_interval(values)
    assert lo <= 0.0 <= hi
    theory = 1.96 * 1.2533 / 400 ** 0.5
    assert 0.6 * theory < (hi - lo) / 2 < 1.5 * theory
    lo, hi = bench.median_interval([v + 0.5 for v in values])
    assert lo > 0.0


def test_the_verdict_calls_within_noise_only_an_interval_that_holds_0():
    """Synthetic rounds: a difference that sits inside the A/A pair's spread but whose own
    interval excludes 0 is not called "within noise" (it was, and a slow day's 70 us read so);
    one whose interval holds 0 is; one far past the A/A spread is above noise."""
    bench = load("overhead")

    def verdict(shift: float, aa_spread: float) -> str:
        # Differences spread evenly on both sides of their median: the bootstrap interval of a
        # zero shift holds 0, and one of a 20 us shift with a spread of 2 us excludes it.
        n = 301
        noise = [((i % 21) - 10) / 10 for i in range(n)]
        basic = [1e-3] * n
        nothr = [b - shift - 2e-6 * e for b, e in zip(basic, noise)]
        aa = [b - aa_spread * e for b, e in zip(basic, noise[7:] + noise[:7])]
        lines = bench.throughput_verdict({"bare": basic, "basic": basic, "basic-nothr": nothr, "basic-aa": aa})
        return next(line for line in lines if line.startswith("throughput features: ")).split(": ", 1)[1]

    assert verdict(0.0, 2e-6).startswith("within noise (the interval holds 0)")
    assert verdict(20e-6, 1e-3).startswith("not told apart from noise")  # 20 us against an A/A interval of about +-100 us
    assert verdict(20e-6, 2e-6) == "above noise"


def test_no_variant_runs_twice_in_a_row_more_often_than_chance(monkeypatch):
    """The rounds' orders: a fixed order alternating with its reverse ran the variants at its two
    ends twice in a row every other round (warm caches: the A/A pair read 24.6 us apart on the
    toy model with basic-aa at an end). Each variant now follows itself about as often as chance
    has it (1 in 8 round boundaries with 8 variants), never every other round."""
    bench = load("overhead")
    variants = ["bare", "floor", "marks", "least", "ideal", "basic", "basic-nothr", "basic-aa"]
    ran: list[str] = []

    class Runtime:
        def flush(self, timeout):
            return True

    monkeypatch.setattr(bench, "make_runner", lambda v, wl: lambda: ran.append(v))
    monkeypatch.setattr(bench.tt_api, "get_runtime", lambda: Runtime())
    rounds = 400
    times, _ = bench.run_workload(None, variants, rounds, 2, 0, bench.torch.device("cpu"), budget_s=1e9)
    assert all(len(times[v]) == rounds for v in variants)
    blocks = [v for i, v in enumerate(ran) if i % 3 == 0]  # each block: one untimed step, then two timed
    assert len(blocks) == rounds * len(variants) and all(ran[3 * i:3 * i + 3] == [b] * 3 for i, b in enumerate(blocks))
    for v in variants:
        again = sum(1 for a, b in zip(blocks, blocks[1:]) if a == b == v)
        assert again < rounds // 8, f"{v} ran twice in a row at {again} of {rounds} round boundaries"  # (chance: about 6)
    firsts = {v: sum(1 for r in range(rounds) if blocks[r * len(variants)] == v) for v in variants}
    assert max(firsts.values()) < 0.3 * rounds, firsts  # no variant always opens a round


def test_the_decoder_workload_clips_under_bf16_autocast_and_its_basic_step_clips_alike(tt_runtime):
    """``--gpt``: the step's forward runs in bfloat16 and the update uses gradients clipped to the
    workload's total norm (checked against a float64 norm in a plain loop), with torchtrace's
    step as without it."""
    import argparse

    bench = load("overhead")
    args = argparse.Namespace(gpt=True, gpu_model=False, quick=True, only_mlp=False)
    wl = bench.workloads(args, bench.torch.device("cpu"))[0]
    assert wl.name.startswith("gpt-") and wl.clip == 1.0 and wl.n_tensors > 20
    wl.clip = 1e-3  # far below the raw norm: the clip must act
    dtypes = []
    wl.model.head.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
    for variant in ("bare", "basic"):
        bench.make_runner(variant, wl)()
        norm = sum(float(p.grad.double().pow(2).sum()) for p in wl.model.parameters()) ** 0.5
        assert abs(norm - 1e-3) < 1e-6, (variant, norm)
    assert dtypes == [bench.torch.bfloat16, bench.torch.bfloat16]
