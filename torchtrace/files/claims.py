"""One writer per file name: :func:`claim_file` and :func:`release_file`.

Re-exported by :mod:`torchtrace.files`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from torchtrace.errors import get_logger
from torchtrace.files.private import O_CLOEXEC, O_NOFOLLOW

logger = get_logger("torchtrace.files")

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
