"""Malformed, hostile and invalid input: the receivers answer per OTLP and keep serving."""

from __future__ import annotations

import gzip
import json
import socket
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from email.message import Message

import grpc
import pytest
from google.rpc import code_pb2, status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.collector.consumers import RecordingConsumer
from tokentrace.collector.receivers.otlp_grpc import OtlpGrpcReceiver
from tokentrace.collector.receivers.otlp_http import OtlpHttpReceiver, default_http_parser
from tokentrace.collector.receivers.validate import REJECTION_REASONS, sanitize

BODY_LIMIT = 256 * 1024
GRPC_LIMIT = 64 * 1024
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(
    params=[
        # httptools with a consumer called on the event loop, h11 with one called on the pool.
        pytest.param(
            ("httptools", True),
            id="httptools-consumer-on-loop",
            marks=pytest.mark.skipif(
                default_http_parser() != "httptools", reason="httptools is not installed"
            ),
        ),
        pytest.param(("h11", False), id="h11-consumer-on-pool"),
    ]
)
def http_receiver(
    request: pytest.FixtureRequest, consumer: RecordingConsumer
) -> Iterator[OtlpHttpReceiver]:
    http_parser, consumer.never_blocks = request.param
    receiver = OtlpHttpReceiver(
        consumer,
        endpoint="127.0.0.1:0",
        max_request_body_size=BODY_LIMIT,
        socket_timeout_s=5,
        http_parser=http_parser,
    )
    receiver.start()
    yield receiver
    # After every malformed case the receiver still takes a good request.
    assert_http_still_serving(receiver, consumer)
    receiver.shutdown()


@pytest.fixture
def grpc_receiver(consumer: RecordingConsumer) -> Iterator[OtlpGrpcReceiver]:
    receiver = OtlpGrpcReceiver(consumer, endpoint="127.0.0.1:0", max_recv_msg_size=GRPC_LIMIT)
    receiver.start()
    yield receiver
    assert_grpc_still_serving(receiver, consumer)
    receiver.shutdown(grace_s=0)


def make_span(
    name: str,
    *,
    trace_id: bytes = b"\x11" * 16,
    span_id: bytes = b"\x22" * 8,
    parent_span_id: bytes = b"",
    start: int = 1_000,
    end: int = 2_000,
) -> Span:
    return Span(
        name=name,
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent_span_id,
        start_time_unix_nano=start,
        end_time_unix_nano=end,
    )


def request_of(*scopes: list[Span], resources: int = 1) -> ExportTraceServiceRequest:
    """``resources`` resources, each with one ScopeSpans per list in ``scopes``."""
    request = ExportTraceServiceRequest()
    for _ in range(resources):
        resource_spans = request.resource_spans.add()
        for spans in scopes:
            resource_spans.scope_spans.add().spans.extend(spans)
    return request


def http_post(
    port: int,
    body: bytes,
    *,
    content_type: str | None = "application/x-protobuf",
    headers: dict[str, str] | None = None,
    path: str = "/v1/traces",
    method: str = "POST",
) -> tuple[int, Message, bytes]:
    all_headers = dict(headers or {})
    if content_type is not None:
        all_headers["Content-Type"] = content_type
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, method=method, headers=all_headers
    )
    try:
        with _NO_PROXY_OPENER.open(request, timeout=5) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def raw_exchange(port: int, head: bytes, body: bytes = b"") -> bytes:
    """Send raw bytes; return everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        connection.sendall(head + body)
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def assert_http_still_serving(receiver: OtlpHttpReceiver, consumer: RecordingConsumer) -> None:
    before = len(consumer.span_names())
    body = request_of([make_span("health-check")]).SerializeToString()
    status, _, _ = http_post(receiver.port, body)
    assert status == 200
    assert consumer.span_names()[before:] == ["health-check"]


def assert_grpc_still_serving(receiver: OtlpGrpcReceiver, consumer: RecordingConsumer) -> None:
    before = len(consumer.span_names())
    with grpc.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
        TraceServiceStub(channel).Export(request_of([make_span("health-check")]), timeout=5)
    assert consumer.span_names()[before:] == ["health-check"]


def status_message(payload: bytes, content_type: str = "application/x-protobuf") -> str:
    if content_type == "application/json":
        return str(json.loads(payload)["message"])
    return status_pb2.Status.FromString(payload).message


# -- sanitize --------------------------------------------------------------------------------


def test_sanitize_counts_each_reason_and_keeps_valid_spans() -> None:
    request = request_of(
        [
            make_span("ok-root"),
            make_span("ok-child", span_id=b"\x33" * 8, parent_span_id=b"\x22" * 8),
            make_span("zero-trace", trace_id=bytes(16)),
            make_span("short-trace", trace_id=b"\x01" * 8),
            make_span("zero-span", span_id=bytes(8)),
            make_span("long-parent", parent_span_id=b"\x01" * 9),
            make_span("no-start", start=0),
            make_span("reversed", start=5_000, end=4_999),
        ]
    )
    rejected, message = sanitize(request)
    assert rejected == 6
    assert message == (
        "rejected 6 spans: 2 invalid trace_id, 1 invalid span_id, 1 invalid parent_span_id, "
        "1 missing start time, 1 end before start"
    )
    spans = request.resource_spans[0].scope_spans[0].spans
    assert [span.name for span in spans] == ["ok-root", "ok-child"]
    assert spans[1].parent_span_id == b"\x22" * 8


def test_sanitize_removes_emptied_scopes_and_resources() -> None:
    request = request_of([make_span("bad", span_id=b"")], [make_span("good")], resources=1)
    request.resource_spans.add().scope_spans.add().spans.append(make_span("bad2", start=0))
    rejected, message = sanitize(request)
    assert (rejected, message) == (2, "rejected 2 spans: 1 invalid span_id, 1 missing start time")
    assert len(request.resource_spans) == 1
    [scope_spans] = request.resource_spans[0].scope_spans
    assert [span.name for span in scope_spans.spans] == ["good"]


def test_sanitize_all_valid_leaves_request_untouched() -> None:
    request = request_of(
        [make_span("a"), make_span("b", parent_span_id=b"\x05" * 8)], [make_span("c")], resources=2
    )
    before = request.SerializeToString()
    sanitized = sanitize(request)
    assert sanitized == (0, "")
    assert not sanitized.modified  # so the received bytes may stand for the request
    assert request.SerializeToString() == before


def test_sanitize_zero_parent_becomes_root_not_rejected() -> None:
    request = request_of([make_span("zero-parent", parent_span_id=bytes(8))])
    sanitized = sanitize(request)
    assert sanitized == (0, "")
    assert sanitized.modified  # nothing rejected, but the received bytes no longer match
    assert request.resource_spans[0].scope_spans[0].spans[0].parent_span_id == b""


def test_sanitize_single_rejection_is_singular() -> None:
    request = request_of([make_span("x", end=1)])
    sanitized = sanitize(request)
    assert sanitized == (1, "rejected 1 span: 1 end before start")
    assert sanitized.modified
    assert len(request.resource_spans) == 0


_ids = st.one_of(st.just(b""), st.binary(min_size=1, max_size=20))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.lists(
            st.tuples(
                st.one_of(st.binary(min_size=16, max_size=16), _ids),
                st.one_of(st.binary(min_size=8, max_size=8), _ids),
                st.one_of(st.just(b""), st.binary(min_size=8, max_size=8), _ids),
                st.integers(min_value=0, max_value=3),
                st.integers(min_value=0, max_value=3),
            ),
            max_size=6,
        ),
        min_size=1,
        max_size=4,
    )
)
def test_sanitize_property(scopes: list[list[tuple[bytes, bytes, bytes, int, int]]]) -> None:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    total = 0
    for scope in scopes:
        scope_spans = resource_spans.scope_spans.add()
        for index, (trace_id, span_id, parent, start, end) in enumerate(scope):
            scope_spans.spans.append(
                make_span(
                    f"s{total}-{index}",
                    trace_id=trace_id,
                    span_id=span_id,
                    parent_span_id=parent,
                    start=start,
                    end=end,
                )
            )
        total += len(scope)
    expected_kept = [
        span.name
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
        if len(span.trace_id) == 16
        and any(span.trace_id)
        and len(span.span_id) == 8
        and any(span.span_id)
        and len(span.parent_span_id) in (0, 8)
        and span.start_time_unix_nano > 0
        and span.end_time_unix_nano >= span.start_time_unix_nano
    ]
    before = request.SerializeToString()
    sanitized = sanitize(request)
    rejected, message = sanitized
    # Unmodified exactly when the serialisation is unchanged (received bytes may be kept).
    assert sanitized.modified == (request.SerializeToString() != before)
    kept = [
        span
        for rs in request.resource_spans
        for scope_spans in rs.scope_spans
        for span in scope_spans.spans
    ]
    assert [span.name for span in kept] == expected_kept  # order preserved
    assert rejected == total - len(expected_kept)
    assert bool(message) == bool(rejected)
    if rejected:
        counted = sum(int(part.split(" ", 1)[0]) for part in message.split(": ", 1)[1].split(", "))
        assert counted == rejected
        assert all(
            part.split(" ", 1)[1] in REJECTION_REASONS
            for part in message.split(": ", 1)[1].split(", ")
        )
    # No empty containers are left behind where spans were removed.
    for rs in request.resource_spans:
        assert len(rs.scope_spans) > 0
    assert all(not span.parent_span_id or any(span.parent_span_id) for span in kept)


# -- HTTP ------------------------------------------------------------------------------------


def test_http_bad_protobuf_is_400_with_status(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    status, headers, payload = http_post(http_receiver.port, b"\xff\xff\xff\xff garbage")
    assert status == 400
    assert headers["Content-Type"] == "application/x-protobuf"
    error = status_pb2.Status.FromString(payload)
    assert error.code == code_pb2.INVALID_ARGUMENT
    assert "protobuf" in error.message
    assert consumer.requests == []
    assert http_receiver.stats()["malformed_requests"] == 1


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"resourceSpans": 5}',
        b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": "soon"}]}]}]}',
        b"[1, 2, 3]",
        b"\xff\xfe",
        b"[" * 100_000,
    ],
    ids=["syntax", "wrong-shape", "bad-int64", "array", "not-utf8", "deep-nesting"],
)
def test_http_bad_json_is_400_with_json_status(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer, body: bytes
) -> None:
    status, headers, payload = http_post(http_receiver.port, body, content_type="application/json")
    assert status == 400
    assert headers["Content-Type"] == "application/json"
    assert "OTLP/JSON" in status_message(payload, "application/json")
    assert consumer.requests == []


def test_http_json_non_hex_id_rejects_only_that_span(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    good = {
        "traceId": "ab" * 16,
        "spanId": "cd" * 8,
        "name": "good",
        "startTimeUnixNano": "1",
        "endTimeUnixNano": "2",
    }
    # Base64 where hex is required: not decodable as hex, so the span is invalid.
    base64_id = {**good, "name": "base64-id", "traceId": "q83vEjRWeJCrze8SNFZ4kA=="}
    document = {"resourceSpans": [{"scopeSpans": [{"spans": [good, base64_id]}]}]}
    status, _, payload = http_post(
        http_receiver.port, json.dumps(document).encode(), content_type="application/json"
    )
    assert status == 200
    partial = json.loads(payload)["partialSuccess"]
    assert partial["rejectedSpans"] == "1"
    assert "invalid trace_id" in partial["errorMessage"]
    assert consumer.span_names() == ["good"]


@pytest.mark.parametrize(
    ("content_type", "encoding"),
    [
        ("text/plain", None),
        (None, None),
        ("application/protobuf-ish", None),
        ("application/x-protobuf", "br"),
    ],
)
def test_http_unsupported_media_is_415(
    http_receiver: OtlpHttpReceiver, content_type: str | None, encoding: str | None
) -> None:
    headers = {"Content-Encoding": encoding} if encoding else {}
    body = request_of([make_span("x")]).SerializeToString()
    status, _, payload = http_post(
        http_receiver.port, body, content_type=content_type, headers=headers
    )
    assert status == 415
    assert "unsupported" in status_message(payload)


def test_http_declared_oversized_body_is_413_without_reading_it(
    http_receiver: OtlpHttpReceiver,
) -> None:
    # Only the headers are sent: the receiver must answer from Content-Length alone.
    answer = raw_exchange(
        http_receiver.port,
        b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
        + f"Content-Length: {BODY_LIMIT + 1}\r\n\r\n".encode(),
    )
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b"connection: close" in answer.lower()  # httptools writes header names in lower case


def test_http_oversized_body_is_413(http_receiver: OtlpHttpReceiver) -> None:
    status, _, payload = http_post(http_receiver.port, b"\x00" * (4 * BODY_LIMIT))
    assert status == 413
    assert str(BODY_LIMIT) in status_message(payload)


def test_http_gzip_bomb_is_413(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    bomb = gzip.compress(b"\x00" * (64 * BODY_LIMIT))  # ~16 MiB inflated from ~16 KiB
    assert len(bomb) < BODY_LIMIT
    status, _, payload = http_post(http_receiver.port, bomb, headers={"Content-Encoding": "gzip"})
    assert status == 413
    assert "decompressed" in status_message(payload)
    assert consumer.requests == []


@pytest.mark.parametrize(
    "body",
    [b"not gzip at all", gzip.compress(b"x" * 1000)[:-12]],
    ids=["garbage", "truncated"],
)
def test_http_bad_gzip_is_400(http_receiver: OtlpHttpReceiver, body: bytes) -> None:
    status, _, payload = http_post(http_receiver.port, body, headers={"Content-Encoding": "gzip"})
    assert status == 400
    assert "gzip" in status_message(payload)


def test_http_deflate_and_multi_member_gzip(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    payload = request_of([make_span("deflated")]).SerializeToString()
    status, _, _ = http_post(
        http_receiver.port, zlib.compress(payload), headers={"Content-Encoding": "deflate"}
    )
    assert status == 200
    # Two gzip members of one protobuf message: concatenated protobuf bytes merge repeated fields.
    first = request_of([make_span("member-1")]).SerializeToString()
    second = request_of([make_span("member-2")]).SerializeToString()
    status, _, _ = http_post(
        http_receiver.port,
        gzip.compress(first) + gzip.compress(second),
        headers={"Content-Encoding": "gzip"},
    )
    assert status == 200
    assert consumer.span_names() == ["deflated", "member-1", "member-2"]


def test_http_missing_content_length_is_411(http_receiver: OtlpHttpReceiver) -> None:
    answer = raw_exchange(
        http_receiver.port,
        b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
        b"5\r\nhello\r\n0\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 411 ")


@pytest.mark.parametrize("length", [b"-5", b"abc", b"1e3"])
def test_http_invalid_content_length_is_400(http_receiver: OtlpHttpReceiver, length: bytes) -> None:
    answer = raw_exchange(
        http_receiver.port,
        b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
        b"Content-Length: " + length + b"\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 400 ")


def test_http_body_shorter_than_declared_does_not_hang_the_server(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    with socket.create_connection(("127.0.0.1", http_receiver.port), timeout=5) as connection:
        connection.sendall(
            b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Content-Length: 1000\r\n\r\nshort"
        )
        connection.shutdown(socket.SHUT_WR)  # client gives up mid-body
        assert connection.recv(100) == b""
    assert consumer.requests == []


@pytest.mark.parametrize("path", ["/v1/metrics", "/v1/logs", "/", "/v1/traces/extra"])
def test_http_unknown_path_is_404(http_receiver: OtlpHttpReceiver, path: str) -> None:
    body = request_of([make_span("x")]).SerializeToString()
    status, _, _ = http_post(http_receiver.port, body, path=path)
    assert status == 404


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
def test_http_wrong_method_is_405(http_receiver: OtlpHttpReceiver, method: str) -> None:
    status, headers, _ = http_post(http_receiver.port, b"", method=method)
    assert status == 405
    assert headers["Allow"] == "POST"


def test_http_invalid_spans_partial_success(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    request = request_of(
        [
            make_span("valid"),
            make_span("no-ids", trace_id=b"", span_id=b""),
            make_span("zero-span-id", span_id=bytes(8)),
            make_span("reversed", start=10, end=9),
        ]
    )
    status, _, payload = http_post(http_receiver.port, request.SerializeToString())
    assert status == 200
    response = ExportTraceServiceResponse.FromString(payload)
    assert response.partial_success.rejected_spans == 3
    assert "1 invalid trace_id" in response.partial_success.error_message
    assert "1 invalid span_id" in response.partial_success.error_message
    assert "1 end before start" in response.partial_success.error_message
    assert consumer.span_names() == ["valid"]
    stats = http_receiver.stats()
    assert (stats["accepted_spans"], stats["rejected_spans"]) == (1, 3)


def test_http_all_spans_invalid_never_reaches_consumer(
    http_receiver: OtlpHttpReceiver, consumer: RecordingConsumer
) -> None:
    request = request_of([make_span("bad", start=0)])
    status, _, payload = http_post(http_receiver.port, request.SerializeToString())
    assert status == 200
    assert ExportTraceServiceResponse.FromString(payload).partial_success.rejected_spans == 1
    assert consumer.requests == []


def test_http_garbage_request_line(http_receiver: OtlpHttpReceiver) -> None:
    # No HTTP version in the line: http.server answers in HTTP/0.9 style (body only).
    answer = raw_exchange(http_receiver.port, b"\x16\x03\x01 not http at all\r\n\r\n")
    assert b"400" in answer


def test_http_connection_limit_refuses_extra_connections(consumer: RecordingConsumer) -> None:
    receiver = OtlpHttpReceiver(
        consumer, endpoint="127.0.0.1:0", max_connections=1, socket_timeout_s=5
    )
    receiver.start()
    try:
        with socket.create_connection(("127.0.0.1", receiver.port), timeout=5) as idle:
            idle.sendall(b"POST /v1/traces HTTP/1.1\r\n")  # holds the only slot
            answer = raw_exchange(receiver.port, b"")
            assert answer.startswith(b"HTTP/1.1 503 ")
            assert b"Retry-After:" in answer
        assert receiver.stats()["refused_connections"] == 1
        # The slot frees up once the handler thread sees the idle connection close.
        body = request_of([make_span("x")]).SerializeToString()
        deadline = time.monotonic() + 5
        status: int | None = None
        while status != 200 and time.monotonic() < deadline:
            try:
                status = http_post(receiver.port, body)[0]
            except OSError:  # refused while sending: the 503 closes the connection
                status = None
            time.sleep(0.01)
        assert status == 200
    finally:
        receiver.shutdown()


# -- gRPC ------------------------------------------------------------------------------------


def _raw_grpc_call(port: int, payload: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(
            EXPORT_METHOD, request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as raised:
            call(payload, timeout=5)
    return raised.value


def test_grpc_undecodable_message(
    grpc_receiver: OtlpGrpcReceiver, consumer: RecordingConsumer
) -> None:
    error = _raw_grpc_call(grpc_receiver.port, b"\xff\xff\xff\xff garbage")
    # OTLP: a request that cannot be decoded is INVALID_ARGUMENT (never retried), not INTERNAL.
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert consumer.requests == []
    assert grpc_receiver.stats()["malformed_requests"] == 1


def test_grpc_oversized_message_is_resource_exhausted(
    grpc_receiver: OtlpGrpcReceiver, consumer: RecordingConsumer
) -> None:
    error = _raw_grpc_call(grpc_receiver.port, b"\x0a" + b"\x00" * (GRPC_LIMIT + 1))
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert consumer.requests == []


def test_grpc_invalid_spans_partial_success(
    grpc_receiver: OtlpGrpcReceiver, consumer: RecordingConsumer
) -> None:
    request = request_of(
        [make_span("valid"), make_span("zero-trace", trace_id=bytes(16))],
        [make_span("reversed", start=3, end=2)],
    )
    with grpc.insecure_channel(f"127.0.0.1:{grpc_receiver.port}") as channel:
        response = TraceServiceStub(channel).Export(request, timeout=5)
    assert response.partial_success.rejected_spans == 2
    assert response.partial_success.error_message == (
        "rejected 2 spans: 1 invalid trace_id, 1 end before start"
    )
    assert consumer.span_names() == ["valid"]
    assert grpc_receiver.stats()["rejected_spans"] == 2


def test_grpc_valid_request_has_no_partial_success(
    grpc_receiver: OtlpGrpcReceiver, consumer: RecordingConsumer
) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_receiver.port}") as channel:
        response = TraceServiceStub(channel).Export(request_of([make_span("ok")]), timeout=5)
    assert not response.HasField("partial_success")
    assert consumer.span_names() == ["ok"]
