"""Memory snapshots and their comparison, weakly tracked tensors, per-step samples.

>>> import torch, torchtrace as tt
>>> a = tt.take_memory_snapshot("before")
>>> keep = torch.zeros(1024, 1024)
>>> b = tt.take_memory_snapshot("after")
>>> b.compare(a)["rss_bytes"] is not None
True
"""

from __future__ import annotations

import collections
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtrace.measure import census as census_measure
from torchtrace.measure import memory as mem_measure


# ---------------------------------------------------------------- snapshots
@dataclass
class MemorySnapshot:
    """Memory at one moment: process RSS, CUDA counters, tracked tensors, optionally a tensor census."""

    name: str
    unix_time: float
    memory: dict[str, int | None]
    tracked: dict[str, int | None] = field(default_factory=dict)  # name -> bytes, None once freed
    census: dict[tuple, list] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "unix_time": self.unix_time, "memory": dict(self.memory),
               "tracked": dict(self.tracked)}
        if self.census is not None:
            out["tensor_groups"] = len(self.census)
            out["tensor_count"] = sum(g[0] for g in self.census.values())
            out["tensor_bytes"] = sum(g[1] for g in self.census.values())
        return out

    def compare(self, earlier: "MemorySnapshot") -> dict[str, Any]:
        """This snapshot minus ``earlier``: memory deltas, tracked tensors freed/new, growing tensor groups."""
        return compare(earlier, self)


def compare(before: MemorySnapshot, after: MemorySnapshot) -> dict[str, Any]:
    """Differences from ``before`` to ``after`` (bytes; None where either side lacks the value)."""
    deltas: dict[str, int | None] = {}
    for key in set(before.memory) | set(after.memory):
        a, b = before.memory.get(key), after.memory.get(key)
        deltas[key] = (b - a) if a is not None and b is not None else None
    out: dict[str, Any] = dict(deltas)
    out["from"] = before.name
    out["to"] = after.name
    out["seconds"] = after.unix_time - before.unix_time
    out["tracked_freed"] = sorted(n for n, v in after.tracked.items()
                                  if v is None and before.tracked.get(n) is not None)
    out["tracked_new"] = sorted(n for n in after.tracked if n not in before.tracked)
    if before.census is not None and after.census is not None:
        out["growing_tensors"] = (census_measure.census_growth(before.census, after.census, 1)
                                  [:census_measure.MAX_REPORTED])
    return out


class _Tracked:
    __slots__ = ("ref", "nbytes", "shape", "dtype", "device", "freed_unix")

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)
        self.nbytes = t.numel() * t.element_size()
        self.shape = list(t.shape)
        self.dtype = str(t.dtype).replace("torch.", "")
        self.device = str(t.device)
        self.freed_unix: float | None = None


class MemoryTracker:
    """Per-step memory samples (bounded), named snapshots and weakly tracked tensors.

    >>> tracker = MemoryTracker()
    >>> t = torch.ones(4); tracker.track_tensor(t, "ones")
    >>> tracker.tracked()["ones"]["alive"]
    True
    """

    def __init__(self, max_samples: int = 10000, max_snapshots: int = 100) -> None:
        self.samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_samples)
        self.snapshots: collections.OrderedDict[str, MemorySnapshot] = collections.OrderedDict()
        self.max_snapshots = max_snapshots
        self._tracked: dict[str, _Tracked] = {}
        self.active = False

    def add_sample(self, step: int, operation: str, memory: dict[str, Any]) -> None:
        self.samples.append({"step": step, "operation": operation, **memory})

    def track_tensor(self, t: torch.Tensor, name: str) -> None:
        """Watch ``t`` through a weak reference: tracking never keeps it alive."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"track_tensor expects a tensor, got {type(t).__name__}")
        entry = _Tracked(t)

        def _freed(_ref, entry=entry):
            entry.freed_unix = time.time()

        entry.ref = weakref.ref(t, _freed)
        self._tracked[name] = entry

    def tracked(self) -> dict[str, dict[str, Any]]:
        return {name: {"alive": e.ref() is not None, "bytes": e.nbytes, "shape": e.shape, "dtype": e.dtype,
                       "device": e.device, "freed_unix": e.freed_unix} for name, e in self._tracked.items()}

    def take_snapshot(self, name: str | None = None, census: bool = False) -> MemorySnapshot:
        name = name or f"snapshot_{len(self.snapshots)}"
        snap = MemorySnapshot(name=name, unix_time=time.time(), memory=mem_measure.sample().as_dict(),
                              tracked={n: (e.nbytes if e.ref() is not None else None)
                                       for n, e in self._tracked.items()},
                              census=census_measure.tensor_census() if census else None)
        self.snapshots[name] = snap
        while len(self.snapshots) > self.max_snapshots:
            self.snapshots.popitem(last=False)
        return snap

    def summary(self) -> dict[str, Any]:
        rss = [s["rss_bytes"] for s in self.samples if s.get("rss_bytes") is not None]
        out: dict[str, Any] = {"samples": len(self.samples), "snapshots": list(self.snapshots),
                               "tracked": self.tracked()}
        if rss:
            out["rss_first"] = rss[0]
            out["rss_last"] = rss[-1]
            out["rss_max"] = max(rss)
        cuda = [s["cuda_peak_allocated_bytes"] for s in self.samples if s.get("cuda_peak_allocated_bytes") is not None]
        if cuda:
            out["cuda_peak_allocated_max"] = max(cuda)
        return out


_TRACKER = MemoryTracker()


def tracker() -> MemoryTracker:
    """The process-wide tracker the memory tools and the memory probe share."""
    return _TRACKER
