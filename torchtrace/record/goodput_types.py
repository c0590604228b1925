"""The goodput ledger's terms (:mod:`torchtrace.record.goodput`): operation kinds, a finished
step, what the ledger made of it, a job's goodput.

No state, no locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from torchtrace.record.throughput import Finding

TRAIN, CHECKPOINT, EVALUATION, OTHER = "train", "checkpoint", "evaluation", "other"
OPERATION_KINDS = (TRAIN, CHECKPOINT, EVALUATION, OTHER)
BADPUT_OF_KIND = {CHECKPOINT: "checkpoint", EVALUATION: "evaluation", OTHER: "other"}
PRODUCTIVE = "productive"


@dataclass(slots=True)
class FinishedStep:
    """One finished operation call, as the step pipeline saw it (times in seconds, one clock).

    ``applied``: the optimizer update was applied (False when the guard skipped it).
    ``failed``: the step raised (the script caught it and went on): no update, but none the guard
    or a loss scaler skipped either: badput *other*, not *skipped_step*.
    ``excluded``: left out of throughput (the step whose FLOPs were counted).
    ``kind``: one of :data:`OPERATION_KINDS`.
    ``device_cycle``: on a GPU, the step's cycle in device time, the time base of its rates
    (``OperationWindow.add``); None on the host.
    ``enclosing`` and ``holds_steps``: see :mod:`torchtrace.record.goodput`'s docstring
    (operations that hold steps) and :func:`enclosing`.
    ``entered``: when torchtrace began the step (before ``start``); ``left``: when it was done
    with the step before. Its own time between the two steps is *other*, not data wait
    (:func:`~torchtrace.record.goodput.own_time`).
    ``checkpoint_s``: seconds of checkpoint saves and loads inside the step (a loop body that
    saves every few steps): badput *checkpoint*, taken out of the step's own time.
    """

    start: float
    end: float
    applied: bool = True
    excluded: bool = False
    samples: int | None = None
    tokens: int | None = None
    flops: int | None = None
    kind: str = TRAIN
    operation: str = "train_step"
    enclosing: tuple[float, str] | None = None
    holds_steps: bool = False
    entered: float | None = None
    left: float | None = None
    device_cycle: float | None = None
    checkpoint_s: float = 0.0
    failed: bool = False


class StepAccount(NamedTuple):
    """What the ledger made of one step: its data wait (None for the first) and findings."""

    data_wait_s: float | None
    findings: tuple[Finding, ...] = ()


@dataclass(frozen=True)
class Goodput:
    """Wall time since configure split into productive time and badput by kind."""

    wall_s: float
    productive_s: float
    badput: dict[str, float] = field(default_factory=dict)  # every kind of semconv.BADPUT_KINDS

    @property
    def ratio(self) -> float | None:
        """Productive time over wall time; None before any wall time passed."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else None


def enclosing(kind: str, start: float, holds_steps: bool) -> tuple[float, str] | None:
    """What :class:`FinishedStep` takes as ``enclosing`` for a
    step inside an operation of ``kind`` that started at ``start``: its time that no step inside
    it covers is of its kind (an evaluation pass's loading is evaluation), productive for a
    training step (a loss function decorated on its own inside it), and data wait, as without
    it, for an operation that holds training steps (an epoch): then None.

    >>> enclosing(EVALUATION, 2.0, False), enclosing(TRAIN, 2.0, False), enclosing(TRAIN, 2.0, True)
    ((2.0, 'evaluation'), (2.0, 'productive'), None)
    """
    if kind != TRAIN:
        return start, BADPUT_OF_KIND[kind]
    return None if holds_steps else (start, PRODUCTIVE)
