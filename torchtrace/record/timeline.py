"""Pieces of the goodput timeline (:mod:`torchtrace.record.goodput`): who owns an interval.

Pure functions of host times (seconds on one clock); no state, no locks.
"""

from __future__ import annotations


def own_time(last: float, start: float, entered: float, left: float | None) -> float:
    """torchtrace's own seconds between a step that ended at ``last`` and the next, which it
    began at ``entered`` and started timing at ``start``: its bookkeeping after the first step
    (until ``left``) and before the second. The rest of the gap is the loop's: data wait.

    >>> own_time(1.0, 2.0, 1.75, 1.25)  # 0.25 s after the step before, 0.25 s before this one
    0.5
    """
    head = start - (entered if entered > last else last)
    tail = ((left if left < entered else entered) - last) if left is not None and left > last else 0.0
    mine = (head if head > 0.0 else 0.0) + tail
    return mine if mine < start - last else start - last


def split_replays(a: float, b: float, replays: list[tuple[float, float]],
                  debt: float) -> tuple[list[tuple[float, float]], float, float]:
    """Forensic seconds in [a, b]: ``(replays left after b, seconds replayed inside, debt repaid)``.

    Replays do not overlap each other; the debt is repaid from what the replays leave of [a, b].
    """
    inside = sum(max(0.0, min(e, b) - max(s, a)) for s, e in replays)
    rest = [(max(s, b), e) for s, e in replays if e > b]
    repaid = min(debt, max(0.0, (b - a) - inside))
    return rest, inside, repaid
