"""The settings that decide torchtrace's collectives, made the same on every rank.

The ranks issue torchtrace's collectives at the same points only while they run it with the
same settings:

* ``level``: at ``off`` a step issues none;
* ``guard``: under ``skip`` and ``raise`` every update agrees its flag (one ``all_reduce``);
* ``rank_skew_interval``: every so many steps the ranks gather their step times;
* ``forensics``: on a step every rank agreed is bad, the ranks share where the value was born.

A script that configures torchtrace on rank 0 alone, as scripts set up their logging on the
main process, leaves the other ranks at their environment's settings. Rank 0's first guard
agreement then met DDP's own collective on rank 1, and gloo ended the job.

So at the first training step of a job of more than one rank (an evaluation or a checkpoint
may run on rank 0 alone, followed by a barrier: only training steps come alike on every
rank), every rank that issues
collectives at all gathers these four settings (one ``all_gather`` of four integers, once). Where
they differ, every rank follows rank 0's, and each says so once. A rank whose settings issue
no collective (``warn``, no skew check) gathers nothing: it would be alone in the gather where
its peers issue no collective either.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from torchtrace.distributed import collectives
from torchtrace.levels import DebugLevel
from torchtrace.record import readout
from torchtrace.record.policy import GuardPolicy

if TYPE_CHECKING:
    from torchtrace.step.runtime import Runtime

FIELDS = ("level", "guard", "rank_skew_interval", "forensics")
_LEVELS = list(DebugLevel)
_GUARDS = list(GuardPolicy)
#: How many ranks that differ from rank 0 a warning names, per setting.
NAMED_RANKS = 4


def issues_collectives(rt: Runtime) -> bool:
    """Whether this rank's settings issue any collective of torchtrace's own at a step."""
    return rt.guard is not GuardPolicy.WARN or bool(rt.settings.rank_skew_interval)


def settings_of(rt: Runtime) -> tuple[int, int, int, int]:
    """This rank's :data:`FIELDS` as integers (the skew interval 0 when off)."""
    return (_LEVELS.index(rt.level), _GUARDS.index(rt.guard), rt.settings.rank_skew_interval or 0,
            int(bool(rt.settings.forensics)))


def shown(field: str, value: int) -> str:
    """One setting's value as ``configure()`` takes it.

    >>> shown("guard", 1), shown("rank_skew_interval", 0), shown("forensics", 1)
    ("'skip'", 'None', 'True')
    """
    if field == "level":
        return repr(_LEVELS[value].value)
    if field == "guard":
        return repr(_GUARDS[value].value)
    if field == "rank_skew_interval":
        return str(value or None)
    return str(bool(value))


def differences(every: list[tuple[int, ...]]) -> list[str]:
    """Per setting where some rank differs from rank 0: rank 0's value, then the ranks that differ.

    >>> differences([(1, 1, 50, 1), (1, 0, 50, 1)])
    ["guard: rank 0 'skip', rank 1 'warn'"]
    """
    said = []
    for i, field in enumerate(FIELDS):
        others = [(rank, values[i]) for rank, values in enumerate(every) if values[i] != every[0][i]]
        if not others:
            continue
        parts = [f"rank 0 {shown(field, every[0][i])}"]
        parts += [f"rank {rank} {shown(field, value)}" for rank, value in others[:NAMED_RANKS]]
        if len(others) > NAMED_RANKS:
            parts.append(f"{len(others) - NAMED_RANKS} more ranks")
        said.append(f"{field}: {', '.join(parts)}")
    return said


def gather(values: tuple[int, ...]) -> list[tuple[int, ...]] | None:
    """Every rank's ``values``, by rank (one ``all_gather``); None without a usable process group."""
    if not collectives.collectives_available():
        return None
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.int64, device=collectives.device())
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    collectives.run("settings", lambda: dist.all_gather(every, mine))
    flat = readout.read(torch.cat(every))
    n = len(values)
    return [tuple(int(v) for v in flat[r * n:(r + 1) * n]) for r in range(len(every))]


def follow(rt: Runtime, values: tuple[int, ...]) -> None:
    """Run on with ``values`` (rank 0's) as this rank's settings."""
    level, guard, interval, forensics = values
    rt.guard = _GUARDS[guard]
    rt.settings = dataclasses.replace(rt.settings, guard=rt.guard.value, rank_skew_interval=interval or None,
                                      forensics=bool(forensics))
    if _LEVELS[level] is not rt.level:
        rt.set_level(_LEVELS[level])


def agree(rt: Runtime) -> None:
    """Make this rank's :data:`FIELDS` rank 0's, where the ranks differ; warn once when they did.
    Without a process group, nothing (the runtime asks again when one starts)."""
    if not issues_collectives(rt):
        return
    every = gather(settings_of(rt))
    if every is None:
        return
    said = differences(every)
    if said:
        follow(rt, every[0])
        sentence = (f"torchtrace ran with other settings on other ranks ({'; '.join(said)}): every rank "
                    "follows rank 0's, so that all issue the same collectives; configure torchtrace alike on "
                    "every rank")
        rt.warn_once("settings_differ", "%s", sentence)
        rt.history.add_event("settings_followed", sentence, {"differences": said})
