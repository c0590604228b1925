"""Fifty slow and garbage clients while training runs: steps keep their pace, the API answers.

A benchmark, not a unit test: it prints the step-time ratio and asserts only a generous bound.
The clients run in another process so that only the server's own cost is measured, and
quiet and loaded blocks alternate so that drift in the machine's load hits both alike.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .debug_helpers import Trainer, call, runtime

ROUNDS = 4
BLOCK = 100
CLIENTS = Path(__file__).with_name("slow_clients.py")


def _step_times(trainer: Trainer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - t0)
    return times


@pytest.fixture
def one_thread():
    """One intra-op thread: on a busy 2-core machine, torch's worker threads make step time
    swing by 100x and drown what this test measures."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_fifty_slow_clients_do_not_slow_training(one_thread, tt_runtime, tiny_model):
    rt = runtime()
    port = rt.server.port
    trainer = Trainer(tiny_model)
    trainer.run(10)  # warm up
    quiet: list[float] = []
    loaded: list[float] = []
    latencies: list[float] = []
    for _ in range(ROUNDS):
        quiet += _step_times(trainer, BLOCK)
        proc = subprocess.Popen([sys.executable, str(CLIENTS), str(port), "60"], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(0.3)
            loaded += _step_times(trainer, BLOCK // 2)
            t0 = time.perf_counter()
            status, _, body = call(port, "GET", "/debug/summary")
            latencies.append(time.perf_counter() - t0)
            assert status == 200 and b'"totals"' in body
            loaded += _step_times(trainer, BLOCK // 2)
            assert proc.poll() is None, "the client process died early"
        finally:
            proc.kill()
            proc.wait(5)
    ratio = statistics.median(loaded) / statistics.median(quiet)
    print(f"\nmedian step: quiet {statistics.median(quiet) * 1e3:.3f} ms, with 50 slow/garbage clients "
          f"{statistics.median(loaded) * 1e3:.3f} ms, ratio {ratio:.3f}; /debug/summary answered in "
          f"{max(latencies) * 1e3:.1f} ms at worst")
    assert max(latencies) < 1.0
    # The client process shares the 2 cores with training, so some slowdown is the machine's,
    # not the server's. A server that blocked the training thread would show as steps of
    # seconds (each slow client holds a connection for up to 10 s): bound the worst step and
    # the median ratio generously; the printed ratio is the measurement.
    assert max(loaded) < 0.5
    assert ratio < 3.0
    # the garbage changed nothing: no clear, no level change, every step recorded
    assert rt.level.value == "basic" and rt.history.totals["steps"] == 10 + 2 * ROUNDS * BLOCK
