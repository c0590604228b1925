"""The configured state of torchtrace in this process: settings, exporters, history.

``configure()`` builds one :class:`Runtime`; ``shutdown()`` closes it within its deadline.
Everything the training thread touches per step hangs off this object.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import Status, StatusCode

from torchtrace import semconv
from torchtrace._version import __version__
from torchtrace.config import Settings
from torchtrace.distributed import Identity, identity, rank_file_name
from torchtrace.distributed.collectives import STATE as COLLECTIVES
from torchtrace.errors import InternalErrors
from torchtrace import files
from torchtrace.export import transport
from torchtrace.export.metrics import Metrics
from torchtrace.export.server import TelemetryServer
from torchtrace.export.trace_ids import StepTraceIdGenerator
from torchtrace.export.tracing import (BoundedBatchSpanProcessor, JsonLinesSpanExporter, otlp_span_exporter,
                                       tracer_provider)
from torchtrace.levels import DebugLevel, DebugMode, Features
from torchtrace.measure import gradients as grad_measure
from torchtrace.record import readout, rules
from torchtrace.record.history import History
from torchtrace.record.step import StepRecord
from torchtrace.probes.straggler import StragglerProbe

logger = logging.getLogger("torchtrace")

_LOG_FIRST = 10  # anomalies of one kind logged individually before thinning out
_LOG_EVERY = 100


class Probe:
    """An optional family of checks plugged into every step (profiling, forensics, ...).

    All methods run on the training thread. ``enter``/``exit`` may only launch device work;
    ``finalize`` sees the host record and the still-open span.
    """

    def enter(self, scope) -> None:  # pragma: no cover - default no-op
        return None

    def exit(self, scope, exc: BaseException | None) -> None:  # pragma: no cover
        return None

    def finalize(self, scope, record: StepRecord, span) -> None:  # pragma: no cover
        return None


class _Deferred:
    __slots__ = ("scope", "record", "pending", "span", "exc")

    def __init__(self, scope, record, pending, span, exc):
        self.scope = scope
        self.record = record
        self.pending = pending
        self.span = span
        self.exc = exc


class Runtime:
    """One configured torchtrace: built by ``configure()``, closed by ``shutdown()``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.identity: Identity = identity()
        self.level: DebugLevel = settings.level
        self.mode: DebugMode = settings.mode
        self.features = Features.for_level(self.level, self.mode)
        self.history = History(settings.history_size)
        self.started_unix = time.time()
        self.closed = False
        self.step_counters: collections.Counter[str] = collections.Counter()
        self.probes: list[Probe] = []
        self.report_sections: dict[str, Callable[[], Any]] = {}
        self._deferred: collections.deque[_Deferred] = collections.deque()
        self._changes: collections.deque[Callable[[], None]] = collections.deque()
        self._param_cache: "weakref.WeakKeyDictionary[Any, tuple[Any, list]]" = weakref.WeakKeyDictionary()
        self._log_counts: collections.Counter[str] = collections.Counter()
        self.consecutive_bad = 0
        self.processors: list[BoundedBatchSpanProcessor] = []
        self.server: TelemetryServer | None = None
        self.spans_path: Path | None = None
        self.report_path: Path | None = None
        self.run_path: Path | None = None
        self.debug_api = None  # torchtrace.export.debug_api.DebugAPI when served
        self.metrics_pusher = None

        self.metrics = Metrics(settings.run_id, self.identity.rank, __version__, self.level.value)
        self.errors = InternalErrors(self.metrics.internal_error, settings.strict)
        self.tracer_provider = tracer_provider(self._resource())
        self.tracer = self.tracer_provider.get_tracer("torchtrace", __version__)
        self._setup_files()
        self._setup_exporters()
        self._setup_server()
        self._install_distributed()
        from torchtrace.probes.forensics import install as _install_forensics

        _install_forensics(self)
        from torchtrace.probes import install_probes

        install_probes(self)
        self._setup_metrics_push()

    # ------------------------------------------------------------ construction
    def _resource(self) -> Resource:
        ident = self.identity
        attrs: dict[str, Any] = {
            semconv.RESOURCE_RUN_ID: self.settings.run_id,
            semconv.RESOURCE_RANK: ident.rank,
            semconv.RESOURCE_LOCAL_RANK: ident.local_rank,
            semconv.RESOURCE_WORLD_SIZE: ident.world_size,
            semconv.RESOURCE_INSTANCE_ID: ident.instance_id,
            "host.name": ident.node,
            "torchtrace.version": __version__,
        }
        attrs.update(self.settings.resource_attributes or {})
        resource = Resource.create(attrs)
        # service.name: argument or OTEL_SERVICE_NAME, then OTEL_RESOURCE_ATTRIBUTES, then ours.
        if self.settings.service_name != "torchtrace" or not str(
                resource.attributes.get("service.name", "")).strip() or str(
                resource.attributes.get("service.name")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": self.settings.service_name}))
        return resource

    def _install_distributed(self) -> None:
        """Shared step traces, the straggler probe and the report's ``distributed`` section."""
        s = self.settings
        self.shared_step_trace = bool(s.shared_step_trace)
        if self.shared_step_trace:
            self.tracer.id_generator = StepTraceIdGenerator()
        straggler = None
        if self.identity.distributed and s.rank_skew_interval:
            straggler = StragglerProbe(self, s.rank_skew_interval)
            self.probes.append(straggler)
        elif not self.identity.distributed:
            # One rank is its own median and its own slowest: the skew is exactly 1.
            self.metrics.set_rank_skew(1.0)

        def section() -> dict[str, Any]:
            ident = self.identity
            return {"rank": ident.rank, "local_rank": ident.local_rank, "world_size": ident.world_size,
                    "local_world_size": ident.local_world_size, "node": ident.node, "node_rank": ident.node_rank,
                    "instance_id": ident.instance_id, "collectives": dict(COLLECTIVES.counts),
                    "collectives_broken": COLLECTIVES.broken,
                    "rank_skew": straggler.last if straggler is not None else None}

        self.report_sections["distributed"] = section

    def _setup_files(self) -> None:
        if not self.settings.write_files:
            return
        try:
            self.run_path = files.ensure_private_dir(Path(self.settings.run_dir) / self.settings.run_id)
            self.spans_path = self.run_path / rank_file_name("spans", ".jsonl", self.identity)
            self.report_path = self.run_path / rank_file_name("report", ".json", self.identity)
        except OSError as exc:
            self.errors.report("files", exc)
            self.run_path = self.spans_path = self.report_path = None

    def _setup_exporters(self) -> None:
        s = self.settings
        exporters = []
        if self.spans_path is not None:
            exporters.append(JsonLinesSpanExporter(self.spans_path, s.max_file_bytes))
        if s.otlp_endpoint:
            transport.warn_if_plaintext(s.otlp_endpoint, "otlp_endpoint")
            exporters.append(otlp_span_exporter(s.otlp_endpoint, s.otlp_protocol, s.export_timeout_s, s.otlp_headers,
                                                s.otlp_certificate))
        for exporter in exporters:
            proc = BoundedBatchSpanProcessor(exporter, s.span_queue_size, self.metrics.drop_spans)
            proc.on_error = self._exporter_error
            self.processors.append(proc)
            self.tracer_provider.add_span_processor(proc)

    def _exporter_error(self, exc: BaseException) -> None:
        """An exporter raised on the export thread: counted, never re-raised there."""
        try:
            self.errors.report("tracing", exc)
        except Exception:
            pass

    def _setup_server(self) -> None:
        s = self.settings
        if s.prometheus_port is None or s.metrics_exporter in ("otlp", "none"):
            return
        port = s.prometheus_port + self.identity.local_rank if s.prometheus_port else 0
        server = TelemetryServer(self.metrics.registry, s.prometheus_host)
        if s.debug_api:
            from torchtrace.export.debug_api import install_debug_api

            self.debug_api = install_debug_api(self, server)
        try:
            # Fallback ports step by the local world size, so rank r never takes rank r+1's port.
            if server.start(port, s.port_policy, stride=self.identity.local_world_size) is not None:
                self.server = server
                if self.debug_api is not None:
                    self.debug_api.announce()
        except Exception as exc:
            self.errors.report("server", exc)

    def _setup_metrics_push(self) -> None:
        s = self.settings
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
            pusher = OtlpMetricsPusher(self.metrics.registry, endpoint, s.otlp_protocol,
                                       dict(self.tracer_provider.resource.attributes), s.metrics_export_interval_s,
                                       s.export_timeout_s, s.otlp_headers, s.otlp_certificate)
            pusher.start()
            self.metrics_pusher = pusher
        except Exception as exc:
            self.errors.report("metrics", exc)

    # ------------------------------------------------------------ per-step services
    @property
    def off(self) -> bool:
        return not self.features.enabled

    def next_step(self, operation: str) -> int:
        n = self.step_counters[operation]
        self.step_counters[operation] = n + 1
        return n

    def params_for(self, model, optimizer) -> list:
        """The watched parameters of (model, optimizer), cached; re-checked when groups change."""
        key_obj = optimizer if optimizer is not None else model
        if key_obj is None:
            return []
        if optimizer is not None:
            signature = (id(model), tuple(len(g["params"]) for g in optimizer.param_groups))
        else:
            signature = (id(model),)
        cached = self._param_cache.get(key_obj)
        if cached is not None and cached[0] == signature:
            return cached[1]
        refs = grad_measure.named_params(model, optimizer)
        self._param_cache[key_obj] = (signature, refs)
        return refs

    def request(self, change: Callable[[], None]) -> None:
        """Queue a change (level, clear, ...) for the training thread's next step boundary."""
        self._changes.append(change)

    def set_level(self, level: DebugLevel | str, mode: DebugMode | str | None = None) -> None:
        """Change the level now (call from the training thread, or through :meth:`request`)."""
        self.level = DebugLevel.parse(level, "level")
        if mode is not None:
            self.mode = DebugMode.parse(mode, "mode")
        self.features = Features.for_level(self.level, self.mode)
        for probe in self.probes:  # a probe whose feature just went off releases what it holds now
            on_level = getattr(probe, "on_level", None)
            if on_level is not None:
                try:
                    on_level(self.features)
                except Exception as exc:
                    self.errors.report("other", exc)
        self.metrics.set_level(self.level.value)
        self.history.add_event("level_changed", f"debug level set to {self.level.value}",
                               {"level": self.level.value, "mode": self.mode.value})

    def at_step_boundary(self) -> None:
        """Apply requested changes and finish records whose device values have arrived."""
        while self._changes:
            change = self._changes.popleft()
            try:
                change()
            except Exception as exc:
                self.errors.report("step", exc)
        self.finish_deferred(block=False)

    # ------------------------------------------------------------ recording
    def submit(self, scope, record: StepRecord, pending, span, exc) -> None:
        """Hand over a step: finished now if its values are on the host, else deferred."""
        item = _Deferred(scope, record, pending, span, exc)
        if pending is None or pending.ready():
            self.finish_deferred(block=False)
            self._finish(item)
        else:
            self._deferred.append(item)

    def finish_deferred(self, block: bool) -> None:
        while self._deferred and (block or self._deferred[0].pending.ready()):
            self._finish(self._deferred.popleft())

    def _finish(self, item: _Deferred) -> None:
        try:
            self.finalize(item.scope, item.record, item.pending.result() if item.pending else None, item.span, item.exc)
        except Exception as exc:
            self.errors.report("record", exc)
            try:
                item.span.end(end_time=item.record.end_unix_ns or None)
            except Exception:
                pass

    def finalize(self, scope, record: StepRecord, values: list[float] | None, span, exc) -> None:
        """Turn host values into the record's fields, anomalies, span, metrics and history."""
        s = self.settings
        layout = scope._layout if scope is not None else {}
        if values is not None:
            if "loss" in layout:
                record.loss = values[layout["loss"]]
            g = layout.get("grads")
            if g is not None:
                start, count = g
                self._evaluate_grads(scope, record, values[start], values[start + 1: start + 1 + count])
            p = layout.get("params")
            if p is not None:
                start, count = p
                record.param_checked = True
                rules.evaluate_parameters(record, scope._param_names, values[start:start + count])
                u = layout.get("updates")
                if u is not None:
                    rules.evaluate_updates(record, scope._param_names, values[u[0]:u[0] + u[1]],
                                           values[start:start + count])
        if scope is not None and scope._grad_read is not None and scope._grad_stats is not None:
            self._evaluate_grads(scope, record, scope._grad_read[0], scope._grad_read[1:])
        if record.loss is None and scope is not None and scope._loss_float is not None:
            record.loss = scope._loss_float
        rules.evaluate_loss(record)
        if scope is not None and not record.param_checked and record.nonfinite and scope._features.param_stats:
            self._check_parameters_now(scope, record)
        if scope is not None and values is not None:
            for key, where in layout.items():
                if key.startswith("read:"):  # probes find their values under "value:<name>"
                    scope.extras["value:" + key[5:]] = values[where[0]:where[0] + where[1]]
        for probe in list(self.probes):
            try:
                probe.finalize(scope, record, span)
            except Exception as perr:
                self.errors.report("other", perr)
        self._decorate_span(record, span, exc)
        try:
            self.metrics.observe_step(record)
        except Exception as merr:
            self.errors.report("metrics", merr)
        self.history.add_step(record)
        for anomaly in record.anomalies:
            self.history.add_event("anomaly", anomaly.detail, anomaly.as_dict())
            self._log_anomaly(anomaly)
        self.consecutive_bad = self.consecutive_bad + 1 if record.nonfinite else 0

    def _check_parameters_now(self, scope, record: StepRecord) -> None:
        """A non-finite step outside the parameter-check cadence: name the non-finite
        parameters now (a second host read, on the anomaly path only)."""
        if scope.model is None and scope.optimizer is None:
            return
        try:
            refs = self.params_for(scope.model, scope.optimizer)
            norms = grad_measure.parameter_norms(refs)
            if norms is None:
                return
            record.param_checked = True
            rules.evaluate_parameters(record, [r.name for r in refs], readout.read(norms))
        except Exception as exc:
            self.errors.report("gradients", exc)

    def _evaluate_grads(self, scope, record: StepRecord, total: float, norms: list[float]) -> None:
        s = self.settings
        record.grad_norm_scope = getattr(scope._grad_stats, "scope", "global")
        overflow: list[str] = []
        # A finite global norm (float64, summed from the tensors' norms) means every tensor's is.
        if scope._grad_stats.grads and not math.isfinite(total) and any(math.isinf(v) for v in norms):
            overflow = self._overflowed(scope, norms)
        rules.evaluate_gradients(record, scope._grad_stats.names, norms, total, s.grad_explosion_threshold,
                                 s.grad_vanishing_threshold, scope._features.param_stats, overflow)

    def _overflowed(self, scope, norms: list[float]) -> list[str]:
        """Names of tensors whose infinite norm came from overflow, not from an Inf element."""
        stats = scope._grad_stats
        idx = [i for i, v in enumerate(norms) if math.isinf(v)]
        import torch

        flags = torch.stack([(~torch.isfinite(stats.grads[i])).any() for i in idx]).to(torch.float64)
        real = readout.read(flags)
        return [stats.names[i] for i, r in zip(idx, real) if not r]

    def _decorate_span(self, record: StepRecord, span, exc) -> None:
        attrs: dict[str, Any] = {}
        if record.loss is not None:
            attrs[semconv.LOSS] = record.loss
        if record.grad_norm is not None:
            attrs[semconv.GRAD_NORM] = record.grad_norm
            attrs[semconv.GRAD_NORM_SCOPE] = record.grad_norm_scope
            attrs[semconv.GRAD_PARAM_COUNT] = len(record.grad_names)
            attrs[semconv.GRAD_NONFINITE_COUNT] = len(record.grad_nonfinite_params)
            if record.grad_nonfinite_params:
                attrs[semconv.GRAD_NONFINITE_PARAMS] = _capped(record.grad_nonfinite_params)
            if record.grad_exploded_params:
                attrs[semconv.GRAD_EXPLODED_PARAMS] = _capped(record.grad_exploded_params)
            if record.grad_vanished_params:
                attrs[semconv.GRAD_VANISHED_PARAMS] = _capped(record.grad_vanished_params)
        if record.param_checked:
            attrs[semconv.PARAM_CHECKED] = True
        if record.param_nonfinite_params:
            attrs[semconv.PARAM_NONFINITE_PARAMS] = _capped(record.param_nonfinite_params)
        if record.update_ratio is not None:
            attrs[semconv.UPDATE_RATIO] = record.update_ratio
        if record.update_ratio_max_param is not None:
            attrs[semconv.UPDATE_RATIO_MAX] = record.update_ratio_max
            attrs[semconv.UPDATE_RATIO_MAX_PARAM] = record.update_ratio_max_param[:200]
        if record.anomalies:
            attrs[semconv.ANOMALY_KINDS] = record.anomaly_kinds
        mem = record.memory
        if mem.get("rss_bytes") is not None:
            attrs[semconv.MEMORY_RSS_BYTES] = mem["rss_bytes"]
        if mem.get("cuda_allocated_bytes") is not None:
            attrs[semconv.MEMORY_CUDA_ALLOCATED_BYTES] = mem["cuda_allocated_bytes"]
            attrs[semconv.MEMORY_CUDA_RESERVED_BYTES] = mem["cuda_reserved_bytes"]
            attrs[semconv.MEMORY_CUDA_PEAK_BYTES] = mem["cuda_peak_allocated_bytes"]
        if record.skipped:
            attrs[semconv.STEP_SKIPPED] = True
        attrs[semconv.OVERHEAD_SECONDS] = record.overhead_s
        span.set_attributes(attrs)
        for anomaly in record.anomalies:
            span.add_event(semconv.EVENT_ANOMALY, {semconv.EVENT_ANOMALY_KIND: anomaly.kind,
                                                   semconv.EVENT_ANOMALY_DETAIL: anomaly.detail[:semconv.MAX_ATTRIBUTE_LENGTH]})
        if exc is not None:
            event = {"exception.type": type(exc).__qualname__}
            if self.settings.record_exception_messages:
                event["exception.message"] = str(exc)[:semconv.MAX_ATTRIBUTE_LENGTH]
            span.add_event("exception", event)
            span.set_status(Status(StatusCode.ERROR, type(exc).__qualname__))
        elif record.nonfinite:
            span.set_status(Status(StatusCode.ERROR, "non-finite step: " + ", ".join(record.anomaly_kinds)))
        span.end(end_time=record.end_unix_ns)

    def _log_anomaly(self, anomaly) -> None:
        n = self._log_counts[anomaly.kind] = self._log_counts[anomaly.kind] + 1
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            suffix = f" ({n} so far)" if n > _LOG_FIRST else ""
            logger.warning("step %s %s: %s: %s%s", anomaly.step, anomaly.operation, anomaly.kind, anomaly.detail, suffix)

    # ------------------------------------------------------------ reports
    def summary(self) -> dict[str, Any]:
        """The run so far: totals, anomalies by kind, telemetry health, last step."""
        h = self.history
        totals = dict(h.totals)
        for key in ("steps", "anomaly_steps", "nonfinite_steps", "skipped_steps", "failed_steps", "events"):
            totals.setdefault(key, 0)
        dropped: collections.Counter[str] = collections.Counter()
        exported = 0
        for proc in self.processors:
            dropped.update(proc.dropped)
            exported += proc.exported
        out = {
            "torchtrace_version": __version__,
            "run_id": self.settings.run_id,
            "service_name": self.settings.service_name,
            "rank": self.identity.rank,
            "local_rank": self.identity.local_rank,
            "world_size": self.identity.world_size,
            "level": self.level.value,
            "mode": self.mode.value,
            "started_unix": self.started_unix,
            "now_unix": time.time(),
            "totals": totals,
            "anomalies_by_kind": dict(h.anomaly_counts),
            "operations": dict(h.operations),
            "last_step": h.last_record.summary() if h.last_record else None,
            "telemetry": {
                "metrics_url": self.metrics_url,
                "spans_file": str(self.spans_path) if self.spans_path else None,
                "otlp_endpoint": _redact_url(self.settings.otlp_endpoint),
                "spans_exported": exported,
                "spans_dropped": dict(dropped),
                "internal_errors": dict(self.errors.by_component),
                "metrics_pushes": self.metrics_pusher.pushes if self.metrics_pusher else None,
                "metrics_push_failures": self.metrics_pusher.failures if self.metrics_pusher else None,
            },
        }
        for name, section in list(self.report_sections.items()):
            try:
                out[name] = section()
            except Exception as exc:
                self.errors.report("record", exc)
        return out

    def report(self) -> dict[str, Any]:
        """The full report: the summary plus recent steps, the event timeline and settings."""
        out = self.summary()
        out["steps"] = self.history.steps()
        out["events"] = [e.as_dict() for e in self.history.events()]
        out["settings"] = _public_settings(self.settings)
        out["finished_unix"] = time.time()
        return out

    def write_report(self, path: str | os.PathLike[str] | None = None) -> Path | None:
        target = Path(path) if path is not None else self.report_path
        if target is None:
            return None
        return files.write_json_atomic(target, self.report(), max_bytes=self.settings.max_file_bytes)

    @property
    def metrics_url(self) -> str | None:
        return f"{self.server.url}/metrics" if self.server and self.server.url else None

    # ------------------------------------------------------------ shutdown
    def flush(self, timeout_s: float | None = None) -> bool:
        """Finish deferred records and push queued spans out, within ``timeout_s``."""
        timeout = self.settings.shutdown_timeout_s if timeout_s is None else timeout_s
        self.finish_deferred(block=True)
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
        self.closed = True
        deadline = time.monotonic() + self.settings.shutdown_timeout_s
        if at_exit:
            for proc in self.processors:
                proc.prepare_exit()
        try:
            self.finish_deferred(block=True)
        except Exception as exc:
            self.errors.report("record", exc)
        for probe in list(self.probes):
            try:
                getattr(probe, "close", lambda: None)()
            except Exception as exc:
                self.errors.report("other", exc)
        try:
            self.write_report()
        except Exception as exc:
            self.errors.report("files", exc)
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
            try:
                self.metrics_pusher.shutdown(max(0.05, deadline - time.monotonic()))
            except Exception as exc:
                self.errors.report("metrics", exc)
        if self.server is not None:
            try:
                self.server.stop(max(0.1, deadline - time.monotonic()))
            except Exception as exc:
                self.errors.report("server", exc)
        try:
            self.write_report()  # again, with the final export counts
        except Exception as exc:
            self.errors.report("files", exc)


def _capped(names: list[str]) -> list[str]:
    return [n[:200] for n in names[: semconv.MAX_NAMES_PER_ATTRIBUTE]]


def _redact_url(url: str | None) -> str | None:
    if not url:
        return url
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _public_settings(settings: Settings) -> dict[str, Any]:
    """Settings safe to write down: no headers, no credentials in URLs."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.name in ("otlp_headers", "debug_token"):
            value = "<set>" if value else None
        elif f.name == "otlp_endpoint":
            value = _redact_url(value)
        elif hasattr(value, "value"):
            value = value.value
        elif isinstance(value, Path):
            value = str(value)
        elif isinstance(value, dict) or hasattr(value, "items"):
            value = {str(k): str(v)[:200] for k, v in dict(value).items()}
        out[f.name] = value
    return out
