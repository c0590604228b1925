"""benchmarks/offload.py: it books what it says it books, and prints every variant's row."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from tests.benchmarks import load

ROOT = Path(__file__).resolve().parents[2]


def test_every_variant_books_every_step_and_the_workers_stop():
    """The queued variants' workers book each step the training thread appended, as many times
    as the inline one (the work handed over is the same work), and stop when asked."""
    offload = load("offload")
    import argparse

    import torch

    wl_args = argparse.Namespace(quick=True, device="cpu", gpu_model=False, only_mlp=True, workloads=None)
    wl = offload.overhead.workloads(wl_args, torch.device("cpu"))[0]
    before = set(threading.enumerate())
    variants, halts = offload.runners(wl, posts=3, poll_s=0.001)
    for name in ("inline", "signal", "poll"):
        for _ in range(5):
            variants[name]()
    for halt in halts:
        halt()
    assert set(threading.enumerate()) <= before  # both workers ended
    ledgers = {}
    for name in ("inline", "signal", "poll"):
        ledgers[name] = variants[name].booker.ledger.throughput("train_step").steps
    assert ledgers == {"inline": 15, "signal": 15, "poll": 15}


def test_prints_a_row_per_variant(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offload.py"), "--rounds", "3", "--steps", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line and not line.startswith("#")}
    assert set(rows) == {"bare", "inline", "signal", "poll"}, proc.stdout
    assert all("ms/step" in row and "vs bare" in row for row in rows.values())
