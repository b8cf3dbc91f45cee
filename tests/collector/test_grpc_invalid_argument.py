"""The gRPC receiver answers undecodable requests INVALID_ARGUMENT (OTLP), logs them in a bounded,
traceback-free way, keeps serving, and still takes gzip-compressed exports."""

from __future__ import annotations

import gzip
import logging
import random
from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.exporter import Compression
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tests.collector.consumers import RecordingConsumer
from tests.collector.test_receivers_malformed import (
    EXPORT_METHOD,
    assert_grpc_still_serving,
    make_span,
    request_of,
)
from tokentrace.collector.receivers.otlp_grpc import OtlpGrpcReceiver, _RateLimitedLog

_RECEIVER_LOGGER = "tokentrace.collector.receivers.otlp_grpc"
_VALID = request_of(
    [make_span("a"), make_span("b", span_id=b"\x33" * 8, parent_span_id=b"\x22" * 8)]
).SerializeToString()


def _random_bytes(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _undecodable(payload: bytes) -> bool:
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    try:
        ExportTraceServiceRequest.FromString(payload)
    except DecodeError:
        return True
    return False


MALFORMED = {
    "garbage": b"\xff\xff\xff\xff garbage",
    **{
        f"random-{seed}": payload
        for seed in range(40)
        if _undecodable(payload := _random_bytes(seed, 16 + seed * 7))
    },
    **{f"truncated-at-{cut}": _VALID[:cut] for cut in (1, 2, 5, 17, len(_VALID) - 1)},
    "wire-type-6": b"\x0e\x00",
    "wire-type-7": b"\x0f\x00",
    "unmatched-end-group": b"\x0c",
    "unterminated-group": b"\x0b\x08\x01",
    "length-past-the-end": b"\x0a\x7f\x00",
    "overlong-varint": b"\x08" + b"\xff" * 11,
    "nested-length-past-the-end": b"\x0a\x04\x12\x10\x00\x00",
}


@pytest.fixture
def receiver(consumer: RecordingConsumer) -> Iterator[OtlpGrpcReceiver]:
    receiver = OtlpGrpcReceiver(consumer, endpoint="127.0.0.1:0")
    receiver.start()
    yield receiver
    assert_grpc_still_serving(receiver, consumer)
    receiver.shutdown(grace_s=0)


@pytest.fixture
def channel(receiver: OtlpGrpcReceiver) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
        yield channel


def _raw_export(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(EXPORT_METHOD, request_serializer=None, response_deserializer=None)


def test_the_malformed_cases_are_really_undecodable() -> None:
    assert len(MALFORMED) > 20  # the random ones are mostly undecodable too
    assert all(_undecodable(payload) for payload in MALFORMED.values())


@pytest.mark.parametrize("payload", list(MALFORMED.values()), ids=list(MALFORMED))
def test_undecodable_request_is_invalid_argument(
    receiver: OtlpGrpcReceiver,
    consumer: RecordingConsumer,
    channel: grpc.Channel,
    payload: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(grpc.RpcError) as raised:
        _raw_export(channel)(payload, timeout=5)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid ExportTraceServiceRequest" in (raised.value.details() or "")
    assert consumer.calls == 0
    assert receiver.stats()["malformed_requests"] == 1
    (record,) = [r for r in caplog.records if r.name == _RECEIVER_LOGGER]
    assert record.levelno == logging.WARNING and not record.exc_info
    assert "INVALID_ARGUMENT" in record.getMessage()
    # No traceback from grpc's own server either ("Exception calling application").
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def test_wrong_but_valid_wire_type_is_an_unknown_field_not_an_error(
    receiver: OtlpGrpcReceiver, consumer: RecordingConsumer, channel: grpc.Channel
) -> None:
    # Field 1 (resource_spans) as a varint: protobuf parsers keep it as an unknown field.
    assert _raw_export(channel)(b"\x08\x01", timeout=5) == b""
    assert consumer.calls == 0 and receiver.stats()["malformed_requests"] == 0


def test_a_thousand_malformed_requests_log_a_bounded_number_of_lines(
    receiver: OtlpGrpcReceiver,
    consumer: RecordingConsumer,
    channel: grpc.Channel,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    export = _raw_export(channel)
    payloads = list(MALFORMED.values())
    codes = set()
    for number in range(1000):
        try:
            export(payloads[number % len(payloads)], timeout=5)
        except grpc.RpcError as error:
            codes.add(error.code())
    assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
    assert receiver.stats()["malformed_requests"] == 1000
    assert consumer.calls == 0
    lines = [
        r for r in caplog.records if r.name.startswith("tokentrace") or r.name.startswith("grpc")
    ]
    # One line, then at most one per 10 s (a slow machine may take a few 10 s windows).
    assert 1 <= len(lines) <= 5
    assert all(not r.exc_info and r.levelno <= logging.WARNING for r in lines)
    # The valid request right after is served (and the fixture checks it once more).
    assert _raw_export(channel)(_VALID, timeout=5) == b""
    assert consumer.span_names() == ["a", "b"]


def test_rate_limited_log_says_how_many_lines_it_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    log = _RateLimitedLog(interval_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger=_RECEIVER_LOGGER)
    for _ in range(5):
        log.log(logging.WARNING, "undecodable", "bad request %d", 1)
    log.log(logging.WARNING, "other reason", "other")  # its own budget
    now[0] += 10.0
    log.log(logging.WARNING, "undecodable", "bad request %d", 2)
    assert [r.getMessage() for r in caplog.records] == [
        "bad request 1",
        "other",
        "bad request 2 (4 more since the last such line)",
    ]


def test_unauthenticated_garbage_is_unauthenticated_not_parsed(
    consumer: RecordingConsumer,
) -> None:
    receiver = OtlpGrpcReceiver(consumer, endpoint="127.0.0.1:0", auth_token="s3cret")
    receiver.start()
    try:
        with (
            grpc.insecure_channel(f"127.0.0.1:{receiver.port}") as channel,
            pytest.raises(grpc.RpcError) as raised,
        ):
            _raw_export(channel)(b"\xff garbage", timeout=5)
        assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED
        stats = receiver.stats()
        assert (stats["unauthenticated_requests"], stats["malformed_requests"]) == (1, 0)
    finally:
        receiver.shutdown(grace_s=0)


# -- compression: grpc decompresses below the (absent) deserializer ---------------------------
def test_gzip_compressed_raw_requests_are_decoded_or_rejected(
    receiver: OtlpGrpcReceiver, consumer: RecordingConsumer
) -> None:
    with grpc.insecure_channel(
        f"127.0.0.1:{receiver.port}", compression=grpc.Compression.Gzip
    ) as channel:
        assert _raw_export(channel)(_VALID, timeout=5) == b""
        with pytest.raises(grpc.RpcError) as raised:
            _raw_export(channel)(MALFORMED["garbage"], timeout=5)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert consumer.span_names() == ["a", "b"]
    assert gzip.decompress(gzip.compress(_VALID)) == _VALID  # (gzip itself round-trips)


def test_the_official_exporter_with_gzip_compression_is_accepted(
    receiver: OtlpGrpcReceiver, consumer: RecordingConsumer
) -> None:
    exporter = OTLPSpanExporter(
        endpoint=f"http://127.0.0.1:{receiver.port}", insecure=True, compression=Compression.Gzip
    )
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        tracer = provider.get_tracer("test")
        with (
            tracer.start_as_current_span("compressed-parent"),
            tracer.start_as_current_span("compressed-child"),
        ):
            pass
    finally:
        provider.shutdown()
    assert sorted(consumer.span_names()) == ["compressed-child", "compressed-parent"]
    assert receiver.stats()["malformed_requests"] == 0
