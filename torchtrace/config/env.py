"""The environment variables torchtrace reads, and the one check made before any settings exist.

Every name here is re-exported by :mod:`torchtrace.config`, which documents how a value from
the environment ranks against arguments and defaults.

>>> ENV_LEVEL
'TORCHTRACE_LEVEL'
"""

from __future__ import annotations

import difflib
import os
from typing import Iterable, Mapping

ENV_DISABLED = "TORCHTRACE_DISABLED"
"""``1``/``true``: torchtrace does nothing at all: no threads, sockets or files."""
ENV_LEVEL = "TORCHTRACE_LEVEL"
"""off, basic, advanced or extreme."""
ENV_MODE = "TORCHTRACE_MODE"
"""A DebugMode turned on on top of the level (anomaly_detection, profiling, ...)."""
ENV_RUN_ID = "TORCHTRACE_RUN_ID"
"""The run's identifier; shared by all ranks of a job. Default: torchrun's run id or a new one."""
ENV_JOB_ID = "TORCHTRACE_JOB_ID"
"""The job's identifier, shared by every rank and every attempt (restart) of one training job.
Default: torchrun's run id, else Slurm's job id, else the run id. When given, it is also the run
id's default, so the attempts of the job live side by side in one run directory."""
ENV_RUN_DIR = "TORCHTRACE_RUN_DIR"
"""Where spans.jsonl and report.json are written. Default ./torchtrace-runs."""
ENV_PROMETHEUS_HOST = "TORCHTRACE_PROMETHEUS_HOST"
"""Address the /metrics server binds. Default 127.0.0.1."""
ENV_PROMETHEUS_PORT = "TORCHTRACE_PROMETHEUS_PORT"
"""Port of the /metrics server: a number (local rank r adds r), 0 for any free port, off for none."""
ENV_PORT_POLICY = "TORCHTRACE_PORT_POLICY"
"""What to do when the port is taken: next (try the next ports), ephemeral, off."""
ENV_GUARD = "TORCHTRACE_GUARD"
"""Guard policy for a non-finite step: warn, skip or raise."""
ENV_STRICT = "TORCHTRACE_STRICT"
"""``1``: torchtrace's own internal errors are raised (for torchtrace's tests), not swallowed."""
ENV_DEBUG_API = "TORCHTRACE_DEBUG_API"
"""``0``/``false``: no /debug endpoints and no live page beside /metrics. Default on."""
ENV_DEBUG_TOKEN = "TORCHTRACE_DEBUG_TOKEN"
"""The token mutating /debug requests must carry (``Authorization: Bearer``). Default: random per process."""
ENV_FORENSICS = "TORCHTRACE_FORENSICS"
"""``0``: never replay a non-finite step to localise it (default on)."""
ENV_FORENSICS_MAX_REPLAYS = "TORCHTRACE_FORENSICS_MAX_REPLAYS"
"""At most this many forensic replays per run (default 3; 0 = none)."""
ENV_OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
ENV_SHARED_STEP_TRACE = "TORCHTRACE_SHARED_STEP_TRACE"
"""``1``: every rank's span of one step joins one trace, its id derived from (run id, operation, step)."""
ENV_RANK_SKEW_INTERVAL = "TORCHTRACE_RANK_SKEW_INTERVAL"
"""Steps between two cross-rank step-time gathers for torchtrace_rank_step_skew (off: never). Default 50."""
ENV_HANG_TIMEOUT_S = "TORCHTRACE_HANG_TIMEOUT_S"
"""Seconds without progress that make a hang; unset or ``adaptive``: computed from recent step times."""
ENV_ON_HANG = "TORCHTRACE_ON_HANG"
"""What a hang does: ``record`` (the default) or ``abort``."""
ENV_UPDATE_RATIO_INTERVAL = "TORCHTRACE_UPDATE_RATIO_INTERVAL"
"""ADVANCED: steps between two update/weight ratio measurements (0: never). Default 50."""
ENV_PARAM_CHECK_INTERVAL = "TORCHTRACE_PARAM_CHECK_INTERVAL"
"""ADVANCED: steps between two parameter norm and finiteness checks (and on every bad step). Default 10."""
ENV_OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENV_OTEL_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
"""``none``: no OTLP span export to an endpoint that comes from the environment (spans.jsonl is still written)."""
ENV_METRICS_EXPORTER = "TORCHTRACE_METRICS_EXPORTER"
"""prometheus (default: the /metrics endpoint), otlp (push to the collector), both, none."""
ENV_METRICS_EXPORT_INTERVAL = "TORCHTRACE_METRICS_EXPORT_INTERVAL"
"""Seconds between OTLP metrics pushes (default 10)."""
ENV_OTLP_METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
ENV_OTLP_CERTIFICATE = "OTEL_EXPORTER_OTLP_CERTIFICATE"
"""A CA bundle (PEM file) trusted for https OTLP endpoints."""
ENV_OTLP_TRACES_CERTIFICATE = "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE"
ENV_OTLP_HEADERS = "OTEL_EXPORTER_OTLP_HEADERS"
"""Headers sent with every OTLP export: ``name=value`` pairs separated by commas, values URL-encoded.
Parsed by torchtrace (never echoed: a malformed entry is named by its position only)."""
ENV_OTLP_TRACES_HEADERS = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
ENV_PEAK_FLOPS = "TORCHTRACE_PEAK_FLOPS"
"""Peak FLOP/s of one device for MFU (e.g. 989e12), instead of the table of known accelerators."""
ENV_THROUGHPUT = "TORCHTRACE_THROUGHPUT"
"""``0``/``false``: no batch sizes, FLOP counts, learning rates, phases or goodput per step (default on)."""

TRUE_STRINGS = frozenset({"1", "true", "yes", "on"})
"""Strings a boolean setting reads as true (after ``strip().lower()``)."""
FALSE_STRINGS = frozenset({"0", "false", "no", "off", ""})
"""Strings a boolean setting reads as false (after ``strip().lower()``)."""


def disabled_by_environment(environ: Mapping[str, str] | None = None) -> bool:
    """True when TORCHTRACE_DISABLED or OTEL_SDK_DISABLED says so (bad values read as false)."""
    env = os.environ if environ is None else environ
    for name in (ENV_DISABLED, ENV_OTEL_SDK_DISABLED):
        raw = env.get(name)
        if raw is not None and raw.strip().lower() in TRUE_STRINGS:
            return True
    return False


def misspelt(environ: Mapping[str, str], known: Iterable[str]) -> list[tuple[str, str]]:
    """The ``TORCHTRACE_*`` variables of ``environ`` that torchtrace does not read but that are a
    letter or two away from one it does (``TORCHTRACE_GAURD``), each with the name it reads.
    Other names (a tool's own ``TORCHTRACE_*``) are left alone.

    >>> misspelt({"TORCHTRACE_GAURD": "skip", "TORCHTRACE_GUARD": "warn", "OMP_NUM_THREADS": "1"}, [ENV_GUARD])
    [('TORCHTRACE_GAURD', 'TORCHTRACE_GUARD')]
    """
    names = sorted(set(known))
    found = []
    for name in sorted(environ):
        if name.startswith("TORCHTRACE_") and name not in names:
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.85)
            if close:
                found.append((name, close[0]))
    return found


class SignalEndpoint(str):
    """An endpoint read from ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
    ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``: by the OpenTelemetry spec, the full URL of that
    signal, which an HTTP exporter posts to as it is (:func:`torchtrace.export.endpoints.signal_url`).
    Everything else about it is the string's."""

    __slots__ = ()


SIGNAL_ENDPOINT_VARIABLES = (ENV_OTLP_TRACES_ENDPOINT, ENV_OTLP_METRICS_ENDPOINT)
