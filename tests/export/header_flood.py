"""A header flood in one process (run as a script by the HTTP-limits test).

Usage: python header_flood.py PORT SECONDS [CONNECTIONS HEADERS HEADER_BYTES]. Opens
CONNECTIONS (default 64) connections; on each it sends a GET whose head carries HEADERS
(default 90) headers of HEADER_BYTES (default 60,000) bytes, as fast as the socket takes
them, and reconnects when the server closes. Needs no token: any local user can do this.
Prints "ready" once every connection is open, and at the end one line of JSON: bytes sent,
connections opened, and the status lines received.
"""

from __future__ import annotations

import collections
import json
import selectors
import signal
import socket
import sys
import time


def request(port: int, headers: int, header_bytes: int) -> bytes:
    value = b"a" * header_bytes
    lines = [f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()]
    lines += [b"X-Fill-%d: %s\r\n" % (i, value) for i in range(headers)]
    return b"".join(lines) + b"\r\n"


def main() -> None:
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    n, headers, header_bytes = (int(a) for a in (sys.argv[3:6] if len(sys.argv) >= 6 else (64, 90, 60_000)))
    payload = request(port, headers, header_bytes)
    sel = selectors.DefaultSelector()
    state: dict[socket.socket, dict] = {}
    stats = {"sent": 0, "opened": 0, "statuses": collections.Counter()}

    def open_one() -> None:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
        except OSError:
            return
        s.setblocking(False)
        state[s] = {"pos": 0}
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)
        stats["opened"] += 1

    def close(s: socket.socket) -> None:
        sel.unregister(s)
        state.pop(s, None)
        s.close()

    for _ in range(n):
        open_one()
    end = time.monotonic() + seconds

    def stop(signum, frame) -> None:  # SIGTERM ends the flood early; the stats still print
        nonlocal end
        end = 0.0

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    while time.monotonic() < end:
        for key, events in sel.select(timeout=0.05):
            s = key.fileobj
            st = state.get(s)
            if st is None:
                continue
            try:
                if events & selectors.EVENT_READ:
                    data = s.recv(65536)
                    if not data:
                        close(s)
                        continue
                    if data.startswith(b"HTTP/"):
                        stats["statuses"][data.split(b"\r\n", 1)[0].decode(errors="replace")] += 1
                if events & selectors.EVENT_WRITE:
                    if st["pos"] >= len(payload):
                        st["pos"] = 0  # the next request on the same connection, if it stays open
                    sent = s.send(payload[st["pos"]:st["pos"] + 262144])
                    st["pos"] += sent
                    stats["sent"] += sent
            except OSError:
                close(s)
        while len(state) < n and time.monotonic() < end:
            before = len(state)
            open_one()
            if len(state) == before:
                break
    stats["statuses"] = dict(stats["statuses"])
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
