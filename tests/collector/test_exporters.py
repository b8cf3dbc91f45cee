"""The collector's upstream exporters against a real OTLP receiver on loopback (upstream.py): how
they form requests (joined traces, data-point batches) and their YAML configuration. Sending itself
(transports, queue, retry, shutdown) is tested in tests/agent/test_otlp_export.py, the
environment in tests/agent/test_otlp_config.py."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    ExponentialHistogram,
    ExponentialHistogramDataPoint,
    Gauge,
    Metric,
    NumberDataPoint,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import semconv
from tokentrace.collector.encoding import encode_trace_request
from tokentrace.collector.exporters.otlp import (
    PROTOCOL_GRPC,
    PROTOCOL_HTTP_PROTOBUF,
    OtlpExporterConfig,
    OtlpMetricExporter,
    OtlpTraceExporter,
)
from tokentrace.collector.receivers.otlp_grpc import OtlpGrpcReceiver
from tokentrace.collector.receivers.otlp_http import OtlpHttpReceiver
from tokentrace.processors.model import SpanRef

from .consumers import RecordingConsumer
from .upstream import (
    FLUSH_S,
    PROTOCOLS,
    UpstreamOtlp,
    endpoint_of,
    exporter_options,
    iter_spans,
)


# --- helpers -----------------------------------------------------------------------------------
def make_config(endpoint: str, protocol: str, **overrides: Any) -> OtlpExporterConfig:
    """The collector's exporter config (a subclass of the agent's), with the tests' timings."""
    return OtlpExporterConfig(**exporter_options(endpoint, protocol, **overrides))


def resource(service: str) -> Resource:
    return Resource(
        attributes=[KeyValue(key=semconv.SERVICE_NAME, value=AnyValue(string_value=service))]
    )


def span_refs(
    count: int,
    *,
    resources: list[Resource] | None = None,
    scopes: list[InstrumentationScope] | None = None,
) -> list[SpanRef]:
    """``count`` distinct spans cycling through the shared resources x scopes."""
    resources = resources or [resource("svc")]
    scopes = scopes or [InstrumentationScope(name="scope")]
    refs = []
    for index in range(count):
        span = Span(
            trace_id=index.to_bytes(16, "big"),
            span_id=(index + 1).to_bytes(8, "big"),
            name=semconv.SPAN_REQUEST,
            start_time_unix_nano=1_000 + index,
            end_time_unix_nano=2_000 + index,
        )
        span.attributes.add(key=semconv.GEN_AI_REQUEST_MODEL, value=AnyValue(string_value="m"))
        span.attributes.add(key=semconv.GEN_AI_USAGE_OUTPUT_TOKENS, value=AnyValue(int_value=index))
        res = resources[index % len(resources)]
        scope = scopes[(index // len(resources)) % len(scopes)]
        refs.append(SpanRef(span=span, resource=res, scope=scope, service="svc"))
    return refs


def encoded_traces(
    sizes: Sequence[int],
    *,
    resources: list[Resource] | None = None,
    scopes: list[InstrumentationScope] | None = None,
) -> tuple[list[tuple[bytes, int]], list[SpanRef]]:
    """Traces of ``sizes`` spans as the pipeline hands them to ``export_encoded``: each trace
    serialised once on its own (trace ``k`` carries trace id ``k``), with its span count.
    Also returns every span, in order."""
    refs = span_refs(sum(sizes), resources=resources, scopes=scopes)
    traces: list[tuple[bytes, int]] = []
    start = 0
    for number, size in enumerate(sizes):
        members = refs[start : start + size]
        for ref in members:
            ref.span.trace_id = number.to_bytes(16, "big")
        traces.append((encode_trace_request(members), size))
        start += size
    return traces, refs


def traces_of(*sizes: int) -> list[tuple[bytes, int]]:
    """Encoded traces of ``sizes`` spans each (see ``encoded_traces``)."""
    return encoded_traces(sizes)[0]


def gauge(name: str, points: int) -> Metric:
    return Metric(
        name=name,
        unit=semconv.METRIC_UNIT_SECONDS,
        gauge=Gauge(
            data_points=[
                NumberDataPoint(as_double=float(i), time_unix_nano=i) for i in range(points)
            ]
        ),
    )


# --- delivery ------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_concatenated_traces_arrive_intact_under_their_resource_and_scope(
    upstream: UpstreamOtlp, protocol: str
) -> None:
    resources = [resource("svc-a"), resource("svc-b")]
    scopes = [InstrumentationScope(name="s1", version="1"), InstrumentationScope(name="s2")]
    traces, refs = encoded_traces([10, 10, 12, 8], resources=resources, scopes=scopes)
    exporter = OtlpTraceExporter(make_config(endpoint_of(upstream, protocol), protocol))
    exporter.export_encoded(traces)
    assert exporter.force_flush(FLUSH_S)
    exporter.shutdown(FLUSH_S)

    # 40 spans fit one request: the four serialised traces joined into one valid message.
    (request,) = upstream.trace_requests
    by_span_id = {ref.span.span_id: ref for ref in refs}
    received = []
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                ref = by_span_id[span.span_id]
                assert span == ref.span  # attributes, ids and times intact
                assert resource_spans.resource == ref.resource
                assert scope_spans.scope == ref.scope
                received.append(span)
    assert sorted(span.span_id for span in received) == sorted(ref.span.span_id for ref in refs)
    # Traces stay in order and whole (inside one, spans are grouped by resource and scope).
    trace_order = [int.from_bytes(span.trace_id, "big") for span in received]
    assert trace_order == sorted(trace_order)
    # Each trace keeps its own grouping: 2 resources per trace, 2 scopes under each.
    assert len(request.resource_spans) == 2 * len(traces)
    assert all(len(resource_spans.scope_spans) == 2 for resource_spans in request.resource_spans)
    assert upstream.calls[0].headers["user-agent"].startswith("tokentrace-collector/")
    assert exporter.stats() == {
        "sent_spans": 40,
        "dropped_spans": 0,
        "rejected_spans": 0,
        "retries": 0,
        "queue_len": 0,
    }


def test_requests_fill_up_to_max_batch_spans_without_splitting_a_trace(
    upstream: UpstreamOtlp,
) -> None:
    exporter = OtlpTraceExporter(
        make_config(upstream.http_endpoint, PROTOCOL_HTTP_PROTOBUF, max_batch_spans=10)
    )
    sizes = [4, 3, 5, 2, 6, 12, 1, 10]
    traces, refs = encoded_traces(sizes)
    exporter.export_encoded(traces)
    exporter.shutdown(FLUSH_S)

    requests = upstream.trace_requests
    traces_per_request = [
        sorted({int.from_bytes(span.trace_id, "big") for _, _, span in iter_spans([request])})
        for request in requests
    ]
    # Greedy in arrival order: a request takes the next trace while it fits in 10 spans; the
    # 12-span trace is never split, so it travels alone.
    assert traces_per_request == [[0, 1], [2, 3], [4], [5], [6], [7]]
    for request, numbers in zip(requests, traces_per_request, strict=True):
        spans = sum(1 for _ in iter_spans([request]))
        assert spans == sum(sizes[number] for number in numbers)
        assert spans <= 10 or len(numbers) == 1
    received = [span.span_id for _, _, span in iter_spans(requests)]
    assert received == [ref.span.span_id for ref in refs]
    assert exporter.stats()["sent_spans"] == sum(sizes)


def test_export_encoded_never_raises_on_a_malformed_entry(upstream: UpstreamOtlp) -> None:
    exporter = OtlpTraceExporter(make_config(upstream.http_endpoint, PROTOCOL_HTTP_PROTOBUF))
    (good,) = traces_of(2)
    malformed: Any = (b"", "two")  # a span count that is not a number
    exporter.export_encoded([good, malformed])
    exporter.shutdown(FLUSH_S)
    stats = exporter.stats()
    assert (stats["sent_spans"], stats["dropped_spans"]) == (0, 2)  # the batch was never formed


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_metrics_arrive_under_the_collector_scope(upstream: UpstreamOtlp, protocol: str) -> None:
    histogram = Metric(
        name=semconv.OTLP_METRIC_NAMES[semconv.METRIC_TTFT],
        unit=semconv.METRIC_UNIT_SECONDS,
        exponential_histogram=ExponentialHistogram(
            data_points=[
                ExponentialHistogramDataPoint(
                    count=3, sum=0.6, scale=3, attributes=[KeyValue(key="k", value=AnyValue())]
                )
            ]
        ),
    )
    metrics = [histogram, gauge("g", 4), Metric(name="empty")]
    exporter = OtlpMetricExporter(make_config(endpoint_of(upstream, protocol), protocol))
    exporter.export(metrics, resource_attributes={semconv.SERVICE_NAME: "tokentrace-collector"})
    exporter.shutdown(FLUSH_S)

    (request,) = upstream.metric_requests
    (resource_metrics,) = request.resource_metrics
    assert list(resource_metrics.resource.attributes) == [
        KeyValue(key=semconv.SERVICE_NAME, value=AnyValue(string_value="tokentrace-collector"))
    ]
    (scope_metrics,) = resource_metrics.scope_metrics
    assert scope_metrics.scope.name == semconv.COLLECTOR_SCOPE
    assert list(scope_metrics.metrics) == metrics[:2]  # the metric without data is skipped
    assert upstream.calls[0].signal == "metrics"
    stats = exporter.stats()
    assert stats["sent_data_points"] == 5
    assert stats["dropped_data_points"] == 0


def test_metric_requests_are_split_by_data_points(upstream: UpstreamOtlp) -> None:
    exporter = OtlpMetricExporter(
        make_config(upstream.http_endpoint, PROTOCOL_HTTP_PROTOBUF, max_batch_spans=5)
    )
    exporter.export(
        [gauge("a", 3), gauge("b", 2), gauge("c", 4), gauge("big", 7)], resource_attributes={}
    )
    exporter.shutdown(FLUSH_S)
    names = [
        [metric.name for metric in request.resource_metrics[0].scope_metrics[0].metrics]
        for request in upstream.metric_requests
    ]
    assert names == [["a", "b"], ["c"], ["big"]]
    assert exporter.stats()["sent_data_points"] == 16


# --- never blocking, bounded -------------------------------------------------------------------
def test_full_queue_drops_new_batches_and_counts_them_exactly(upstream: UpstreamOtlp) -> None:
    upstream.hold()
    exporter = OtlpTraceExporter(
        make_config(upstream.grpc_endpoint, PROTOCOL_GRPC, queue_size=10, max_batch_spans=5)
    )
    traces = traces_of(5, 5, 2, 3, 4, 7, 1)
    exporter.export_encoded(traces[0:1])  # taken by the worker, held upstream
    assert upstream.wait_for_started_calls(1)
    exporter.export_encoded(traces[1:2])  # queued: 5 of 10
    # One call, two requests: traces 2+3 fill the queue (10 of 10), trace 4 no longer fits.
    exporter.export_encoded(traces[2:5])
    stats = exporter.stats()
    assert (stats["dropped_spans"], stats["queue_len"]) == (4, 10)
    exporter.export_encoded(traces[5:6])  # 7 spans: one trace, travels alone, dropped whole
    exporter.export_encoded(traces[6:7])  # dropped
    stats = exporter.stats()
    assert (stats["dropped_spans"], stats["queue_len"]) == (4 + 7 + 1, 10)

    upstream.release()
    assert exporter.force_flush(FLUSH_S)
    exporter.shutdown(FLUSH_S)
    stats = exporter.stats()
    assert (stats["sent_spans"], stats["dropped_spans"], stats["queue_len"]) == (15, 12, 0)
    delivered = {
        int.from_bytes(span.trace_id, "big") for _, _, span in iter_spans(upstream.trace_requests)
    }
    assert delivered == {0, 1, 2, 3}  # whole traces: a dropped trace sends no span at all
    assert upstream.span_count() == 15


def test_exporter_without_an_endpoint_for_its_signal_is_disabled(upstream: UpstreamOtlp) -> None:
    config = OtlpExporterConfig(
        traces_endpoint=f"{upstream.http_endpoint}/v1/traces", protocol=PROTOCOL_HTTP_PROTOBUF
    )
    metrics = OtlpMetricExporter(config)
    traces = OtlpTraceExporter(config)
    assert (traces.enabled, metrics.enabled) == (True, False)
    metrics.export([gauge("g", 2)], resource_attributes={})
    traces.export_encoded(traces_of(2))
    metrics.shutdown(FLUSH_S)
    traces.shutdown(FLUSH_S)
    assert metrics.stats()["sent_data_points"] == metrics.stats()["dropped_data_points"] == 0
    assert [call.signal for call in upstream.calls] == ["traces"]


def test_exports_after_shutdown_are_counted_without_encoding(upstream: UpstreamOtlp) -> None:
    config = make_config(upstream.http_endpoint, PROTOCOL_HTTP_PROTOBUF)
    traces = OtlpTraceExporter(config)
    metrics = OtlpMetricExporter(config)
    traces.shutdown(FLUSH_S)
    metrics.shutdown(FLUSH_S)
    traces.export_encoded(traces_of(3, 4))
    metrics.export([gauge("a", 2), gauge("b", 5)], resource_attributes={})
    assert traces.stats()["dropped_spans"] == 7
    assert metrics.stats()["dropped_data_points"] == 7
    assert upstream.calls == []


# --- configuration -----------------------------------------------------------------------------
ENV = "OTEL_EXPORTER_OTLP_"


def test_invalid_configuration_is_refused_when_the_exporter_is_made() -> None:
    for exporter_type in (OtlpTraceExporter, OtlpMetricExporter):
        with pytest.raises(ValueError, match=r"^queue_size:"):
            exporter_type(OtlpExporterConfig(endpoint="http://h:4318", queue_size=1))


def test_from_settings_with_an_endpoint_ignores_the_environment() -> None:
    environ = {f"{ENV}ENDPOINT": "http://env:4318", f"{ENV}HEADERS": "secret=env"}
    config = OtlpExporterConfig.from_settings(
        {
            "endpoint": "http://tempo:4317",
            "headers": {"x-scope-orgid": "team"},
            "timeout": "1500ms",
            "tls": {"insecure": True},
            "sending_queue": {"queue_size": 2000},
            "retry_on_failure": {"initial_interval": "100ms", "max_elapsed_time": "30s"},
        },
        environ=environ,
    )
    assert config.protocol == PROTOCOL_GRPC  # the Collector's `otlp` exporter speaks gRPC
    assert config.endpoint_for("metrics") == "http://tempo:4317"
    assert dict(config.headers) == {"x-scope-orgid": "team"}
    assert config.timeout_s == pytest.approx(1.5)
    assert config.queue_size == 2000
    assert config.retry.initial_interval_s == pytest.approx(0.1)
    assert config.retry.max_elapsed_s == pytest.approx(30.0)
    assert config.uses_tls("http://tempo:4317") is False


def test_from_settings_without_an_endpoint_starts_from_the_environment() -> None:
    environ = {f"{ENV}ENDPOINT": "http://env:4318", f"{ENV}HEADERS": "k=v"}
    config = OtlpExporterConfig.from_settings({"compression": "none"}, environ=environ)
    assert config.endpoint_for("traces") == "http://env:4318/v1/traces"
    assert dict(config.headers) == {"k": "v"}
    assert config.compression == "none"


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"endpoint": "http://h:1", "bogus": 1}, "bogus"),
        ({"endpoint": "http://h:1", "timeout": "soon"}, "timeout"),
        ({"endpoint": "http://h:1", "tls": {"insecure": "yes"}}, "tls.insecure"),
        ({"endpoint": "http://h:1", "sending_queue": {"size": 1}}, "sending_queue.size"),
        ({"endpoint": "http://h:1", "retry_on_failure": {"max_interval": -1}}, "retry_on_failure"),
        ({"endpoint": "http://h:1", "headers": ["a"]}, "headers"),
        ({"compression": "none"}, "endpoint"),
    ],
)
def test_from_settings_errors_name_the_key(settings: Mapping[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=f"^{key}"):
        OtlpExporterConfig.from_settings(settings, environ={})


# --- TLS files (the OpenTelemetry Collector's tls keys) ------------------------------------------
def test_from_settings_takes_the_ca_and_client_certificate_files(
    tls_files: tuple[str, str],
) -> None:
    cert, key = tls_files
    config = OtlpExporterConfig.from_settings(
        {
            "endpoint": "https://h:4317",
            "tls": {"ca_file": cert, "cert_file": cert, "key_file": key},
        },
        environ={},
    )
    assert (config.certificate_file, config.client_certificate_file, config.client_key_file) == (
        cert,
        cert,
        key,
    )


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ({"ca_file": "/nonexistent/ca.pem"}, "^tls.ca_file: "),
        ({"ca_file": 3}, "^tls.ca_file: must be a string"),
        ({"key_file": "KEY"}, "^tls.key_file: given without tls.cert_file"),
        ({"cert_file": "CERT"}, "^tls.cert_file: given without tls.key_file"),
        ({"ca_file": "KEY"}, "^tls.ca_file: .*(certificate|PEM)"),
    ],
)
def test_tls_file_errors_name_the_key(
    tls: dict[str, Any], message: str, tls_files: tuple[str, str]
) -> None:
    cert, key = tls_files
    files = {
        k: {"CERT": cert, "KEY": key}.get(v, v) if isinstance(v, str) else v for k, v in tls.items()
    }
    with pytest.raises(ValueError, match=message):
        OtlpExporterConfig.from_settings({"endpoint": "https://h:4317", "tls": files}, environ={})


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_exporter_reaches_a_private_ca_upstream_with_ca_file(
    protocol: str, tls_files: tuple[str, str]
) -> None:
    cert, key = tls_files
    consumer = RecordingConsumer()
    receiver_type = OtlpGrpcReceiver if protocol == PROTOCOL_GRPC else OtlpHttpReceiver
    receiver = receiver_type(consumer, endpoint="127.0.0.1:0", tls_cert_file=cert, tls_key_file=key)
    receiver.start()
    try:
        config = OtlpExporterConfig.from_settings(
            {
                "endpoint": f"https://127.0.0.1:{receiver.port}",
                "protocol": protocol,
                "tls": {"ca_file": cert},  # the self-signed certificate is its own CA
            },
            environ={},
        )
        exporter = OtlpTraceExporter(config)
        try:
            now_ns = time.time_ns()
            span = Span(
                trace_id=b"\x01" * 16,
                span_id=b"\x02" * 8,
                name="over-tls",
                start_time_unix_nano=now_ns - 10**6,
                end_time_unix_nano=now_ns,
            )
            ref = SpanRef(span=span, resource=Resource(), scope=InstrumentationScope(), service="s")
            exporter.export_encoded([(encode_trace_request([ref]), 1)])
            assert exporter.force_flush(FLUSH_S)
        finally:
            exporter.shutdown(FLUSH_S)
    finally:
        receiver.shutdown(grace_s=0)
    assert consumer.span_names() == ["over-tls"]
