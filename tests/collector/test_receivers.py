"""OTLP receivers against the official OpenTelemetry exporters and plain HTTP clients (loopback)."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import re
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from email.message import Message
from pathlib import Path

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.collector.consumers import RecordingConsumer
from tokentrace.collector.consumer import Overloaded, Unavailable
from tokentrace.collector.receivers import (
    ReceiverCounters,
    ReceiverStartError,
    join_endpoint,
    split_endpoint,
)
from tokentrace.collector.receivers.otlp_grpc import OtlpGrpcReceiver
from tokentrace.collector.receivers.otlp_http import (
    HTTP_PARSERS,
    OtlpHttpReceiver,
    default_http_parser,
)

SERVICE_NAME = "receiver-test-service"
TOKEN = "s3cret-token"
HTTP_PARSER_PARAMS = [
    pytest.param(
        parser,
        marks=pytest.mark.skipif(
            parser == "httptools" and default_http_parser() != "httptools",
            reason="httptools is not installed",
        ),
    )
    for parser in HTTP_PARSERS
]
# Each HTTP test runs twice: httptools with a consumer called on the event loop, and h11 with
# one called on the thread pool (the two parsers, and both places the consumer runs).
HTTP_SETUPS = [
    pytest.param(
        ("httptools", True),
        id="httptools-consumer-on-loop",
        marks=pytest.mark.skipif(
            default_http_parser() != "httptools", reason="httptools is not installed"
        ),
    ),
    pytest.param(("h11", False), id="h11-consumer-on-pool"),
]


@pytest.fixture
def grpc_receiver(consumer: RecordingConsumer) -> Iterator[OtlpGrpcReceiver]:
    receiver = OtlpGrpcReceiver(consumer, endpoint="127.0.0.1:0")
    receiver.start()
    yield receiver
    receiver.shutdown(grace_s=0)


@pytest.fixture(params=HTTP_SETUPS)
def http_receiver(
    request: pytest.FixtureRequest, consumer: RecordingConsumer
) -> Iterator[OtlpHttpReceiver]:
    http_parser, consumer.never_blocks = request.param
    receiver = OtlpHttpReceiver(consumer, endpoint="127.0.0.1:0", http_parser=http_parser)
    receiver.start()
    yield receiver
    receiver.shutdown(grace_s=1)


def http_parser_of(receiver: OtlpHttpReceiver) -> str:
    return receiver._http_parser or default_http_parser()


def make_sdk_spans() -> list[ReadableSpan]:
    """A parent and a child span from a real SDK TracerProvider."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("receiver-test")
    with (
        tracer.start_as_current_span("parent-op", attributes={"test.count": 7}),
        tracer.start_as_current_span(
            "child-op", attributes={"test.flag": True, "test.labels": ["a", "b"]}
        ) as child,
    ):
        child.set_attribute("test.ratio", 0.25)
    provider.shutdown()
    return list(memory.get_finished_spans())


def assert_delivered(consumer: RecordingConsumer, sent: Sequence[ReadableSpan]) -> None:
    received = {span.name: span for span in consumer.spans()}
    assert sorted(received) == sorted(span.name for span in sent)
    for sdk_span in sent:
        context = sdk_span.get_span_context()
        assert context is not None
        got = received[sdk_span.name]
        assert got.trace_id == context.trace_id.to_bytes(16, "big")
        assert got.span_id == context.span_id.to_bytes(8, "big")
        assert got.start_time_unix_nano == sdk_span.start_time
        assert got.end_time_unix_nano == sdk_span.end_time
    parent, child = received["parent-op"], received["child-op"]
    assert child.parent_span_id == parent.span_id
    assert parent.parent_span_id == b""
    parent_attributes = {a.key: a.value for a in parent.attributes}
    assert parent_attributes["test.count"].int_value == 7
    child_attributes = {a.key: a.value for a in child.attributes}
    assert child_attributes["test.flag"].bool_value is True
    assert child_attributes["test.ratio"].double_value == 0.25
    assert [v.string_value for v in child_attributes["test.labels"].array_value.values] == [
        "a",
        "b",
    ]
    assert {"service.name": SERVICE_NAME}.items() <= consumer.resource_attributes()[0].items()


_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def post(
    port: int,
    body: bytes,
    *,
    content_type: str = "application/x-protobuf",
    headers: dict[str, str] | None = None,
    path: str = "/v1/traces",
) -> tuple[int, Message, bytes]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=body,
        method="POST",
        headers={"Content-Type": content_type, **(headers or {})},
    )
    try:
        with _NO_PROXY_OPENER.open(request, timeout=5) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def grpc_export(
    port: int, request: ExportTraceServiceRequest, metadata: tuple[tuple[str, str], ...] = ()
) -> ExportTraceServiceResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        response: ExportTraceServiceResponse = TraceServiceStub(channel).Export(
            request, metadata=metadata, timeout=5
        )
        return response


def one_span_request(name: str = "raw-op") -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id = bytes(range(1, 17))
    span.span_id = bytes(range(1, 9))
    span.name = name
    span.start_time_unix_nano = 1_700_000_000_000_000_000
    span.end_time_unix_nano = 1_700_000_000_500_000_000
    return request


# -- gRPC ----------------------------------------------------------------------------------


def test_grpc_sdk_exporter_through_tracer_provider(
    grpc_receiver: OtlpGrpcReceiver, consumer: RecordingConsumer
) -> None:
    exporter = GrpcSpanExporter(
        endpoint=f"127.0.0.1:{grpc_receiver.port}", insecure=True, timeout=5
    )
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("receiver-test")
    with (
        tracer.start_as_current_span("parent-op", attributes={"test.count": 7}),
        tracer.start_as_current_span(
            "child-op", attributes={"test.flag": True, "test.labels": ["a", "b"]}
        ) as child,
    ):
        child.set_attribute("test.ratio", 0.25)
    provider.shutdown()
    # SimpleSpanProcessor exports each span as it ends: two requests.
    assert len(consumer.requests) == 2
    assert_delivered(consumer, memory.get_finished_spans())
    assert grpc_receiver.stats()["accepted_spans"] == 2


@pytest.mark.parametrize("compression", [grpc.Compression.NoCompression, grpc.Compression.Gzip])
def test_grpc_sdk_exporter_export_batch(
    grpc_receiver: OtlpGrpcReceiver, consumer: RecordingConsumer, compression: grpc.Compression
) -> None:
    spans = make_sdk_spans()
    exporter = GrpcSpanExporter(
        endpoint=f"127.0.0.1:{grpc_receiver.port}",
        insecure=True,
        timeout=5,
        compression=compression,
    )
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert len(consumer.requests) == 1
    assert_delivered(consumer, spans)
    stats = grpc_receiver.stats()
    assert stats["accepted_spans"] == 2
    assert stats["rejected_spans"] == 0


def test_grpc_overloaded_carries_retry_info(
    grpc_receiver: OtlpGrpcReceiver, consumer: RecordingConsumer
) -> None:
    consumer.fail_next(Overloaded("queue full", retry_after_s=1.5))
    with pytest.raises(grpc.RpcError) as raised:
        grpc_export(grpc_receiver.port, one_span_request())
    error = raised.value
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue full" in (error.details() or "")
    trailers = {item.key: item.value for item in error.trailing_metadata()}
    status_details = trailers["grpc-status-details-bin"]
    assert isinstance(status_details, bytes)
    status = status_pb2.Status.FromString(status_details)
    assert status.code == code_pb2.RESOURCE_EXHAUSTED
    retry_info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(retry_info)
    assert retry_info.retry_delay.ToNanoseconds() == 1_500_000_000
    assert grpc_receiver.stats()["refused_requests"] == 1
    assert grpc_receiver.stats()["accepted_spans"] == 0
    assert consumer.requests == []


def test_grpc_sdk_exporter_retries_after_retry_info(
    grpc_receiver: OtlpGrpcReceiver, consumer: RecordingConsumer
) -> None:
    # Without RetryInfo the exporter's first backoff is ~1 s, past this 0.8 s timeout: only a
    # RetryInfo it honours makes the second attempt (and so success) possible.
    consumer.fail_next(Overloaded("busy", retry_after_s=0.02))
    spans = make_sdk_spans()
    exporter = GrpcSpanExporter(
        endpoint=f"127.0.0.1:{grpc_receiver.port}", insecure=True, timeout=0.8
    )
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert consumer.calls == 2
    assert grpc_receiver.stats()["refused_requests"] == 1
    assert_delivered(consumer, spans)


def test_grpc_unavailable_and_consumer_crash(
    grpc_receiver: OtlpGrpcReceiver, consumer: RecordingConsumer, caplog: pytest.LogCaptureFixture
) -> None:
    consumer.fail_next(Unavailable("shutting down"), KeyError("boom"))
    with pytest.raises(grpc.RpcError) as unavailable:
        grpc_export(grpc_receiver.port, one_span_request())
    assert unavailable.value.code() is grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as internal:
        grpc_export(grpc_receiver.port, one_span_request())
    assert internal.value.code() is grpc.StatusCode.INTERNAL
    assert "KeyError" in (internal.value.details() or "")
    assert any("consumer failed" in record.getMessage() for record in caplog.records)
    # The server is still serving.
    grpc_export(grpc_receiver.port, one_span_request("after-crash"))
    assert [span.name for span in consumer.spans()] == ["after-crash"]
    stats = grpc_receiver.stats()
    assert (stats["refused_requests"], stats["failed_requests"]) == (1, 1)


def test_grpc_bearer_auth(consumer: RecordingConsumer) -> None:
    receiver = OtlpGrpcReceiver(consumer, endpoint="127.0.0.1:0", auth_token=TOKEN)
    receiver.start()
    try:
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as raised:
                grpc_export(receiver.port, one_span_request(), metadata)
            assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert consumer.calls == 0
        spans = make_sdk_spans()
        exporter = GrpcSpanExporter(
            endpoint=f"127.0.0.1:{receiver.port}",
            insecure=True,
            timeout=5,
            headers={"authorization": f"Bearer {TOKEN}"},
        )
        try:
            assert exporter.export(spans) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        assert_delivered(consumer, spans)
        assert receiver.stats()["unauthenticated_requests"] == 3
    finally:
        receiver.shutdown(grace_s=0)


@pytest.mark.parametrize(
    ("endpoint", "host", "port"),
    [("127.0.0.1:4317", "127.0.0.1", 4317), ("[::1]:0", "::1", 0), ("h:65535", "h", 65535)],
)
def test_an_endpoint_is_split_and_joined_back(endpoint: str, host: str, port: int) -> None:
    assert split_endpoint(endpoint) == (host, port)
    assert join_endpoint(host, port) == endpoint


@pytest.mark.parametrize("endpoint", ["nowhere", ":4317", "h:", "h:65536", "h:-1", "h:\u00b2"])
def test_a_malformed_endpoint_is_refused_by_the_one_parser(endpoint: str) -> None:
    with pytest.raises(ValueError, match=f"^expected HOST:PORT, got {re.escape(repr(endpoint))}$"):
        split_endpoint(endpoint)


def test_grpc_port_taken_raises_clear_error(grpc_receiver: OtlpGrpcReceiver) -> None:
    endpoint = f"127.0.0.1:{grpc_receiver.port}"
    second = OtlpGrpcReceiver(RecordingConsumer(), endpoint=endpoint)
    with pytest.raises(ReceiverStartError, match=re.escape(endpoint)):
        second.start()
    with pytest.raises(ReceiverStartError, match="no-port-here"):
        OtlpGrpcReceiver(RecordingConsumer(), endpoint="no-port-here").start()


# -- HTTP ----------------------------------------------------------------------------------


@pytest.mark.parametrize("compression", [HttpCompression.NoCompression, HttpCompression.Gzip])
def test_http_sdk_exporter_export_batch(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer, compression: HttpCompression
) -> None:
    spans = make_sdk_spans()
    exporter = HttpSpanExporter(
        endpoint=f"http://127.0.0.1:{http_receiver.port}/v1/traces",
        timeout=5,
        compression=compression,
    )
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert len(consumer.requests) == 1
    assert_delivered(consumer, spans)
    assert http_receiver.stats()["accepted_spans"] == 2


def test_http_gzip_body_from_plain_client(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    body = gzip.compress(one_span_request("gzipped").SerializeToString())
    status, headers, payload = post(http_receiver.port, body, headers={"Content-Encoding": "gzip"})
    assert status == 200
    assert headers["Content-Type"] == "application/x-protobuf"
    assert not ExportTraceServiceResponse.FromString(payload).HasField("partial_success")
    assert [span.name for span in consumer.spans()] == ["gzipped"]


def test_http_json_with_hex_ids(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    trace_id_hex = "5b8efff798038103d269b633813fc60c"
    span_id_hex = "eee19b7ec3c1b174"
    parent_hex = "eee19b7ec3c1b173"
    link_trace_hex = "0af7651916cd43dd8448eb211c80319c"
    document = {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": "json-svc"}}]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "json-scope"},
                        "spans": [
                            {
                                "traceId": trace_id_hex,
                                "spanId": span_id_hex,
                                "parentSpanId": parent_hex,
                                "name": "json-op",
                                "kind": 2,
                                "startTimeUnixNano": "1700000000000000001",
                                "endTimeUnixNano": "1700000000900000001",
                                "attributes": [
                                    {"key": "test.tokens", "value": {"intValue": "42"}},
                                    {"key": "test.model", "value": {"stringValue": "m"}},
                                ],
                                "links": [{"traceId": link_trace_hex, "spanId": span_id_hex}],
                                "status": {"code": 2, "message": "x"},
                                "someFutureField": {"ignored": True},
                            }
                        ],
                    }
                ],
            }
        ]
    }
    status, headers, payload = post(
        http_receiver.port, json.dumps(document).encode(), content_type="application/json"
    )
    assert status == 200, payload
    assert headers["Content-Type"] == "application/json"
    assert json.loads(payload) == {}
    [span] = consumer.spans()
    assert span.trace_id == bytes.fromhex(trace_id_hex)
    assert span.span_id == bytes.fromhex(span_id_hex)
    assert span.parent_span_id == bytes.fromhex(parent_hex)
    assert span.links[0].trace_id == bytes.fromhex(link_trace_hex)
    assert span.kind == Span.SPAN_KIND_SERVER
    assert span.start_time_unix_nano == 1_700_000_000_000_000_001
    assert span.status.code == 2
    attributes = {a.key: a.value for a in span.attributes}
    assert attributes["test.tokens"].int_value == 42
    assert attributes["test.model"].string_value == "m"
    assert consumer.resource_attributes() == [{"service.name": "json-svc"}]


def test_http_json_gzip_partial_success_is_json(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    good = {
        "traceId": "01" * 16,
        "spanId": "02" * 8,
        "name": "kept",
        "startTimeUnixNano": "10",
        "endTimeUnixNano": "20",
    }
    reversed_times = {**good, "spanId": "03" * 8, "name": "dropped", "endTimeUnixNano": "5"}
    document = {"resourceSpans": [{"scopeSpans": [{"spans": [good, reversed_times]}]}]}
    status, _, payload = post(
        http_receiver.port,
        gzip.compress(json.dumps(document).encode()),
        content_type="application/json; charset=utf-8",
        headers={"Content-Encoding": "gzip"},
    )
    assert status == 200
    partial = json.loads(payload)["partialSuccess"]
    assert partial["rejectedSpans"] == "1"  # int64 is a string in protobuf JSON
    assert "end before start" in partial["errorMessage"]
    assert [span.name for span in consumer.spans()] == ["kept"]


def test_http_overloaded_gives_429_with_retry_after(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    consumer.fail_next(Overloaded("queue full", retry_after_s=2.2))
    status, headers, payload = post(http_receiver.port, one_span_request().SerializeToString())
    assert status == 429
    assert headers["Retry-After"] == "3"  # whole seconds, rounded up
    error = status_pb2.Status.FromString(payload)
    assert "queue full" in error.message
    # The SDK exporter treats it as retryable and honours Retry-After: 3 s exceeds its 0.5 s
    # deadline, so it gives up after one attempt instead of retrying at once.
    consumer.fail_next(Overloaded("still full", retry_after_s=3))
    exporter = HttpSpanExporter(
        endpoint=f"http://127.0.0.1:{http_receiver.port}/v1/traces", timeout=0.5
    )
    try:
        assert exporter.export(make_sdk_spans()) is SpanExportResult.FAILURE
    finally:
        exporter.shutdown()
    assert http_receiver.stats()["refused_requests"] == 2
    assert consumer.requests == []


def test_http_sdk_exporter_retries_after_429(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    # Retry-After: 0 lets the exporter retry at once; without honouring it, the first backoff
    # (~1 s) would exceed the 0.8 s timeout and the export would fail.
    consumer.fail_next(Overloaded("busy", retry_after_s=0))
    spans = make_sdk_spans()
    exporter = HttpSpanExporter(
        endpoint=f"http://127.0.0.1:{http_receiver.port}/v1/traces", timeout=0.8
    )
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert consumer.calls == 2
    assert_delivered(consumer, spans)


def test_http_unavailable_and_consumer_crash(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer, caplog: pytest.LogCaptureFixture
) -> None:
    consumer.fail_next(Unavailable("draining"), ValueError("boom"))
    status, headers, payload = post(
        http_receiver.port, b'{"resourceSpans": []}', content_type="application/json"
    )
    # An empty request never reaches the consumer.
    assert status == 200
    body = one_span_request().SerializeToString()
    status, headers, payload = post(http_receiver.port, body)
    assert status == 503
    assert int(headers["Retry-After"]) >= 0
    assert status_pb2.Status.FromString(payload).message == "draining"
    status, headers, payload = post(http_receiver.port, body)
    assert status == 500
    assert "ValueError" in status_pb2.Status.FromString(payload).message
    assert any("consumer failed" in record.getMessage() for record in caplog.records)
    status, _, _ = post(http_receiver.port, one_span_request("after-crash").SerializeToString())
    assert status == 200
    assert [span.name for span in consumer.spans()] == ["after-crash"]


def test_http_bearer_auth(consumer: RecordingConsumer) -> None:
    receiver = OtlpHttpReceiver(consumer, endpoint="127.0.0.1:0", auth_token=TOKEN)
    receiver.start()
    try:
        body = one_span_request().SerializeToString()
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {TOKEN}"}):
            status, response_headers, _ = post(receiver.port, body, headers=headers)
            assert status == 401
            assert response_headers["WWW-Authenticate"] == "Bearer"
        assert consumer.calls == 0
        spans = make_sdk_spans()
        exporter = HttpSpanExporter(
            endpoint=f"http://127.0.0.1:{receiver.port}/v1/traces",
            timeout=5,
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        try:
            assert exporter.export(spans) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        assert_delivered(consumer, spans)
        assert receiver.stats()["unauthenticated_requests"] == 3
    finally:
        receiver.shutdown()


def test_http_keep_alive_reuses_connection(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", http_receiver.port, timeout=5)
    try:
        sockets = []
        for index in range(3):
            connection.request(
                "POST",
                "/v1/traces",
                body=one_span_request(f"keep-alive-{index}").SerializeToString(),
                headers={"Content-Type": "application/x-protobuf"},
            )
            response = connection.getresponse()
            response.read()
            assert response.status == 200
            assert response.getheader("Connection") != "close"
            sockets.append(connection.sock)
        assert sockets[0] is not None
        assert sockets[0] is sockets[1] is sockets[2]
    finally:
        connection.close()
    assert [span.name for span in consumer.spans()] == [f"keep-alive-{i}" for i in range(3)]


def test_http_port_taken_raises_clear_error(http_receiver: OtlpHttpReceiver) -> None:
    endpoint = f"127.0.0.1:{http_receiver.port}"
    with pytest.raises(ReceiverStartError, match=re.escape(endpoint)):
        OtlpHttpReceiver(RecordingConsumer(), endpoint=endpoint).start()
    with pytest.raises(ReceiverStartError, match=re.escape("127.0.0.1:99999")):
        OtlpHttpReceiver(RecordingConsumer(), endpoint="127.0.0.1:99999").start()


def test_http_shutdown_stops_listening(consumer: RecordingConsumer) -> None:
    receiver = OtlpHttpReceiver(consumer, endpoint="127.0.0.1:0")
    receiver.start()
    port = receiver.port
    assert post(port, one_span_request().SerializeToString())[0] == 200
    receiver.shutdown()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


def raw_exchange(port: int, data: bytes) -> bytes:
    """Send raw bytes; return everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        connection.sendall(data)
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(
    "framing",
    [
        b"Content-Length: 5\r\nContent-Length: 6\r\n",
        b"Content-Length: 5, 6\r\n",
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
    ],
    ids=["two-lengths", "length-list", "length-then-chunked", "chunked-then-length"],
)
def test_http_conflicting_framing_is_400_and_closes(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer, framing: bytes
) -> None:
    # Two readings of where the body ends (request smuggling): refused, never delivered.
    body = one_span_request("smuggled").SerializeToString()
    chunked = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    answer = raw_exchange(
        http_receiver.port,
        b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
        + framing
        + b"\r\n"
        + (chunked if b"chunked" in framing else body[:5]),
    )
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert consumer.requests == []
    assert http_receiver.stats()["malformed_requests"] == 1
    assert post(http_receiver.port, one_span_request("after").SerializeToString())[0] == 200


def test_http_same_content_length_twice_is_one_length_or_refused(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    # RFC 9110 lets a recipient either refuse it or read it as one length: h11 reads one,
    # httptools refuses every repeated Content-Length. Never two readings.
    body = one_span_request("twice").SerializeToString()
    length = str(len(body)).encode()
    answer = raw_exchange(
        http_receiver.port,
        b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
        b"Content-Length: " + length + b"\r\nContent-Length: " + length + b"\r\n"
        b"Connection: close\r\n\r\n" + body,
    )
    if http_parser_of(http_receiver) == "h11":
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert consumer.span_names() == ["twice"]
    else:
        assert answer.startswith(b"HTTP/1.1 400 ")
        assert consumer.span_names() == []
        assert http_receiver.stats()["malformed_requests"] == 1


class _RecordingTransport(asyncio.Transport):
    """Stands in for the socket's transport: records each write (one write is one send)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = asyncio.Event()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed.set()

    def is_closing(self) -> bool:
        return self.closed.is_set()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 4318), "peername": ("127.0.0.1", 50000)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _writes_of_one_exchange(
    consumer: RecordingConsumer, request: bytes, http_parser: str
) -> list[bytes]:
    """Drive the receiver's uvicorn protocol over a recording transport: what it writes."""
    import uvicorn
    from uvicorn.server import ServerState

    from tokentrace.collector.receivers.otlp_http import _protocol_class
    from tokentrace.collector.receivers.otlp_http_app import OtlpHttpApp

    async def exchange() -> list[bytes]:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=1) as executor:
            app = OtlpHttpApp(
                consumer,
                ReceiverCounters(),
                executor,
                max_request_body_size=1 << 20,
                auth_token=None,
                read_timeout_s=5,
            )
            config = uvicorn.Config(
                app,
                http=_protocol_class(4, ReceiverCounters(), http_parser=http_parser),
                interface="asgi3",
                lifespan="off",
                log_config=None,
            )
            config.load()
            protocol = config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=ServerState(), app_state={}, _loop=loop
            )
            transport = _RecordingTransport()
            protocol.connection_made(transport)
            protocol.data_received(request)
            deadline = loop.time() + 5
            while not transport.writes:
                assert loop.time() < deadline, "no reply"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # anything written after the reply would show up here
            protocol.connection_lost(None)
            return transport.writes

    return asyncio.run(exchange())


@pytest.mark.parametrize("consumer_never_blocks", [True, False], ids=["on-loop", "on-pool"])
@pytest.mark.parametrize("http_parser", HTTP_PARSER_PARAMS)
@pytest.mark.parametrize("case", ["partial-success", "bad-request", "empty-ok"])
def test_http_reply_leaves_in_one_write(
    consumer: RecordingConsumer, case: str, http_parser: str, consumer_never_blocks: bool
) -> None:
    # Status line, headers and body in one send: no second small segment waiting for the
    # client's delayed ACK on a kept-alive connection.
    consumer.never_blocks = consumer_never_blocks
    request = one_span_request("kept")
    if case == "partial-success":
        request.resource_spans[0].scope_spans[0].spans.add(name="no-ids", start_time_unix_nano=1)
    body = b"\xff garbage" if case == "bad-request" else request.SerializeToString()
    writes = _writes_of_one_exchange(
        consumer,
        b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body,
        http_parser,
    )
    assert len(writes) == 1, writes
    head, _, payload = writes[0].partition(b"\r\n\r\n")
    expected = {"partial-success": b" 200 ", "bad-request": b" 400 ", "empty-ok": b" 200 "}[case]
    assert expected in head.split(b"\r\n")[0]
    assert f"content-length: {len(payload)}".encode() in head.lower()  # httptools: lower case
    if case == "partial-success":
        assert ExportTraceServiceResponse.FromString(payload).partial_success.rejected_spans == 1


@pytest.mark.parametrize("http_parser", HTTP_PARSER_PARAMS)
def test_http_slow_consumer_does_not_stall_other_connections(http_parser: str) -> None:
    release = threading.Event()
    entered = threading.Event()

    class SlowFirst(RecordingConsumer):  # may block (never_blocks stays False)
        def consume_traces(
            self, request: ExportTraceServiceRequest, *, encoded: bytes | None = None
        ) -> None:
            if request.resource_spans[0].scope_spans[0].spans[0].name == "slow":
                entered.set()
                release.wait(10)
            super().consume_traces(request, encoded=encoded)

    slow_consumer = SlowFirst()
    receiver = OtlpHttpReceiver(slow_consumer, endpoint="127.0.0.1:0", http_parser=http_parser)
    receiver.start()
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            slow = pool.submit(post, receiver.port, one_span_request("slow").SerializeToString())
            assert entered.wait(5)
            # The event loop still serves other connections while the consumer holds one.
            assert post(receiver.port, one_span_request("fast").SerializeToString())[0] == 200
            assert not slow.done()
            release.set()
            assert slow.result(timeout=5)[0] == 200
        assert slow_consumer.span_names() == ["fast", "slow"]
    finally:
        release.set()
        receiver.shutdown()


def test_http_shutdown_ends_the_server_thread_even_with_a_request_in_flight(
    consumer: RecordingConsumer,
) -> None:
    release = threading.Event()
    entered = threading.Event()

    class Stuck(RecordingConsumer):
        def consume_traces(
            self, request: ExportTraceServiceRequest, *, encoded: bytes | None = None
        ) -> None:
            entered.set()
            release.wait(10)
            super().consume_traces(request, encoded=encoded)

    receiver = OtlpHttpReceiver(Stuck(), endpoint="127.0.0.1:0")
    receiver.start()
    port = receiver.port
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            stuck = pool.submit(post, port, one_span_request("stuck").SerializeToString())
            assert entered.wait(5)
            receiver.shutdown(grace_s=0)
            assert not [t for t in threading.enumerate() if t.name == f"otlp-http-{port}"]
            # The request the grace period cut short is told to come back later.
            status, headers, _ = stuck.result(timeout=5)
            assert status == 503
            assert headers["Retry-After"] == "1"
    finally:
        release.set()
        receiver.shutdown()


def many_spans_request(spans: int, *, name_length: int = 200) -> ExportTraceServiceRequest:
    """Valid spans with long names: about ``spans * (name_length + 50)`` bytes encoded."""
    request = ExportTraceServiceRequest()
    scope_spans = request.resource_spans.add().scope_spans.add()
    for index in range(spans):
        span = scope_spans.spans.add()
        span.trace_id = bytes(range(1, 17))
        span.span_id = (index + 1).to_bytes(8, "big")
        span.name = f"span-{index}-".ljust(name_length, "x")
        span.start_time_unix_nano = 1_700_000_000_000_000_000
        span.end_time_unix_nano = 1_700_000_000_500_000_000
    return request


def unknown_field_first(request: ExportTraceServiceRequest) -> bytes:
    """``request`` encoded with a field this version does not know (15, varint) ahead of the
    known ones: it parses to the same message, but re-serialising moves that field last."""
    body = b"\x78\x01" + request.SerializeToString()
    assert ExportTraceServiceRequest.FromString(body).SerializeToString() != body
    return body


@pytest.mark.parametrize("never_blocks", [True, False], ids=["never-blocks", "may-block"])
@pytest.mark.parametrize("http_parser", HTTP_PARSER_PARAMS)
def test_http_consumer_runs_on_the_event_loop_only_when_it_never_blocks_and_the_body_is_small(
    http_parser: str, never_blocks: bool
) -> None:
    consumer = RecordingConsumer(never_blocks=never_blocks)
    receiver = OtlpHttpReceiver(consumer, endpoint="127.0.0.1:0", http_parser=http_parser)
    receiver.start()
    try:
        small = one_span_request("small").SerializeToString()
        large = many_spans_request(400).SerializeToString()
        assert len(large) > 64 * 1024  # the receiver's inline limit
        # Small on the wire, large once inflated: first tried on the loop, then on the pool.
        inflating = gzip.compress(large)
        assert len(inflating) < 64 * 1024
        json_body = json.dumps(
            {"resourceSpans": [{"scopeSpans": [{"spans": [json_span("json")]}]}]}
        ).encode()
        assert post(receiver.port, small)[0] == 200
        assert post(receiver.port, large)[0] == 200
        assert post(receiver.port, inflating, headers={"Content-Encoding": "gzip"})[0] == 200
        assert post(receiver.port, json_body, content_type="application/json")[0] == 200
        port = receiver.port
    finally:
        receiver.shutdown()
    loop_thread = f"otlp-http-{port}"
    small_thread, large_thread, inflating_thread, json_thread = consumer.threads
    assert (small_thread == loop_thread) is never_blocks
    for thread in (large_thread, inflating_thread, json_thread):
        assert thread.startswith("otlp-http-export"), thread
    assert len(consumer.spans()) == 1 + 400 + 400 + 1
    assert receiver.stats()["malformed_requests"] == 0


def json_span(name: str) -> dict[str, object]:
    return {
        "traceId": bytes(range(1, 17)).hex(),
        "spanId": bytes(range(1, 9)).hex(),
        "name": name,
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000000500000000",
    }


def test_http_hands_the_consumer_the_received_bytes_when_validation_changed_nothing(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    port = http_receiver.port
    unchanged = unknown_field_first(one_span_request("as-received"))
    large = unknown_field_first(many_spans_request(400))  # decoded on a pool thread
    assert post(port, unchanged)[0] == 200
    assert post(port, gzip.compress(unchanged), headers={"Content-Encoding": "gzip"})[0] == 200
    assert post(port, large)[0] == 200
    assert consumer.encoded == [unchanged, unchanged, large]

    # A rejected span: the consumer gets no bytes (the request it gets lacks that span) ...
    rejected = one_span_request("kept")
    rejected.resource_spans[0].scope_spans[0].spans.add(name="no-ids", start_time_unix_nano=1)
    status, _, payload = post(port, unknown_field_first(rejected))
    assert status == 200
    assert ExportTraceServiceResponse.FromString(payload).partial_success.rejected_spans == 1
    # ... nor when validation rewrote an all-zero parent id, nor for OTLP/JSON.
    zero_parent = one_span_request("zero-parent")
    zero_parent.resource_spans[0].scope_spans[0].spans[0].parent_span_id = bytes(8)
    assert post(port, zero_parent.SerializeToString())[0] == 200
    json_body = json.dumps(
        {"resourceSpans": [{"scopeSpans": [{"spans": [json_span("json")]}]}]}
    ).encode()
    assert post(port, json_body, content_type="application/json")[0] == 200
    assert consumer.encoded[3:] == [None, None, None]
    assert consumer.span_names()[-3:] == ["kept", "zero-parent", "json"]


def test_grpc_hands_the_consumer_the_received_bytes_when_validation_changed_nothing(
    grpc_receiver: OtlpGrpcReceiver, consumer: RecordingConsumer
) -> None:
    unchanged = unknown_field_first(one_span_request("as-received"))
    rejected = one_span_request("kept")
    rejected.resource_spans[0].scope_spans[0].spans.add(name="no-ids", start_time_unix_nano=1)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_receiver.port}") as channel:
        # Bytes in, bytes out: the body goes as built.
        export = channel.unary_unary(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            request_serializer=None,
            response_deserializer=None,
        )
        export(unchanged, timeout=5)
        export(unknown_field_first(rejected), timeout=5)
    assert consumer.encoded == [unchanged, None]
    assert consumer.span_names() == ["as-received", "kept"]


# -- TLS -----------------------------------------------------------------------------------


def _export_over_tls(
    make_receiver: Callable[[], OtlpGrpcReceiver | OtlpHttpReceiver],
    make_exporter: Callable[[int], GrpcSpanExporter | HttpSpanExporter],
    consumer: RecordingConsumer,
) -> None:
    receiver = make_receiver()
    receiver.start()
    try:
        spans = make_sdk_spans()
        exporter = make_exporter(receiver.port)
        try:
            assert exporter.export(spans) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        assert_delivered(consumer, spans)
    finally:
        receiver.shutdown(grace_s=0)


def test_grpc_tls(tls_files: tuple[str, str], consumer: RecordingConsumer) -> None:
    cert, key = tls_files
    _export_over_tls(
        lambda: OtlpGrpcReceiver(
            consumer, endpoint="127.0.0.1:0", tls_cert_file=cert, tls_key_file=key
        ),
        lambda port: GrpcSpanExporter(
            endpoint=f"localhost:{port}",
            credentials=grpc.ssl_channel_credentials(Path(cert).read_bytes()),
            timeout=5,
        ),
        consumer,
    )


def test_http_tls(
    tls_files: tuple[str, str], consumer: RecordingConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tls_files
    # requests lets these override the exporter's certificate_file (session.verify).
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    _export_over_tls(
        lambda: OtlpHttpReceiver(
            consumer, endpoint="127.0.0.1:0", tls_cert_file=cert, tls_key_file=key
        ),
        lambda port: HttpSpanExporter(
            endpoint=f"https://127.0.0.1:{port}/v1/traces", certificate_file=cert, timeout=5
        ),
        consumer,
    )


def test_tls_files_must_be_readable(consumer: RecordingConsumer, tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    for receiver in (
        OtlpGrpcReceiver(
            consumer, endpoint="127.0.0.1:0", tls_cert_file=missing, tls_key_file=missing
        ),
        OtlpHttpReceiver(
            consumer, endpoint="127.0.0.1:0", tls_cert_file=missing, tls_key_file=missing
        ),
    ):
        with pytest.raises(ReceiverStartError, match="TLS"):
            receiver.start()
    with pytest.raises(ValueError):
        OtlpHttpReceiver(consumer, tls_cert_file=missing)
