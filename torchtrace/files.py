"""Run-directory files: strict JSON, atomic writes, mode 0600, size caps, no symlinks followed.

Every file torchtrace opens for writing is opened with ``O_NOFOLLOW`` (a symlink planted at
its name is refused, never written through) and created with mode 0600. The run directory is
0700: an existing one with looser permissions is tightened, with a warning, and one that is a
symlink or belongs to another user is refused. :func:`claim_file` gives a second process with
the same run id its own file names instead of letting both write the same files.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import secrets
import stat
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


_PLAIN = (str, int, bool, type(None))


def to_strict(value: Any) -> Any:
    """Replace non-finite floats by the strings "NaN", "Infinity", "-Infinity", recursively.

    Strict JSON has no NaN token; a reader that sees the string still knows what happened.
    Tuples become lists and keys strings, as JSON has them.

    >>> to_strict({"loss": float("nan"), "names": ("a", "b")})
    {'loss': 'NaN', 'names': ['a', 'b']}
    """
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is float:
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k if type(k) is str else str(k): v if type(v) in _PLAIN else to_strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        # a list of names is the common large case: no call per string
        return [v if type(v) in _PLAIN else to_strict(v) for v in value]
    if isinstance(value, float):
        return to_strict(float(value))
    if isinstance(value, Path):
        return str(value)
    return value


def dumps(value: Any, indent: int | None = None) -> str:
    """Strict JSON text (``allow_nan=False``; non-finite floats as strings, see :func:`to_strict`).

    The C encoder does the work: a document without non-finite floats is encoded as it is,
    others after :func:`to_strict`. ``indent`` is applied to documents under 256 KB only:
    indenting makes Python's encoder fall back to its pure-Python path, about ten times slower
    (a 24 MB report took seconds where the compact form takes a fraction of one).
    """
    try:
        text = json.dumps(value, allow_nan=False, default=str)
    except (ValueError, TypeError):  # a non-finite float; a key JSON has no form for
        value = to_strict(value)
        text = json.dumps(value, allow_nan=False, default=str)
    if indent is not None and len(text) < 256 * 1024:
        return json.dumps(json.loads(text), indent=indent, allow_nan=False)
    return text


# ---------------------------------------------------------------- directories
def ensure_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` with mode 0700 (missing parents get the default mode), or check an
    existing one: a symlink or a directory owned by another user is refused, and group or
    other permission bits are removed, with a warning.

    Use it for torchtrace's own directories (the run directory); for a directory the user
    named, use :func:`ensure_parent_dir`, which never changes an existing directory.

    Raises:
        PermissionError: ``path`` is a symlink, not a directory, or belongs to another user.

    >>> import tempfile, stat
    >>> d = ensure_private_dir(Path(tempfile.mkdtemp()) / "run")
    >>> oct(stat.S_IMODE(d.stat().st_mode))
    '0o700'
    """
    target = Path(path)
    created = True
    try:
        target.mkdir(mode=0o700)
    except FileNotFoundError:
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            target.mkdir(mode=0o700)
        except FileExistsError:
            created = False
    except FileExistsError:
        created = False
    try:
        fd = os.open(target, os.O_RDONLY | _O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PermissionError(f"torchtrace refuses {target}: it is a symlink or not a directory") from None
        raise
    try:
        info = os.fstat(fd)
        if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            raise PermissionError(f"torchtrace refuses {target}: it belongs to uid {info.st_uid}, not to this user")
        mode = stat.S_IMODE(info.st_mode)
        if mode != 0o700 and not _never_tightened(target, info):
            os.fchmod(fd, 0o700)  # also when just created under a umask that took bits away
            if mode & 0o077 and not created:
                logger.warning("torchtrace directory %s had mode %s; tightened to 0o700", target, oct(mode))
    finally:
        os.close(fd)
    return target


def _never_tightened(path: Path, info: os.stat_result) -> bool:
    """Directories that are not torchtrace's to change even when asked for a private one: a
    shared directory (sticky bit, like /tmp), the working directory and the home directory."""
    if info.st_mode & stat.S_ISVTX:
        return True
    try:
        for other in (Path.cwd(), Path.home()):
            if os.path.samestat(info, other.stat()):
                return True
    except (OSError, RuntimeError):
        pass
    return False


def ensure_parent_dir(path: str | os.PathLike[str]) -> Path:
    """Create the directory that will hold ``path`` (mode 0700 for what is created); an
    existing directory is left as it is. Returns the directory."""
    parent = Path(path).parent
    parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return parent


# ---------------------------------------------------------------- whole files
def open_private(path: str | os.PathLike[str], append: bool = False, exclusive: bool = False) -> int:
    """Open ``path`` for writing, mode 0600 when created, never through a symlink. Returns an fd.

    Raises:
        OSError: ``ELOOP`` when ``path`` is a symlink; ``EEXIST`` with ``exclusive`` when it exists.

    >>> import tempfile
    >>> fd = open_private(Path(tempfile.mkdtemp()) / "spans.jsonl", append=True)
    >>> os.close(fd)
    """
    flags = os.O_WRONLY | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC
    flags |= os.O_APPEND if append else 0
    flags |= os.O_EXCL if exclusive else 0
    return os.open(path, flags, 0o600)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically: a new private temp file beside it (``O_EXCL``,
    ``O_NOFOLLOW``, 0600), fsync, then rename over ``path``. A symlink at ``path`` is
    replaced, not followed. On any error (a full disk included) ``path`` keeps its old
    content and no temp file is left.

    >>> import tempfile
    >>> write_bytes_atomic(Path(tempfile.mkdtemp()) / "trace.json", b"{}").read_bytes()
    b'{}'
    """
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    ensure_parent_dir(target)
    tmp = directory / f".{target.name}.{secrets.token_hex(6)}.tmp"
    fd = open_private(tmp, exclusive=True)
    try:
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target


def write_json_atomic(path: str | os.PathLike[str], value: Any, max_bytes: int | None = None) -> Path:
    """Write ``value`` as strict JSON to ``path`` atomically (temp file + rename), mode 0600.

    Raises:
        ValueError: the document is larger than ``max_bytes``.
    """
    data = (dumps(value, indent=2) + "\n").encode("utf-8")
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"report of {len(data)} bytes is over the cap of {max_bytes} bytes")
    return write_bytes_atomic(path, data)


# ---------------------------------------------------------------- one writer per file name
_claims: dict[str, tuple[int, Path]] = {}
_claims_lock = threading.Lock()


def claim_file(path: str | os.PathLike[str]) -> Path:
    """Reserve ``path`` for this process: the first process to claim a name gets it, a second
    live process (the same run id and rank started twice) gets ``<stem>.pid<PID><suffix>``
    and a warning. The claim is an exclusive ``flock`` on ``.<name>.lock`` beside the file;
    the kernel drops it when the process ends, so a restarted job reuses the plain name.
    Release it with :func:`release_file`.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> claim_file(d / "report.json").name
    'report.json'
    >>> release_file(d / "report.json")
    """
    import fcntl

    target = Path(path)
    with _claims_lock:
        held = _claims.get(str(target))
        if held is not None:
            return held[1]
        alternative = target.with_name(f"{target.stem}.pid{os.getpid()}{target.suffix}")
        holder = None
        for candidate in (target, alternative):
            lock_path = candidate.with_name(f".{candidate.name}.lock")
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            if not _still_linked(fd, lock_path):
                # A releasing process removed the lock file between our open and our lock:
                # the claim on an unlinked file is worth nothing; try this name again.
                os.close(fd)
                return claim_file(path) if candidate == target else _retry_alternative(target, alternative)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            _claims[str(target)] = (fd, candidate)
            if candidate != target:
                logger.warning("torchtrace: %s is being written by another process (pid %s) with the same run id; "
                               "this process writes %s instead", target, holder, candidate.name)
            return candidate
        raise PermissionError(f"torchtrace could not claim {target} or {alternative.name}")


def release_file(path: str | os.PathLike[str]) -> None:
    """Give up a claim made with :func:`claim_file`, named by the path asked for or the one
    returned (a no-op for a path never claimed)."""
    key = str(Path(path))
    with _claims_lock:
        held = _claims.pop(key, None)
        if held is None:
            for asked, (fd, claimed) in list(_claims.items()):
                if str(claimed) == key:
                    held = _claims.pop(asked)
                    break
    if held is not None:
        fd, claimed = held
        lock_path = claimed.with_name(f".{claimed.name}.lock")
        try:  # remove the lock file while still holding the lock (claimers check it is linked)
            if _still_linked(fd, lock_path):
                os.unlink(lock_path)
        except OSError:
            pass
        os.close(fd)


def _still_linked(fd: int, path: Path) -> bool:
    """The open file ``fd`` is still the one named ``path``."""
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _retry_alternative(target: Path, alternative: Path) -> Path:
    raise PermissionError(f"torchtrace could not claim {target} or {alternative.name} (lock files changing)")


# ---------------------------------------------------------------- JSON lines
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
            self._fd = open_private(self.path, append=True)
            self._torn = False
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
        """Before writing after a torn tail that could not be cut: end it with a newline, so the
        next line is whole (a reader skips the one broken line)."""
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
