"""Metric names a PromQL expression references (for the catalog reference checks in tests).

Not a parser: parsing is promtool's and Prometheus's job (the tests run both). This strips what cannot be
a metric name (strings, label matchers, ranges, grouping label lists, function calls, keywords,
numbers and durations) and returns the identifiers that are left, so a misspelt or removed metric is
reported by name rather than silently matching nothing.
"""

from __future__ import annotations

import re

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# An identifier not preceded by a word character, ':', '.' or '$' (so not "5m", "1.5e3", "$run") and not
# followed by "(" (so not a function or aggregation call).
_IDENT = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(?![\w:]*\s*\()")
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                      "unless", "offset", "inf", "nan", "start", "end"})
# Series Prometheus itself provides that meshscope's rules and panels use.
BUILTIN_SERIES = frozenset({"up"})


def metric_names(expr: str) -> set[str]:
    """Every series name (or recording-rule name) ``expr`` selects."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _LABEL_LISTS.sub(" ", text)
    return {name for name in _IDENT.findall(text) if name.lower() not in KEYWORDS}


def label_values_metric(query: str) -> str | None:
    """The metric of a Grafana ``label_values(metric{...}, label)`` variable query."""
    m = re.match(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)", query)
    return m.group(1) if m else None
