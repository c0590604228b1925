"""The bytecode counter of benchmarks/opcodes.py: exact on code whose bytecodes are known, and
what it says of the throughput features."""

from __future__ import annotations

import dis
import os
import subprocess
import sys
from pathlib import Path

from tests.benchmarks import load

ROOT = Path(__file__).resolve().parents[2]


def _straight(x):
    y = x + 1
    z = (x, y)
    return z


def _loop(n):
    total = 0
    for i in range(n):
        total += _straight(i)[1]
    return total


def test_counts_every_bytecode_a_call_runs():
    """A function without branches runs each of its instructions once (the frame's RESUME
    marker is no event); a loop of n runs its body n times and the other function's n times."""
    count = load("opcodes").count_bytecodes
    straight = [i for i in dis.get_instructions(_straight) if i.opname not in ("RESUME", "CACHE")]
    counts = count(lambda: _straight(3), 7)
    assert counts["benchmarks/test_opcodes.py:_straight"] == 7 * len(straight)
    five, nine = count(lambda: _loop(5), 1), count(lambda: _loop(9), 1)
    assert nine["benchmarks/test_opcodes.py:_straight"] == 9 * len(straight)
    body = (nine["benchmarks/test_opcodes.py:_loop"] - five["benchmarks/test_opcodes.py:_loop"]) / 4
    assert body == int(body) > 0  # each iteration runs the same bytecodes
    assert five["benchmarks/test_opcodes.py:_loop"] - 5 * body == nine["benchmarks/test_opcodes.py:_loop"] - 9 * body


def test_the_script_shows_the_throughput_features_python_work():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "opcodes.py"), "--steps", "20", "--warmup", "5"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    totals = dict(part.split(": ") for part in lines[1].split("   "))
    assert float(totals["basic - basic-nothr"]) > 0  # the features run Python on every step
    assert abs(float(totals["basic"]) - float(totals["basic-nothr"]) - float(totals["basic - basic-nothr"])) < 0.11
    functions = [line.split()[1] for line in lines[2:]]
    # The features' own work at a step's start, at its end (the record's booking) and in the ledger.
    assert {"step/throughput.py:start", "step/throughput.py:account", "record/goodput.py:add_step"} <= set(functions)
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "opcodes.py"), "--variants", "basic"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--variants='basic' is not valid; accepted values: two of" in bad.stderr
