"""Which parameters a step trains, as far as its FLOPs are concerned.

A step's FLOPs are counted once per input shape, but freezing parameters (fine-tuning a head
first, unfreezing the backbone later) changes what the backward computes at the same shapes:
without weight gradients for the frozen layers, and without the input gradients below the
lowest trained one. The gradient check already knows, at no cost, how many parameter tensors
got a gradient; when that number differs from the one the operation's FLOPs were counted
with, those counts are dropped and the operation's next step is counted again.

What it cannot see: parameters frozen while their gradients are kept (``zero_grad(
set_to_none=False)`` leaves zeros on them), and a change that keeps the number of tensors
with gradients (one layer frozen as another is unfrozen). A model whose parameters get
gradients in some steps only (experts no token was routed to) would change the number often:
after :data:`MAX_RECOUNTS` recounts the operation keeps its last counts, and the log says so once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torchtrace.measure.flops import StepFlops
    from torchtrace.step.gradients import GradientCheck

MAX_RECOUNTS = 8  # recounts per operation for a change of trained parameters
MAX_OPERATIONS = 64  # operations whose trained-parameter count is kept


class TrainedParameters:
    """Per operation, how many parameter tensors had a gradient when its FLOPs were counted."""

    def __init__(self, flops: StepFlops, warn_once: Callable[..., None], forget_shapes: Callable[[], None]) -> None:
        self.flops = flops  # the StepFlops table whose counts are dropped
        self.warn_once = warn_once
        self.forget_shapes = forget_shapes  # and what the pipeline keeps of them per shape
        self.counted_with: dict[str, int] = {}
        self.recounts: dict[str, int] = {}

    def changed(self, operation: str, gradients: GradientCheck | None, counted: bool) -> bool:
        """After a step with FLOPs: True when they were counted with other parameters trained
        (they are dropped: the operation's next step is counted again). ``counted``: this
        step's FLOPs were counted now, with its own gradients."""
        stats = gradients.stats if gradients is not None else None
        if stats is None:
            return False
        n = len(stats.names)  # (GradStats.count, without the property's call: every step pays for this)
        if counted:
            if operation in self.counted_with or len(self.counted_with) < MAX_OPERATIONS:
                self.counted_with[operation] = n
            return False
        known = self.counted_with.get(operation)
        if known is None or known == n:
            return False
        recounts = self.recounts.get(operation, 0)
        if recounts >= MAX_RECOUNTS:
            self.counted_with[operation] = n  # (said once below; not looked at again until a count)
            self.warn_once(("flops", "trained", operation),
                           "torchtrace: %s: the parameters that get gradients changed again after %d recounts of "
                           "its FLOPs; its FLOPs are those of the last count from now on", operation, MAX_RECOUNTS)
            return False
        self.recounts[operation] = recounts + 1
        del self.counted_with[operation]
        self.flops.forget(operation)
        self.forget_shapes()
        return True


__all__ = ["MAX_RECOUNTS", "TrainedParameters"]
