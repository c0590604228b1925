"""The runtime's side of hang detection: the phase marks tracked into the black box, the
collectives counted, the watchdog started and stopped, and what a hang finding becomes.

Built at ``configure()`` by :func:`watch`, after :func:`torchtrace.step.setup.black_box` made
``rt.rank_state``; stopped first thing at shutdown by :func:`stop` (a slow shutdown is never
taken for a hang). The watchdog itself is :mod:`torchtrace.job.watchdog`; docs/hangs.md says
how it decides.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue

from torchtrace import semconv
from torchtrace.distributed import flight, rank_file_name
from torchtrace.errors import get_logger
from torchtrace.export.hang_metrics import HangMetrics
from torchtrace.job import progress
from torchtrace.job.stacks import where
from torchtrace.job.state import read_states
from torchtrace.job.watchdog import Watchdog

if TYPE_CHECKING:
    from torchtrace.step.runtime import Runtime

logger = get_logger("torchtrace")


def watch(rt: Runtime) -> None:
    """The phase marks storing into the black box, the collectives counted, and the hang
    watchdog (``rt.watchdog``) with its series on ``/metrics``. A failure here is counted and
    leaves the job unwatched; it never fails ``configure()``."""
    box = rt.rank_state
    if box is None:
        return
    try:
        _watch(rt, box.fields)
    except Exception as exc:
        rt.errors.report("other", exc)


def _watch(rt: Runtime, fields: dict[str, Any]) -> None:
    ident, s = rt.identity, rt.settings
    progress.track(fields)
    recorder = flight.enable() if ident.distributed else flight.enabled()
    count_collectives(rt)
    run_path = rt.run_path
    box = rt.rank_state
    assert box is not None
    rt.watchdog = Watchdog(
        fields, given_timeout_s=s.hang_timeout_s, on_hang=s.on_hang,
        stack_path=run_path / rank_file_name("stacks", ".txt", ident) if run_path is not None else None,
        hang_path=run_path / rank_file_name("hang", ".json", ident) if run_path is not None else None,
        workers_path=run_path / rank_file_name("workers", ".txt", ident) if run_path is not None else None,
        # (A job of one process has no peers to look at: no directory read every tick.)
        peers=(lambda: read_states(run_path)) if run_path is not None and ident.world_size > 1 else None,
        on_finding=lambda finding: hang_telemetry(rt, finding), on_abort=lambda: flush_for_abort(rt),
        collectives=flight.last_collective if recorder else None, persist=box.write)
    rt.metrics.registry.register(HangMetrics(s.run_id, str(ident.rank), progress.tracked, rt.watchdog.stall.now))
    rt.report_sections["hangs"] = rt.watchdog.summary
    rt.watchdog.start()


def count_collectives(rt: Runtime) -> None:
    """DDP's all-reduce runs in C++: only the flight recorder sees it. Without one, or with an
    older torch's that records NCCL only, the torch.distributed calls made from Python are
    counted, on a distributed job (at configure, or when its process group starts later)."""
    if rt.identity.distributed and not (flight.enabled() and flight.records_every_backend()):
        flight.count_calls(progress.collective_began, functools.partial(progress.phase_ended, "collective"))


def stop(rt: Runtime) -> None:
    """At shutdown, first thing: the watchdog stops and the phase becomes idle. How the
    attempt ended, with a last look at the peers (one that vanished is why this rank ends
    now), is :func:`torchtrace.step.job.close`'s."""
    try:
        if rt.watchdog is not None:
            rt.watchdog.stop()
        if rt.rank_state is not None:
            progress.untrack(rt.rank_state.fields)
    except Exception as exc:
        rt.errors.report("other", exc)


def hang_telemetry(rt: Runtime, finding: dict[str, Any]) -> None:
    """A hang where a trace viewer shows it: a span of its own (the hung step has no span yet),
    with the ``hang`` anomaly event and status ERROR."""
    detail = (f"no progress for {finding['stalled_s']:.1f} s (timeout {finding['timeout_s']:.1f} s) in step "
              f"{finding['step']}, phase {finding['phase']}, at {where(finding['where'])}")
    peers = finding.get("peers") or {}
    attrs: dict[str, AttributeValue] = {semconv.RANK: rt.identity.rank, "torchtrace.hang.phase": str(finding["phase"]),
             "torchtrace.hang.stalled_s": float(finding["stalled_s"]), "torchtrace.hang.where": where(finding["where"]),
             semconv.ANOMALY_KINDS: [semconv.HANG]}
    if isinstance(finding.get("step"), int):
        attrs[semconv.STEP] = finding["step"]
    if peers.get("culprit_ranks"):
        attrs["torchtrace.hang.culprit_ranks"] = [int(r) for r in peers["culprit_ranks"]]
    span = rt.tracer.start_span("torchtrace.hang", attributes=attrs)
    span.add_event(semconv.EVENT_ANOMALY, {semconv.EVENT_ANOMALY_KIND: semconv.HANG,
                                           semconv.EVENT_ANOMALY_DETAIL: detail})
    span.set_status(Status(StatusCode.ERROR, detail))
    span.end()


def flush_for_abort(rt: Runtime) -> None:
    """``on_hang="abort"``: the report, the queued spans and the black box out, each bounded."""
    try:
        rt.write_report()
    except Exception as exc:
        logger.debug("torchtrace: report not written before abort: %r", exc)
    for proc in rt.processors:
        try:
            proc.force_flush(int(rt.settings.shutdown_timeout_s * 1000))
        except Exception:
            pass
    if rt.rank_state is not None:
        rt.rank_state.write()
