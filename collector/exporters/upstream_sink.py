"""The ``otlp`` exporter: enriched spans as they finish; every ``metrics_interval`` (and on the
final tick) the percentile histograms and the collector's self-telemetry, both from the pipeline's
tick, under the collector's resource."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

from tokentrace.agent import semconv
from tokentrace.collector.component_configs import UpstreamConfig
from tokentrace.collector.exporters.otlp import OtlpMetricExporter, OtlpTraceExporter
from tokentrace.collector.self_telemetry import ComponentTelemetry

if TYPE_CHECKING:
    from tokentrace.collector.pipeline import PipelineTick, ProcessedTrace

_COLLECTOR_SERVICE_NAME: Final = "tokentrace-collector"
SNAPSHOT_PREFIX: Final = "UpstreamSink."
"""What the view given to ``UpstreamSink`` prefixes its snapshot keys with (then the signal)."""
_TRACES: Final = "traces"
_METRICS: Final = "metrics"
_QUEUE_LEN: Final = {semconv.SELF_METRIC_QUEUE_LEN: "items waiting to be sent"}
_SENDER_COUNTERS: Final = {
    _TRACES: {
        semconv.SELF_METRIC_SENT_SPANS: "spans the upstream accepted",
        semconv.SELF_METRIC_DROPPED_SPANS: "spans given up",
        semconv.SELF_METRIC_REJECTED_SPANS: "spans the upstream refused",
        semconv.SELF_METRIC_RETRIES: "export attempts retried",
    },
    _METRICS: {
        semconv.SELF_METRIC_SENT_DATA_POINTS: "data points the upstream accepted",
        semconv.SELF_METRIC_DROPPED_DATA_POINTS: "data points given up",
        semconv.SELF_METRIC_REJECTED_DATA_POINTS: "data points the upstream refused",
        semconv.SELF_METRIC_RETRIES: "export attempts retried",
    },
}


class UpstreamSink:
    def __init__(
        self,
        config: UpstreamConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        telemetry: ComponentTelemetry | None = None,
    ) -> None:
        """``telemetry``: this exporter's view of the collector's registry (snapshot prefix
        ``SNAPSHOT_PREFIX``), which each sender's counters are reported to, with the signal as
        an attribute."""
        self._traces = OtlpTraceExporter(config.exporter)
        self._metrics = OtlpMetricExporter(config.exporter)
        self._interval_s = config.metrics_interval_s
        self._clock = clock
        self._next_metrics = clock() + self._interval_s
        # Cumulative series must each have one writer: replicas tell theirs apart by instance.
        self._resource_attributes = {
            semconv.SERVICE_NAME: _COLLECTOR_SERVICE_NAME,
            semconv.SERVICE_INSTANCE_ID: str(uuid.uuid4()),
        }
        if telemetry is not None:
            for signal, exporter in ((_TRACES, self._traces), (_METRICS, self._metrics)):
                view = telemetry.part(
                    snapshot_prefix=f"{signal}.", attributes={semconv.SELF_ATTR_SIGNAL: signal}
                )
                view.observe(exporter.stats, counters=_SENDER_COUNTERS[signal], gauges=_QUEUE_LEN)

    def export_traces(self, batch: Sequence[ProcessedTrace]) -> None:
        """Queue each trace's enriched spans; a re-derived late fragment's ``otlp`` holds only
        its own spans (the stored ones went upstream with their trace)."""
        self._traces.export_encoded([(item.otlp, len(item.trace.spans)) for item in batch])

    def tick(self, tick: PipelineTick) -> None:
        if tick.final or self._clock() >= self._next_metrics:
            metrics = tick.otlp_metrics()
            if metrics:
                self._metrics.export(metrics, resource_attributes=self._resource_attributes)
            self._next_metrics = self._clock() + self._interval_s

    def start(self) -> None:
        """Nothing left to do: the senders start their workers with the first export."""

    def shutdown(self, timeout_s: float) -> None:
        self._traces.shutdown(timeout_s / 2)
        self._metrics.shutdown(timeout_s / 2)
