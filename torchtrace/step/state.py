"""What one step carries from its start to its record, one object per concern.

:class:`~torchtrace.step.scope.StepScope` is what the user holds (``record_loss``,
``record_batch``, ``add_anomaly``, ``span``); the state below is what the pipeline keeps for
the step, each part read and written by the module that owns its concern:

- :class:`Given`: what the user handed over inside the step (its loss, its batch size), read
  by the scope's end and by a framework integration that gathers micro-batches;
- :class:`StepThroughput`: written by :class:`~torchtrace.step.throughput.RunThroughput` at the
  step's start and read back at its end (FLOP key, known shapes, phase clock, FLOP counter,
  the step's place among nested operations and its times for goodput);
- the gradients: :class:`~torchtrace.step.gradients.GradientCheck` (``scope.gradients``);
- :class:`StepForensics`: what a forensic replay of the step needs (how to call it again,
  and the optimizers and schedulers it must not step a second time).

>>> given = Given()
>>> given.loss is None and given.batch is None
True
>>> StepThroughput(parent=None, entered_at=1.0, left_before=None).counter is None
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Hashable

if TYPE_CHECKING:
    from contextlib import ExitStack

    import torch

    from torchtrace.measure.batch import BatchSize
    from torchtrace.measure.loss import LossValue
    from torchtrace.step.phases import StepClock
    from torchtrace.step.scope import StepScope


class Given:
    """What the user handed over inside the step: ``loss`` (:meth:`StepScope.record_loss`) and
    ``batch`` (:meth:`StepScope.record_batch`'s checked ``(samples, tokens, flops)``)."""

    __slots__ = ("loss", "batch")

    def __init__(self) -> None:
        self.loss: LossValue | None = None
        self.batch: tuple[Any, Any, Any] | None = None  # (samples, tokens, flops)

    def take(self) -> tuple[LossValue | None, tuple[Any, Any, Any] | None]:
        """``(loss, batch)`` given so far, cleared: a framework's next micro-batch gives its own."""
        taken = self.loss, self.batch
        self.loss = self.batch = None
        return taken


class StepThroughput:
    """The throughput side of one step.

    ``key``: the FLOP table's key (the operation and its inputs' shapes), a ``LateKey`` that the
    model's call fills in, or None. ``shape``: ``(FLOPs, batch size)`` known for that key, or
    None. ``clock``: the phase clock (forward, backward, optimizer). ``counter``: the FLOP
    counter this step runs under (a few steps of a run only), else None. ``parent``: the step
    this one runs inside; ``holds_steps``: training steps ran inside this one (an epoch).
    ``started_at`` (the step's body began), ``entered_at`` (torchtrace began it) and
    ``left_before`` (torchtrace was done with the step before) are ``perf_counter`` times for
    goodput. ``scale_before``: a GradScaler's scale at the start (a skipped update shows as a
    smaller scale). ``step_end``: the clock's mark where the backward ends without an optimizer.
    ``checkpoint_s``: seconds of checkpoint saves and loads inside the step, goodput's
    *checkpoint*, not the step's time.
    """

    __slots__ = ("key", "shape", "clock", "counter", "parent", "holds_steps", "started_at", "entered_at",
                 "left_before", "scale_before", "step_end", "checkpoint_s")

    def __init__(self, parent: StepScope | None, entered_at: float, left_before: float | None) -> None:
        self.key: Hashable | None = None
        self.shape: tuple[float | None, BatchSize] | None = None
        self.clock: StepClock | None = None
        self.counter: ExitStack | None = None
        self.parent = parent
        self.holds_steps = False
        self.started_at = entered_at
        self.entered_at = entered_at
        self.left_before = left_before
        self.scale_before: torch.Tensor | float | None = None
        self.step_end: object = None
        self.checkpoint_s = 0.0


class StepForensics:
    """What replaying the step needs: ``replay`` (the caller's), or ``function`` with the step's
    inputs (a decorated step), and ``stepped``: the other optimizers, schedulers and weight
    averages that stepped in it, which a replay must not step again."""

    __slots__ = ("replay", "function", "stepped")

    def __init__(self, replay: Callable[[], Any] | None) -> None:
        self.replay = replay
        self.function: Callable[..., Any] | None = None
        self.stepped: list[object] | None = None

    def note_stepped(self, updater: object) -> None:
        """``updater`` stepped in the step (at most 64 kept, each once)."""
        stepped = self.stepped
        if stepped is None:
            self.stepped = [updater]
        elif len(stepped) < 64 and not any(u is updater for u in stepped):
            stepped.append(updater)


__all__ = ["Given", "StepForensics", "StepThroughput"]
