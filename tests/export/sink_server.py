"""A stand-in HTTP server in its own process, for the load test's control blocks.

Usage: python sink_server.py. Prints its port, then accepts connections forever: reads what
arrives, answers a complete request head (or anything that is not one) with a 400 and closes
it, as torchtrace's server does with garbage. Aimed at this instead of torchtrace, the same
misbehaving clients load the machine alike while torchtrace's server stays idle.
"""

from __future__ import annotations

import selectors
import socket

RESPONSE = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def main() -> None:
    sel = selectors.DefaultSelector()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    listener.setblocking(False)
    sel.register(listener, selectors.EVENT_READ, None)
    print(listener.getsockname()[1], flush=True)
    buffers: dict[socket.socket, bytes] = {}
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.data is None:
                conn, _ = listener.accept()
                conn.setblocking(False)
                buffers[conn] = b""
                sel.register(conn, selectors.EVENT_READ, "conn")
                continue
            conn = key.fileobj
            try:
                data = conn.recv(65536)
            except OSError:
                data = b""
            buf = buffers.get(conn, b"") + data
            done = not data or b"\r\n\r\n" in buf and not buf.startswith(b"POST") or len(buf) > 8192
            if done:
                try:
                    conn.send(RESPONSE)
                except OSError:
                    pass
                sel.unregister(conn)
                buffers.pop(conn, None)
                conn.close()
            else:
                buffers[conn] = buf


if __name__ == "__main__":
    main()
