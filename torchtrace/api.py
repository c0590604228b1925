"""configure / shutdown / debug_context / debug_operation: the names users type.

One :class:`StepScope` per operation call serves ``with``, ``async with`` and the
decorators. The scope's hot path launches device work only; the record is read to the host
once, at the end of the step (or in the optimizer pre-hook when a guard policy must decide
before the update).
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import inspect
import logging
import math
import threading
import time
from typing import Any, Callable, TypeVar, overload

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace

from torchtrace import current, semconv
from torchtrace.distributed import in_dataloader_worker
from torchtrace.export.trace_ids import step_trace
from torchtrace.config import Settings, disabled_by_environment
from torchtrace.errors import NonFiniteError
from torchtrace.levels import DebugLevel, DebugMode, Features
from torchtrace.measure import gradients as grad_measure
from torchtrace.measure import memory as mem_measure
from torchtrace.measure.loss import extract_loss
from torchtrace.record import readout
from torchtrace.record.policy import agree_any
from torchtrace.record.step import StepRecord

logger = logging.getLogger("torchtrace")
F = TypeVar("F", bound=Callable[..., Any])

_atexit_registered = False


class ConfigureResult:
    """What ``configure()`` set up: where metrics are served, where files are written."""

    def __init__(self, runtime) -> None:
        self._runtime = runtime

    @property
    def enabled(self) -> bool:
        return self._runtime is not None

    @property
    def run_id(self) -> str | None:
        return self._runtime.settings.run_id if self._runtime else None

    @property
    def metrics_url(self) -> str | None:
        return self._runtime.metrics_url if self._runtime else None

    @property
    def prometheus_port(self) -> int | None:
        rt = self._runtime
        return rt.server.port if rt and rt.server else None

    @property
    def run_dir(self):
        return self._runtime.run_path if self._runtime else None

    @property
    def spans_path(self):
        return self._runtime.spans_path if self._runtime else None

    @property
    def report_path(self):
        return self._runtime.report_path if self._runtime else None

    @property
    def settings(self) -> Settings | None:
        return self._runtime.settings if self._runtime else None

    def __repr__(self) -> str:
        if not self.enabled:
            return "ConfigureResult(disabled)"
        return f"ConfigureResult(run_id={self.run_id!r}, metrics_url={self.metrics_url!r}, run_dir={str(self.run_dir)!r})"


def configure(
    service_name: str | None = None,
    *,
    run_id: str | None = None,
    level: DebugLevel | str | None = None,
    mode: DebugMode | str | None = None,
    prometheus_host: str | None = None,
    prometheus_port: int | str | None = None,
    run_dir: str | None = None,
    otlp_endpoint: str | None = None,
    otlp_protocol: str | None = None,
    disabled: bool | None = None,
    **settings: Any,
) -> ConfigureResult:
    """Set torchtrace up (or set it up again). Every argument is optional.

    Arguments beat ``TORCHTRACE_*``/``OTEL_*`` environment variables, which beat defaults.
    Calling it again shuts the previous set-up down first. Without any call, the first
    instrumented step configures torchtrace from the environment.

    Raises:
        ValueError: an invalid argument, naming the setting and the accepted values.

    >>> import torchtrace as tt
    >>> result = tt.configure(level="basic", prometheus_port="off", write_files=False)
    >>> result.enabled
    True
    >>> tt.shutdown()
    """
    global _atexit_registered
    args = dict(service_name=service_name, run_id=run_id, level=level, mode=mode, prometheus_host=prometheus_host,
                prometheus_port=prometheus_port, run_dir=run_dir, otlp_endpoint=otlp_endpoint,
                otlp_protocol=otlp_protocol, disabled=disabled, **settings)
    resolved = Settings.resolve(args)  # raises before anything is torn down
    with current.lock:
        shutdown()
        if resolved.disabled:
            current.set_disabled(True)
            return ConfigureResult(None)
        from torchtrace.step.runtime import Runtime

        rt = Runtime(resolved)
        current.set_runtime(rt)
        _install_clip_interception()
        if resolved.register_atexit and not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True
        return ConfigureResult(rt)


def _install_clip_interception() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` measure the current step's
    gradients first (once per step), so the recorded norm is the one *before* clipping, as the
    telemetry contract says; without it the optimizer pre-hook would see clipped gradients and
    an explosion would read as ``max_norm``. Idempotent (run at import and at configure);
    outside a step the wrapper only reads a context variable. A function bound by name before
    torchtrace was imported (``from torch.nn.utils import clip_grad_norm_``) is not reached
    (documented)."""
    import torch.nn.utils as nn_utils
    from torch.nn.utils import clip_grad as clip_module

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        current = getattr(nn_utils, name, None)
        if current is None or getattr(current, "__torchtrace_wrapped__", False):
            continue
        wrapped = _clip_wrapper(current)
        setattr(nn_utils, name, wrapped)
        if getattr(clip_module, name, None) is current:
            setattr(clip_module, name, wrapped)


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    check = getattr(compiler, "is_compiling", None)
    return bool(check()) if check is not None else False


def _clip_wrapper(original):
    @functools.wraps(original)
    def clip(*args, **kwargs):
        if _is_compiling():  # traced by torch.compile: stay out of the graph (no break)
            return original(*args, **kwargs)
        scope = current.step()
        if scope is not None and scope._active and not scope._hook_fired:
            try:
                scope._before_clipping()
            except NonFiniteError:
                raise  # guard="raise": the policy the user asked for
            except Exception as exc:  # torchtrace's own failure never reaches the user's clip call
                rt = current.runtime(create=False)
                if rt is not None:
                    rt.errors.report("gradients", exc)
        return original(*args, **kwargs)

    clip.__torchtrace_wrapped__ = True  # type: ignore[attr-defined]
    return clip


def shutdown(timeout_s: float | None = None) -> None:
    """Finish pending records, write the report, flush spans and stop servers, within a deadline.

    Safe to call any number of times, and when torchtrace was never configured.
    """
    with current.lock:
        rt = current.runtime(create=False)
        current.set_runtime(None)
    if rt is not None:
        if timeout_s is not None:
            rt.settings = rt.settings.replace(shutdown_timeout_s=timeout_s)
        rt.close()


def _shutdown_at_exit() -> None:
    try:
        with current.lock:
            rt = current.runtime(create=False)
            current.set_runtime(None)
        if rt is not None:
            rt.close(at_exit=True)
    except Exception:  # never fail interpreter exit
        logger.debug("torchtrace shutdown at exit failed", exc_info=True)


get_runtime = current.runtime


def _configure_on_first_use():
    """The runtime built from the environment when a step runs before any ``configure()``."""
    if disabled_by_environment():
        return None
    if in_dataloader_worker():
        # A spawn/forkserver DataLoader worker: the main process owns the run's telemetry;
        # configuring here would open a second server and a second run directory.
        return None
    with current.lock:
        if current.runtime(create=False) is None and not current.disabled():
            try:
                configure()
            except Exception as exc:  # a bad environment must not break the user's step
                logger.warning("torchtrace could not configure itself (%s); instrumentation is off", exc)
                current.set_disabled(True)
        return current.runtime(create=False)


current.set_auto_configure(_configure_on_first_use)


def flush(timeout_s: float | None = None) -> bool:
    """Finish deferred records and export queued spans now. True when everything went out."""
    rt = current.runtime(create=False)
    return rt.flush(timeout_s) if rt is not None else True


def current_step() -> "StepScope | None":
    """The innermost active step scope of this thread/task, if any."""
    return current.step()


def _record_returned_loss(scope: "StepScope", rt, result: Any) -> None:
    """Take the loss from a step's return value; an odd object's failing ``.loss`` is ours to absorb."""
    try:
        scope.record_loss(extract_loss(result))
    except Exception as exc:
        rt.errors.report("step", exc)


class StepScope:
    """One instrumented operation call: a span, a step record, the step's measurements.

    Use through :func:`debug_context` or :func:`debug_operation`. Inside the block,
    :meth:`record_loss` hands over the loss.
    """

    __slots__ = ("name", "model", "optimizer", "_step_arg", "_level_arg", "_mode_arg", "_attributes", "_rt",
                 "_active", "step", "_features", "_span", "_token", "_ctx_token", "_hook", "_hook_fired",
                 "_grad_stats", "_grad_read", "_loss", "_loss_float", "_layout", "_start_ns", "_t0", "_overhead",
                 "_anomaly_cm", "record", "_param_names", "_param_norms", "_skipped", "_raise", "__weakref__",
                 "extras", "_update_before")

    def __init__(self, name: str = "step", *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, step: int | None = None,
                 level: DebugLevel | str | None = None, mode: DebugMode | str | None = None,
                 attributes: dict[str, Any] | None = None) -> None:
        self.name = name
        self.model = model
        self.optimizer = optimizer
        self._step_arg = step
        self._level_arg = DebugLevel.parse(level, "level") if level is not None else None
        self._mode_arg = DebugMode.parse(mode, "mode") if mode is not None else None
        self._attributes = attributes
        self._active = False
        self.record: StepRecord | None = None
        self.step: int | None = None
        self.extras: dict[str, Any] = {}

    # ------------------------------------------------------------ user API
    def record_loss(self, loss: Any) -> None:
        """Record the step's loss (a scalar tensor or a number). No host read happens here."""
        if not self._active or loss is None:
            return
        if isinstance(loss, torch.Tensor):
            self._loss = loss.detach()
        elif isinstance(loss, (int, float)):
            self._loss_float = float(loss)

    @property
    def span(self):
        return self._span if self._active else trace.INVALID_SPAN

    @property
    def active(self) -> bool:
        return self._active

    # ------------------------------------------------------------ enter
    def __enter__(self) -> "StepScope":
        rt = current.runtime()
        if rt is None or getattr(rt, "replaying", False):  # a forensic replay records nothing itself
            return self
        level = self._level_arg or rt.level
        if level is DebugLevel.OFF:
            return self
        t0 = time.perf_counter()
        try:
            self._begin(rt, level, t0)
        except Exception as exc:
            self._active = False
            rt.errors.report("step", exc)
        return self

    def _begin(self, rt, level: DebugLevel, t0: float) -> None:
        rt.at_step_boundary()
        self._rt = rt
        mode = self._mode_arg or rt.mode
        self._features = rt.features if (level is rt.level and mode is rt.mode) else Features.for_level(level, mode)
        self.step = self._step_arg if self._step_arg is not None else rt.next_step(self.name)
        if self._step_arg is not None:
            rt.step_counters[self.name] = max(rt.step_counters[self.name], self._step_arg + 1)
        self._grad_stats = None
        self._grad_read = None
        self._loss = None
        self._loss_float = None
        self._layout = {}
        self._hook = None
        self._hook_fired = False
        self._param_names = None
        self._param_norms = None
        self._update_before = None
        self._skipped = False
        self._raise = None
        self._anomaly_cm = None
        self._overhead = 0.0
        attrs = {semconv.STEP: self.step, semconv.OPERATION: self.name, semconv.LEVEL: level.value,
                 semconv.RANK: rt.identity.rank}
        if self._attributes:
            attrs.update(self._attributes)
        self._start_ns = time.time_ns()
        with step_trace(rt.shared_step_trace, rt.settings.run_id, self.name, self.step):
            self._span = rt.tracer.start_span(self.name, start_time=self._start_ns, attributes=attrs)
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        self._ctx_token = current.enter_step(self)
        if self.optimizer is not None and self._features.grad_stats:
            self._hook = self.optimizer.register_step_pre_hook(self._before_optimizer_step)
        if self._features.anomaly_mode:
            self._anomaly_cm = torch.autograd.detect_anomaly(check_nan=True)
            self._anomaly_cm.__enter__()
        self._active = True
        for probe in rt.probes:
            try:
                probe.enter(self)
            except Exception as exc:
                rt.errors.report("other", exc)
        t1 = time.perf_counter()
        self._overhead += t1 - t0
        self._t0 = t1

    # ------------------------------------------------------------ optimizer pre-hook
    def _before_clipping(self) -> None:
        """The user is about to clip: measure (and guard) now, on the gradients as backward left them."""
        if self._features.grad_stats and (self.optimizer is not None or self.model is not None):
            try:
                self._before_optimizer_step(self.optimizer, (), {})
            except NonFiniteError as exc:
                on_raise = self.extras.get("on_guard_raise")  # a framework callback ends its span first
                if on_raise is not None:
                    on_raise(exc)
                raise

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """Measure the gradients the optimizer is about to use; apply the guard policy."""
        if self._hook_fired or not self._active:
            return None
        t0 = time.perf_counter()
        self._hook_fired = True
        rt = self._rt
        try:
            params = rt.params_for(self.model, optimizer)
            self._grad_stats = grad_measure.gradient_norms(params)
            guard = rt.settings.guard != "warn" and (self._grad_stats is not None or rt.identity.distributed)
            if guard:
                self._guard_now(rt, params)
            elif self._grad_stats is not None and rt.forensics.decide_early(self, params):
                # The global norm is non-finite exactly when some tensor's is: look at that one
                # CPU value, and build the full vector only on a bad step.
                if not math.isfinite(readout.peek_cpu(self._grad_stats.total.reshape(1))[0]):
                    self._guard_now(rt, params)
            every = rt.settings.update_ratio_interval
            if self._features.param_stats and every and self.step % every == 0 and params:
                # Before the update: the parameters now, to measure what the update changed.
                self._update_before = (params, grad_measure.snapshot_parameters(params))
        except NonFiniteError:
            self._overhead += time.perf_counter() - t0
            raise
        except Exception as exc:
            rt.errors.report("gradients", exc)
        self._overhead += time.perf_counter() - t0
        return None

    def _guard_now(self, rt, params) -> None:
        """Read the gradient norms now (the step's host read) and skip or raise if non-finite."""
        stats = self._grad_stats
        bad = False
        if stats is not None:
            vec = torch.cat([stats.total.reshape(1), stats.norms])  # float64: cat promotes to the total's dtype
            if rt.settings.guard == "warn":
                # Only forensics' early look at CPU gradients brings a warn step here: the
                # values are in host memory already, and the step's one read stays at its end.
                values = readout.peek_cpu(vec)
            else:
                values = readout.read(vec)  # a guard must decide before the update
            self._grad_read = values
            bad = any(not math.isfinite(v) for v in values[1:])
        local_bad = bad
        if rt.identity.distributed and rt.settings.guard != "warn":
            # Every rank takes the same decision in the same step: one all_reduce(MAX).
            try:
                bad = agree_any(bad)
            except Exception as exc:
                rt.errors.report("distributed", exc)
        if not bad:
            return
        report = None
        if not local_bad:
            self._span.set_attribute(semconv.GUARD_PEER_NONFINITE, True)
        else:
            try:  # localise before anything changes: the parameters are still those the step saw
                report = rt.forensics.on_nonfinite(self)
            except Exception as exc:
                rt.errors.report("forensics", exc)
        if rt.settings.guard == "skip":
            for ref in params:
                ref.param.grad = None
            self._skipped = True
        elif rt.settings.guard == "raise":
            where = "" if local_bad else " on another rank"
            self._raise = NonFiniteError(f"non-finite gradients{where} at step {self.step} of {self.name}",
                                         step=self.step, kinds=[semconv.NONFINITE_GRAD], report=report)
            raise self._raise

    # ------------------------------------------------------------ exit
    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self._active:
            return False
        t0 = time.perf_counter()
        duration = t0 - self._t0
        end_ns = time.time_ns()
        self._active = False
        rt = self._rt
        try:
            self._finish(rt, exc, duration, end_ns, t0)
        except Exception as err:
            try:
                rt.errors.report("step", err)
            finally:
                self._abandon()
        if exc is None and self.extras.get("raise") is not None:
            raise self.extras.pop("raise")  # a guard policy decided on the host record
        return bool(exc is not None and self.extras.get("suppress"))  # OOM skipped by the guard

    def _abandon(self) -> None:
        """After an internal error in ``_finish``: restore every global and end the span."""
        for undo in (lambda: self._anomaly_cm is not None and self._anomaly_cm.__exit__(None, None, None),
                     lambda: self._hook is not None and self._hook.remove(),
                     lambda: self._ctx_token is not None and current.leave_step(self._ctx_token),
                     lambda: self._token is not None and otel_context.detach(self._token),
                     lambda: self._span.end()):
            try:
                undo()
            except Exception:
                pass
        self._anomaly_cm = self._hook = self._ctx_token = self._token = None

    def _finish(self, rt, exc, duration: float, end_ns: int, t0: float) -> None:
        if self._anomaly_cm is not None:
            self._anomaly_cm.__exit__(None, None, None)
            self._anomaly_cm = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        current.leave_step(self._ctx_token)
        self._ctx_token = None
        for probe in rt.probes:
            try:
                probe.exit(self, exc)
            except Exception as perr:
                rt.errors.report("other", perr)
        feats = self._features
        if feats.grad_stats and self._grad_stats is None and not self._hook_fired and self.model is not None \
                and self.optimizer is None:
            try:
                self._grad_stats = grad_measure.gradient_norms(rt.params_for(self.model, None))
            except Exception as gerr:
                rt.errors.report("gradients", gerr)
        pieces: list[torch.Tensor] = []
        offset = 0
        home = None
        # Pieces keep their dtypes: the one cat below promotes them (the float64 global norm
        # makes it float64), so no piece needs a conversion of its own.
        if self._loss is not None:
            loss = self._loss.reshape(1) if self._loss.numel() == 1 else self._loss.reshape(-1)[:1]
            pieces.append(loss)
            home = loss.device
            self._layout["loss"] = offset
            offset += 1
        stats = self._grad_stats
        if stats is not None:
            if self._grad_read is None:
                total, norms = stats.total.reshape(1), stats.norms
                if home is not None and total.device != home:
                    total, norms = total.to(home, non_blocking=True), norms.to(home, non_blocking=True)
                pieces.append(total)
                pieces.append(norms)
                self._layout["grads"] = (offset, stats.count)
                offset += 1 + stats.count
        if feats.param_stats and (self.model is not None or self.optimizer is not None) and (
                self._update_before is not None or self.step % rt.settings.param_check_interval == 0):
            # A second pass over memory as large as the model: every param_check_interval
            # steps (and on update-ratio steps). A step with a non-finite loss or gradient
            # gets its parameters checked when its record is finished (Runtime.finalize).
            try:
                refs = rt.params_for(self.model, self.optimizer)
                norms = grad_measure.parameter_norms(refs)
                if norms is not None:
                    if home is not None and norms.device != home:
                        norms = norms.to(home, non_blocking=True)
                    self._param_names = [r.name for r in refs]
                    pieces.append(norms)
                    self._layout["params"] = (offset, len(refs))
                    offset += len(refs)
                    if self._update_before is not None:
                        snap_refs, before = self._update_before
                        self._update_before = None
                        # Only against the same parameter list (an integration may measure
                        # through the optimizer's list and record through the model's).
                        updates = grad_measure.update_norms(refs, before) if snap_refs is refs else None
                        if updates is not None:
                            pieces.append(updates)  # on the parameters' device, like ``norms``
                            self._layout["updates"] = (offset, len(refs))
                            offset += len(refs)
            except Exception as perr:
                rt.errors.report("gradients", perr)
        for key, tensor in self.extras.items():
            if isinstance(tensor, torch.Tensor) and key.startswith("read:"):
                flat = tensor.detach().reshape(-1).to(torch.float64)
                if home is not None and flat.device != home:
                    flat = flat.to(home, non_blocking=True)
                pieces.append(flat)
                self._layout[key] = (offset, flat.numel())
                offset += flat.numel()
        pending = None
        if pieces:
            dev = pieces[0].device
            vec = pieces[0] if len(pieces) == 1 else torch.cat([p if p.device == dev else p.to(dev) for p in pieces])
            if vec.dtype != torch.float64:
                vec = vec.to(torch.float64)
            try:
                pending = readout.start(vec)
            except Exception as rerr:
                rt.errors.report("record", rerr)
                self._layout.clear()
        try:
            mem = mem_measure.sample(cuda=feats.cuda_memory)
        except Exception as merr:
            rt.errors.report("memory", merr)
            mem = mem_measure.MemorySample(rss=None)  # type: ignore[arg-type]
        otel_context.detach(self._token)
        self._token = None
        record = StepRecord(operation=self.name, step=self.step, level=(self._level_arg or rt.level).value,
                            start_unix_ns=self._start_ns, end_unix_ns=end_ns, duration_s=duration,
                            memory=mem.as_dict(), skipped=self._skipped,
                            exception_type=type(exc).__qualname__ if exc is not None else None)
        ctx = self._span.get_span_context()
        record.trace_id = format(ctx.trace_id, "032x")
        record.span_id = format(ctx.span_id, "016x")
        self.record = record
        self._overhead += time.perf_counter() - t0
        record.overhead_s = self._overhead  # the span's attribute: time up to the hand-over
        t_submit = time.perf_counter()
        rt.submit(self, record, pending, self._span, exc)
        if stats is not None and pending is not None and not pending.ready():
            stats.grads = []  # deferred: do not keep gradients alive past the step
        # The metric also counts the hand-over (on CPU it finishes the record: span, metrics,
        # history). Deferred records are finished inside the next step's __enter__, counted there.
        try:
            rt.metrics.add_overhead(self._overhead + (time.perf_counter() - t_submit))
        except Exception as oerr:
            rt.errors.report("metrics", oerr)

    # ------------------------------------------------------------ async
    async def __aenter__(self) -> "StepScope":
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        return self.__exit__(exc_type, exc, tb)


def debug_context(name: str | DebugLevel = "step", *, model: torch.nn.Module | None = None,
                  optimizer: torch.optim.Optimizer | None = None, step: int | None = None,
                  level: DebugLevel | str | None = None, mode: DebugMode | str | None = None,
                  attributes: dict[str, Any] | None = None, replay: Callable[[], Any] | None = None,
                  scaler: Any = None) -> StepScope:
    """A ``with`` (or ``async with``) block that is one instrumented operation.

    Args:
        name: the operation's name, which is the span's name (``train_step``).
        model: the model whose gradients and parameters are watched.
        optimizer: when given, gradients are measured in its step pre-hook, exactly as the
            optimizer will use them, and the guard policy can skip the update.
        step: the step number; counted automatically per operation when omitted.
        level / mode: override the configured level or mode for this operation.
        attributes: extra span attributes (low-cardinality, not per-step values).
        replay: a callable that runs the step's forward and loss (and optionally backward)
            again, returning the loss; used only to localise a non-finite step (docs/forensics.md).
        scaler: the GradScaler in use: overflow steps under a finite loss are not anomalies.

    >>> import torch, torchtrace as tt
    >>> _ = tt.configure(prometheus_port="off", write_files=False)
    >>> model = torch.nn.Linear(3, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with tt.debug_context("train_step", model=model, optimizer=opt) as step:
    ...     loss = model(torch.ones(2, 3)).pow(2).mean()
    ...     loss.backward(); step.record_loss(loss); opt.step()
    >>> step.record.grad_norm is not None
    True
    >>> tt.shutdown()
    """
    if isinstance(name, DebugLevel):  # the seeds' debug_context(DebugLevel.BASIC)
        level, name = name, "step"
    scope = StepScope(name, model=model, optimizer=optimizer, step=step, level=level, mode=mode,
                      attributes=attributes)
    if replay is not None:
        scope.extras["replay"] = replay
    if scaler is not None:
        scope.extras["scaler"] = scaler
    return scope


def _resolve_model(model, args):
    if model is not None:
        return model
    for arg in args[:2]:
        if isinstance(arg, torch.nn.Module):
            return arg
    return None


@overload
def debug_operation(func: F) -> F: ...
@overload
def debug_operation(func: None = None, *, name: str | None = None, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, level: DebugLevel | str | None = None,
                    mode: DebugMode | str | None = None) -> Callable[[F], F]: ...


def _resolve_optimizer(optimizer, args, kwargs):
    if optimizer is not None:
        return optimizer
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.optim.Optimizer):
            return value
    return None


def _prepare_replay(scope: StepScope, fn, args, kwargs, replay, scaler) -> None:
    """What forensics needs to replay this call: a callable, and whose updates to neutralise."""
    from torchtrace.forensics import replay as forensic_replay

    if scaler is not None:
        scope.extras["scaler"] = scaler
    if replay is False:
        return
    scope.extras["replay_owners"] = forensic_replay.find_side_effect_owners(args, kwargs)
    if callable(replay):
        scope.extras["replay"] = replay
    elif fn is not None:
        scope.extras["replay"] = forensic_replay.default_replay(fn, args, kwargs)


def debug_operation(func=None, *, name=None, model=None, optimizer=None, level=None, mode=None, attributes=None,
                    replay=None, scaler=None):
    """Decorate a training step (plain, ``async def`` or a method): each call is one operation.

    The loss is taken from the return value (a scalar tensor, a dict's ``"loss"``, an
    object's ``.loss``) unless the body called ``current_step().record_loss``. When no model
    is given and the first or second argument is an ``nn.Module`` (``self`` of a module
    method, or ``train_step(model, batch)``), that module is watched; an optimizer among the
    arguments is hooked likewise. Exceptions are recorded on the span and re-raised unchanged.

    Forensics: a non-finite step is replayed by calling the undecorated function again with
    the same arguments, its optimizers' ``step`` neutralised, so the function must be
    re-runnable (no side effect but the optimizer step). ``replay=`` gives another callable
    (forward + loss), ``replay=False`` turns replay off; ``scaler=`` names a GradScaler.

    >>> import torchtrace as tt
    >>> @tt.debug_operation
    ... def train_step(x):
    ...     return (x * 2).sum()
    """
    if level is not None:
        DebugLevel.parse(level, "level")  # fail at decoration time, not in the loop
    if mode is not None:
        DebugMode.parse(mode, "mode")

    def decorate(fn):
        op_name = name or getattr(fn, "__name__", "operation")
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_wrapper(*args, **kwargs):
                rt = current.runtime()
                if rt is None or (level is None and rt.off):
                    return await fn(*args, **kwargs)
                scope = StepScope(op_name, model=_resolve_model(model, args),
                                  optimizer=_resolve_optimizer(optimizer, args, kwargs), level=level,
                                  mode=mode, attributes=attributes)
                _prepare_replay(scope, None, args, kwargs, replay, scaler)
                result = None
                with scope:
                    result = await fn(*args, **kwargs)
                    if scope._active and scope._loss is None and scope._loss_float is None:
                        _record_returned_loss(scope, rt, result)
                return result

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            rt = current.runtime()
            if rt is None or (level is None and rt.off):
                return fn(*args, **kwargs)
            scope = StepScope(op_name, model=_resolve_model(model, args),
                              optimizer=_resolve_optimizer(optimizer, args, kwargs), level=level,
                              mode=mode, attributes=attributes)
            _prepare_replay(scope, fn, args, kwargs, replay, scaler)
            result = None
            with scope:
                result = fn(*args, **kwargs)
                if scope._active and scope._loss is None and scope._loss_float is None:
                    _record_returned_loss(scope, rt, result)
            return result

        return wrapper

    if func is not None and callable(func):
        return decorate(func)
    return decorate


# At import, so modules imported after torchtrace that bind the clip functions by name get
# the wrapped ones (the wrapper is inert until a step is open).
_install_clip_interception()
