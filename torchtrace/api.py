"""configure / shutdown / debug_context / debug_operation: the names users type.

The step itself is :class:`torchtrace.step.scope.StepScope`; this module builds scopes, and
the runtime they report to (:class:`torchtrace.step.runtime.Runtime`).
"""

from __future__ import annotations

import atexit
import functools
import inspect
import multiprocessing
import multiprocessing.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, TypeVar, overload

import torch

from torchtrace import current
from torchtrace.config import Settings, disabled_by_environment
from torchtrace.distributed import collectives, in_dataloader_worker
from torchtrace.distributed.identity import (
    Identity,
    identity,
    rank_file_name,
    rerunning_main_script,
    unwatch_group_start,
    watch_group_start,
)
from torchtrace.errors import get_logger
from torchtrace.job import progress
from torchtrace.job.identity import (
    SettingsOffer,
    agent_run_id,
    hand_over_run_id,
    launched_rank_run_id,
    offer_settings,
    parents_settings,
    run_id_offered_ahead,
    slurm_step_run_id,
    spawned_run_id,
    take_back_run_id,
    take_back_settings,
)
from torchtrace.levels import DebugLevel, DebugMode, debug_mode_setting
from torchtrace.measure.loss import extract_loss, not_a_loss
from torchtrace.step import block, checks, clipping, job, updaters
from torchtrace.step.scope import StepScope
from torchtrace.step.watched import instance_first, unwatch_layouts, watch_layouts, watched

if TYPE_CHECKING:
    from torchtrace.step.runtime import RunSoFar, Runtime

logger = get_logger("torchtrace")
F = TypeVar("F", bound=Callable[..., Any])

_atexit_registered = False
_finalizer_pid: int | None = None  # the process whose multiprocessing finalizer shuts torchtrace down
_run_so_far: RunSoFar | None = None  # the run the last shutdown() in this process ended (_keep_run_so_far)


class ConfigureResult:
    """What ``configure()`` set up: where metrics are served, where files are written."""

    def __init__(self, runtime: Runtime | None) -> None:
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
        return (f"ConfigureResult(run_id={self.run_id!r}, metrics_url={self.metrics_url!r}, "
                f"run_dir={str(self.run_dir)!r})")


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
    **settings: object,
) -> ConfigureResult:
    """Set torchtrace up (or set it up again). Every argument is optional.

    Arguments beat ``TORCHTRACE_*``/``OTEL_*`` environment variables, which beat defaults.
    Calling it again shuts the previous set-up down first; under the same run id and run
    directory the new set-up goes on with the run (docs/jobs.md). Without any call, the first
    instrumented step configures torchtrace from the environment.

    From a script's top level, which a spawn/forkserver child (a DataLoader worker, a
    ``torch.multiprocessing.spawn`` rank) runs again as it starts, the set-up waits for that
    process's first instrumented step (a worker runs none); ``enabled`` is False until then.

    Raises:
        ValueError: an invalid argument, naming the setting and the accepted values.

    >>> import torchtrace as tt
    >>> result = tt.configure(level="basic", prometheus_port="off", write_files=False)
    >>> result.enabled
    True
    >>> tt.shutdown()
    """
    args = dict(service_name=service_name, run_id=run_id, level=level, mode=mode, prometheus_host=prometheus_host,
                prometheus_port=prometheus_port, run_dir=run_dir, otlp_endpoint=otlp_endpoint,
                otlp_protocol=otlp_protocol, disabled=disabled, **settings)
    resolved = _settings(args)  # raises before anything is torn down
    if rerunning_main_script():
        _put_off(args)
        return ConfigureResult(None)
    result = _set_up(resolved)
    rt = current.runtime(create=False)
    if rt is not None:  # (the children multiprocessing spawns take these arguments: _set_up_spawned_child)
        offer_settings(args, rt.settings.run_id, rt.job_id)
    return result


def _set_up(resolved: Settings) -> ConfigureResult:
    """Replace the runtime with one built from ``resolved``: ``configure()`` once its arguments
    are checked."""
    with current.lock:
        shutdown()
        _let_go_of_inherited()
        if resolved.disabled:
            current.set_disabled(True)
            return ConfigureResult(None)
        from torchtrace.step.runtime import Runtime

        rt = Runtime(resolved, _run_so_far)
        current.set_runtime(rt)
        hand_over_run_id(resolved.run_id)
        clipping.install()
        updaters.install()
        watch_layouts()
        watch_group_start(_process_group_started)
        collectives.watch_join()
        if resolved.register_atexit:
            _shut_down_as_the_process_ends()
        return ConfigureResult(rt)


def _shut_down_as_the_process_ends() -> None:
    """torchtrace shuts down as this process ends: at the interpreter's exit, and, in a process
    ``multiprocessing`` started, from multiprocessing's finalizers, which run as its target ends
    (:func:`_shutdown_multiprocessing_child`; a forked one then ends through ``os._exit``, which
    runs no exit handler)."""
    global _atexit_registered, _finalizer_pid
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True
    if multiprocessing.parent_process() is not None and _finalizer_pid != os.getpid():
        multiprocessing.util.Finalize(None, _shutdown_multiprocessing_child, exitpriority=0)
        _finalizer_pid = os.getpid()


def _settings(args: dict[str, Any]) -> Settings:
    """``configure()``'s settings; where nothing names a run id, ranks started through
    ``multiprocessing`` take the one they share (:func:`_spawned_ranks_run_id`), and ranks a
    configured process started take its own (:func:`~torchtrace.job.identity.launched_rank_run_id`);
    a process that offered a run id before it was configured takes that one
    (:func:`~torchtrace.job.identity.offer_run_id_ahead`); the ranks of a Slurm job step take its
    ids (:func:`~torchtrace.job.identity.slurm_step_run_id`), and the ranks torchrun started with
    no rendezvous id one their agent gives them alike (:func:`~torchtrace.job.identity.agent_run_id`)."""
    resolved = Settings.resolve(args)
    ident = identity()
    agent = agent_run_id()
    shared = (_spawned_ranks_run_id(resolved, ident) or slurm_step_run_id(ident.distributed) or agent
              or launched_rank_run_id(ident.rank, ident.distributed) or run_id_offered_ahead())
    settings = resolved if shared is None else Settings.resolve(args, default_run_id=shared, warn=False)
    if agent is not None and settings.run_id == agent and ident.world_size > ident.local_world_size:
        logger.warning("torchtrace: torchrun gave this job no rendezvous id (--rdzv-id): the ranks of this host "
                       "share the run id %s, and the other hosts' ranks have run ids of their own; give torchrun "
                       "--rdzv-id (or every rank TORCHTRACE_RUN_ID) to make every rank one run", agent)
    return settings


def _spawned_ranks_run_id(settings: Settings, ident: Identity) -> str | None:
    """The run id the ranks of a job started by ``multiprocessing`` share when nothing names one
    (:func:`torchtrace.job.identity.spawned_run_id`), for a process that is a rank of a world of
    more than one: its files go beside the other ranks' black boxes, where the watchdog and
    ``torchtrace why`` look for them."""
    if not ident.distributed:
        return None
    run_dir = Path(settings.run_dir) if settings.write_files else None
    return spawned_run_id(run_dir, rank_file_name("state", ".json", ident))


_put_off_args: dict[str, Any] | None = None
"""The arguments of a ``configure()`` put off to the process's first step (see configure)."""


def _put_off(args: dict[str, Any]) -> None:
    global _put_off_args
    _put_off_args = args
    logger.debug("torchtrace: configure() ran in a process started by multiprocessing as it ran the main "
                 "script's top level; torchtrace is set up at this process's first step, if it runs one")


def shutdown(timeout_s: float | None = None) -> None:
    """Finish pending records, write the report, flush spans and stop servers, within a deadline.

    Safe to call any number of times, and when torchtrace was never configured.
    """
    global _put_off_args
    _put_off_args = None
    current.end_orphan()  # a framework's step whose loop raised: recorded before the runtime goes
    with current.lock:
        rt = current.runtime(create=False)
        current.set_runtime(None)
        current.set_disabled(False)  # configure(disabled=True) ends here too: the next use starts afresh
    if rt is not None:
        if timeout_s is not None:
            rt.settings = rt.settings.replace(shutdown_timeout_s=timeout_s)
        try:
            rt.close()
            _keep_run_so_far(rt)
        finally:
            # torch as it was: the clip functions, GradScaler, schedulers and the optimizer hook
            clipping.uninstall()
            updaters.uninstall()
            block.unwatch()
            from torchtrace.export.otlp_spans import restore_sdk_jitter

            restore_sdk_jitter()  # the OpenTelemetry exporters draw from Python's random again
            unwatch_layouts()
            unwatch_group_start()
            collectives.unwatch_join()
            take_back_run_id()
            take_back_settings()


def _keep_run_so_far(rt: Runtime) -> None:
    """Keep what ``rt``'s run did in this process: a later ``configure()`` of the same run id and
    run directory here goes on with it (:class:`~torchtrace.step.runtime.RunSoFar`)."""
    global _run_so_far
    try:
        _run_so_far = rt.so_far()
    except Exception as exc:
        _run_so_far = None
        logger.debug("torchtrace: the run so far was not kept: %s", exc)


def _process_group_started() -> None:
    """``torch.distributed.init_process_group`` returned: the runtime reads its identity again."""
    rt = current.runtime(create=False)
    if rt is not None:
        rt.process_group_started()


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


def _configure_on_first_use() -> Runtime | None:
    """The runtime built when a step runs before any ``configure()`` in this process: from the
    environment, from a ``configure()`` put off, or, in a forked child, from its parent's."""
    if disabled_by_environment():
        return None
    with current.lock:
        if in_dataloader_worker():
            # The main process owns the run's telemetry: configuring here would open a second
            # server and run directory. A forked worker keeps its parent's runtime (its guard,
            # its once-only warnings); a spawn/forkserver worker runs without.
            current.set_runtime(_inherited)
            return _inherited
        if current.runtime(create=False) is None and not current.disabled():
            try:
                if _inherited is not None:
                    _set_up_forked_child(_inherited)
                elif _put_off_args is None and (offer := parents_settings()) is not None:
                    _set_up_spawned_child(offer)
                else:
                    configure(**(_put_off_args or {}))
            except Exception as exc:  # a bad environment must not break the user's step
                logger.warning("torchtrace could not configure itself (%s); instrumentation is off", exc)
                current.set_disabled(True)
        return current.runtime(create=False)


_inherited: Runtime | None = None
"""In a child forked from a configured process, the parent's runtime, set aside (see _forked)."""


def _forked() -> None:
    """In a child just forked from a configured process: the parent's runtime is set aside.

    Its threads, server and exporters run in the parent only, so what the child's steps gave it
    was dropped (the steps of Hogwild workers, of a ``multiprocessing.Pool`` of trials). At the
    child's first step (:func:`_configure_on_first_use`) a DataLoader worker takes it back, and
    any other child is set up for itself (:func:`_set_up_forked_child`).
    """
    global _inherited
    _inherited = current.runtime(create=False)
    current.set_runtime(None)


def _set_up_forked_child(parent: Runtime) -> None:
    """Set a forked child that trains up with its parent's settings, under the parent's job id."""
    _set_up_child(parent.settings, parent.job_id, parent.settings.run_id)


def _set_up_spawned_child(offer: SettingsOffer) -> None:
    """Set a child that ``multiprocessing`` spawned from a configured process (a spawn Pool of
    trials, a ``torch.multiprocessing.spawn`` rank), whose ``configure()`` ran under
    ``if __name__ == "__main__":`` and so not here, up with the arguments it was given, under the
    parent's job id."""
    _set_up_child(Settings.resolve(offer.args), offer.job_id, offer.run_id)


def _set_up_child(settings: Settings, job_id: str, parent_run_id: str) -> None:
    """Set a child up with its parent's ``settings`` under the parent's job id. The ranks of a
    process group share one run, as spawned ranks do (:func:`_spawned_ranks_run_id`); any other
    child has a run of its own, ``<parent's run id>-pid<pid>``."""
    settings = settings.replace(job_id=job_id)
    run_id = _spawned_ranks_run_id(settings, identity()) or f"{parent_run_id}-pid{os.getpid()}"
    _set_up(settings.replace(run_id=run_id))


def _shutdown_multiprocessing_child() -> None:
    """multiprocessing's finalizer in a child it started: the exception that ended the child's
    target is the end recorded in the black box; then torchtrace shuts down as at exit.

    No ``sys.excepthook`` runs for it: multiprocessing catches and prints it, and
    ``torch.multiprocessing.spawn`` catches it and ends the rank with ``sys.exit(1)`` (whose
    exception leads back to it). Python 3.10-3.12 run the finalizers as that exception leaves
    the target; 3.13 runs them once multiprocessing has handled it, and there the end stays
    ``completed``.
    """
    rt = current.runtime(create=False)
    ending = sys.exc_info()[1]  # (the finalizer runs as the exception leaves the target)
    if isinstance(ending, SystemExit):
        ending = ending.__context__ if ending.code not in (0, None) else None
    if rt is not None and ending is not None:
        try:
            job.record_exception(rt, ending)
        except Exception:
            logger.debug("torchtrace: recording how the process ended failed", exc_info=True)
    _shutdown_at_exit()


def _let_go_of_inherited() -> None:
    """A forked child being set up lets its parent's runtime go: the signal handlers it
    inherited give way to its own (the parent's threads and files stay the parent's)."""
    global _inherited
    parent, _inherited = _inherited, None
    if parent is not None and parent.signals is not None:
        parent.signals.restore()


os.register_at_fork(after_in_child=_forked)


current.set_auto_configure(_configure_on_first_use)


def flush(timeout_s: float | None = None) -> bool:
    """Finish deferred records and export queued spans now. True when everything went out."""
    rt = current.runtime(create=False)
    return rt.flush(timeout_s) if rt is not None else True


class _NoStep(StepScope):
    """What :func:`current_step` gives outside any step: its calls (``record_loss``,
    ``record_batch``, ...) do nothing, it is false, and it never opens a step itself."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return False

    def __enter__(self) -> "StepScope":
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        return False


_NO_STEP = _NoStep("no_step")


def current_step() -> StepScope:
    """The innermost active step scope of this thread/task; outside any step (an evaluation
    loop calling the same ``compute_loss``, torchtrace at level off or disabled) an inert scope
    that is false and whose calls do nothing, so ``tt.current_step().record_loss(loss)`` is safe
    anywhere. ``if tt.current_step():`` tells whether a step is open."""
    current.end_orphan()  # a framework's step whose loop raised is not open any more
    scope = current.step()
    return scope if scope is not None else _NO_STEP


def idle() -> None:
    """Say that training is over for now: the script evaluates, serves its model, keeps a page
    up or waits for its next job after its last step.

    Until the next step begins, the hang watchdog does not watch the training thread (its phase
    is ``idle``, as before the first step) and goodput counts no time. Without it that time is
    ``data_wait`` under the regular hang timeout: a script that served for a minute after its
    last step was reported as a hung job. Does nothing outside a configured run, inside a step,
    or on a thread other than the one that runs the steps.

    >>> import torchtrace as tt
    >>> tt.idle()
    """
    rt = current.runtime(create=False)
    if rt is None or current.step() is not None or not progress.on_training_thread():
        return
    progress.idle()
    rt.throughput.idle()


def debug_context(name: str | DebugLevel = "step", *, model: torch.nn.Module | None = None,
                  optimizer: torch.optim.Optimizer | None = None, step: int | None = None,
                  level: DebugLevel | str | None = None, mode: DebugMode | str | None = None,
                  attributes: dict[str, Any] | None = None, replay: Callable[[], Any] | None = None,
                  scaler: torch.amp.GradScaler | None = None, kind: str = "train", inputs: object = None) -> StepScope:
    """A ``with`` (or ``async with``) block that is one instrumented operation.

    Args:
        name: the operation's name, which is the span's name (``train_step``); a level: the
            seeds' block (step/block.py).
        model: the model whose gradients and parameters are watched.
        optimizer: when given, gradients are measured in its step pre-hook, exactly as the
            optimizer will use them, and the guard policy can skip the update.
        step: the step number; counted automatically per operation when omitted.
        level / mode: override the configured level or mode for this operation.
        attributes: extra span attributes (low-cardinality, not per-step values).
        replay: a callable that runs the step's forward and loss (and optionally backward)
            again, returning the loss; used only to find the module that produced a
            non-finite value (docs/forensics.md).
        scaler: the GradScaler in use: overflow steps under a finite loss are not anomalies.
        kind: ``train`` (default), ``evaluation``, ``checkpoint`` or ``other``: what the time of
            the block counts as in the goodput accounting.
        inputs: the step's batch (a tensor, a dict such as a tokenizer's output, or a tuple),
            to count samples and tokens and the FLOPs of its shapes, as the decorator does
            with its arguments; ``step.record_batch(...)`` sets them instead.

    Raises:
        TypeError: a wrong type for an argument (a module where the name belongs, an
            optimizer as ``model=``...), with the correct call.

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
    if isinstance(name, DebugLevel):  # the seeds' debug_context(DebugLevel.BASIC): step/block.py
        # (a WatchedBlock: its ``with`` gives the StepScope, as a StepScope's does)
        return block.level_block(name, model, optimizer, step, mode, attributes,  # type: ignore[return-value]
                                 replay, scaler, kind, inputs)
    return StepScope(name, model=model, optimizer=optimizer, step=step, level=level, mode=mode,
                     attributes=attributes, replay=replay, scaler=scaler, kind=kind,
                     inputs=((inputs,), {}) if inputs is not None else None)


class _Operation:
    """What a decorated function's calls share: the decorator's arguments."""

    __slots__ = ("name", "model", "optimizer", "level", "mode", "attributes", "replay", "scaler", "kind")

    def __init__(self, name, model, optimizer, level, mode, attributes, replay, scaler, kind) -> None:
        self.name, self.model, self.optimizer, self.level, self.mode = name, model, optimizer, level, mode
        self.attributes, self.replay, self.scaler, self.kind = attributes, replay, scaler, kind

    def scope(self, fn: Callable[..., Any] | None, args: tuple, kwargs: dict, method: bool = False) -> StepScope:
        model, optimizer, scaler = watched(self.model, self.optimizer, self.scaler, args, kwargs)
        scope = StepScope(self.name, model=model, optimizer=optimizer, level=self.level,
                          mode=self.mode, attributes=self.attributes, scaler=scaler, kind=self.kind,
                          inputs=(args, kwargs), checked=True)
        if method and args:
            scope.batch_skip = 1  # a method's instance (a trainer) is not its batch
        if self.replay is not False:
            # Forensics replays the call (with its optimizers' and scalers' updates neutralised).
            if callable(self.replay):
                scope.forensics.replay = self.replay
            elif fn is not None:
                scope.forensics.function = fn
        return scope

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as an instrumented operation: one step per call (uninstrumented when off)."""
        op, level = self, self.level
        method = instance_first(fn)
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_wrapper(*args, **kwargs):
                rt = current.runtime()
                if rt is None or (level is None and rt.skips_steps):
                    return await fn(*args, **kwargs)
                result = None  # stays None when the guard absorbs the step's exception (out of memory)
                with op.scope(fn, args, kwargs, method) as scope:  # (replayed by driving a new coroutine)
                    result = await fn(*args, **kwargs)
                    _take_returned_loss(scope, result)
                return result

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            rt = current.runtime()
            if rt is None or (level is None and rt.skips_steps):
                return fn(*args, **kwargs)
            result = None  # stays None when the guard absorbs the step's exception (out of memory)
            with op.scope(fn, args, kwargs, method) as scope:
                result = fn(*args, **kwargs)
                _take_returned_loss(scope, result)
            return result

        return wrapper


def _take_returned_loss(scope: StepScope, result: object) -> None:
    """The loss from the step's return value; an odd object's failing ``.loss`` is ours to absorb."""
    if scope.active and not scope.has_loss:
        try:
            loss = extract_loss(result)
        except Exception as exc:
            rt = current.runtime(create=False)
            if rt is not None:
                rt.errors.report("step", exc)
            return
        if scope.kind != "train" and not_a_loss(loss):
            return  # an evaluation's predictions (and labels), not a loss: nothing to warn about
        scope.record_loss(loss)
    if scope.has_loss and scope.model is None and scope.optimizer is None and scope.kind == "train" \
            and scope.features is not None and scope.features.grad_stats:
        rt = current.runtime(create=False)
        if rt is not None:
            rt.warn_once(("unwatched", scope.name),
                         "torchtrace: %s: a training step with a loss but no model or optimizer to watch: its "
                         "gradients, phases and learning rates are not measured; pass model= and optimizer= to "
                         "debug_operation", scope.name)


@overload
def debug_operation(func: F) -> F: ...
@overload
def debug_operation(func: None = None, *, name: str | None = None, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, level: DebugLevel | str | None = None,
                    mode: DebugMode | str | None = None) -> Callable[[F], F]: ...


def debug_operation(func=None, *, name=None, model=None, optimizer=None, level=None, mode=None, attributes=None,
                    replay=None, scaler=None, kind="train", debug_mode=None):
    """Decorate a training step (plain, ``async def`` or a method): each call is one operation.

    The loss is taken from the return value (a scalar tensor, a Python number, a dict's
    ``"loss"``, an object's ``.loss``) unless the body called ``current_step().record_loss``.
    When no model is given and the first or second argument is an ``nn.Module`` (``self`` of a
    module method, or ``train_step(model, batch)``), that module is watched; an optimizer among
    the arguments is hooked likewise; a method of another class (a trainer object) watches the
    model, optimizer and GradScaler among its ``self``'s attributes (:mod:`torchtrace.step.watched`).
    Exceptions are recorded on the span and re-raised unchanged.

    Forensics: a non-finite step is replayed by calling the undecorated function again with
    the same arguments, its optimizers' ``step`` neutralised, so the function must be
    re-runnable (no side effect but the optimizer step). ``replay=`` gives another callable
    (forward + loss), ``replay=False`` turns replay off; ``scaler=`` names a GradScaler.

    ``debug_mode=`` is the seeds' spelling: a ``DebugMode`` is the operation's ``mode``,
    ``False`` turns the operation's instrumentation off, ``True`` keeps the run's settings.

    Raises:
        TypeError: at decoration, for a module passed where the function belongs
            (``@debug_operation(model)``) or a wrong type for ``model=``/``optimizer=``/``scaler=``.
        ValueError: an invalid level, mode or kind, or both ``debug_mode=`` and ``mode=``.

    >>> import torchtrace as tt
    >>> @tt.debug_operation
    ... def train_step(x):
    ...     return (x * 2).sum()
    """
    # Fail at decoration time, not in the loop.
    checks.check_decorator_arguments(func, name, model, optimizer, level, mode, replay, scaler, kind, attributes)
    on, seed_mode = debug_mode_setting(debug_mode)
    if seed_mode is not None and seed_mode is not DebugMode.NONE:
        if mode is not None:
            raise ValueError("debug_operation: give debug_mode= or mode=, not both")
        mode = seed_mode
    elif on is False and level is None:
        level = DebugLevel.OFF

    def decorate(fn):
        return _Operation(checks.operation_name(fn, name), model, optimizer, level, mode, attributes,
                          replay, scaler, kind).wrap(fn)

    if func is not None:
        return decorate(func)
    return decorate

