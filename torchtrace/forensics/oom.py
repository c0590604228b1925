"""Out of memory inside a step: record memory statistics (and a CUDA snapshot), then re-raise
or, with the ``skip`` guard, drop the batch after freeing the cache."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from torchtrace.errors import get_logger
from torchtrace.measure import memory as mem_measure
from torchtrace.record.policy import GuardPolicy

logger = get_logger("torchtrace.forensics")


# torch's CPU allocator raises a plain RuntimeError when malloc fails, e.g. "[enforce fail at
# alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to
# allocate 35184372088832 bytes. Error code 12 (Cannot allocate memory)" (torch 2.x).
CPU_ALLOCATOR_OOM = "DefaultCPUAllocator: can't allocate memory"


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory error: torch's ``OutOfMemoryError`` (CUDA and other accelerators), a
    RuntimeError saying "out of memory", or the CPU allocator's failure to allocate."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return "out of memory" in text.lower() or CPU_ALLOCATOR_OOM in text


def _history_recording() -> bool:
    try:
        snap = torch.cuda.memory._snapshot()
        return any(seg.get("frames") for t in snap.get("device_traces", []) for seg in t)
    except Exception:
        return False


def handle(rt, scope, exc: BaseException) -> dict[str, Any]:
    """Record the OOM; free what can be freed when the batch is to be skipped."""
    info: dict[str, Any] = {"step": scope.step, "operation": scope.name, "rank": rt.identity.rank,
                            "exception_type": type(exc).__qualname__,
                            "memory": mem_measure.sample(cuda=torch.cuda.is_available()).as_dict()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            stats = torch.cuda.memory_stats()
            info["cuda"] = {k: stats.get(k) for k in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                                                      "reserved_bytes.all.current", "num_alloc_retries", "num_ooms")}
            if rt.run_path is not None and _history_recording():
                path = rt.run_path / f"oom-snapshot-rank{rt.identity.rank}-step{scope.step}-{int(time.time())}.pickle"
                torch.cuda.memory._dump_snapshot(str(path))
                info["snapshot"] = str(path)
        except Exception as err:  # a failed snapshot must not hide the OOM
            rt.errors.report("forensics", err)
    skip = rt.guard is GuardPolicy.SKIP
    info["action"] = "skipped" if skip else "raised"
    info["detail"] = f"out of memory at step {scope.step} of {scope.name}; batch {info['action']}"
    if skip:
        for ref in rt.params_for(scope.model, scope.optimizer):
            ref.param.grad = None
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    logger.error("torchtrace: %s", info["detail"])
    return info
