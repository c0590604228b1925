"""``torch.profiler`` windows over chosen steps, with a rate limit and a size cap.

A window covers ``active`` consecutive instrumented steps. It opens on a schedule (chosen
steps, every N steps), after an anomaly, or after a step-time regression. Each profiled step
is marked ``ProfilerStep#<step>`` in a Chrome trace written per rank; the trace's path goes on
every profiled step's span, and the window's top ops by self time go on the last step's span
as ``torchtrace.profile.op`` events, so the breakdown is visible in Jaeger without the file.

>>> import torchtrace as tt
>>> sched = tt.ProfileSchedule(steps=[3], active=2)
>>> sched.wants(3), sched.wants(4)
(True, False)
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Tuple

import torch

from torchtrace import files
from torchtrace.distributed import rank_file_name
from torchtrace.errors import get_logger
from torchtrace.measure.flop_modes import leave_counter, profiler_running
from torchtrace.probes.base import Probe

if TYPE_CHECKING:
    from torch.profiler import profile

    from torchtrace.levels import Features
    from torchtrace.record.step import StepRecord
    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope

logger = get_logger(__name__)

TOP_OPS = 10


@dataclass
class ProfileSchedule:
    """When windows open and what they record.

    Args:
        steps: step numbers where a window starts.
        every: also start a window every ``every`` steps (after ``wait`` steps), None for never.
        wait: steps to skip before the first scheduled window (warm-up, compilation).
        active: steps per window (capped by ``max_window_steps``).
        on_anomaly: open a window on the step after an anomaly.
        regression_factor: open a window after a step slower than this times the median of the
            last ``regression_window`` steps (None: off).
        max_windows: windows per run at most; min_interval_steps / min_interval_s: rate limit.
        max_trace_bytes: size cap of one trace file; events are dropped (longest kept) past it.
        record_shapes / profile_memory / with_stack: ``torch.profiler`` options.
    """

    steps: list[int] = field(default_factory=list)
    every: int | None = None
    wait: int = 0
    active: int = 1
    on_anomaly: bool = False
    regression_factor: float | None = None
    regression_window: int = 32
    max_windows: int = 10
    min_interval_steps: int = 0
    min_interval_s: float = 0.0
    max_window_steps: int = 8
    max_trace_bytes: int = 64 * 1024 * 1024
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    cuda: bool | None = None  # None: when CUDA is available

    def __post_init__(self) -> None:
        def bad(name, accepted):
            raise ValueError(f"{name}={getattr(self, name)!r} is not valid; accepted values: {accepted}")

        self.steps = sorted({int(s) for s in self.steps})
        if self.every is not None and (isinstance(self.every, bool) or int(self.every) <= 0):
            bad("every", "a positive integer or None")
        if int(self.active) <= 0:
            bad("active", "a positive integer")
        if int(self.max_window_steps) <= 0:
            bad("max_window_steps", "a positive integer")
        if int(self.max_trace_bytes) < 4096:
            bad("max_trace_bytes", "an integer >= 4096")
        if self.regression_factor is not None and not self.regression_factor > 1:
            bad("regression_factor", "a number > 1 or None")

    @property
    def window_steps(self) -> int:
        return min(int(self.active), int(self.max_window_steps))

    def wants(self, step: int) -> bool:
        """Whether the schedule starts a window at ``step`` (triggers aside)."""
        if step in self.steps:
            return True
        return self.every is not None and step >= self.wait and (step - self.wait) % self.every == 0

    @classmethod
    def default(cls) -> "ProfileSchedule":
        """``DebugMode.PROFILING``'s schedule: steps 5-6, then every 500 steps, and after anomalies."""
        return cls(steps=[], every=500, wait=5, active=2, on_anomaly=True, regression_factor=3.0,
                   min_interval_steps=50, max_windows=20)


class Window:
    """One profiled stretch of steps and where its trace goes (``private``: into torchtrace's
    own directory, else into one the user named)."""

    def __init__(self, path: Path, reason: str, first_step: int, n_steps: int, prof: profile | None,
                 private: bool = True) -> None:
        self.path = path
        self.private = private
        self.reason = reason
        self.first_step = first_step
        self.n_steps = n_steps
        self.prof = prof
        self.steps: list[int] = []
        # The open ProfilerStep record_function.
        self.rec: torch.profiler.record_function | None = None
        self.done = False
        self.top_ops: list[dict[str, Any]] = []
        self.truncated = 0


def top_ops(prof: profile, limit: int = TOP_OPS) -> list[dict[str, Any]]:
    """The window's ops by self CPU time (ProfilerStep markers excluded)."""
    out = []
    for evt in prof.key_averages():
        if evt.key.startswith("ProfilerStep#"):
            continue
        dev = getattr(evt, "self_device_time_total", None)
        if dev is None:
            dev = getattr(evt, "self_cuda_time_total", 0)
        out.append({"name": evt.key, "self_cpu_us": float(evt.self_cpu_time_total),
                    "cpu_us": float(evt.cpu_time_total), "self_device_us": float(dev or 0.0), "calls": int(evt.count)})
    out.sort(key=lambda d: (d["self_cpu_us"] + d["self_device_us"]), reverse=True)
    return out[:limit]


def cap_trace(path: Path, max_bytes: int) -> int:
    """Shrink a Chrome trace to ``max_bytes``: keep metadata and ProfilerStep events, then the
    longest events that fit. Returns how many events were dropped."""
    size = path.stat().st_size
    if size <= max_bytes:
        return 0
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    events = doc.get("traceEvents", [])
    keep = [e for e in events if e.get("ph") == "M" or str(e.get("name", "")).startswith("ProfilerStep#")]
    rest = sorted((e for e in events if not (e.get("ph") == "M" or str(e.get("name", "")).startswith("ProfilerStep#"))),
                  key=lambda e: e.get("dur", 0) or 0, reverse=True)
    base = dict(doc)
    base["traceEvents"] = keep
    _fit_header(base, max_bytes - 64)
    keep = base["traceEvents"]
    budget = max_bytes - len(json.dumps(base)) - 64
    for e in rest:
        n = len(json.dumps(e)) + 2
        if n > budget:
            continue
        budget -= n
        keep.append(e)
    dropped = len(events) - len(keep)
    base["traceEvents"] = keep
    base["torchtrace_dropped_events"] = dropped
    files.write_bytes_atomic(path, json.dumps(base).encode("utf-8"))
    return dropped


def _fit_header(doc: dict[str, Any], max_bytes: int) -> None:
    """Make the part of a trace that is always kept fit ``max_bytes``: on a GPU the device
    properties and the names of its streams alone can pass a small cap. Dropped in this order
    until it fits: the metadata events (process and thread names), then the document's other
    keys (``deviceProperties`` and the like); the ProfilerStep events and the schema stay."""
    if len(json.dumps(doc)) <= max_bytes:
        return
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("ph") != "M"]
    for key in [k for k in doc if k not in ("traceEvents", "schemaVersion")]:
        if len(json.dumps(doc)) <= max_bytes:
            return
        del doc[key]


def write_trace(prof: profile, path: Path, max_bytes: int, private: bool = True) -> int:
    """Write the profiler's Chrome trace to ``path``, capped at ``max_bytes``; returns the events
    dropped to fit. torch writes it into a new private temp file beside ``path`` that is then
    renamed over it, so a symlink planted at ``path`` is replaced, never followed. ``private``:
    the directory is torchtrace's own (made 0700); else the user's, created if missing and
    otherwise left as it is."""
    directory = files.ensure_private_dir(path.parent) if private else files.ensure_parent_dir(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(directory))
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        os.chmod(tmp, 0o600)
        dropped = cap_trace(Path(tmp), max_bytes)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dropped


_someone_profiling = profiler_running  # (not one of torchtrace's windows: the probe asks before opening one)


# What ProfilerProbe.restore puts back: the schedule, the output folder and the open window.
Saved = Tuple[Optional[ProfileSchedule], Optional[Path], Optional[Window]]


class ProfilerProbe(Probe[Window]):
    """Opens and closes profiler windows around instrumented steps (see :class:`ProfileSchedule`);
    the window holding a step goes to ``record.profile``."""

    name = "profiles"
    component = "profiler"

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.schedule: ProfileSchedule | None = None  # explicit, from profiling(); else the default
        self.output: Path | None = None
        self.window: Window | None = None
        self.windows: list[dict[str, Any]] = []
        self.armed: str | None = None  # a trigger seen in finish: start at the next step
        self.last_start_step: int | None = None
        self.last_start_time = 0.0
        self.durations: list[float] = []

    # -------------------------------------------------------------- configuration
    def _active_schedule(self, scope: StepScope | None) -> ProfileSchedule | None:
        if self.schedule is not None:
            return self.schedule
        feats = scope.features if scope is not None else self.rt.features
        return ProfileSchedule.default() if feats is not None and feats.profiling else None

    def wanted(self, features: Features) -> bool:
        """With the ``profiling`` feature, a schedule from ``profiling()``, or a window open."""
        return features.profiling or self.schedule is not None or self.window is not None

    def open_schedule(self, schedule: ProfileSchedule, output: Path | None = None) -> Saved:
        """``profiling(schedule=...)``: steps are profiled by ``schedule`` into ``output`` until
        :meth:`restore` puts back what this returns."""
        saved = (self.schedule, self.output, self.window)
        self.schedule = schedule
        self.output = output
        self.rt.probes.refresh()
        return saved

    def directory(self) -> Path:
        """Where traces go: the output given to ``profiling()``, else the run's ``profiles/``."""
        if self.output is not None:
            return self.output
        base = (self.rt.run_path if self.rt.run_path is not None
                else Path(self.rt.settings.run_dir) / self.rt.settings.run_id)
        return base / "profiles"

    def _allowed(self, sched: ProfileSchedule, step: int) -> bool:
        if len(self.windows) >= sched.max_windows:
            return False
        if self.last_start_step is not None and step - self.last_start_step < sched.min_interval_steps:
            return False
        return time.monotonic() - self.last_start_time >= sched.min_interval_s or not self.windows

    # -------------------------------------------------------------- per step
    def enter(self, scope: StepScope) -> Window | None:
        w = self.window
        step = scope.step
        if step is None or (w is not None and w.rec is not None):
            return None  # a step nested in a profiled step is part of it
        if w is None:
            sched = self._active_schedule(scope)
            if sched is None:
                self.armed = None
                return None
            reason = self.armed or ("schedule" if sched.wants(step) else None)
            if reason is None or not self._allowed(sched, step):
                return None
            if _someone_profiling():
                # Another profiler (the user's torch.profiler.profile) is running: opening a
                # window would end its session. Ours steps aside, and says so once.
                self.rt.warn_once(("profiler", "busy"),
                                  "torchtrace: a profiler is already running (torch.profiler.profile); "
                                  "torchtrace's profiling windows are skipped while it runs")
                return None
            self.armed = None
            w = self.window = self._open(sched, scope.name, step, reason)
            state = scope.throughput
            if state is not None and state.counter is not None and leave_counter(state.counter):
                # The step's FLOP count, opened before the window: the trace would hold its every
                # op twice. The count waits for a step outside windows (as under the user's profiler).
                state.counter = None
        rec = w.rec = torch.profiler.record_function(f"ProfilerStep#{step}")
        rec.__enter__()
        w.steps.append(step)
        return w

    def _open(self, sched: ProfileSchedule, operation: str, step: int, reason: str) -> Window:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        use_cuda = torch.cuda.is_available() if sched.cuda is None else sched.cuda
        if use_cuda:
            activities.append(ProfilerActivity.CUDA)
        ident = self.rt.identity
        n = sched.window_steps
        stem = f"trace-{operation}-step{step}-{step + n - 1}"
        path = self.directory() / rank_file_name(stem, ".json", ident)
        prof = profile(activities=activities, record_shapes=sched.record_shapes, profile_memory=sched.profile_memory,
                       with_stack=sched.with_stack)
        prof.__enter__()
        self.last_start_step = step
        self.last_start_time = time.monotonic()
        return Window(path, reason, step, n, prof, private=self.output is None)

    def exit(self, scope: StepScope, w: Window | None, exc: BaseException | None) -> None:
        if w is None or w is not self.window:
            return None
        if w.rec is not None:
            w.rec.__exit__(None, None, None)
            w.rec = None
        if len(w.steps) >= w.n_steps or exc is not None:
            self.close_window()
        return None

    def open_block(self, window: Window, schedule: ProfileSchedule) -> Saved:
        """``profiling()`` without a schedule: ``window`` covers every step until :meth:`close_window`.
        Returns what :meth:`restore` puts back."""
        saved = (self.schedule, self.output, self.window)
        self.schedule = schedule
        self.window = window
        self.rt.probes.refresh()
        return saved

    def restore(self, saved: Saved) -> None:
        self.schedule, self.output, self.window = saved
        if not self.wanted(self.rt.features):
            self.armed = None  # (a trigger of the schedule that ended)
        self.rt.probes.refresh()

    def close_window(self) -> None:
        """Stop the open window and write its trace (capped in size)."""
        w, self.window = self.window, None
        if w is None:
            return
        self.rt.probes.refresh()
        try:
            if w.rec is not None:
                w.rec.__exit__(None, None, None)
                w.rec = None
            prof = w.prof
            if prof is not None:
                prof.__exit__(None, None, None)
                sched = self.schedule or ProfileSchedule.default()
                w.truncated = write_trace(prof, w.path, sched.max_trace_bytes, private=w.private)
                w.top_ops = top_ops(prof)
        finally:
            w.prof = None
            w.done = True
            self.windows.append({"path": str(w.path), "reason": w.reason, "steps": list(w.steps),
                                 "truncated_events": w.truncated, "top_ops": w.top_ops[:5]})

    def finish(self, scope: StepScope, w: Window | None, record: StepRecord, values: list[float] | None) -> None:
        if w is not None:
            last = w.done and w.steps and scope.step == w.steps[-1]
            record.profile = {"path": str(w.path), "window": f"{w.first_step}-{w.first_step + w.n_steps - 1}",
                              "reason": w.reason, "truncated": w.truncated if last else 0,
                              "top_ops": list(w.top_ops) if last else []}
        sched = self._active_schedule(scope)
        if sched is None or self.window is not None:
            return
        if sched.on_anomaly and record.anomalies:
            self.armed = "anomaly"
        if sched.regression_factor is not None and record.duration_s > 0:
            d = self.durations
            if len(d) >= max(8, sched.regression_window // 2):
                if record.duration_s > sched.regression_factor * statistics.median(d):
                    self.armed = self.armed or "regression"
            d.append(record.duration_s)
            if len(d) > sched.regression_window:
                del d[0]

    def close(self) -> None:
        if self.window is not None:
            self.close_window()

    def section(self) -> list[dict[str, Any]]:
        return list(self.windows)
