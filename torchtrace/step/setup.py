"""What ``configure()`` builds besides the runtime's own state: the resource, the run directory,
span exporters, the metrics server with the debug API, the OTLP metrics pusher, and the probes."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import Status, StatusCode

from torchtrace import files, semconv
from torchtrace._version import __version__
from torchtrace.distributed import rank_file_name
from torchtrace.distributed import flight
from torchtrace.distributed.collectives import STATE as COLLECTIVES
from torchtrace.export.hang_metrics import HangMetrics
from torchtrace.export import transport
from torchtrace.export.server import TelemetryServer
from torchtrace.export.tracing import BoundedBatchSpanProcessor, JsonLinesSpanExporter, otlp_span_exporter
from torchtrace.probes.activations import ActivationProbe
from torchtrace.probes.forensics import ForensicsProbe
from torchtrace.probes.leaks import LeakProbe
from torchtrace.probes.memory import MemoryProbe
from torchtrace.probes.profiler import ProfilerProbe
from torchtrace.probes.straggler import StragglerProbe
from torchtrace.errors import get_logger
from torchtrace.job import progress
from torchtrace.job.stacks import where
from torchtrace.job.state import RankState, read_states
from torchtrace.job.watchdog import Watchdog

logger = get_logger("torchtrace")


def resource(rt: Any) -> Resource:
    """service.name, run id, rank identity, host and version; OTEL_RESOURCE_ATTRIBUTES merged in."""
    ident = rt.identity
    attrs: dict[str, Any] = {
        semconv.RESOURCE_RUN_ID: rt.settings.run_id,
        semconv.RESOURCE_RANK: ident.rank,
        semconv.RESOURCE_LOCAL_RANK: ident.local_rank,
        semconv.RESOURCE_WORLD_SIZE: ident.world_size,
        semconv.RESOURCE_INSTANCE_ID: ident.instance_id,
        "host.name": ident.node,
        "torchtrace.version": __version__,
    }
    attrs.update(rt.settings.resource_attributes or {})
    res = Resource.create(attrs)
    # service.name: argument or OTEL_SERVICE_NAME, then OTEL_RESOURCE_ATTRIBUTES, then ours.
    given = str(res.attributes.get("service.name", "")).strip()
    if rt.settings.service_name != "torchtrace" or not given or given.startswith("unknown_service"):
        res = res.merge(Resource({"service.name": rt.settings.service_name}))
    return res


def run_files(rt: Any) -> None:
    """The run directory and this rank's file names (none with ``write_files=False``)."""
    if not rt.settings.write_files:
        return
    try:
        rt.run_path = files.ensure_private_dir(Path(rt.settings.run_dir) / rt.settings.run_id)
        # A second live process with the same run id and rank gets file names of its own.
        rt.spans_path = files.claim_file(rt.run_path / rank_file_name("spans", ".jsonl", rt.identity))
        rt.report_path = files.claim_file(rt.run_path / rank_file_name("report", ".json", rt.identity))
    except OSError as exc:
        rt.errors.report("files", exc)
        rt.run_path = rt.spans_path = rt.report_path = None


def span_exporters(rt: Any) -> None:
    """One bounded batch processor per exporter: spans.jsonl, and OTLP when an endpoint is set."""
    s = rt.settings
    exporters = []
    if rt.spans_path is not None:
        exporters.append(JsonLinesSpanExporter(rt.spans_path, s.max_file_bytes))
    if s.otlp_endpoint:
        transport.warn_if_plaintext(s.otlp_endpoint, "otlp_endpoint")
        exporters.append(otlp_span_exporter(s.otlp_endpoint, s.otlp_protocol, s.export_timeout_s, s.otlp_headers,
                                            s.otlp_certificate))
    for exporter in exporters:
        proc = BoundedBatchSpanProcessor(exporter, s.span_queue_size, rt.metrics.drop_spans)
        proc.on_error = rt.exporter_error
        rt.processors.append(proc)
        rt.tracer_provider.add_span_processor(proc)


def server(rt: Any) -> None:
    """/metrics (and the debug API) on ``prometheus_port`` (+ local rank), by the port policy."""
    s = rt.settings
    if s.prometheus_port is None or s.metrics_exporter in ("otlp", "none"):
        return
    port = s.prometheus_port + rt.identity.local_rank if s.prometheus_port else 0
    srv = TelemetryServer(rt.metrics.registry, s.prometheus_host)
    if s.debug_api:
        from torchtrace.export.debug_api import install_debug_api

        rt.debug_api = install_debug_api(rt, srv)
    try:
        # Fallback ports step by the local world size, so rank r never takes rank r+1's port.
        if srv.start(port, s.port_policy, stride=rt.identity.local_world_size) is not None:
            rt.server = srv
            if rt.debug_api is not None:
                rt.debug_api.announce()
    except Exception as exc:
        rt.errors.report("server", exc)


def metrics_push(rt: Any) -> None:
    """OTLP metrics push for fleets (``metrics_exporter`` otlp or both)."""
    s = rt.settings
    if s.metrics_exporter not in ("otlp", "both"):
        return
    endpoint = s.otlp_metrics_endpoint or s.otlp_endpoint
    if not endpoint:
        logger.warning("torchtrace metrics_exporter=%s but no OTLP endpoint is set: no metrics are pushed",
                       s.metrics_exporter)
        return
    from torchtrace.export.otlp_metrics import OtlpMetricsPusher

    transport.warn_if_plaintext(endpoint, "otlp_metrics_endpoint")
    try:
        pusher = OtlpMetricsPusher(rt.metrics.registry, endpoint, s.otlp_protocol,
                                   dict(rt.tracer_provider.resource.attributes), s.metrics_export_interval_s,
                                   s.export_timeout_s, s.otlp_headers, s.otlp_certificate)
        pusher.start()
        rt.metrics_pusher = pusher
    except Exception as exc:
        rt.errors.report("metrics", exc)


def probes(rt: Any) -> None:
    """The probes every runtime runs, in order; forensics last among the step's own checks."""
    rt.probes.add(ProfilerProbe(rt))
    rt.probes.add(ActivationProbe(rt))
    rt.probes.add(MemoryProbe(rt))
    rt.probes.add(LeakProbe(rt))
    rt.forensics = rt.probes.add(ForensicsProbe(rt))
    s = rt.settings
    if rt.identity.distributed and s.rank_skew_interval:
        rt.probes.add(StragglerProbe(rt, s.rank_skew_interval))
    elif not rt.identity.distributed:
        # One rank is its own median and its own slowest: the skew is exactly 1.
        rt.metrics.set_rank_skew(1.0)


def distributed_section(rt: Any) -> dict[str, Any]:
    ident = rt.identity
    straggler = rt.probes.find(StragglerProbe)
    return {"rank": ident.rank, "local_rank": ident.local_rank, "world_size": ident.world_size,
            "local_world_size": ident.local_world_size, "node": ident.node, "node_rank": ident.node_rank,
            "instance_id": ident.instance_id, "collectives": dict(COLLECTIVES.counts),
            "collectives_broken": COLLECTIVES.broken,
            "rank_skew": straggler.last if straggler is not None else None}


BLACK_BOX_PERIOD_S = 1.0
"""Seconds between two rewrites of the black box: the rank's heartbeat."""


def black_box(rt: Any) -> None:
    """This rank's black box (``rt.rank_state``), the phase marks storing into it, and the
    hang watchdog (``rt.watchdog``) with its series on ``/metrics``."""
    ident, s = rt.identity, rt.settings
    path = rt.run_path / rank_file_name("state", ".json", ident) if rt.run_path is not None else None
    rt.rank_state = RankState(path, {"rank": ident.rank, "world_size": ident.world_size, "run_id": s.run_id,
                                     "host": ident.node, "attempt": _attempt()})
    fields = rt.rank_state.fields
    progress.track(fields)
    # DDP's all-reduce runs in C++: only the flight recorder sees it. Without one, count the
    # torch.distributed calls made from Python.
    recorder = flight.enable() if ident.distributed else flight.enabled()
    if ident.distributed and not recorder:
        flight.count_calls(progress.collective_began, progress.collective_ended)
    run_path = rt.run_path
    rt.watchdog = Watchdog(
        fields, given_timeout_s=s.hang_timeout_s, on_hang=s.on_hang,
        stack_path=run_path / rank_file_name("stacks", ".txt", ident) if run_path is not None else None,
        hang_path=run_path / rank_file_name("hang", ".json", ident) if run_path is not None else None,
        peers=(lambda: read_states(run_path)) if run_path is not None else None,
        on_finding=lambda finding: hang_telemetry(rt, finding), on_abort=lambda: flush_for_abort(rt),
        collectives=flight.last_collective if recorder else None, persist=rt.rank_state.write)
    rt.metrics.registry.register(HangMetrics(s.run_id, str(ident.rank), progress.tracked))
    rt.report_sections["hangs"] = rt.watchdog.summary
    rt.rank_state.write()
    rt.rank_state.start(BLACK_BOX_PERIOD_S)
    rt.watchdog.start()


def close_black_box(rt: Any) -> None:
    """At shutdown: the watchdog stops, the phase is idle, the black box says how it ended."""
    if rt.watchdog is not None:
        rt.watchdog.stop()
        # A last look: a peer that vanished is why this rank ends now (an exception from gloo).
        rt.watchdog.check_peers()
    box = rt.rank_state
    if box is None:
        return
    progress.untrack(box.fields)
    box.stop()
    if box.fields.get("ended") is None:
        # At interpreter exit after an uncaught exception, Python has set sys.last_value.
        error = getattr(sys, "last_value", None)
        box.fields.update(ended="exception" if error is not None else "completed", end_time=time.time(),
                          end_detail=type(error).__qualname__ if error is not None else None)
    box.write()


def _attempt() -> int:
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        raw = os.environ.get(name, "")
        if raw.isdigit():
            return int(raw)
    return 0


def hang_telemetry(rt: Any, finding: dict[str, Any]) -> None:
    """A hang where a trace viewer shows it: a span of its own (the hung step has no span yet),
    with the ``hang`` anomaly event and status ERROR."""
    detail = (f"no progress for {finding['stalled_s']:.1f} s (timeout {finding['timeout_s']:.1f} s) in step "
              f"{finding['step']}, phase {finding['phase']}, at {where(finding['where'])}")
    peers = finding.get("peers") or {}
    attrs = {semconv.RANK: rt.identity.rank, "torchtrace.hang.phase": str(finding["phase"]),
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


def flush_for_abort(rt: Any) -> None:
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
