"""A Hugging Face Trainer's checkpoint as one save, and its resume as one load.

A Trainer checkpoint writes the model (safetensors), then the optimizer, the scheduler, the
random states and the arguments, one file each. Timed file by file it was four saves, and the
model's write none (transformers took safetensors' ``save_file`` by name at its import, before
torchtrace wraps it). A resume (``train(resume_from_checkpoint=...)``) loads the model in
``train()`` before any callback hook, the optimizer and scheduler and the scaler as training
is prepared, and the random states as the first epoch begins, with other work between: four
loads, one per file.

Here the Trainer's own methods for these are timed instead: ``_save_checkpoint`` as one save
(the files inside it count once, as inside any save), and the resume's loads as parts of one
load, counted whole when the first step begins. They are private API: they are wrapped on the
one Trainer instance the callback sees, never on the class, and put back when training ends; a
method this transformers does not have is left alone, and what it writes or reads is timed file
by file as before.
"""

from __future__ import annotations

from typing import Any, Callable

from torchtrace import api
from torchtrace.integrations._common import put_back_attribute, replace_attribute
from torchtrace.job.checkpoints import checkpoint
from torchtrace.step import job

SAVE = "_save_checkpoint"
"""The Trainer's method that writes one checkpoint, every file of it."""

LOADS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state")
"""The Trainer's methods that load the parts of the checkpoint it resumes from."""


class TrainerCheckpoints:
    """The checkpoint methods of one Trainer, timed while it is taken (:meth:`take`).

    >>> checkpoints = TrainerCheckpoints()
    >>> checkpoints.take(None)  # no Trainer seen: nothing wrapped, files timed one by one
    >>> checkpoints.times_saves
    False
    """

    def __init__(self) -> None:
        self._trainer: Any = None  # Any: a transformers.Trainer, from the optional package
        self.times_saves = False  # whether the Trainer's saves are timed whole (else on_save says them)
        self._loaded: float | None = None  # the resume's parts so far, in seconds (None: no part yet)

    def take(self, trainer: Any) -> None:
        """Time ``trainer``'s checkpoint methods (once; a Trainer taken before is given back)."""
        if trainer is None or trainer is self._trainer:
            return
        self.give_back()
        for name in (SAVE, *LOADS):
            method = getattr(trainer, name, None)
            if callable(method):
                replace_attribute(trainer, name, _whole_save(method) if name == SAVE else self._part(method))
        self.times_saves = callable(getattr(trainer, SAVE, None))
        self._trainer = trainer

    def give_back(self) -> None:
        """The Trainer's methods are its own again (a resume not yet counted is counted now)."""
        self.resumed()
        trainer, self._trainer = self._trainer, None
        self.times_saves = False
        if trainer is not None:
            for name in (SAVE, *LOADS):
                put_back_attribute(trainer, name)

    def resumed(self) -> None:
        """The resume's loads are over (its first step begins): one load, of their time together."""
        seconds, self._loaded = self._loaded, None
        rt = api.get_runtime()
        if seconds is None or rt is None:
            return
        try:
            job.checkpoint_counted(rt, "load", seconds)
        except Exception as exc:  # torchtrace's own failure never reaches the Trainer
            rt.errors.report("other", exc)

    def _part(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` timed as a part of the resume's load: its time is checkpoint time, and adds
        to the load that :meth:`resumed` counts."""
        # Any: the Trainer method's own arguments and result, passed through.
        def load_part(*args: Any, **kwargs: Any) -> Any:
            with checkpoint("load") as call:
                call.part = True
                result = method(*args, **kwargs)
            if call.seconds is not None:  # (None: inside another checkpoint, or torchtrace not configured)
                self._loaded = (self._loaded or 0.0) + call.seconds
            return result

        return load_part


def _whole_save(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` timed as one save, whatever it writes inside."""
    # Any: the Trainer method's own arguments and result, passed through.
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        with checkpoint("save"):
            return method(*args, **kwargs)

    return save_checkpoint
