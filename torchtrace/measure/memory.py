"""Memory samples: process RSS from the OS, CUDA allocator counters (host-side, no sync)."""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Literal

import psutil
import torch

_PROCESS: psutil.Process | None = None


def _process() -> psutil.Process:
    global _PROCESS
    if _PROCESS is None or _PROCESS.pid != os.getpid():
        _PROCESS = psutil.Process()
    return _PROCESS


@dataclass(frozen=True)
class MemorySample:
    """One memory sample, in bytes. CUDA fields are None without CUDA."""

    rss: int
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak_allocated: int | None = None
    device: str = "cpu"

    def as_dict(self) -> dict[str, int | None]:
        return {
            "rss_bytes": self.rss,
            "cuda_allocated_bytes": self.cuda_allocated,
            "cuda_reserved_bytes": self.cuda_reserved,
            "cuda_peak_allocated_bytes": self.cuda_peak_allocated,
        }


_STATM: tuple[int, int] | None = None  # (pid, fd) of an open /proc/self/statm
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _statm_rss() -> int | None:
    """RSS from ``/proc/self/statm`` through a kept-open descriptor (one pread, a few µs).

    The same number psutil reports on Linux (resident pages times the page size); None where
    there is no procfs, and the caller falls back to psutil.
    """
    global _STATM
    pid = os.getpid()
    try:
        if _STATM is None or _STATM[0] != pid:
            if not sys.platform.startswith("linux"):
                return None
            _STATM = (pid, os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        data = os.pread(_STATM[1], 128, 0)
        return int(data.split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def rss_bytes() -> int:
    """Resident set size of this process."""
    rss = _statm_rss()
    if rss is not None:
        return rss
    return int(_process().memory_info().rss)


def sample(cuda: bool = True) -> MemorySample:
    """Process RSS, and the current CUDA device's allocator counters when CUDA is initialised.

    The CUDA counters are kept by the caching allocator on the host: reading them does not
    synchronise the device. CUDA is never initialised by this call.
    """
    rss = rss_bytes()
    if cuda and torch.cuda.is_initialized():  # initialised implies available; cheaper to ask
        dev = torch.cuda.current_device()
        allocated, reserved, peak = cuda_counters(dev)
        return MemorySample(rss=rss, cuda_allocated=allocated, cuda_reserved=reserved, cuda_peak_allocated=peak,
                            device=f"cuda:{dev}")
    return MemorySample(rss=rss)


def cuda_counters(device: int) -> tuple[int, int, int]:
    """``(allocated, reserved, peak allocated)`` bytes of a CUDA device: what
    ``torch.cuda.memory_allocated``, ``memory_reserved`` and ``max_memory_allocated`` return,
    from one read of the allocator's statistics. Each of those three flattens and sorts every
    statistic the allocator keeps to return one: called every step, the three took 548 us of
    CPU a step on an H200 machine (benchmarks/RESULTS.md)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    allocated = stats.get("allocated_bytes", {}).get("all", {})
    reserved = stats.get("reserved_bytes", {}).get("all", {})
    return int(allocated.get("current", 0)), int(reserved.get("current", 0)), int(allocated.get("peak", 0))


def step_sample(cuda: bool = True) -> dict[str, Any]:
    """:func:`sample` as the step record's ``memory`` dict (only the keys that have values)."""
    if cuda and torch.cuda.is_initialized():
        s = sample(cuda=True)
        return {**s.as_dict(), "device": s.device}
    return {"rss_bytes": rss_bytes()}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


# glibc's mallinfo2 once looked up; False where it is missing.
_MALLINFO2: Callable[[], _MallInfo2] | Literal[False] | None = None


def heap_in_use_bytes() -> int | None:
    """Bytes malloc has handed out and not had back (glibc ``mallinfo2``: in-use arena + mmapped).

    Unlike RSS this falls when memory is freed even if the allocator keeps the pages, so a
    leak of CPU tensors shows up as growth even after an earlier phase left free pages behind.
    None where glibc's ``mallinfo2`` is not available.
    """
    global _MALLINFO2
    if _MALLINFO2 is None:
        _MALLINFO2 = False
        try:
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = libc.mallinfo2
            fn.restype = _MallInfo2
            fn.argtypes = []
            _MALLINFO2 = fn
        except (OSError, AttributeError):
            pass
    if not _MALLINFO2:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)
