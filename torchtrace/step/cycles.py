"""On a GPU, the time base of a step's rates: its cycle in device time (see :class:`DeviceCycles`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchtrace.record import events

if TYPE_CHECKING:
    from torchtrace.step.phases import StepClock


class DeviceCycles:
    """On a GPU, each step's cycle in device time: from the last mark of the step before (of
    the same operation) to the step's own last mark (the optimizer's end, else the step's end,
    else the forward's end), CUDA events read once the step's copy has landed.

    The host runs ahead of the GPU until CUDA's launch queue fills, so the host's time between
    step ends can be shorter or longer than the GPU's: rates over a window of host cycles were
    5-10 % off the device's on an H100, and 44 % off with other processes on the GPU. The
    device's cycle holds what the GPU did and any time it sat idle waiting for the host (a
    loader, the loop's own work), which is the step's real throughput either way.
    """

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: tuple[str, Any] | None = None  # (operation, last mark) of the step finished before

    def cycle(self, operation: str, clock: StepClock | None) -> float | None:
        """Seconds from the step before's last mark to this step's (called once per finished
        step, in step order, after ``clock.phases()``); None on the host, for an operation's
        first step, after a step of another operation, or when a mark is missing."""
        end = clock.last if clock is not None and clock.cuda else None
        last, self.last = self.last, ((operation, end) if end is not None else None)
        if last is None:
            return None
        seconds = None
        try:
            if end is not None and last[0] == operation:
                seconds = events.seconds_between(last[1], end)
        except RuntimeError:  # marks on two devices (the current device changed between steps)
            seconds = None
        events.TIMING.give_back(last[1])
        return seconds if seconds is not None and seconds > 0 else None
