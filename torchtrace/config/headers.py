"""OTLP headers: the ``otlp_headers`` argument and ``OTEL_EXPORTER_OTLP_HEADERS``, checked before
any OpenTelemetry exporter sees them, and never echoed (a header often carries a secret).

>>> check_headers({"authorization": "Bearer abc"}, "otlp_headers")
{'authorization': 'Bearer abc'}
"""

from __future__ import annotations

import re
from typing import Mapping
from urllib.parse import unquote

from torchtrace.errors import get_logger

__all__ = ["check_headers", "parse_env_headers"]

logger = get_logger(__name__)

# An HTTP header name: a token (RFC 7230 3.2.6).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _header_value_ok(value: str) -> bool:
    """Printable, no line break or other control character (which would split the header)."""
    return all(c == "\t" or (c.isprintable() and c not in "\r\n") for c in value)


def check_headers(value: object, setting: str) -> dict[str, str]:
    """``otlp_headers``: a mapping of header names to string values. Values are never echoed."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{setting} is not valid; accepted values: a mapping of header names to strings")
    out: dict[str, str] = {}
    for name, val in value.items():
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            shown = repr(name[:64]) if isinstance(name, str) and name.isprintable() else "<unprintable>"
            raise ValueError(f"{setting} has a header name {shown} that is not an HTTP token; accepted values: "
                             "names of letters, digits and !#$%&'*+-.^_`|~")
        if not isinstance(val, str) or not _header_value_ok(val):
            raise ValueError(f"{setting}[{name!r}] is not valid (its value is not shown); accepted values: a "
                             "string of printable characters without line breaks")
        out[name] = val
    return out


def parse_env_headers(raw: str, setting: str) -> dict[str, str]:
    """Headers from ``OTEL_EXPORTER_OTLP_HEADERS``: ``name=value`` pairs separated by commas.

    Values are URL-decoded, names lower-cased, as the OpenTelemetry specification says. A
    malformed entry is logged by its position, never its text (it may hold a secret), and
    left out; a variable with no valid entry raises ``ValueError``, so the default (no
    headers) is used. Runs before any OpenTelemetry exporter reads the variable.

    >>> parse_env_headers("Authorization=Bearer%20abc, x-team=ml", "OTEL_EXPORTER_OTLP_HEADERS")
    {'authorization': 'Bearer abc', 'x-team': 'ml'}
    """
    entries = [part for part in raw.split(",") if part.strip()]
    out: dict[str, str] = {}
    bad: list[int] = []
    for number, entry in enumerate(entries, 1):
        name, sep, value = entry.partition("=")
        name, value = name.strip(), unquote(value.strip())
        if not sep or not _HEADER_NAME.fullmatch(name) or not _header_value_ok(value):
            bad.append(number)
            continue
        out[name.lower()] = value
    if bad:
        logger.warning("torchtrace: %s entr%s %s of %d %s not name=value with a URL-encoded value and %s left "
                       "out (the text is not shown: it may hold a secret)", setting, "y" if len(bad) == 1 else "ies",
                       ", ".join(map(str, bad)), len(entries), "is" if len(bad) == 1 else "are",
                       "is" if len(bad) == 1 else "are")
    if not out and bad:
        raise ValueError(f"{setting} has no valid name=value entry (its text is not shown)")
    return out
