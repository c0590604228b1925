"""What ``benchmark_optimizations`` returns: one :class:`ModeResult` per mode, gathered in
:class:`BenchmarkResults`, which also prints them as a table.

>>> from torchtrace.levels import OptimizationMode
>>> ModeResult(mode=OptimizationMode.NONE).seed_view()["mode"]
'none'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torchtrace.levels import OptimizationMode


@dataclass
class ModeResult:
    """One mode's measurements. Times in seconds, memory in bytes; None when not measured."""

    mode: OptimizationMode
    ok: bool = True
    error: str | None = None
    step_times_s: list[float] = field(default_factory=list)
    median_s: float | None = None
    iqr_s: float | None = None  # 75th minus 25th percentile of the timed steps
    memory_bytes: int | None = None
    memory_kind: str = ""
    speedup: float | None = None  # NONE's median / this median: < 1 means slower
    memory_saving: float | None = None  # 1 - memory / NONE's memory: < 0 means more memory
    max_abs_loss_diff: float | None = None  # against NONE, step by step
    losses: list[float] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("ok", "error", "median_s", "iqr_s", "memory_bytes", "memory_kind",
                                           "speedup", "memory_saving", "max_abs_loss_diff", "applied", "skipped")}
        d["mode"] = self.mode.value
        d["step_times_s"] = list(self.step_times_s)
        d["losses"] = list(self.losses)
        return d

    # The seeds read a mode's result as a dict: result["total_time"], "error" in result.
    def seed_view(self) -> dict[str, Any]:
        """The seeds' keys: ``total_time`` (seconds of the timed steps; ``inf`` for a failed mode,
        so ``min(results.items(), key=...)`` never picks it), ``speedup_factor``,
        ``memory_savings``, ``median_step_time``, ``memory_bytes``, ``max_abs_loss_diff``,
        ``applied``, ``skipped``, ``mode``; ``error`` only for a mode that failed."""
        d: dict[str, Any] = {"mode": self.mode.value,
                             "total_time": math.fsum(self.step_times_s) if self.ok else math.inf,
                             "speedup_factor": self.speedup, "memory_savings": self.memory_saving,
                             "median_step_time": self.median_s, "memory_bytes": self.memory_bytes,
                             "max_abs_loss_diff": self.max_abs_loss_diff, "applied": list(self.applied),
                             "skipped": dict(self.skipped)}
        if not self.ok:
            d["error"] = self.error
        return d

    def __getitem__(self, key: str) -> Any:
        return self.seed_view()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.seed_view()

    def get(self, key: str, default: object = None) -> Any:
        return self.seed_view().get(key, default)

    def keys(self):
        return self.seed_view().keys()


@dataclass
class BenchmarkResults:
    """All modes' results (``results[mode]``), the device, and the table as text.

    Also a mapping of mode value (``"amp"``) to :class:`ModeResult`: ``items()``, ``keys()``,
    ``values()``, ``len()``, ``in`` (the seeds' ``for mode, result in results.items()``).
    """

    device: str
    warmup: int
    steps: int
    results: dict[OptimizationMode, ModeResult] = field(default_factory=dict)

    def __getitem__(self, mode: OptimizationMode | str) -> ModeResult:
        return self.results[OptimizationMode.parse(mode, "mode")]

    # Mapping of mode value ("amp") -> ModeResult, as the seeds iterate it.
    def items(self):
        return [(m.value, r) for m, r in self.results.items()]

    def keys(self):
        return [m.value for m in self.results]

    def values(self):
        return list(self.results.values())

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.results)

    def __contains__(self, mode: object) -> bool:
        try:
            return OptimizationMode.parse(mode, "mode") in self.results  # type: ignore[arg-type]
        except ValueError:
            return False

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "warmup": self.warmup, "steps": self.steps,
                "modes": {m.value: r.as_dict() for m, r in self.results.items()}}

    def table(self) -> str:
        """A fixed-width table; speedups are NONE's printed median over each printed median."""
        kinds = {r.memory_kind for r in self.results.values() if r.memory_kind}
        mem_head = "memory MB" + (f" ({kinds.pop()})" if len(kinds) == 1 else "")
        head = ["mode", "status", "median ms", "IQR ms", "speedup", mem_head, "mem saving", "max |dloss|", "notes"]
        rows = [head]
        for r in self.results.values():
            notes = (r.error or "") if not r.ok else ", ".join(r.applied) or "-"
            if r.ok and r.skipped:
                notes += "; not applied: " + ", ".join(f"{k} ({v})" for k, v in r.skipped.items())
            rows.append([
                r.mode.value, "ok" if r.ok else "FAILED",
                _fmt(r.median_s, 1e3, "{:.4f}"), _fmt(r.iqr_s, 1e3, "{:.4f}"),
                "-" if r.speedup is None else f"{r.speedup:.3f}x",
                _fmt(r.memory_bytes, 1 / 2**20, "{:.3f}"),
                "-" if r.memory_saving is None else f"{100 * r.memory_saving:+.1f}%",
                _fmt(r.max_abs_loss_diff, 1, "{:.2e}"), notes[:160],
            ])
        widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
        lines = []
        for n, row in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
            if n == 0:
                lines.append("-" * len(lines[0]))
        return "\n".join(lines) + f"\n({self.device}; {self.warmup} warm-up + {self.steps} timed steps per mode)"


def _fmt(value: float | None, scale: float, pattern: str) -> str:
    return "-" if value is None else pattern.format(value * scale)

