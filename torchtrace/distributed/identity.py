"""Who this process is in the job: rank, local rank, world size, node, and per-rank file names."""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torchtrace.patches import Patches, marked


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

    A launcher that names no global rank (Lightning's for ``devices=N``: LOCAL_RANK, NODE_RANK
    and WORLD_SIZE) gives the first node's processes their local rank as their rank; on a later
    node the rank is unknown until the process group starts, and read as 0.

    >>> identity({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}).local_world_size
    2
    >>> identity({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}).rank
    1
    """
    env = os.environ if environ is None else environ
    world = _int(env, "WORLD_SIZE", 1)
    local = _int(env, "LOCAL_RANK", 0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", 1)
    node_rank = _int(env, "GROUP_RANK", _int(env, "NODE_RANK", 0))
    rank = _int(env, "RANK", local if world > 1 and node_rank == 0 else 0)
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


def refreshed(ident: Identity) -> Identity:
    """``ident`` with rank, local rank and world size read again (:func:`identity`), the same
    process otherwise (its ``instance_id`` and node kept)."""
    fresh = identity()
    return dataclasses.replace(fresh, instance_id=ident.instance_id, node=ident.node)


_STARTS = "init_process_group"  # the torch.distributed function that starts the default process group


def watch_group_start(started: Callable[[], None]) -> None:
    """Call ``started()`` after ``torch.distributed.init_process_group`` returns (wrapped where
    torch and the frameworks reach it: ``torch.distributed`` and its ``distributed_c10d``).

    A framework's launcher starts the process group after the user's script configured
    torchtrace (Lightning's ``devices=N`` on one machine, a ``torch.multiprocessing`` spawn):
    one process of the job may have read a world of one from its environment, another a world
    of two. Collectives decided on that reading would wait for each other forever; read again
    as the group starts, every rank decides alike. A function bound by name before
    ``configure()`` is not reached; the environment torchrun sets is read at configure.
    """
    for module in _group_modules():
        fn = getattr(module, _STARTS, None)
        if fn is not None and not marked(fn):
            _PATCHES.replace(module, _STARTS, _calling_after(fn, started))


def unwatch_group_start() -> None:
    """Put torch's own ``init_process_group`` back where torchtrace's wrapper still is
    (idempotent; at ``shutdown()``)."""
    _PATCHES.undo()


_PATCHES = Patches()


def _group_modules() -> list[Any]:
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d
    except Exception:  # a torch built without distributed
        return []
    return [dist, distributed_c10d] if dist.is_available() else []


def _calling_after(fn: Callable[..., Any], started: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def init_process_group(*args: object, **kwargs: object) -> Any:
        result = fn(*args, **kwargs)
        try:
            started()
        except Exception:  # the caller's group is up; torchtrace's reading of it never fails the call
            pass
        return result

    return init_process_group


def rank_file_name(stem: str, suffix: str, ident: Identity) -> str:
    """``spans.jsonl`` for a single process, ``spans.rank3.jsonl`` for rank 3 of a job."""
    if ident.distributed:
        return f"{stem}.rank{ident.rank}{suffix}"
    return f"{stem}{suffix}"


def rerunning_main_script() -> bool:
    """True while this process, started by ``multiprocessing`` with spawn or forkserver (a
    DataLoader worker, a ``torch.multiprocessing.spawn`` rank), runs the main script's top level
    again, as such a process does before it runs what it was started for: ``multiprocessing``
    runs the script under the name ``__mp_main__`` (before ``multiprocessing.parent_process()``
    is set), and a frame of that run is on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def in_dataloader_worker() -> bool:
    """True inside a ``torch.utils.data.DataLoader`` worker process (any start method)."""
    try:
        from torch.utils.data import get_worker_info

        return get_worker_info() is not None
    except Exception:
        return False
