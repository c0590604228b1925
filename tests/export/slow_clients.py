"""Fifty misbehaving HTTP clients in one process (run as a script by the load test).

Usage: python slow_clients.py PORT SECONDS. Prints "ready" once every connection is open,
then keeps them misbehaving until SECONDS have passed:
- 20 slowloris clients send a request head one byte every 0.2 s and never finish it;
- 15 garbage clients send random bytes, read whatever comes back, reconnect;
- 10 clients POST with a large Content-Length and no token, trickling the body;
- 5 idle clients connect and say nothing.
"""

from __future__ import annotations

import os
import random
import selectors
import socket
import sys
import time


def main() -> None:
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    rng = random.Random(0)
    sel = selectors.DefaultSelector()
    conns: dict[socket.socket, dict] = {}
    head = f"GET /debug/summary HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Pad: {'a' * 200}\r\n".encode()
    post = (f"POST /debug/clear HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 4000\r\n\r\n").encode()

    def open_conn(kind: str) -> None:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setblocking(False)
        state = {"kind": kind, "pos": 0, "next": time.monotonic()}
        conns[s] = state
        sel.register(s, selectors.EVENT_READ, state)

    kinds = ["slow"] * 20 + ["garbage"] * 15 + ["post"] * 10 + ["idle"] * 5
    for k in kinds:
        open_conn(k)
    print("ready", flush=True)
    end = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < end:
        now = time.monotonic()
        for s, st in list(conns.items()):
            if now < st["next"]:
                continue
            try:
                if st["kind"] == "slow":
                    s.send(head[st["pos"] % len(head):st["pos"] % len(head) + 1])
                    st["pos"] += 1
                    st["next"] = now + 0.2
                elif st["kind"] == "garbage":
                    s.send(os.urandom(rng.randint(1, 300)) + b"\r\n\r\n")
                    st["next"] = now + 0.2
                elif st["kind"] == "post":
                    data = post if st["pos"] == 0 else b"x"
                    s.send(data)
                    st["pos"] += 1
                    st["next"] = now + 0.1
                sent += 1
            except OSError:
                st["next"] = float("inf")
        for key, _ in sel.select(timeout=0.02):
            s = key.fileobj
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if not data:  # the server closed it: reconnect with the same behaviour
                kind = conns.pop(s)["kind"]
                sel.unregister(s)
                s.close()
                try:
                    open_conn(kind)
                except OSError:
                    pass
        for s, st in list(conns.items()):
            if st["next"] == float("inf"):
                kind = conns.pop(s)["kind"]
                sel.unregister(s)
                s.close()
                open_conn(kind)
    print(f"sent {sent}", flush=True)


if __name__ == "__main__":
    main()
