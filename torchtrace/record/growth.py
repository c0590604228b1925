"""When memory growth is a leak: a robust slope over a window of *steps*, and a rule that asks
for evidence in bytes, so a larger leak is called sooner.

The rule, for samples ``(step, bytes)`` taken every step or every few steps:

- the first ``warmup`` steps are ignored (optimizer state, caches and loader queues fill then);
- the window holds the samples of the last ``window`` steps, and never fewer than
  ``MIN_SAMPLES`` however far apart the samples are;
- growth is *sustained* when a stretch of the window ending at the latest sample (the last
  ``window // 4`` steps, twice that, ..., the whole window) holds ``MIN_SAMPLES`` samples and:
  its Theil-Sen slope is above the threshold; the growth that slope predicts over the
  stretch, ``slope * span``, reaches ``threshold * window`` (what a leak at exactly the
  threshold takes in a whole window); each third of the stretch climbs at half the threshold
  or more (one or two jumps are not a leak); the net change covers half the prediction; and
  the prediction is ``NOISE_FACTOR`` times the median step-to-step scatter around the slope.

The evidence condition makes the time to detection fall as the leak grows: a leak at twice
the threshold needs half a window of steps, one at four times or more the minimum stretch.

While growth is *suspected* (the last two samples or the window climb faster than the
threshold, or the last change is a quarter window's evidence beyond the trend) a caller that
samples sparsely should sample every ``stride()`` steps: about
``MIN_SAMPLES`` samples over the steps the suspected rate needs.
"""

from __future__ import annotations

import bisect
import collections
import math
from typing import Any

DEFAULT_WINDOW = 32  # steps
DEFAULT_THRESHOLD = 256 * 1024  # bytes per step
MIN_SAMPLES = 5  # fewest samples a window holds, and the fewest that can call growth sustained
NOISE_FACTOR = 8  # the growth over a stretch must be this many times its step-to-step scatter
PARTS = 3  # every third of a stretch must climb: one or two jumps are not a leak
_MAX_FIT = 64  # the slope is fitted on at most this many samples of the window (evenly spread)


def theil_sen_slope(xs: list[float], ys: list[float]) -> float | None:
    """Median of the slopes between every pair of points (Theil-Sen); None below two points.

    >>> theil_sen_slope([0, 1, 2, 3, 4], [0, 10, 20, 30, 1000])
    10.0
    """
    n = len(xs)
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(n) for j in range(i + 1, n) if xs[j] != xs[i]]
    if not slopes:
        return None
    slopes.sort()
    mid = len(slopes) // 2
    return float(slopes[mid]) if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2.0


def _scatter(samples: list[tuple[int, int]], slope: float) -> float:
    """Median distance between a change from one sample to the next and what the slope predicts."""
    dist = sorted(abs((b[1] - a[1]) - slope * (b[0] - a[0])) for a, b in zip(samples, samples[1:]))
    return dist[len(dist) // 2]


def _fit(samples: list[tuple[int, int]]) -> float | None:
    if len(samples) > _MAX_FIT:  # evenly spread, both ends kept
        last = len(samples) - 1
        samples = [samples[round(i * last / (_MAX_FIT - 1))] for i in range(_MAX_FIT)]
    return theil_sen_slope([s for s, _ in samples], [v for _, v in samples])


def goes_on(points: list[tuple[int, int]], threshold: float) -> bool:
    """The confirmation steps judged on their own: ``(step, bytes)`` at their start, at points
    within and at their end, each measured after a full garbage collection (see
    ``LeakProbe``). The growth goes on when the whole confirmation climbs faster than
    ``threshold`` and each part between two points at half the threshold or more: a growth
    that stopped during it, or garbage a collection frees, is not a leak.

    >>> goes_on([(0, 0), (4, 4_000), (6, 6_000), (8, 8_000)], 500)     # 1000 B/step all along
    True
    >>> goes_on([(0, 0), (4, 4_000), (6, 6_000), (8, 6_100)], 500)     # stopped at step 6
    False
    >>> goes_on([(0, 0), (4, 8_000), (6, 1_000), (8, 1_500)], 500)     # garbage, collected
    False
    """
    (s0, v0), (s1, v1) = points[0], points[-1]
    if s1 <= s0 or v1 - v0 <= threshold * (s1 - s0):
        return False
    return all(b[1] - a[1] >= 0.5 * threshold * (b[0] - a[0]) for a, b in zip(points, points[1:]))


class GrowthTracker:
    """Samples of one device's memory in use, their robust slope, and whether growth is a leak.

    Steps are the x axis: samples may come every step or every few steps, and the slope is in
    bytes per step either way. ``add`` is O(1) on most calls (the slope is refreshed every
    ``len(window) // 8`` samples); ``sustained`` is O(window) and fits slopes only when the
    net change already looks like a leak.

    >>> tr = GrowthTracker(window=32, threshold=1000)
    >>> for step in range(48):
    ...     _ = tr.add(step, 50_000 * step)    # 50x the threshold
    >>> tr.sustained(), tr.slope
    (True, 50000.0)
    """

    def __init__(self, window: int = DEFAULT_WINDOW, threshold: float = DEFAULT_THRESHOLD,
                 warmup: int | None = None, min_samples: int = MIN_SAMPLES) -> None:
        if window < 4:
            raise ValueError(f"window={window!r} is not valid; accepted values: an integer >= 4")
        self.window = int(window)
        self.threshold = float(threshold)
        self.warmup = self.window if warmup is None else int(warmup)
        self.min_samples = max(int(min_samples), 3)
        self.first_step: int | None = None
        self.last: tuple[int, int] | None = None  # the latest sample, warm-up included
        self.pair_slope: float | None = None  # between the latest two samples
        self.pair_excess = 0.0  # their change beyond what the window's slope predicts, bytes
        self.samples: collections.deque[tuple[int, int]] = collections.deque()
        self.slope: float | None = None
        self.since: int | None = None  # first step of the stretch last called sustained
        self._stale = 0  # samples since the slope was refreshed

    @property
    def min_span(self) -> int:
        """Fewest steps a window must span before growth can be called sustained."""
        return max(self.window // 4, 2)

    @property
    def evidence_bytes(self) -> float:
        """Growth over the window that calls a leak: what the threshold rate takes in a window."""
        return self.threshold * self.window

    def in_warmup(self, step: int) -> bool:
        return self.first_step is None or step - self.first_step < self.warmup

    def add(self, step: int, value: int, refresh: bool = True) -> float | None:
        """One sample; returns the window's slope (None until there is one). ``refresh=False``
        keeps the last slope (no fit: the slow path's tracing makes a fit slow)."""
        value = int(value)
        if self.first_step is None:
            self.first_step = step
        if self.last is not None and step > self.last[0]:
            self.pair_slope = (value - self.last[1]) / (step - self.last[0])
            self.pair_excess = value - self.last[1] - max(self.slope or 0.0, 0.0) * (step - self.last[0])
        self.last = (step, value)
        if self.in_warmup(step):
            return self.slope
        if self.samples and step <= self.samples[-1][0]:
            return self.slope  # steps run one way; a repeated step is ignored
        self.samples.append((step, value))
        while len(self.samples) > self.min_samples and step - self.samples[0][0] > self.window:
            self.samples.popleft()
        self._stale += 1
        if refresh and self._stale >= max(1, len(self.samples) // 8):
            self.refresh()
        return self.slope

    def refresh(self) -> float | None:
        self._stale = 0
        self.slope = _fit(list(self.samples))
        return self.slope

    def suspected(self) -> bool:
        """The last two samples or the window climb faster than the threshold, or the last
        change is a quarter window's evidence beyond the window's trend (a leak that began a
        few steps before a sparse sample): samples are worth taking more often until the
        question is settled."""
        return ((self.pair_slope is not None and self.pair_slope > self.threshold)
                or (self.slope is not None and self.slope > self.threshold)
                or self.pair_excess >= 0.25 * self.evidence_bytes)

    def sample_due(self) -> int | None:
        """The step from which another sample would help decide: the end of the warm-up while
        there is no sample after it, or ``stride()`` steps after the last while growth is
        suspected; None otherwise. It changes only when a sample is added."""
        if self.first_step is None:
            return None
        if not self.samples:
            return self.first_step + self.warmup
        return self.samples[-1][0] + self.stride() if self.suspected() else None

    def wants_samples(self, step: int) -> bool:
        """A sample at ``step`` would help decide (see ``sample_due``)."""
        due = self.sample_due()
        return due is not None and step >= due

    def stride(self) -> int:
        """Steps between samples while growth is suspected: ``MIN_SAMPLES`` samples over the span
        the suspected rate needs to reach the evidence (``min_span`` at least), so a large leak
        is sampled every step or two and a small one every few steps.

        >>> tr = GrowthTracker(window=32, threshold=1000)
        >>> tr.pair_slope = 10_000; tr.stride()     # 10x: 8 steps of evidence, 5 samples
        2
        >>> tr.pair_slope = 2_000; tr.stride()      # 2x: 16 steps
        4
        """
        rate = max(self.pair_slope or 0.0, self.slope or 0.0, self.threshold)
        span = max(self.min_span, self.evidence_bytes / rate)
        return max(1, math.ceil(span / (self.min_samples - 1)))

    def sustained(self) -> bool:
        """The rule in the module docstring, on the window and on its recent stretches (the last
        ``min_span`` steps, then twice as many, ...): a leak that starts mid-window is called
        once its own stretch has the evidence, without waiting for the flat steps before it to
        leave the window. O(1) per stretch unless its net change already looks like a leak."""
        n = len(self.samples)
        if n < self.min_samples:
            return False
        last_value = self.samples[-1][1]
        if last_value - min(v for _, v in self.samples) < 0.5 * self.evidence_bytes:
            return False  # no stretch has grown enough to pass (see below): the usual case, O(n)
        ordered = list(self.samples)
        last_step, last_value = ordered[-1]
        for i in self._starts([st for st, _ in ordered]):
            span, net = last_step - ordered[i][0], last_value - ordered[i][1]
            if span < self.min_span or net < 0.5 * self.threshold * max(span, self.window):
                continue  # necessary for every condition below: no fit needed
            if self._holds(ordered[i:], span, net):
                self.since = ordered[i][0]
                return True
        return False

    def _starts(self, steps: list[int]) -> list[int]:
        """First indices of the stretches to test, shortest first, the whole window last."""
        out: list[int] = []
        span = self.min_span
        while True:
            i = min(bisect.bisect_right(steps, steps[-1] - span) - 1, len(steps) - self.min_samples)
            if i <= 0:
                out.append(0)
                return out
            if not out or i < out[-1]:
                out.append(i)
            span *= 2

    def _holds(self, part: list[tuple[int, int]], span: int, net: int) -> bool:
        slope = _fit(part)
        if slope is None or slope <= self.threshold or slope * span < self.evidence_bytes or net < 0.5 * slope * span:
            return False
        if slope * span < NOISE_FACTOR * _scatter(part, slope):
            return False  # the growth does not stand clear of the step-to-step scatter
        n = len(part)
        cuts = [round(k * (n - 1) / PARTS) for k in range(PARTS + 1)]
        for a, b in zip(cuts, cuts[1:]):  # consecutive parts share their boundary sample
            s = _fit(part[a:b + 1])
            if s is None or s < 0.5 * self.threshold:
                return False
        return True

    def rate(self) -> float | None:
        """Bytes per step since the stretch last called sustained began (the leak's own rate,
        not diluted by the flat steps before it); the window's slope before any."""
        if self.since is None:
            return self.slope
        part = [s for s in self.samples if s[0] >= self.since]
        return _fit(part) if len(part) >= 2 else self.slope

    def reset(self) -> None:
        """A fresh window (the warm-up is not repeated)."""
        self.samples.clear()
        self.slope = None
        self.pair_slope = None
        self.pair_excess = 0.0
        self.since = None
        self._stale = 0

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "threshold": self.threshold, "warmup": self.warmup,
                "min_samples": self.min_samples, "first_step": self.first_step,
                "last": list(self.last) if self.last is not None else None, "pair_slope": self.pair_slope,
                "pair_excess": self.pair_excess, "since": self.since, "samples": [list(s) for s in self.samples]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window = int(state["window"])
        self.threshold = float(state["threshold"])
        self.warmup = int(state["warmup"])
        self.min_samples = int(state.get("min_samples", MIN_SAMPLES))
        self.first_step = state.get("first_step")
        last = state.get("last")
        self.last = (int(last[0]), int(last[1])) if last is not None else None
        self.pair_slope = state.get("pair_slope")
        self.pair_excess = float(state.get("pair_excess", 0.0))
        self.since = state.get("since")
        self.samples = collections.deque(tuple(s) for s in state["samples"])
        self.refresh()
