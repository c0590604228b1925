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
from typing import Any, Iterator, Sequence

import psutil
import torch

from torchtrace import current
from torchtrace.measure import memory as mem_measure
from torchtrace.measure.snapshots import MemorySnapshot, MemoryTracker, tracker
from torchtrace.record.growth import DEFAULT_THRESHOLD, DEFAULT_WINDOW, GrowthTracker

_TRACKER = tracker()


def sustained_growth(values: Sequence[int | None], window: int = DEFAULT_WINDOW,
                     threshold: float = DEFAULT_THRESHOLD, warmup: int | None = None) -> float | None:
    """The leak detector's rule (:class:`~torchtrace.record.growth.GrowthTracker`, the rule the
    per-step leak probe applies) over memory samples taken one per step, or one per call
    (None: a step without a sample; the x axis stays the step's index):
    the robust slope in bytes per sample of the last stretch it called a leak, or None when
    growth was never sustained (no leak; a block shorter than ``warmup`` plus a few samples
    cannot show one). Raw growth is not a leak: memory that rises once and stays, or a few
    jumps, are not called.

    >>> sustained_growth([4_000_000 * i for i in range(48)])
    4000000.0
    >>> sustained_growth([10_000_000] * 48) is None
    True
    """
    tracker_ = GrowthTracker(window=window, threshold=threshold, warmup=warmup)
    slope = None
    for i, value in enumerate(values):
        if value is None:
            continue
        tracker_.add(i, value)
        if tracker_.sustained():
            slope = tracker_.refresh()
    return slope


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
    out: dict[str, int | None] = {"rss_bytes": before.rss - after.rss}
    if before.cuda_reserved is not None and after.cuda_reserved is not None:
        out["cuda_reserved_bytes"] = before.cuda_reserved - after.cuda_reserved
    if before.cuda_allocated is not None and after.cuda_allocated is not None:
        out["cuda_allocated_bytes"] = before.cuda_allocated - after.cuda_allocated
    return out


def model_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of a model's own tensors: parameters, their gradients, buffers, and the total.

    A tensor shared by two modules (tied weights) is counted once.

    >>> model_bytes(torch.nn.Linear(3, 2))["total"]
    32
    """
    seen: set[tuple] = set()

    def size(ts) -> int:
        n = 0
        for t in ts:
            ptr = t.data_ptr() if t.device.type != "meta" else 0
            key = (ptr, t.numel(), t.element_size()) if ptr else ("id", id(t))
            if key in seen:
                continue
            seen.add(key)
            n += t.numel() * t.element_size()
        return n

    params = list(model.parameters())
    p = size(params)
    g = size(q.grad for q in params if q.grad is not None)
    b = size(model.buffers())
    return {"parameters": p, "gradients": g, "buffers": b, "total": p + g + b}


def memory_profile(model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Memory now: process RSS (bytes and percent of physical memory), system memory percent,
    CUDA allocator counters (bytes and MB; None without CUDA), and with ``model`` the bytes of
    its parameters, gradients and buffers (``total`` is their sum).

    >>> "cpu_memory" in memory_profile()
    True
    """
    sample = mem_measure.sample()
    vm = psutil.virtual_memory()
    out: dict[str, Any] = sample.as_dict()
    out["cpu_memory"] = 100.0 * sample.rss / vm.total if vm.total else None  # process, percent
    out["system_memory_percent"] = float(vm.percent)
    alloc = sample.cuda_allocated
    out["gpu_memory"] = alloc / 2 ** 20 if alloc is not None else None  # MB
    out["gpu_memory_reserved"] = sample.cuda_reserved / 2 ** 20 if sample.cuda_reserved is not None else None
    if model is not None:
        sizes = model_bytes(model)
        out.update({f"{k}_bytes": v for k, v in sizes.items() if k != "total"})
        out["total"] = sizes["total"]
    return out


@contextlib.contextmanager
def memory_tracking(tracker_: MemoryTracker | None = None, enabled: bool = True) -> Iterator[MemoryTracker]:
    """Record a memory sample for every instrumented step inside the block.

    ``DebugMode.MEMORY_PROFILING`` does the same for the whole run. Snapshots ``start`` and
    ``end`` are taken around the block. ``enabled=False`` takes no snapshot and records
    nothing (the seeds' ``memory_tracking(enabled=...)``).
    """
    if isinstance(tracker_, bool):  # memory_tracking(True): the seeds' positional ``enabled``
        tracker_, enabled = None, tracker_
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled={enabled!r} is not valid; accepted values: True, False")
    trk = tracker_ or _TRACKER
    if not enabled:
        yield trk
        return
    was = trk.active
    trk.active = True
    _probes_changed()
    trk.take_snapshot("start")
    try:
        yield trk
    finally:
        trk.take_snapshot("end")
        trk.active = was
        _probes_changed()


def _probes_changed() -> None:
    """The memory probe runs on every step inside ``memory_tracking()``: the runtime asks again."""
    rt = current.runtime(create=False)
    if rt is not None:
        rt.probes.refresh()
