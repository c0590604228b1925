"""``PyTorchDebugger``: the seeds' debugger (000, 001, 003) as one facade over the core.

Interactive checks read their results to the host once each; training steps it monitors are
torchtrace steps (spans, metrics, report entries), opened with the public step API.

>>> import torch, torchtrace as tt
>>> dbg = tt.create_pytorch_debugger()
>>> model = torch.nn.Linear(4, 2); model(torch.ones(3, 4)).sum().backward()
>>> dbg.check_gradients(model, gradient_threshold=1e3) > 0
True
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Reversible

import torch

from torchtrace import current, semconv
from torchtrace.compat import resources, steps
from torchtrace.compat.inspecting import CheckingMixin
from torchtrace.compat.operations import OperationsMixin
from torchtrace.compat.records import DebugMetrics, OptimizationMetrics
from torchtrace.compat.results import Result
from torchtrace.compat.settings import DebugConfig, build_config, debug_mode_setting, flag, is_logger
from torchtrace.compat.timeline import Timeline, iso, make_sink
from torchtrace.errors import NonFiniteError, get_logger
from torchtrace.forensics.anomaly import anomaly_detection as core_anomaly_detection
from torchtrace.levels import DebugLevel, DebugMode
from torchtrace.measure.snapshots import MemorySnapshot
from torchtrace.record.growth import DEFAULT_THRESHOLD, DEFAULT_WINDOW, GrowthTracker
from torchtrace.tools import memory as memory_tools
from torchtrace.tools.profiling import profiling as core_profiling

logger = get_logger("torchtrace.debugger")


def samples_after(samples: Reversible[dict[str, Any]], last: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The samples added after ``last`` (all when ``last`` is None or has left the bounded deque)."""
    out: list[dict[str, Any]] = []
    for sample in reversed(samples):
        if sample is last:
            break
        out.append(sample)
    out.reverse()
    return out


def _split_positional(first: object, second: object
                      ) -> tuple[DebugConfig | DebugLevel | str | None, object, bool | DebugMode | None]:
    """``(config, logger, debug_mode)`` from the two positional slots, by type.

    Seed 000 is ``PyTorchDebugger(logger, debug_mode)``, seed 001 ``PyTorchDebugger(level)``,
    torchtrace's own ``PyTorchDebugger(config, logger)``.
    """
    config: DebugConfig | DebugLevel | str | None = None
    log: object = None
    mode: bool | DebugMode | None = None
    for slot, value in enumerate((first, second)):
        if value is None:
            continue
        if isinstance(value, bool) or isinstance(value, DebugMode):
            mode = value
        elif isinstance(value, (DebugConfig, DebugLevel, str)) and config is None:
            config = value
        elif (is_logger(value) or slot == 1) and log is None:
            log = value  # the logger slot: an unusable logger is refused by name when it is wrapped
        else:
            raise TypeError(f"PyTorchDebugger: a positional argument of type {type(value).__name__} is not accepted; "
                            "accepted: a DebugConfig or DebugLevel, a logger, debug_mode (bool or DebugMode)")
    return config, log, mode


def _error_tracker(error_system: object) -> Callable[..., object] | None:
    """The user's ``track_error(error=..., context=...)``."""
    if error_system is None:
        return None
    for obj in (getattr(error_system, "error_tracker", None), error_system):
        track_error = getattr(obj, "track_error", None)
        if obj is not None and callable(track_error):
            return track_error
    raise TypeError(f"error_system= must have error_tracker.track_error or track_error; got "
                    f"{type(error_system).__name__}")


class PyTorchDebugger(CheckingMixin, OperationsMixin):
    """Gradient, parameter, tensor and memory checks, autograd anomaly detection, profiling and
    memory tracking, with a bounded event timeline written to your logger.

    Construction (every seed's form): ``PyTorchDebugger()``, ``PyTorchDebugger(DebugLevel.ADVANCED)``,
    ``PyTorchDebugger(logger, debug_mode=True, enable_profiling=True, log_dir="debug_logs")``,
    ``PyTorchDebugger(error_system=..., training_logger=..., debug_mode=DebugMode.FULL_DEBUG)``.
    Keywords are :class:`~torchtrace.compat.settings.DebugConfig` fields (and the seed aliases
    ``gradient_threshold``, ``gradient_norm_threshold``). ``debug_mode`` takes a bool or a
    DebugMode; ``logger`` and ``training_logger`` take a ``logging.Logger`` or a seed-style
    logger (``log_info``/``log_warning``/``log_error``); events go to both. ``error_system``
    (an object with ``error_tracker.track_error`` or ``track_error``) receives every ERROR
    event as a :class:`~torchtrace.NonFiniteError` (NaN/Inf gradients, parameters, losses).

    Raises:
        TypeError: an unknown setting or an unusable logger/error_system, naming it.
        ValueError: a bad value or a contradiction, naming the setting and the accepted values.
    """

    def __init__(self, config: DebugConfig | DebugLevel | str | object = None, logger: object = None, *,
                 debug_mode: bool | DebugMode | str | None = None, error_system: object = None,
                 training_logger: object = None, **settings: Any) -> None:
        config, logger, positional_mode = _split_positional(config, logger)
        if positional_mode is not None and debug_mode is not None:
            raise TypeError("PyTorchDebugger: debug_mode was given twice")
        on, mode = debug_mode_setting(positional_mode if debug_mode is None else debug_mode)
        if on is not None:
            settings["debug_mode"] = on
        if mode is not None:
            if "mode" in settings and DebugMode.parse(settings["mode"], "mode") is not mode:
                raise ValueError(f"debug_mode={mode.value!r} contradicts mode={settings['mode']!r}")
            settings["mode"] = mode
        if isinstance(config, (DebugLevel, str)):
            settings.setdefault("level", config)
        self.config = build_config(config if isinstance(config, DebugConfig) else None, settings)
        self.logger = logger if logger is not None else get_logger("torchtrace.debugger")
        sinks = [make_sink(self.logger)]
        if training_logger is not None:
            sinks.append(make_sink(training_logger, "training_logger"))
        self.training_logger = training_logger
        self.error_system = error_system
        self._track_error = _error_tracker(error_system)
        self.timeline = Timeline(self.config.max_events, sinks)
        self.history = self.timeline.history
        self.debug_metrics: list[DebugMetrics] = []
        self.optimization_metrics: list[OptimizationMetrics] = []
        self.memory_snapshots: list[dict[str, Any]] = []
        self.profiles_written: list[str] = []
        self.last_forward_pass: Result | None = None
        self._violations: collections.Counter[str] = collections.Counter()
        self._active: collections.Counter[str] = collections.Counter()
        self._open_metrics: list[DebugMetrics] = []
        self._profiles = 0
        self._growth = GrowthTracker(window=8, threshold=DEFAULT_THRESHOLD, warmup=8)
        self._leak_seq = 0
        self._leaking = False
        self._clean_calls = 0  # profile_memory calls without a leak since one was seen
        self._reset_counts()

    # ------------------------------------------------------------ settings and events
    @property
    def level(self) -> DebugLevel | None:
        # (validated: an enum; parse says so to the type checker, and returns it as it is)
        level = self.config.level
        return DebugLevel.parse(level, "level") if level is not None else None

    @property
    def mode(self) -> DebugMode:
        return DebugMode.parse(self.config.mode, "mode")

    def _off(self, feature: str) -> str:
        """Why ``feature`` is off ("" when on): level OFF, ``debug_mode=False``, or its own switch."""
        if self.config.level is DebugLevel.OFF:
            return "level=off"
        if feature in ("debug_mode", "enable_anomaly_detection", "enable_profiling") and not self.config.debug_mode:
            return "debug_mode=False"
        if feature != "debug_mode" and getattr(self.config, feature) is False:
            return f"{feature}=False"
        return ""

    def _log(self, event_type: str, message: str, data: dict[str, Any] | None = None,
             level: int = logging.INFO) -> None:
        """Add an event to the timeline and the loggers; ERROR events also go to the error system."""
        self.timeline.log(event_type, message, data, level)
        if level >= logging.ERROR and self._track_error is not None:
            try:
                self._track_error(error=NonFiniteError(f"{event_type}: {message}"), context={
                    "event_type": event_type, "source": "torchtrace", **(data or {})})
            except Exception as exc:  # the user's error system must not break the caller
                logger.warning("error_system.track_error failed (%s: %s)", type(exc).__name__, exc)

    def _log_debug_event(self, event_type: str, message: str, data: dict[str, Any] | None = None,
                         level: int = logging.INFO) -> None:
        """Seed 000's name: add your own event (``debugger._log_debug_event("custom_error", str(e))``)."""
        self._log(event_type, message, data, level)

    log_event = _log_debug_event

    def _note_anomalies(self, sentences: list[str]) -> None:
        if self._open_metrics and sentences:
            self._open_metrics[-1].gradient_anomalies.extend(sentences)

    def _snapshot(self, name: str, profile: dict[str, Any]) -> dict[str, Any]:
        """Keep a snapshot in seed 000's shape (percent, CUDA bytes, ISO timestamp)."""
        snap = {"name": name, "timestamp": iso(time.time()), "cpu_memory_percent": profile.get("cpu_memory"),
                "rss_bytes": profile.get("rss_bytes"), "cuda_allocated": profile.get("cuda_allocated_bytes"),
                "cuda_reserved": profile.get("cuda_reserved_bytes")}
        self.memory_snapshots.append(snap)
        del self.memory_snapshots[:-self.config.max_events]
        return snap

    def _run_leaks(self) -> list[str]:
        """``memory_leak`` anomalies the configured run recorded since the last look."""
        rt = current.runtime(create=False)
        if rt is None:
            return []
        events = rt.history.events(self._leak_seq)
        if events:
            self._leak_seq = events[-1].seq
        return [e.message for e in events if e.event_type == "anomaly" and e.data.get("kind") == "memory_leak"]

    def _path(self, name: str | os.PathLike[str] | None, default: str) -> Path:
        """A relative name goes under ``log_dir``; None gets ``default`` there."""
        path = Path(name) if name is not None else Path(default)
        return path if path.is_absolute() else Path(self.config.log_dir) / path

    # ------------------------------------------------------------ the three contexts
    @contextlib.contextmanager
    def anomaly_detection(self, enabled: bool | None = None, mode: str | None = None) -> Iterator[None]:
        """``torch.autograd.detect_anomaly`` over the block (``mode``: detect, warn, raise; default
        the config's ``anomaly_mode``). ``raise`` raises :class:`~torchtrace.NonFiniteError` from
        autograd's error. ``enabled`` None follows the settings (off with
        ``enable_anomaly_detection=False`` or ``debug_mode=False``); True/False decide here."""
        if isinstance(enabled, str) and mode is None:  # anomaly_detection("warn"): the mode, positionally
            enabled, mode = None, enabled
        on = not self._off("enable_anomaly_detection") if enabled is None else bool(flag(enabled, "enabled"))
        mode = mode or self.config.anomaly_mode
        if not on:
            self._log("anomaly_detection_skipped",
                      f"anomaly detection off ({self._off('enable_anomaly_detection') or 'enabled=False'})",
                      level=logging.DEBUG)
        else:
            self._log("anomaly_detection", f"Anomaly detection enabled (mode {mode})", {"mode": mode})
        self._active["anomaly_detection"] += on
        try:
            with core_anomaly_detection(mode=mode, enabled=on, on_anomaly=self._autograd_anomaly):
                yield
        finally:
            self._active["anomaly_detection"] -= on

    def _autograd_anomaly(self, exc: BaseException, mode: str) -> None:
        self._log("autograd_anomaly", f"{type(exc).__name__} under anomaly detection: {str(exc).splitlines()[0][:200]}",
                  {"mode": mode, "error": str(exc)[:500]}, logging.ERROR)

    autograd_anomaly_detection = anomaly_detection

    @contextlib.contextmanager
    def profiling(self, enabled: bool | None = None, output_file: str | os.PathLike[str] | None = None,
                  **options: Any) -> Iterator[dict[str, Any]]:
        """A ``torch.profiler`` window over the block, written as a Chrome trace.

        ``output_file`` relative (or None) goes under ``log_dir`` (default
        ``profile_<n>.json``): ``result["path"]`` is where it went and ``result["log_dir"]``
        the directory a relative name is taken in. Shapes, memory and Python stack traces
        (seed 000's "Stack trace collection") are recorded unless ``options`` say otherwise:
        ``with_stack=False`` profiles faster without the stacks. ``options`` are
        :func:`torchtrace.profiling`'s. ``enabled`` None follows the settings; off, nothing is
        profiled and ``result["path"]`` is None.
        """
        if isinstance(enabled, (str, os.PathLike)) and output_file is None:  # profiling("trace.json")
            enabled, output_file = None, enabled
        on = not self._off("enable_profiling") if enabled is None else flag(enabled, "enabled")
        if not on:
            self._log("profiling_skipped", f"profiling off ({self._off('enable_profiling') or 'enabled=False'}); "
                      "nothing is profiled", level=logging.INFO)
            yield {"path": None, "windows": [], "enabled": False, "log_dir": str(self.config.log_dir)}
            return
        path = self._path(output_file, f"profile_{len(self.profiles_written)}.json")
        for key in ("record_shapes", "profile_memory", "with_stack"):
            options.setdefault(key, True)
        self._log("profiling", f"profiling to {path}", {"path": str(path)}, logging.DEBUG)
        self._active["profiling"] += 1
        try:
            with core_profiling(path, **options) as result:
                result["log_dir"] = str(self.config.log_dir)
                yield result
        finally:
            self._active["profiling"] -= 1
        self.profiles_written.append(str(result.get("path") or path))
        self._log("profile_written", f"profile written to {result.get('path') or path}", {"path": str(path)})

    @contextlib.contextmanager
    def memory_tracking(self, enabled: bool | None = None) -> Iterator[Any]:
        """Memory snapshots at the start and end of the block, a sample for every torchtrace step
        inside it, and a ``memory_tracking`` event with the difference and the leaks found: the
        leak detector's rule over the steps' samples (a ``memory_leak`` event each, with
        ``bytes_per_step``), and ``memory_leak`` anomalies the run recorded."""
        on = not self._off("enable_memory_tracking") if enabled is None else flag(enabled, "enabled")
        if not on:
            self._log("memory_tracking_skipped",
                      f"memory tracking off ({self._off('enable_memory_tracking') or 'enabled=False'})",
                      level=logging.DEBUG)
            yield None
            return
        start = self.profile_memory("memory_tracking_start")
        self._active["memory_tracking"] += 1
        tracker = memory_tools.tracker()
        before = tracker.samples[-1] if tracker.samples else None
        try:
            with memory_tools.memory_tracking(enabled=True) as tracker:
                yield tracker
        finally:
            self._active["memory_tracking"] -= 1
            end = self.profile_memory("memory_tracking_end")
            step_leaks = self._step_leaks(samples_after(tracker.samples, before))
            delta = end["rss_bytes"] - start["rss_bytes"]
            self._log("memory_tracking", f"process memory changed by {delta / 2 ** 20:+.2f} MB",
                      {"rss_delta_bytes": delta,
                       "cuda_allocated_delta_bytes": None if end["cuda_allocated_bytes"] is None
                       else end["cuda_allocated_bytes"] - (start["cuda_allocated_bytes"] or 0),
                       "memory_leaks": end["memory_leaks"] + step_leaks})

    def _step_leaks(self, samples: list[dict[str, Any]]) -> list[str]:
        """Leaks in the per-step samples of a ``memory_tracking`` block (the heap in use where
        glibc counts it, else RSS; CUDA memory allocated), by the leak detector's rule with the
        run's window and threshold (``leak_window``, ``leak_threshold_bytes``);
        each is logged as a ``memory_leak`` event and counted under the operation
        ``memory_tracking``."""
        rt = current.runtime(create=False)
        window = (getattr(rt.settings, "leak_window", None) if rt is not None else None) or DEFAULT_WINDOW
        threshold = getattr(rt.settings, "leak_threshold_bytes", None) if rt is not None else None
        leaks = []
        heap = any(s.get("heap_in_use_bytes") is not None for s in samples)
        cpu = ("heap_in_use_bytes", "heap in use") if heap else ("rss_bytes", "process memory")
        for key, what in (cpu, ("cuda_allocated_bytes", "CUDA memory allocated")):
            # One entry per step (None where a step has no such sample): steps are the x axis.
            values = [s.get(key) for s in samples]
            if all(v is None for v in values):
                continue
            # The block is the user's: a quarter window of warm-up (the run's probe waits a
            # whole window for its first steps' caches), so a block of ~50 steps can show a leak.
            slope = memory_tools.sustained_growth(values, window, threshold or DEFAULT_THRESHOLD,
                                                  warmup=max(4, window // 4))
            if slope is not None:
                leak = (f"{what} grew {slope / 2 ** 20:.2f} MB per step over the {len(values)} steps tracked "
                        "(the leak detector's rule)")
                leaks.append(leak)
                self._log("memory_leak", leak, {"source": "memory_tracking", "memory": key,
                                                "bytes_per_step": slope}, logging.WARNING)
        if leaks:
            steps.report([semconv.MEMORY_LEAK] * len(leaks), "memory_tracking", data={"leaks": leaks})
        return leaks

    # ------------------------------------------------------------ memory tools
    def take_memory_snapshot(self, name: str | None = None, census: bool = False) -> Any:
        """A named snapshot (``snapshot.compare(earlier)`` gives the differences); also kept in
        :attr:`memory_snapshots` in seed 000's shape."""
        snap = memory_tools.take_memory_snapshot(name, census)
        self._snapshot(snap.name, memory_tools.memory_profile())
        self._log("memory_snapshot", f"snapshot {snap.name}", snap.as_dict(), logging.DEBUG)
        return snap

    def compare_memory_snapshots(self, before: MemorySnapshot, after: MemorySnapshot) -> dict[str, Any]:
        return after.compare(before)

    def track_tensor(self, tensor: torch.Tensor, name: str) -> None:
        """Watch ``tensor`` by weak reference (never keeps it alive)."""
        memory_tools.track_tensor(tensor, name)

    def clear_memory(self) -> dict[str, Any]:
        """``gc.collect()`` and CUDA ``empty_cache()``; returns the bytes released."""
        freed = memory_tools.clear_memory()
        self._log("memory_cleared", f"released {freed}", freed, logging.DEBUG)
        return freed

    def monitor_resources(self, **thresholds: float) -> Result:
        """CPU %, memory % and GPU utilisation/memory now; see :func:`torchtrace.compat.monitor_resources`."""
        out = resources.monitor_resources(logger=None, **thresholds)
        for warning in out["warnings"]:
            self._log("resource_warning", warning, {k: out[k] for k in ("cpu_percent", "memory_percent")},
                      logging.WARNING)
        return out
