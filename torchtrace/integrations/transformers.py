"""Hugging Face ``transformers.Trainer``: one line gives every optimizer step a torchtrace step.

>>> from torchtrace.integrations.transformers import TorchtraceCallback   # doctest: +SKIP
>>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[TorchtraceCallback()])  # doctest: +SKIP

Needs ``pip install "torchtrace[transformers]"``.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

import torch

from torchtrace import api
from torchtrace.forensics.isolation import autocast_as, autocast_state
from torchtrace.integrations._common import StepDriver, loop_frame, put_back_attribute, replace_attribute, require
from torchtrace.integrations._trainer_checkpoints import TrainerCheckpoints
from torchtrace.job import progress
from torchtrace.measure.batch import same_arguments
from torchtrace.step import job

if TYPE_CHECKING:
    from transformers import TrainingArguments

_tf = require("transformers", "transformers", "Hugging Face transformers")
if not hasattr(_tf.TrainerCallback, "on_pre_optimizer_step"):  # added in transformers 4.42
    raise ImportError(f"torchtrace.integrations.transformers needs transformers>=4.42 (found {_tf.__version__}): "
                      "pip install -U \"torchtrace[transformers]\"")

# Any: the base class comes from the optional package, imported at run time, without types.
_TrainerCallback: Any = _tf.TrainerCallback

__all__ = ["TorchtraceCallback"]


def _calling_trainer() -> Any:
    """The ``transformers.Trainer`` whose training loop called the hook that calls this (the
    ``self`` of the nearest such frame), or None. Callbacks are not handed the Trainer."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, _tf.Trainer):
            return owner
        frame = frame.f_back
    return None


def _output_loss(output: object) -> object:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    return loss


class TorchtraceCallback(_TrainerCallback):
    """A torchtrace step span per Trainer optimizer step (all its gradient-accumulation micro-batches).

    Hooks used:

    - ``on_step_begin`` opens the step (span ``train_step``); ``on_step_end`` closes it.
    - ``on_pre_optimizer_step`` measures the gradients the optimizer is about to use (the
      Trainer has already unscaled them) and applies the guard policy, unless torchtrace
      already did so at the Trainer's ``clip_grad_norm_`` call, before clipping: ``skip`` clears
      the gradients so ``optimizer.step()``
      leaves every parameter unchanged; ``raise`` ends the span and raises
      :class:`torchtrace.NonFiniteError` out of ``trainer.train()``.
    - The loss: the Trainer does not hand it to callbacks, so a forward hook on the model
      (registered in ``on_train_begin``, removed in ``on_train_end``) keeps the model
      output's ``loss`` while a step is open, as a device tensor (no host read); the
      micro-batch losses are averaged, or summed when the Trainer passes the model
      ``num_items_in_batch`` and the model's loss function takes it (it then divides each
      by the whole step's tokens: a causal or masked LM's loss under gradient accumulation,
      which the Trainer logs as that sum). When the Trainer computes the loss itself
      (``label_smoothing_factor``, ``compute_loss_func``: the model is not given the labels),
      the loss is what the Trainer's ``training_step`` returns for each micro-batch, summed
      (what it logs): its ``training_step`` is wrapped on the Trainer during ``train()``. A
      custom ``compute_loss`` whose loss is not the model output's can call
      ``torchtrace.current_step().record_loss(loss)`` instead.
    - Evaluation and checkpoints between steps: ``on_evaluate`` and ``on_save`` come when the
      Trainer's evaluation loop or checkpoint save has ended; the time since the step before
      (or since the one before it ended, or since training began: ``eval_on_start``) is
      evaluation or checkpoint badput in goodput, not data wait or startup.
    - Checkpoints: each Trainer checkpoint (model, optimizer, scheduler, random states,
      arguments) is one save in ``torchtrace_checkpoint_seconds``, timed from its start to its
      end, and a resume (``resume_from_checkpoint``) one load; the black box's last checkpoint
      holds the last step finished. The Trainer's ``_save_checkpoint`` and ``_load_*`` methods
      are wrapped on the Trainer instance from its ``__init__`` (``on_init_end``; or from
      ``on_train_begin`` for a callback added later, whose resume's model load is then timed
      on its own) until training ends (see :mod:`torchtrace.integrations._trainer_checkpoints`):
      they are private API, and where this transformers lacks them each file is timed on its
      own, as any ``torch.save``.
    - FLOPs: the Trainer's own estimate (what it adds to ``total_flos``), six times the
      main input's elements times the parameters outside the embeddings, summed over the
      micro-batches: the step's batch is not known when it starts, so torchtrace's own
      FLOP count cannot run. MFU's peak is taken at the Trainer's precision (``bf16`` or
      ``fp16`` mixed precision, else the weights' dtype). A model whose main input is not
      token ids (pixels, audio) gets no estimate: the formula would count every pixel as a
      token.

    Args:
        name: the span's name (the ``operation`` label).
        max_grad_norm: clip gradients to this global norm *after* torchtrace measured
            them, on the device, with no host read (with ``TrainingArguments(max_grad_norm=0)``;
            the Trainer's own clipping is measured before clipping too). ``None`` (default)
            clips nothing.
    """

    def __init__(self, name: str = "train_step", max_grad_norm: float | None = None) -> None:
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
        self._driver = StepDriver(name)
        self._max_grad_norm = max_grad_norm
        self._handle = None
        self._params: int | None = None
        self._parts: bool | None = None  # the model's loss is divided by the step's items (see _divides_by_items)
        self._inputs: list[tuple[tuple, dict]] = []  # the calls whose micro-batches the open step counted
        # The autocasts the step's first forward ran under: the replay runs under them too.
        self._autocast: tuple[tuple[str, torch.dtype], ...] = ()
        self._boundary: float | None = None  # perf_counter() when the last step (or evaluation, save) ended
        # The Trainer whose training_step gives the loss (it computes it outside the model).
        self._loss_trainer: Any = None
        self._checkpoints = TrainerCheckpoints()

    def on_init_end(self, args, state, control, **kwargs):
        # A resume loads the model in train() before on_train_begin: the Trainer is taken now.
        self._checkpoints.take(_calling_trainer())

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._params = None  # parameters outside the embeddings, counted at the first forward
        self._parts = None
        self._boundary = time.perf_counter()  # (an evaluation before the first step, eval_on_start, is evaluation)
        self._note_precision(args)
        rt = api.get_runtime()
        if rt is not None:
            # on_save books the whole save since the step before; the torch.save inside it
            # (the optimizer's) must not book its own slice first (see step/job.py).
            job.framework_books_checkpoints(rt, True)
        if model is not None and self._handle is None:
            self._handle = model.register_forward_hook(self._on_forward, with_kwargs=True)
        trainer = _calling_trainer()
        self._checkpoints.take(trainer)
        self._take_trainers_loss(trainer)

    def on_train_end(self, args, state, control, **kwargs):
        self._boundary = None
        rt = api.get_runtime()
        if rt is not None:
            job.framework_books_checkpoints(rt, False)
        self._inputs = []
        self._driver.abort(None)
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._give_back_training_step()
        self._checkpoints.give_back()

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._checkpoints.resumed()  # (the resume's loads all come before its first step)
        self._inputs = []
        self._driver.begin(model, loop=loop_frame("transformers.trainer_callback"), step=state.global_step,
                           replay=self._replayer(model))

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        self._driver.mark("optimizer_start")  # the forward marks are the model's own
        self._driver.measure(model, inner)
        if self._max_grad_norm is not None and model is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                           self._max_grad_norm, foreach=True)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._driver.mark("optimizer_end")

    def on_step_end(self, args, state, control, **kwargs):
        self._inputs = []
        self._driver.end(None)
        self._boundary = time.perf_counter()
        # The Trainer evaluates or saves now, before its next step: the hang watchdog's allowance.
        if getattr(control, "should_evaluate", False) or getattr(control, "should_save", False):
            progress.between("evaluation" if getattr(control, "should_evaluate", False) else "checkpoint")

    def on_prediction_step(self, args, state, control, **kwargs):
        progress.mark("forward")  # (inside an evaluation: progress only, the phase stays)

    def on_evaluate(self, args, state, control, **kwargs):
        self._book_since_boundary("evaluation", "evaluate")
        if getattr(control, "should_save", False):
            progress.between("checkpoint")

    def on_save(self, args, state, control, **kwargs):
        self._book_since_boundary("checkpoint", "save_checkpoint")
        # The black box's last checkpoint, where no timed save set it (this Trainer has no
        # _save_checkpoint to time): the last step finished, the Trainer's count of steps less
        # one, as a timed save's.
        rt = api.get_runtime()
        if rt is not None and not self._checkpoints.times_saves:
            job.checkpoint_saved(rt, state.global_step - 1)

    def _take_trainers_loss(self, trainer: Any) -> None:
        """When the Trainer computes the loss outside the model (``label_smoothing_factor``, a
        ``compute_loss_func``), it takes the labels away from the model, whose output then has
        no loss: the step's loss is what the Trainer's ``training_step`` returns for each
        micro-batch (the loss it backpropagates, divided by the accumulation steps where it
        divides them), summed, which is what the Trainer logs. Its ``training_step`` is wrapped
        on the instance until training ends; the wrapper only keeps the returned tensor."""
        if trainer is None or self._loss_trainer is not None:
            return
        if getattr(trainer, "label_smoother", None) is None and getattr(trainer, "compute_loss_func", None) is None:
            return
        step = trainer.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            loss = step(*args, **kwargs)
            self._add_trainers_loss(loss)
            return loss

        replace_attribute(trainer, "training_step", training_step)
        self._loss_trainer = trainer

    def _give_back_training_step(self) -> None:
        """Undo :meth:`_take_trainers_loss`: the Trainer's ``training_step`` is its own again."""
        trainer, self._loss_trainer = self._loss_trainer, None
        if trainer is not None:
            put_back_attribute(trainer, "training_step")

    def _add_trainers_loss(self, loss: object) -> None:
        """A micro-batch's loss as the Trainer's ``training_step`` returned it: a part of the
        step's (the parts are summed)."""
        try:
            self._driver.add_loss(loss, part=True)
        except Exception as exc:  # torchtrace's own failure never reaches the Trainer
            rt = api.get_runtime()
            if rt is not None:
                rt.errors.report("other", exc)

    @staticmethod
    def _note_precision(args: TrainingArguments) -> None:
        """The Trainer's mixed precision (``bf16=True``, ``fp16=True``) is the precision of the
        peak MFU is measured against: its autocast is closed again when the step ends, and the
        FLOPs are the Trainer's estimate, so no count sees the operands' dtype."""
        rt = api.get_runtime()
        if rt is None:
            return
        dtype = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) \
            else None
        rt.throughput.framework_dtype = dtype

    def _book_since_boundary(self, kind: str, operation: str) -> None:
        """The time since the last step (or evaluation, save) ended was this operation's.
        Outside training (``trainer.evaluate()`` on its own) nothing is booked."""
        start, now = self._boundary, time.perf_counter()
        if start is None:
            return
        self._boundary = now
        rt = api.get_runtime()
        if rt is None or rt.off or not rt.settings.throughput:
            return
        try:
            rt.throughput.book(start, now, kind, operation)
        except Exception as exc:  # torchtrace's own failure never reaches the Trainer
            rt.errors.report("other", exc)

    def _replayer(self, model: torch.nn.Module | None) -> Callable[[], Any] | None:
        """What forensics replays for a Trainer step: the model on each of the step's
        micro-batches again (the inputs the Trainer gave it, kept by the forward hook); the
        replay's loss is their sum (the model computes it from ``labels``)."""
        if model is None:
            return None

        def replay() -> Any:
            with autocast_as(self._autocast):  # the Trainer's bf16=/fp16= autocast, as the step ran
                outputs = [_output_loss(model(*args, **kwargs)) for args, kwargs in list(self._inputs)]
            losses = [loss for loss in outputs if isinstance(loss, torch.Tensor)]
            return sum(losses[1:], losses[0]) if losses else None

        return replay

    def _on_forward(self, module, args, kwargs, output) -> None:
        rt = api.get_runtime()
        if rt is not None and rt.replaying:  # a forensic replay's forward is not the step's
            return
        if self._driver.active and module.training:
            if self._loss_trainer is None:  # (else the Trainer's training_step gives the loss)
                self._driver.add_loss(_output_loss(output), part=kwargs.get("num_items_in_batch") is not None
                                      and self._divides_by_items(module))
            if any(same_arguments(call, args, kwargs) for call in self._inputs):
                return  # the same micro-batch again (a compute_loss that runs the model twice: R-Drop)
            if self._inputs:
                self._driver.next_micro_batch()  # what a custom compute_loss gave for the one before
            else:
                self._autocast = autocast_state()
            self._inputs.append((args, kwargs))  # (held until the step ends: the Trainer holds them as long)
            self._driver.add_batch(args, kwargs)  # samples and non-padding tokens of the micro-batch
            self._driver.add_flops(self._flops_of(module, kwargs))

    def _divides_by_items(self, model: torch.nn.Module) -> bool:
        """True when the model's loss function takes ``num_items_in_batch`` (a causal or masked
        LM's): given it, each micro-batch's loss is a part of the step's, divided by the whole
        step's tokens, and the step's loss is their sum. A model whose loss ignores it (a
        sequence classifier's mean) gives a loss per micro-batch: they are averaged."""
        if self._parts is None:
            try:
                function = getattr(model, "loss_function", None)
                self._parts = function is not None and "num_items_in_batch" in inspect.signature(function).parameters
            except Exception:  # (no signature to read: averaged, as before)
                self._parts = False
        return self._parts

    def _flops_of(self, model: torch.nn.Module, kwargs: Mapping[str, Any]) -> int | None:
        """The Trainer's estimate of a micro-batch's FLOPs (``Trainer.floating_point_ops``):
        6 x the main input's elements x the parameters outside the embeddings (counted once).

        Only for token ids: the formula takes each element of the main input for a token, so
        for pixels or audio samples (a floating-point main input) it is off by orders of
        magnitude (a small ViT: 214 times FlopCounterMode's count), and such steps get none."""
        ids = kwargs.get(getattr(model, "main_input_name", "input_ids"))
        # A transformers PreTrainedModel's method; any other model gets no estimate.
        num_parameters = getattr(model, "num_parameters", None)
        if not isinstance(ids, torch.Tensor) or not callable(num_parameters):
            return None
        if ids.is_floating_point() or ids.is_complex():
            return None
        if self._params is None:
            self._params = int(num_parameters(exclude_embeddings=True))
        return 6 * ids.numel() * self._params
