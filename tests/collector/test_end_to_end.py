"""The collector end to end: official OpenTelemetry SDK exporters send request traces to a running
collector on 127.0.0.1; a test-owned upstream OTLP receiver gets the enriched spans and metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from tests.collector.upstream import UpstreamOtlp
from tokentrace.agent import semconv
from tokentrace.collector.config import parse_config
from tokentrace.collector.service import Collector
from tokentrace.collector.store import RequestStore
from tokentrace.loadgen.replay.emit import emit_sdk
from tokentrace.loadgen.replay.request import SimulatedRequest
from tokentrace.loadgen.replay.simulation import simulate


def start_collector(tmp_path: Path, upstream: UpstreamOtlp) -> Collector:
    raw: dict[str, Any] = {
        "receivers": {
            "otlp": {
                "protocols": {
                    "grpc": {"endpoint": "127.0.0.1:0"},
                    "http": {"endpoint": "127.0.0.1:0"},
                }
            }
        },
        "processors": {
            "assembly": {"quiet_period": "300ms", "root_grace": "50ms"},
            "slo": {
                "targets": [
                    {"name": "ttft-p95", "metric": "ttft", "percentile": 95, "threshold": "500ms"},
                    {"name": "tpot-p99", "metric": "tpot", "percentile": 99, "threshold": "1ms"},
                ]
            },
        },
        "exporters": {
            "store": {"path": str(tmp_path / "requests.db")},
            "otlp": {
                "endpoint": f"http://127.0.0.1:{upstream.grpc_port}",
                "tls": {"insecure": True},
                "metrics_interval": "1h",
            },
        },
    }
    collector = Collector(parse_config(raw, environ={}))
    collector.start()
    return collector


def send(requests: list[SimulatedRequest], exporter: SpanExporter, dialect: str) -> int:
    provider = TracerProvider(resource=Resource.create({semconv.SERVICE_NAME: "vllm-e2e"}))
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=100_000))
    count = emit_sdk(requests, provider, dialect=dialect)  # type: ignore[arg-type]
    assert provider.force_flush(30_000)
    provider.shutdown()
    return count


def attributes(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = getattr(value, kind) if kind != "array_value" else value.array_value
    return out


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_sdk_exporters_to_collector_to_store_and_upstream(
    tmp_path: Path, upstream: UpstreamOtlp, transport: str
) -> None:
    collector = start_collector(tmp_path, upstream)
    requests = simulate("mixed", requests=60, seed=3)
    try:
        if transport == "grpc":
            exporter: SpanExporter = GrpcSpanExporter(
                endpoint=f"127.0.0.1:{collector.grpc_port}", insecure=True
            )
        else:
            exporter = HttpSpanExporter(
                endpoint=f"http://127.0.0.1:{collector.http_port}/v1/traces"
            )
        sent_spans = send(requests, exporter, "tokentrace")
        collector.flush()
        stats = collector.stats()
        assert stats["received_spans"] == sent_spans
        assert stats["requests"] == len(requests)
        assert not stats["processor_errors"]
    finally:
        collector.shutdown()  # flushes the upstream exporters and the final metrics

    store = RequestStore.open_readonly(tmp_path / "requests.db")
    try:
        assert store.count() == len(requests)
        slowest = store.slowest(metric="e2e", limit=len(requests))
    finally:
        store.close()
    by_request_id = {r.request_id: r for r in requests}
    for doc in slowest:
        simulated = by_request_id[doc["request_id"]]
        # The collector's TTFT is first token - server arrival (the HTTP span's start).
        expected_ttft_ms = (simulated.first_token_ns - simulated.server_start_ns) / 1e6
        assert doc["metrics_ms"]["ttft"] == pytest.approx(expected_ttft_ms, abs=0.001)
        budget = doc["budget"]
        segments = sum(v for k, v in budget.items() if k != "e2e_ms")
        assert segments == pytest.approx(budget["e2e_ms"], abs=0.002)
        assert doc["verdict"]["sentence"]
        assert set(doc["slo"]) == {"ttft-p95", "tpot-p99"}

    # Upstream: every span, the request spans enriched.
    assert upstream.span_count() == sent_spans
    enriched = []
    for request in upstream.trace_requests:
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    if span.name == semconv.SPAN_REQUEST:
                        enriched.append(attributes(span))
    assert len(enriched) == len(requests)
    for attrs in enriched:
        assert attrs[semconv.E2E_NS] > 0
        assert attrs[semconv.DIAGNOSIS_CAUSE]
        budget_total = sum(v for k, v in attrs.items() if k.startswith(semconv.BUDGET_PREFIX))
        assert budget_total >= attrs[semconv.E2E_NS]  # plus the network segment, if any

    # Metrics: GenAI exponential histograms counting every request once.
    ttft_points = [
        point
        for request in upstream.metric_requests
        for resource_metrics in request.resource_metrics
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
        if metric.name == semconv.OTLP_METRIC_NAMES[semconv.METRIC_TTFT]
        for point in metric.exponential_histogram.data_points
    ]
    assert ttft_points, "no TTFT histogram reached the upstream receiver"
    assert sum(point.count for point in ttft_points) == len(requests)
    # The collector's self-telemetry came along, sent after the pipeline drained.
    (requests_point,) = [
        point
        for request in upstream.metric_requests
        for resource_metrics in request.resource_metrics
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
        if metric.name == semconv.SELF_METRIC_REQUESTS
        for point in metric.sum.data_points
    ]
    assert requests_point.as_int == len(requests)


def test_vllm_native_dialect_end_to_end(tmp_path: Path, upstream: UpstreamOtlp) -> None:
    collector = start_collector(tmp_path, upstream)
    requests = simulate("steady", requests=20, seed=5)
    try:
        exporter = GrpcSpanExporter(endpoint=f"127.0.0.1:{collector.grpc_port}", insecure=True)
        send(requests, exporter, "vllm")
        collector.flush()
    finally:
        collector.shutdown()
    store = RequestStore.open_readonly(tmp_path / "requests.db")
    try:
        docs = store.slowest(metric="ttft", limit=100)
    finally:
        store.close()
    assert len(docs) == len(requests)
    by_request_id = {r.request_id: r for r in requests}
    for doc in docs:
        assert doc["dialect"] == "vllm"
        simulated = by_request_id[doc["request_id"]]
        # vLLM's span starts at its own arrival and reports TTFT in float seconds from there;
        # the collector keeps it to the rounding of those floats.
        expected = (simulated.first_token_ns - simulated.arrival_ns) / 1e6
        assert doc["metrics_ms"]["ttft"] == pytest.approx(expected, abs=0.01)
        assert doc["tokens"]["output"] == simulated.output_tokens


def _post(port: int, body: bytes, content_type: str) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/traces",
        data=body,
        headers={"Content-Type": content_type},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def test_malformed_input_never_crashes_or_corrupts_the_store(
    tmp_path: Path, upstream: UpstreamOtlp
) -> None:
    import sqlite3

    from tokentrace.loadgen.replay.emit import to_otlp_requests

    collector = start_collector(tmp_path, upstream)
    good = simulate("steady", requests=10, seed=9)
    (message,) = to_otlp_requests(good, batch_spans=10_000)
    try:
        port = collector.http_port
        assert port is not None
        assert _post(port, b"\x0a\xff\xff\xff garbage", "application/x-protobuf") == 400
        assert _post(port, b'{"resourceSpans": [', "application/json") == 400
        assert _post(port, message.SerializeToString(), "text/plain") == 415
        # One span with its end before its start: rejected alone, the rest accepted.
        broken = type(message)()
        broken.CopyFrom(message)
        first = broken.resource_spans[0].scope_spans[0].spans[0]
        first.end_time_unix_nano = first.start_time_unix_nano - 1
        assert _post(port, broken.SerializeToString(), "application/x-protobuf") == 200
        collector.flush()
        stats = collector.stats()
    finally:
        collector.shutdown()
    assert stats["OtlpHttpReceiver.rejected_spans"] == 1
    assert stats["processor_errors"] == {}
    with sqlite3.connect(tmp_path / "requests.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    store = RequestStore.open_readonly(tmp_path / "requests.db")
    try:
        # The trace that lost a span still yields its request when the request span survived.
        assert store.count() >= len(good) - 1
    finally:
        store.close()
