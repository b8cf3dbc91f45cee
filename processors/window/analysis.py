"""One window of requests, analysed exactly: what ``tokentrace diagnose`` and ``compare`` print.

Pure and I/O-free. From the window's request records:

- ``metrics``: per latency metric (``semconv.LATENCY_METRICS``; ITL pooled over every gap) the
  count, mean and percentiles;
- ``segments``: per budget segment, the same over the requests plus the mean share of E2E;
- ``findings``: one per SLO target, breached first: which segment of the target's metric
  dominates the requests beyond its threshold, its cause, one fix and the counterfactual
  (``findings.target_findings``);
- ``metric_findings``: per metric (TTFT, TPOT, E2E), the typical request's and the tail's
  dominant segment and cause (``findings.metric_findings``), on the client's clock when every
  request has a client span;
- ``perceived``: streaming, time to first byte and connection reuse as users felt them
  (``perceived_speed.perceived_speed``);
- ``slo``: per target, the value at its percentile, whether it is met, the compliance (share of
  requests inside, as ``slo.mark_request`` judges them) and the error-budget burn rate.

Percentiles are nearest-rank over the exact values, like the rest of the collector's exact
numbers (sketches are for windows too large to hold; a diagnosed window is not).
Durations are milliseconds rounded to the microsecond.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Final

from tokentrace.agent import semconv
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.durations import ms_of
from tokentrace.processors.model import RequestRecord
from tokentrace.processors.slo import SloTarget, burn_rate_of, mark_request
from tokentrace.processors.stats import nearest_rank
from tokentrace.processors.window.findings import metric_findings, target_findings
from tokentrace.processors.window.perceived_speed import perceived_speed

DEFAULT_PERCENTILES: Final = (50.0, 90.0, 95.0, 99.0)
_DEFAULT_DIAGNOSIS: Final = DiagnosisConfig()


def analyze_window(
    records: Sequence[RequestRecord],
    *,
    targets: Sequence[SloTarget] = (),
    diagnosis: DiagnosisConfig = _DEFAULT_DIAGNOSIS,
    percents: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The window document (see the module docstring)."""
    values: dict[str, list[int]] = {metric: [] for metric in semconv.LATENCY_METRICS}
    segment_values: dict[str, list[int]] = {}
    share_sums: dict[str, float] = {}
    for record in records:
        metrics = record.metrics
        for metric in semconv.LATENCY_METRICS:
            if metric == semconv.METRIC_ITL:
                values[metric].extend(metrics.itl)
                continue
            value = metrics.value(metric)
            if value is not None:
                values[metric].append(value)
        e2e_ns = record.budget.e2e_ns
        for segment, ns in record.budget.segments.items():
            segment_values.setdefault(segment, []).append(ns)
            if e2e_ns > 0:
                share_sums[segment] = share_sums.get(segment, 0.0) + ns / e2e_ns
    count = len(records)
    segments: dict[str, dict[str, Any]] = {}
    for segment in _segment_order(segment_values):
        summary = summarize_ns(segment_values[segment], percents)
        summary["share"] = round(share_sums.get(segment, 0.0) / count, 4) if count else None
        segments[segment] = summary
    return {
        "requests": count,
        "metrics": {
            metric: summarize_ns(found, percents) for metric, found in values.items() if found
        },
        "segments": segments,
        "findings": target_findings(records, targets, diagnosis),
        "metric_findings": metric_findings(records, config=diagnosis),
        "perceived": perceived_speed(records),
        "slo": slo_status(records, targets),
    }


def summarize_ns(values_ns: Iterable[int], percents: Sequence[float]) -> dict[str, Any]:
    """``{count, mean, p50, ...}`` in ms; only ``count`` when there are no values."""
    ordered = sorted(values_ns)
    summary: dict[str, Any] = {"count": len(ordered)}
    if ordered:
        summary["mean"] = ms_of(math.fsum(ordered) / len(ordered))
        for percent in percents:
            summary[f"p{percent:g}"] = ms_of(nearest_rank(ordered, percent))
    return summary


def slo_status(
    records: Sequence[RequestRecord], targets: Sequence[SloTarget]
) -> list[dict[str, Any]]:
    """Per target over the window's records (see the module docstring); ``value_ms`` and
    ``met`` are None when no request matched."""
    target_list = list(targets)
    marks = [mark_request(record, target_list) for record in records]
    entries: list[dict[str, Any]] = []
    for target in target_list:
        pooled: list[int] = []
        judged = inside = 0
        for record, record_marks in zip(records, marks, strict=True):
            if target.name not in record_marks:
                continue
            judged += 1
            inside += record_marks[target.name]
            metrics = record.metrics
            if target.metric == semconv.METRIC_ITL:
                pooled.extend(metrics.itl)
            else:
                value = metrics.value(target.metric)
                if value is not None:
                    pooled.append(value)
        entry: dict[str, Any] = {
            "target": target.name,
            "metric": target.metric,
            "percentile": target.percentile,
            "threshold_ms": ms_of(target.threshold_ns),
            "selector": dict(target.selector),
            "requests": judged,
            "value_ms": None,
            "met": None,
            "compliance": None,
            "burn_rate": None,
        }
        if judged and pooled:
            pooled.sort()
            value_ns = nearest_rank(pooled, target.percentile)
            compliance = inside / judged
            entry.update(
                value_ms=ms_of(value_ns),
                met=value_ns <= target.threshold_ns,
                compliance=round(compliance, 4),
                burn_rate=round(burn_rate_of(compliance, target.percentile), 3),
            )
        entries.append(entry)
    return entries


def _segment_order(found: dict[str, list[int]]) -> list[str]:
    known = [segment for segment in semconv.SEGMENTS if segment in found]
    return known + sorted(segment for segment in found if segment not in semconv.SEGMENTS)
