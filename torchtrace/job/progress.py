"""What the training thread is doing now: the phase marks' stores into the black box.

The step's existing marks (step entry and exit, the model's forward, the optimizer's step
hooks, a ``torch.distributed`` call) call the functions below. Each is a handful of plain
dict stores and one ``time.time()``: no lock, no I/O, no device work. The dict is the black
box's :attr:`~torchtrace.job.state.RankState.fields`, so the watchdog, the black box's writer
thread and ``/metrics`` read the same values (a dict store is atomic under the GIL).

Fields written here (besides those :mod:`torchtrace.job.state` lists):

* ``phase``: one of :data:`torchtrace.semconv.TRAINING_PHASES`. ``idle`` before the first
  step, after shutdown and from :func:`torchtrace.idle` to the next training step (an
  evaluation or a checkpoint in between has its phase while it runs, then ``idle`` again); ``data_wait``
  between steps and inside a step before its model's forward (input code); ``forward``, then
  ``backward`` from the forward's end (the loss counts with it), ``optimizer``;
  ``collective`` inside a ``torch.distributed`` call; ``checkpoint`` and ``evaluation`` for
  the whole of a step marked with that ``kind=``.
* ``progress``: unix time of the last mark of any kind (the watchdog's clock).
* ``step_kind``: the open step's ``kind=`` (train, evaluation, checkpoint, other).
* ``step_start``: unix time the open step began; None between steps. Kept at shutdown: a
  process that ends inside a step (a signal) leaves the start of the step it interrupted, and
  that step's number as ``interrupted_step``.
* ``steps_done``: steps finished in this process (the watchdog's step-period estimate).
* ``thread``: the id of the thread that runs the steps (its stack comes first).
* ``idles``: :func:`torchtrace.idle` calls so far (the watchdog learns no step period across one).

>>> fields = {}
>>> track(fields)
>>> step_began(3, "train"); mark("forward")
>>> (fields["current_step"], fields["phase"])
(3, 'forward')
>>> step_ended(3); (fields["step"], fields["phase"], fields["current_step"])
(3, 'data_wait', None)
>>> untrack(fields)
"""

from __future__ import annotations

import threading
import time
from typing import Any

# The live black box's fields; a scratch dict when none is tracked (stores then go nowhere).
_fields: dict[str, Any] = {}
# Whether the open step is a training step: its forward, backward and optimizer marks name
# the phase. Inside a checkpoint or evaluation step the phase stays the step's kind (the
# watchdog gives those their own allowance) and the marks count as progress only.
_train = True
# Whether torchtrace.idle() was said since the last training step began: a checkpoint or an
# evaluation step then ends in phase idle, not data_wait.
_idle = False
_clock = time.time
_ident = threading.get_ident
SLOW_KINDS = ("checkpoint", "evaluation")
TRAIN_KIND = "train"


def track(fields: dict[str, Any]) -> None:
    """Make ``fields`` the dict the marks store into, starting idle."""
    global _fields, _train, _idle
    now = _clock()
    # The thread that configures is usually the one that trains (a step sets it again).
    fields.update(phase="idle", phase_since=now, progress=now, current_step=None, step_kind=None, step_start=None,
                  steps_done=0, collective_seq=fields.get("collective_seq") or 0, thread=_ident())
    _train = True
    _idle = False
    _fields = fields


def untrack(fields: dict[str, Any]) -> None:
    """Stop storing into ``fields`` (shutdown): its phase becomes ``idle``. A step still running
    here (a signal ends the process) is one its end interrupted: its number is kept as
    ``interrupted_step``, and ``step_start`` stays."""
    global _fields
    if _fields is fields:
        _fields = {}
    now = _clock()
    if fields.get("current_step") is not None:
        fields["interrupted_step"] = fields["current_step"]
    fields.update(phase="idle", phase_since=now, progress=now, current_step=None)


def idle() -> None:
    """The script says no step comes for now (:func:`torchtrace.idle`): the phase is ``idle``,
    which no timeout watches, until the next training step begins (a checkpoint or an
    evaluation meanwhile has its own phase while it runs, then the phase is ``idle`` again)."""
    global _idle
    _idle = True
    f = _fields
    now = _clock()
    f["phase"] = "idle"
    f["phase_since"] = f["progress"] = now
    f["idles"] = f.get("idles", 0) + 1


def tracked() -> dict[str, Any]:
    """The dict the marks store into now."""
    return _fields


def step_began(step: int, kind: str) -> None:
    """A step was entered (``StepScope``): its number and kind; data_wait until its forward.
    A training step ends an idle (:func:`idle`)."""
    global _train, _idle
    f = _fields
    now = _clock()
    f["current_step"] = step
    f["step_kind"] = kind
    f["step_start"] = now
    f["thread"] = _ident()
    if kind in SLOW_KINDS:
        _train = False
        f["phase"] = kind
    else:
        _train = True
        _idle = False
        f["phase"] = "data_wait"
    f["phase_since"] = f["progress"] = now


def mark(phase: str) -> None:
    """A boundary inside the step: ``forward``, ``backward`` or ``optimizer`` begins."""
    f = _fields
    now = f["progress"] = _clock()
    if _train:
        f["phase"] = phase
        f["phase_since"] = now


def called_between_steps() -> None:
    """A model a step watches was called between steps (an evaluation loop the script does not
    mark, nanoGPT's ``estimate_loss``, a sample generated): progress, when it is the thread that
    runs the steps (another thread serving the model says nothing of the training). The phase
    stays what it was: the call gets no allowance, so one that never returns is still a hang."""
    f = _fields
    if f.get("current_step") is None and f.get("thread") == _ident():
        f["progress"] = _clock()


def step_ended(step: int, kind: str = TRAIN_KIND) -> None:
    """A step ended (``StepScope.__exit__``): data_wait until the next one (while idle, a
    checkpoint or evaluation step ends in ``idle``: no training step follows). A training step's
    number is the job's last step (``step``): an evaluation or a checkpoint operation numbers
    its own steps, and its number would read as the job's (the checkpoint's step, the steps a
    killed attempt lost)."""
    global _train
    f = _fields
    now = _clock()
    if kind == TRAIN_KIND:
        f["step"] = step
        f["step_time"] = now
    f["current_step"] = None
    f["step_start"] = None
    f["phase"] = "idle" if _idle else "data_wait"
    f["phase_since"] = f["progress"] = now
    f["steps_done"] = f.get("steps_done", 0) + 1
    _train = True


def collective_began(op: str, group: str) -> str:
    """A ``torch.distributed`` call was entered: counted, the phase is ``collective``.

    Returns the phase before it, for :func:`phase_ended`.
    """
    f = _fields
    now = f["progress"] = _clock()
    before = f.get("phase", "idle")
    f["collective_seq"] = f.get("collective_seq", 0) + 1
    f["collective_op"] = op
    f["collective_group"] = group
    f["phase"] = "collective"
    f["phase_since"] = now
    return before


def on_training_thread() -> bool:
    """Whether the caller is the thread that runs the steps (before the first step: the one
    that configured)."""
    return _fields.get("thread") in (None, _ident())


def checkpoint_began() -> str:
    """A checkpoint save or load began on the training thread (``torch.save`` between steps,
    say): the phase is ``checkpoint``, with its allowance, until it ends; while ``idle``
    before the first step (a resume's load) it stays idle, which no timeout watches; after
    :func:`idle` it is ``checkpoint``, then ``idle`` again. Returns the phase before it, for
    :func:`phase_ended`."""
    f = _fields
    now = f["progress"] = _clock()
    before = f.get("phase", "idle")
    if before != "idle" or _idle:
        f["phase"] = "checkpoint"
        f["phase_since"] = now
    return before


def phase_ended(phase: str, before: str) -> None:
    """A call that set ``phase`` returned (:func:`collective_began`'s ``torch.distributed``
    call, which for ``async_op`` returns before its work completes; :func:`checkpoint_began`'s
    save or load): the phase ``before`` it again, unless something else set one meanwhile."""
    f = _fields
    now = f["progress"] = _clock()
    if f.get("phase") == phase:
        f["phase"] = before
        f["phase_since"] = now


def between(kind: str) -> None:
    """A framework says the time until its next step is a checkpoint or an evaluation (a
    Trainer about to evaluate or save between two steps): the phase is that kind, with its
    allowance, until the next step begins."""
    global _train
    f = _fields
    now = _clock()
    _train = False
    f["phase"] = kind
    f["phase_since"] = f["progress"] = now
