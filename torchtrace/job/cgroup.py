"""The memory cgroup a process runs in: its limit and the kernel's count of OOM kills.

The kernel's OOM killer sends SIGKILL: the killed process runs no code, so it cannot say why
it died. What is left is the cgroup's own count of OOM kills, which the next attempt (or
``torchtrace why``) compares with the count this process saw when it started. Both cgroup
versions are read:

- v2: ``memory.max`` (the limit) and ``oom_kill`` in ``memory.events``;
- v1: ``memory.limit_in_bytes`` and ``oom_kill`` in ``memory.oom_control``.

>>> parse_counters("oom_kill_disable 0\\nunder_oom 0\\noom_kill 3\\n")["oom_kill"]
3
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_NO_LIMIT = 1 << 60  # v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages)


def parse_counters(text: str) -> dict[str, int]:
    """``name value`` lines (memory.events, memory.oom_control) into a dict of ints."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def memory_cgroup(pid: int | str = "self") -> dict[str, Any] | None:
    """This process's memory cgroup: ``{"version", "path", "limit_bytes", "oom_kills"}``, or
    None where there is none to read (not Linux, no memory controller, not mounted)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        mounts = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            v1 = path
        elif hierarchy == "0" and controllers == "":
            v2 = path
    if v1 is not None:
        directory = _directory(mounts, v1, "cgroup", "memory")
        if directory is not None and (directory / "memory.limit_in_bytes").exists():
            return _describe(1, directory)
    if v2 is not None:
        directory = _directory(mounts, v2, "cgroup2", None)
        if directory is not None and (directory / "memory.events").exists():
            return _describe(2, directory)
    return None


def _directory(mounts: list[str], cgroup_path: str, fstype: str, option: str | None) -> Path | None:
    """Where the cgroup ``cgroup_path`` is mounted in this mount namespace (from mountinfo)."""
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or not tail or tail[0] != fstype:
            continue
        if option is not None and option not in (tail[2] if len(tail) > 2 else "").split(","):
            continue
        root, mount_point = fields[3], fields[4]
        if cgroup_path == root or cgroup_path.startswith(root.rstrip("/") + "/"):
            rest = cgroup_path[len(root.rstrip("/")):].lstrip("/")
            return Path(mount_point) / rest
    return None


def _describe(version: int, directory: Path) -> dict[str, Any]:
    return {"version": version, "path": str(directory), "limit_bytes": limit_bytes(version, directory),
            "oom_kills": oom_kills(version, directory)}


def limit_bytes(version: int, directory: str | os.PathLike[str]) -> int | None:
    """The cgroup's memory limit in bytes, or None when it has none."""
    name = "memory.max" if version == 2 else "memory.limit_in_bytes"
    try:
        raw = (Path(directory) / name).read_text().strip()
    except OSError:
        return None
    if not raw.isdigit():
        return None  # v2's "max"
    value = int(raw)
    return None if value >= _NO_LIMIT else value


def oom_kills(version: int, directory: str | os.PathLike[str]) -> int | None:
    """How many processes the kernel's OOM killer has killed in the cgroup, or None."""
    name = "memory.events" if version == 2 else "memory.oom_control"
    try:
        return parse_counters((Path(directory) / name).read_text()).get("oom_kill")
    except OSError:
        return None
