"""Settings: arguments beat ``TORCHTRACE_*``/``OTEL_*`` environment variables, which beat defaults.

A bad argument raises ``ValueError`` at configure time, naming the setting and the accepted
values. A bad environment value is logged and replaced by the default: an environment typo
must not kill a three-week job at start-up, but a typo in code should be fixed at once.

The environment variables are in :mod:`torchtrace.config.env` and the parsers of every
setting in :mod:`torchtrace.config.parsers`; their public names are importable from here.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from torchtrace.config.env import (
    ENV_DEBUG_API,
    ENV_DEBUG_TOKEN,
    ENV_DISABLED,
    ENV_FORENSICS,
    ENV_FORENSICS_MAX_REPLAYS,
    ENV_GUARD,
    ENV_JOB_ID,
    ENV_LEVEL,
    ENV_METRICS_EXPORT_INTERVAL,
    ENV_METRICS_EXPORTER,
    ENV_MODE,
    ENV_OTEL_SDK_DISABLED,
    ENV_OTEL_SERVICE_NAME,
    ENV_OTEL_TRACES_EXPORTER,
    ENV_OTLP_CERTIFICATE,
    ENV_OTLP_ENDPOINT,
    ENV_OTLP_HEADERS,
    ENV_OTLP_METRICS_ENDPOINT,
    ENV_OTLP_PROTOCOL,
    ENV_OTLP_TRACES_CERTIFICATE,
    ENV_OTLP_TRACES_ENDPOINT,
    ENV_OTLP_TRACES_HEADERS,
    ENV_OTLP_TRACES_PROTOCOL,
    ENV_PARAM_CHECK_INTERVAL,
    ENV_PEAK_FLOPS,
    ENV_PORT_POLICY,
    ENV_PROMETHEUS_HOST,
    ENV_PROMETHEUS_PORT,
    ENV_RANK_SKEW_INTERVAL,
    ENV_RUN_DIR,
    ENV_RUN_ID,
    ENV_SHARED_STEP_TRACE,
    ENV_STRICT,
    ENV_THROUGHPUT,
    ENV_UPDATE_RATIO_INTERVAL,
    disabled_by_environment,
    misspelt,
)
from torchtrace.config.parsers import (
    ENV_SOURCES,
    GUARD_POLICIES,
    METRICS_EXPORTERS,
    OTLP_PROTOCOLS,
    PORT_POLICIES,
    VALIDATORS,
    check_run_id,
    valid_host,
)
from torchtrace.errors import get_logger
from torchtrace.levels import DebugLevel, DebugMode

__all__ = [
    "DEFAULT_GRAD_EXPLOSION_THRESHOLD", "DEFAULT_GRAD_VANISHING_THRESHOLD", "Settings", "new_run_id",
    "disabled_by_environment", "valid_host", "check_run_id", "VALIDATORS", "ENV_SOURCES",
    "GUARD_POLICIES", "METRICS_EXPORTERS", "OTLP_PROTOCOLS", "PORT_POLICIES",
    "ENV_DISABLED", "ENV_LEVEL", "ENV_MODE", "ENV_RUN_ID", "ENV_RUN_DIR", "ENV_PROMETHEUS_HOST",
    "ENV_PROMETHEUS_PORT", "ENV_PORT_POLICY", "ENV_GUARD", "ENV_STRICT", "ENV_DEBUG_API", "ENV_DEBUG_TOKEN",
    "ENV_FORENSICS", "ENV_FORENSICS_MAX_REPLAYS", "ENV_OTEL_SDK_DISABLED", "ENV_SHARED_STEP_TRACE",
    "ENV_RANK_SKEW_INTERVAL", "ENV_UPDATE_RATIO_INTERVAL", "ENV_PARAM_CHECK_INTERVAL", "ENV_OTEL_SERVICE_NAME",
    "ENV_OTLP_ENDPOINT", "ENV_OTLP_TRACES_ENDPOINT", "ENV_OTLP_PROTOCOL", "ENV_OTLP_TRACES_PROTOCOL",
    "ENV_METRICS_EXPORTER", "ENV_METRICS_EXPORT_INTERVAL", "ENV_OTLP_METRICS_ENDPOINT", "ENV_OTLP_CERTIFICATE",
    "ENV_OTLP_TRACES_CERTIFICATE", "ENV_PEAK_FLOPS", "ENV_THROUGHPUT", "ENV_OTLP_HEADERS",
    "ENV_OTLP_TRACES_HEADERS", "ENV_JOB_ID",
]

logger = get_logger(__name__)

# ---------------------------------------------------------------- one default per threshold
DEFAULT_GRAD_EXPLOSION_THRESHOLD = 1e3
"""Global (and per-tensor) L2 gradient norm above which a step is a ``grad_explosion``.

The one default of every API that judges explosion (``configure``, ``TrainingMonitor``,
``PyTorchDebugger.check_gradients``, ``check_gradient_explosion``, ``PyTorchDebugConfig``);
docs/seed-api.md says why this value.
"""
DEFAULT_GRAD_VANISHING_THRESHOLD = 1e-7
"""Global L2 gradient norm below which a step is ``grad_vanishing`` (the one default, as above)."""


def new_run_id() -> str:
    """A sortable, unique run id: UTC time plus 6 random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class Settings:
    """Everything ``configure()`` accepts. Build with :meth:`resolve`, not directly.

    >>> s = Settings.resolve({"level": "advanced", "prometheus_port": "off"}, environ={})
    >>> (s.level, s.prometheus_port)
    (<DebugLevel.ADVANCED: 'advanced'>, None)
    """

    disabled: bool = False
    service_name: str = "torchtrace"
    run_id: str = ""
    job_id: str | None = None  # the job's id across ranks and attempts (see torchtrace.job.identity)
    level: DebugLevel = DebugLevel.BASIC
    mode: DebugMode = DebugMode.NONE
    run_dir: Path = Path("torchtrace-runs")
    write_files: bool = True
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int | None = 9464
    port_policy: str = "next"
    otlp_endpoint: str | None = None
    otlp_protocol: str = "http/protobuf"
    otlp_headers: Mapping[str, str] | None = field(default=None, repr=False)
    grad_explosion_threshold: float = DEFAULT_GRAD_EXPLOSION_THRESHOLD
    grad_vanishing_threshold: float = DEFAULT_GRAD_VANISHING_THRESHOLD
    guard: str = "warn"
    max_consecutive_bad_steps: int | None = None
    span_queue_size: int = 4096
    export_timeout_s: float = 5.0
    shutdown_timeout_s: float = 1.0
    history_size: int = 1000
    max_file_bytes: int = 256 * 1024 * 1024
    strict: bool = False
    record_exception_messages: bool = False
    register_atexit: bool = True
    resource_attributes: Mapping[str, Any] | None = None
    debug_api: bool = True
    debug_token: str | None = field(default=None, repr=False)
    shared_step_trace: bool = False
    rank_skew_interval: int | None = 50
    update_ratio_interval: int = 50  # ADVANCED: update/weight ratio every N steps (0: never)
    param_check_interval: int = 10  # ADVANCED: parameter norms and finiteness every N steps (and on bad steps)
    forensics: bool = True
    forensics_max_replays: int = 3
    leak_window: int = 32  # steps in the leak detector's slope window
    leak_threshold_bytes: int = 256 * 1024  # bytes per step of sustained growth that is a leak
    leak_confirm_steps: int = 8  # steps the slow path (census, tracemalloc) watches before reporting
    metrics_exporter: str = "prometheus"
    metrics_export_interval_s: float = 10.0
    otlp_metrics_endpoint: str | None = None
    otlp_certificate: str | None = None
    peak_flops: float | None = None  # FLOP/s of one device for MFU; None: the table of known accelerators
    throughput: bool = True  # samples, tokens, FLOPs, learning rate, phases and goodput at every level but OFF
    hang_timeout_s: float | None = None  # no progress this long is a hang; None: adaptive (docs/hangs.md)
    on_hang: str = "record"  # record: report it and keep waiting; abort: write everything and exit non-zero

    # ------------------------------------------------------------ resolution
    @classmethod
    def resolve(cls, args: Mapping[str, Any], environ: Mapping[str, str] | None = None,
                default_run_id: str | None = None, *, warn: bool = True) -> "Settings":
        """Merge arguments (``None`` means "not given"), environment and defaults; validate.

        ``default_run_id``: the run id when neither an argument, the environment nor the launcher
        names one (else a new one, :func:`new_run_id`). ``warn``: log a warning for each
        environment variable ignored (a bad value, a misspelt name); False for a second
        resolution of one environment, whose first named them.

        Raises:
            ValueError: an argument is invalid; the message names the setting and what it accepts.
            TypeError: an unknown setting name.
        """
        env = os.environ if environ is None else environ
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - names)
        if unknown:
            raise TypeError(f"unknown torchtrace setting(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        given = {k: v for k, v in args.items() if v is not None}
        values: dict[str, Any] = {}
        for name, (env_names, parse) in ENV_SOURCES.items():
            if name in given:
                continue
            for env_name in env_names:
                raw = env.get(env_name)
                if raw is None or raw.strip() == "" and name != "disabled":
                    continue
                try:
                    values[name] = parse(raw, env_name)
                except ValueError as exc:
                    if warn:
                        logger.warning("ignoring %s: %s; using the default", env_name, exc)
                break
        if warn:
            for env_name, meant in misspelt(env, (n for env_names, _ in ENV_SOURCES.values() for n in env_names)):
                logger.warning("ignoring %s: torchtrace reads no such variable; did you mean %s?", env_name, meant)
        if env.get(ENV_OTEL_TRACES_EXPORTER, "").strip().lower() == "none":
            values.pop("otlp_endpoint", None)  # the platform's "no trace exporter"; an argument still wins
        # Arguments are validated strictly.
        for name, value in given.items():
            validator = VALIDATORS.get(name)
            values[name] = validator(value, name) if validator else value
        if not values.get("run_id") and values.get("job_id"):
            # A job id given by the user names the run directory too: every attempt finds the others.
            values["run_id"] = values["job_id"]
        if not values.get("run_id"):
            elastic = env.get("TORCHELASTIC_RUN_ID", "")
            values["run_id"] = elastic if elastic and elastic != "none" else default_run_id or new_run_id()
        check_run_id(values["run_id"], "run_id")
        values.setdefault("otlp_protocol", "http/protobuf")
        return cls(**values)

    # Any: each change is a field's value, of that field's own type.
    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

