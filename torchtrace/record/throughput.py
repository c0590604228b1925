"""Throughput windows of one operation, and the two rules that read them: throughput_drop, data_stall.

Host values in (seconds, counts), findings out. Every step of an operation adds one entry:
its *cycle* is its duration plus the data wait before it when the step before it was of the
same kind (the wait before the first evaluation step after a stretch of training is the
training, not the evaluation's input pipeline; the wait before a GAN's discriminator step,
after its generator's, is the discriminator's). The step whose FLOPs were counted is
left out: the counter slowed it down.

Rules (their settings are :class:`RuleSettings`; defaults are the constants below):

- **throughput_drop**: the steps after the warm-up are cut into windows of ``window``
  steps. A window's throughput is the *median* of its steps' rates (tokens/s if the batch
  has tokens, else samples/s, else steps/s), so one slow step does not move it. It is a
  drop when it is under ``drop_ratio`` times the baseline, the median of up to
  ``baseline_windows`` earlier windows (at least ``min_baseline_windows`` of them), for
  ``drop_windows`` windows in a row (one slow window on a shared machine is noise); it is
  reported once per such stretch. A 2x slow-down is reported within
  ``(drop_windows + 1) * window`` steps; a lasting one becomes the new baseline after about
  ``baseline_windows / 2`` windows.
- **data_stall**: a step *waited* when its data wait is over ``stall_share`` of its cycle
  (and at least ``stall_min_wait_s``: the loop's own work between tiny steps is no stall) or
  over ``stall_seconds``. A stall is at least ``stall_min_steps`` waiting steps among the
  last ``stall_window``; it is reported at once, then not again for ``stall_window`` steps.
  A loader that makes every step wait is reported within ``stall_window`` steps.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from torchtrace import semconv

WINDOW = 20  # steps per throughput window (MFU gauge, throughput_drop)
WARMUP_STEPS = 20  # steps of an operation the drop rule ignores first (compilation, autotuning, caches)
DROP_RATIO = 0.7  # a window under 0.7 x the baseline is low
DROP_WINDOWS = 2  # and this many low windows in a row are a drop (one slow window is noise)
BASELINE_WINDOWS = 8  # earlier windows whose median is the baseline
MIN_BASELINE_WINDOWS = 3  # windows needed before any drop is judged
STALL_SHARE = 0.25  # data wait over 25 % of the step's cycle is waiting
STALL_SECONDS = 5.0  # or data wait over 5 s, whatever the step time
STALL_MIN_WAIT_S = 0.01  # a wait under 10 ms is the loop's own bookkeeping, never a stall
STALL_WINDOW = 10  # the last 10 steps ...
STALL_MIN_STEPS = 8  # ... of which 8 waited: a data stall


@dataclass(frozen=True)
class RuleSettings:
    """Settings of the throughput window and of the two rules; see the module's docstring.

    Raises:
        ValueError: a value out of range, naming the setting and the accepted values.

    >>> RuleSettings(drop_ratio=0.5).window
    20
    """

    window: int = WINDOW
    warmup_steps: int = WARMUP_STEPS
    drop_ratio: float = DROP_RATIO
    drop_windows: int = DROP_WINDOWS
    baseline_windows: int = BASELINE_WINDOWS
    min_baseline_windows: int = MIN_BASELINE_WINDOWS
    stall_share: float = STALL_SHARE
    stall_seconds: float = STALL_SECONDS
    stall_window: int = STALL_WINDOW
    stall_min_steps: int = STALL_MIN_STEPS
    stall_min_wait_s: float = STALL_MIN_WAIT_S

    def __post_init__(self) -> None:
        def bad(name: str, accepted: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is not valid; accepted values: {accepted}")

        for name in ("window", "baseline_windows", "min_baseline_windows", "stall_window", "stall_min_steps",
                     "drop_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(name, "an integer >= 1")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise bad("warmup_steps", "an integer >= 0")
        if not 0 < self.drop_ratio < 1:
            raise bad("drop_ratio", "a number between 0 and 1, exclusive")
        if not 0 < self.stall_share < 1:
            raise bad("stall_share", "a number between 0 and 1, exclusive")
        if not self.stall_seconds > 0:
            raise bad("stall_seconds", "a positive number of seconds")
        if not 0 <= self.stall_min_wait_s < self.stall_seconds:
            raise bad("stall_min_wait_s", f"a number of seconds >= 0 and under stall_seconds ({self.stall_seconds})")
        if self.min_baseline_windows > self.baseline_windows:
            raise bad("min_baseline_windows", f"an integer <= baseline_windows ({self.baseline_windows})")
        if self.stall_min_steps > self.stall_window:
            raise bad("stall_min_steps", f"an integer <= stall_window ({self.stall_window})")


@dataclass(frozen=True)
class Finding:
    """An anomaly the rules found; the step pipeline makes it an ``Anomaly`` of its step."""

    kind: str  # semconv.THROUGHPUT_DROP or semconv.DATA_STALL
    detail: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Throughput:
    """Throughput of an operation over its last ``steps`` steps (``seconds`` of cycles).

    A rate is None when no step of the window carried that quantity; ``mfu`` is None
    without FLOPs or without a peak.
    """

    steps: int
    seconds: float
    samples_per_s: float | None
    tokens_per_s: float | None
    flops_per_s: float | None
    mfu: float | None
    data_wait_share: float


# One window entry: (cycle_s, wait_s, samples, tokens, flops, host_cycle_s). The first is the
# rates' time base: the device's cycle where one was measured (a GPU), else the host's.
Entry = tuple[float, float, int | None, int | None, int | None, float]


class OperationWindow:
    """The throughput window of one operation and its two rules' state.

    >>> w = OperationWindow(RuleSettings(window=2))
    >>> _ = w.add(duration=0.5, wait=0.5, samples=10, tokens=None, flops=None)
    >>> _ = w.add(duration=0.5, wait=0.5, samples=10, tokens=None, flops=None)
    >>> w.throughput().samples_per_s, w.throughput().data_wait_share
    (10.0, 0.5)
    """

    def __init__(self, settings: RuleSettings) -> None:
        self.settings = settings
        self.entries: collections.deque[Entry] = collections.deque(maxlen=settings.window)
        self.seen = 0  # steps added
        self.unit: str | None = None  # the drop rule's rate: tokens, samples or steps
        self.rates: list[float] = []  # this window's per-step rates
        self.baseline: collections.deque[float] = collections.deque(maxlen=settings.baseline_windows)
        self.low = 0  # low windows in a row
        self.waited: collections.deque[bool] = collections.deque(maxlen=settings.stall_window)

    def add(self, duration: float, wait: float, samples: int | None, tokens: int | None,
            flops: int | None, rules: bool = True, device_cycle: float | None = None) -> tuple[Finding, ...]:
        """Add one step; with ``rules``, evaluate the rules on it. Returns what they found.

        ``device_cycle`` (a GPU step's cycle in device time) is the time base of the rates and
        of the drop rule when given; the data wait and the stall rule stay on the host's clock.
        """
        duration, wait = max(duration, 0.0), max(wait, 0.0)
        cycle = duration + wait
        rated = device_cycle if device_cycle is not None and device_cycle > 0.0 else cycle
        self.entries.append((rated, wait, samples, tokens, flops, cycle))
        self.seen += 1
        if not rules:
            return ()
        s = self.settings
        found: list[Finding] = []
        # throughput_drop: one rate per step after the warm-up, judged a window at a time
        if self.seen > s.warmup_steps and rated > 0 and self._rate(rated, samples, tokens) \
                and len(self.rates) >= s.window:
            drop = self._judge_window()
            if drop is not None:
                found.append(drop)
        # data_stall: whether this step waited; reported on a step that waited, once the window is full
        waited = cycle > 0 and (wait > s.stall_share * cycle and wait >= s.stall_min_wait_s or wait > s.stall_seconds)
        self.waited.append(waited)
        if waited and len(self.waited) >= s.stall_window:
            stall = self._stall()
            if stall is not None:
                found.append(stall)
        return tuple(found)

    def _rate(self, rated: float, samples: int | None, tokens: int | None) -> bool:
        """Add a step's rate to the drop rule's window (the first sets the unit); False without one."""
        unit = self.unit
        if unit is None:
            self.unit = unit = "tokens" if tokens is not None else "samples" if samples is not None else "steps"
        amount = tokens if unit == "tokens" else samples if unit == "samples" else 1
        if amount is None:
            return False
        self.rates.append(amount / rated)
        return True

    # ------------------------------------------------------------ windows
    def throughput(self, peak_flops: float | None = None) -> Throughput | None:
        """Rates over the window; None before its first step."""
        if not self.entries:
            return None
        seconds = sum(e[0] for e in self.entries)
        waited = sum(e[1] for e in self.entries)
        host = sum(e[5] for e in self.entries)

        def rate(index: int) -> float | None:
            known = [(e[0], e[index]) for e in self.entries if e[index] is not None]
            time = sum(c for c, _ in known)
            if not known or time <= 0:
                return None
            try:
                return sum(v for _, v in known) / time  # type: ignore[misc]  # (known holds no None)
            except OverflowError:  # FLOPs past the float range (given ones, 1e307 a step): an infinite rate
                return math.inf

        flops_per_s = rate(4)
        mfu = flops_per_s / peak_flops if flops_per_s is not None and peak_flops else None
        return Throughput(len(self.entries), seconds, rate(2), rate(3), flops_per_s, mfu,
                          waited / host if host > 0 else 0.0)

    # ------------------------------------------------------------ rules
    def _judge_window(self) -> Finding | None:
        """A full window of rates: its median against the baseline (throughput_drop)."""
        s = self.settings
        current = statistics.median(self.rates)
        self.rates = []
        finding = None
        if len(self.baseline) >= s.min_baseline_windows:
            baseline = statistics.median(self.baseline)
            self.low = self.low + 1 if current < s.drop_ratio * baseline else 0
            if self.low == s.drop_windows:
                finding = Finding(semconv.THROUGHPUT_DROP,
                                  f"throughput {current:.4g} {self.unit}/s over the last {s.window} steps is "
                                  f"{current / baseline:.2f}x the baseline {baseline:.4g} {self.unit}/s "
                                  f"(threshold {s.drop_ratio}x)",
                                  {"rate": current, "baseline": baseline, "unit": self.unit,
                                   "ratio": current / baseline, "threshold": s.drop_ratio, "window": s.window})
        self.baseline.append(current)
        return finding

    def _stall(self) -> Finding | None:
        """The stall window is full and its last step waited: a stall if enough of them did."""
        s = self.settings
        count = sum(self.waited)
        if count < s.stall_min_steps:
            return None
        recent = list(self.entries)[-s.stall_window:]
        share = sum(e[1] for e in recent) / max(sum(e[5] for e in recent), 1e-12)
        mean_wait = sum(e[1] for e in recent) / len(recent)
        self.waited.clear()  # report once, then watch a fresh window
        return Finding(semconv.DATA_STALL,
                       f"{count} of the last {len(recent)} steps waited for data: {share:.0%} of their time, "
                       f"{mean_wait * 1e3:.1f} ms per step (threshold {s.stall_share:.0%} or {s.stall_seconds:g} s)",
                       {"waiting_steps": count, "steps": len(recent), "share": share, "mean_wait_s": mean_wait,
                        "threshold_share": s.stall_share, "threshold_s": s.stall_seconds})

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"entries": [list(e) for e in self.entries], "seen": self.seen, "unit": self.unit,
                "rates": list(self.rates), "baseline": list(self.baseline), "waited": list(self.waited),
                "low": self.low}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.settings
        # (an entry saved before the host cycle was kept has five fields: its cycle was the host's)
        self.entries = collections.deque(((*e[:5], e[5] if len(e) > 5 else e[0]) for e in state["entries"]),
                                         maxlen=s.window)
        self.seen = int(state["seen"])
        self.unit = state["unit"]
        self.rates = [float(r) for r in state["rates"]][: s.window]
        self.baseline = collections.deque((float(b) for b in state["baseline"]), maxlen=s.baseline_windows)
        self.low = int(state.get("low", 0))
        self.waited = collections.deque((bool(w) for w in state["waited"]), maxlen=s.stall_window)


def settings_state(settings: RuleSettings) -> dict[str, Any]:
    return asdict(settings)
