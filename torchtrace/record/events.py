"""CUDA events, reused from step to step.

Every GPU step records a few events: the phase marks (timing events) and the mark that tells
when the step's host copy has landed. Making an event and destroying it are driver calls on
top of recording it (on an H100 VM, making and recording took 8.7 us against 6.7 us for
recording an existing event again; benchmarks/RESULTS.md). An event whose step has been
finished (the event completed, its time read) goes back to a free list and is recorded again
by a later step: after the first steps, a mark is one ``record()``.
"""

from __future__ import annotations

from typing import Any

import torch

MAX_FREE = 64  # per device and kind: a few steps' worth (steps in flight hold theirs)
MAX_STREAMS = 64  # stream handles kept for marks (a job uses a few)

# The calls under torch.cuda's own current_device(), current_stream() and Event.record(). The
# public ones build a Stream object in Python for every call; a step records four marks, and
# on an H100 VM each mark took several microseconds that way. Any of them missing (a CPU
# build, another version), or torch.cuda.Event replaced (a test's stand-in): the public way.
_EVENT = getattr(torch.cuda, "Event", None)
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)
_GET_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
_BASE = getattr(torch._C, "_CudaEventBase", None)
_RECORD, _QUERY, _ELAPSED = (getattr(_BASE, name, None) for name in ("record", "query", "elapsed_time"))
_DIRECT = None not in (_EVENT, _GET_DEVICE, _GET_STREAM, _RECORD, _QUERY, _ELAPSED)
# (each is called only where _DIRECT holds, so none is None there: the calls' "type: ignore[misc]")
_STREAMS: dict[tuple, Any] = {}  # (stream id, device index, device type) -> torch.cuda.Stream


def _current_stream() -> tuple[int, Any]:
    """``(device index, its current stream)`` without the public functions' Python layers."""
    device = _GET_DEVICE()  # type: ignore[misc]
    data = _GET_STREAM(device)  # type: ignore[misc]
    stream = _STREAMS.get(data)
    if stream is None:
        if len(_STREAMS) >= MAX_STREAMS:
            _STREAMS.clear()
        stream = _STREAMS[data] = torch.cuda.Stream(stream_id=data[0], device_index=data[1], device_type=data[2])
    return device, stream


def seconds_between(a: torch.cuda.Event, b: torch.cuda.Event) -> float | None:
    """Seconds from event ``a`` to event ``b``, when both have completed (no wait); else None."""
    if _DIRECT and type(a) is _EVENT and type(b) is _EVENT:
        if not (_QUERY(a) and _QUERY(b)):  # type: ignore[misc]
            return None
        return _ELAPSED(a, b) / 1000.0  # type: ignore[misc]
    if not (a.query() and b.query()):
        return None
    return a.elapsed_time(b) / 1000.0


class EventPool:
    """Free CUDA events of one kind (timing or not), per device."""

    __slots__ = ("timing", "_free", "created")

    def __init__(self, timing: bool) -> None:
        self.timing = timing
        self._free: dict[int, list[Any]] = {}
        self.created = 0  # events made (the rest of the marks reused one)

    def recorded(self) -> torch.cuda.Event:
        """An event recorded now on the current device's current stream."""
        direct = _DIRECT and torch.cuda.Event is _EVENT
        if direct:
            device, stream = _current_stream()
        else:
            device = torch.cuda.current_device()
        free = self._free.get(device)
        event = None
        if free:
            try:
                event = free.pop()
            except IndexError:  # another thread took the last one
                event = None
        if event is None:
            event = torch.cuda.Event(enable_timing=self.timing)
            self.created += 1
        if direct:
            _RECORD(event, stream)  # type: ignore[misc]
        else:
            event.record()
        return event

    def give_back(self, *events: torch.cuda.Event | None) -> None:
        """Events that have completed and will not be read again."""
        for event in events:
            if event is None:
                continue
            device = getattr(event, "device", None)
            if device is None or device.index is None:
                continue
            free = self._free.setdefault(device.index, [])
            if len(free) < MAX_FREE:
                free.append(event)


TIMING = EventPool(timing=True)  # the phase marks
LANDED = EventPool(timing=False)  # "the host copy has landed"
