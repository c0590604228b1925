"""The overhead benchmark's --quick mode runs and prints its table (nothing about time)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    for variant in ("bare", "off", "basic", "advanced", "extreme", "seed", "anomaly"):
        assert any(line.split()[:1] == [variant] for line in out.splitlines()), f"no {variant} row:\n{out}"
    assert "OFF decorated call" in out
    assert "torchtrace_overhead_seconds_total" in out
