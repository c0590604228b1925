"""Resource monitoring (seed 003's ``monitor_resources``): CPU %, memory %, GPU utilisation and memory.

>>> r = monitor_resources()
>>> 0.0 <= r["memory_percent"] <= 100.0
True
"""

from __future__ import annotations

import logging
from typing import Any

import psutil
import torch

from torchtrace.compat.results import Result
from torchtrace.compat.settings import positive
from torchtrace.errors import GuardedLogger, get_logger
from torchtrace.measure.memory import cuda_counters

_logger = get_logger("torchtrace.resources")


def _gpu() -> dict[str, Any]:
    """CUDA device 0 (the current device): utilisation % (needs NVML; None without it), memory."""
    out: dict[str, Any] = {"gpu_available": torch.cuda.is_available(), "gpu_utilization": None,
                           "gpu_memory_allocated_mb": None, "gpu_memory_reserved_mb": None,
                           "gpu_memory_total_mb": None, "gpu_memory_percent": None}
    if not out["gpu_available"]:
        return out
    dev = torch.cuda.current_device()
    try:
        out["gpu_utilization"] = float(torch.cuda.utilization(dev))
    except Exception:  # noqa: BLE001 - NVML (pynvml) missing or not permitted: utilisation unknown
        out["gpu_utilization"] = None
    total = torch.cuda.get_device_properties(dev).total_memory
    allocated, reserved, _ = cuda_counters(dev)
    out.update(gpu_memory_allocated_mb=allocated / 2 ** 20,
               gpu_memory_reserved_mb=reserved / 2 ** 20,
               gpu_memory_total_mb=total / 2 ** 20, gpu_memory_percent=100.0 * allocated / total if total else None)
    return out


def monitor_resources(cpu_threshold: float = 90.0, memory_threshold: float = 90.0,
                      gpu_memory_threshold_mb: float = 8000.0, interval: float | None = None,
                      logger: logging.Logger | GuardedLogger | None = _logger) -> Result:
    """Sample system resources now and warn above the thresholds (seed 003's defaults).

    Keys: ``cpu_percent`` (system CPU, psutil: since the previous call, or over ``interval``
    seconds when given), ``memory_percent`` (system memory in use), ``process_memory_percent``
    and ``process_rss_bytes`` (this process), ``gpu_available``, ``gpu_utilization`` (percent,
    None without NVML), ``gpu_memory_allocated_mb``, ``gpu_memory_reserved_mb``,
    ``gpu_memory_total_mb``, ``gpu_memory_percent`` (None without CUDA), and ``warnings``
    (one sentence per threshold crossed, also logged to ``logger``).

    Raises:
        ValueError: a threshold that is not a positive number, naming it.
    """
    cpu_threshold = positive(cpu_threshold, "cpu_threshold")
    memory_threshold = positive(memory_threshold, "memory_threshold")
    gpu_memory_threshold_mb = positive(gpu_memory_threshold_mb, "gpu_memory_threshold_mb")
    if interval is not None:
        positive(interval, "interval")
    proc = psutil.Process()
    out = Result(cpu_percent=float(psutil.cpu_percent(interval=interval)),
                 memory_percent=float(psutil.virtual_memory().percent),
                 process_memory_percent=float(proc.memory_percent()), process_rss_bytes=int(proc.memory_info().rss),
                 **_gpu())
    warnings = []
    if out["cpu_percent"] > cpu_threshold:
        warnings.append(f"High CPU usage: {out['cpu_percent']}%")
    if out["memory_percent"] > memory_threshold:
        warnings.append(f"High memory usage: {out['memory_percent']}%")
    if out["gpu_memory_allocated_mb"] is not None and out["gpu_memory_allocated_mb"] > gpu_memory_threshold_mb:
        warnings.append(f"High GPU memory usage: {out['gpu_memory_allocated_mb']:.1f}MB")
    out["warnings"] = warnings
    if logger is not None:
        for w in warnings:
            logger.warning("%s", w)
    return out


__all__ = ["monitor_resources"]
