"""What forensics replays for a Lightning batch, and what the replay leaves as it was.

A replay runs the module's ``training_step`` again on the same batch. Lightning's trainer
must not see it: nothing logged twice, no callback hook called a second time, and under
manual optimization no ``opt.step()`` counted in Lightning's loop (``global_step``, which
``max_steps`` reads). Imports no framework: the trainer and module come as arguments.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer


def training_step_replay(trainer: Trainer, pl_module: LightningModule, batch: object,
                         batch_idx: int) -> Callable[[], Any]:
    """What forensics replays for a Lightning batch: ``training_step(batch, batch_idx)`` again,
    under the trainer's precision context, with ``self.log``/``self.log_dict`` silenced (a
    replay logs nothing twice), no callback hearing it (:func:`_unheard`) and the module's
    optimizers running only the closure they are given (:func:`_closures_only`: under manual
    optimization the replay's ``opt.step()`` calls leave Lightning's step count as it was).
    The loss it returns is the module's own code's: a non-finite value made there, outside any
    submodule, is blamed on the module itself (``""``).

    >>> replay = training_step_replay(trainer, module, batch, 0)   # doctest: +SKIP
    """
    def replay() -> Any:
        context = getattr(getattr(trainer, "precision_plugin", None), "train_step_context", None)
        with (context() if context is not None else contextlib.nullcontext()), _silenced(pl_module), \
                _unheard(trainer), _closures_only(pl_module):
            return pl_module.training_step(batch, batch_idx)

    replay.__torchtrace_model_code__ = True  # type: ignore[attr-defined]
    return replay


_ABSENT = object()


@contextlib.contextmanager
def _held(obj: object, name: str, value: object) -> Iterator[None]:
    """``obj.name`` (an instance attribute) is ``value`` while the block runs; then what the
    instance held under that name itself again, or nothing (its class's attribute again)."""
    own = vars(obj).get(name, _ABSENT)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own is _ABSENT:
            vars(obj).pop(name, None)
        else:
            setattr(obj, name, own)


def _silenced(pl_module: LightningModule) -> contextlib.ExitStack:
    """``log`` and ``log_dict`` do nothing on this instance while the block runs."""
    stack = contextlib.ExitStack()
    for name in ("log", "log_dict"):
        stack.enter_context(_held(pl_module, name, _nothing))
    return stack


def _unheard(trainer: Trainer) -> contextlib.AbstractContextManager[None]:
    """The trainer has no callbacks while the block runs: a replay's ``manual_backward`` and
    ``opt.step()`` would call their ``on_before_backward``, ``on_after_backward`` and
    ``on_before_optimizer_step`` a second time (torchtrace's own would mark the step's phases
    again). (``trainer.callbacks`` is the list Lightning's callback connector sets on the
    trainer.)"""
    return _held(trainer, "callbacks", [])


def _closures_only(pl_module: LightningModule) -> contextlib.ExitStack:
    """The module's optimizers (``self.optimizers()``, Lightning's wrappers) run only the
    closure they are given, if any, while the block runs: their ``step`` would count a step in
    Lightning's loop (``global_step``), call the callbacks' and the module's
    ``on_before_optimizer_step``, clip, and step a loss scaler."""
    found = pl_module.optimizers()
    stack = contextlib.ExitStack()
    for optimizer in found if isinstance(found, list) else [found]:
        stack.enter_context(_held(optimizer, "step", _closure_only))
    return stack


# Any: what the closure returns, the step's result.
def _closure_only(closure: Callable[[], Any] | None = None, **kwargs: object) -> Any:
    """An optimizer's ``step`` in a replay: the closure (the forward and backward it wraps) runs,
    the update does not."""
    return closure() if closure is not None else None


def _nothing(*args: object, **kwargs: object) -> None:
    """``self.log`` in a replay."""


__all__ = ["training_step_replay"]
