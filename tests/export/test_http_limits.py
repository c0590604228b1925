"""HTTP limits on the telemetry server: a local client without a token cannot inflate the
training process or stall its steps. A real flood (another process) against the real server
while steps run, compared with quiet blocks of the same run."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from torchtrace.export import server as server_mod

from .debug_helpers import Trainer, call, runtime

FLOOD = Path(__file__).with_name("header_flood.py")
ROUNDS = 3
BLOCK = 150


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _PeakRss:
    """Samples this process's RSS every 5 ms from a thread; ``peak`` since the last ``reset``."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def reset(self) -> int:
        self.peak = self._proc.memory_info().rss
        return self.peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _steps(trainer: Trainer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - t0)
    return times


@pytest.mark.slow
def test_a_header_flood_keeps_memory_and_step_time_bounded(one_thread, tt_runtime, tiny_model):
    """64 connections, each sending 90 headers of 60 KB, again and again: RSS went from 309 MB
    to 1,454 MB and one step took 1.1 s. Now each head is cut at 16 KB (431)."""
    rt = runtime()
    port = rt.server.port
    trainer = Trainer(tiny_model)
    trainer.run(30)  # warm up
    rss = _PeakRss()
    quiet: list[float] = []
    flooded: list[float] = []
    growth: list[int] = []
    stats: list[dict] = []
    try:
        for _ in range(ROUNDS):
            quiet.extend(_steps(trainer, BLOCK))
            base = rss.reset()
            proc = subprocess.Popen([sys.executable, str(FLOOD), str(port), "60"], stdout=subprocess.PIPE, text=True)
            try:
                assert proc.stdout.readline().strip() == "ready"
                time.sleep(0.5)  # the flood is at full strength
                flooded.extend(_steps(trainer, BLOCK))
                time.sleep(0.3)
                growth.append(rss.peak - base)
                assert proc.poll() is None, "the flood process died early"
            finally:
                proc.terminate()
                out, _ = proc.communicate(timeout=10)
            stats.append(json.loads(out.strip().splitlines()[-1]) if out.strip() else {})
    finally:
        rss.stop()
    ratio = statistics.median(flooded) / statistics.median(quiet)
    sent = sum(s.get("sent", 0) for s in stats)
    print(f"\nheader flood: {sent / 2**20:.0f} MiB sent in {ROUNDS} blocks; RSS growth per block "
          f"{[round(g / 2**20, 1) for g in growth]} MiB; median step quiet {statistics.median(quiet) * 1e3:.3f} ms, "
          f"flooded {statistics.median(flooded) * 1e3:.3f} ms (ratio {ratio:.2f}); slowest flooded step "
          f"{max(flooded) * 1e3:.1f} ms; answers {stats[-1].get('statuses')}")
    assert max(growth) < 48 * 2**20, growth
    assert max(flooded) < 0.5
    assert ratio < 1.6
    assert sent > 50 * 2**20  # the flood was real
    assert any("431" in k for s in stats for k in (s.get("statuses") or {}))
    status, _, body = call(port, "GET", "/metrics")  # the server still serves
    assert status == 200 and b"torchtrace_steps_total" in body


def _raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:
            pass
        chunks = []
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError:
            pass
    return b"".join(chunks)


def _head(port: int, headers: int, size: int) -> bytes:
    lines = [f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n".encode()]
    lines += [b"X-A%d: %s\r\n" % (i, b"a" * size) for i in range(headers)]
    return b"".join(lines) + b"\r\n"


def test_request_heads_over_the_byte_or_line_cap_get_431(tt_runtime):
    port = runtime().server.port
    assert _raw(port, _head(port, 10, 1000)).startswith(b"HTTP/1.1 200")
    assert _raw(port, _head(port, 1, 20_000)).startswith(b"HTTP/1.1 431")  # one long header
    assert _raw(port, _head(port, 20, 1000)).startswith(b"HTTP/1.1 431")  # 20 KB in all
    assert _raw(port, _head(port, server_mod.MAX_HEADER_LINES + 1, 10)).startswith(b"HTTP/1.1 431")
    assert _raw(port, _head(port, server_mod.MAX_HEADER_LINES - 2, 10)).startswith(b"HTTP/1.1 200")
    assert _raw(port, b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 431")


def test_connections_beyond_the_cap_replace_the_longest_waiting_or_are_refused(tt_runtime, monkeypatch):
    monkeypatch.setattr(server_mod._Server, "max_connections", 4)
    rt = runtime()
    port = rt.server.port
    httpd = rt.server._httpd
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
    try:
        deadline = time.monotonic() + 5
        while httpd.open_connections() < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert httpd.open_connections() == 4
        # Young idle connections are not replaced: a newcomer is refused without a thread.
        assert _raw(port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").startswith(b"HTTP/1.1 503")
        time.sleep(server_mod._EVICT_AFTER_S + 0.1)
        # Now a real request replaces the longest-waiting idle connection and is served.
        status, _, _ = call(port, "GET", "/healthz")
        assert status == 200
        assert httpd.evicted >= 1 and httpd.refused >= 1
        assert idle[0].recv(10) == b""  # the oldest was hung up on
        assert httpd.open_connections() <= 4
    finally:
        for s in idle:
            s.close()


def test_a_trickling_request_head_is_cut_at_its_deadline(tt_runtime, monkeypatch):
    """One byte every 0.1 s is never silent long enough for the idle timeout; the head's
    deadline ends it (10 s by default, 1 s here)."""
    monkeypatch.setattr(server_mod, "HEAD_DEADLINE_S", 1.0)
    port = runtime().server.port
    head = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
    closed_at = None
    with socket.create_connection(("127.0.0.1", port), timeout=10) as trickle:
        t0 = time.monotonic()
        for byte in head:
            try:
                trickle.send(bytes([byte]))
            except OSError:
                closed_at = time.monotonic() - t0
                break
            time.sleep(0.1)
    assert closed_at is not None and closed_at < 2.5, closed_at


def test_an_idle_connection_is_closed_after_the_idle_timeout(tt_runtime):
    port = runtime().server.port
    with socket.create_connection(("127.0.0.1", port), timeout=server_mod.IDLE_TIMEOUT_S + 5) as idle:
        t0 = time.monotonic()
        assert idle.recv(10) == b""
        closed_at = time.monotonic() - t0
    assert server_mod.IDLE_TIMEOUT_S - 0.5 < closed_at < server_mod.IDLE_TIMEOUT_S + 2


def test_requests_on_a_kept_alive_connection_answer_without_the_nagle_delay(tt_runtime):
    """The head and the body are two writes; with Nagle's algorithm on, the body waited for
    the client's delayed ACK: every request after the first few on a kept-alive connection
    (Prometheus's, the live page's fetches) took 44 ms instead of about 1 ms."""
    import http.client

    port = runtime().server.port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    times = []
    try:
        for _ in range(30):
            t0 = time.perf_counter()
            conn.request("GET", "/healthz", headers={"Host": "127.0.0.1"})
            resp = conn.getresponse()
            resp.read()
            times.append(time.perf_counter() - t0)
    finally:
        conn.close()
    assert statistics.median(times) < 0.02, [round(t * 1e3, 1) for t in times]


@pytest.mark.parametrize("method, path", [("GET", "/healthz"), ("POST", "/metrics"), ("POST", "/nope"),
                                          ("HEAD", "/metrics")])
def test_a_body_the_route_does_not_read_is_never_served_as_a_request(tt_runtime, method, path):
    """A GET (or a refused POST) with a body kept the connection open and parsed the body as the
    next request: a request hidden in a body reached /debug/* past a proxy that only lets
    /metrics through. A request with a body now ends its connection."""
    port = runtime().server.port
    inner = b"GET /debug/summary HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(inner)}\r\n\r\n".encode()
    answer = _raw(port, head + inner)
    assert answer.count(b"HTTP/1.1 ") == 1, answer[:300]
    assert b"Connection: close" in answer
