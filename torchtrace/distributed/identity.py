"""Who this process is in the job: rank, local rank, world size, node, and per-rank file names."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Mapping


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
