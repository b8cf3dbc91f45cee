"""The agent's span layout (``plan_spans``) and wire encoder (``encode_recordings``)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.spanbuild import attributes_of, key_value
from tokentrace.agent import semconv
from tokentrace.agent.recording import PrefillChunk, RequestRecording
from tokentrace.agent.spans import (
    KIND_CLIENT,
    KIND_INTERNAL,
    PlannedSpan,
    RecordingEncoder,
    ResourceScope,
    count_spans,
    encode_recordings,
    encode_span,
    export_request,
    plan_spans,
    random_span_id,
)
from tokentrace.processors.budget import compute_budget
from tokentrace.processors.model import AssembledTrace, Budget, RequestTimeline, SpanRef
from tokentrace.processors.timeline import normalize

T0 = 1_700_000_000_000_000_000
US = 1_000
MS = 1_000_000
PARENT = bytes.fromhex("00f067aa0ba902b7")
RESOURCE = {semconv.SERVICE_NAME: "vllm-test", semconv.PROCESS_PID: 4242}
SCOPE = "tokentrace.agent"


def trace_id(number: int) -> bytes:
    return number.to_bytes(16, "big")


def full_recording(number: int = 1, **changes: Any) -> RequestRecording:
    """A request that went through every phase: cold start, 3 prefill chunks, 2 preemptions
    (one during prefill, one during decode), 160 tokens."""
    arrival = T0 + number * 10 * MS
    scheduled = arrival + 4 * MS
    first_token = scheduled + 30 * MS
    offsets = [k * 20_000 + (5_000 if k >= 100 else 0) for k in range(160)]  # one 25 ms gap
    last_token = first_token + offsets[-1] * US
    recording = RequestRecording(
        trace_id=trace_id(number),
        parent_span_id=PARENT,
        request_id=f"cmpl-{number}",
        model="llama-test",
        operation=semconv.OPERATION_CHAT,
        arrival_ns=arrival,
        end_ns=last_token + 700 * US,
        first_scheduled_ns=scheduled,
        first_token_ns=first_token,
        last_token_ns=last_token,
        token_offsets_us=offsets,
        prefill_chunks=[
            PrefillChunk(scheduled, scheduled + 8 * MS, 2048),
            # preempted from +8 ms to +12 ms, then recomputed
            PrefillChunk(scheduled + 12 * MS, scheduled + 22 * MS, 2048),
            PrefillChunk(scheduled + 22 * MS, first_token, 300),
        ],
        preempted=[
            (scheduled + 8 * MS, scheduled + 12 * MS),
            (first_token + 2_000 * US, first_token + 2_005 * US),
        ],
        ready_ns=arrival + MS,
        input_tokens=4396,
        output_tokens=160,
        cached_tokens=0,
        max_tokens=512,
        temperature=0.7,
        top_p=0.95,
        finish_reason="stop",
        requests_ahead=3,
        running_at_arrival=12,
        max_running=64,
        prefix_hash="9f2c41aa",
        outlier_steps_with_prefill=1,
    )
    return dataclasses.replace(recording, **changes)


def minimal_recording(number: int = 2, **changes: Any) -> RequestRecording:
    """Only what every recording has: no optional attribute, one unchunked prefill."""
    recording = RequestRecording(
        trace_id=trace_id(number),
        request_id=f"req-{number}",
        model="m",
        operation=semconv.OPERATION_TEXT_COMPLETION,
        arrival_ns=T0,
        end_ns=T0 + 50 * MS,
        first_scheduled_ns=T0 + MS,
        first_token_ns=T0 + 10 * MS,
        last_token_ns=T0 + 49 * MS,
        token_offsets_us=[0, 13_000, 26_000, 39_000],
    )
    return dataclasses.replace(recording, **changes)


def aborted_while_queued() -> RequestRecording:
    return RequestRecording(
        trace_id=trace_id(3),
        parent_span_id=PARENT,
        request_id="req-queued",
        model="m",
        operation=semconv.OPERATION_CHAT,
        arrival_ns=T0,
        end_ns=T0 + 900 * MS,
        input_tokens=100,
        requests_ahead=40,
        error="client disconnected",
    )


def aborted_mid_decode() -> RequestRecording:
    """Produced 3 tokens, then the client went away: the last token never came."""
    return RequestRecording(
        trace_id=trace_id(4),
        parent_span_id=PARENT,
        request_id="req-decode",
        model="m",
        operation=semconv.OPERATION_CHAT,
        arrival_ns=T0,
        end_ns=T0 + 80 * MS,
        first_scheduled_ns=T0 + 2 * MS,
        first_token_ns=T0 + 20 * MS,
        token_offsets_us=[0, 15_000, 30_000],
        prefill_chunks=[PrefillChunk(T0 + 2 * MS, T0 + 20 * MS, 100)],
        input_tokens=100,
        output_tokens=3,
        error="client disconnected",
    )


def encode(
    recordings: list[RequestRecording], **options: Any
) -> tuple[ExportTraceServiceRequest, int]:
    payload, count = encode_recordings(
        recordings, resource_attributes=RESOURCE, scope_name=SCOPE, **options
    )
    return ExportTraceServiceRequest.FromString(payload), count


def spans_of(message: ExportTraceServiceRequest) -> list[Span]:
    return [
        span
        for resource_spans in message.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]


def by_name(spans: list[Span]) -> dict[str, Span]:
    names = Counter(span.name for span in spans)
    return {span.name: span for span in spans if names[span.name] == 1}


def request_span(spans: list[Span]) -> Span:
    (span,) = (span for span in spans if span.name == semconv.SPAN_REQUEST)
    return span


def children_of(spans: list[Span], parent: Span) -> list[Span]:
    return [span for span in spans if span.parent_span_id == parent.span_id]


def interval(span: Span) -> tuple[int, int]:
    return span.start_time_unix_nano, span.end_time_unix_nano


# --- the tree -------------------------------------------------------------------------------------


def test_span_tree_links_every_phase_to_the_request_and_the_request_to_its_parent() -> None:
    recording = full_recording()
    message, count = encode([recording])
    (resource_spans,) = message.resource_spans
    (scope_spans,) = resource_spans.scope_spans
    assert attributes_of(resource_spans.resource) == RESOURCE  # type: ignore[arg-type]
    assert scope_spans.scope.name == SCOPE
    spans = list(scope_spans.spans)
    assert count == len(spans) == count_spans(recording) == 10

    ids = [span.span_id for span in spans]
    assert len(set(ids)) == len(ids)
    assert all(len(span_id) == 8 and any(span_id) for span_id in ids)
    assert {span.trace_id for span in spans} == {recording.trace_id}
    assert all(span.kind == Span.SPAN_KIND_INTERNAL for span in spans)
    root = request_span(spans)
    assert root.parent_span_id == PARENT
    assert interval(root) == (recording.arrival_ns, recording.end_ns)
    assert root.status.code == Status.STATUS_CODE_UNSET

    children = children_of(spans, root)
    assert Counter(span.name for span in children) == {
        semconv.SPAN_QUEUE: 1,
        semconv.SPAN_PREFILL: 1,
        semconv.SPAN_PREEMPTED: 2,
        semconv.SPAN_DECODE: 1,
        semconv.SPAN_POSTPROCESS: 1,
    }
    phases = by_name(children)
    assert recording.first_scheduled_ns is not None
    assert recording.first_token_ns is not None and recording.last_token_ns is not None
    assert interval(phases[semconv.SPAN_QUEUE]) == (
        recording.arrival_ns,
        recording.first_scheduled_ns,
    )
    assert interval(phases[semconv.SPAN_PREFILL]) == (
        recording.first_scheduled_ns,
        recording.first_token_ns,
    )
    assert interval(phases[semconv.SPAN_DECODE]) == (
        recording.first_token_ns,
        recording.last_token_ns,
    )
    assert interval(phases[semconv.SPAN_POSTPROCESS]) == (
        recording.last_token_ns,
        recording.end_ns,
    )
    preempted = sorted(interval(s) for s in children if s.name == semconv.SPAN_PREEMPTED)
    assert preempted == recording.preempted

    prefill = phases[semconv.SPAN_PREFILL]
    assert attributes_of(prefill) == {semconv.PREFILL_CHUNK_TOKENS: 4396}
    chunks = sorted(children_of(spans, prefill), key=interval)
    assert [(*interval(c), attributes_of(c)) for c in chunks] == [
        (c.start_ns, c.end_ns, {semconv.PREFILL_CHUNK_TOKENS: c.tokens})
        for c in recording.prefill_chunks
    ]
    assert all(span.name == semconv.SPAN_PREFILL_CHUNK for span in chunks)
    assert len(children) + len(chunks) + 1 == len(spans)  # nothing else hangs anywhere


def test_request_attributes_come_from_the_recording() -> None:
    recording = full_recording()
    (message, _) = encode([recording])
    spans = spans_of(message)
    assert attributes_of(request_span(spans)) == {
        semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_CHAT,
        semconv.GEN_AI_REQUEST_MODEL: "llama-test",
        semconv.REQUEST_ID: "cmpl-1",
        semconv.GEN_AI_REQUEST_MAX_TOKENS: 512,
        semconv.GEN_AI_REQUEST_TEMPERATURE: 0.7,
        semconv.GEN_AI_REQUEST_TOP_P: 0.95,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: 4396,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 160,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 0,
        semconv.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"],
        semconv.QUEUE_REQUESTS_AHEAD: 3,
        semconv.QUEUE_RUNNING_AT_ARRIVAL: 12,
        semconv.QUEUE_MAX_RUNNING: 64,
        semconv.PROMPT_PREFIX_HASH: "9f2c41aa",
        semconv.COLD_START_READY_TIME: recording.ready_ns,
    }
    decode = by_name(spans)[semconv.SPAN_DECODE]
    assert attributes_of(decode) == {
        semconv.DECODE_TOKEN_OFFSETS: recording.token_offsets_us,
        semconv.DECODE_OUTLIER_STEPS_WITH_PREFILL: 1,
    }


def test_a_recording_without_parent_is_a_root_and_several_recordings_share_one_request() -> None:
    recordings = [full_recording(1), minimal_recording(2), full_recording(5, parent_span_id=b"")]
    message, count = encode(recordings)
    assert len(message.resource_spans) == 1
    assert len(message.resource_spans[0].scope_spans) == 1
    spans = spans_of(message)
    assert count == len(spans) == sum(count_spans(r) for r in recordings)
    by_trace: dict[bytes, list[Span]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    assert set(by_trace) == {r.trace_id for r in recordings}
    assert request_span(by_trace[trace_id(5)]).parent_span_id == b""
    assert request_span(by_trace[trace_id(2)]).parent_span_id == b""  # default: no parent
    assert request_span(by_trace[trace_id(1)]).parent_span_id == PARENT


def test_a_request_that_waited_for_the_cold_start_links_to_it() -> None:
    link = (trace_id(9), bytes(range(1, 9)))
    message, _ = encode([full_recording(cold_start_link=link), minimal_recording()])
    spans = spans_of(message)
    linked, plain = [span for span in spans if span.name == semconv.SPAN_REQUEST]
    assert [(item.trace_id, item.span_id) for item in linked.links] == [link]
    assert not plain.links
    assert all(not span.links for span in spans if span.name != semconv.SPAN_REQUEST)


def test_attributes_are_absent_when_unknown() -> None:
    (message, _) = encode([minimal_recording()])
    spans = by_name(spans_of(message))
    assert set(spans) == {
        semconv.SPAN_REQUEST,
        semconv.SPAN_QUEUE,
        semconv.SPAN_PREFILL,
        semconv.SPAN_DECODE,
        semconv.SPAN_POSTPROCESS,
    }
    assert attributes_of(spans[semconv.SPAN_REQUEST]) == {
        semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_TEXT_COMPLETION,
        semconv.GEN_AI_REQUEST_MODEL: "m",
        semconv.REQUEST_ID: "req-2",
    }
    assert attributes_of(spans[semconv.SPAN_PREFILL]) == {}  # no chunks recorded: no count
    assert attributes_of(spans[semconv.SPAN_DECODE]) == {
        semconv.DECODE_TOKEN_OFFSETS: [0, 13_000, 26_000, 39_000]
    }
    # No token offsets recorded: no empty array either.
    (message, _) = encode([minimal_recording(token_offsets_us=[])])
    assert attributes_of(by_name(spans_of(message))[semconv.SPAN_DECODE]) == {}


# --- decode offsets cap -------------------------------------------------------------------------


@pytest.mark.parametrize(("cap", "kept"), [(1024, 1024), (5000, 3000), (1, 1), (0, 0)])
def test_decode_keeps_the_first_offsets_and_counts_the_rest(cap: int, kept: int) -> None:
    offsets = [k * 7_000 + k * k for k in range(3000)]  # distinct gaps: order errors show up
    first_token = full_recording().first_token_ns
    assert first_token is not None
    recording = full_recording(
        token_offsets_us=offsets,
        output_tokens=len(offsets),
        last_token_ns=first_token + offsets[-1] * US,
    )
    (message, _) = encode([recording], max_token_offsets=cap)
    attributes = attributes_of(by_name(spans_of(message))[semconv.SPAN_DECODE])
    assert attributes.get(semconv.DECODE_TOKEN_OFFSETS, []) == offsets[:kept]
    dropped = attributes.get(semconv.DECODE_TOKEN_OFFSETS_DROPPED)
    assert dropped == (len(offsets) - kept if kept < len(offsets) else None)
    # The collector reads back the same consecutive gaps for the kept prefix.
    timeline = timeline_of(message)
    assert timeline.token_offsets_us == offsets[:kept]
    assert timeline.token_offsets_dropped == len(offsets) - kept


def test_a_negative_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="max_token_offsets"):
        encode([full_recording()], max_token_offsets=-1)
    with pytest.raises(ValueError, match="max_token_offsets"):
        list(plan_spans(full_recording(), max_token_offsets=-1))


# --- requests that did not finish ---------------------------------------------------------------


def assert_children_inside(spans: list[Span]) -> None:
    root = request_span(spans)
    by_id = {span.span_id: span for span in spans}
    for span in spans:
        if span is root:
            continue
        parent = by_id[span.parent_span_id]
        assert parent.start_time_unix_nano <= span.start_time_unix_nano, span.name
        assert span.start_time_unix_nano <= span.end_time_unix_nano, span.name
        assert span.end_time_unix_nano <= parent.end_time_unix_nano, span.name


def test_aborted_while_queued_is_the_request_and_its_queue_wait_up_to_the_end() -> None:
    recording = aborted_while_queued()
    message, count = encode([recording])
    spans = spans_of(message)
    assert count == 2 == count_spans(recording)
    assert sorted(span.name for span in spans) == [semconv.SPAN_QUEUE, semconv.SPAN_REQUEST]
    root = request_span(spans)
    assert root.status.code == Status.STATUS_CODE_ERROR
    assert root.status.message == "client disconnected"
    (queue,) = children_of(spans, root)
    assert interval(queue) == (recording.arrival_ns, recording.end_ns)
    assert queue.status.code == Status.STATUS_CODE_UNSET  # the error belongs to the request
    assert_children_inside(spans)


def test_aborted_mid_decode_has_no_postprocess_and_decodes_until_the_end() -> None:
    recording = aborted_mid_decode()
    message, count = encode([recording])
    spans = spans_of(message)
    assert count == len(spans) == count_spans(recording)
    phases = by_name(spans)
    assert set(phases) == {
        semconv.SPAN_REQUEST,
        semconv.SPAN_QUEUE,
        semconv.SPAN_PREFILL,
        semconv.SPAN_DECODE,
    }
    assert phases[semconv.SPAN_REQUEST].status.code == Status.STATUS_CODE_ERROR
    assert interval(phases[semconv.SPAN_DECODE]) == (recording.first_token_ns, recording.end_ns)
    assert attributes_of(phases[semconv.SPAN_DECODE]) == {
        semconv.DECODE_TOKEN_OFFSETS: [0, 15_000, 30_000]
    }
    assert not children_of(spans, phases[semconv.SPAN_PREFILL])  # one chunk: no chunk spans
    assert_children_inside(spans)


def test_aborted_mid_prefill_keeps_the_prefill_up_to_the_end() -> None:
    recording = dataclasses.replace(
        aborted_mid_decode(), first_token_ns=None, token_offsets_us=[], output_tokens=0
    )
    (message, _) = encode([recording])
    spans = spans_of(message)
    phases = by_name(spans)
    assert set(phases) == {semconv.SPAN_REQUEST, semconv.SPAN_QUEUE, semconv.SPAN_PREFILL}
    assert interval(phases[semconv.SPAN_PREFILL]) == (recording.first_scheduled_ns, T0 + 80 * MS)
    assert_children_inside(spans)


def test_a_missing_boundary_extends_the_phase_before_it_to_the_next_known_one() -> None:
    # The recorder missed "first scheduled": no prefill span, the queue lasts to the first token.
    recording = minimal_recording(first_scheduled_ns=None)
    (message, _) = encode([recording])
    phases = by_name(spans_of(message))
    assert set(phases) == {
        semconv.SPAN_REQUEST,
        semconv.SPAN_QUEUE,
        semconv.SPAN_DECODE,
        semconv.SPAN_POSTPROCESS,
    }
    assert interval(phases[semconv.SPAN_QUEUE]) == (recording.arrival_ns, recording.first_token_ns)
    assert count_spans(recording) == 4


def test_intervals_outside_the_request_are_clamped_into_it() -> None:
    recording = full_recording()
    scheduled = recording.first_scheduled_ns
    assert scheduled is not None
    skewed = dataclasses.replace(
        recording,
        preempted=[(recording.arrival_ns - MS, recording.arrival_ns + MS)],
        prefill_chunks=[
            PrefillChunk(scheduled - MS, scheduled + MS, 10),
            PrefillChunk(scheduled + MS, recording.end_ns + MS, 10),
        ],
    )
    (message, _) = encode([skewed])
    assert_children_inside(spans_of(message))


def test_the_queue_starts_when_the_engine_queued_the_request() -> None:
    recording = minimal_recording(queued_ns=T0 + 300 * US)
    phases = by_name(spans_of(encode([recording])[0]))
    assert interval(phases[semconv.SPAN_QUEUE]) == (T0 + 300 * US, recording.first_scheduled_ns)
    assert interval(phases[semconv.SPAN_REQUEST]) == (recording.arrival_ns, recording.end_ns)


@pytest.mark.parametrize(
    ("queued_offset_ns", "expected_offset_ns"),
    [(-MS, 0), (5 * MS, MS)],  # before arrival; after first scheduled (T0 + 1 ms)
    ids=["before_arrival", "after_scheduled"],
)
def test_an_engine_arrival_outside_the_queue_phase_is_clamped_into_it(
    queued_offset_ns: int, expected_offset_ns: int
) -> None:
    recording = minimal_recording(queued_ns=T0 + queued_offset_ns)
    spans = spans_of(encode([recording])[0])
    queue = by_name(spans)[semconv.SPAN_QUEUE]
    assert interval(queue) == (T0 + expected_offset_ns, recording.first_scheduled_ns)
    assert_children_inside(spans)


# --- the collector reads back the recording's phases ---------------------------------------------


def timeline_of(message: ExportTraceServiceRequest) -> RequestTimeline:
    """What the collector derives: spans grouped by trace as assembly does, then normalised."""
    traces: dict[bytes, list[SpanRef]] = {}
    for resource_spans in message.resource_spans:
        resource = resource_spans.resource
        service = str(attributes_of(resource)[semconv.SERVICE_NAME])  # type: ignore[arg-type]
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                ref = SpanRef(
                    span=span, resource=resource, scope=scope_spans.scope, service=service
                )
                traces.setdefault(span.trace_id, []).append(ref)
    (trace_id, refs), *others = traces.items()
    assert not others
    (timeline,) = normalize(AssembledTrace(trace_id=trace_id, spans=refs))
    return timeline


def overlap(intervals: list[tuple[int, int]], start: int, end: int) -> int:
    return sum(max(0, min(b, end) - max(a, start)) for a, b in intervals)


def expected_segments(recording: RequestRecording) -> dict[str, int]:
    """The recording's phase durations, from its own boundaries (missing ones: the next known,
    the end at the latest)."""
    end = recording.end_ns
    last_token = recording.last_token_ns if recording.last_token_ns is not None else end
    first_token = recording.first_token_ns if recording.first_token_ns is not None else last_token
    scheduled = (
        recording.first_scheduled_ns if recording.first_scheduled_ns is not None else first_token
    )
    # Engine arrival: when the engine queued the request; the hand-off before it is http.
    arrival = recording.queued_ns if recording.queued_ns is not None else recording.arrival_ns
    ready = recording.ready_ns if recording.ready_ns is not None else arrival
    ready = max(ready, arrival)
    in_prefill = overlap(recording.preempted, scheduled, first_token)
    in_decode = overlap(recording.preempted, first_token, last_token)
    segments = dict.fromkeys(semconv.SEGMENTS, 0)
    segments |= {
        semconv.SEGMENT_HTTP: arrival - recording.arrival_ns,
        semconv.SEGMENT_COLD_START: ready - arrival,
        semconv.SEGMENT_QUEUE: scheduled - ready,
        semconv.SEGMENT_PREFILL: first_token - scheduled - in_prefill,
        semconv.SEGMENT_PREEMPTED: in_prefill + in_decode,
        semconv.SEGMENT_DECODE: last_token - first_token - in_decode,
        semconv.SEGMENT_POSTPROCESS: end - last_token,
    }
    return segments


@pytest.mark.parametrize(
    "recording",
    [
        full_recording(),
        minimal_recording(),
        aborted_while_queued(),
        aborted_mid_decode(),
        minimal_recording(queued_ns=T0 + 300 * US),
        full_recording(queued_ns=T0 + 10 * MS + 400 * US),  # before ready (+1 ms)
        full_recording(queued_ns=T0 + 10 * MS + 2 * MS),  # after ready: no cold start
    ],
    ids=[
        "full",
        "minimal",
        "aborted_while_queued",
        "aborted_mid_decode",
        "minimal_queued_after_handoff",
        "full_queued_before_ready",
        "full_queued_after_ready",
    ],
)
def test_collector_reads_back_the_recorded_phase_durations(recording: RequestRecording) -> None:
    (message, _) = encode([recording])
    timeline = timeline_of(message)
    budget: Budget = compute_budget(timeline)

    assert budget.segments == expected_segments(recording)
    assert budget.e2e_ns == recording.end_ns - recording.arrival_ns
    assert not budget.skew_clamped
    if recording.first_token_ns is None:
        assert budget.ttft_ns is None
    else:
        assert budget.ttft_ns == recording.first_token_ns - recording.arrival_ns
    assert timeline.status_error == recording.error
    assert timeline.request_id == recording.request_id
    assert (timeline.model, timeline.operation) == (recording.model, recording.operation)
    assert timeline.service == RESOURCE[semconv.SERVICE_NAME]
    assert timeline.input_tokens == recording.input_tokens
    assert timeline.output_tokens == recording.output_tokens
    assert timeline.token_offsets_us == recording.token_offsets_us
    assert timeline.preempted == recording.preempted
    assert timeline.requests_ahead == recording.requests_ahead
    assert timeline.ready == recording.ready_ns
    if len(recording.prefill_chunks) > 1:
        assert timeline.prefill_chunks == [tuple(c) for c in recording.prefill_chunks]


def test_full_recording_exercises_every_segment() -> None:
    # Guards the round-trip test above against a fixture that stopped covering a segment.
    segments = expected_segments(full_recording())
    for segment in (
        semconv.SEGMENT_COLD_START,
        semconv.SEGMENT_QUEUE,
        semconv.SEGMENT_PREFILL,
        semconv.SEGMENT_PREEMPTED,
        semconv.SEGMENT_DECODE,
        semconv.SEGMENT_POSTPROCESS,
    ):
        assert segments[segment] > 0, segment
    recording = full_recording()
    assert recording.first_token_ns is not None
    assert overlap(recording.preempted, recording.arrival_ns, recording.first_token_ns) > 0
    assert overlap(recording.preempted, recording.first_token_ns, recording.end_ns) > 0


# --- the wire encoding ----------------------------------------------------------------------------


def reference_span(planned: PlannedSpan, trace: bytes, span_id: bytes, parent: bytes) -> Span:
    """The same span built through the protobuf API, field by field."""
    span = Span(
        trace_id=trace,
        span_id=span_id,
        parent_span_id=parent,
        name=planned.name,
        kind=planned.kind,
        start_time_unix_nano=planned.start_ns,
        end_time_unix_nano=planned.end_ns,
    )
    span.attributes.extend(key_value(k, v) for k, v in planned.attributes.items())
    if planned.error is not None:
        span.status.code = Status.STATUS_CODE_ERROR
        span.status.message = planned.error
    return span


def test_encoded_spans_equal_spans_built_through_the_protobuf_api() -> None:
    recording = full_recording()
    message, _ = encode([dataclasses.replace(recording, error="engine died")])
    encoded = spans_of(message)
    planned = list(plan_spans(dataclasses.replace(recording, error="engine died")))
    assert len(encoded) == len(planned)
    for span, plan in zip(encoded, planned, strict=True):
        parent = encoded[plan.parent_local_id].span_id if plan.parent_local_id >= 0 else PARENT
        assert span == reference_span(plan, recording.trace_id, span.span_id, parent)


@pytest.mark.parametrize(
    "value",
    [
        0,
        127,
        128,
        16_384,
        -1,
        -(2**63),
        2**63 - 1,
        2.5,
        -0.0,
        True,
        False,
        "",
        "ünïcode ✓",
        ("stop", "length"),
        (),
        [0, 1, 127, 128, 2**35 - 1, 2**35, 2**62],
        [5, -3],
        [],
    ],
)
def test_every_attribute_value_type_round_trips(value: Any) -> None:
    planned = PlannedSpan(0, -1, "x", KIND_CLIENT, T0, T0 + 1, {"k": value, "n": 7}, error="")
    span_id = (2**64 - 1).to_bytes(8, "big")
    payload = export_request(
        [(ResourceScope(resource_attributes={"r": value}, scope_name="s", scope_version="1"), [
            encode_span(planned, trace_id=trace_id(9), span_id=span_id)
        ])]
    )  # fmt: skip
    message = ExportTraceServiceRequest.FromString(payload)
    (span,) = spans_of(message)
    assert span == reference_span(planned, trace_id(9), span_id, b"")
    expected = list(value) if isinstance(value, tuple) else value
    assert attributes_of(span) == {"k": expected, "n": 7}
    assert attributes_of(message.resource_spans[0].resource) == {"r": expected}  # type: ignore[arg-type]
    assert message.resource_spans[0].scope_spans[0].scope.version == "1"
    assert span.status.code == Status.STATUS_CODE_ERROR and span.status.message == ""


def test_empty_input_is_an_empty_request() -> None:
    assert encode_recordings([], resource_attributes=RESOURCE, scope_name=SCOPE) == (b"", 0)
    assert export_request([(ResourceScope(resource_attributes={}, scope_name="s"), [])]) == b""


def test_bad_recordings_are_skipped_and_counted_never_raised() -> None:
    encoder = RecordingEncoder(resource_attributes=RESOURCE, scope_name=SCOPE)
    bad = [
        full_recording(1, trace_id=b"short"),
        full_recording(2, parent_span_id=b"\x01\x02"),
        full_recording(3, requests_ahead=2**64),
        full_recording(4, token_offsets_us=[0, 2**70]),
        full_recording(5, arrival_ns=-1),
        full_recording(6, model=None),
    ]
    good = minimal_recording(7)
    payload, count = encoder.encode([*bad[:3], good, *bad[3:]])
    assert encoder.recordings_skipped == len(bad)
    spans = spans_of(ExportTraceServiceRequest.FromString(payload))
    assert count == len(spans) == count_spans(good)
    assert {span.trace_id for span in spans} == {good.trace_id}


def test_encoded_bytes_include_unicode_and_error_messages_intact() -> None:
    recording = aborted_while_queued()
    recording = dataclasses.replace(recording, model="模型-ü", error="abgebrochen: 客户端")
    (message, _) = encode([recording])
    root = request_span(spans_of(message))
    assert attributes_of(root)[semconv.GEN_AI_REQUEST_MODEL] == "模型-ü"
    assert root.status.message == "abgebrochen: 客户端"


# --- span ids -------------------------------------------------------------------------------------


def test_caller_supplied_span_ids_are_used_in_plan_order() -> None:
    recording = minimal_recording()
    (message, _) = encode([recording], span_ids=itertools.count(100).__next__)
    spans = spans_of(message)
    planned = list(plan_spans(recording))
    assert [int.from_bytes(s.span_id, "big") for s in spans] == list(range(100, 100 + len(planned)))
    assert [s.name for s in spans] == [p.name for p in planned]


def test_a_zero_span_id_from_the_source_skips_the_recording() -> None:
    encoder = RecordingEncoder(
        resource_attributes=RESOURCE, scope_name=SCOPE, span_ids=itertools.repeat(0).__next__
    )
    assert encoder.encode([minimal_recording()]) == (b"", 0)
    assert encoder.recordings_skipped == 1


def test_random_span_ids_are_distinct_and_never_zero() -> None:
    ids = [random_span_id() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert all(0 < span_id < 2**64 for span_id in ids)
    assert max(ids) > 2**63  # the whole 64-bit range is used


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_processes_draw_different_span_ids() -> None:
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.write(write_end, random_span_id().to_bytes(8, "big"))
        os._exit(0)
    os.close(write_end)
    parent_id = random_span_id()
    child_id = int.from_bytes(os.read(read_end, 8), "big")
    os.close(read_end)
    os.waitpid(child, 0)
    assert child_id != 0 and child_id != parent_id


# --- packaging ------------------------------------------------------------------------------------


def test_the_encoder_needs_neither_protobuf_nor_the_collector() -> None:
    code = (
        "import sys\n"
        "from tokentrace.agent import spans\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry', 'google', "
        "'grpc', 'tokentrace.collector', 'tokentrace.processors'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_planned_spans_are_numbered_in_order_with_parents_first() -> None:
    for recording in (full_recording(), minimal_recording(), aborted_while_queued()):
        planned = list(plan_spans(recording))
        assert [p.local_id for p in planned] == list(range(len(planned)))
        assert planned[0].parent_local_id == -1 and planned[0].name == semconv.SPAN_REQUEST
        assert all(0 <= p.parent_local_id < p.local_id for p in planned[1:])
        assert all(p.kind == KIND_INTERNAL for p in planned)


def test_boundaries_from_skewed_clocks_are_clamped_inside_the_request() -> None:
    from tokentrace.agent.recording import RequestRecording
    from tokentrace.agent.spans import plan_spans

    recording = RequestRecording(
        trace_id=b"\x01" * 16,
        request_id="r",
        model="m",
        operation="chat",
        arrival_ns=1_000,
        end_ns=2_000,
        first_scheduled_ns=900,  # before arrival: another process's clock
        first_token_ns=1_500,
        last_token_ns=2_500,  # after the end
        token_offsets_us=[0],
    )
    spans = list(plan_spans(recording))
    request = spans[0]
    for span in spans[1:]:
        assert request.start_ns <= span.start_ns <= span.end_ns <= request.end_ns, span.name
