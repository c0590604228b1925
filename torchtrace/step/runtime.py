"""The configured state of torchtrace in this process: settings, exporters, probes, history.

``configure()`` builds one :class:`Runtime`; ``shutdown()`` closes it within its deadline.
Everything a step touches hangs off this object: the scope asks it for a step number, a span
and the watched parameters, and hands it the step's record (:meth:`Runtime.submit`), which is
finished by :func:`torchtrace.step.finish.finish` once its host values are known.
"""

from __future__ import annotations

import collections
import math
import os
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable

from torchtrace import files, semconv
from torchtrace._version import __version__
from torchtrace.config import Settings
from torchtrace.distributed import Identity, identity
from torchtrace.distributed.identity import refreshed
from torchtrace.errors import InternalErrors, OncePerProcessTree, get_logger
from torchtrace.export import spans as span_export
from torchtrace.export import transport
from torchtrace.export.metrics import Metrics
from torchtrace.export.server import TelemetryServer
from torchtrace.export.trace_ids import step_trace_id
from torchtrace.export.tracing import BoundedBatchSpanProcessor, tracer_provider
from torchtrace.job.state import RUN_PROGRESS
from torchtrace.levels import DebugLevel, DebugMode, Features
from torchtrace.measure import gradients as grad_measure
from torchtrace.probes.base import ProbeSet
from torchtrace.record.history import History
from torchtrace.record.policy import GuardPolicy
from torchtrace.record.step import StepRecord
from torchtrace.step import agreement, finish, hangs, job, report, setup
from torchtrace.step.gradients import UpdateHooks
from torchtrace.step.throughput import RunThroughput
from torchtrace.step.watched import layout_version

if TYPE_CHECKING:
    import torch
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from torchtrace.export.debug_api import DebugAPI
    from torchtrace.export.otlp_metrics import OtlpMetricsPusher
    from torchtrace.job.metrics import JobMetrics
    from torchtrace.job.signals import SignalGuard
    from torchtrace.job.state import RankState
    from torchtrace.job.watchdog import Watchdog
    from torchtrace.measure.gradients import ParamRef
    from torchtrace.probes.forensics import ForensicsProbe
    from torchtrace.record.readout import Pending, ReadPlan
    from torchtrace.step.scope import StepScope

logger = get_logger("torchtrace")


class _Deferred:
    __slots__ = ("scope", "record", "plan", "pending", "span", "exc")

    def __init__(self, scope: StepScope, record: StepRecord, plan: ReadPlan, pending: Pending | None, span: Span,
                 exc: BaseException | None) -> None:
        self.scope = scope
        self.record = record
        self.plan = plan
        self.pending = pending
        self.span = span
        self.exc = exc


class RunSoFar:
    """What a run did in one process, kept as its runtime shuts down (:meth:`Runtime.so_far`):
    the runtime a later ``configure()`` of the same run id and run directory in the same process
    builds goes on from it (the process keeps its attempt). It numbers its steps on from the last, its report
    keeps the steps and events so far, its goodput the time so far, and its black box the
    attempt's start and progress."""

    __slots__ = ("run_id", "run_dir", "pid", "started_unix", "step_counters", "history", "goodput", "progress")

    def __init__(self, settings: Settings, pid: int, started_unix: float, step_counters: collections.Counter[str],
                 history: History, goodput: dict[str, Any], progress: dict[str, Any]) -> None:
        self.run_id = settings.run_id
        self.run_dir = os.path.abspath(settings.run_dir)
        self.pid = pid
        self.started_unix = started_unix
        self.step_counters = step_counters
        self.history = history
        self.goodput = goodput  # GoodputLedger.state_dict()
        self.progress = progress  # the black box's RUN_PROGRESS fields

    def goes_on_in(self, settings: Settings) -> bool:
        """Whether a runtime of ``settings`` in this process goes on with this run."""
        return (settings.run_id == self.run_id and os.path.abspath(settings.run_dir) == self.run_dir
                and os.getpid() == self.pid)


class Runtime:
    """One configured torchtrace: built by ``configure()``, closed by ``shutdown()``.

    ``so_far``: the run the last runtime of this process shut down; when it has the same run
    id and run directory, this runtime goes on with it (:class:`RunSoFar`)."""

    # The whole job's attributes, set by torchtrace.step.job.init (and filled by setup.run_files,
    # setup.black_box and job.watch): declared here so that a type checker knows them.
    job_id: str
    attempt: int
    run_root: Path | None
    state_path: Path | None
    rank_state: RankState | None
    job_metrics: JobMetrics | None
    signals: SignalGuard | None
    job_goodput_cache: tuple[float, float | None] | None
    checkpoints_booked_by_framework: bool
    exit_in_step: tuple[SystemExit, int] | None

    def __init__(self, settings: Settings, so_far: RunSoFar | None = None) -> None:
        earlier = so_far if so_far is not None and so_far.goes_on_in(settings) else None
        self.settings = settings
        self.pid = os.getpid()  # the process that owns its threads, server and files
        self.identity: Identity = identity()
        self.level: DebugLevel = settings.level
        self.mode: DebugMode = settings.mode
        self.features = Features.for_level(self.level, self.mode, settings.throughput)
        self.guard = GuardPolicy.parse(settings.guard, "guard")
        self.closed = False
        self.replaying = False  # a forensic replay is running: its steps record nothing
        # A new run, or the one this process's last set-up of the run left (before anything is set up)
        self.history = earlier.history.continued(settings.history_size) if earlier else History(settings.history_size)
        self.started_unix = earlier.started_unix if earlier else time.time()
        self.step_counters = collections.Counter(earlier.step_counters if earlier else ())
        self.consecutive_bad = 0
        self.log_counts: collections.Counter[str] = collections.Counter()
        self.guard_unable: collections.Counter[str] = collections.Counter()  # operation -> bad steps not skipped
        self._warned = OncePerProcessTree()
        self._deferred: collections.deque[_Deferred] = collections.deque()
        self._changes: collections.deque[Callable[[], None]] = collections.deque()
        self._param_cache: "weakref.WeakKeyDictionary[Any, tuple[Any, list]]" = weakref.WeakKeyDictionary()
        self._outside_cache: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[list, list, list]]" = \
            weakref.WeakKeyDictionary()
        # A step's optimizer that did not step in it -> the step's name (GradientCheck.measure_at_end).
        self.unstepped: weakref.WeakKeyDictionary[torch.optim.Optimizer, str] = weakref.WeakKeyDictionary()
        self.processors: list[BoundedBatchSpanProcessor] = []
        self.server: TelemetryServer | None = None
        self.spans_path: Path | None = None
        self.report_path: Path | None = None
        self.run_path: Path | None = None
        self.debug_api: DebugAPI | None = None  # when served
        self.metrics_pusher: OtlpMetricsPusher | None = None
        self.forensics: ForensicsProbe | None = None
        job.init(self)  # the whole job: job_id, attempt, run_root, state_path, rank_state, signals
        self.watchdog: Watchdog | None = None

        self.metrics = Metrics(settings.run_id, self.identity.rank, __version__, self.level.value)
        self.errors = InternalErrors(self.metrics.internal_error, settings.strict)
        self.probes = ProbeSet(self.errors)
        setup.run_files(self)  # (before the resource: it names the job and attempt)
        self.tracer_provider = tracer_provider(setup.resource(self))
        self.tracer = self.tracer_provider.get_tracer("torchtrace", __version__)
        self.throughput = RunThroughput(self)
        self.update_hooks = UpdateHooks()
        self.metrics.steps.run_source = self.throughput.scrape
        self.shared_step_trace = bool(settings.shared_step_trace)
        self.report_sections: dict[str, Callable[[], Any]] = {
            "distributed": lambda: setup.distributed_section(self),
            "guard": self._guard_section,
            "throughput": self.throughput.section,
        }
        setup.span_exporters(self)
        setup.server(self)
        setup.probes(self)
        setup.metrics_push(self)
        try:
            setup.black_box(self)
        except Exception as exc:  # the black box and the watchdog are never worth the run
            self.errors.report("files", exc)
        self._go_on(earlier)
        hangs.watch(self)
        # The ranks compare their settings at their first training step (torchtrace.step.agreement).
        self.settings_agreed = not self.identity.distributed

    def _go_on(self, earlier: RunSoFar | None) -> None:
        """The goodput and the black box's progress of the run so far, if it goes on (the rest of
        ``earlier`` was taken as the runtime began)."""
        if earlier is None:
            return
        try:
            self.throughput.ledger.load_state_dict(earlier.goodput)
            if self.rank_state is not None:
                self.rank_state.fields.update(earlier.progress)
                self.rank_state.write()
        except Exception as exc:
            self.errors.report("files", exc)

    def so_far(self) -> RunSoFar:
        """What this run did in this process (see :class:`RunSoFar`); after :meth:`close`."""
        box = self.rank_state.fields if self.rank_state is not None else {}
        return RunSoFar(self.settings, self.pid, self.started_unix, collections.Counter(self.step_counters),
                        self.history, self.throughput.ledger.state_dict(),
                        {name: box[name] for name in RUN_PROGRESS if name in box})

    # ------------------------------------------------------------ per-step services
    @property
    def off(self) -> bool:
        return not self.features.enabled

    @property
    def skips_steps(self) -> bool:
        """A step may skip torchtrace: nothing is measured, and no change the debug API
        queued waits (the way back on from level off must reach a step to apply)."""
        return not self.features.enabled and not self._changes

    def step_number(self, operation: str, given: int | None) -> int:
        """The step's number: ``given``, or counted per operation."""
        counters = self.step_counters
        if given is None:
            n = counters[operation]
            counters[operation] = n + 1
            return n
        if counters[operation] <= given:
            counters[operation] = given + 1
        return given

    def give_back_step_number(self, operation: str, step: int) -> None:
        """A counted step of ``operation`` that was no step (its data ran out before it began):
        the next step takes its number."""
        if self.step_counters[operation] == step + 1:
            self.step_counters[operation] = step

    def open_span(self, scope: StepScope, level: DebugLevel, attributes: dict[str, Any] | None, start_ns: int,
                  around: Context | None = None) -> Span:
        """The step's span, child of the span current in the context ``around`` (default: the
        current context)."""
        attrs = {semconv.STEP: scope.step, semconv.OPERATION: scope.name, semconv.LEVEL: level.value,
                 semconv.RANK: self.identity.rank}
        if scope.kind != "train":
            attrs[semconv.OPERATION_KIND] = scope.kind
        if attributes:
            attrs.update(attributes)
        assert scope.step is not None  # (numbered as the step began)
        forced = step_trace_id(self.settings.run_id, scope.name, scope.step) if self.shared_step_trace else 0
        return span_export.open_span(self.tracer_provider, scope.name, attrs, start_ns, self._span_ended,
                                     forced, around)

    def _span_ended(self, span: span_export.StepSpan) -> None:
        for proc in self.processors:
            proc.on_end(span)

    def params_for(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> list:
        """The watched parameters of (model, optimizer), cached; listed anew when the groups
        change, or any module's layout (:func:`~torchtrace.step.watched.layout_version`)."""
        key_obj = optimizer if optimizer is not None else model
        if key_obj is None:
            return []
        signature: tuple[Any, ...]
        if optimizer is not None:
            signature = (id(model), layout_version(), tuple(len(g["params"]) for g in optimizer.param_groups))
        else:
            signature = (id(model), layout_version())
        cached = self._param_cache.get(key_obj)
        if cached is not None and cached[0] == signature:
            return cached[1]
        refs = grad_measure.named_params(model, optimizer)
        self._param_cache[key_obj] = (signature, refs)
        return refs

    def outside(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[ParamRef]:
        """The parameters of ``model`` that ``optimizer`` does not update (another optimizer's, or
        none's), in the model's order; listed again when either list of :meth:`params_for` is."""
        model_refs = self.params_for(model, None)
        updated_refs = self.params_for(model, optimizer)
        kept = self._outside_cache.get(optimizer)
        if kept is not None and kept[0] is model_refs and kept[1] is updated_refs:
            return kept[2]
        updated = {id(ref.param) for ref in updated_refs}
        refs = [ref for ref in model_refs if id(ref.param) not in updated]
        self._outside_cache[optimizer] = (model_refs, updated_refs, refs)
        return refs

    def plan_parameter_check(self, scope: StepScope, plan: ReadPlan) -> None:
        """ADVANCED: parameter norms into the step's read every ``param_check_interval`` steps, and
        update norms on the steps whose parameters were snapshotted before the update."""
        feats = scope.features
        assert feats is not None and scope.step is not None  # (the step has begun)
        if not feats.param_stats or (scope.model is None and scope.optimizer is None):
            return
        check = scope.gradients
        before = check.update_before if check is not None else None
        if before is None and scope.step % self.settings.param_check_interval:
            return
        try:
            refs = self.params_for(scope.model, scope.optimizer)
            norms = grad_measure.parameter_norms(refs)
            if norms is None:
                return
            plan.add("params", norms, label=[r.name for r in refs])
            if before is not None and check is not None:
                snap_refs, snapshot = before
                check.update_before = None
                # Only against the same parameter list (an integration may measure through the
                # optimizer's list and record through the model's).
                updates = grad_measure.update_norms(refs, snapshot) if snap_refs is refs else None
                if updates is not None:
                    plan.add("updates", updates)
        except Exception as exc:
            self.errors.report("gradients", exc)

    def warn_once(self, key: Hashable, message: str, *args: object) -> None:
        """Log a warning the first time ``key`` is seen (a user's mistake, named once)."""
        if self._warned.first(key):  # once for the process and the DataLoader workers it forks
            logger.warning(message, *args)

    def guard_without_optimizer(self, scope: StepScope) -> None:
        if self.guard is GuardPolicy.SKIP:
            self.warn_once(("guard", scope.name),
                           "torchtrace: guard='skip' cannot skip the updates of %s: the step has no optimizer, so "
                           "its gradients are checked only after the update; pass optimizer= to debug_context or "
                           "debug_operation (or clip with torch.nn.utils.clip_grad_norm_ inside the step)", scope.name)

    def guard_could_not_act(self, scope: StepScope, record: StepRecord) -> None:
        self.guard_unable[record.operation] += 1

    def _guard_section(self) -> dict[str, Any]:
        return {"policy": self.guard.value, "max_consecutive_bad_steps": self.settings.max_consecutive_bad_steps,
                "not_applied": dict(self.guard_unable)}

    def exporter_error(self, exc: BaseException) -> None:
        """An exporter raised on the export thread: counted, never re-raised there."""
        try:
            self.errors.report("tracing", exc)
        except Exception:
            pass

    def process_group_started(self) -> None:
        """``torch.distributed.init_process_group`` returned after ``configure()`` (a framework's
        launcher started the job's processes): the identity is read again from the group, so
        every rank takes its collective decisions (the guard's agreement) on the same world. The
        rank-skew probe and the count of Python collectives start at the next step boundary.
        The black box says the rank and world it has now, for the watchdog and ``torchtrace why``;
        file names and metric labels keep the identity read at configure."""
        try:
            self.identity = refreshed(self.identity)
        except Exception as exc:
            self.errors.report("distributed", exc)
            return
        box = self.rank_state
        if box is not None:
            # One update: the writer thread's copy holds both new values or neither.
            box.fields.update(rank=self.identity.rank, world_size=self.identity.world_size)
        self.request(self._distributed_from_now)
        self.settings_agreed = False

    def _distributed_from_now(self) -> None:
        setup.straggler(self)
        hangs.count_collectives(self)

    def agree_settings(self) -> None:
        """At the first training step of a job of several ranks, once (the first step every rank
        reaches alike: an evaluation or a checkpoint may run on rank 0 alone): the settings that
        decide torchtrace's collectives made rank 0's on every rank (:mod:`torchtrace.step.agreement`)."""
        self.settings_agreed = True
        try:
            agreement.agree(self)
        except Exception as exc:
            self.errors.report("distributed", exc)
        setup.straggler(self)

    # ------------------------------------------------------------ changes and boundaries
    @property
    def pending_changes(self) -> int:
        """Changes queued by the debug API, not yet applied by the training thread."""
        return len(self._changes)

    def request(self, change: Callable[[], None]) -> None:
        """Queue a change (level, clear, ...) for the training thread's next step boundary."""
        self._changes.append(change)

    def set_level(self, level: DebugLevel | str, mode: DebugMode | str | None = None) -> None:
        """Change the level now (call from the training thread, or through :meth:`request`)."""
        self.level = DebugLevel.parse(level, "level")
        if mode is not None:
            self.mode = DebugMode.parse(mode, "mode")
        self.features = Features.for_level(self.level, self.mode, self.settings.throughput)
        self.probes.on_level(self.features)  # a probe whose feature just went off releases what it holds now
        if not self.features.throughput:
            self.throughput.release()
        self.metrics.set_level(self.level.value)
        self.history.add_event("level_changed", f"debug level set to {self.level.value}",
                               {"level": self.level.value, "mode": self.mode.value})

    def at_step_boundary(self) -> None:
        """Apply requested changes (level, clear...) before a step begins.

        Records whose device values have arrived are finished at the end of a later step
        (:meth:`submit`), not here: at a step's start the device may be idle (the user's loop
        read a value, which waits for the device), and finishing a record there would delay
        the step's first kernel. At a step's end the step's own work is queued ahead of it.
        """
        while self._changes:
            change = self._changes.popleft()
            try:
                change()
            except Exception as exc:
                self.errors.report("step", exc)

    # ------------------------------------------------------------ recording
    def submit(self, scope: StepScope, record: StepRecord, plan: ReadPlan, pending: Pending | None, span: Span,
               exc: BaseException | None) -> None:
        """Hand over a step: finished now if its values are on the host, else deferred."""
        item = _Deferred(scope, record, plan, pending, span, exc)
        if pending is None or pending.ready():
            if self._deferred:
                self.finish_deferred(block=False, into=scope)
            self._finish(item)
        else:
            if scope.gradients is not None and scope.gradients.stats is not None:
                scope.gradients.stats.grads = []  # deferred: do not keep gradients alive past the step
            self._deferred.append(item)
            if len(self._deferred) > 1:  # earlier steps whose copies landed, while the device works on this one
                self.finish_deferred(block=False, into=scope)
        try:
            self.metrics.add_overhead(record.overhead_s)
        except Exception as oerr:
            self.errors.report("metrics", oerr)

    def records_pending(self) -> bool:
        """Whether a finished step's record still waits for its copy (on a GPU)."""
        return bool(self._deferred)

    def finish_deferred(self, block: bool, into: StepScope | None = None) -> None:
        """Finish the records whose copies landed (all of them, waiting, with ``block``). An
        error the guard decided on such a record (``max_consecutive_bad_steps`` reached) is
        raised at the end of ``into``, the step now ending: the late record's own step is
        long over."""
        # (a deferred record always has a pending read: submit defers only those)
        while self._deferred and (block or self._deferred[0].pending.ready()):  # type: ignore[union-attr]
            item = self._deferred.popleft()
            self._finish(item)
            late = item.scope
            if into is not None and late is not into and late.pending_error is not None:
                if into.pending_error is None:
                    into.pending_error = late.pending_error
                late.pending_error = None

    def _finish(self, item: _Deferred) -> None:
        try:
            values = item.pending.result() if item.pending is not None else None
            finish.finish(self, item.scope, item.record, item.plan, values, item.span, item.exc)
        except Exception as exc:
            self.errors.report("record", exc)
            try:
                item.span.end(end_time=item.record.end_unix_ns or None)
            except Exception:
                pass

    # ------------------------------------------------------------ reports
    def summary(self) -> dict[str, Any]:
        """The run so far: totals, anomalies by kind, telemetry health, last step."""
        return report.summary(self)

    def report(self) -> dict[str, Any]:
        """The full report: the summary plus recent steps, the event timeline and settings."""
        return report.full_report(self)

    def write_report(self, path: str | os.PathLike[str] | None = None) -> Path | None:
        return report.write(self, path)

    @property
    def metrics_url(self) -> str | None:
        return f"{self.server.url}/metrics" if self.server and self.server.url else None

    # ------------------------------------------------------------ shutdown
    def flush(self, timeout_s: float | None = None) -> bool:
        """Finish deferred records, write the black box and push queued spans out, within ``timeout_s``."""
        timeout = self.settings.shutdown_timeout_s if timeout_s is None else timeout_s
        self.finish_deferred(block=True)
        job.write_now(self)  # the black box too: flush() makes everything known so far durable
        deadline = time.monotonic() + timeout
        ok = True
        for proc in self.processors:
            left = max(0.0, deadline - time.monotonic())
            ok = proc.force_flush(int(left * 1000)) and ok
        return ok

    def close(self, at_exit: bool = False) -> None:
        """Write the report and stop every thread and socket within the shutdown deadline.

        ``at_exit``: called from the interpreter's exit; no thread is started from here on.
        """
        if self.closed:
            return
        if os.getpid() != self.pid:
            # A forked child's copy (a DataLoader worker keeps its parent's; see api._forked):
            # its threads and server are the parent's, not running here, and waiting for them
            # to stop would wait forever; the run's files and telemetry are the parent's too.
            self.closed = True
            return
        if self.signals is not None:
            # A SIGTERM from here on ends the process once shutdown has ended. (Held before the
            # runtime is closed: a signal between the two would find a shutdown under way that
            # it neither waits for nor does itself, and end the process in its middle.)
            self.signals.hold()
        self.closed = True
        try:
            self._shut_down(at_exit)
        finally:
            job.release(self)  # (and the signal handlers given back)

    def _shut_down(self, at_exit: bool) -> None:
        # The deadline and shutdown's own time (not the job's) start here.
        deadline, closing = time.monotonic() + self.settings.shutdown_timeout_s, time.perf_counter()
        # First the watchdog stops (a slow shutdown is never taken for a hang). The steps still
        # in flight are finished and the run's ledger books the time after the last step
        # (``other``) before the black box says how this attempt ended (the report's job section
        # reads it, with the same accounts), as of shutdown's start.
        ended_at = time.time()
        hangs.stop(self)
        if at_exit:
            for proc in self.processors:
                proc.prepare_exit()
        try:
            self.finish_deferred(block=True)
            self.throughput.between_steps(before=math.inf)  # an evaluation after the last step
        except Exception as exc:
            self.errors.report("record", exc)
        self.throughput.ledger.pause(closing, last=True)  # (shutdown's own time is not the job's: not in wall time)
        job.close(self, ended_at)
        self.probes.close()
        self.throughput.close()
        self.update_hooks.close()
        written = time.monotonic()
        self._write_report_safely()
        # The deadline covers everything shutdown does: the exporters stop early enough for the
        # report to be written again (with the final export counts), with a tenth of the
        # deadline and 50 ms to spare for a loaded machine's scheduling and the files' claims
        # released after them. The second write comes after the exporters' wait, and work after
        # a long wait ran up to four times slower than the first write on a shared 2-core machine
        # (14 ms, then 52 ms, and 14 ms more to release the claims).
        timeout = self.settings.shutdown_timeout_s
        reserve = min(4.0 * (time.monotonic() - written) + 0.1 * timeout + 0.05, 0.3 * timeout)
        self._stop_exporters(deadline - reserve, at_exit)
        self._write_report_safely()
        for path in (self.spans_path, self.report_path):
            if path is not None:
                files.release_file(path)

    def _write_report_safely(self) -> None:
        try:
            self.write_report()
        except Exception as exc:
            self.errors.report("files", exc)

    def _stop_exporters(self, deadline: float, at_exit: bool = False) -> None:
        n = len(self.processors) + (self.metrics_pusher is not None)
        for i, proc in enumerate(self.processors):
            # Each exporter gets an equal share of what is left, so one stuck collector
            # cannot use up the others' time.
            share = max(0.05, (deadline - time.monotonic()) / max(1, n - i))
            try:
                proc.shutdown(share)
            except Exception as exc:
                self.errors.report("tracing", exc)
        if self.metrics_pusher is not None:
            # The server is stopped after the final push: keep it the time its stop takes.
            server_s = _SERVER_STOP_S if self.server is not None else 0.0
            try:
                self.metrics_pusher.shutdown(max(0.05, deadline - server_s - time.monotonic()))
            except Exception as exc:
                self.errors.report("metrics", exc)
        if not at_exit:  # no socket to a gRPC collector outlives shutdown (at exit, the process's end closes them)
            transport.wait_for_grpc_disconnect(self.settings, self.metrics_pusher is not None,
                                               deadline - (_SERVER_STOP_S if self.server is not None else 0.0))
        if self.server is not None:
            try:
                self.server.stop(max(_SERVER_STOP_S, deadline - time.monotonic()))
            except Exception as exc:
                self.errors.report("server", exc)


_SERVER_STOP_S = 0.1  # the HTTP server's stop: its threads see the closed socket and end

__all__ = ["Runtime"]
