"""The agent's span layout (``spans.plan_spans``), read back through the wire encoder and the
collector's processors."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.agent.finished_requests import (
    MS,
    PARENT,
    RESOURCE,
    SCOPE,
    T0,
    US,
    aborted_mid_decode,
    aborted_while_queued,
    encode,
    full_finished_request,
    minimal_finished_request,
    request_span,
    spans_of,
    trace_id,
)
from tests.spanbuild import attributes_of
from tokentrace.agent import semconv
from tokentrace.agent.finished_request import FinishedRequest, PrefillChunk
from tokentrace.agent.spans import KIND_INTERNAL, count_spans, plan_spans
from tokentrace.processors.budget import compute_budget
from tokentrace.processors.model import AssembledTrace, Budget, RequestTimeline, SpanRef
from tokentrace.processors.timeline import normalize


def by_name(spans: list[Span]) -> dict[str, Span]:
    names = Counter(span.name for span in spans)
    return {span.name: span for span in spans if names[span.name] == 1}


def children_of(spans: list[Span], parent: Span) -> list[Span]:
    return [span for span in spans if span.parent_span_id == parent.span_id]


def interval(span: Span) -> tuple[int, int]:
    return span.start_time_unix_nano, span.end_time_unix_nano


# --- the tree -------------------------------------------------------------------------------------


def test_span_tree_links_every_phase_to_the_request_and_the_request_to_its_parent() -> None:
    finished = full_finished_request()
    message, count = encode([finished])
    (resource_spans,) = message.resource_spans
    (scope_spans,) = resource_spans.scope_spans
    assert attributes_of(resource_spans.resource) == RESOURCE  # type: ignore[arg-type]
    assert scope_spans.scope.name == SCOPE
    spans = list(scope_spans.spans)
    assert count == len(spans) == count_spans(finished) == 10

    ids = [span.span_id for span in spans]
    assert len(set(ids)) == len(ids)
    assert all(len(span_id) == 8 and any(span_id) for span_id in ids)
    assert {span.trace_id for span in spans} == {finished.trace_id}
    assert all(span.kind == Span.SPAN_KIND_INTERNAL for span in spans)
    root = request_span(spans)
    assert root.parent_span_id == PARENT
    assert interval(root) == (finished.arrival_ns, finished.end_ns)
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
    assert finished.first_scheduled_ns is not None
    assert finished.first_token_ns is not None and finished.last_token_ns is not None
    assert interval(phases[semconv.SPAN_QUEUE]) == (
        finished.arrival_ns,
        finished.first_scheduled_ns,
    )
    assert interval(phases[semconv.SPAN_PREFILL]) == (
        finished.first_scheduled_ns,
        finished.first_token_ns,
    )
    assert interval(phases[semconv.SPAN_DECODE]) == (
        finished.first_token_ns,
        finished.last_token_ns,
    )
    assert interval(phases[semconv.SPAN_POSTPROCESS]) == (
        finished.last_token_ns,
        finished.end_ns,
    )
    preempted = sorted(interval(s) for s in children if s.name == semconv.SPAN_PREEMPTED)
    assert preempted == finished.preempted

    prefill = phases[semconv.SPAN_PREFILL]
    assert attributes_of(prefill) == {semconv.PREFILL_CHUNK_TOKENS: 4396}
    chunks = sorted(children_of(spans, prefill), key=interval)
    assert [(*interval(c), attributes_of(c)) for c in chunks] == [
        (c.start_ns, c.end_ns, {semconv.PREFILL_CHUNK_TOKENS: c.tokens})
        for c in finished.prefill_chunks
    ]
    assert all(span.name == semconv.SPAN_PREFILL_CHUNK for span in chunks)
    assert len(children) + len(chunks) + 1 == len(spans)  # nothing else hangs anywhere


def test_request_attributes_come_from_the_finished_request() -> None:
    finished = full_finished_request()
    (message, _) = encode([finished])
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
        semconv.COLD_START_READY_TIME: finished.ready_ns,
    }
    decode = by_name(spans)[semconv.SPAN_DECODE]
    assert attributes_of(decode) == {
        semconv.DECODE_TOKEN_OFFSETS: finished.token_offsets_us,
        semconv.DECODE_OUTLIER_STEPS_WITH_PREFILL: 1,
    }


def test_a_finished_request_without_parent_is_a_root_and_several_share_one_export() -> None:
    finished_requests = [
        full_finished_request(1),
        minimal_finished_request(2),
        full_finished_request(5, parent_span_id=b""),
    ]
    message, count = encode(finished_requests)
    assert len(message.resource_spans) == 1
    assert len(message.resource_spans[0].scope_spans) == 1
    spans = spans_of(message)
    assert count == len(spans) == sum(count_spans(r) for r in finished_requests)
    by_trace: dict[bytes, list[Span]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    assert set(by_trace) == {r.trace_id for r in finished_requests}
    assert request_span(by_trace[trace_id(5)]).parent_span_id == b""
    assert request_span(by_trace[trace_id(2)]).parent_span_id == b""  # default: no parent
    assert request_span(by_trace[trace_id(1)]).parent_span_id == PARENT


def test_a_request_that_waited_for_the_cold_start_links_to_it() -> None:
    link = (trace_id(9), bytes(range(1, 9)))
    message, _ = encode([full_finished_request(cold_start_link=link), minimal_finished_request()])
    spans = spans_of(message)
    linked, plain = [span for span in spans if span.name == semconv.SPAN_REQUEST]
    assert [(item.trace_id, item.span_id) for item in linked.links] == [link]
    assert not plain.links
    assert all(not span.links for span in spans if span.name != semconv.SPAN_REQUEST)


def test_attributes_are_absent_when_unknown() -> None:
    (message, _) = encode([minimal_finished_request()])
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
    (message, _) = encode([minimal_finished_request(token_offsets_us=[])])
    assert attributes_of(by_name(spans_of(message))[semconv.SPAN_DECODE]) == {}


# --- decode offsets cap -------------------------------------------------------------------------


@pytest.mark.parametrize(("cap", "kept"), [(1024, 1024), (5000, 3000), (1, 1), (0, 0)])
def test_decode_keeps_the_first_offsets_and_counts_the_rest(cap: int, kept: int) -> None:
    offsets = [k * 7_000 + k * k for k in range(3000)]  # distinct gaps: order errors show up
    first_token = full_finished_request().first_token_ns
    assert first_token is not None
    finished = full_finished_request(
        token_offsets_us=offsets,
        output_tokens=len(offsets),
        last_token_ns=first_token + offsets[-1] * US,
    )
    (message, _) = encode([finished], max_token_offsets=cap)
    attributes = attributes_of(by_name(spans_of(message))[semconv.SPAN_DECODE])
    assert attributes.get(semconv.DECODE_TOKEN_OFFSETS, []) == offsets[:kept]
    dropped = attributes.get(semconv.DECODE_TOKEN_OFFSETS_DROPPED)
    assert dropped == (len(offsets) - kept if kept < len(offsets) else None)
    # The collector reads back the same consecutive gaps for the kept prefix.
    timeline = timeline_of(message)
    assert list(timeline.token_offsets_us) == offsets[:kept]
    assert timeline.token_offsets_dropped == len(offsets) - kept


def test_a_negative_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="max_token_offsets"):
        encode([full_finished_request()], max_token_offsets=-1)
    with pytest.raises(ValueError, match="max_token_offsets"):
        list(plan_spans(full_finished_request(), max_token_offsets=-1))


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
    finished = aborted_while_queued()
    message, count = encode([finished])
    spans = spans_of(message)
    assert count == 2 == count_spans(finished)
    assert sorted(span.name for span in spans) == [semconv.SPAN_QUEUE, semconv.SPAN_REQUEST]
    root = request_span(spans)
    assert root.status.code == Status.STATUS_CODE_ERROR
    assert root.status.message == "client disconnected"
    (queue,) = children_of(spans, root)
    assert interval(queue) == (finished.arrival_ns, finished.end_ns)
    assert queue.status.code == Status.STATUS_CODE_UNSET  # the error belongs to the request
    assert_children_inside(spans)


def test_aborted_mid_decode_has_no_postprocess_and_decodes_until_the_end() -> None:
    finished = aborted_mid_decode()
    message, count = encode([finished])
    spans = spans_of(message)
    assert count == len(spans) == count_spans(finished)
    phases = by_name(spans)
    assert set(phases) == {
        semconv.SPAN_REQUEST,
        semconv.SPAN_QUEUE,
        semconv.SPAN_PREFILL,
        semconv.SPAN_DECODE,
    }
    assert phases[semconv.SPAN_REQUEST].status.code == Status.STATUS_CODE_ERROR
    assert interval(phases[semconv.SPAN_DECODE]) == (finished.first_token_ns, finished.end_ns)
    assert attributes_of(phases[semconv.SPAN_DECODE]) == {
        semconv.DECODE_TOKEN_OFFSETS: [0, 15_000, 30_000]
    }
    assert not children_of(spans, phases[semconv.SPAN_PREFILL])  # one chunk: no chunk spans
    assert_children_inside(spans)


def test_aborted_mid_prefill_keeps_the_prefill_up_to_the_end() -> None:
    finished = dataclasses.replace(
        aborted_mid_decode(), first_token_ns=None, token_offsets_us=[], output_tokens=0
    )
    (message, _) = encode([finished])
    spans = spans_of(message)
    phases = by_name(spans)
    assert set(phases) == {semconv.SPAN_REQUEST, semconv.SPAN_QUEUE, semconv.SPAN_PREFILL}
    assert interval(phases[semconv.SPAN_PREFILL]) == (finished.first_scheduled_ns, T0 + 80 * MS)
    assert_children_inside(spans)


def test_a_missing_boundary_extends_the_phase_before_it_to_the_next_known_one() -> None:
    # The recorder missed "first scheduled": no prefill span, the queue lasts to the first token.
    finished = minimal_finished_request(first_scheduled_ns=None)
    (message, _) = encode([finished])
    phases = by_name(spans_of(message))
    assert set(phases) == {
        semconv.SPAN_REQUEST,
        semconv.SPAN_QUEUE,
        semconv.SPAN_DECODE,
        semconv.SPAN_POSTPROCESS,
    }
    assert interval(phases[semconv.SPAN_QUEUE]) == (finished.arrival_ns, finished.first_token_ns)
    assert count_spans(finished) == 4


def test_intervals_outside_the_request_are_clamped_into_it() -> None:
    finished = full_finished_request()
    scheduled = finished.first_scheduled_ns
    assert scheduled is not None
    skewed = dataclasses.replace(
        finished,
        preempted=[(finished.arrival_ns - MS, finished.arrival_ns + MS)],
        prefill_chunks=[
            PrefillChunk(scheduled - MS, scheduled + MS, 10),
            PrefillChunk(scheduled + MS, finished.end_ns + MS, 10),
        ],
    )
    (message, _) = encode([skewed])
    assert_children_inside(spans_of(message))


def test_the_queue_starts_when_the_engine_queued_the_request() -> None:
    finished = minimal_finished_request(queued_ns=T0 + 300 * US)
    phases = by_name(spans_of(encode([finished])[0]))
    assert interval(phases[semconv.SPAN_QUEUE]) == (T0 + 300 * US, finished.first_scheduled_ns)
    assert interval(phases[semconv.SPAN_REQUEST]) == (finished.arrival_ns, finished.end_ns)


@pytest.mark.parametrize(
    ("queued_offset_ns", "expected_offset_ns"),
    [(-MS, 0), (5 * MS, MS)],  # before arrival; after first scheduled (T0 + 1 ms)
    ids=["before_arrival", "after_scheduled"],
)
def test_an_engine_arrival_outside_the_queue_phase_is_clamped_into_it(
    queued_offset_ns: int, expected_offset_ns: int
) -> None:
    finished = minimal_finished_request(queued_ns=T0 + queued_offset_ns)
    spans = spans_of(encode([finished])[0])
    queue = by_name(spans)[semconv.SPAN_QUEUE]
    assert interval(queue) == (T0 + expected_offset_ns, finished.first_scheduled_ns)
    assert_children_inside(spans)


# --- the collector reads back the finished request's phases ------------------------------------


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


def expected_segments(finished: FinishedRequest) -> dict[str, int]:
    """The finished request's phase durations, from its own boundaries (missing ones: the next
    known, the end at the latest)."""
    end = finished.end_ns
    last_token = finished.last_token_ns if finished.last_token_ns is not None else end
    first_token = finished.first_token_ns if finished.first_token_ns is not None else last_token
    scheduled = (
        finished.first_scheduled_ns if finished.first_scheduled_ns is not None else first_token
    )
    # Engine arrival: when the engine queued the request; the hand-off before it is http.
    arrival = finished.queued_ns if finished.queued_ns is not None else finished.arrival_ns
    ready = finished.ready_ns if finished.ready_ns is not None else arrival
    ready = max(ready, arrival)
    in_prefill = overlap(finished.preempted, scheduled, first_token)
    in_decode = overlap(finished.preempted, first_token, last_token)
    segments = dict.fromkeys(semconv.SEGMENTS, 0)
    segments |= {
        semconv.SEGMENT_HTTP: arrival - finished.arrival_ns,
        semconv.SEGMENT_COLD_START: ready - arrival,
        semconv.SEGMENT_QUEUE: scheduled - ready,
        semconv.SEGMENT_PREFILL: first_token - scheduled - in_prefill,
        semconv.SEGMENT_PREEMPTED: in_prefill + in_decode,
        semconv.SEGMENT_DECODE: last_token - first_token - in_decode,
        semconv.SEGMENT_POSTPROCESS: end - last_token,
    }
    return segments


@pytest.mark.parametrize(
    "finished",
    [
        full_finished_request(),
        minimal_finished_request(),
        aborted_while_queued(),
        aborted_mid_decode(),
        minimal_finished_request(queued_ns=T0 + 300 * US),
        full_finished_request(queued_ns=T0 + 10 * MS + 400 * US),  # before ready (+1 ms)
        full_finished_request(queued_ns=T0 + 10 * MS + 2 * MS),  # after ready: no cold start
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
def test_collector_reads_back_the_recorded_phase_durations(finished: FinishedRequest) -> None:
    (message, _) = encode([finished])
    timeline = timeline_of(message)
    budget: Budget = compute_budget(timeline)

    assert budget.segments == expected_segments(finished)
    assert budget.e2e_ns == finished.end_ns - finished.arrival_ns
    assert not budget.skew_clamped
    if finished.first_token_ns is None:
        assert budget.ttft_ns is None
    else:
        assert budget.ttft_ns == finished.first_token_ns - finished.arrival_ns
    assert timeline.status_error == finished.status_error
    assert timeline.request_id == finished.request_id
    assert (timeline.model, timeline.operation) == (finished.model, finished.operation)
    assert timeline.service == RESOURCE[semconv.SERVICE_NAME]
    assert timeline.input_tokens == finished.input_tokens
    assert timeline.output_tokens == finished.output_tokens
    assert list(timeline.token_offsets_us) == finished.token_offsets_us
    assert timeline.preempted == finished.preempted
    assert timeline.requests_ahead == finished.requests_ahead
    assert timeline.ready == finished.ready_ns
    if len(finished.prefill_chunks) > 1:
        assert timeline.prefill_chunks == [tuple(c) for c in finished.prefill_chunks]


def test_full_finished_request_exercises_every_segment() -> None:
    # Guards the round-trip test above against a fixture that stopped covering a segment.
    segments = expected_segments(full_finished_request())
    for segment in (
        semconv.SEGMENT_COLD_START,
        semconv.SEGMENT_QUEUE,
        semconv.SEGMENT_PREFILL,
        semconv.SEGMENT_PREEMPTED,
        semconv.SEGMENT_DECODE,
        semconv.SEGMENT_POSTPROCESS,
    ):
        assert segments[segment] > 0, segment
    finished = full_finished_request()
    assert finished.first_token_ns is not None
    assert overlap(finished.preempted, finished.arrival_ns, finished.first_token_ns) > 0
    assert overlap(finished.preempted, finished.first_token_ns, finished.end_ns) > 0


# --- numbering and clamping -----------------------------------------------------------------------


def test_planned_spans_are_numbered_in_order_with_parents_first() -> None:
    for finished in (full_finished_request(), minimal_finished_request(), aborted_while_queued()):
        planned = list(plan_spans(finished))
        assert [p.local_id for p in planned] == list(range(len(planned)))
        assert planned[0].parent_local_id == -1 and planned[0].name == semconv.SPAN_REQUEST
        assert all(0 <= p.parent_local_id < p.local_id for p in planned[1:])
        assert all(p.kind == KIND_INTERNAL for p in planned)


def test_boundaries_from_skewed_clocks_are_clamped_inside_the_request() -> None:
    from tokentrace.agent.finished_request import FinishedRequest
    from tokentrace.agent.spans import plan_spans

    finished = FinishedRequest(
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
    spans = list(plan_spans(finished))
    request = spans[0]
    for span in spans[1:]:
        assert request.start_ns <= span.start_ns <= span.end_ns <= request.end_ns, span.name


def test_what_the_instrumentation_cannot_measure_reaches_the_timeline() -> None:
    """An engine instrumentation's ``not_reported`` rides on ``llm.request`` and the collector's
    timeline names it with its source; without a source it says whose it is in general terms."""
    said = dataclasses.replace(
        full_finished_request(),
        not_reported=("engine steps", "preemption"),
        not_reported_by="llama-cpp-python's server",
    )
    timeline = timeline_of(encode([said])[0])
    assert timeline.not_reported == ("engine steps", "preemption")
    assert timeline.not_reported_by == "llama-cpp-python's server"

    anonymous = dataclasses.replace(minimal_finished_request(), not_reported=("the queue",))
    timeline = timeline_of(encode([anonymous])[0])
    assert timeline.not_reported == ("the queue",)
    assert timeline.not_reported_by == "the engine's instrumentation"

    silent = timeline_of(encode([full_finished_request()])[0])
    assert silent.not_reported == () and silent.not_reported_by is None
