"""Strict JSON: non-finite floats written as strings, never as the ``NaN`` token JSON lacks.

Re-exported by :mod:`torchtrace.files`.

>>> dumps({"loss": float("inf")})
'{"loss": "Infinity"}'
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

_PLAIN = (str, int, bool, type(None))


# Any: a JSON-like value; the fast checks by exact type (``type(value) is float``) are not
# ones mypy narrows by.
def to_strict(value: Any) -> Any:
    """Replace non-finite floats by the strings "NaN", "Infinity", "-Infinity", recursively.

    Strict JSON has no NaN token; a reader that sees the string still knows what happened.
    Tuples become lists and keys strings, as JSON has them.

    >>> to_strict({"loss": float("nan"), "names": ("a", "b")})
    {'loss': 'NaN', 'names': ['a', 'b']}
    """
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is float:
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k if type(k) is str else str(k): v if type(v) in _PLAIN else to_strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        # a list of names is the common large case: no call per string
        return [v if type(v) in _PLAIN else to_strict(v) for v in value]
    if isinstance(value, float):
        return to_strict(float(value))
    if isinstance(value, Path):
        return str(value)
    return value


_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf,
               "nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def from_strict(value: object) -> float | None:
    """A number as :func:`to_strict` wrote it, back as a float: a number, or the string of a
    non-finite one ("NaN", "Infinity", "-Infinity"; Python's spellings too); None for
    anything else (absent, not a number).

    >>> from_strict("NaN") != from_strict("NaN"), from_strict(2), from_strict(True), from_strict("x")
    (True, 2.0, None, None)
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return _NON_FINITE.get(value) if isinstance(value, str) else None


def dumps(value: object, indent: int | None = None) -> str:
    """Strict JSON text (``allow_nan=False``; non-finite floats as strings, see :func:`to_strict`).

    The C encoder does the work: a document without non-finite floats is encoded as it is,
    others after :func:`to_strict`. ``indent`` is applied to documents under 256 KB only:
    indenting makes Python's encoder fall back to its pure-Python path, about ten times slower
    (a 24 MB report took seconds where the compact form takes a fraction of one).
    """
    try:
        text = json.dumps(value, allow_nan=False, default=str)
    except (ValueError, TypeError):  # a non-finite float; a key JSON has no form for
        value = to_strict(value)
        text = json.dumps(value, allow_nan=False, default=str)
    if indent is not None and len(text) < 256 * 1024:
        return json.dumps(json.loads(text), indent=indent, allow_nan=False)
    return text
