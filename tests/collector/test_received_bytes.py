"""Received export requests read from their wire bytes in C (agent/_wire.c): each span's
own bytes kept for the exporters, and the receiver's cheap checks run over the bytes."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.spanbuild import key_value
from tokentrace.agent.span_encoding import length_delimited
from tokentrace.collector.encoding import encode_trace_request
from tokentrace.collector.pipeline import group_by_trace
from tokentrace.collector.receivers import wire
from tokentrace.collector.receivers.validate import DEFAULT_SPAN_LIMITS, SpanLimits, sanitize

pytestmark = pytest.mark.skipif(not wire.BUILT, reason="the C functions are not built here")

_T0 = 1_700_000_000_000_000_000
_ID = st.sampled_from([b"", bytes(8), bytes(16), b"\x01" * 7, b"\x02" * 8, b"\x03" * 16])
_TIME = st.sampled_from([0, 1, _T0, _T0 + 5, 2**63 + 1, 2**64 - 1])


@st.composite
def _spans(draw: st.DrawFn) -> Span:
    span = Span(
        trace_id=draw(_ID),
        span_id=draw(_ID),
        parent_span_id=draw(_ID),
        name=draw(st.text(max_size=5)),
        start_time_unix_nano=draw(_TIME),
        end_time_unix_nano=draw(_TIME),
    )
    for number in range(draw(st.integers(0, 3))):
        span.attributes.append(
            key_value(f"k{number}", draw(st.integers(-(2**63), 2**63 - 1) | st.text(max_size=9)))
        )
    if draw(st.booleans()):
        span.attributes.append(key_value("big", "x" * draw(st.sampled_from([10, 3000]))))
    if draw(st.integers(0, 5)) == 0:
        span.events.add(name="e", time_unix_nano=draw(_TIME))
    if draw(st.integers(0, 5)) == 0:
        span.links.add(trace_id=b"\x04" * 16, span_id=b"\x05" * 8)
    return span


@st.composite
def _requests(draw: st.DrawFn) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(0, 3))):
        resource_spans = request.resource_spans.add()
        resource_spans.resource.attributes.append(key_value("service.name", "svc"))
        for _ in range(draw(st.integers(0, 3))):
            scope_spans = resource_spans.scope_spans.add()
            scope_spans.scope.name = "scope"
            scope_spans.spans.extend(draw(st.lists(_spans(), max_size=4)))
    return request


def _spans_of(request: ExportTraceServiceRequest) -> list[Span]:
    return [s for r in request.resource_spans for ss in r.scope_spans for s in ss.spans]


# Fields the walk must step over as the parser does: unknown fields of every wire type, and a
# known field number with another wire type than its own (the parser keeps it as unknown).
_NOISE = st.sampled_from(
    [b"", b"\xf8\x01\x07", b"\xfd\x01\x01\x02\x03\x04", b"\xf9\x01" + bytes(8), b"\xfa\x01\x02hi",
     b"\x08\x05", b"\x0d\x00\x00\x00\x00"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(_requests(), _NOISE)
def test_span_entries_are_each_span_as_the_parser_reads_it(
    request: ExportTraceServiceRequest, noise: bytes
) -> None:
    data = request.SerializeToString()
    entries = wire.span_entries(data)
    assert entries == [length_delimited(b"\x12", s.SerializeToString()) for s in _spans_of(request)]
    # With unknown fields around every message level: the same spans, in the same order.
    noisy = ExportTraceServiceRequest.FromString(noise + data + noise)
    assert wire.span_entries(noise + data + noise) == entries
    assert _spans_of(noisy) == _spans_of(request)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_the_walk_never_fails_on_arbitrary_bytes(data: bytes) -> None:
    entries = wire.span_entries(data)
    unclean = wire.unclean_spans(data, 2048, 1, 2**63)
    assert (entries is None) == (unclean is None)  # one walk: both take it or neither
    try:
        request = ExportTraceServiceRequest.FromString(data)
    except Exception:
        return  # the receiver answers INVALID_ARGUMENT before either runs
    if entries is not None:
        parsed = [Span.FromString(entry[1 + len(_varint_of(entry)) :]) for entry in entries]
        assert parsed == _spans_of(request)


def _varint_of(entry: bytes) -> bytes:
    end = 1
    while entry[end] & 0x80:
        end += 1
    return entry[1 : end + 1]


@settings(max_examples=500, deadline=None)
@given(_requests(), st.sampled_from([DEFAULT_SPAN_LIMITS, SpanLimits(max_string_length=100)]))
def test_sanitize_over_the_bytes_answers_as_over_every_span(
    request: ExportTraceServiceRequest, limits: SpanLimits
) -> None:
    data = request.SerializeToString()
    assert (
        wire.unclean_spans(data, limits.fast_path_bytes, limits.min_time_ns, limits.max_time_ns)
        is not None
    )  # the checks below ran over the bytes
    by_bytes, by_spans = copy.deepcopy(request), copy.deepcopy(request)
    answer_by_bytes = sanitize(by_bytes, limits, encoded=data)
    answer_by_spans = sanitize(by_spans, limits)
    assert answer_by_bytes == answer_by_spans
    assert answer_by_bytes.modified == answer_by_spans.modified
    assert by_bytes == by_spans


def test_only_the_spans_that_fail_a_cheap_check_are_singled_out() -> None:
    good = Span(
        trace_id=b"\x01" * 16, span_id=b"\x02" * 8, start_time_unix_nano=_T0, end_time_unix_nano=_T0
    )
    request = ExportTraceServiceRequest()
    scope_spans = request.resource_spans.add().scope_spans.add()
    zero_parent = copy.deepcopy(good)
    zero_parent.parent_span_id = bytes(8)
    with_event = copy.deepcopy(good)
    with_event.events.add(name="e", time_unix_nano=_T0)
    big = copy.deepcopy(good)
    big.attributes.append(key_value("big", "x" * 3000))
    backwards = copy.deepcopy(good)
    backwards.end_time_unix_nano = _T0 - 1
    scope_spans.spans.extend([good, zero_parent, good, with_event, big, backwards, good])
    data = request.SerializeToString()
    limits = DEFAULT_SPAN_LIMITS
    unclean = wire.unclean_spans(
        data, limits.fast_path_bytes, limits.min_time_ns, limits.max_time_ns
    )
    assert unclean == [(0, 0, 1), (0, 0, 3), (0, 0, 4), (0, 0, 5)]
    assert wire.unclean_spans(data, limits.fast_path_bytes, -1, limits.max_time_ns) is None


def test_exporters_send_the_received_bytes_of_every_span_that_kept_them() -> None:
    spans = [
        Span(trace_id=b"\x01" * 16, span_id=bytes([n]) * 8, start_time_unix_nano=_T0,
             end_time_unix_nano=_T0 + n, name=f"s{n}")
        for n in (1, 2)
    ]  # fmt: skip
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.extend(spans)
    data = request.SerializeToString()
    groups, count = group_by_trace(ExportTraceServiceRequest.FromString(data), encoded=data)
    assert count == 2
    refs = groups[b"\x01" * 16]
    assert [ref.wire for ref in refs] == wire.span_entries(data)
    # The bytes go out as received while a span keeps them, whatever its object says (whoever
    # changes a span drops them); the second's enrichment is appended to its bytes.
    for ref in refs:
        ref.span.name = "changed"
    enrichment = key_value("tokentrace.e2e_ns", 5).SerializeToString()
    appended = {spans[1].span_id: b"\x4a" + bytes([len(enrichment)]) + enrichment}
    first, second = _spans_of(
        ExportTraceServiceRequest.FromString(encode_trace_request(refs, appended=appended))
    )
    assert first == spans[0]
    assert second.name == "s2" and second.attributes[-1].key == "tokentrace.e2e_ns"
    second.ClearField("attributes")
    assert second == spans[1]
    # Dropped bytes: re-serialised from the object.
    refs[1].wire = None
    _, second = _spans_of(
        ExportTraceServiceRequest.FromString(encode_trace_request(refs, appended=appended))
    )
    assert second.name == "changed" and second.attributes[-1].key == "tokentrace.e2e_ns"
    # Bytes that are not this request's: no wire for anyone, the spans re-serialised.
    groups, _ = group_by_trace(ExportTraceServiceRequest.FromString(data), encoded=b"")
    assert [ref.wire for ref in groups[b"\x01" * 16]] == [None, None]
