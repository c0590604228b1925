"""Operations inside operations: which ones hold training steps (an epoch, the run of epochs
around it), and whether a step inside them is counted as an outermost one.

A step with an optimizer inside another operation makes that one, and every operation around
it, a container: goodput counts the time their steps do not cover as data wait, not as their
own (productive), and their FLOPs are not counted (the steps' are). An operation without an
optimizer inside containers only (an evaluation step, or a validation pass, in an epoch) is
counted as it is without them (it had no FLOPs: the container was taken to count them).
"""

from __future__ import annotations

from typing import Any

MAX_CONTAINERS = 256  # operation names remembered as containers


def hold_steps(holder: Any, containers: set[str]) -> None:
    """A training step began inside ``holder``: mark it and the operations around it as
    holding steps, and remember their names in ``containers``."""
    while holder is not None and not getattr(holder, "holds_steps", False):
        holder.holds_steps = True
        if len(containers) < MAX_CONTAINERS:
            containers.add(holder.name)
        holder = getattr(holder, "parent", None)


def below_containers(parent: Any, containers: set[str]) -> bool:
    """True when every operation from ``parent`` outwards holds training steps (now, or in an
    earlier call: an epoch's validation before its first step) and none has a FLOP count open."""
    while parent is not None:
        if getattr(parent, "_flops_counter", None) is not None or not (
                getattr(parent, "holds_steps", False) or parent.name in containers):
            return False
        parent = getattr(parent, "parent", None)
    return True
