"""Run-directory files: strict JSON, atomic writes, mode 0600, size caps."""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
from pathlib import Path
from typing import Any


def to_strict(value: Any) -> Any:
    """Replace non-finite floats by the strings "NaN", "Infinity", "-Infinity", recursively.

    Strict JSON has no NaN token; a reader that sees the string still knows what happened.
    """
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    if isinstance(value, dict):
        return {str(k): to_strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_strict(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def dumps(value: Any, indent: int | None = None) -> str:
    """Strict JSON text (``allow_nan=False`` after :func:`to_strict`)."""
    return json.dumps(to_strict(value), indent=indent, allow_nan=False, default=str)


def ensure_private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def write_json_atomic(path: str | os.PathLike[str], value: Any, max_bytes: int | None = None) -> Path:
    """Write ``value`` as strict JSON to ``path`` atomically (temp file + rename), mode 0600.

    Raises:
        ValueError: the document is larger than ``max_bytes``.
    """
    target = Path(path)
    ensure_private_dir(target.parent if str(target.parent) else Path("."))
    text = dumps(value, indent=2) + "\n"
    data = text.encode("utf-8")
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"report of {len(data)} bytes is over the cap of {max_bytes} bytes")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=str(target.parent))
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target


class JsonLinesFile:
    """An append-only JSON-lines file, mode 0600, that stops growing at ``max_bytes``.

    Lines past the cap are counted in :attr:`dropped`, never written partially.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.dropped = 0
        self._lock = threading.Lock()
        self._fh = None
        self._size = 0

    def _open(self):
        if self._fh is None:
            ensure_private_dir(self.path.parent)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._fh = os.fdopen(fd, "ab")
            self._size = self._fh.tell()
        return self._fh

    def write_many(self, docs: list[Any]) -> int:
        """Append documents; returns how many were written (the rest hit the size cap)."""
        return self.write_lines([(dumps(doc) + "\n").encode("utf-8") for doc in docs])

    def write_lines(self, lines: list[bytes]) -> int:
        """Append encoded lines (each one strict JSON document ending in a newline)."""
        with self._lock:
            fh = self._open()
            written = 0
            chunks = []
            for line in lines:
                if self._size + len(line) > self.max_bytes:
                    self.dropped += 1
                    continue
                chunks.append(line)
                self._size += len(line)
                written += 1
            if chunks:
                fh.write(b"".join(chunks))
                fh.flush()
            return written

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def read_json_lines(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a JSON-lines file written by :class:`JsonLinesFile`, skipping a torn last line."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
