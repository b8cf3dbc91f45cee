"""The JSON documents the request store keeps and its readers (CLI, API, web UI) print.

``record_to_dict`` turns one ``RequestRecord`` into the document ``tokentrace explain --json``
prints. Durations are milliseconds as floats rounded to 3 decimals, i.e. exact microseconds.
Budget segments are rounded on their cumulative boundaries, so the segments' microseconds sum
exactly to the rounded E2E (the budget partitions E2E, and the document keeps that property).

``window_report`` turns stored sketch slices and SLO targets into the document
``tokentrace top --json`` prints; it is pure, so an API can serve the same shape.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Final

from tokentrace.agent import semconv
from tokentrace.processors.model import RequestRecord, RequestTimeline

DOC_VERSION: Final = 1
"""Bumped when the request document changes shape incompatibly."""
DOC_TOKEN_OFFSETS_CAP: Final = 4096
"""Token offsets kept in one document; the rest are counted in ``token_offsets_dropped``."""

TIMELINE_BOUNDARIES: Final = (
    "client_start",
    "server_start",
    "arrival",
    "ready",
    "first_scheduled",
    "first_token",
    "client_first_token",
    "last_token",
    "end",
    "server_end",
    "client_end",
)
"""The ``RequestTimeline`` fields a document's ``timeline.boundaries_ms`` may hold."""

_CONTEXT_FIELDS: Final = (
    "requests_ahead",
    "running_at_arrival",
    "max_running",
    "outlier_steps_with_prefill",
    "decode_bandwidth_peak_ratio",
    "prefix_hash",
)

TOP_QUANTILES: Final = ((0.5, "p50"), (0.95, "p95"), (0.99, "p99"))
"""The quantiles ``window_report`` reports for every metric."""

_NS_PER_US: Final = 1_000
_US_PER_MS: Final = 1_000
_NS_PER_S: Final = 1_000_000_000


def ns_to_ms(value_ns: int | None) -> float | None:
    """Integer ns -> ms rounded to the microsecond (half up), None stays None."""
    if value_ns is None:
        return None
    return _round_us(value_ns) / _US_PER_MS


def _round_us(value_ns: int) -> int:
    # Half up on integers: float division would round 0.5 µs either way.
    return (int(value_ns) + _NS_PER_US // 2) // _NS_PER_US


def _finite(value: Any) -> Any:
    """JSON has no NaN/Infinity: a non-finite float becomes None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _partition_ms(segments: Mapping[str, int]) -> dict[str, float]:
    """Every segment (``semconv.SEGMENTS`` order, then any unknown ones) in exact µs as ms.

    Rounds the running sum, not each segment, so the rounded segments add up to the rounded
    total whenever the ns segments add up to ``total_ns``.
    """
    names = list(semconv.SEGMENTS) + sorted(s for s in segments if s not in semconv.SEGMENTS)
    out: dict[str, float] = {}
    cumulative_ns = 0
    previous_us = 0
    for name in names:
        cumulative_ns += int(segments.get(name, 0))
        cumulative_us = _round_us(cumulative_ns)
        out[name] = (cumulative_us - previous_us) / _US_PER_MS
        previous_us = cumulative_us
    return out


def _itl_summary(gaps_ns: Sequence[int]) -> dict[str, float | int | None]:
    if not gaps_ns:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(gaps_ns)
    return {
        "count": len(ordered),
        "p50": ns_to_ms(_nearest_rank(ordered, 0.50)),
        "p99": ns_to_ms(_nearest_rank(ordered, 0.99)),
        "max": ns_to_ms(ordered[-1]),
    }


def _nearest_rank(ordered: Sequence[int], q: float) -> int:
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def request_start_ns(timeline: RequestTimeline) -> int:
    """When the request started as the server saw it (client start for client-only traces)."""
    for value in (
        timeline.server_start,
        timeline.arrival,
        timeline.client_start,
        timeline.first_token,
        timeline.end,
        timeline.client_end,
    ):
        if value is not None:
            return int(value)
    raise ValueError("request timeline has no timestamp at all")


def iso_utc(unix_ns: int) -> str:
    """ISO-8601 UTC with microseconds, e.g. ``2025-01-02T03:04:05.123456Z``."""
    seconds, rest_ns = divmod(int(unix_ns), _NS_PER_S)
    moment = datetime.fromtimestamp(seconds, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{rest_ns // _NS_PER_US:06d}Z"


def _timeline_dict(timeline: RequestTimeline) -> dict[str, Any]:
    boundaries = {
        name: getattr(timeline, name)
        for name in TIMELINE_BOUNDARIES
        if getattr(timeline, name) is not None
    }
    known = [int(v) for v in boundaries.values()]
    known += [int(start) for start, _ in timeline.preempted]
    known += [int(start) for start, _, _ in timeline.prefill_chunks]
    origin = min(known) if known else request_start_ns(timeline)

    def offset(value: int) -> float:
        return _round_us(int(value) - origin) / _US_PER_MS

    return {
        "origin_unix_ns": origin,
        "boundaries_ms": {name: offset(value) for name, value in boundaries.items()},
        "preemptions_ms": [[offset(start), offset(end)] for start, end in timeline.preempted],
        "prefill_chunks": [
            {"start_ms": offset(start), "end_ms": offset(end), "tokens": int(tokens)}
            for start, end, tokens in timeline.prefill_chunks
        ],
    }


def record_to_dict(record: RequestRecord) -> dict[str, Any]:
    """The JSON-ready document of one request (see the module docstring for units).

    Raises (TypeError/ValueError/AttributeError) on a malformed record, e.g. None where a
    number must be; the store counts such records as rejected.
    """
    timeline = record.timeline
    budget = record.budget
    metrics = record.metrics
    start_ns = request_start_ns(timeline)

    budget_doc: dict[str, Any] = dict(_partition_ms(budget.segments))
    budget_doc["e2e_ms"] = ns_to_ms(int(budget.e2e_ns))
    ttft_budget_doc: dict[str, Any] | None = None
    if budget.ttft_ns is not None:
        ttft_budget_doc = dict(_partition_ms(budget.ttft_segments))
        ttft_budget_doc["ttft_ms"] = ns_to_ms(int(budget.ttft_ns))

    offsets = [int(v) for v in timeline.token_offsets_us[:DOC_TOKEN_OFFSETS_CAP]]
    offsets_dropped = int(timeline.token_offsets_dropped) + max(
        0, len(timeline.token_offsets_us) - DOC_TOKEN_OFFSETS_CAP
    )

    verdict = record.verdict
    verdict_doc: dict[str, Any] | None = None
    if verdict is not None:
        verdict_doc = {
            "segment": str(verdict.segment),
            "cause": str(verdict.cause),
            "sentence": str(verdict.sentence),
            "advice": str(verdict.advice),
            "numbers": {str(k): _finite(v) for k, v in verdict.numbers.items()},
        }

    context = {
        name: _finite(getattr(timeline, name))
        for name in _CONTEXT_FIELDS
        if getattr(timeline, name) is not None
    }

    return {
        "doc_version": DOC_VERSION,
        "trace_id": bytes(timeline.trace_id).hex(),
        "span_id": bytes(timeline.span_id).hex(),
        "service": str(timeline.service),
        "model": str(timeline.model),
        "operation": str(timeline.operation),
        "dialect": str(timeline.dialect),
        "prompt_bucket": str(record.prompt_bucket),
        "request_id": timeline.request_id,
        "start": {"iso": iso_utc(start_ns), "unix_ns": start_ns},
        "tokens": {
            "input": timeline.input_tokens,
            "output": timeline.output_tokens,
            "cached": timeline.cached_tokens,
        },
        "finish_reason": timeline.finish_reason,
        "status_error": timeline.status_error,
        "metrics_ms": {
            semconv.METRIC_TTFT: ns_to_ms(metrics.ttft),
            semconv.METRIC_TPOT: ns_to_ms(metrics.tpot),
            semconv.METRIC_E2E: ns_to_ms(int(metrics.e2e)),
            semconv.METRIC_QUEUE: ns_to_ms(metrics.queue),
            semconv.METRIC_PREFILL: ns_to_ms(metrics.prefill),
            semconv.METRIC_DECODE: ns_to_ms(metrics.decode),
            semconv.METRIC_NETWORK: ns_to_ms(metrics.network),
            semconv.METRIC_ITL: _itl_summary(metrics.itl),
        },
        "budget": budget_doc,
        "ttft_budget": ttft_budget_doc,
        "skew_clamped": bool(budget.skew_clamped),
        "timeline": _timeline_dict(timeline),
        "token_offsets_us": offsets,
        "token_offsets_dropped": offsets_dropped,
        "context": context,
        "verdict": verdict_doc,
        "slo": {str(name): bool(met) for name, met in record.slo.items()},
    }


def budget_segments(budget_doc: Mapping[str, Any]) -> dict[str, float]:
    """The segment entries of a document's ``budget``/``ttft_budget`` (without the total)."""
    return {k: float(v) for k, v in budget_doc.items() if k not in ("e2e_ms", "ttft_ms")}


# --- the `top` window report ----------------------------------------------------------------

KEY_FIELDS: Final = ("service", "model", "operation", "prompt_bucket")
"""The percentile key, in the order stored sketch slices carry it."""

SketchSlice = tuple[float, tuple[str, str, str, str], str, dict[str, Any]]
"""(slice_start_s, (service, model, operation, prompt_bucket), metric, LatencySketch dict)."""


def selector_matches(selector: Mapping[str, str], key: Mapping[str, str]) -> bool:
    """An SLO selector (exact values or ``*`` globs per key field) against one key."""
    for field_name, pattern in selector.items():
        value = key.get(field_name)
        if value is None or not fnmatch.fnmatchcase(value, str(pattern)):
            return False
    return True


def _ms_from_s(value_s: float | None) -> float | None:
    if value_s is None or not math.isfinite(value_s):
        return None
    return round(value_s * _US_PER_MS, 3)


def window_report(
    slices: Iterable[SketchSlice],
    *,
    window_s: float,
    now_s: float,
    slo_targets: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Merge sketch slices per key and metric; percentiles per key; SLO status per target.

    ``slo_targets`` are target dicts as the collector stores them in meta ``slo_targets``
    (parsed with ``processors.slo.parse_targets``). Values are ms. Shape::

        {window_s, since_s, until_s, requests,
         keys: [{service, model, operation, prompt_bucket, requests,
                 metrics: {ttft: {p50, p95, p99, count}, ...},
                 slo: [{target, met, value_ms}]}],
         slo: [{target, metric, percentile, threshold_ms, selector, requests,
                value_ms, met, compliance, burn_rate}],
         slo_errors: [str]}
    """
    from tokentrace.processors.sketches import LatencySketch
    from tokentrace.processors.slo import evaluate_window, parse_targets

    merged: dict[tuple[str, str, str, str], dict[str, LatencySketch]] = {}
    for _slice_start, key, metric, sketch_dict in slices:
        sketch = LatencySketch.from_dict(sketch_dict)
        per_metric = merged.setdefault(tuple(key), {})  # type: ignore[arg-type]
        if metric in per_metric:
            per_metric[metric].merge(sketch)
        else:
            per_metric[metric] = sketch

    # One bad target (e.g. written by a newer collector) must not hide the others.
    targets = []
    slo_errors: list[str] = []
    for raw_target in slo_targets:
        try:
            targets.extend(parse_targets([dict(raw_target)]))
        except (ValueError, TypeError, KeyError) as error:
            slo_errors.append(f"{raw_target!r}: {error}")

    keys_doc: list[dict[str, Any]] = []
    for key in sorted(merged, key=_key_sort):
        per_metric = merged[key]
        key_fields = dict(zip(KEY_FIELDS, key, strict=True))
        metrics_doc: dict[str, dict[str, Any]] = {}
        for metric in semconv.LATENCY_METRICS:
            sketch = per_metric.get(metric)
            if sketch is None or sketch.count == 0:
                continue
            entry: dict[str, Any] = {
                label: _ms_from_s(sketch.quantile(q)) for q, label in TOP_QUANTILES
            }
            entry["count"] = sketch.count
            metrics_doc[metric] = entry
        key_slo: list[dict[str, Any]] = []
        for target in targets:
            sketch = per_metric.get(target.metric)
            if sketch is None or not selector_matches(target.selector, key_fields):
                continue
            status = evaluate_window(target, sketch)
            key_slo.append(
                {
                    "target": target.name,
                    "met": status.met,
                    "value_ms": ns_to_ms(status.value_ns),
                }
            )
        e2e = metrics_doc.get(semconv.METRIC_E2E)
        requests = (
            e2e["count"] if e2e else max((m["count"] for m in metrics_doc.values()), default=0)
        )
        keys_doc.append(
            {**key_fields, "requests": requests, "metrics": metrics_doc, "slo": key_slo}
        )

    slo_doc: list[dict[str, Any]] = []
    for target in targets:
        combined: LatencySketch | None = None
        for key, per_metric in merged.items():
            sketch = per_metric.get(target.metric)
            if sketch is None:
                continue
            if not selector_matches(target.selector, dict(zip(KEY_FIELDS, key, strict=True))):
                continue
            if combined is None:
                combined = sketch.copy()
            else:
                combined.merge(sketch)
        entry = {
            "target": target.name,
            "metric": target.metric,
            "percentile": target.percentile,
            "threshold_ms": ns_to_ms(target.threshold_ns),
            "selector": dict(target.selector),
            "requests": 0,
            "value_ms": None,
            "met": None,
            "compliance": None,
            "burn_rate": None,
        }
        if combined is not None:
            status = evaluate_window(target, combined)
            entry["requests"] = status.requests
            entry["value_ms"] = ns_to_ms(status.value_ns)
            entry["met"] = status.met
            entry["compliance"] = _finite(status.compliance)
            entry["burn_rate"] = _finite(status.burn_rate)
        slo_doc.append(entry)

    return {
        "window_s": window_s,
        "since_s": now_s - window_s,
        "until_s": now_s,
        "requests": sum(k["requests"] for k in keys_doc),
        "keys": keys_doc,
        "slo": slo_doc,
        "slo_errors": slo_errors,
    }


def _key_sort(key: tuple[str, str, str, str]) -> tuple[Any, ...]:
    service, model, operation, bucket = key
    # Prompt buckets are labels like "128-511": order them by their lower bound.
    head = bucket.split("-", 1)[0].rstrip("+")
    lower = int(head) if head.isdigit() else math.inf
    return (model, operation, lower, bucket, service)
