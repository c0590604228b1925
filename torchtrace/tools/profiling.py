"""``profiling()``: profile a block, or the instrumented steps inside it on a schedule.

>>> import torchtrace as tt
>>> sched = tt.ProfileSchedule(steps=[3], active=2)
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from torchtrace import current
from torchtrace.probes.profiler import ProfilerProbe, ProfileSchedule, Saved, Window, top_ops, write_trace

if TYPE_CHECKING:
    from torch.profiler import profile

    from torchtrace.step.runtime import Runtime


@contextlib.contextmanager
def profiling(output_file: str | os.PathLike[str] | None = None, schedule: ProfileSchedule | None = None, *,
              record_shapes: bool = False, profile_memory: bool = False, with_stack: bool = False,
              max_trace_bytes: int = 64 * 1024 * 1024, enabled: bool = True) -> Iterator[dict[str, Any]]:
    """Profile inside the block.

    ``enabled=False`` runs the block unprofiled and writes nothing (``result["path"]`` stays
    None): the seeds' ``profiling(enabled=...)``.

    Without ``schedule``: one ``torch.profiler`` window over the whole block, written as a
    Chrome trace to ``output_file`` (default ``<run_dir>/profiles/trace-block.json``); every
    instrumented step inside is a ``ProfilerStep``. With ``schedule``: instrumented steps in
    the block are profiled in windows per the schedule, written into ``output_file``'s
    directory (or the run's ``profiles/``). The yielded dict gets ``path``/``windows``.

    >>> import torch, torchtrace as tt, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> with tt.profiling(os.path.join(d, "t.json")) as result:
    ...     _ = torch.ones(8) * 2
    >>> os.path.exists(result["path"])
    True
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled={enabled!r} is not valid; accepted values: True, False")
    result: dict[str, Any] = {"path": None, "windows": []}
    if not enabled:
        yield result
        return
    probe = _probe(current.runtime())
    if schedule is not None:
        if probe is None:
            raise RuntimeError("profiling(schedule=...) needs a configured torchtrace runtime")
        saved = _open_schedule(probe, schedule, output_file, record_shapes, profile_memory, with_stack)
        before = len(probe.windows)
        try:
            yield result
        finally:
            _close_schedule(probe, saved, before, result)
        return
    path = Path(output_file) if output_file else (
        (probe.directory() if probe is not None else Path("torchtrace-profiles")) / "trace-block.json")
    sched = ProfileSchedule(every=1, active=10 ** 9, max_window_steps=10 ** 9, max_windows=10 ** 9,
                            record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack,
                            max_trace_bytes=max_trace_bytes)
    prof = _block_profiler(record_shapes, profile_memory, with_stack)
    window = Window(path, "manual", -1, 10 ** 9, prof, private=output_file is None)
    block_saved = probe.open_block(window, sched) if probe is not None else None
    prof.__enter__()
    try:
        yield result
    finally:
        _close_block(probe, window, sched, block_saved, prof, path, max_trace_bytes, output_file is None, result)


def _open_schedule(probe: ProfilerProbe, schedule: ProfileSchedule,
                   output_file: str | os.PathLike[str] | None, record_shapes: bool, profile_memory: bool,
                   with_stack: bool) -> Saved:
    """Hand ``schedule`` (with the block's options added) to the probe; return what to restore."""
    schedule.record_shapes = schedule.record_shapes or record_shapes
    schedule.profile_memory = schedule.profile_memory or profile_memory
    schedule.with_stack = schedule.with_stack or with_stack
    return probe.open_schedule(schedule, Path(output_file).parent if output_file else None)


def _close_schedule(probe: ProfilerProbe, saved: Saved, before: int, result: dict[str, Any]) -> None:
    """Close the scheduled windows, restore the probe, and put the block's windows in ``result``."""
    probe.close()
    probe.restore(saved)
    result["windows"] = probe.windows[before:]
    result["path"] = result["windows"][-1]["path"] if result["windows"] else None


def _block_profiler(record_shapes: bool, profile_memory: bool, with_stack: bool) -> profile:
    """A ``torch.profiler.profile`` over the CPU, and CUDA when there is one; not started."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=activities, record_shapes=record_shapes, profile_memory=profile_memory,
                   with_stack=with_stack)


def _close_block(probe: ProfilerProbe | None, window: Window, sched: ProfileSchedule, saved: Saved | None,
                 prof: profile,
                 path: Path, max_trace_bytes: int, private: bool, result: dict[str, Any]) -> None:
    """End the block's window: through the probe when there is one, else write the trace here."""
    if probe is not None and saved is not None:
        probe.open_block(window, sched)  # the block's window, whatever steps did inside
        probe.close_window()
        probe.restore(saved)
        result["windows"] = probe.windows[-1:]
    else:
        prof.__exit__(None, None, None)
        write_trace(prof, path, max_trace_bytes, private=private)
        result["windows"] = [{"path": str(path), "reason": "manual", "top_ops": top_ops(prof)[:5]}]
    result["path"] = str(path)


def _probe(rt: Runtime | None) -> ProfilerProbe | None:
    return rt.probes.find(ProfilerProbe) if rt is not None else None
