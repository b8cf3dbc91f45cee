"""The window report: stored percentile-sketch slices and SLO targets merged into the document
``tokentrace top --json`` prints (per key percentiles, per target SLO status).

It is pure (slices and targets in, a document out), so the CLI and the API serve the same
shape from any store; it reads sketch slices, not request rows, hence its own module beside
``document.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final

from tokentrace.agent import semconv
from tokentrace.collector.store.document import finite_or_none, ns_to_ms
from tokentrace.processors.slo import SELECTOR_KEYS

if TYPE_CHECKING:
    from tokentrace.processors.slo import SloTarget

_MS_PER_S: Final = 1_000

TOP_QUANTILES: Final = ((0.5, "p50"), (0.95, "p95"), (0.99, "p99"))
"""The quantiles ``window_report`` reports for every metric."""

SketchSlice = tuple[float, tuple[str, str, str, str], str, dict[str, Any]]
"""(slice_start_s, (service, model, operation, prompt_bucket), metric, LatencySketch dict)."""


def _ms_from_s(value_s: float | None) -> float | None:
    if value_s is None or not math.isfinite(value_s):
        return None
    return round(value_s * _MS_PER_S, 3)


def window_report(
    slices: Iterable[SketchSlice],
    *,
    window_s: float,
    now_s: float,
    slo_targets: Sequence[SloTarget] = (),
    slo_errors: Sequence[str] = (),
) -> dict[str, Any]:
    """Merge sketch slices per key and metric; percentiles per key; SLO status per target.

    ``slo_errors``: why some of the targets could not be read (``RequestStore.slo_targets``),
    reported as they are. Values are ms. Shape::

        {window_s, since_s, until_s, requests,
         keys: [{service, model, operation, prompt_bucket, requests,
                 metrics: {ttft: {p50, p95, p99, count}, ...},
                 slo: [{target, met, value_ms}]}],
         slo: [{target, metric, percentile, threshold_ms, selector, requests,
                value_ms, met, compliance, burn_rate}],
         slo_errors: [str]}
    """
    from tokentrace.processors.sketches import LatencySketch
    from tokentrace.processors.slo import evaluate_window

    merged: dict[tuple[str, str, str, str], dict[str, LatencySketch]] = {}
    for _slice_start, key, metric, sketch_dict in slices:
        loaded = LatencySketch.from_dict(sketch_dict)
        per_metric = merged.setdefault(tuple(key), {})  # type: ignore[arg-type]
        if metric in per_metric:
            per_metric[metric].merge(loaded)
        else:
            per_metric[metric] = loaded

    keys_doc: list[dict[str, Any]] = []
    for key in sorted(merged, key=_key_sort):
        per_metric = merged[key]
        key_fields = dict(zip(SELECTOR_KEYS, key, strict=True))
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
        for target in slo_targets:
            sketch = per_metric.get(target.metric)
            if sketch is None or not target.matches_key(key_fields):
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
    for target in slo_targets:
        combined: LatencySketch | None = None
        for key, per_metric in merged.items():
            sketch = per_metric.get(target.metric)
            if sketch is None:
                continue
            if not target.matches_key(dict(zip(SELECTOR_KEYS, key, strict=True))):
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
            entry["compliance"] = finite_or_none(status.compliance)
            entry["burn_rate"] = finite_or_none(status.burn_rate)
        slo_doc.append(entry)

    return {
        "window_s": window_s,
        "since_s": now_s - window_s,
        "until_s": now_s,
        "requests": sum(k["requests"] for k in keys_doc),
        "keys": keys_doc,
        "slo": slo_doc,
        "slo_errors": list(slo_errors),
    }


def _key_sort(key: tuple[str, str, str, str]) -> tuple[Any, ...]:
    service, model, operation, bucket = key
    # Prompt buckets are labels like "128-511": order them by their lower bound.
    head = bucket.split("-", 1)[0].rstrip("+")
    lower = int(head) if head.isdigit() else math.inf
    return (model, operation, lower, bucket, service)
