"""Seed 001's ``AsyncTrainingLogger``: training logs written by a background thread, and the
``*_async`` tensor, gradient and progress checks.

A log call builds the record on the caller's thread and puts it on a bounded queue through
the standard library's :class:`logging.handlers.QueueHandler`; a
:class:`logging.handlers.QueueListener` thread (``torchtrace-training-logger``) hands
records to the logger's handlers, so a slow handler (a network log shipper) never holds up
training. A full queue drops the record and counts it (``dropped``). :meth:`flush` waits for
the queue with a deadline; :meth:`close` stops the thread.

>>> import asyncio, torch
>>> log = AsyncTrainingLogger(user_id=1, model_name="tiny")
>>> info = asyncio.run(log.check_tensor_anomalies_async(torch.tensor([1.0, float("nan")]), "loss"))
>>> info["has_nan"]
True
>>> log.close()
"""

from __future__ import annotations

import asyncio
import enum
import logging
import logging.handlers
import math
import queue
import threading
import time
from typing import Any, Union

import torch

from torchtrace import semconv
from torchtrace.compat import checks, steps
from torchtrace.compat.results import Result
from torchtrace.config import DEFAULT_GRAD_EXPLOSION_THRESHOLD, DEFAULT_GRAD_VANISHING_THRESHOLD
from torchtrace.errors import GuardedLogger, get_logger

logger = logging.getLogger(__name__)

WRITER_THREAD = "torchtrace-training-logger"


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """A :class:`~logging.handlers.QueueHandler` for a bounded queue: a full queue drops the
    record and counts it (``dropped``) instead of reporting an error, and records go on the
    queue as they are (the logger's own handlers format them, tracebacks included)."""

    def __init__(self, records: queue.Queue) -> None:
        super().__init__(records)
        self.dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # Each record is built for this queue alone: nothing to copy or pre-format.
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


class ToLogger(logging.Handler):
    """The listener's one handler: every record goes through ``target``'s handlers (its
    filters, levels and propagation), on the listener's thread, named ``WRITER_THREAD``."""

    def __init__(self, target: logging.Logger | GuardedLogger) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        thread = threading.current_thread()
        if thread.name != WRITER_THREAD:
            thread.name = WRITER_THREAD
        try:
            self.target.handle(record)
        except Exception:  # a failing handler must not kill the writer thread
            pass


class TrainingPhase(str, enum.Enum):
    """Where in training a log line comes from."""

    INITIALIZATION = "initialization"
    DATA_LOADING = "data_loading"
    TRAINING = "training"
    VALIDATION = "validation"
    EVALUATION = "evaluation"
    CHECKPOINTING = "checkpointing"
    INFERENCE = "inference"
    COMPLETED = "completed"


# A log line's phase: a TrainingPhase, its value, or none.
Phase = Union[TrainingPhase, str, None]


def _kind_for(name: str) -> str:
    low = name.lower()
    if "loss" in low:
        return semconv.NONFINITE_LOSS
    if "input" in low:
        return semconv.NONFINITE_INPUT
    return semconv.NONFINITE_OUTPUT


class AsyncTrainingLogger:
    """Training logs through a background thread, and NaN/Inf checks that feed the telemetry.

    Args:
        user_id, model_name: written with every record (``record.user_id``, ``record.model_name``).
        enable_autograd_debug: :meth:`start_training` turns autograd anomaly detection on for
            the process until :meth:`end_training` or :meth:`close` restores the previous state.
        logger: where records go (default ``logging.getLogger("torchtrace.training")``).
        queue_size: records waiting at most; more are dropped and counted.

    Raises:
        ValueError: a bad ``queue_size`` or ``enable_autograd_debug``.
        TypeError: ``logger`` is not a ``logging.Logger``.
    """

    def __init__(self, user_id: object = None, model_name: str | None = None, *, enable_autograd_debug: bool = False,
                 logger: logging.Logger | None = None, queue_size: int = 10000) -> None:
        if not isinstance(enable_autograd_debug, bool):
            raise ValueError(f"enable_autograd_debug={enable_autograd_debug!r} is not valid; "
                             "accepted values: True, False")
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size <= 0:
            raise ValueError(f"queue_size={queue_size!r} is not valid; accepted values: a positive integer")
        if logger is not None and not isinstance(logger, logging.Logger):
            raise TypeError(f"logger= must be a logging.Logger (its handlers get the records; for a LoggerAdapter "
                            f"pass its .logger), got {type(logger).__name__}")
        self.user_id = user_id
        self.model_name = model_name
        self.enable_autograd_debug = enable_autograd_debug
        self.logger = logger if logger is not None else get_logger("torchtrace.training")
        self.progress: dict[str, Any] = {"epoch": None, "step": None, "loss": None, "learning_rate": None}
        self.training: dict[str, Any] = {"active": False}
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._handler = DroppingQueueHandler(self._queue)
        self._lock = threading.Lock()
        self._listener: logging.handlers.QueueListener | None = None
        self._anomaly_prev: tuple[bool, bool] | None = None
        self._closed = False

    @property
    def dropped(self) -> int:
        """Records dropped because the queue was full."""
        return self._handler.dropped

    # ------------------------------------------------------------ the background writer
    def _start(self) -> None:
        with self._lock:
            if self._listener is None and not self._closed:
                self._listener = logging.handlers.QueueListener(self._queue, ToLogger(self.logger))
                self._listener.start()

    def _emit(self, level: int, message: str, phase: Phase = None, context: dict[str, Any] | None = None,
              exc: BaseException | None = None) -> None:
        if self._closed or not self.logger.isEnabledFor(level):
            return
        phase_value = phase.value if isinstance(phase, enum.Enum) else phase
        extra = {"user_id": self.user_id, "model_name": self.model_name, "phase": phase_value, "context": context}
        text = f"[{phase_value}] {message}" if phase_value else message
        exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
        record = self.logger.makeRecord(self.logger.name, level, "(training)", 0, "%s", (text,), exc_info,
                                        extra=extra)
        self._start()
        self._handler.handle(record)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued record was handled, at most ``timeout`` seconds. True when done."""
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Restore autograd anomaly detection, write what is queued (within ``timeout``), stop the
        thread. Handlers still busy after ``timeout`` keep the (daemon) thread until they finish:
        closing never waits longer."""
        self.end_training()
        drained = self.flush(timeout)
        with self._lock:
            self._closed = True
            listener, self._listener = self._listener, None
        if listener is None:
            return
        if drained:
            listener.stop()
        else:
            logger.warning("AsyncTrainingLogger.close: handlers still busy after %.1f s; the writer thread "
                            "finishes the queue on its own", timeout)

    def __enter__(self) -> "AsyncTrainingLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> "AsyncTrainingLogger":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    # ------------------------------------------------------------ seed-style logging
    def log_info(self, message: str, phase: Phase = None, context: dict[str, Any] | None = None) -> None:
        self._emit(logging.INFO, str(message), phase, context)

    def log_warning(self, message: str, phase: Phase = None, context: dict[str, Any] | None = None) -> None:
        self._emit(logging.WARNING, str(message), phase, context)

    def log_error(self, error: BaseException | str, phase: Phase = None, context: dict[str, Any] | None = None) -> None:
        """An exception (with its traceback) or a message, at ERROR."""
        if isinstance(error, BaseException):
            self._emit(logging.ERROR, f"{type(error).__name__}: {error}", phase, context, exc=error)
        else:
            self._emit(logging.ERROR, str(error), phase, context)

    def log_debug(self, message: str, phase: Phase = None, context: dict[str, Any] | None = None) -> None:
        self._emit(logging.DEBUG, str(message), phase, context)

    # ------------------------------------------------------------ training lifecycle
    def start_training(self, total_epochs: int | None = None, total_steps: int | None = None) -> None:
        """Note the plan; with ``enable_autograd_debug`` turn autograd anomaly detection on."""
        self.training = {"active": True, "total_epochs": total_epochs, "total_steps": total_steps,
                         "started_unix": time.time()}
        if self.enable_autograd_debug and self._anomaly_prev is None:
            self._anomaly_prev = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
            torch.set_anomaly_enabled(True, True)
        self.log_info(f"training started: {total_epochs} epochs, {total_steps} steps"
                      + (" (autograd anomaly detection on)" if self._anomaly_prev is not None else ""),
                      TrainingPhase.INITIALIZATION)

    def end_training(self) -> None:
        """Restore autograd anomaly detection as it was before :meth:`start_training`."""
        if self._anomaly_prev is not None:
            torch.set_anomaly_enabled(*self._anomaly_prev)
            self._anomaly_prev = None
        if self.training.get("active"):
            self.training["active"] = False
            self.log_info("training finished", TrainingPhase.COMPLETED)

    # ------------------------------------------------------------ checks (sync and async)
    def check_tensor_anomalies(self, tensor: torch.Tensor, name: str = "tensor") -> Result:
        """NaN/Inf counts and statistics of ``tensor`` (``has_nan``, ``has_inf``, ``mean``...).

        A NaN/Inf counts as an anomaly of kind ``nonfinite_loss`` (a name with "loss"),
        ``nonfinite_input`` (with "input") or ``nonfinite_output``; a loss checked inside an open
        torchtrace step is handed to the step, which counts it.
        """
        info = checks.analyze_tensor(tensor, name)
        if info["has_nan"] or info["has_inf"]:
            kind = _kind_for(name)
            in_step = steps.share_with_step(loss=tensor) if kind == semconv.NONFINITE_LOSS else False
            steps.report([kind], "check_tensor_anomalies", in_step=in_step, data={"name": name})
            self.log_warning(f"{name} holds {info['nan_count']} NaN and {info['inf_count']} Inf value(s)",
                             TrainingPhase.TRAINING)
        return info

    def check_gradient_anomalies(self, model: torch.nn.Module) -> Result:
        """``params_with_nan_grad``, ``params_with_inf_grad``, ``params_with_grad``, ``global_norm``,
        ``nonfinite_params``, ``exploded_params``, ``vanished_params`` (one default per threshold)."""
        report = checks.gradient_report(model, DEFAULT_GRAD_EXPLOSION_THRESHOLD, DEFAULT_GRAD_VANISHING_THRESHOLD)
        in_step = steps.share_with_step(model=model)
        kinds = [a["kind"] for a in report["anomalies"]]
        steps.report(kinds, "check_gradient_anomalies", grad_norm=report["global_norm"], in_step=in_step)
        for sentence in report["gradient_anomalies"]:
            self.log_warning(sentence, TrainingPhase.TRAINING)
        return Result({k: report[k] for k in ("params_with_nan_grad", "params_with_inf_grad", "params_with_grad",
                                              "global_norm", "nonfinite_params", "exploded_params",
                                              "vanished_params", "gradient_anomalies", "anomalies")})

    def update_progress(self, epoch: int | None = None, step: int | None = None,
                        loss: float | torch.Tensor | None = None,
                        learning_rate: float | None = None, **metrics: object) -> Result:
        """Log progress (INFO, through the queue); a NaN/Inf loss counts as ``nonfinite_loss``."""
        value = steps.loss_value(loss) if loss is not None else None
        self.progress = {"epoch": epoch, "step": step, "loss": value, "learning_rate": learning_rate, **metrics}
        if steps.nonfinite(value):
            steps.report([semconv.NONFINITE_LOSS], "update_progress", step=step,
                         in_step=steps.share_with_step(loss=value))
        parts = [f"epoch {epoch}", f"step {step}"]
        if value is not None:
            parts.append(f"loss {value:.6g}" if math.isfinite(value) else f"loss {value}")
        if learning_rate is not None:
            parts.append(f"lr {_shown_rate(learning_rate)}")
        parts += [f"{k} {v}" for k, v in metrics.items()]
        self.log_info(", ".join(parts), TrainingPhase.TRAINING, dict(self.progress))
        return Result(self.progress)

    async def check_tensor_anomalies_async(self, tensor: torch.Tensor, name: str = "tensor") -> Result:
        """:meth:`check_tensor_anomalies` on a worker thread (the event loop keeps running)."""
        return await asyncio.to_thread(self.check_tensor_anomalies, tensor, name)

    async def check_gradient_anomalies_async(self, model: torch.nn.Module) -> Result:
        """:meth:`check_gradient_anomalies` on a worker thread."""
        return await asyncio.to_thread(self.check_gradient_anomalies, model)

    async def update_progress_async(self, epoch: int | None = None, step: int | None = None,
                                    loss: float | torch.Tensor | None = None,
                                    learning_rate: float | None = None, **metrics: object) -> Result:
        """:meth:`update_progress` (it only queues a record: nothing to wait for)."""
        return self.update_progress(epoch, step, loss, learning_rate, **metrics)


# Any: whatever the user's optimizer holds as its learning rate.
def _shown_rate(rate: Any) -> str:
    """A learning rate as the log shows it: its value when it has one (a float, a one-element
    tensor as ``Adam(lr=torch.tensor([1e-3]))`` holds, a numeric string), else as it prints.
    Never raises: it runs inside the user's training loop."""
    try:
        return f"{float(rate):.6g}"
    except Exception:
        try:
            return str(rate)
        except Exception:
            return f"<{type(rate).__name__}>"


__all__ = ["AsyncTrainingLogger", "TrainingPhase"]
