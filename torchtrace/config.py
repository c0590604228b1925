"""Settings: arguments beat ``TORCHTRACE_*``/``OTEL_*`` environment variables, which beat defaults.

A bad argument raises ``ValueError`` at configure time, naming the setting and the accepted
values. A bad environment value is logged and replaced by the default: an environment typo
must not kill a three-week job at start-up, but a typo in code should be fixed at once.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import operator
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from torchtrace.levels import DebugLevel, DebugMode

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- environment variables
ENV_DISABLED = "TORCHTRACE_DISABLED"
"""``1``/``true``: torchtrace does nothing at all: no threads, sockets or files."""
ENV_LEVEL = "TORCHTRACE_LEVEL"
"""off, basic, advanced or extreme."""
ENV_MODE = "TORCHTRACE_MODE"
"""A DebugMode turned on on top of the level (anomaly_detection, profiling, ...)."""
ENV_RUN_ID = "TORCHTRACE_RUN_ID"
"""The run's identifier; shared by all ranks of a job. Default: torchrun's run id or a new one."""
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
ENV_UPDATE_RATIO_INTERVAL = "TORCHTRACE_UPDATE_RATIO_INTERVAL"
ENV_PARAM_CHECK_INTERVAL = "TORCHTRACE_PARAM_CHECK_INTERVAL"
"""Steps between two cross-rank step-time gathers for torchtrace_rank_step_skew (off: never). Default 50."""
ENV_OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENV_METRICS_EXPORTER = "TORCHTRACE_METRICS_EXPORTER"
"""prometheus (default: the /metrics endpoint), otlp (push to the collector), both, none."""
ENV_METRICS_EXPORT_INTERVAL = "TORCHTRACE_METRICS_EXPORT_INTERVAL"
"""Seconds between OTLP metrics pushes (default 10)."""
ENV_OTLP_METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
ENV_OTLP_CERTIFICATE = "OTEL_EXPORTER_OTLP_CERTIFICATE"
"""A CA bundle (PEM file) trusted for https OTLP endpoints."""
ENV_OTLP_TRACES_CERTIFICATE = "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE"
ENV_PEAK_FLOPS = "TORCHTRACE_PEAK_FLOPS"
"""Peak FLOP/s of one device for MFU (e.g. 989e12), instead of the table of known accelerators."""
ENV_THROUGHPUT = "TORCHTRACE_THROUGHPUT"
"""``0``/``false``: no batch sizes, FLOP counts, learning rates, phases or goodput per step (default on)."""

# ---------------------------------------------------------------- one default per threshold
DEFAULT_GRAD_EXPLOSION_THRESHOLD = 1e3
"""Global (and per-tensor) L2 gradient norm above which a step is a ``grad_explosion``.

The one default of every API that judges explosion (``configure``, ``TrainingMonitor``,
``PyTorchDebugger.check_gradients``, ``check_gradient_explosion``, ``PyTorchDebugConfig``);
docs/seed-api.md says why this value.
"""
DEFAULT_GRAD_VANISHING_THRESHOLD = 1e-7
"""Global L2 gradient norm below which a step is ``grad_vanishing`` (the one default, as above)."""

OTLP_PROTOCOLS = ("grpc", "http/protobuf")
GUARD_POLICIES = ("warn", "skip", "raise")
PORT_POLICIES = ("next", "ephemeral", "off")
METRICS_EXPORTERS = ("prometheus", "otlp", "both", "none")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


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

    # ------------------------------------------------------------ resolution
    @classmethod
    def resolve(cls, args: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> "Settings":
        """Merge arguments (``None`` means "not given"), environment and defaults; validate.

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
        for name, (env_names, parse) in _ENV_SOURCES.items():
            if name in given:
                continue
            for env_name in env_names:
                raw = env.get(env_name)
                if raw is None or raw.strip() == "" and name != "disabled":
                    continue
                try:
                    values[name] = parse(raw, env_name)
                except ValueError as exc:
                    logger.warning("ignoring %s: %s; using the default", env_name, exc)
                break
        # Arguments are validated strictly.
        for name, value in given.items():
            validator = _VALIDATORS.get(name)
            values[name] = validator(value, name) if validator else value
        if not values.get("run_id"):
            elastic = env.get("TORCHELASTIC_RUN_ID", "")
            values["run_id"] = elastic if elastic and elastic != "none" else new_run_id()
        _check_run_id(values["run_id"], "run_id")
        values.setdefault("otlp_protocol", "http/protobuf")
        return cls(**values)

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------- parsers (raise ValueError)
def _bool(value: Any, setting: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        if key in _TRUE:
            return True
        if key in _FALSE:
            return False
    raise ValueError(f"{setting}={value!r} is not valid; accepted values: true, false, 1, 0")


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    def parse(value: Any, setting: str) -> str:
        key = value.strip().lower() if isinstance(value, str) else value
        if key not in choices:
            raise ValueError(f"{setting}={value!r} is not valid; accepted values: {', '.join(choices)}")
        return key

    return parse


def _port(value: Any, setting: str) -> int | None:
    accepted = "accepted values: an integer 0-65535 (0 = any free port) or 'off'"
    if isinstance(value, str):
        key = value.strip().lower()
        if key in ("off", "none", "disabled", "false"):
            return None
        if not key.isdigit():
            raise ValueError(f"{setting}={value!r} is not valid; {accepted}")
        value = int(key)
    number = _as_int(value)
    if number is None or not 0 <= number <= 65535:
        raise ValueError(f"{setting}={value!r} is not valid; {accepted}")
    return number


def _is_bool(value: Any) -> bool:
    """A Python or numpy bool (numpy's is not a subclass of ``bool``)."""
    return isinstance(value, bool) or type(value).__name__ in ("bool", "bool_")


def _as_int(value: Any) -> int | None:
    """``value`` as an int when it is one (an int, a numpy integer, a string of digits), else None.

    A bool is not an integer here (``span_queue_size=True`` is a mistake, not 1), and neither
    is a float, even an integral one: an integer setting is a count.
    """
    if _is_bool(value):
        return None
    if isinstance(value, str):
        text = value.strip()
        digits = text[1:] if text[:1] in "+-" else text
        if not digits.isdigit() or len(digits) > 18:
            return None
        return int(text)
    if isinstance(value, float):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _positive_float(value: Any, setting: str) -> float:
    accepted = "accepted values: a positive finite number"
    if _is_bool(value):
        raise ValueError(f"{setting}={value!r} is not valid; {accepted}")
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise ValueError(f"{setting}={value!r} is not valid; {accepted}") from None
    if not (number > 0 and number != float("inf")):
        raise ValueError(f"{setting}={value!r} is not valid; {accepted}")
    return number


def _positive_int(value: Any, setting: str) -> int:
    number = _as_int(value)
    if number is None or number <= 0:
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: a positive integer")
    return number


def _optional_positive_int(value: Any, setting: str) -> int | None:
    if isinstance(value, str) and value.strip().lower() in ("off", "none", ""):
        return None
    return _positive_int(value, setting)


def _non_negative_int(value: Any, setting: str) -> int:
    number = _as_int(value)
    if number is None or number < 0:
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: an integer >= 0")
    return number


def _nonempty_str(value: Any, setting: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: a non-empty string")
    return value.strip()


def _check_run_id(value: str, setting: str) -> str:
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
    if not value or len(value) > 128 or set(value) - allowed or value in (".", ".."):
        raise ValueError(
            f"{setting}={value!r} is not valid; accepted values: 1-128 characters of letters, digits, '-', '_', '.'"
        )
    return value


_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\Z")


def valid_host(host: str) -> bool:
    """True for an IPv4 or IPv6 address or a DNS name (labels of letters, digits, ``-``, ``_``).

    >>> valid_host("127.0.0.1"), valid_host("::1"), valid_host("node-3.cluster"), valid_host("not a host")
    (True, True, True, False)
    """
    if not isinstance(host, str) or not host:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    if not name or len(name) > 253:
        return False
    return all(_HOST_LABEL.match(label) and not label.startswith("-") for label in name.split("."))


def _host(value: Any, setting: str) -> str:
    text = value.strip() if isinstance(value, str) else None
    if text and text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if text is None or not valid_host(text):
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: an IP address (127.0.0.1, ::1, "
                         "0.0.0.0) or a host name, without a port")
    return text


def _check_endpoint(value: Any, setting: str) -> str:
    """A collector URL parsed completely now, so nothing about it can fail later: scheme
    http or https, a valid host, a port 1-65535 if one is given, no query or fragment, no
    whitespace. The scheme is returned in lower case."""
    accepted = ("accepted values: a URL starting with http:// or https://, with a valid host, an optional port "
                "1-65535 and an optional path (e.g. http://127.0.0.1:4318)")
    shown = "<not a string>" if not isinstance(value, str) else repr(_without_credentials(value)[:200])
    bad = ValueError(f"{setting}={shown} is not valid; {accepted}")
    if not isinstance(value, str) or not value.isprintable() or any(c.isspace() for c in value):
        raise bad
    try:
        parts = urlsplit(value)
        port = parts.port
        host = parts.hostname
    except ValueError:
        raise bad from None
    if parts.scheme.lower() not in ("http", "https") or not value[:len(parts.scheme) + 3].lower().endswith("://"):
        raise bad
    if not host or parts.query or parts.fragment or value.endswith(("?", "#")):
        raise bad
    hostport = parts.netloc.rpartition("@")[2]
    if hostport.startswith("["):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad from None
    elif not valid_host(host):
        raise bad
    if port is not None and not 1 <= port <= 65535 or hostport.endswith(":"):
        raise bad
    return parts.scheme.lower() + value[len(parts.scheme):]


def _without_credentials(url: str) -> str:
    """``url`` with any ``user:password@`` part removed, for error messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    return scheme + sep + netloc.rpartition("@")[2] + slash + path


def _path(value: Any, setting: str) -> Path:
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: a directory path")
    return Path(value)


def _mapping(value: Any, setting: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: a mapping of names to values")
    return dict(value)


def _debug_token(value: Any, setting: str) -> str:
    if not isinstance(value, str) or len(value.strip()) < 16 or any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(f"{setting}=<hidden> is not valid; accepted values: a string of at least 16 printable "
                         "characters without spaces")
    return value
def _too_small(value: Any, setting: str, minimum: int) -> int:
    raise ValueError(f"{setting}={value!r} is not valid; accepted values: an integer >= {minimum}")
def _readable_file(value: Any, setting: str) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.path.isfile(value) or not os.access(value, os.R_OK):
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: the path of a readable PEM file")
    return os.fspath(value)


_VALIDATORS: dict[str, Callable[[Any, str], Any]] = {
    "disabled": _bool,
    "service_name": _nonempty_str,
    "run_id": _check_run_id,
    "level": lambda v, s: DebugLevel.parse(v, s),
    "mode": lambda v, s: DebugMode.parse(v, s),
    "run_dir": _path,
    "write_files": _bool,
    "prometheus_host": _host,
    "prometheus_port": _port,
    "port_policy": _choice(PORT_POLICIES),
    "otlp_endpoint": _check_endpoint,
    "otlp_protocol": _choice(OTLP_PROTOCOLS),
    "otlp_headers": _mapping,
    "grad_explosion_threshold": _positive_float,
    "grad_vanishing_threshold": _positive_float,
    "guard": _choice(GUARD_POLICIES),
    "max_consecutive_bad_steps": _optional_positive_int,
    "span_queue_size": _positive_int,
    "export_timeout_s": _positive_float,
    "shutdown_timeout_s": _positive_float,
    "history_size": _positive_int,
    "max_file_bytes": _positive_int,
    "strict": _bool,
    "record_exception_messages": _bool,
    "register_atexit": _bool,
    "resource_attributes": _mapping,
    "debug_api": _bool,
    "debug_token": _debug_token,
    "shared_step_trace": _bool,
    "rank_skew_interval": _optional_positive_int,
    "update_ratio_interval": lambda v, s: _non_negative_int(v, s),
    "param_check_interval": _positive_int,
    "forensics": _bool,
    "forensics_max_replays": lambda v, s: _non_negative_int(v, s),
    "leak_window": lambda v, s: _positive_int(v, s) if _positive_int(v, s) >= 4 else _too_small(v, s, 4),
    "leak_threshold_bytes": _positive_int,
    "leak_confirm_steps": _positive_int,
    "metrics_exporter": _choice(METRICS_EXPORTERS),
    "metrics_export_interval_s": _positive_float,
    "otlp_metrics_endpoint": _check_endpoint,
    "otlp_certificate": _readable_file,
    "peak_flops": _positive_float,
    "throughput": _bool,
}

# setting -> (environment variables in order of precedence, parser)
_ENV_SOURCES: dict[str, tuple[tuple[str, ...], Callable[[str, str], Any]]] = {
    "disabled": ((ENV_DISABLED, ENV_OTEL_SDK_DISABLED), _bool),
    "service_name": ((ENV_OTEL_SERVICE_NAME,), _nonempty_str),
    "run_id": ((ENV_RUN_ID,), _check_run_id),
    "level": ((ENV_LEVEL,), lambda v, s: DebugLevel.parse(v, s)),
    "mode": ((ENV_MODE,), lambda v, s: DebugMode.parse(v, s)),
    "run_dir": ((ENV_RUN_DIR,), _path),
    "prometheus_host": ((ENV_PROMETHEUS_HOST,), _host),
    "prometheus_port": ((ENV_PROMETHEUS_PORT,), _port),
    "port_policy": ((ENV_PORT_POLICY,), _choice(PORT_POLICIES)),
    "otlp_endpoint": ((ENV_OTLP_TRACES_ENDPOINT, ENV_OTLP_ENDPOINT), _check_endpoint),
    "otlp_protocol": ((ENV_OTLP_TRACES_PROTOCOL, ENV_OTLP_PROTOCOL), _choice(OTLP_PROTOCOLS)),
    "guard": ((ENV_GUARD,), _choice(GUARD_POLICIES)),
    "strict": ((ENV_STRICT,), _bool),
    "debug_api": ((ENV_DEBUG_API,), _bool),
    "debug_token": ((ENV_DEBUG_TOKEN,), _debug_token),
    "shared_step_trace": ((ENV_SHARED_STEP_TRACE,), _bool),
    "rank_skew_interval": ((ENV_RANK_SKEW_INTERVAL,), _optional_positive_int),
    "update_ratio_interval": ((ENV_UPDATE_RATIO_INTERVAL,), lambda v, s: _non_negative_int(v, s)),
    "param_check_interval": ((ENV_PARAM_CHECK_INTERVAL,), _positive_int),
    "forensics": ((ENV_FORENSICS,), _bool),
    "forensics_max_replays": ((ENV_FORENSICS_MAX_REPLAYS,), lambda v, s: _non_negative_int(v, s)),
    "metrics_exporter": ((ENV_METRICS_EXPORTER,), _choice(METRICS_EXPORTERS)),
    "metrics_export_interval_s": ((ENV_METRICS_EXPORT_INTERVAL,), _positive_float),
    "otlp_metrics_endpoint": ((ENV_OTLP_METRICS_ENDPOINT, ENV_OTLP_ENDPOINT), _check_endpoint),
    "otlp_certificate": ((ENV_OTLP_TRACES_CERTIFICATE, ENV_OTLP_CERTIFICATE), _readable_file),
    "peak_flops": ((ENV_PEAK_FLOPS,), _positive_float),
    "throughput": ((ENV_THROUGHPUT,), _bool),
}


def disabled_by_environment(environ: Mapping[str, str] | None = None) -> bool:
    """True when TORCHTRACE_DISABLED or OTEL_SDK_DISABLED says so (bad values read as false)."""
    env = os.environ if environ is None else environ
    for name in (ENV_DISABLED, ENV_OTEL_SDK_DISABLED):
        raw = env.get(name)
        if raw is not None and raw.strip().lower() in _TRUE:
            return True
    return False
