"""Where a leak is: the slow path that runs only after the leak detector saw sustained growth.

An *investigation* takes a census of live tensors (shape, dtype, device, ``grad_fn``), turns
on Python allocation tracing (``tracemalloc``) and, on CUDA, a bounded allocator history with
Python stacks. A few steps later a second census is taken; the groups of tensors whose number
grew, and the allocation sites that grew, name the leak. The per-step slope and the rule that
starts an investigation are in :mod:`torchtrace.record.growth`.
"""

from __future__ import annotations

import gc
import os
import tracemalloc
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from torchtrace.errors import get_logger
from torchtrace.measure.autograd_graph import graph_nodes

logger = get_logger(__name__)

DEFAULT_CONFIRM_STEPS = 8
MAX_REPORTED = 8
_GRAPH_NODES = 2000  # bound on the autograd-graph walk that estimates retained bytes


# ---------------------------------------------------------------- census of live tensors
def _grad_fn_name(t: torch.Tensor) -> str | None:
    fn = t.grad_fn
    return type(fn).__name__ if fn is not None else None


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # no storage (sparse, fake): the tensor itself
        return id(t)


def _kept_by_a_model(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (``AddmmBackward0`` saves ``weight.t()``): the model keeps
    it whether or not the graph does."""
    return isinstance(t, torch.nn.Parameter) or isinstance(getattr(t, "_base", None), torch.nn.Parameter)


def _saved_tensors(node: Any) -> Iterable[torch.Tensor]:
    for attr in dir(node):
        if not attr.startswith("_saved_"):
            continue
        try:
            value = getattr(node, attr)
        except Exception:  # freed buffers raise
            continue
        for v in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(v, torch.Tensor):
                yield v


def graph_bytes(t: torch.Tensor, max_nodes: int = _GRAPH_NODES) -> int:
    """Bytes of the tensors saved by ``t``'s autograd graph (bounded walk), what keeping ``t``
    retains beyond itself: each storage once, leaving out ``t``'s own storage (``TanhBackward0``
    saves its output; the census counts it already) and parameters with their views."""
    fn = t.grad_fn
    if fn is None:
        return 0
    seen_storage = {_storage_key(t)}
    total = 0
    for node in graph_nodes(fn, max_nodes):
        for v in _saved_tensors(node):
            key = _storage_key(v)
            if key in seen_storage or _kept_by_a_model(v):
                continue
            seen_storage.add(key)
            total += v.numel() * v.element_size()
    return total


_TENSOR_BASE = getattr(torch._C, "TensorBase", None) or getattr(torch._C, "_TensorBase")


def _is_tensor(obj: object) -> bool:
    # The C base class has no Python __instancecheck__: ~10x faster over a whole heap.
    try:
        return isinstance(obj, _TENSOR_BASE) and not isinstance(obj, torch.nn.Parameter)
    except Exception:
        return False


def tensor_census() -> dict[tuple, list]:
    """Live tensors grouped by (shape, dtype, device, grad_fn): [count, bytes, one weak sample].

    Walks ``gc.get_objects()``: tens to hundreds of milliseconds. Slow path only.
    """
    import weakref

    groups: dict[tuple, list] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated torch aliases warns
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        tensors = [o for o in objects if _is_tensor(o)]
    del objects
    for obj in tensors:
        try:
            # Fake or symbolic tensors (left by torch.compile) have no concrete size: skip them.
            shape = tuple(int(d) for d in obj.shape)
            nbytes = int(obj.numel()) * obj.element_size()
            key = (shape, str(obj.dtype).replace("torch.", ""), str(obj.device), _grad_fn_name(obj))
            hash(key)
        except Exception:
            continue
        g = groups.get(key)
        if g is None:
            try:
                ref = weakref.ref(obj)
            except TypeError:
                ref = None
            groups[key] = [1, nbytes, ref]
        else:
            g[0] += 1
            g[1] += nbytes
    return groups


def census_growth(before: dict[tuple, list], after: dict[tuple, list], steps: int) -> list[dict[str, Any]]:
    """Groups whose count grew between two censuses, largest byte growth first."""
    out = []
    for key, (count, nbytes, ref) in after.items():
        c0, b0 = (before[key][0], before[key][1]) if key in before else (0, 0)
        if count <= c0:
            continue
        shape, dtype, device, grad_fn = key
        item = {"shape": list(shape), "dtype": dtype, "device": device, "grad_fn": grad_fn,
                "count": count, "count_growth": count - c0, "bytes_growth": nbytes - b0,
                "per_step": (count - c0) / max(steps, 1)}
        sample = ref() if ref is not None else None
        if grad_fn is not None and sample is not None:
            try:
                item["graph_bytes_each"] = graph_bytes(sample)
            except Exception:
                item["graph_bytes_each"] = None
        retained = item["bytes_growth"] + item["count_growth"] * (item.get("graph_bytes_each") or 0)
        item["retained_bytes_growth"] = retained
        out.append(item)
    out.sort(key=lambda d: (d["retained_bytes_growth"], d["count_growth"]), reverse=True)
    return out


def describe_group(g: dict[str, Any]) -> str:
    desc = f"shape={g['shape']} dtype={g['dtype']} device={g['device']}"
    if g.get("grad_fn"):
        desc += f" grad_fn={g['grad_fn']}"
    desc += f" +{g['count_growth']} tensors (+{g['retained_bytes_growth']} bytes retained)"
    return desc


# ---------------------------------------------------------------- Python allocation sites
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # torchtrace/
_EXCLUDED = (os.path.dirname(torch.__file__) + os.sep, _OWN)
_STDLIB = os.path.dirname(os.__file__) + os.sep


def _user_frame(tb: Iterable) -> str | None:
    """The innermost user frame of an allocation; None for torchtrace's own allocations."""
    frames = list(tb)
    if any(f.filename.startswith(_OWN) for f in frames):
        return None
    for frame in reversed(frames):  # most recent first
        name = frame.filename
        if name.startswith(_EXCLUDED) or name.startswith(_STDLIB) or "site-packages" in name or name.startswith("<"):
            continue
        return f"{name}:{frame.lineno}"
    return None


def allocation_sites(snapshot: "tracemalloc.Snapshot", limit: int = MAX_REPORTED) -> list[dict[str, Any]]:
    """Live Python allocations grouped by the innermost frame outside torch, torchtrace and libraries."""
    sites: dict[str, list[int]] = {}
    for stat in snapshot.statistics("traceback"):
        site = _user_frame(stat.traceback)
        if site is None:
            continue
        s = sites.setdefault(site, [0, 0])
        s[0] += stat.size
        s[1] += stat.count
    ranked = sorted(sites.items(), key=lambda kv: kv[1][0], reverse=True)[:limit]
    return [{"site": k, "bytes": v[0], "blocks": v[1]} for k, v in ranked]


def cuda_history_sites(snapshot: dict[str, Any], limit: int = MAX_REPORTED) -> list[dict[str, Any]]:
    """Live CUDA blocks from an allocator snapshot grouped by their innermost user frame."""
    sites: dict[str, list[int]] = {}
    for seg in snapshot.get("segments", []):
        for block in seg.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = block.get("frames") or []
            site = None
            for fr in frames:  # most recent first in allocator snapshots
                name = fr.get("filename", "")
                if name and not (name.startswith(_EXCLUDED) or "site-packages" in name or name.startswith(_STDLIB)
                                 or name.startswith("<") or name.endswith((".cpp", ".h", ".cu"))):
                    site = f"{name}:{fr.get('line')}"
                    break
            if site is None:
                continue
            s = sites.setdefault(site, [0, 0])
            s[0] += int(block.get("size", 0))
            s[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: kv[1][0], reverse=True)[:limit]
    return [{"site": k, "bytes": v[0], "blocks": v[1]} for k, v in ranked]


@dataclass
class Investigation:
    """The slow path between a sustained slope and the leak report (``confirm_steps`` steps)."""

    start_step: int
    census: dict[tuple, list]
    started_tracemalloc: bool = False
    started_cuda_history: bool = False
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def begin(cls, step: int, use_tracemalloc: bool = True, cuda_history: bool = True) -> "Investigation":
        census = tensor_census()
        inv = cls(start_step=step, census=census)
        if use_tracemalloc and not tracemalloc.is_tracing():
            tracemalloc.start(16)
            inv.started_tracemalloc = True
        if cuda_history and torch.cuda.is_available() and torch.cuda.is_initialized():
            try:
                torch.cuda.memory._record_memory_history(enabled="all", max_entries=20000)
                inv.started_cuda_history = True
            except Exception:  # older builds or no CUDA caching allocator
                logger.debug("CUDA memory history unavailable", exc_info=True)
        return inv

    def finish(self, step: int, steps: int | None = None) -> dict[str, Any]:
        """Second census, allocation sites; always stops what :meth:`begin` started.

        ``steps``: the steps recorded since :meth:`begin` (default ``step - start_step``,
        which is wrong when other operations' steps came in between).
        """
        steps = max(step - self.start_step if steps is None else steps, 1)
        report: dict[str, Any] = {"start_step": self.start_step, "end_step": step, "steps": steps}
        before = self.census
        try:
            if self.started_tracemalloc or tracemalloc.is_tracing():
                report["sites"] = allocation_sites(tracemalloc.take_snapshot())
            if self.started_cuda_history:
                report["cuda_sites"] = cuda_history_sites(torch.cuda.memory._snapshot())
        finally:
            self.stop()  # before the census: tracing makes the heap walk several times slower
        report["tensors"] = census_growth(before, tensor_census(), steps)[:MAX_REPORTED]
        return report

    def stop(self) -> None:
        self.census = {}
        if self.started_tracemalloc:
            tracemalloc.stop()
            self.started_tracemalloc = False
        if self.started_cuda_history:
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception:
                pass
            self.started_cuda_history = False


def attributed_bytes(report: dict[str, Any]) -> int:
    """Bytes of growth the report accounts for: retained tensor growth plus Python/CUDA sites."""
    total = sum(max(g.get("retained_bytes_growth", 0), 0) for g in report.get("tensors", []))
    total += sum(s["bytes"] for s in report.get("sites", []))
    total += sum(s["bytes"] for s in report.get("cuda_sites", []))
    return total


def leak_detail(device: str, slope: float, report: dict[str, Any]) -> str:
    parts = [f"{device} memory grows {slope:.0f} bytes/step"]
    if report.get("tensors"):
        parts.append("accumulating: " + "; ".join(describe_group(g) for g in report["tensors"][:3]))
    sites = report.get("cuda_sites") or report.get("sites")
    if sites:
        parts.append("sites: " + ", ".join(f"{s['site']} +{s['bytes']}B" for s in sites[:3]))
    return " | ".join(parts)


__all__ = ["Investigation", "tensor_census", "census_growth", "graph_bytes", "allocation_sites", "leak_detail",
           "describe_group"]
