"""Fifty slow and garbage clients while training runs: steps keep their pace, the API answers.

The clients run in another process. In control blocks the same clients are aimed at a
stand-in server in a third process (``sink_server.py``), so the machine carries the same
client load while torchtrace's server is idle; in loaded blocks they hit torchtrace's
server. Control and loaded blocks alternate so drift in the machine's load hits both alike,
and the ratio of their median step times is what the server itself costs the training
thread. (Compared with quiet blocks instead, the ratio mostly measured the client process
taking a core from training on this 2-core machine: 0.98 to 3.2 from run to run.)
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
SINK = Path(__file__).with_name("sink_server.py")


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
    control: list[float] = []
    loaded: list[float] = []
    latencies: list[float] = []
    sink = subprocess.Popen([sys.executable, str(SINK)], stdout=subprocess.PIPE, text=True)
    try:
        sink_port = int(sink.stdout.readline())
        for _ in range(ROUNDS):
            for target in (sink_port, port):
                proc = subprocess.Popen([sys.executable, str(CLIENTS), str(target), "60"], stdout=subprocess.PIPE,
                                        text=True)
                try:
                    assert proc.stdout.readline().strip() == "ready"
                    time.sleep(0.3)
                    times = _step_times(trainer, BLOCK // 2)
                    if target == port:
                        t0 = time.perf_counter()
                        status, _, body = call(port, "GET", "/debug/summary")
                        latencies.append(time.perf_counter() - t0)
                        assert status == 200 and b'"totals"' in body
                    times += _step_times(trainer, BLOCK // 2)
                    assert proc.poll() is None, "the client process died early"
                finally:
                    proc.kill()
                    proc.wait(5)
                (loaded if target == port else control).extend(times)
    finally:
        sink.kill()
        sink.wait(5)
    ratio = statistics.median(loaded) / statistics.median(control)
    print(f"\nmedian step with 50 slow/garbage clients: at a stand-in server {statistics.median(control) * 1e3:.3f} ms, "
          f"at torchtrace's server {statistics.median(loaded) * 1e3:.3f} ms, ratio {ratio:.3f}; /debug/summary "
          f"answered in {max(latencies) * 1e3:.1f} ms at worst")
    assert max(latencies) < 1.0
    # A server that blocked the training thread would show as steps of seconds (each slow
    # client holds a connection for up to 10 s): bound the worst step; the median ratio is
    # bounded generously (the server's threads do take some GIL time), the printed ratio is
    # the measurement.
    assert max(loaded) < 0.5
    assert ratio < 1.5
    # the garbage changed nothing: no clear, no level change, every step recorded
    assert rt.level.value == "basic" and rt.history.totals["steps"] == 10 + 2 * ROUNDS * BLOCK


def test_a_reconnect_flood_is_paced(tt_runtime, monkeypatch):
    # A client that reconnects in a tight loop gets at most max_accept_rate connections a
    # second accepted; the rest wait in the kernel's backlog (the server's Python work, and
    # so its GIL time, stays bounded).
    from torchtrace.export import server as server_mod

    accepted = []
    original = server_mod._Server.process_request

    def counting(self, request, client_address):
        accepted.append(time.monotonic())
        return original(self, request, client_address)

    monkeypatch.setattr(server_mod._Server, "process_request", counting)
    port = runtime().server.port
    # The fifty misbehaving clients reconnect as soon as the server closes on them: unpaced,
    # about 1,800 connections a second on this machine.
    proc = subprocess.Popen([sys.executable, str(CLIENTS), str(port), "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.5)
        stop = time.monotonic()
    finally:
        proc.kill()
        proc.wait(5)
    window = [t for t in accepted if stop - 1.0 <= t < stop]  # the last second of the flood
    rate = server_mod._Server.max_accept_rate
    assert 0.3 * rate <= len(window) <= 1.1 * rate + 2, len(window)
    status, _, _ = call(port, "GET", "/debug/summary")  # the server still answers afterwards
    assert status in (200, 401)
