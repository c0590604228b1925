"""What ``configure()`` builds besides the runtime's own state: the resource, the run directory,
span exporters, the metrics server with the debug API, the OTLP metrics pusher, the probes, and
the rank's black box."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.resources import Resource

from torchtrace import files, semconv
from torchtrace._version import __version__
from torchtrace.distributed import rank_file_name
from torchtrace.distributed.collectives import STATE as COLLECTIVES
from torchtrace.errors import get_logger
from torchtrace.export import transport
from torchtrace.export.endpoints import metrics_endpoint
from torchtrace.export.server import TelemetryServer
from torchtrace.export.tracing import BoundedBatchSpanProcessor, JsonLinesSpanExporter, otlp_span_exporter
from torchtrace.job import identity as job_identity
from torchtrace.job.cgroup import memory_cgroup
from torchtrace.job.state import RankState
from torchtrace.probes.activations import ActivationProbe
from torchtrace.probes.forensics import ForensicsProbe
from torchtrace.probes.leaks import LeakProbe
from torchtrace.probes.memory import MemoryProbe
from torchtrace.probes.profiler import ProfilerProbe
from torchtrace.probes.straggler import StragglerProbe
from torchtrace.step import job

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from torchtrace.step.runtime import Runtime

logger = get_logger("torchtrace")


def resource(rt: Runtime) -> Resource:
    """service.name, run id, rank identity, host and version; OTEL_RESOURCE_ATTRIBUTES merged in."""
    ident = rt.identity
    attrs: dict[str, Any] = {
        semconv.RESOURCE_RUN_ID: rt.settings.run_id,
        semconv.RESOURCE_RANK: ident.rank,
        semconv.RESOURCE_LOCAL_RANK: ident.local_rank,
        semconv.RESOURCE_WORLD_SIZE: ident.world_size,
        semconv.RESOURCE_INSTANCE_ID: ident.instance_id,
        semconv.RESOURCE_JOB_ID: rt.job_id,
        semconv.RESOURCE_ATTEMPT: rt.attempt,
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


def run_files(rt: Runtime) -> None:
    """The job's identity and attempt, the attempt's directory and this rank's file names (none
    with ``write_files=False``).

    Attempt 0 writes in ``<run_dir>/<run_id>/`` as a run always did; a later attempt of the same
    run id in ``attempt-N/`` beside it, so no attempt appends to or overwrites another's files
    (:mod:`torchtrace.job.identity` says how attempts are counted).
    """
    s = rt.settings
    rt.job_id = job_identity.job_id_from(s.job_id, s.run_id)
    launcher = job_identity.launcher_attempt()
    rt.attempt = launcher or 0
    if not s.write_files:
        return
    try:
        root = files.ensure_private_dir(Path(s.run_dir) / s.run_id)
        state_name = rank_file_name("state", ".json", rt.identity)
        rt.attempt = job_identity.choose_attempt(root, state_name, rt.attempt)
        rt.run_root = root
        rt.run_path = files.ensure_private_dir(job_identity.attempt_dir(root, rt.attempt))
        # A second live process with the same run id and rank gets file names of its own.
        rt.spans_path = files.claim_file(rt.run_path / rank_file_name("spans", ".jsonl", rt.identity))
        rt.report_path = files.claim_file(rt.run_path / rank_file_name("report", ".json", rt.identity))
        rt.state_path = files.claim_file(rt.run_path / state_name)
    except OSError as exc:
        rt.run_path = rt.spans_path = rt.report_path = rt.state_path = rt.run_root = None
        no_run_files(rt, exc)


def no_run_files(rt: Runtime, exc: OSError) -> None:
    """The run directory cannot be used: the user's setting, not torchtrace's failure. One
    warning line names it and what it accepts, without a traceback (it logged three chained
    ones as an internal error); counted under ``files``; strict mode raises."""
    reason = exc.strerror or str(exc)
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(rt.settings.run_dir) else ""
    logger.warning("torchtrace: run_dir=%r cannot be used: %s%s; this run writes no files (spans, report, black "
                   "box), training goes on; accepted values: a directory this process can create and write",
                   str(rt.settings.run_dir), reason, where)
    rt.errors.report("files", exc, log=False)


BLACK_BOX_PERIOD_S = 0.5
"""Seconds between two rewrites of the black box: what a SIGKILL can lose of it."""


def black_box(rt: Runtime) -> None:
    """This rank's black box (:class:`torchtrace.job.state.RankState`), as ``rt.rank_state``:
    who this process is, its memory cgroup's limit and OOM-kill count at start (a later reader
    compares them), written now and every :data:`BLACK_BOX_PERIOD_S` by its writer thread."""
    ident = rt.identity
    fields: dict[str, Any] = {
        "rank": ident.rank, "world_size": ident.world_size, "job_id": rt.job_id, "attempt": rt.attempt,
        "run_id": rt.settings.run_id, "host": ident.node, "started": rt.started_unix,
        "process_started": job_identity.process_start_time(), "step": None,
        "period_s": BLACK_BOX_PERIOD_S,
    }
    group = memory_cgroup()  # (never raises: None where there is none to read)
    if group is not None:
        fields["cgroup"] = {"version": group["version"], "path": group["path"], "oom_kills": group["oom_kills"]}
        fields["memory_limit_bytes"] = group["limit_bytes"]
    box = RankState(rt.state_path, fields)
    box.refresh = lambda f: job.refresh(rt, f)
    rt.rank_state = box
    try:
        if rt.state_path is not None and not box.write():
            rt.errors.report("files", OSError(f"black box {rt.state_path} not written"))
        box.start(BLACK_BOX_PERIOD_S)
        job.watch(rt)
    except Exception as exc:
        rt.errors.report("files", exc)


def span_exporters(rt: Runtime) -> None:
    """One bounded batch processor per exporter: spans.jsonl, and OTLP when an endpoint is set."""
    s = rt.settings
    exporters: list[SpanExporter] = []
    if rt.spans_path is not None:
        exporters.append(JsonLinesSpanExporter(rt.spans_path, s.max_file_bytes))
    if s.otlp_endpoint:
        transport.warn_if_plaintext(s.otlp_endpoint, "otlp_endpoint")
        exporters.append(otlp_span_exporter(s.otlp_endpoint, s.otlp_protocol, s.export_timeout_s, s.otlp_headers,
                                            s.otlp_certificate,
                                            transport.connect_timeout_s(s.export_timeout_s, s.shutdown_timeout_s)))
    for exporter in exporters:
        proc = BoundedBatchSpanProcessor(exporter, s.span_queue_size, rt.metrics.drop_spans)
        proc.on_error = rt.exporter_error
        rt.processors.append(proc)
        rt.tracer_provider.add_span_processor(proc)


def server(rt: Runtime) -> None:
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


def metrics_push(rt: Runtime) -> None:
    """OTLP metrics push for fleets (``metrics_exporter`` otlp or both)."""
    s = rt.settings
    if s.metrics_exporter not in ("otlp", "both"):
        return
    endpoint = metrics_endpoint(s)
    if not endpoint:
        logger.warning("torchtrace metrics_exporter=%s but no OTLP endpoint is set for metrics (otlp_metrics_endpoint, "
                       "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT; the traces URL is not "
                       "used for metrics): no metrics are pushed", s.metrics_exporter)
        return
    from torchtrace.export.otlp_metrics import OtlpMetricsPusher

    transport.warn_if_plaintext(endpoint, "otlp_metrics_endpoint")
    try:
        pusher = OtlpMetricsPusher(rt.metrics.registry, endpoint, s.otlp_protocol,
                                   dict(rt.tracer_provider.resource.attributes), s.metrics_export_interval_s,
                                   s.export_timeout_s, s.otlp_headers, s.otlp_certificate,
                                   transport.connect_timeout_s(s.export_timeout_s, s.shutdown_timeout_s))
        pusher.start()
        rt.metrics_pusher = pusher
    except Exception as exc:
        rt.errors.report("metrics", exc)


def probes(rt: Runtime) -> None:
    """The probes every runtime runs, in order; forensics last among the step's own checks."""
    rt.probes.add(ProfilerProbe(rt))
    rt.probes.add(ActivationProbe(rt))
    rt.probes.add(MemoryProbe(rt))
    rt.probes.add(LeakProbe(rt))
    rt.forensics = rt.probes.add(ForensicsProbe(rt))
    straggler(rt)


def straggler(rt: Runtime) -> None:
    """The rank-skew probe, on a distributed job (once); a single process's skew is 1. Called
    at configure, again when a process group starts after it (:meth:`Runtime.process_group_started`),
    and when the ranks agreed their settings (an interval of None: the probe gathers nothing)."""
    s = rt.settings
    probe = rt.probes.find(StragglerProbe)
    if probe is not None:  # (the interval the ranks agreed: torchtrace.step.agreement)
        probe.interval = s.rank_skew_interval
    elif rt.identity.distributed and s.rank_skew_interval:
        rt.probes.add(StragglerProbe(rt, s.rank_skew_interval))
    elif not rt.identity.distributed:
        # One rank is its own median and its own slowest: the skew is exactly 1.
        rt.metrics.set_rank_skew(1.0)


def distributed_section(rt: Runtime) -> dict[str, Any]:
    ident = rt.identity
    straggler = rt.probes.find(StragglerProbe)
    return {"rank": ident.rank, "local_rank": ident.local_rank, "world_size": ident.world_size,
            "local_world_size": ident.local_world_size, "node": ident.node, "node_rank": ident.node_rank,
            "instance_id": ident.instance_id, "collectives": dict(COLLECTIVES.counts),
            "collectives_broken": COLLECTIVES.broken,
            "rank_skew": straggler.last if straggler is not None else None}
