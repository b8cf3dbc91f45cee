"""Before/after comparison of two windows: percentiles per key and metric, and SLOs, side by side.

Pure and I/O-free. The inputs are two window reports in the shape the request store's
``window_report`` produces (``tokentrace top --json``, ``GET /api/v1/window``)::

    {keys: [{service, model, operation, prompt_bucket, metrics: {ttft: {p50, p95, p99, count}}}],
     slo: [{target, metric, percentile, threshold_ms, value_ms, met, compliance, burn_rate, ...}]}

so that the API's ``/compare`` and a ``tokentrace compare RUN_A RUN_B`` command compare the same
way. Values are milliseconds. For every (key, metric) present in either window:

- ``delta``: ``b - a`` per quantile in ms (rounded to the microsecond), positive = B is slower;
- ``change``: ``b / a - 1`` per quantile (0.25 = B is 25% slower), None where ``a`` is 0.

A quantile missing on either side has a None delta and change; a (key, metric) missing from one
window has ``a`` or ``b`` None and no delta at all.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, TypedDict

from tokentrace.agent import semconv
from tokentrace.processors.slo import SELECTOR_KEYS

COUNT_FIELD: Final = "count"
"""The entry of a metric summary that counts values rather than giving a quantile."""
_DELTA_DECIMALS: Final = 3
"""ms to the microsecond, the resolution of the reports."""
_CHANGE_DECIMALS: Final = 6

_METRIC_ORDER: Final = {metric: index for index, metric in enumerate(semconv.LATENCY_METRICS)}

Key = tuple[str, ...]


class MetricComparison(TypedDict):
    """One (key, metric) of two windows side by side (plus the key fields, see ``compare``)."""

    metric: str
    a: dict[str, Any] | None
    b: dict[str, Any] | None
    delta: dict[str, float | None] | None
    change: dict[str, float | None] | None


class SloComparison(TypedDict):
    target: str
    a: dict[str, Any] | None
    b: dict[str, Any] | None


class WindowComparison(TypedDict):
    metrics: list[dict[str, Any]]
    slo: list[SloComparison]


def compare_windows(a: Mapping[str, Any], b: Mapping[str, Any]) -> WindowComparison:
    """Both comparisons of two window reports (``compare_metrics`` and ``compare_slo``)."""
    return {"metrics": compare_metrics(a, b), "slo": compare_slo(a, b)}


def compare_metrics(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every (key, metric) of either report: the key's fields, ``metric``, both summaries and
    their ``delta``/``change`` (see the module docstring).

    Order: A's keys in A's order, then keys only B has in B's order; metrics within a key in
    ``semconv.LATENCY_METRICS`` order, then unknown metrics by name.
    """
    metrics_a = _metrics_by_key(a)
    metrics_b = _metrics_by_key(b)
    keys = list(metrics_a) + [key for key in metrics_b if key not in metrics_a]
    rows: list[dict[str, Any]] = []
    for key in keys:
        per_metric_a = metrics_a.get(key, {})
        per_metric_b = metrics_b.get(key, {})
        names = set(per_metric_a) | set(per_metric_b)
        for metric in sorted(names, key=lambda m: (_METRIC_ORDER.get(m, len(_METRIC_ORDER)), m)):
            summary_a = per_metric_a.get(metric)
            summary_b = per_metric_b.get(metric)
            comparison: MetricComparison = {
                "metric": metric,
                "a": summary_a,
                "b": summary_b,
                "delta": None,
                "change": None,
            }
            if summary_a is not None and summary_b is not None:
                labels = _quantile_labels(summary_a, summary_b)
                comparison["delta"] = {
                    label: _delta(summary_a.get(label), summary_b.get(label)) for label in labels
                }
                comparison["change"] = {
                    label: _change(summary_a.get(label), summary_b.get(label)) for label in labels
                }
            rows.append({**dict(zip(SELECTOR_KEYS, key, strict=True)), **comparison})
    return rows


def compare_slo(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[SloComparison]:
    """Every SLO target of either report by name, A's order first: both windows' entries."""
    slo_a = _slo_by_target(a)
    slo_b = _slo_by_target(b)
    names = list(slo_a) + [name for name in slo_b if name not in slo_a]
    return [{"target": name, "a": slo_a.get(name), "b": slo_b.get(name)} for name in names]


def _metrics_by_key(report: Mapping[str, Any]) -> dict[Key, dict[str, dict[str, Any]]]:
    """key -> metric -> summary; a key listed twice (not produced by window_report) keeps the
    first listing of each metric."""
    found: dict[Key, dict[str, dict[str, Any]]] = {}
    for entry in _entries(report.get("keys")):
        key = tuple(str(entry.get(field, "")) for field in SELECTOR_KEYS)
        per_metric = found.setdefault(key, {})
        metrics = entry.get("metrics")
        if not isinstance(metrics, Mapping):
            continue
        for metric, summary in metrics.items():
            if isinstance(summary, Mapping) and metric not in per_metric:
                per_metric[str(metric)] = dict(summary)
    return found


def _slo_by_target(report: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for entry in _entries(report.get("slo")):
        name = entry.get("target")
        if isinstance(name, str) and name not in found:
            found[name] = dict(entry)
    return found


def _entries(value: object) -> Iterable[Mapping[str, Any]]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        return ()
    return [entry for entry in value if isinstance(entry, Mapping)]


def _quantile_labels(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The quantile labels of either summary (all entries but the count), A's order first."""
    labels = [label for label in a if label != COUNT_FIELD]
    labels += [label for label in b if label != COUNT_FIELD and label not in a]
    return [str(label) for label in labels]


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _delta(a: object, b: object) -> float | None:
    before, after = _number(a), _number(b)
    if before is None or after is None:
        return None
    return round(after - before, _DELTA_DECIMALS)


def _change(a: object, b: object) -> float | None:
    before, after = _number(a), _number(b)
    if before is None or after is None or before == 0:
        return None
    return round(after / before - 1.0, _CHANGE_DECIMALS)
