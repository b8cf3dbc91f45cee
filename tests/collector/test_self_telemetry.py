"""The self-telemetry registry: instruments, the flat snapshot, and the OTLP encoding (decoded
with the opentelemetry-proto classes)."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import AGGREGATION_TEMPORALITY_CUMULATIVE, Metric

from tokentrace.agent import semconv
from tokentrace.collector.component import KIND_EXPORTER, KIND_PIPELINE, KIND_PROCESSOR
from tokentrace.collector.self_telemetry import SelfTelemetry, metric_key

START_NS = 1_000
NOW_NS = 5_000


def decoded(telemetry: SelfTelemetry) -> dict[str, Metric]:
    """The registry's OTLP metrics after a round trip through the wire format, by name."""
    request = ExportMetricsServiceRequest()
    scope = request.resource_metrics.add().scope_metrics.add()
    scope.metrics.extend(
        telemetry.to_otlp_metrics(start_time_unix_nano=START_NS, time_unix_nano=NOW_NS)
    )
    wire = ExportMetricsServiceRequest.FromString(request.SerializeToString())
    return {metric.name: metric for metric in wire.resource_metrics[0].scope_metrics[0].metrics}


def attributes(point: Any) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in point.attributes}


def test_counters_gauges_and_sources_in_the_snapshot_keep_the_readers_shape() -> None:
    telemetry = SelfTelemetry()
    pipeline = telemetry.component("traces", KIND_PIPELINE)
    requests = pipeline.counter(semconv.SELF_METRIC_REQUESTS, description="requests")
    errors = pipeline.keyed_counter(
        semconv.SELF_METRIC_PROCESSOR_ERRORS, key_kind=KIND_PROCESSOR, description="errors"
    )
    pending = [7]
    pipeline.gauge(semconv.SELF_METRIC_PENDING_SPANS, lambda: pending[0], description="pending")
    store = telemetry.component("store", KIND_EXPORTER, snapshot_prefix="StoreSink.")
    store.observe(
        lambda: {"written_requests": 4, "pruned_requests": 1},
        counters={
            semconv.SELF_METRIC_WRITTEN_REQUESTS: "written",
            semconv.SELF_METRIC_PRUNED_REQUESTS: "pruned",
        },
    )
    requests.add()
    requests.add(2)
    errors.add("slo")
    errors.add("slo")
    errors.add("normalize")
    pending[0] = 3
    assert telemetry.snapshot() == {
        "requests": 3,
        "processor_errors": {"slo": 2, "normalize": 1},
        "pending_spans": 3,
        "StoreSink.written_requests": 4,
        "StoreSink.pruned_requests": 1,
    }


def test_values_observed_one_by_one_name_each_metric_once() -> None:
    telemetry = SelfTelemetry()
    evicted = [0]
    view = telemetry.component("percentiles", KIND_PROCESSOR)
    view.observe_each(
        counters={semconv.SELF_METRIC_PERCENTILE_KEYS_EVICTED: ("evicted", lambda: evicted[0])},
        gauges={semconv.SELF_METRIC_PENDING_TRACES: ("pending", lambda: 2)},
    )
    evicted[0] = 5  # read when collected, not when registered
    assert telemetry.snapshot() == {"percentile_keys_evicted": 5, "pending_traces": 2}
    metrics = decoded(telemetry)
    assert metrics[semconv.SELF_METRIC_PERCENTILE_KEYS_EVICTED].description == "evicted"
    assert metrics[semconv.SELF_METRIC_PERCENTILE_KEYS_EVICTED].sum.data_points[0].as_int == 5
    assert metrics[semconv.SELF_METRIC_PENDING_TRACES].gauge.data_points[0].as_int == 2


def test_series_with_one_snapshot_key_are_summed() -> None:
    telemetry = SelfTelemetry()
    for component_id, sent in (("otlp/a", 2), ("otlp/b", 5)):
        view = telemetry.component(
            component_id, KIND_EXPORTER, snapshot_prefix="UpstreamSink.traces."
        )
        view.observe(
            lambda sent=sent: {"sent_spans": sent},
            counters={semconv.SELF_METRIC_SENT_SPANS: "sent"},
        )
    assert telemetry.snapshot() == {"UpstreamSink.traces.sent_spans": 7}
    (metric,) = decoded(telemetry).values()
    ids = {attributes(p)[semconv.SELF_ATTR_COMPONENT_ID]: p.as_int for p in metric.sum.data_points}
    assert ids == {"otlp/a": 2, "otlp/b": 5}  # separate series upstream


def test_otlp_encoding_names_kinds_values_and_attributes() -> None:
    telemetry = SelfTelemetry()
    pipeline = telemetry.component("traces", KIND_PIPELINE)
    pipeline.counter(semconv.SELF_METRIC_TRACES, description="traces processed").add(4)
    pipeline.keyed_counter(
        semconv.SELF_METRIC_EXPORTER_ERRORS, key_kind=KIND_EXPORTER, description="errors"
    ).add("otlp/tempo")
    pipeline.gauge(semconv.SELF_METRIC_PENDING_TRACES, lambda: 2.5, description="pending")
    histogram = pipeline.histogram(
        semconv.SELF_METRIC_BATCH_DURATION, (0.01, 0.1), description="batch", unit="s"
    )
    for value in (0.005, 0.01, 0.05, 0.5):
        histogram.record(value)
    receiver = telemetry.component(
        "otlp", "receiver", attributes={semconv.SELF_ATTR_TRANSPORT: "grpc"}
    )
    receiver.observe(
        lambda: {"accepted_spans": 9, "queue_len": 1},
        counters={semconv.SELF_METRIC_ACCEPTED_SPANS: "accepted"},
        gauges={semconv.SELF_METRIC_QUEUE_LEN: "queued"},
    )

    metrics = decoded(telemetry)
    assert set(metrics) == {
        semconv.SELF_METRIC_TRACES,
        semconv.SELF_METRIC_EXPORTER_ERRORS,
        semconv.SELF_METRIC_PENDING_TRACES,
        semconv.SELF_METRIC_BATCH_DURATION,
        semconv.SELF_METRIC_ACCEPTED_SPANS,
        semconv.SELF_METRIC_QUEUE_LEN,
    }
    assert all(name.startswith(semconv.SELF_METRIC_PREFIX) for name in metrics)

    traces = metrics[semconv.SELF_METRIC_TRACES]
    assert (traces.WhichOneof("data"), traces.description) == ("sum", "traces processed")
    assert traces.sum.is_monotonic
    assert traces.sum.aggregation_temporality == AGGREGATION_TEMPORALITY_CUMULATIVE
    (point,) = traces.sum.data_points
    assert (point.as_int, point.start_time_unix_nano, point.time_unix_nano) == (4, START_NS, NOW_NS)
    assert attributes(point) == {
        semconv.SELF_ATTR_COMPONENT_ID: "traces",
        semconv.SELF_ATTR_COMPONENT_KIND: KIND_PIPELINE,
    }

    (error_point,) = metrics[semconv.SELF_METRIC_EXPORTER_ERRORS].sum.data_points
    assert error_point.as_int == 1
    assert attributes(error_point) == {  # the exporter that failed, not the counting pipeline
        semconv.SELF_ATTR_COMPONENT_ID: "otlp/tempo",
        semconv.SELF_ATTR_COMPONENT_KIND: KIND_EXPORTER,
    }

    pending = metrics[semconv.SELF_METRIC_PENDING_TRACES]
    assert pending.WhichOneof("data") == "gauge"
    (gauge_point,) = pending.gauge.data_points
    assert (gauge_point.as_double, gauge_point.time_unix_nano) == (2.5, NOW_NS)

    batch = metrics[semconv.SELF_METRIC_BATCH_DURATION]
    assert (batch.WhichOneof("data"), batch.unit) == ("histogram", "s")
    assert batch.histogram.aggregation_temporality == AGGREGATION_TEMPORALITY_CUMULATIVE
    (hist_point,) = batch.histogram.data_points
    assert list(hist_point.explicit_bounds) == [0.01, 0.1]
    assert list(hist_point.bucket_counts) == [2, 1, 1]  # upper bounds inclusive
    assert (hist_point.count, hist_point.min, hist_point.max) == (4, 0.005, 0.5)
    assert hist_point.sum == pytest.approx(0.565)

    (accepted,) = metrics[semconv.SELF_METRIC_ACCEPTED_SPANS].sum.data_points
    assert accepted.as_int == 9
    assert attributes(accepted)[semconv.SELF_ATTR_TRANSPORT] == "grpc"
    (queued,) = metrics[semconv.SELF_METRIC_QUEUE_LEN].gauge.data_points
    assert queued.as_int == 1
    # Histograms are for OTLP only: the flat snapshot holds what its readers read.
    assert metric_key(semconv.SELF_METRIC_BATCH_DURATION) not in telemetry.snapshot()


def test_a_failing_source_hides_only_itself() -> None:
    telemetry = SelfTelemetry()

    def broken() -> dict[str, int]:
        raise RuntimeError("gone")

    telemetry.component("store", KIND_EXPORTER).observe(
        broken, counters={semconv.SELF_METRIC_WRITTEN_REQUESTS: "written"}
    )
    telemetry.component("traces", KIND_PIPELINE).counter(
        semconv.SELF_METRIC_TRACES, description="traces"
    ).add()
    assert telemetry.snapshot() == {"traces": 1}


def test_series_and_keys_are_capped() -> None:
    telemetry = SelfTelemetry(max_series=2, max_keys=2)
    names = (semconv.SELF_METRIC_TRACES, semconv.SELF_METRIC_REQUESTS, semconv.SELF_METRIC_RETRIES)
    view = telemetry.component("traces", KIND_PIPELINE)
    counters = [view.counter(name, description="") for name in names]
    for counter in counters:
        counter.add()  # the one beyond the cap still counts for its owner
    assert telemetry.snapshot() == {"traces": 1, "requests": 1}
    assert telemetry.dropped_series == 1

    keyed = SelfTelemetry(max_keys=2)
    errors = keyed.component("traces", KIND_PIPELINE).keyed_counter(
        semconv.SELF_METRIC_PROCESSOR_ERRORS, key_kind=KIND_PROCESSOR, description=""
    )
    for key in ("a", "b", "c", "a"):
        errors.add(key)
    assert keyed.snapshot() == {"processor_errors": {"a": 2, "b": 1}}


def test_registration_errors() -> None:
    telemetry = SelfTelemetry()
    view = telemetry.component("traces", KIND_PIPELINE)
    view.counter(semconv.SELF_METRIC_TRACES, description="")
    with pytest.raises(ValueError, match="already registered"):
        view.counter(semconv.SELF_METRIC_TRACES, description="")
    with pytest.raises(ValueError, match="registered as a sum"):
        telemetry.component("other", KIND_PIPELINE).gauge(
            semconv.SELF_METRIC_TRACES, lambda: 1, description=""
        )
    with pytest.raises(ValueError, match="must start with"):
        view.counter("requests", description="")
    with pytest.raises(ValueError, match="strictly increasing"):
        view.histogram(semconv.SELF_METRIC_BATCH_DURATION, (1.0, 0.5), description="", unit="s")
