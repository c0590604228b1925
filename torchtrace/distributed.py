"""Rank identity and the few cross-rank reductions torchtrace makes.

Who this process is (:class:`Identity`), and the only collectives torchtrace ever issues:

* :func:`reduce_shard_norms`: squared gradient norms of DTensor shards (FSDP2) summed over
  the mesh's shard dimension, one ``all_reduce`` per recorded step;
* :func:`agree_any`: one ``all_reduce(MAX)`` of a flag, so that a guard policy (skip/raise)
  takes the same decision on every rank in the same step;
* :func:`gather_step_times`: every ``rank_skew_interval`` steps, each rank's mean step time,
  for the straggler skew.

Every one of them is issued from the training thread at a point every rank reaches in the
same order when the ranks run the same program (the optimizer step, the end of an
outermost operation). They wait at most the process group's timeout
(``init_process_group(timeout=...)``); a collective that fails marks torchtrace's
collectives broken for the rest of the process, so torchtrace never issues another one
that its peers might not reach, and the failure is counted under
``torchtrace_internal_errors_total{component="distributed"}``.
"""

from __future__ import annotations

import collections
import contextvars
import hashlib
import logging
import os
import socket
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

logger = logging.getLogger("torchtrace")


@dataclass(frozen=True)
class Identity:
    """This process's place in the job. ``instance_id`` is unique per process start."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    node: str = ""
    instance_id: str = ""
    local_world_size: int = 1
    node_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except (TypeError, ValueError):
        return default


def identity(environ: Mapping[str, str] | None = None) -> Identity:
    """Rank, local rank and world size from ``torch.distributed`` when initialised, else from
    the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK),
    else a single process.

    >>> identity({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}).local_world_size
    2
    """
    env = os.environ if environ is None else environ
    rank = _int(env, "RANK", 0)
    world = _int(env, "WORLD_SIZE", 1)
    local = _int(env, "LOCAL_RANK", 0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", 1)
    node_rank = _int(env, "GROUP_RANK", _int(env, "NODE_RANK", 0))
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
            world = dist.get_world_size()
    except Exception:  # identity must never fail
        pass
    return Identity(rank=rank, local_rank=local, world_size=max(world, 1), node=socket.gethostname(),
                    instance_id=uuid.uuid4().hex, local_world_size=max(local_world, local + 1, 1),
                    node_rank=node_rank)


def rank_file_name(stem: str, suffix: str, ident: Identity) -> str:
    """``spans.jsonl`` for a single process, ``spans.rank3.jsonl`` for rank 3 of a job."""
    if ident.distributed:
        return f"{stem}.rank{ident.rank}{suffix}"
    return f"{stem}{suffix}"


def in_dataloader_worker() -> bool:
    """True inside a ``torch.utils.data.DataLoader`` worker process (any start method)."""
    try:
        from torch.utils.data import get_worker_info

        return get_worker_info() is not None
    except Exception:
        return False


# ---------------------------------------------------------------- collectives
class _State:
    """Process-wide collective bookkeeping: counts per purpose, and the broken flag."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.broken: str | None = None  # why collectives were switched off


STATE = _State()


def collectives_available() -> bool:
    """True when a default process group of more than one rank is up and nothing broke."""
    if STATE.broken is not None:
        return False
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except Exception:
        return False


def _device(group: Any = None):
    """Where a collective's tensor must live for the group's backend (cuda for NCCL)."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "cuda" not in backend and "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _collective(purpose: str, fn) -> Any:
    """Run one collective; on failure switch collectives off for good and re-raise."""
    STATE.counts[purpose] += 1
    try:
        return fn()
    except Exception as exc:
        STATE.broken = f"{purpose}: {type(exc).__name__}"
        logger.error("torchtrace: a %s collective failed (%s); torchtrace issues no further collectives in "
                     "this process", purpose, type(exc).__name__)
        raise


def shard_key(grad: Any) -> tuple | None:
    """For a DTensor gradient: ``(mesh, shard mesh dims, has_partial)``; None for a plain tensor."""
    if type(grad).__name__ != "DTensor" or not hasattr(grad, "placements"):
        return None
    mesh = grad.device_mesh
    dims = tuple(i for i, p in enumerate(grad.placements) if p.is_shard() and mesh.size(i) > 1)
    partial = any(p.is_partial() for p in grad.placements)
    return (mesh, dims, partial)


def reduce_shard_norms(norms, keys: Sequence[tuple | None]):
    """Global per-tensor norms from local shard norms: returns ``(norms, scope)``.

    ``norms`` holds each tensor's local L2 norm; ``keys[i]`` is :func:`shard_key` of its
    gradient. Squared norms of tensors sharded over the same mesh dimensions are stacked
    and summed with one ``all_reduce`` per distinct group (one per step for FSDP2); mesh
    dimensions where a tensor is replicated are not reduced, so nothing is counted twice.
    A NaN or Inf in any shard makes the global norm non-finite on every rank.
    ``scope`` is ``"global"`` when every norm now covers its whole tensor, ``"local"`` when
    some could not be combined (no process group, collectives off, Partial placements).
    """
    import torch
    import torch.distributed as dist

    groups: dict[tuple, list[int]] = {}
    scope = "global"
    for i, key in enumerate(keys):
        if key is None:
            continue
        mesh, dims, partial = key
        if partial:
            scope = "local"
            continue
        if dims:
            groups.setdefault((id(mesh), dims), []).append(i)
    if not groups:
        return norms, scope
    if not collectives_available():
        return norms, "local"
    out_dtype = norms.dtype
    squared = norms.to(torch.float64).square()
    for (_mesh_id, dims), idx in groups.items():
        mesh = keys[idx[0]][0]
        index = torch.tensor(idx, device=squared.device)
        part = squared.index_select(0, index)
        for dim in dims:
            group = mesh.get_group(dim)
            home = part.device
            dev = _device(group)
            buf = part.to(dev) if dev != home else part
            _collective("grad_norm", lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group))
            part = buf.to(home) if dev != home else buf
        squared = squared.index_copy(0, index, part)
    return squared.sqrt().to(out_dtype), scope


def agree_any(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank: one ``all_reduce(MAX)``.

    Without a usable process group, the local flag.
    """
    if not collectives_available():
        return flag
    import torch
    import torch.distributed as dist

    from torchtrace.record import readout

    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=_device())
    _collective("guard", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX))
    return readout.read(t)[0] > 0


def gather_step_times(mean_s: float) -> list[float] | None:
    """Every rank's ``mean_s`` (one ``all_reduce`` of a world-sized vector), or None."""
    if not collectives_available():
        return None
    import torch
    import torch.distributed as dist

    from torchtrace.record import readout

    world, rank = dist.get_world_size(), dist.get_rank()
    t = torch.zeros(world, dtype=torch.float64, device=_device())
    t[rank] = mean_s
    _collective("skew", lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM))
    return readout.read(t)


def skew(times: Sequence[float]) -> float:
    """Slowest rank's time over the median rank's (1.0 when all are equal).

    >>> skew([1.0, 1.0, 3.0])
    3.0
    """
    med = statistics.median(times)
    if med <= 0:
        return 1.0
    return max(times) / med


# ---------------------------------------------------------------- stragglers
class StragglerProbe:
    """Per outermost operation, the mean step time over ``interval`` steps is gathered from
    every rank and the skew (slowest over median) exported as ``torchtrace_rank_step_skew``.

    The gather happens at the end of the step every rank reaches in the same order (its
    ``interval``-th outermost call of that operation).
    """

    def __init__(self, rt, interval: int) -> None:
        self.rt = rt
        self.interval = interval
        self._sum: collections.Counter[str] = collections.Counter()
        self._n: collections.Counter[str] = collections.Counter()
        self.last: dict[str, Any] | None = None
        from prometheus_client import Gauge

        from torchtrace import semconv

        self.step_seconds = Gauge(semconv.M_RANK_STEP_SECONDS,
                                  "This rank's mean step time over the last skew window, in seconds.",
                                  list(semconv.COMMON_LABELS) + ["operation"], registry=rt.metrics.registry)

    def enter(self, scope) -> None:
        return None

    def exit(self, scope, exc) -> None:
        from torchtrace import api, semconv

        if api.current_step() is not None:  # nested operation: only outermost steps count
            return
        op = scope.name
        self._sum[op] += time.perf_counter() - scope._t0
        self._n[op] += 1
        if self._n[op] < self.interval:
            return
        mean = self._sum[op] / self._n[op]
        self._sum[op] = 0.0
        self._n[op] = 0
        m = self.rt.metrics
        self.step_seconds.labels(m.run_id, m.rank, m.operation(op)).set(mean)
        times = gather_step_times(mean)
        if not times:
            return
        value = skew(times)
        m.set_rank_skew(value)
        slowest = max(range(len(times)), key=times.__getitem__)
        self.last = {"operation": op, "step": scope.step, "skew": value, "slowest_rank": slowest,
                     "step_seconds_by_rank": list(times)}
        scope._span.set_attributes({semconv.RANK_STEP_SKEW: value, semconv.RANK_SLOWEST: slowest})

    def finalize(self, scope, record, span) -> None:
        return None


# ---------------------------------------------------------------- one trace per step
_forced_trace_id: contextvars.ContextVar[int] = contextvars.ContextVar("torchtrace_trace_id", default=0)


def step_trace_id(run_id: str, operation: str, step: int) -> int:
    """The 128-bit trace id every rank derives for (run, operation, step)."""
    digest = hashlib.sha256(f"{run_id}\x00{operation}\x00{step}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1


class StepTraceIdGenerator(RandomIdGenerator):
    """An OTel IdGenerator: random ids, except a root step span's trace id is derived from
    (run id, operation, step), so all ranks' spans of one step share one trace."""

    def generate_trace_id(self) -> int:
        return _forced_trace_id.get() or super().generate_trace_id()

    def is_trace_id_random(self) -> bool:
        # A derived id is not random in the W3C sense (trace-flags "random" bit).
        return not _forced_trace_id.get()


class _StepTrace:
    __slots__ = ("_value", "_token")

    def __init__(self, value: int) -> None:
        self._value = value
        self._token = None

    def __enter__(self) -> None:
        if self._value:
            self._token = _forced_trace_id.set(self._value)

    def __exit__(self, *exc) -> None:
        if self._token is not None:
            _forced_trace_id.reset(self._token)


_NO_TRACE = _StepTrace(0)


def step_trace(rt, operation: str, step: int) -> _StepTrace:
    """Context around the step span's creation: forces the shared trace id when enabled."""
    if not getattr(rt, "shared_step_trace", False):
        return _NO_TRACE
    return _StepTrace(step_trace_id(rt.settings.run_id, operation, step))


# ---------------------------------------------------------------- wiring
def install(rt) -> None:
    """Attach the distributed pieces to a new Runtime (called once from its constructor)."""
    s = rt.settings
    rt.shared_step_trace = bool(getattr(s, "shared_step_trace", False))
    if rt.shared_step_trace:
        rt.tracer.id_generator = StepTraceIdGenerator()
    straggler = None
    interval = getattr(s, "rank_skew_interval", None)
    if rt.identity.distributed and interval:
        straggler = StragglerProbe(rt, interval)
        rt.probes.append(straggler)
    elif not rt.identity.distributed:
        # One rank is its own median and its own slowest: the skew is exactly 1.
        rt.metrics.set_rank_skew(1.0)

    def section() -> dict[str, Any]:
        ident = rt.identity
        return {"rank": ident.rank, "local_rank": ident.local_rank, "world_size": ident.world_size,
                "local_world_size": ident.local_world_size, "node": ident.node, "node_rank": ident.node_rank,
                "instance_id": ident.instance_id, "collectives": dict(STATE.counts),
                "collectives_broken": STATE.broken,
                "rank_skew": straggler.last if straggler is not None else None}

    rt.report_sections["distributed"] = section
