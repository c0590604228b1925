"""The collectives torchtrace issues, and the rule that keeps them safe.

Every collective goes through :func:`run`: it is counted by purpose, and one that fails
switches torchtrace's collectives off for the rest of the process, so torchtrace never issues
another one that its peers might not reach (the failure is counted under
``torchtrace_internal_errors_total{component="distributed"}`` by the caller). Callers issue
them from the training thread at a point every rank reaches in the same order (the optimizer
step, the end of an outermost operation); they wait at most the process group's timeout.

The collectives, by purpose:

* ``grad_norm``: squared gradient norms of DTensor shards (FSDP2) summed over the mesh's
  shard dimension (:func:`reduce_shard_norms`, from :mod:`torchtrace.measure.gradients`);
* ``guard``: one ``all_reduce(MAX)`` of a flag, so a guard policy takes the same decision on
  every rank (:mod:`torchtrace.record.policy`);
* ``settings``: once, at the first step, the settings that decide the others, so that every
  rank issues the same ones (:mod:`torchtrace.step.agreement`);
* ``skew``: every ``rank_skew_interval`` steps, each rank's mean step time
  (:mod:`torchtrace.probes.straggler`).

None is issued inside ``Join`` (uneven inputs: :func:`watch_join`): once a rank has run out
of batches, only DDP's own collectives are matched by the shadow ones it runs, and any other
met them (gloo aborted the process: "Received data size doesn't match expected size").
"""

from __future__ import annotations

import collections
import functools
import time
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from torchtrace.errors import get_logger
from torchtrace.patches import Patches, marked

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

logger = get_logger("torchtrace")


OWN_SPANS = 1024  # the time spans of torchtrace's latest collectives kept (several per step at most)


class _State:
    """Process-wide collective bookkeeping: counts per purpose, the broken flag, and when
    torchtrace's latest collectives ran."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.broken: str | None = None  # why collectives were switched off
        # (began, ended) of each recent run(), in time.time_ns(): a flight-recorder entry created
        # inside one is torchtrace's own (issued_by_torchtrace)
        self.spans: collections.deque[tuple[int, int]] = collections.deque(maxlen=OWN_SPANS)


STATE = _State()


def collectives_available() -> bool:
    """True when a default process group of more than one rank is up, nothing broke, and no
    ``Join`` context is open (:func:`watch_join`)."""
    if STATE.broken is not None or _JOINS.open:
        return False
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except Exception:
        return False


class _Joins:
    """The ``Join`` contexts open in this process (uneven inputs), counted by :func:`watch_join`'s wrappers."""

    def __init__(self) -> None:
        self.open = 0
        self.patches = Patches()


_JOINS = _Joins()


def watch_join() -> None:
    """Count the ``torch.distributed.algorithms.join.Join`` contexts open, from entry to the end
    of exit (where a rank out of batches runs the shadow collectives): torchtrace issues no
    collective while one is. At ``configure()``; :func:`unwatch_join` at ``shutdown()``."""
    try:
        from torch.distributed.algorithms.join import Join
    except Exception:  # a torch built without distributed
        return
    enter, leave = vars(Join)["__enter__"], vars(Join)["__exit__"]
    if marked(enter) or marked(leave):
        return

    @functools.wraps(enter)
    def entering(self: Any) -> Any:
        _JOINS.open += 1
        try:
            return enter(self)
        except BaseException:
            _JOINS.open -= 1
            raise

    @functools.wraps(leave)
    def leaving(self: Any, *args: Any) -> Any:
        try:
            return leave(self, *args)
        finally:
            _JOINS.open = max(0, _JOINS.open - 1)

    _JOINS.patches.replace(Join, "__enter__", entering)
    _JOINS.patches.replace(Join, "__exit__", leaving)


def unwatch_join() -> None:
    """Undo :func:`watch_join` (idempotent)."""
    _JOINS.patches.undo()


def device(group: ProcessGroup | None = None) -> torch.device:
    """Where a collective's tensor must live for the group's backend (cuda for NCCL)."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "cuda" not in backend and "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def run(purpose: str, fn) -> Any:
    """Run one collective; on failure switch collectives off for good and re-raise. When it
    ran is kept (:func:`issued_by_torchtrace`)."""
    STATE.counts[purpose] += 1
    began = time.time_ns()
    try:
        return fn()
    except Exception as exc:
        STATE.broken = f"{purpose}: {type(exc).__name__}"
        logger.error("torchtrace: a %s collective failed (%s); torchtrace issues no further collectives in "
                     "this process", purpose, type(exc).__name__)
        raise
    finally:
        STATE.spans.append((began, time.time_ns()))


def spans_since(since_ns: int) -> list[tuple[int, int]]:
    """The ``(began, ended)`` times of torchtrace's collectives that ended at ``since_ns`` or later."""
    return [span for span in STATE.spans if span[1] >= since_ns]


def issued_by_torchtrace(created_ns: int, spans: Iterable[tuple[int, int]] | None = None) -> bool:
    """Whether a collective created at ``created_ns`` (``time.time_ns()``'s clock, as the flight
    recorder stamps its entries) was one of torchtrace's own: created while :func:`run` ran
    (``spans``: its latest ``(began, ended)`` times, the kept ones by default).

    >>> issued_by_torchtrace(15, [(10, 20)]), issued_by_torchtrace(25, [(10, 20)])
    (True, False)
    """
    return any(began <= created_ns <= ended for began, ended in (STATE.spans if spans is None else spans))


# Any: a DTensor is known by its class name (torch.distributed.tensor may not be importable).
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
        mesh = keys[idx[0]][0]  # type: ignore[index]  # (grouped keys are never None)
        index = torch.tensor(idx, device=squared.device)
        part = squared.index_select(0, index)
        for dim in dims:
            group = mesh.get_group(dim)
            home = part.device
            dev = device(group)
            buf = part.to(dev) if dev != home else part
            run("grad_norm", lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group))
            part = buf.to(home) if dev != home else buf
        squared = squared.index_copy(0, index, part)
    return squared.sqrt().to(out_dtype), scope
