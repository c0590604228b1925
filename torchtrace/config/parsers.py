"""The parsers behind :class:`torchtrace.config.Settings`: one per kind of setting, each raising
``ValueError`` with a message that names the setting and the values it accepts.

:data:`VALIDATORS` maps every setting to its parser (for arguments); :data:`ENV_SOURCES` maps
the settings the environment can give to their variables, in order of precedence, and parser.

>>> VALIDATORS["prometheus_port"]("off", "prometheus_port") is None
True
"""

from __future__ import annotations

import ipaddress
import operator
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, SupportsFloat, SupportsIndex
from urllib.parse import urlsplit

from torchtrace.config.env import (
    ENV_DEBUG_API,
    ENV_DEBUG_TOKEN,
    ENV_DISABLED,
    ENV_FORENSICS,
    ENV_FORENSICS_MAX_REPLAYS,
    ENV_GUARD,
    ENV_HANG_TIMEOUT_S,
    ENV_JOB_ID,
    ENV_LEVEL,
    ENV_METRICS_EXPORT_INTERVAL,
    ENV_METRICS_EXPORTER,
    ENV_MODE,
    ENV_ON_HANG,
    ENV_OTEL_SDK_DISABLED,
    ENV_OTEL_SERVICE_NAME,
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
    FALSE_STRINGS,
    SIGNAL_ENDPOINT_VARIABLES,
    TRUE_STRINGS,
    SignalEndpoint,
)
from torchtrace.config.headers import check_headers, parse_env_headers
from torchtrace.levels import DebugLevel, DebugMode

OTLP_PROTOCOLS = ("grpc", "http/protobuf")
GUARD_POLICIES = ("warn", "skip", "raise")
HANG_POLICIES = ("record", "abort")
PORT_POLICIES = ("next", "ephemeral", "off")
METRICS_EXPORTERS = ("prometheus", "otlp", "both", "none")


def _bool(value: object, setting: str) -> bool:
    if isinstance(value, bool):
        return value
    if _is_bool(value):  # a numpy bool, typed like Python's
        return bool(value)
    if isinstance(value, str):
        key = value.strip().lower()
        if key in TRUE_STRINGS:
            return True
        if key in FALSE_STRINGS:
            return False
    raise ValueError(f"{setting}={value!r} is not valid; accepted values: True or False, or a string: "
                     f"true, false, yes, no, on, off, 1, 0")


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    def parse(value: object, setting: str) -> str:
        key = value.strip().lower() if isinstance(value, str) else value
        if key not in choices:
            raise ValueError(f"{setting}={value!r} is not valid; accepted values: {', '.join(choices)}")
        return key

    return parse


def _port(value: object, setting: str) -> int | None:
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


def _is_bool(value: object) -> bool:
    """A Python or numpy bool (numpy's is not a subclass of ``bool``)."""
    return isinstance(value, bool) or type(value).__name__ in ("bool", "bool_")


def _as_int(value: object) -> int | None:
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
    if isinstance(value, float) or not isinstance(value, SupportsIndex):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _positive_float(value: object, setting: str, least: float = 0.0,
                    accepted: str = "accepted values: a positive finite number") -> float:
    """A finite number above 0 (at least ``least`` when that is given); a number too large for
    a float (``10**400``) is as invalid as ``inf``."""
    if _is_bool(value):
        raise ValueError(f"{setting}={shown(value)} is not valid; {accepted}")
    try:
        number = _float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{setting}={shown(value)} is not valid; {accepted}") from None
    if not (number > 0 and number >= least and number != float("inf")):
        raise ValueError(f"{setting}={shown(value)} is not valid; {accepted}")
    return number


def _float(value: object) -> float:
    """``float(value)`` for what ``float()`` takes (a string with spaces around it too);
    TypeError for anything else."""
    if isinstance(value, str):
        return float(value.strip())
    if isinstance(value, (SupportsFloat, SupportsIndex, bytes, bytearray, memoryview)):
        return float(value)
    raise TypeError(f"not a number: {type(value).__name__}")


def _peak_flops(value: object, setting: str) -> float:
    """A device's peak FLOP/s: at least 1 (a smaller peak, a subnormal ``1e-320`` say, is no
    device's and would make every MFU infinite)."""
    return _positive_float(value, setting, least=1.0, accepted="accepted values: a finite number of FLOP/s >= 1")


def shown(value: object) -> str:
    """``repr(value)`` for a message, cut short (``10**400`` has 401 digits); never raises (a
    lazy proxy's repr may, and so does an int past Python's 4300 digits)."""
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__name__} object>"
    return text if len(text) <= 60 else f"{text[:40]}...<{len(text)} characters>"


def _positive_int(value: object, setting: str) -> int:
    number = _as_int(value)
    if number is None or number <= 0:
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: a positive integer")
    return number


def _optional_positive_int(value: object, setting: str) -> int | None:
    if isinstance(value, str) and value.strip().lower() in ("off", "none", ""):
        return None
    return _positive_int(value, setting)


def _hang_timeout(value: object, setting: str) -> float | None:
    """Seconds without progress that make a hang, or None (``adaptive``): the rule in docs/hangs.md."""
    if isinstance(value, str) and value.strip().lower() in ("adaptive", "auto", ""):
        return None
    return _positive_float(value, setting, accepted="accepted values: a positive number of seconds, or 'adaptive'")


def _non_negative_int(value: object, setting: str) -> int:
    number = _as_int(value)
    if number is None or number < 0:
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: an integer >= 0")
    return number


def _nonempty_str(value: object, setting: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: a non-empty string")
    return value.strip()


def check_run_id(value: str, setting: str) -> str:
    """``value`` when it is a valid run id (it names files and directories), else ``ValueError``.

    >>> check_run_id("20240101-120000-ab12cd", "run_id")
    '20240101-120000-ab12cd'
    """
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


def _host(value: object, setting: str) -> str:
    text = value.strip() if isinstance(value, str) else None
    if text and text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if text is None or not valid_host(text):
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: an IP address (127.0.0.1, ::1, "
                         "0.0.0.0) or a host name, without a port")
    return text


def _check_endpoint(value: object, setting: str) -> str:
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


def _path(value: object, setting: str) -> Path:
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: a directory path")
    return Path(value)


def _mapping(value: object, setting: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: a mapping of names to values")
    return dict(value)


def _debug_token(value: object, setting: str) -> str:
    if not isinstance(value, str) or len(value.strip()) < 16 or any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(f"{setting}=<hidden> is not valid; accepted values: a string of at least 16 printable "
                         "characters without spaces")
    return value


def _too_small(value: object, setting: str, minimum: int) -> int:
    raise ValueError(f"{setting}={value!r} is not valid; accepted values: an integer >= {minimum}")


def _readable_file(value: object, setting: str) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.path.isfile(value) or not os.access(value, os.R_OK):
        raise ValueError(f"{setting}={value!r} is not valid; accepted values: the path of a readable PEM file")
    return os.fspath(value)


# setting -> parser of an argument
VALIDATORS: dict[str, Callable[[Any, str], Any]] = {
    "disabled": _bool,
    "service_name": _nonempty_str,
    "run_id": check_run_id,
    "job_id": check_run_id,
    "level": lambda v, s: DebugLevel.parse(v, s),
    "mode": lambda v, s: DebugMode.parse(v, s),
    "run_dir": _path,
    "write_files": _bool,
    "prometheus_host": _host,
    "prometheus_port": _port,
    "port_policy": _choice(PORT_POLICIES),
    "otlp_endpoint": _check_endpoint,
    "otlp_protocol": _choice(OTLP_PROTOCOLS),
    "otlp_headers": check_headers,
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
    "peak_flops": _peak_flops,
    "throughput": _bool,
    "hang_timeout_s": lambda v, s: _hang_timeout(v, s),
    "on_hang": _choice(HANG_POLICIES),
}

def _env_endpoint(value: str, variable: str) -> str:
    """An endpoint from the environment; a signal-specific variable's is a :class:`SignalEndpoint`."""
    url = _check_endpoint(value, variable)
    return SignalEndpoint(url) if variable in SIGNAL_ENDPOINT_VARIABLES else url


# setting -> (environment variables in order of precedence, parser)
ENV_SOURCES: dict[str, tuple[tuple[str, ...], Callable[[str, str], Any]]] = {
    "disabled": ((ENV_DISABLED, ENV_OTEL_SDK_DISABLED), _bool),
    "service_name": ((ENV_OTEL_SERVICE_NAME,), _nonempty_str),
    "run_id": ((ENV_RUN_ID,), check_run_id),
    "job_id": ((ENV_JOB_ID,), check_run_id),
    "level": ((ENV_LEVEL,), lambda v, s: DebugLevel.parse(v, s)),
    "mode": ((ENV_MODE,), lambda v, s: DebugMode.parse(v, s)),
    "run_dir": ((ENV_RUN_DIR,), _path),
    "prometheus_host": ((ENV_PROMETHEUS_HOST,), _host),
    "prometheus_port": ((ENV_PROMETHEUS_PORT,), _port),
    "port_policy": ((ENV_PORT_POLICY,), _choice(PORT_POLICIES)),
    "otlp_endpoint": ((ENV_OTLP_TRACES_ENDPOINT, ENV_OTLP_ENDPOINT), _env_endpoint),
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
    "otlp_metrics_endpoint": ((ENV_OTLP_METRICS_ENDPOINT, ENV_OTLP_ENDPOINT), _env_endpoint),
    "otlp_certificate": ((ENV_OTLP_TRACES_CERTIFICATE, ENV_OTLP_CERTIFICATE), _readable_file),
    "otlp_headers": ((ENV_OTLP_TRACES_HEADERS, ENV_OTLP_HEADERS), parse_env_headers),
    "peak_flops": ((ENV_PEAK_FLOPS,), _peak_flops),
    "throughput": ((ENV_THROUGHPUT,), _bool),
    "hang_timeout_s": ((ENV_HANG_TIMEOUT_S,), lambda v, s: _hang_timeout(v, s)),
    "on_hang": ((ENV_ON_HANG,), _choice(HANG_POLICIES)),
}
