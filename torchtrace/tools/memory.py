"""Memory tools: named snapshots, weakly tracked tensors, clearing caches, and a block whose
steps each leave a memory sample.

>>> import torch, torchtrace as tt
>>> a = tt.take_memory_snapshot("before")
>>> keep = torch.zeros(1024, 1024)
>>> b = tt.take_memory_snapshot("after")
>>> b.compare(a)["rss_bytes"] is not None
True
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import torch

from torchtrace.measure import memory as mem_measure
from torchtrace.measure.snapshots import MemorySnapshot, MemoryTracker, tracker

_TRACKER = tracker()


def take_memory_snapshot(name: str | None = None, census: bool = False) -> MemorySnapshot:
    """A named snapshot of memory now; ``census=True`` also groups the live tensors (slow)."""
    return _TRACKER.take_snapshot(name, census)


def track_tensor(t: torch.Tensor, name: str) -> None:
    """Watch a tensor by weak reference; snapshots and reports say whether it is still alive."""
    _TRACKER.track_tensor(t, name)


def clear_memory() -> dict[str, int | None]:
    """Collect garbage and return cached CUDA blocks to the driver; returns bytes released per counter."""
    before = mem_measure.sample()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    after = mem_measure.sample()
    out = {"rss_bytes": before.rss - after.rss}
    if before.cuda_reserved is not None and after.cuda_reserved is not None:
        out["cuda_reserved_bytes"] = before.cuda_reserved - after.cuda_reserved
        out["cuda_allocated_bytes"] = before.cuda_allocated - after.cuda_allocated
    return out


@contextlib.contextmanager
def memory_tracking(tracker_: MemoryTracker | None = None) -> Iterator[MemoryTracker]:
    """Record a memory sample for every instrumented step inside the block.

    ``DebugMode.MEMORY_PROFILING`` does the same for the whole run. Snapshots ``start`` and
    ``end`` are taken around the block.
    """
    trk = tracker_ or _TRACKER
    was = trk.active
    trk.active = True
    trk.take_snapshot("start")
    try:
        yield trk
    finally:
        trk.take_snapshot("end")
        trk.active = was
