"""JSON-lines files: append-only, capped, and whole lines only, whatever the disk does.

Re-exported by :mod:`torchtrace.files`.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any

from torchtrace.errors import get_logger
from torchtrace.files.private import ensure_parent_dir, open_private
from torchtrace.files.strict_json import dumps

logger = get_logger("torchtrace.files")

class JsonLinesFile:
    """An append-only JSON-lines file, mode 0600, never through a symlink, that stops
    growing at ``max_bytes``.

    Only whole lines end up in the file: a write cut short (a full disk) is truncated back
    to the last complete line. :meth:`write_lines` returns how many lines are in the file,
    so callers count exactly what was lost; a later write succeeds again once space returns.

    Attributes:
        dropped: lines refused by the size cap.
        lost: lines that a write error (ENOSPC, EIO, ...) kept out of the file.
        last_error: the errno name of the last write error, or None.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.dropped = 0
        self.lost = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._torn = False  # a cut-short write could not be truncated away

    def _open(self) -> int:
        if self._fd is None:
            ensure_parent_dir(self.path)
            # (readable: _repair reads the last byte; a write-only fd made that pread fail, so a
            # torn tail was never ended before)
            self._fd = open_private(self.path, append=True, readable=True)
            # A file that was there before may end in a line torn by a killed process: the
            # first write checks its last byte (_repair), so no line is glued onto it.
            self._torn = os.fstat(self._fd).st_size > 0
        return self._fd

    def write_many(self, docs: list[Any]) -> int:
        """Append documents; returns how many were written (the rest hit the size cap or an error)."""
        return self.write_lines([(dumps(doc) + "\n").encode("utf-8") for doc in docs])

    def write_lines(self, lines: list[bytes]) -> int:
        """Append encoded lines (each one strict JSON document ending in a newline).

        Returns how many of them are in the file now; the rest were refused by the size cap
        (:attr:`dropped`) or lost to a write error (:attr:`lost`).

        Raises:
            OSError: the file cannot be opened (a symlink at its name, a missing permission).
        """
        with self._lock:
            fd = self._open()
            start = os.fstat(fd).st_size
            if self._torn:
                start = self._repair(fd, start)
            size = start
            accepted: list[bytes] = []
            for line in lines:
                if size + len(line) > self.max_bytes:
                    self.dropped += 1
                    continue
                accepted.append(line)
                size += len(line)
            if not accepted:
                return 0
            data = b"".join(accepted)
            done, error = _write_all(fd, data)
            if error is None:
                self.last_error = None
                return len(accepted)
            whole = data.count(b"\n", 0, done)
            keep = sum(len(line) for line in accepted[:whole])
            if done > keep:
                self._truncate(fd, start + keep, start + done)
            self.lost += len(accepted) - whole
            if self.last_error != error:
                logger.warning("torchtrace could not write %s (%s): %d span line(s) lost; writing resumes when "
                               "it can", self.path, error, len(accepted) - whole)
            self.last_error = error
            return whole

    def _truncate(self, fd: int, good: int, end: int) -> None:
        """Cut a torn tail: only when the file ends where this write ended (no other writer)."""
        try:
            if os.fstat(fd).st_size == end:
                os.ftruncate(fd, good)
                return
        except OSError:
            pass
        self._torn = True

    def _repair(self, fd: int, size: int) -> int:
        """Before writing after a torn tail that could not be cut, or into a file that was there
        before: end it with a newline, so the next line is whole (a reader skips the one broken
        line)."""
        try:
            if size and os.pread(fd, 1, size - 1) != b"\n":
                done, error = _write_all(fd, b"\n")
                if error is not None:
                    return size
            self._torn = False
        except OSError:
            return size
        return os.fstat(fd).st_size

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                try:
                    os.close(self._fd)
                finally:
                    self._fd = None


def _write_all(fd: int, data: bytes) -> tuple[int, str | None]:
    """Write ``data`` with as many ``write`` calls as it takes. Returns (bytes written, None),
    or (bytes written before the error, the error's errno name)."""
    view = memoryview(data)
    done = 0
    while done < len(data):
        try:
            n = os.write(fd, view[done:])
        except InterruptedError:
            continue
        except OSError as exc:
            return done, errno.errorcode.get(exc.errno or 0, type(exc).__name__)
        if n == 0:
            return done, "ENOSPC"
        done += n
    return done, None


def read_json_lines(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a JSON-lines file written by :class:`JsonLinesFile`, skipping a torn line."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
