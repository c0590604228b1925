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


class EventPool:
    """Free CUDA events of one kind (timing or not), per device."""

    __slots__ = ("timing", "_free", "created")

    def __init__(self, timing: bool) -> None:
        self.timing = timing
        self._free: dict[int, list[Any]] = {}
        self.created = 0  # events made (the rest of the marks reused one)

    def recorded(self) -> Any:
        """An event recorded now on the current device's current stream."""
        free = self._free.get(torch.cuda.current_device())
        event = None
        if free:
            try:
                event = free.pop()
            except IndexError:  # another thread took the last one
                event = None
        if event is None:
            event = torch.cuda.Event(enable_timing=self.timing)
            self.created += 1
        event.record()
        return event

    def give_back(self, *events: Any) -> None:
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
