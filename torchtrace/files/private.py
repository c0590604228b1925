"""Private directories and whole files: mode 0700 and 0600, never through a symlink, atomic.

Re-exported by :mod:`torchtrace.files`, whose docstring states the rules.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from torchtrace.errors import get_logger
from torchtrace.files.strict_json import dumps

logger = get_logger("torchtrace.files")

O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


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
def open_private(path: str | os.PathLike[str], append: bool = False, exclusive: bool = False,
                 readable: bool = False) -> int:
    """Open ``path`` for writing (and reading, with ``readable``), mode 0600 when created, never
    through a symlink. Returns an fd.

    Raises:
        OSError: ``ELOOP`` when ``path`` is a symlink; ``EEXIST`` with ``exclusive`` when it exists.

    >>> import tempfile
    >>> fd = open_private(Path(tempfile.mkdtemp()) / "spans.jsonl", append=True)
    >>> os.close(fd)
    """
    flags = (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC
    flags |= os.O_APPEND if append else 0
    flags |= os.O_EXCL if exclusive else 0
    return os.open(path, flags, 0o600)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, durable: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically: a new private temp file beside it (``O_EXCL``,
    ``O_NOFOLLOW``, 0600), fsync, then rename over ``path``. A symlink at ``path`` is
    replaced, not followed. On any error (a full disk included) ``path`` keeps its old
    content and no temp file is left.

    ``durable=False`` skips the fsync: the rename still makes the write whole for any reader,
    also after the writing process is killed; only a crash of the machine may lose it (the
    black box, rewritten twice a second, where an fsync cost 10 ms a write).

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
            if durable:
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


def write_json_atomic(path: str | os.PathLike[str], value: object, max_bytes: int | None = None,
                      durable: bool = True, indent: int | None = 2) -> Path:
    """Write ``value`` as strict JSON to ``path`` atomically (temp file + rename), mode 0600;
    ``indent=None`` writes it compact (a file rewritten often, read by programs).

    Raises:
        ValueError: the document is larger than ``max_bytes``.
    """
    data = (dumps(value, indent=indent) + "\n").encode("utf-8")
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"report of {len(data)} bytes is over the cap of {max_bytes} bytes")
    return write_bytes_atomic(path, data, durable)
