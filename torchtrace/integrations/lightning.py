"""PyTorch Lightning: one line gives every training batch a torchtrace step.

>>> from torchtrace.integrations.lightning import TorchtraceCallback   # doctest: +SKIP
>>> trainer = lightning.pytorch.Trainer(callbacks=[TorchtraceCallback()])  # doctest: +SKIP

Needs ``pip install "torchtrace[lightning]"``.
"""

from __future__ import annotations

import collections
import functools
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

from torchtrace import api
from torchtrace.distributed.identity import identity
from torchtrace.integrations._common import StepDriver, put_back_attribute, replace_attribute, require
from torchtrace.integrations._lightning_replay import training_step_replay
from torchtrace.job import progress
from torchtrace.job.checkpoints import checkpoint
from torchtrace.job.identity import offer_run_id_ahead
from torchtrace.measure.batch import infer_batch
from torchtrace.measure.batch_layout import sequence_layout
from torchtrace.measure.loss import extract_loss
from torchtrace.measure.scaler import scaler_enabled, unscaled_by

try:
    import lightning.pytorch as _pl
except ImportError:  # the older package name
    try:
        import pytorch_lightning as _pl  # type: ignore[no-redef]
    except ImportError:
        _pl = require("lightning.pytorch", "lightning", "PyTorch Lightning")

# Lightning's checkpoint IO that writes on a thread of its own (None where this Lightning has none).
_ASYNC_IO: type | None = getattr(getattr(_pl, "plugins", None), "AsyncCheckpointIO", None)

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.utilities.types import STEP_OUTPUT

_R = TypeVar("_R")

__all__ = ["TorchtraceCallback", "training_step_replay"]


class TorchtraceCallback(_pl.Callback):
    """A torchtrace step span per training batch, and one per validation batch.

    Hooks used:

    - ``on_train_batch_start`` opens the step (span ``train_step``); ``on_train_batch_end``
      records ``outputs["loss"]`` and closes it.
    - ``on_before_optimizer_step`` measures the gradients: Lightning calls it after the
      closure (forward and backward) and, under mixed precision, after unscaling, so the
      statistics are those of the real update. The guard policy applies here: ``skip``
      zeroes the gradients (Lightning's clip comes next) and clears them as the torch
      optimizer's update begins, so it leaves every parameter unchanged; ``raise``
      ends the span and raises :class:`torchtrace.NonFiniteError` through ``trainer.fit``.
    - ``on_validation_batch_start/end`` open and close a ``validation_step`` span (no
      gradient statistics; the sanity check is not traced), inside a ``validation_step_loop``
      span that ``on_validation_start/end`` open and close: in goodput the whole loop is
      evaluation, its loading between batches included.

    - Under manual optimization (``automatic_optimization = False``), ``setup`` has the
      module's ``clip_gradients`` measure the gradients of the optimizer it is given before
      clipping them (the module clips before its ``optimizer.step()``, and so before
      ``on_before_optimizer_step``), unless a ``16-mixed`` loss scaler has not unscaled them
      yet (they are measured at ``on_before_optimizer_step`` then); ``teardown`` puts the
      module's own method back.
    - ``setup`` times the strategy's checkpoint IO (``save_checkpoint``, ``load_checkpoint``:
      serialising and writing, whatever the IO plugin) as checkpoint saves and loads
      (``torchtrace_checkpoint_seconds``, badput ``checkpoint``, the black box's last
      checkpoint step); ``teardown`` takes the timing off.

    Built in a process where torchtrace is not configured yet, the callback offers the run id
    that process will take to the ranks Lightning's launcher starts for ``devices=N``: all
    write one run, whether ``configure()`` was called or torchtrace set itself up at the first
    step.

    Nothing is logged through ``LightningModule.log``: Lightning's own logged metrics are
    untouched; torchtrace's numbers go to its spans, Prometheus metrics and report.

    Args:
        name: the training span's name (the ``operation`` label).
        validation_name: the validation span's name; ``None`` traces no validation.
    """

    def __init__(self, name: str = "train_step", validation_name: str | None = "validation_step") -> None:
        super().__init__()
        # The script's first process builds its callbacks before Lightning's launcher
        # (``devices=N``, ``strategy="ddp"``) runs the script again for the other ranks, and
        # torchtrace is set up at the first step, after that: a run id offered now is the one
        # they and this process take (one run, not one each).
        if api.get_runtime(create=False) is None:
            ident = identity()
            offer_run_id_ahead(ident.rank, ident.distributed)
        self._train = StepDriver(name)
        # Validation batches are evaluation in goodput (badput), not training steps.
        self._val = StepDriver(validation_name, kind="evaluation") if validation_name else None
        self._loop = StepDriver(f"{validation_name}_loop", kind="evaluation") if validation_name else None

    # ------------------------------------------------------------ checkpoints
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        put_back_attribute(pl_module, "clip_gradients")  # left by a fit that ended without its teardown (an exception)
        if not getattr(pl_module, "automatic_optimization", True):
            replace_attribute(pl_module, "clip_gradients", _measured_clip(self._train, pl_module))
        io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
        if io is None or getattr(io.save_checkpoint, "__torchtrace_kind__", None):
            return
        handing_over = (_ASYNC_IO is not None and isinstance(io, _ASYNC_IO)
                        and getattr(io, "checkpoint_io", None) is not None)
        save = _timed_handover(io) if handing_over else _timed(io.save_checkpoint, "save")
        replace_attribute(io, "save_checkpoint", save)
        replace_attribute(io, "load_checkpoint", _timed(io.load_checkpoint, "load"))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        put_back_attribute(pl_module, "clip_gradients")
        io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
        for plugin in (io, getattr(io, "checkpoint_io", None)):  # (an AsyncCheckpointIO's writer too)
            if plugin is not None:
                put_back_attribute(plugin, "save_checkpoint")
                put_back_attribute(plugin, "load_checkpoint")

    # ------------------------------------------------------------ training
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        # The module joins the scope in on_before_optimizer_step: a batch that only
        # accumulates gradients gets no gradient statistics of partial sums. The batch gives
        # the step's samples and tokens; the optimizer, its learning rates.
        # The step number is Lightning's batch count over the run (restored when resuming from a checkpoint).
        step = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "total_batch_idx", None)
        self._train.begin(None, batch, step=step, replay=training_step_replay(trainer, pl_module, batch, batch_idx))
        scope = self._train.scope
        if scope is not None and not getattr(pl_module, "automatic_optimization", True):
            scope.before_clip = functools.partial(_join_at_clip, self._train, pl_module)
        _read_as_consumed(self._train, pl_module, batch)
        # The phases come from Lightning's hooks: forward to on_before_backward, backward to
        # on_before_optimizer_step, optimizer to the batch's end (its update, zero_grad, scheduler).
        self._train.mark("forward_start", cuda=getattr(pl_module.device, "type", None) == "cuda")

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._train.mark("forward_end")

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self._train.mark("optimizer_start")
        self._train.measure(pl_module, optimizer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule,
                           outputs: STEP_OUTPUT, batch: object, batch_idx: int) -> None:
        self._train.mark("optimizer_end")
        self._train.end(None, extract_loss(outputs))

    # ------------------------------------------------------------ validation
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The loop's own span (kind evaluation) around its batches' steps: in goodput, its
        # loading between them and its end (metrics, logging) are evaluation, not data wait.
        if self._loop is not None and not trainer.sanity_checking:
            self._loop.begin(None)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._loop is not None:
            self._loop.end(None)

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if self._val is not None and not trainer.sanity_checking:
            self._val.begin(None, batch)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule,
                                outputs: STEP_OUTPUT, batch: object, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if self._val is not None:
            loss = extract_loss(outputs)  # a tuple (predictions, labels) is no loss, and left unsaid
            self._val.end(None, None if isinstance(loss, (tuple, list)) else loss)

    # ------------------------------------------------------------ failures
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # The checkpoint is written next, outside any step: the hang watchdog's allowance.
        progress.between("checkpoint")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._train.abort(exception)
        if self._val is not None:
            self._val.abort(exception)
        if self._loop is not None:
            self._loop.abort(exception)


def _read_as_consumed(driver: StepDriver, module: torch.nn.Module, batch: object) -> None:
    """The batch's samples and tokens as the module consumes it (token ids fed to an
    embedding, a time-major layout: :mod:`torchtrace.measure.batch_layout`). The module joins
    the step's scope only at its update, so a batch that only accumulates gradients would be
    read without it: its reading is given to the step instead (``record_batch``; one the
    user's ``training_step`` gives later wins)."""
    scope = driver.scope
    if scope is None or not scope.active or scope.features is None or not scope.features.throughput:
        return
    try:
        layout = sequence_layout(module)
        if not (layout.embeds or layout.time_major):
            return
        read = infer_batch((batch,), {}, model=module)
        if not read.pending and read.samples is not None:
            scope.record_batch(samples=read.samples, tokens=read.tokens)
    except Exception as exc:  # a batch or module that cannot be read: what the step infers stands
        rt = api.get_runtime()
        if rt is not None:
            rt.errors.report("other", exc)


def _measured_clip(driver: StepDriver, pl_module: LightningModule) -> Callable[..., None]:
    """``pl_module.clip_gradients`` that measures (and guards) the gradients of the optimizer it
    is given before they are clipped. Under manual optimization the module's ``training_step``
    clips before ``optimizer.step()``, and so before ``on_before_optimizer_step``: measured
    there, the step's norm was the clipped one (``gradient_clip_val`` on every step, so no
    explosion could be seen). Gradients a loss scaler has not unscaled yet are left to
    ``on_before_optimizer_step`` (:func:`_still_scaled`)."""
    original = pl_module.clip_gradients

    # Any: clip_gradients' own arguments (the clip value and algorithm), passed through.
    def clip_gradients(optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if not _still_scaled(pl_module):
            driver.measure(pl_module, optimizer)
        original(optimizer, *args, **kwargs)

    return clip_gradients


def _join_at_clip(driver: StepDriver, pl_module: LightningModule, parameters: list[torch.Tensor]) -> None:
    """Manual optimization, torch's own clip (``torch.nn.utils.clip_grad_norm_``) called in
    ``training_step``: the module joins the step, and the gradients of the optimizer that
    updates the clipped parameters (the module's, where none does) are measured and guarded
    before the clip, as :func:`_measured_clip` does for the module's ``clip_gradients``.
    Gradients a loss scaler has not unscaled yet are left to ``on_before_optimizer_step``."""
    if _still_scaled(pl_module):
        return
    clipped = {id(p) for p in parameters}
    optimizers = getattr(getattr(pl_module, "trainer", None), "optimizers", None) or []
    updating = next((opt for opt in optimizers
                     if any(id(p) in clipped for group in opt.param_groups for p in group["params"])), None)
    driver.measure(pl_module, updating)


def _still_scaled(pl_module: LightningModule) -> bool:
    """Whether the trainer's loss scaler (``16-mixed``) has not unscaled the gradients yet, as
    in a manual-optimization ``training_step`` before ``optimizer.step()``: Lightning unscales
    them inside the step, before ``on_before_optimizer_step``, which then measures them."""
    try:
        scaler = getattr(pl_module.trainer.precision_plugin, "scaler", None)
    except Exception:  # no trainer attached
        return False
    return scaler_enabled(scaler) and not unscaled_by(scaler)


def _timed_handover(io: Any) -> Callable[..., None]:
    """``save_checkpoint`` of an ``AsyncCheckpointIO``, which hands the checkpoint to its one
    thread and returns: timed as a save that counts once written (``TimedCall.upload``).

    The thread runs the writes in the order of the calls, through the plugin ``io`` wraps: each
    call queues a future, and that plugin's ``save_checkpoint``, wrapped too, completes the
    oldest as its write on that thread ends. (A call that raises before handing over, which
    Lightning does only once a write has failed and the fit is ending, would leave its future
    to the next write.)
    """
    written: collections.deque[Future[None]] = collections.deque()
    writer = io.checkpoint_io
    write = writer.save_checkpoint
    hand_over = io.save_checkpoint

    def writing(*args: object, **kwargs: object) -> None:
        # (a write on the training thread is a direct call, not one handed over)
        done = written.popleft() if written and not progress.on_training_thread() else None
        try:
            write(*args, **kwargs)
        except BaseException as exc:
            if done is not None:
                done.set_exception(exc)
            raise
        if done is not None:
            done.set_result(None)

    def timed(*args: object, **kwargs: object) -> None:
        done: Future[None] = Future()
        written.append(done)
        with checkpoint("save") as call:
            call.upload = done
            hand_over(*args, **kwargs)

    writing.__torchtrace_kind__ = "write"  # type: ignore[attr-defined]
    replace_attribute(writer, "save_checkpoint", writing)
    timed.__torchtrace_kind__ = "save"  # type: ignore[attr-defined]
    return timed


def _timed(method: Callable[..., _R], kind: str) -> Callable[..., _R]:
    """``method`` timed as a checkpoint ``kind`` (``tt.checkpoint``: a torch.save inside counts once)."""

    # Any: the arguments of the checkpoint IO's method, passed through as they are.
    def timed(*args: object, **kwargs: object) -> _R:
        with checkpoint(kind):
            return method(*args, **kwargs)

    timed.__torchtrace_kind__ = kind  # type: ignore[attr-defined]
    return timed
