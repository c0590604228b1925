"""Requests on kept-alive connections are paced like connections: one route at a time, and
the server's threads busy for a bounded share of the time.

Twenty clients that each pipelined 200 ``GET /metrics`` and never read had twenty threads
rendering the registry at once; each took the GIL in turn and a 1 ms training step waited
up to 0.6 s (probe: a 20-connection pipeline flood during training, worst step 629 ms
against 15 ms at a stand-in server)."""

from __future__ import annotations

import socket
import threading
import time

from torchtrace.export import pacing

from .debug_helpers import call, runtime


def _watch_routes(server):
    """Wrap the server's routing: count routes running at once and their CPU seconds."""
    lock = threading.Lock()
    stats = {"running": 0, "most": 0, "served": 0}
    handle = server.handle

    def watched(method, request):
        with lock:
            stats["running"] += 1
            stats["most"] = max(stats["most"], stats["running"])
        try:
            spin = time.thread_time() + 0.002  # 2 ms of CPU, as a big registry's render takes
            while time.thread_time() < spin:
                pass
            return handle(method, request)
        finally:
            with lock:
                stats["running"] -= 1
                stats["served"] += 1

    server.handle = watched
    return stats


def test_pipelined_requests_are_served_one_at_a_time_and_paced(tt_runtime):
    rt = runtime()
    port = rt.server.port
    stats = _watch_routes(rt.server)
    head = f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    socks = []
    try:
        for _ in range(10):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(head * 100)  # and never read
            socks.append(s)
        t0 = time.thread_time()
        time.sleep(2.0)
        served, busy = stats["served"], time.thread_time() - t0
        # a normal scrape still gets its turn while the flood waits
        started = time.monotonic()
        status, _, body = call(rt.server.port, "GET", "/metrics")
        waited = time.monotonic() - started
    finally:
        for s in socks:
            s.close()
    assert stats["most"] == 1, stats
    # Each request takes at least 2 ms of CPU here; at most BUSY_SHARE of the 2 s window
    # goes to requests, so a few hundred at most (unpaced: all 1,000).
    assert served < 2.0 / 0.002 * pacing.BUSY_SHARE * 1.5 + 5, (served, busy)
    assert status == 200 and b"torchtrace_steps_total" in body and waited < 2.0, waited


def test_the_pacer_charges_cpu_time_and_spaces_turns():
    pacer = pacing.RequestPacer(share=0.5)
    with pacer.turn():
        pass
    pacer.charge(0.05)  # 50 ms of CPU at a 50% share: the next turn waits about 50 ms
    t0 = time.monotonic()
    with pacer.turn():
        waited = time.monotonic() - t0
    assert 0.03 < waited < 0.5, waited
