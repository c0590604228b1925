"""Goodput: where a job's wall time went, step by step, and how fast its steps ran.

Host-side bookkeeping; no torch, no telemetry. The step pipeline feeds one
:class:`FinishedStep` per finished operation call and the seconds of each forensic replay;
it reads back a :class:`Goodput` (the goodput ratio and badput seconds by kind), throughput
windows with MFU, and the findings of the throughput_drop and data_stall rules.

**The timeline.** Wall time runs from ``configured_at`` (``configure()``) to now, on one
monotonic clock (``time.perf_counter()``) for every call. Each instant of it is counted
once, in exactly one class, so that ``productive + sum(badput) == wall``:

- *startup*: from configure to the start of the first step;
- a step's own interval, by its operation kind: ``train`` with its update applied is
  *productive*; ``train`` whose update was not applied (the guard skipped it) is
  *skipped_step*; ``train`` that raised (the script caught it) is *other*; ``checkpoint``,
  ``evaluation`` and ``other`` operations are badput of the
  same name. The FLOP-counting step made its update: it is productive (its slow-down
  only leaves it out of throughput). Checkpoint saves and loads inside a step
  (``FinishedStep.checkpoint_s``) are *checkpoint*, taken out of the step's own class;
- *data_wait*: every instant after the first step's start that no step covers (the input pipeline,
  and everything else the loop does between steps), but torchtrace's own work between two steps
  (``entered``, ``left`` of :meth:`GoodputLedger.add_step`) and the run's end (``pause(last=True)``): *other*;
- inside an operation that holds steps, the instants its steps do not cover are of its kind
  (an evaluation pass's loading between its evaluation steps is evaluation; a training step's
  time around a loss function decorated on its own is productive), except in an operation
  that holds training steps (an epoch): there they are data wait, as without it, not
  productive (the pipeline says so: ``enclosing`` and ``holds_steps`` of :meth:`GoodputLedger.add_step`);
- *forensics*: the seconds of forensic replays, taken out of whatever class the instants
  they covered would otherwise have been (a replay that ran between two steps is not data
  wait). A replay reported after its instants were already counted (they cannot be
  recounted: badput counters only grow) is taken out of the next instants counted.

While nothing is measured (level ``off``, or ``throughput=False``) the ledger is paused
(:meth:`GoodputLedger.pause`): that stretch is in no class and not in wall time either (the
job may have trained all along; nobody looked), and the first step after it has no data
wait. Without the pause, turning torchtrace off for an hour and on again counted the hour
as data wait, and the goodput alert fired on a healthy job. While the script says training is
over for now (:meth:`GoodputLedger.idle`, from :func:`torchtrace.idle`) the ledger is paused
until the next *training* step: an evaluation or a checkpoint booked meanwhile is counted as
its own class, and the pause goes on from its end.

Overlapping steps (a step inside another) are not counted twice: a step's interval starts
at the end of the time already counted. Two views: :meth:`GoodputLedger.closed` counts up
to the end of the last finished step (final: export counters from its increases);
:meth:`GoodputLedger.snapshot` counts up to ``now``, the open stretch since the last step
as startup or data wait (for the goodput gauge; a step running now is counted when it ends).

>>> ledger = GoodputLedger(configured_at=0.0)
>>> _ = ledger.add_step(FinishedStep(start=10.0, end=12.0))                 # productive
>>> _ = ledger.add_step(FinishedStep(start=13.0, end=14.0, applied=False))  # skipped
>>> g = ledger.snapshot(now=16.0)
>>> g.productive_s, g.badput["startup"], g.badput["skipped_step"], g.badput["data_wait"]
(2.0, 10.0, 1.0, 3.0)
>>> g.ratio
0.125
"""

from __future__ import annotations

import threading
from typing import Any

from torchtrace import semconv
from torchtrace.record.goodput_types import BADPUT_OF_KIND as _BADPUT_OF_KIND
from torchtrace.record.goodput_types import (
    CHECKPOINT,
    EVALUATION,
    OPERATION_KINDS,
    OTHER,
    TRAIN,
    FinishedStep,
    Goodput,
    StepAccount,
    enclosing,
)
from torchtrace.record.goodput_types import PRODUCTIVE as _PRODUCTIVE
from torchtrace.record.throughput import OperationWindow, RuleSettings, Throughput, settings_state

MAX_OPERATIONS = 32  # operations with their own throughput window; later ones share none
MAX_PEAKS = 4 * MAX_OPERATIONS  # operations with a peak FLOP/s of their own (later ones have no MFU)
MAX_PENDING_REPLAYS = 64
_KINDS = frozenset(OPERATION_KINDS)
STATE_VERSION = 1


# ---------------------------------------------------------------- who owns an interval
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


def _own_class(step: FinishedStep) -> str:
    """The class of a step's own interval: a training step's is productive, *skipped_step*
    (its update skipped) or *other* (it raised: no update, and none skipped); another kind's
    is badput of its kind.

    >>> _own_class(FinishedStep(0.0, 1.0, applied=False, failed=True))
    'other'
    """
    if step.kind != TRAIN:
        return _BADPUT_OF_KIND[step.kind]
    if step.failed:
        return _BADPUT_OF_KIND[OTHER]
    return _PRODUCTIVE if step.applied else "skipped_step"


class GoodputLedger:
    """Goodput accounting, throughput windows and their rules for one process. Thread-safe: the
    step thread adds, an exporter thread may take snapshots.

    >>> ledger = GoodputLedger(configured_at=100.0, peak_flops=1e9)
    >>> for i in range(3):
    ...     _ = ledger.add_step(FinishedStep(100.0 + i, 100.5 + i, samples=4, flops=10**8))
    >>> tp = ledger.throughput("train_step")  # 3 steps of 0.5 s, 2 waits of 0.5 s
    >>> tp.samples_per_s, tp.mfu, tp.data_wait_share
    (4.8, 0.12, 0.4)
    """

    def __init__(self, configured_at: float, *, peak_flops: float | None = None,
                 rules: RuleSettings | None = None) -> None:
        self.configured_at = float(configured_at)
        self.peak_flops = peak_flops  # every operation's peak FLOP/s when given (configured)
        self._peaks: dict[str, float | None] = {}  # otherwise each operation's own (set_peak)
        self.rules = rules or RuleSettings()
        self._lock = threading.Lock()
        self._cursor = self.configured_at  # everything before it is counted
        self._started = False
        self._last_operation: str | None = None
        self._last_kind: str | None = None
        self._totals: dict[str, float] = {_PRODUCTIVE: 0.0, **{k: 0.0 for k in semconv.BADPUT_KINDS}}
        self._prior_wall = 0.0  # wall time of a run restored with load_state_dict
        self._unmeasured = 0.0  # seconds while paused: in no class, not in wall time
        self._paused_at: float | None = None  # when measuring stopped (pause), until the next step
        self._idle = False  # paused by idle(): until the next training step, not any step
        self._replays: list[tuple[float, float]] = []  # forensic intervals not yet counted
        self._debt = 0.0  # forensic seconds reported after their instants were counted
        self._windows: dict[str, OperationWindow] = {}
        self._last_end: float | None = None  # the latest end of a step (data wait's origin)

    # ------------------------------------------------------------ input
    def add_step(self, step: FinishedStep) -> StepAccount:
        """Count one finished step (from the step thread); returns its data wait (None after a
        pause and for the first step) and what the throughput rules found on it. Booked at once
        under the lock (uncontended but for a scrape).

        Raises:
            ValueError: ``step.kind`` is not one of :data:`OPERATION_KINDS`.
        """
        kind, operation = step.kind, step.operation
        if kind not in _KINDS:
            raise ValueError(f"kind={kind!r} is not valid; accepted values: {', '.join(OPERATION_KINDS)}")
        start = max(step.start, self.configured_at)
        end = max(step.end, start)
        own = _own_class(step)
        if step.holds_steps and kind == TRAIN:
            own = "data_wait"
        with self._lock:
            before = self._totals[own]
            wait, mine = self._book(start, end, own, step.enclosing, step.entered, step.left)
            if self._idle:
                self._still_idle(kind, end)
            saving = min(step.checkpoint_s, self._totals[own] - before)
            if saving > 0:  # (moved within one booking: a badput counter never goes down)
                self._totals[own] -= saving
                self._totals[_BADPUT_OF_KIND[CHECKPOINT]] += saving
            same_operation, self._last_operation = self._last_operation == operation, operation
            same_kind, self._last_kind = self._last_kind == kind, kind
            window = self._window(operation)
            if window is None or step.excluded:
                return StepAccount(wait, ())
            # The wait after a step of another kind (training, then the first evaluation step) is not
            # this one's input pipeline; after one of the same kind (a GAN's two steps) it is. Rates
            # are per second of wall time: torchtrace's own time between the steps is in the cycle.
            found = window.add(end - start - saving + mine, wait if same_kind and wait is not None else 0.0,
                               step.samples, step.tokens, step.flops, kind == TRAIN,
                               step.device_cycle if same_operation else None)
        return StepAccount(wait, found)

    def _book(self, start: float, end: float, own: str, enclosing: tuple[float, str] | None, entered: float | None,
              left: float | None) -> tuple[float | None, float]:
        """:meth:`add_step`'s counting of the step's time as ``own`` and of the time before it (the
        lock is held): ``(its data wait, torchtrace's own seconds in the wait)``."""
        if self._paused_at is not None:
            self._resume(start)
        last, cursor = self._last_end, self._cursor
        if last is None:
            wait = None
            self._last_end = end
        else:
            wait = start - last if start > last else 0.0
            if end > last:
                self._last_end = end
        gap = "data_wait" if self._started else "startup"
        mine = 0.0  # torchtrace's own time before the step, after the step before (not data wait)
        if enclosing is not None and cursor < start and enclosing[0] < start:
            cursor = self._enclosed(cursor, start, enclosing, gap)
        elif enclosing is None and wait and entered is not None and last is not None:
            mine = own_time(last, start, entered, left)
            wait -= mine
        if not self._replays and not self._debt:  # the common case: no replay to take out
            totals = self._totals
            if start > cursor:
                if mine:
                    mine = mine if mine < start - cursor else start - cursor
                    totals["other"] += mine
                totals[gap] += start - cursor - mine
                cursor = start
            if end > cursor:
                totals[own] += end - cursor
                cursor = end
            self._cursor = cursor
        else:
            self._count_step(cursor, start, end, gap, own, mine)
        self._started = True
        return wait, mine

    def _count_step(self, cursor: float, start: float, end: float, gap: str, own: str, mine: float) -> None:
        """:meth:`add_step`'s counting when forensic seconds are to be taken out (the lock is held):
        up to ``start`` as ``gap``, less torchtrace's own ``mine`` seconds at its end, then the
        step as ``own``."""
        if start > cursor:
            mine = mine if mine < start - cursor else start - cursor
            self._count(cursor, start - mine, gap)
            if mine:
                self._count(start - mine, start, "other")
        if end > self._cursor:
            self._count(max(start, self._cursor), end, own)

    def _enclosed(self, cursor: float, start: float, enclosing: tuple[float, str], gap: str) -> float:
        """Count the time up to ``start`` of a step inside an operation (the lock is held): as
        ``gap`` until the operation began, then as the operation's class. Returns the cursor."""
        cut = enclosing[0] if enclosing[0] > cursor else cursor
        if cut > cursor:
            self._count(cursor, cut, gap)
        self._count(cut, start, enclosing[1])
        return start

    def pause(self, now: float, last: bool = False) -> None:
        """Measuring stopped at ``now``: until the next step, time is not counted (see the module
        docstring). Idempotent. ``last``: the run ends; the time since the last step is other."""
        with self._lock:
            if self._paused_at is None:
                self._paused_at = max(now, self._cursor)
            if last and self._started and self._paused_at > self._cursor:
                self._count(self._cursor, self._paused_at, OTHER)

    def idle(self, now: float) -> None:
        """The script said training is over for now (:func:`torchtrace.idle`) at ``now``: paused
        as by :meth:`pause`, until the next training step (an evaluation or a checkpoint before
        it is booked as itself, and the pause goes on after it)."""
        self.pause(now)
        with self._lock:
            self._idle = True

    def _still_idle(self, kind: str, end: float) -> None:
        """After a step of ``kind`` booked while idle (the lock is held): a training step ends
        the idle; any other leaves the ledger paused again from its ``end``."""
        if kind == TRAIN:
            self._idle = False
        else:
            self._paused_at = max(end, self._cursor)

    def _resume(self, start: float) -> None:
        """The first step after a pause starts at ``start`` (the lock is held): the time up to
        the pause is counted as before; from the pause to this step, nothing."""
        paused_at, self._paused_at = self._paused_at, None
        if paused_at is None:
            return
        if paused_at > self._cursor:
            self._count(self._cursor, paused_at, "data_wait" if self._started else "startup")
        if start > self._cursor:
            self._unmeasured += start - max(paused_at, self._cursor)
            self._cursor = start
        self._last_end = None  # the step after a pause has no data wait, like a run's first

    def add_forensics(self, start: float, end: float) -> None:
        """Count a forensic replay that ran from ``start`` to ``end``."""
        with self._lock:
            start, end = max(start, self.configured_at), max(end, start)
            if start < self._cursor:  # already counted as something else: repay later
                self._debt += min(end, self._cursor) - start
                start = self._cursor
            if self._replays:
                start = max(start, self._replays[-1][1])
            if end > start:
                if len(self._replays) >= MAX_PENDING_REPLAYS:
                    self._debt += end - start
                else:
                    self._replays.append((start, end))

    # ------------------------------------------------------------ output
    def closed(self) -> Goodput:
        """Accounting up to the end of the last finished step: final, every count only grows."""
        with self._lock:
            return self._goodput(self._totals, self._cursor)

    def snapshot(self, now: float, left: float | None = None) -> Goodput:
        """Accounting up to ``now``: the open stretch since the last step as startup or data
        wait, but torchtrace's own time after it (up to ``left``, when it was done with it) as other."""
        with self._lock:
            totals = dict(self._totals)
            until, unmeasured, cursor = now, 0.0, self._cursor
            if self._paused_at is not None and now > self._paused_at:
                until, unmeasured = max(self._paused_at, cursor), now - max(self._paused_at, cursor)
            if until > cursor:
                mine = min(left, until) - cursor if self._started and left is not None and left > cursor else 0.0
                kind = "data_wait" if self._started else "startup"
                _, inside, repaid = split_replays(cursor, until, self._replays, self._debt)
                totals[kind] += (until - cursor) - inside - repaid - mine
                totals["other"] += mine
                totals["forensics"] += inside + repaid
            return self._goodput(totals, max(now, cursor), unmeasured)

    def throughput(self, operation: str) -> Throughput | None:
        """The operation's throughput over its last ``rules.window`` steps; None before its first."""
        with self._lock:
            window = self._windows.get(operation)
            return window.throughput(self.peak_of(operation)) if window is not None else None

    def set_peak(self, operation: str, peak_flops: float | None) -> None:
        """The peak FLOP/s of ``operation``'s device at the precision it computes in (None:
        not known); a configured ``peak_flops`` stays every operation's."""
        if len(self._peaks) < MAX_PEAKS or operation in self._peaks:
            self._peaks[operation] = peak_flops

    def peak_of(self, operation: str) -> float | None:
        """The peak FLOP/s ``operation``'s MFU is taken against (None: no MFU)."""
        return self.peak_flops if self.peak_flops is not None else self._peaks.get(operation)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Totals, rule settings and every operation's window and rule state (JSON-able).

        Times are kept as durations (a replay not yet counted as its seconds): a ledger of a
        new process restores the run's totals and baselines (see :meth:`load_state_dict`).
        """
        with self._lock:
            wall = self._prior_wall + (self._cursor - self.configured_at) - self._unmeasured
            debt = self._debt + sum(e - s for s, e in self._replays)  # replays still to count, as seconds
            return {"version": STATE_VERSION, "wall_s": wall, "totals": dict(self._totals), "debt_s": debt,
                    "rules": settings_state(self.rules), "peak_flops": self.peak_flops,
                    "windows": {op: w.state_dict() for op, w in self._windows.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a run saved with :meth:`state_dict`, in this ledger's own timeline.

        Restored: the totals (the saved wall time comes before this ledger's), the forensic
        debt, the rule settings and every window. The time between the saved ledger's last
        step and this ledger's configure is not known and not counted; the stretch from this
        ledger's configure to its first step is startup (a restart's cost).
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"goodput state version {state.get('version')!r} is not valid; accepted values: "
                             f"{STATE_VERSION}")
        rules = RuleSettings(**state["rules"])
        windows = {}
        for op, ws in state["windows"].items():
            windows[op] = OperationWindow(rules)
            windows[op].load_state_dict(ws)
        with self._lock:
            self.rules = rules
            if self.peak_flops is None:  # a peak configured in this process wins over the saved one
                self.peak_flops = state.get("peak_flops")
            self._prior_wall += float(state["wall_s"])
            self._totals = {k: float(state["totals"].get(k, 0.0)) + self._totals[k] for k in self._totals}
            self._debt = float(state["debt_s"]) + self._debt
            self._windows = windows

    # ------------------------------------------------------------ internals
    def _window(self, operation: str) -> OperationWindow | None:
        window = self._windows.get(operation)
        if window is None and len(self._windows) < MAX_OPERATIONS:
            window = self._windows[operation] = OperationWindow(self.rules)
        return window

    def _count(self, a: float, b: float, kind: str) -> None:
        """Count [a, b] as ``kind``, less the forensic seconds in it; advance the cursor."""
        self._replays, inside, repaid = split_replays(a, b, self._replays, self._debt)
        self._debt -= repaid
        self._totals[kind] += (b - a) - inside - repaid
        self._totals["forensics"] += inside + repaid
        self._cursor = b

    def _goodput(self, totals: dict[str, float], until: float, unmeasured: float = 0.0) -> Goodput:
        wall = self._prior_wall + (until - self.configured_at) - self._unmeasured - unmeasured
        return Goodput(wall, totals[_PRODUCTIVE], {k: totals[k] for k in semconv.BADPUT_KINDS})


__all__ = ["CHECKPOINT", "EVALUATION", "MAX_OPERATIONS", "MAX_PEAKS", "OPERATION_KINDS", "OTHER", "TRAIN",
           "FinishedStep", "Goodput", "GoodputLedger", "StepAccount", "enclosing"]
