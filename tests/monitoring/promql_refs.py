"""Find the series, labels and functions a PromQL expression refers to.

Not a PromQL parser: a tokenizer and a few rules, enough to list every metric name,
label matcher and grouping label in the expressions of our rules and dashboards, so
that a test can hold them against the telemetry contract. Grafana's template variables
(``$job``, ``${rank}``, ``$__rate_interval``) are accepted wherever PromQL allows a
string or a duration.

>>> refs = references('sum by (kind) (rate(torchtrace_anomalies_total{kind="oom"}[5m]))')
>>> [(s.name, s.matchers) for s in refs.selectors]
[('torchtrace_anomalies_total', (('kind', '=', 'oom'),))]
>>> refs.grouping_labels, sorted(refs.functions)
({'kind'}, ['rate', 'sum'])
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

AGGREGATIONS = frozenset({
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
})

FUNCTIONS = frozenset({
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan",
    "atanh", "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "cos", "cosh", "count_over_time", "day_of_month", "day_of_week", "day_of_year",
    "days_in_month", "deg", "delta", "deriv", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev",
    "histogram_stdvar", "histogram_sum", "holt_winters", "hour", "idelta", "increase",
    "irate", "label_join", "label_replace", "last_over_time", "ln", "log10", "log2",
    "mad_over_time", "max_over_time", "min_over_time", "minute", "month", "pi",
    "predict_linear", "present_over_time", "quantile_over_time", "rad", "rate",
    "resets", "round", "scalar", "sgn", "sin", "sinh", "sort", "sort_desc",
    "sort_by_label", "sort_by_label_desc", "sqrt", "stddev_over_time",
    "stdvar_over_time", "sum_over_time", "tan", "tanh", "time", "timestamp", "vector",
    "year", "start", "end",
})

KEYWORDS = frozenset({
    "and", "or", "unless", "atan2", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan",
})

_TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$\w+|\[\[\w+\]\])
  | (?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=@,(){}\[\]:])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class Selector:
    """One vector selector: a metric name (or None) and its label matchers."""

    name: str | None
    matchers: tuple[tuple[str, str, str], ...]


@dataclass
class References:
    selectors: list[Selector] = field(default_factory=list)
    grouping_labels: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)


class PromQLSyntaxError(ValueError):
    pass


def tokenize(expr: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise PromQLSyntaxError(f"cannot read {expr[pos:pos + 20]!r} in {expr!r}")
        pos = m.end()
        kind = m.lastgroup
        if kind != "space":
            tokens.append((kind, m.group()))
    return tokens


def _unquote(text: str) -> str:
    if text[0] == "`":
        return text[1:-1]
    return re.sub(r"\\(.)", r"\1", text[1:-1])


def _label_list(tokens: list[tuple[str, str]], i: int, expr: str) -> tuple[list[str], int]:
    """Read ``( a, b )`` starting at tokens[i] == '('; return labels and the next index."""
    if i >= len(tokens) or tokens[i][1] != "(":
        raise PromQLSyntaxError(f"expected a label list in {expr!r}")
    labels, i = [], i + 1
    while tokens[i][1] != ")":
        kind, text = tokens[i]
        if kind == "ident":
            labels.append(text)
        elif text != ",":
            raise PromQLSyntaxError(f"unexpected {text!r} in a label list of {expr!r}")
        i += 1
    return labels, i + 1


def _matchers(tokens: list[tuple[str, str]], i: int, expr: str):
    """Read ``{ l op "v", ... }`` starting at tokens[i] == '{'."""
    matchers, i = [], i + 1
    while tokens[i][1] != "}":
        if tokens[i][1] == ",":
            i += 1
            continue
        try:
            (lk, label), (_, op), (vk, value) = tokens[i:i + 3]
        except ValueError:
            raise PromQLSyntaxError(f"unterminated matcher in {expr!r}") from None
        if lk != "ident" or op not in ("=", "!=", "=~", "!~") or vk != "string":
            raise PromQLSyntaxError(f"bad matcher {label}{op}{value} in {expr!r}")
        matchers.append((label, op, _unquote(value)))
        i += 3
    return tuple(matchers), i + 1


def references(expr: str) -> References:
    """List what ``expr`` refers to. Raises PromQLSyntaxError on what it cannot read."""
    tokens = tokenize(expr)
    refs = References()
    i, depth_brackets = 0, 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if text == "[":
            depth_brackets += 1
        elif text == "]":
            depth_brackets -= 1
        if depth_brackets or kind != "ident" and text != "{":
            i += 1
            continue
        if text == "{":  # a selector with no name before it
            matchers, i = _matchers(tokens, i, expr)
            names = [v for (lbl, op, v) in matchers if lbl == "__name__" and op == "="]
            refs.selectors.append(Selector(names[0] if names else None, matchers))
            continue
        low = text.lower()
        if low in ("by", "without", "on", "ignoring", "group_left", "group_right"):
            if nxt == "(":
                labels, i = _label_list(tokens, i + 1, expr)
                refs.grouping_labels.update(labels)
            else:
                i += 1
            continue
        if low in KEYWORDS:
            i += 1
            continue
        if text in AGGREGATIONS and (nxt == "(" or nxt in ("by", "without")):
            refs.functions.add(text)
            i += 1
            continue
        if nxt == "(":
            if text not in FUNCTIONS:
                raise PromQLSyntaxError(f"unknown function {text!r} in {expr!r}")
            refs.functions.add(text)
            i += 1
            continue
        # anything else is a metric name, perhaps with matchers
        if nxt == "{":
            matchers, i = _matchers(tokens, i + 1, expr)
        else:
            matchers, i = (), i + 1
        refs.selectors.append(Selector(text, matchers))
    if depth_brackets:
        raise PromQLSyntaxError(f"unbalanced [ ] in {expr!r}")
    return refs


_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(?P<selector>.*),)?\s*(?P<label>\w+)\s*\)\s*$", re.S)


def variable_query_references(query: str) -> tuple[References, str | None]:
    """References of a Grafana Prometheus variable query, and the label it lists.

    ``label_values(selector, label)`` and ``label_values(label)`` are Grafana's own
    syntax; anything else is treated as PromQL (``query_result(...)`` unwrapped).
    """
    m = _LABEL_VALUES.match(query)
    if m:
        selector = m.group("selector")
        return (references(selector) if selector else References()), m.group("label")
    inner = re.match(r"^\s*query_result\((.*)\)\s*$", query, re.S)
    return references(inner.group(1) if inner else query), None
