"""Upstream OTLP export as a pipeline sink: enriched spans as they finish, metrics periodically."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tokentrace.agent import semconv
from tokentrace.collector.config import UpstreamConfig
from tokentrace.collector.exporters.otlp import OtlpMetricExporter, OtlpTraceExporter

if TYPE_CHECKING:
    from tokentrace.collector.pipeline import Pipeline, ProcessedTrace

_COLLECTOR_SERVICE_NAME = "tokentrace-collector"


class UpstreamSink:
    def __init__(
        self,
        config: UpstreamConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._traces = OtlpTraceExporter(config.exporter)
        self._metrics = OtlpMetricExporter(config.exporter)
        self._interval_s = config.metrics_interval_s
        self._clock = clock
        self._next_metrics = clock() + self._interval_s
        self._start_ns = time.time_ns()
        # Cumulative series must each have one writer: replicas tell theirs apart by instance.
        self._resource_attributes = {
            semconv.SERVICE_NAME: _COLLECTOR_SERVICE_NAME,
            semconv.SERVICE_INSTANCE_ID: str(uuid.uuid4()),
        }

    def export_traces(self, batch: Sequence[ProcessedTrace]) -> None:
        """Queue each trace's enriched spans; a re-derived late fragment's ``otlp`` holds only
        its own spans (the stored ones went upstream with their trace)."""
        self._traces.export_encoded([(item.otlp, len(item.trace.spans)) for item in batch])

    def housekeeping(self, pipeline: Pipeline, *, final: bool = False) -> None:
        if final or self._clock() >= self._next_metrics:
            self.export_metrics(pipeline)
            self._next_metrics = self._clock() + self._interval_s

    def export_metrics(self, pipeline: Pipeline) -> None:
        if pipeline.percentiles is None:
            return
        metrics = pipeline.percentiles.to_otlp_metrics(
            start_time_unix_nano=self._start_ns, time_unix_nano=time.time_ns()
        )
        if metrics:
            self._metrics.export(metrics, resource_attributes=self._resource_attributes)

    def shutdown(self, timeout_s: float) -> None:
        self._traces.shutdown(timeout_s / 2)
        self._metrics.shutdown(timeout_s / 2)

    def stats(self) -> dict[str, int]:
        stats = {f"traces.{k}": v for k, v in self._traces.stats().items()}
        stats.update({f"metrics.{k}": v for k, v in self._metrics.stats().items()})
        return stats
