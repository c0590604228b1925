"""Finishing a step's record: host values in, a complete record out, handed to export.

Runs on the training thread, when the step's one host read has landed (at once on the CPU; at
a later step boundary on a GPU): the values fill the record, the rules add anomalies, the
probes add their findings, the guard policy decides, and then export takes over (span,
metrics, history, log).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, ParamSpec

import torch

from torchtrace import semconv
from torchtrace.errors import NonFiniteError, get_logger
from torchtrace.export.spans import apply_record
from torchtrace.forensics.isolation import sharded_by_fsdp
from torchtrace.measure import gradients as grad_measure
from torchtrace.measure.counts import device_count, read_given
from torchtrace.measure.learning_rates import read_rates
from torchtrace.record import policy, readout, rules
from torchtrace.record.step import Anomaly, StepRecord
from torchtrace.step import job
from torchtrace.step.watched import hookable

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from torchtrace.measure.gradients import GradStats
    from torchtrace.record.readout import ReadPlan
    from torchtrace.step.runtime import Runtime
    from torchtrace.step.scope import StepScope

logger = get_logger("torchtrace")

_LOG_FIRST = 10  # anomalies of one kind logged individually before thinning out
_LOG_EVERY = 100


def finish(rt: Runtime, scope: StepScope, record: StepRecord, plan: ReadPlan, values: list[float] | None, span: Span,
           exc: BaseException | None) -> None:
    """Turn host values into the record's fields, anomalies, policy decisions and telemetry.

    Each stage is guarded on its own: an internal error costs the record that stage's part
    (counted under ``record``), never the whole record, which is exported all the same.
    """
    assert scope.features is not None  # (set as the step began)
    states, _ = scope.hand_over()
    _guarded(rt, _fill, rt, scope, record, plan, values)
    if rt.watchdog is not None:
        if rt.watchdog.unmarked:  # the watchdog found this step hung
            _guarded(rt, _mark_hang, rt, record)
        if exc is not None and rt.identity.distributed:  # a collective that failed: was a peer lost?
            _guarded(rt, rt.watchdog.check_peers)
    _guarded(rt, _judge, rt, scope, record, exc)
    _guarded(rt, rt.probes.finish, scope, states, record, plan, values)
    if scope.features.throughput:
        try:  # (_guarded, inline: every step pays for this)
            rt.throughput.account(scope, record)  # phases, data wait, goodput
        except Exception as err:
            rt.errors.report("record", err)
    _guarded(rt, _apply_policy, rt, scope, record)
    export(rt, record, span, exc)
    # The black box: the last step finished (plain stores).
    _guarded(rt, job.note_step, rt, record)
    scope.release()


def _mark_hang(rt: Runtime, record: StepRecord) -> None:
    """A step the watchdog found hung has ended after all: its span carries the ``hang`` anomaly."""
    assert rt.watchdog is not None  # (called only with one)
    finding = rt.watchdog.take(record.step)
    if finding is not None:
        record.anomalies.append(Anomaly(semconv.HANG, f"no progress for {finding['stalled_s']:.1f} s in phase "
                                        f"{finding['phase']} (timeout {finding['timeout_s']:.1f} s)", record.step,
                                        record.operation,
                                        {"phase": finding["phase"], "stalled_s": finding["stalled_s"],
                                         "since": finding["since"]}))


_P = ParamSpec("_P")


def _guarded(rt: Runtime, stage: Callable[_P, object], *args: _P.args, **kwargs: _P.kwargs) -> None:
    """``stage(*args, **kwargs)``, its failure counted, not raised (the arguments are checked
    against the stage's signature by the type checker)."""
    try:
        stage(*args, **kwargs)
    except Exception as err:
        rt.errors.report("record", err)


def _fill(rt: Runtime, scope: StepScope, record: StepRecord, plan: ReadPlan, values: list[float] | None) -> None:
    """The host values of the step's one read into the record: loss, gradients, parameters,
    tokens and samples counted on the device, the loss scaler's skipped update, learning
    rates held in device tensors."""
    if values is not None:
        loss = plan.first("loss", values)
        if loss is not None:
            record.loss = loss
        norms = plan.take("grads", values)
        if norms is not None:
            _evaluate_grads(rt, scope, record, norms)
        _evaluate_parameters(rt, scope, record, plan, values)
        tokens = plan.first("tokens", values)
        if tokens is not None:
            record.tokens = device_count(tokens)
        samples = plan.first("samples", values)
        if samples is not None:
            record.samples = device_count(samples)
        if "given_samples" in plan or "given_tokens" in plan:  # record_batch's device counts win when counts
            given, problems = read_given(plan, values)
            for field, count in given.items():
                setattr(record, field, count)
            for problem in problems:
                rt.warn_once(("batch", problem), "torchtrace: %s: record_batch: %s", scope.name, problem)
        if (plan.first("scaler_skipped", values) or 0.0) > 0:  # the loss scaler skipped the update
            record.scaler_overflow = True
        if "lr" in plan:  # learning rates on a device
            record.lr = read_rates(plan, values)
    check = scope.gradients
    if check is not None and check.values is not None and check.stats is not None:
        _evaluate_grads(rt, scope, record, check.values)


def _judge(rt: Runtime, scope: StepScope, record: StepRecord, exc: BaseException | None) -> None:
    """The rules on the filled record (loss, exception), and the parameters of a bad step."""
    assert scope.features is not None  # (set as the step began)
    rules.evaluate_loss(record)
    if exc is not None:
        rules.evaluate_exception(record, exc, scope.features.anomaly_mode)
    if not record.param_checked and record.nonfinite and scope.features.param_stats:
        _check_parameters_now(rt, scope, record)


def export(rt: Runtime, record: StepRecord, span: Span, exc: BaseException | None) -> None:
    """Hand the finished record to every sink: span, metrics, history, log."""
    try:
        apply_record(span, record, exc, rt.settings.record_exception_messages)
    except Exception as serr:
        rt.errors.report("tracing", serr)
        try:
            span.end(end_time=record.end_unix_ns or None)
        except Exception:
            pass
    try:
        rt.metrics.observe_step(record)
    except Exception as merr:
        rt.errors.report("metrics", merr)
    rt.history.add_step(record)
    for anomaly in record.anomalies:
        rt.history.add_event("anomaly", anomaly.detail, anomaly.as_dict())
        _log_anomaly(rt, anomaly)


def _apply_policy(rt: Runtime, scope: StepScope, record: StepRecord) -> None:
    """The guard's follow-ups that need the host record: stop after K bad steps, raise without an optimizer."""
    run = rt.consecutive_bad + 1 if record.nonfinite else 0
    rt.consecutive_bad = run
    if (record.nonfinite and not record.skipped and rt.guard is policy.GuardPolicy.SKIP and record.kind == "train"
            and not _made_no_update(scope)):
        # (an evaluation or checkpoint step makes no update, nor does a micro-batch whose
        # gradients go into a later step's: there was nothing to skip)
        rt.guard_could_not_act(scope, record)
    report = record.forensics
    if scope.raised is not None:
        # Raised from the optimizer's pre-hook, where only the gradients were judged: the
        # error the user catches carries what the step's record found (its loss, its output).
        if report is not None and scope.raised.report is None:
            scope.raised.report = report
        if record.anomaly_kinds:
            scope.raised.kinds = list(record.anomaly_kinds)
        return
    scope.pending_error = policy.decide_after_record(record, rt.guard, run, rt.settings.max_consecutive_bad_steps,
                                                     report)


def _made_no_update(scope: StepScope) -> bool:
    """Whether the step is known to have made no update, so that a non-finite value in it went
    through none (a micro-batch of an accumulation whose update comes in a later step, which the
    guard skips or counts): no optimizer stepped in it, and its updates could go through nothing
    else. That is known of a framework's step its framework told of no update
    (:attr:`StepScope.update_told`), and of a step that names an optimizer torch's step hooks
    reach; a step given only its model may update it by hand, unseen."""
    if any(isinstance(u, torch.optim.Optimizer) for u in scope.forensics.stepped or ()):
        return False
    if scope.update_told is not None:
        return not scope.update_told
    check = scope.gradients
    # (the check hears the step's own optimizer's updates: hooked where torch's hooks reach it)
    return scope.optimizer is not None and hookable(scope.optimizer) and check is not None and check.updates == 0


def _evaluate_grads(rt: Runtime, scope: StepScope, record: StepRecord, norms: list[float]) -> None:
    # (gradients are evaluated only where they were measured)
    assert scope.gradients is not None and scope.gradients.stats is not None and scope.features is not None
    stats = scope.gradients.stats
    total = grad_measure.global_norm(norms)
    # FSDP's first API: plain tensors, each rank's flat shard (FSDP2's DTensors were combined).
    record.grad_norm_scope = "local" if scope.model is not None and sharded_by_fsdp(scope.model) else stats.scope
    overflow: list[str] = []
    # A finite global norm (float64, summed from the tensors' norms) means every tensor's is.
    if stats.grads and not math.isfinite(total) and any(math.isinf(v) for v in norms):
        overflow = _overflowed(stats, norms)
    s = rt.settings
    rules.evaluate_gradients(record, stats.names, norms, total, s.grad_explosion_threshold,
                             s.grad_vanishing_threshold, scope.features.param_stats, overflow)


def _overflowed(stats: GradStats, norms: list[float]) -> list[str]:
    """Names of tensors whose infinite norm came from overflow, not from an Inf element (anomaly path)."""
    idx = [i for i, v in enumerate(norms) if math.isinf(v)]
    flags = torch.stack([(~torch.isfinite(stats.grads[i])).any() for i in idx]).to(torch.float64)
    real = readout.read(flags)
    return [stats.names[i] for i, r in zip(idx, real) if not r]


def _evaluate_parameters(rt: Runtime, scope: StepScope, record: StepRecord, plan: ReadPlan,
                         values: list[float]) -> None:
    norms = plan.take("params", values)
    if norms is None:
        return
    names = plan.label("params")
    record.param_checked = True
    rules.evaluate_parameters(record, names, norms)
    updates = plan.take("updates", values)
    if updates is not None:
        rules.evaluate_updates(record, names, updates, norms)


def _check_parameters_now(rt: Runtime, scope: StepScope, record: StepRecord) -> None:
    """A non-finite step outside the parameter-check cadence: name the non-finite parameters now
    (a second host read, on the anomaly path only)."""
    if scope.model is None and scope.optimizer is None:
        return
    try:
        refs = rt.params_for(scope.model, scope.optimizer)
        norms = grad_measure.parameter_norms(refs)
        if norms is None:
            return
        record.param_checked = True
        rules.evaluate_parameters(record, [r.name for r in refs], readout.read(norms))
    except Exception as exc:
        rt.errors.report("gradients", exc)


def _log_anomaly(rt: Runtime, anomaly: Anomaly) -> None:
    counts = rt.log_counts
    n = counts[anomaly.kind] = counts[anomaly.kind] + 1
    if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
        suffix = f" ({n} so far)" if n > _LOG_FIRST else ""
        logger.warning("step %s %s: %s: %s%s", anomaly.step, anomaly.operation, anomaly.kind, anomaly.detail, suffix)


__all__ = ["NonFiniteError", "export", "finish", "semconv"]
