"""When memory growth is a leak: a robust slope over a window of samples, and the rule that
calls it sustained."""

from __future__ import annotations

import collections
from typing import Any

DEFAULT_WINDOW = 32
DEFAULT_THRESHOLD = 256 * 1024  # bytes per step


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


class GrowthTracker:
    """A window of (step, bytes) samples and their robust slope in bytes per step.

    The first ``warmup`` samples (default: one window) are ignored: allocators and caches
    grow while a job warms up. Growth is *sustained* when the Theil-Sen slope is above the threshold, the window is full,
    and at least ``min_rising`` of the window's step-to-step differences are not negative and
    the net change covers half of what the slope predicts (one jump is not a leak).
    """

    def __init__(self, window: int = DEFAULT_WINDOW, threshold: float = DEFAULT_THRESHOLD,
                 min_rising: float = 0.6, warmup: int | None = None) -> None:
        if window < 4:
            raise ValueError(f"window={window!r} is not valid; accepted values: an integer >= 4")
        self.window = window
        self.warmup = window if warmup is None else warmup
        self.seen = 0
        self.threshold = float(threshold)
        self.min_rising = min_rising
        self.samples: collections.deque[tuple[int, int]] = collections.deque(maxlen=window)
        self.slope: float | None = None

    def add(self, step: int, value: int) -> float | None:
        self.seen += 1
        if self.seen <= self.warmup:
            return self.slope
        self.samples.append((step, int(value)))
        # The O(window²) median is refreshed every window/8 samples: ~25 us a step amortised.
        if (self.seen - self.warmup) % max(1, self.window // 8) == 0:
            self.slope = theil_sen_slope([s for s, _ in self.samples], [v for _, v in self.samples])
        return self.slope

    def sustained(self) -> bool:
        if self.slope is None or len(self.samples) < self.window or self.slope <= self.threshold:
            return False
        ys = [v for _, v in self.samples]
        rising = sum(1 for a, b in zip(ys, ys[1:]) if b >= a) / (len(ys) - 1)
        span = self.samples[-1][0] - self.samples[0][0]
        return rising >= self.min_rising and (ys[-1] - ys[0]) >= 0.5 * self.slope * span

    def reset(self) -> None:
        self.samples.clear()
        self.slope = None

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "threshold": self.threshold, "min_rising": self.min_rising,
                "warmup": self.warmup, "seen": self.seen, "samples": [list(s) for s in self.samples]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window = int(state["window"])
        self.threshold = float(state["threshold"])
        self.min_rising = float(state["min_rising"])
        self.warmup = int(state["warmup"])
        self.seen = int(state["seen"])
        self.samples = collections.deque((tuple(s) for s in state["samples"]), maxlen=self.window)
        self.slope = theil_sen_slope([s for s, _ in self.samples], [v for _, v in self.samples])
