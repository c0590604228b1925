"""The run's summary and report: what ``/debug/summary`` serves and ``report.json`` holds.

Bounded in bytes whatever the model: step summaries and events carry capped name lists (see
:mod:`torchtrace.record.step`), the history keeps the last ``history_size`` of each.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from torchtrace import files
from torchtrace._version import __version__
from torchtrace.config import Settings

if TYPE_CHECKING:
    from torchtrace.step.runtime import Runtime


def summary(rt: Runtime) -> dict[str, Any]:
    """The run so far: totals, anomalies by kind, telemetry health, last step, report sections."""
    h = rt.history
    totals = dict(h.totals)
    for key in ("steps", "anomaly_steps", "nonfinite_steps", "skipped_steps", "scaler_overflow_steps", "failed_steps",
                "events"):
        totals.setdefault(key, 0)
    last = h.last_record
    out = {
        "torchtrace_version": __version__,
        "run_id": rt.settings.run_id,
        "service_name": rt.settings.service_name,
        "rank": rt.identity.rank,
        "local_rank": rt.identity.local_rank,
        "world_size": rt.identity.world_size,
        "level": rt.level.value,
        "mode": rt.mode.value,
        "started_unix": rt.started_unix,
        "now_unix": time.time(),
        "totals": totals,
        "anomalies_by_kind": dict(h.anomaly_counts),
        "operations": dict(h.operations),
        "last_step": last.summary() if last is not None else None,
        "telemetry": telemetry(rt),
    }
    sections = dict(rt.report_sections)
    for name, section in sections.items():
        try:
            out[name] = section()
        except Exception as exc:
            rt.errors.report("record", exc)
    out.update(rt.probes.sections())
    return out


def telemetry(rt: Runtime) -> dict[str, Any]:
    """Where the telemetry goes and what was lost on the way."""
    dropped: collections.Counter[str] = collections.Counter()
    exported = 0
    for proc in rt.processors:
        dropped.update(proc.dropped)
        exported += proc.exported
    pusher = rt.metrics_pusher
    return {
        "metrics_url": rt.metrics_url,
        "spans_file": str(rt.spans_path) if rt.spans_path else None,
        "otlp_endpoint": redact_url(rt.settings.otlp_endpoint),
        "spans_exported": exported,
        "spans_dropped": dict(dropped),
        "span_exporters": [proc.accounting() for proc in rt.processors],
        "internal_errors": dict(rt.errors.by_component),
        "metrics_pushes": pusher.pushes if pusher else None,
        "metrics_push_failures": pusher.failures if pusher else None,
    }


def full_report(rt: Runtime) -> dict[str, Any]:
    """The summary plus recent steps, the event timeline and the settings."""
    out = summary(rt)
    out["steps"] = rt.history.steps()
    out["events"] = [e.as_dict() for e in rt.history.events()]
    out["settings"] = public_settings(rt.settings)
    out["finished_unix"] = time.time()
    return out


def write(rt: Runtime, path: str | os.PathLike[str] | None = None) -> Path | None:
    target = Path(path) if path is not None else rt.report_path
    if target is None:
        return None
    return files.write_json_atomic(target, full_report(rt), max_bytes=rt.settings.max_file_bytes)


def redact_url(url: str | None) -> str | None:
    """Scheme, host, port and path only: no credentials, query or fragment.

    >>> redact_url("http://user:secret@[::1]:4318/v1/traces?k=v")
    'http://[::1]:4318/v1/traces'
    """
    if not url:
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address keeps its brackets
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def public_settings(settings: Settings) -> dict[str, Any]:
    """Settings safe to write down: no headers, no credentials in URLs."""
    out = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.name in ("otlp_headers", "debug_token"):
            value = "<set>" if value else None
        elif f.name in ("otlp_endpoint", "otlp_metrics_endpoint"):
            value = redact_url(value)
        elif hasattr(value, "value"):
            value = value.value
        elif isinstance(value, Path):
            value = str(value)
        elif isinstance(value, dict) or hasattr(value, "items"):
            value = {str(k): str(v)[:200] for k, v in dict(value).items()}
        out[f.name] = value
    return out
