"""The request metrics of the admin extension's Prometheus ``/metrics``, fed by the pipeline.

``PrometheusSink`` is a ``TraceSink`` like the exporters: the collector hands it every batch
(``export_traces``) when an ``admin`` extension runs (``collector/service.py`` wires it; it is
not configured as an exporter). Per request it observes, in a ``prometheus-client`` registry of
the admin extension's own (never the global one):

- the TTFT, TPOT, E2E histograms and one ITL observation per inter-token gap, in seconds, with
  buckets for LLM latencies, labelled by service, model and operation;
- per SLO target the request's outcome (``good``: inside the threshold), from the ``slo``
  processor's marks, so PromQL derives compliance and burn rate over any range; the targets'
  objectives and thresholds are gauges set once;
- the dominant segment and cause of its verdict (the ``diagnosis`` processor's);
- the seconds it spent in each budget segment (its E2E partition), for the budget over time.

Each request is counted once, as the pipeline's ``requests`` counter counts it: a late fragment
derived again with its trace's stored spans adds only the records beyond those it replaces.
Cardinality is capped: at most ``max_label_sets`` (service, model, operation) label sets; later
ones are counted under ``_other`` (``tokentrace_label_sets_overflowed_total`` counts them).
Names and label names are ``semconv``'s ``PROM_*``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from tokentrace.agent import semconv
from tokentrace.processors.model import RequestRecord
from tokentrace.processors.slo import SloTarget

if TYPE_CHECKING:
    from tokentrace.collector.pipeline import PipelineTick, ProcessedTrace

_log = logging.getLogger(__name__)

DEFAULT_MAX_LABEL_SETS: Final = 100
TTFT_BUCKETS_S: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
"""Time to first token: 5 ms (a cached prefix on a fast GPU) to a minute (a long queue)."""
TOKEN_BUCKETS_S: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.0,
)  # fmt: skip
"""TPOT and ITL: 1 ms (a small model, small batch) to 2 s (a stall)."""
E2E_BUCKETS_S: Final = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
"""End to end: 50 ms to 10 minutes (long generations)."""
_NS_PER_S: Final = 1e9
_REQUEST_LABELS: Final = (
    semconv.PROM_LABEL_SERVICE,
    semconv.PROM_LABEL_MODEL,
    semconv.PROM_LABEL_OPERATION,
)
_OVERFLOW: Final[tuple[str, str, str]] = (
    semconv.PROM_OVERFLOW_LABEL_VALUE,
    semconv.PROM_OVERFLOW_LABEL_VALUE,
    semconv.PROM_OVERFLOW_LABEL_VALUE,
)


class PrometheusSink:
    """Request metrics into ``registry`` from every batch (module docstring). Called on the
    pipeline thread only; prometheus-client's metrics are read safely by the scraping thread."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        slo_targets: Sequence[SloTarget] = (),
        max_label_sets: int = DEFAULT_MAX_LABEL_SETS,
    ) -> None:
        if max_label_sets < 1:
            raise ValueError(f"max_label_sets: must be >= 1, got {max_label_sets}")
        # No ``*_created`` series beside every counter and histogram: Prometheus's text format
        # would ingest them as series of their own. A process-wide switch of prometheus-client;
        # nothing else in the collector uses the library.
        disable_created_metrics()
        self._max_label_sets = max_label_sets
        self._label_sets: set[tuple[str, str, str]] = set()
        self._overflow_logged = False
        self._target_metrics = {target.name: target.metric for target in slo_targets}

        def histogram(name: str, buckets: Sequence[float], doc: str) -> Histogram:
            return Histogram(name, doc, _REQUEST_LABELS, buckets=buckets, registry=registry)

        self._ttft = histogram(semconv.PROM_METRIC_TTFT, TTFT_BUCKETS_S, "time to first token")
        self._tpot = histogram(semconv.PROM_METRIC_TPOT, TOKEN_BUCKETS_S, "time per output token")
        self._itl = histogram(semconv.PROM_METRIC_ITL, TOKEN_BUCKETS_S, "inter-token gaps")
        self._e2e = histogram(semconv.PROM_METRIC_E2E, E2E_BUCKETS_S, "end-to-end latency")
        target_labels = (semconv.PROM_LABEL_TARGET, semconv.PROM_LABEL_METRIC)
        self._slo_requests = Counter(
            semconv.PROM_METRIC_SLO_REQUESTS,
            "requests an SLO target judged, by outcome",
            (*target_labels, semconv.PROM_LABEL_OUTCOME),
            registry=registry,
        )
        objective = Gauge(
            semconv.PROM_METRIC_SLO_OBJECTIVE,
            "share of requests a target wants inside its threshold",
            target_labels,
            registry=registry,
        )
        threshold = Gauge(
            semconv.PROM_METRIC_SLO_THRESHOLD,
            "latency threshold of a target",
            target_labels,
            registry=registry,
        )
        for target in slo_targets:
            objective.labels(target.name, target.metric).set(target.percentile / 100)
            threshold.labels(target.name, target.metric).set(target.threshold_ns / _NS_PER_S)
            for outcome in (semconv.PROM_OUTCOME_GOOD, semconv.PROM_OUTCOME_BAD):
                # Present from the start: a target with no bad request yet shows 0, not nothing.
                self._slo_requests.labels(target.name, target.metric, outcome)
        self._dominant = Counter(
            semconv.PROM_METRIC_DOMINANT_SEGMENT,
            "requests by the dominant segment and cause of their verdict",
            (
                *_REQUEST_LABELS,
                semconv.PROM_LABEL_METRIC,
                semconv.PROM_LABEL_SEGMENT,
                semconv.PROM_LABEL_CAUSE,
            ),
            registry=registry,
        )
        self._segment_seconds = Counter(
            semconv.PROM_METRIC_SEGMENT_SECONDS,
            "seconds requests spent in each budget segment",
            (*_REQUEST_LABELS, semconv.PROM_LABEL_SEGMENT),
            registry=registry,
        )
        self._overflowed = Counter(
            semconv.PROM_METRIC_LABEL_SETS_OVERFLOWED,
            "requests counted under _other: max_label_sets reached",
            registry=registry,
        )

    def export_traces(self, batch: Sequence[ProcessedTrace]) -> None:
        for item in batch:
            records = item.records
            if item.replaces_stored:
                # Counted when first derived: only what the fragment added is new.
                replaced = set(item.replaces_stored)
                fresh = [r for r in records if r.timeline.span_id not in replaced]
                records = fresh[: max(0, len(records) - len(replaced))]
            for record in records:
                self._observe(record)

    def _observe(self, record: RequestRecord) -> None:
        labels = self._labels_of(record)
        metrics = record.metrics
        if metrics.ttft is not None:
            self._ttft.labels(*labels).observe(metrics.ttft / _NS_PER_S)
        if metrics.tpot is not None:
            self._tpot.labels(*labels).observe(metrics.tpot / _NS_PER_S)
        if metrics.itl:
            itl = self._itl.labels(*labels)
            for gap in metrics.itl:
                itl.observe(gap / _NS_PER_S)
        self._e2e.labels(*labels).observe(metrics.e2e / _NS_PER_S)
        for segment, spent_ns in record.budget.segments.items():
            if spent_ns > 0:
                self._segment_seconds.labels(*labels, segment).inc(spent_ns / _NS_PER_S)
        for target, met in record.slo.items():
            outcome = semconv.PROM_OUTCOME_GOOD if met else semconv.PROM_OUTCOME_BAD
            metric = self._target_metrics.get(target, "")
            self._slo_requests.labels(target, metric, outcome).inc()
        verdict = record.verdict
        if verdict is not None:
            self._dominant.labels(*labels, verdict.metric, verdict.segment, verdict.cause).inc()

    def _labels_of(self, record: RequestRecord) -> tuple[str, str, str]:
        timeline = record.timeline
        labels = (timeline.service, timeline.model, timeline.operation)
        if labels in self._label_sets:
            return labels
        if len(self._label_sets) < self._max_label_sets:
            self._label_sets.add(labels)
            return labels
        if not self._overflow_logged:  # the first overflow is worth one log line
            self._overflow_logged = True
            _log.warning(
                "prometheus metrics: more than %d (service, model, operation) label sets; "
                "further ones are counted under %r",
                self._max_label_sets,
                semconv.PROM_OVERFLOW_LABEL_VALUE,
            )
        self._overflowed.inc()
        return _OVERFLOW

    def tick(self, tick: PipelineTick) -> None:
        """Nothing periodic: the self-telemetry is read at each scrape (``collector/admin.py``)."""

    def start(self) -> None:
        """Nothing to start: it serves through the admin extension's listener."""

    def shutdown(self, *, timeout_s: float) -> None:
        """Nothing to flush: a scrape reads the current values."""
