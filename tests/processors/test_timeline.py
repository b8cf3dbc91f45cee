"""Normalisation of tokentrace, vLLM and GenAI-client span dialects into request timelines."""

from __future__ import annotations

import math

import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.spanbuild import (
    KIND_CLIENT,
    KIND_INTERNAL,
    KIND_SERVER,
    T0,
    AttrValue,
    ref,
    request_spans,
    sid,
    span,
    trace,
)
from tokentrace.agent import semconv
from tokentrace.processors.model import RequestTimeline, SpanRef
from tokentrace.processors.timeline import normalize

MS = 1_000_000


def only(timelines: list[RequestTimeline]) -> RequestTimeline:
    assert len(timelines) == 1, timelines
    return timelines[0]


# --- tokentrace dialect ---------------------------------------------------------------------------
def test_full_request_boundaries_follow_the_phase_spans() -> None:
    spans = request_spans(
        start_ns=T0,
        http_ns=2 * MS,
        queue_ns=7 * MS,
        prefill_ns=30 * MS,
        token_offsets_us=[0, 12_000, 25_000],
        postprocess_ns=MS,
        http_tail_ns=3 * MS,
        request_attrs={
            semconv.REQUEST_ID: "req-7",
            semconv.GEN_AI_USAGE_INPUT_TOKENS: 300,
            semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 40,
            semconv.GEN_AI_RESPONSE_FINISH_REASONS: ["length", "stop"],
            semconv.QUEUE_REQUESTS_AHEAD: 37,
            semconv.QUEUE_RUNNING_AT_ARRIVAL: 256,
            semconv.QUEUE_MAX_RUNNING: 256,
            semconv.PROMPT_PREFIX_HASH: "9f2c",
        },
    )
    timeline = only(normalize(trace(*spans, service="vllm-a")))

    arrival = T0 + 2 * MS
    first_scheduled = arrival + 7 * MS
    first_token = first_scheduled + 30 * MS
    last_token = first_token + 25 * MS
    end = last_token + MS
    assert timeline.dialect == "tokentrace"
    assert timeline.span_id == spans[1].span_id  # the llm.request span, not the HTTP span
    assert timeline.trace_id == spans[1].trace_id
    assert timeline.service == "vllm-a"
    assert (timeline.model, timeline.operation) == ("test-model", "text_completion")
    assert timeline.server_start == T0
    assert timeline.server_end == end + 3 * MS
    assert timeline.engine_arrival == arrival
    assert timeline.first_scheduled == first_scheduled
    assert timeline.first_token == first_token
    assert timeline.last_token == last_token
    assert timeline.end == end
    assert list(timeline.token_offsets_us) == [0, 12_000, 25_000]
    assert timeline.token_offsets_dropped == 0
    assert timeline.prefill_chunks == [(first_scheduled, first_token, 260)]  # 300 - 40 cached
    assert (timeline.input_tokens, timeline.output_tokens, timeline.cached_tokens) == (300, 3, 40)
    assert timeline.finish_reason == "length"
    assert timeline.request_id == "req-7"
    assert (timeline.requests_ahead, timeline.running_at_arrival, timeline.max_running) == (
        37,
        256,
        256,
    )
    assert timeline.prefix_hash == "9f2c"
    assert timeline.status_error is None
    assert timeline.client_start is None and timeline.client_end is None


def test_without_a_server_span_the_request_span_is_the_server_view() -> None:
    spans = request_spans(http_ns=None)
    timeline = only(normalize(trace(*spans)))
    assert timeline.server_start == timeline.engine_arrival == spans[0].start_time_unix_nano
    assert timeline.server_end == timeline.end == spans[0].end_time_unix_nano


def test_engine_arrival_is_the_queue_span_start_after_the_hand_off() -> None:
    # The engine queued the request 3 ms after llm.request began (tokenised, handed off).
    spans = request_spans(http_ns=None, queue_ns=8 * MS)
    request, queue = spans[0], spans[1]
    assert queue.name == semconv.SPAN_QUEUE
    queue.start_time_unix_nano += 3 * MS
    timeline = only(normalize(trace(*spans)))
    assert timeline.engine_arrival == request.start_time_unix_nano + 3 * MS
    assert timeline.first_scheduled == queue.end_time_unix_nano
    # No HTTP server span: the server view is the request span, from its own start.
    assert timeline.server_start == request.start_time_unix_nano
    assert timeline.server_end == timeline.end == request.end_time_unix_nano


def test_with_a_server_span_engine_arrival_is_still_the_queue_start() -> None:
    spans = request_spans(start_ns=T0, http_ns=2 * MS)
    http, queue = spans[0], spans[2]
    assert queue.name == semconv.SPAN_QUEUE
    queue.start_time_unix_nano += MS
    timeline = only(normalize(trace(*spans)))
    assert timeline.server_start == http.start_time_unix_nano == T0
    assert timeline.engine_arrival == T0 + 3 * MS


def test_model_falls_back_to_response_model_then_unknown() -> None:
    response_only = request_spans(
        request_attrs={semconv.GEN_AI_REQUEST_MODEL: 5, semconv.GEN_AI_RESPONSE_MODEL: "resp"}
    )
    assert only(normalize(trace(*response_only))).model == "resp"

    request = span(semconv.SPAN_REQUEST, T0, T0 + MS, span_id=sid(1))
    timeline = only(normalize(trace(request)))
    assert (timeline.model, timeline.operation) == ("unknown", "unknown")


def test_cold_start_ready_time_is_read() -> None:
    spans = request_spans(request_attrs={semconv.COLD_START_READY_TIME: T0 + 4 * MS})
    assert only(normalize(trace(*spans))).ready == T0 + 4 * MS


@pytest.mark.parametrize(
    ("message", "expected"), [("CUDA out of memory", "CUDA out of memory"), ("", "error")]
)
def test_error_status_becomes_status_error(message: str, expected: str) -> None:
    request = span(semconv.SPAN_REQUEST, T0, T0 + MS, span_id=sid(1), error=message)
    assert only(normalize(trace(request))).status_error == expected


def test_chunked_prefill_lists_chunks_in_time_order() -> None:
    request = span(semconv.SPAN_REQUEST, T0, T0 + 100 * MS, span_id=sid(1))
    prefill = span(
        semconv.SPAN_PREFILL, T0 + 10 * MS, T0 + 40 * MS, span_id=sid(2), parent_span_id=sid(1)
    )
    chunk_b = span(
        semconv.SPAN_PREFILL_CHUNK,
        T0 + 25 * MS,
        T0 + 40 * MS,
        span_id=sid(4),
        parent_span_id=sid(2),
        attrs={semconv.PREFILL_CHUNK_TOKENS: 512},
    )
    chunk_a = span(
        semconv.SPAN_PREFILL_CHUNK,
        T0 + 10 * MS,
        T0 + 25 * MS,
        span_id=sid(3),
        parent_span_id=sid(2),
        attrs={semconv.PREFILL_CHUNK_TOKENS: 2048},
    )
    timeline = only(normalize(trace(request, prefill, chunk_b, chunk_a)))
    assert timeline.prefill_chunks == [
        (T0 + 10 * MS, T0 + 25 * MS, 2048),
        (T0 + 25 * MS, T0 + 40 * MS, 512),
    ]
    # Without a queue span, the prefill start is when the request was first scheduled.
    assert timeline.first_scheduled == T0 + 10 * MS
    assert timeline.first_token == T0 + 40 * MS


def test_unchunked_prefill_uses_its_own_token_count() -> None:
    request = span(semconv.SPAN_REQUEST, T0, T0 + 100 * MS, span_id=sid(1))
    prefill = span(
        semconv.SPAN_PREFILL,
        T0 + MS,
        T0 + 9 * MS,
        span_id=sid(2),
        parent_span_id=sid(1),
        attrs={semconv.PREFILL_CHUNK_TOKENS: 77},
    )
    assert only(normalize(trace(request, prefill))).prefill_chunks == [(T0 + MS, T0 + 9 * MS, 77)]


def test_decode_details_and_preemptions() -> None:
    spans = request_spans(
        token_offsets_us=[0, 5, 9],
        decode_attrs={
            semconv.DECODE_TOKEN_OFFSETS_DROPPED: 120,
            semconv.GPU_MEMORY_BANDWIDTH_PEAK_RATIO: 0.91,
            semconv.DECODE_OUTLIER_STEPS_WITH_PREFILL: 4,
        },
    )
    request_id = spans[1].span_id
    later = span(
        semconv.SPAN_PREEMPTED,
        T0 + 90 * MS,
        T0 + 95 * MS,
        span_id=sid(20),
        parent_span_id=request_id,
    )
    earlier = span(
        semconv.SPAN_PREEMPTED,
        T0 + 30 * MS,
        T0 + 32 * MS,
        span_id=sid(21),
        parent_span_id=request_id,
    )
    timeline = only(normalize(trace(*spans, later, earlier)))
    assert list(timeline.token_offsets_us) == [0, 5, 9]
    assert timeline.token_offsets_dropped == 120
    assert timeline.decode_bandwidth_peak_ratio == pytest.approx(0.91)
    assert timeline.outlier_steps_with_prefill == 4
    assert timeline.preempted == [(T0 + 30 * MS, T0 + 32 * MS), (T0 + 90 * MS, T0 + 95 * MS)]


def test_engine_steps_under_the_request_count_the_outlier_steps_that_carried_prefill() -> None:
    spans = request_spans(token_offsets_us=[0, 5, 90])
    request_id = spans[1].span_id

    def step(number: int, prefill_tokens: int) -> Span:
        return span(
            semconv.SPAN_ENGINE_STEP,
            T0 + (60 + number) * MS,
            T0 + (61 + number) * MS,
            span_id=sid(30 + number),
            parent_span_id=request_id,
            attrs={semconv.ENGINE_STEP_PREFILL_TOKENS: prefill_tokens},
        )

    timeline = only(normalize(trace(*spans, step(0, 0), step(1, 512), step(2, 64))))
    assert timeline.outlier_steps_with_prefill == 2
    # No steps exported: unknown, not zero.
    assert only(normalize(trace(*request_spans()))).outlier_steps_with_prefill is None
    # The agent's own count on llm.decode wins.
    counted = request_spans(decode_attrs={semconv.DECODE_OUTLIER_STEPS_WITH_PREFILL: 7})
    step_under = span(
        semconv.SPAN_ENGINE_STEP, T0, T0 + MS, span_id=sid(40), parent_span_id=counted[1].span_id
    )
    assert only(normalize(trace(*counted, step_under))).outlier_steps_with_prefill == 7


def test_first_token_from_decode_start_without_prefill_span() -> None:
    request = span(semconv.SPAN_REQUEST, T0, T0 + 50 * MS, span_id=sid(1))
    decode = span(
        semconv.SPAN_DECODE, T0 + 20 * MS, T0 + 45 * MS, span_id=sid(2), parent_span_id=sid(1)
    )
    timeline = only(normalize(trace(request, decode)))
    assert (timeline.first_token, timeline.last_token) == (T0 + 20 * MS, T0 + 45 * MS)
    assert timeline.first_scheduled is None
    assert timeline.prefill_chunks == []


@pytest.mark.parametrize(("output_tokens", "last_is_first"), [(1, True), (2, False)])
def test_single_token_request_has_last_token_equal_first(
    output_tokens: int, last_is_first: bool
) -> None:
    request = span(
        semconv.SPAN_REQUEST,
        T0,
        T0 + 50 * MS,
        span_id=sid(1),
        attrs={semconv.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens},
    )
    prefill = span(
        semconv.SPAN_PREFILL, T0 + 5 * MS, T0 + 30 * MS, span_id=sid(2), parent_span_id=sid(1)
    )
    timeline = only(normalize(trace(request, prefill)))
    assert timeline.first_token == T0 + 30 * MS
    assert (timeline.last_token == T0 + 30 * MS) is last_is_first
    if not last_is_first:
        assert timeline.last_token is None


def test_client_span_above_the_server_span_gives_the_client_view() -> None:
    spans = request_spans(http_ns=MS, request_attrs={semconv.GEN_AI_REQUEST_MODEL: ""})
    # A client on another host: its clock is a minute off, which must not matter.
    client_start = T0 - 60_000 * MS
    client = span(
        semconv.SPAN_CLIENT_REQUEST,
        client_start,
        client_start + 500 * MS,
        span_id=sid(50),
        kind=KIND_CLIENT,
        attrs={
            semconv.CLIENT_FIRST_TOKEN_TIME: client_start + 40 * MS,
            semconv.GEN_AI_REQUEST_MODEL: "client-model",
        },
    )
    spans[0].parent_span_id = sid(50)
    timelines = normalize(trace(client, *spans))
    timeline = only(timelines)  # no extra client-only timeline: a server request is beneath
    assert timeline.dialect == "tokentrace"
    assert (timeline.client_start, timeline.client_end) == (client_start, client_start + 500 * MS)
    assert timeline.client_first_token == client_start + 40 * MS
    assert timeline.model == "client-model"  # the request span had no usable model


def test_nearest_server_and_client_ancestors_are_used() -> None:
    # user CLIENT -> gateway SERVER -> gateway CLIENT -> inference SERVER -> INTERNAL -> request
    user = span("user", T0, T0 + 100 * MS, span_id=sid(1), kind=KIND_CLIENT)
    gateway_server = span(
        "gw", T0 + MS, T0 + 99 * MS, span_id=sid(2), parent_span_id=sid(1), kind=KIND_SERVER
    )
    gateway_client = span(
        "gw-out", T0 + 2 * MS, T0 + 98 * MS, span_id=sid(3), parent_span_id=sid(2), kind=KIND_CLIENT
    )
    server = span(
        "POST", T0 + 3 * MS, T0 + 97 * MS, span_id=sid(4), parent_span_id=sid(3), kind=KIND_SERVER
    )
    handler = span("handler", T0 + 4 * MS, T0 + 96 * MS, span_id=sid(5), parent_span_id=sid(4))
    request = span(
        semconv.SPAN_REQUEST, T0 + 5 * MS, T0 + 95 * MS, span_id=sid(6), parent_span_id=sid(5)
    )
    timeline = only(
        normalize(trace(user, gateway_server, gateway_client, server, handler, request))
    )
    assert (timeline.server_start, timeline.server_end) == (T0 + 3 * MS, T0 + 97 * MS)
    assert (timeline.client_start, timeline.client_end) == (T0 + 2 * MS, T0 + 98 * MS)


def test_request_under_a_client_without_server_span_keeps_its_own_server_view() -> None:
    # The SERVER span beyond the nearest CLIENT belongs to another service: it must not be used.
    gateway_server = span("gw", T0, T0 + 99 * MS, span_id=sid(1), kind=KIND_SERVER)
    client = span(
        "out", T0 + MS, T0 + 98 * MS, span_id=sid(2), parent_span_id=sid(1), kind=KIND_CLIENT
    )
    request = span(
        semconv.SPAN_REQUEST, T0 + 5 * MS, T0 + 95 * MS, span_id=sid(3), parent_span_id=sid(2)
    )
    timeline = only(normalize(trace(gateway_server, client, request)))
    assert (timeline.server_start, timeline.server_end) == (T0 + 5 * MS, T0 + 95 * MS)
    assert (timeline.client_start, timeline.client_end) == (T0 + MS, T0 + 98 * MS)


def test_several_requests_in_one_trace() -> None:
    first = request_spans(first_span_id=1, request_attrs={semconv.REQUEST_ID: "a"})
    second = request_spans(
        first_span_id=11, start_ns=T0 + 7 * MS, request_attrs={semconv.REQUEST_ID: "b"}
    )
    timelines = normalize(trace(*first, *second))
    assert sorted(t.request_id or "" for t in timelines) == ["a", "b"]
    assert {t.span_id for t in timelines} == {first[1].span_id, second[1].span_id}


def test_unrelated_spans_produce_nothing() -> None:
    assert (
        normalize(trace(span("GET /health", T0, T0 + MS, span_id=sid(1), kind=KIND_SERVER))) == []
    )
    assert normalize(trace()) == []
    # A CLIENT span without GenAI attributes (e.g. a database call) is no request either.
    assert normalize(trace(span("SELECT", T0, T0 + MS, span_id=sid(1), kind=KIND_CLIENT))) == []


# --- vLLM's built-in span -------------------------------------------------------------------------
def vllm_span(
    overrides: dict[str, AttrValue] | None = None, *, kind: Span.SpanKind.ValueType = KIND_SERVER
) -> SpanRef:
    """vLLM's span from T0 to T0 + 1 s (ttft 250 ms, queue 50, prefill 150, decode 700)."""
    attrs: dict[str, AttrValue] = {
        semconv.VLLM_LATENCY_TTFT: 0.25,
        semconv.VLLM_LATENCY_E2E: 1.0,
        semconv.VLLM_LATENCY_QUEUE: 0.05,
        semconv.VLLM_LATENCY_PREFILL: 0.15,
        semconv.VLLM_LATENCY_DECODE: 0.7,
        semconv.VLLM_USAGE_PROMPT_TOKENS: 64,
        semconv.VLLM_USAGE_COMPLETION_TOKENS: 32,
        semconv.VLLM_REQUEST_ID: "cmpl-abc-0",
    }
    attrs.update(overrides or {})
    return ref(
        span(
            semconv.VLLM_SPAN_REQUEST,
            T0,
            T0 + 1000 * MS,
            span_id=sid(9),
            parent_span_id=sid(8),
            kind=kind,
            attrs=attrs,
        ),
        service="vllm",
        scope=semconv.VLLM_TRACING_SCOPE,
    )


def test_vllm_span_boundaries_are_reconstructed_from_latencies() -> None:
    timeline = only(normalize(trace(vllm_span())))
    assert timeline.dialect == "vllm"
    assert timeline.service == "vllm"
    assert (timeline.model, timeline.operation) == ("unknown", "unknown")
    assert timeline.server_start == T0
    assert timeline.first_token == T0 + 250 * MS
    assert timeline.first_scheduled == T0 + 100 * MS  # first token - prefill
    assert timeline.engine_arrival == T0 + 50 * MS  # first scheduled - queue
    assert timeline.last_token == T0 + 950 * MS  # first token + decode
    assert timeline.end == timeline.server_end == T0 + 1000 * MS
    assert (timeline.input_tokens, timeline.output_tokens) == (64, 32)
    assert timeline.request_id == "cmpl-abc-0"


def test_vllm_reconstruction_is_clamped_into_the_span() -> None:
    item = vllm_span({semconv.VLLM_LATENCY_TTFT: 3.0, semconv.VLLM_LATENCY_QUEUE: 9.0})
    timeline = only(normalize(trace(item)))
    assert timeline.first_token == T0 + 1000 * MS
    assert timeline.first_scheduled == T0 + 850 * MS
    assert timeline.engine_arrival == T0
    assert timeline.last_token == T0 + 1000 * MS


def test_vllm_internal_span_takes_server_view_from_its_server_parent() -> None:
    parent = span("POST", T0 - 5 * MS, T0 + 1002 * MS, span_id=sid(8), kind=KIND_SERVER)
    timeline = only(normalize(trace(parent, vllm_span(kind=KIND_INTERNAL))))
    assert (timeline.server_start, timeline.server_end) == (T0 - 5 * MS, T0 + 1002 * MS)
    assert timeline.engine_arrival == T0 + 50 * MS


def test_vllm_model_and_operation_when_present_and_malformed_latencies_skipped() -> None:
    item = vllm_span(
        {
            semconv.GEN_AI_RESPONSE_MODEL: "llama",
            semconv.GEN_AI_OPERATION_NAME: "chat",
            semconv.VLLM_LATENCY_PREFILL: -0.1,
            semconv.VLLM_LATENCY_DECODE: "fast",
        }
    )
    timeline = only(normalize(trace(item)))
    assert (timeline.model, timeline.operation) == ("llama", "chat")
    assert timeline.first_token == T0 + 250 * MS
    assert timeline.first_scheduled is None
    assert timeline.last_token is None


def test_vllm_span_under_a_client_span() -> None:
    client = span(
        "chat llama",
        T0 - 10 * MS,
        T0 + 1010 * MS,
        span_id=sid(8),
        kind=KIND_CLIENT,
        attrs={semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_REQUEST_MODEL: "llama"},
    )
    timelines = normalize(trace(client, vllm_span()))
    timeline = only(timelines)
    assert timeline.dialect == "vllm"
    assert (timeline.client_start, timeline.client_end) == (T0 - 10 * MS, T0 + 1010 * MS)
    assert timeline.model == "llama"


def test_span_named_like_vllm_without_its_scope_or_attributes_is_ignored() -> None:
    assert normalize(trace(span(semconv.VLLM_SPAN_REQUEST, T0, T0 + MS, span_id=sid(1)))) == []


def test_tokentrace_spans_win_over_vllm_span_of_the_same_request() -> None:
    spans = request_spans(request_attrs={semconv.REQUEST_ID: "cmpl-abc-0"})
    vllm = vllm_span()
    vllm.span.parent_span_id = b""
    timeline = only(normalize(trace(*spans, vllm)))
    assert timeline.dialect == "tokentrace"


# --- GenAI client-only ----------------------------------------------------------------------------
def genai_client(
    span_id: int, parent: int = 0, *, attrs: dict[str, AttrValue] | None = None
) -> Span:
    base: dict[str, AttrValue] = {
        semconv.GEN_AI_OPERATION_NAME: "chat",
        semconv.GEN_AI_REQUEST_MODEL: "gpt-x",
        semconv.GEN_AI_USAGE_INPUT_TOKENS: 11,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 22,
        semconv.GEN_AI_RESPONSE_ID: "chatcmpl-1",
        semconv.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"],
    }
    base.update(attrs or {})
    return span(
        "chat gpt-x",
        T0 + span_id * MS,
        T0 + 300 * MS - span_id * MS,
        span_id=sid(span_id),
        parent_span_id=sid(parent),
        kind=KIND_CLIENT,
        attrs=base,
    )


def test_genai_client_span_alone_is_a_client_only_timeline() -> None:
    item = genai_client(1, attrs={semconv.CLIENT_FIRST_TOKEN_TIME: T0 + 50 * MS})
    timeline = only(normalize(trace(item, service="app")))
    assert timeline.dialect == "genai_client"
    assert timeline.service == "app"
    assert (timeline.model, timeline.operation) == ("gpt-x", "chat")
    assert (timeline.client_start, timeline.client_end) == (T0 + MS, T0 + 299 * MS)
    assert timeline.client_first_token == T0 + 50 * MS
    assert (timeline.input_tokens, timeline.output_tokens) == (11, 22)
    assert timeline.request_id == "chatcmpl-1"
    assert timeline.finish_reason == "stop"
    assert timeline.server_start is None and timeline.engine_arrival is None


def test_nested_genai_client_spans_count_once_innermost() -> None:
    outer = genai_client(1)
    inner = genai_client(2, parent=1)
    timeline = only(normalize(trace(outer, inner)))
    assert timeline.span_id == sid(2)


def test_two_sibling_genai_calls_are_two_requests() -> None:
    timelines = normalize(trace(genai_client(1), genai_client(2)))
    assert sorted(t.span_id for t in timelines) == [sid(1), sid(2)]


# --- malformed input ------------------------------------------------------------------------------
def test_wrong_attribute_types_are_skipped() -> None:
    spans = request_spans(
        token_offsets_us=[0, 10, 20],
        request_attrs={
            semconv.GEN_AI_USAGE_INPUT_TOKENS: "many",
            semconv.GEN_AI_USAGE_OUTPUT_TOKENS: -3,
            semconv.GEN_AI_RESPONSE_FINISH_REASONS: [7],
            semconv.REQUEST_ID: 12,
            semconv.QUEUE_REQUESTS_AHEAD: 2.5,
            semconv.COLD_START_READY_TIME: "soon",
        },
        decode_attrs={
            semconv.DECODE_TOKEN_OFFSETS_DROPPED: "x",
            semconv.GPU_MEMORY_BANDWIDTH_PEAK_RATIO: math.nan,
        },
    )
    timeline = only(normalize(trace(*spans)))
    assert timeline.input_tokens is None
    assert timeline.output_tokens is None
    assert timeline.finish_reason is None
    assert timeline.request_id is None
    assert timeline.requests_ahead is None
    assert timeline.ready is None
    assert timeline.token_offsets_dropped == 0
    assert timeline.decode_bandwidth_peak_ratio is None
    assert list(timeline.token_offsets_us) == [0, 10, 20]


def test_non_integer_token_offsets_are_dropped_but_genuine_zeros_kept() -> None:
    spans = request_spans(token_offsets_us=[0, 0, 15])
    decode = spans[4]
    offsets = next(kv for kv in decode.attributes if kv.key == semconv.DECODE_TOKEN_OFFSETS)
    offsets.value.array_value.values.add(string_value="junk")
    offsets.value.array_value.values.add(int_value=30)
    assert list(only(normalize(trace(*spans))).token_offsets_us) == [0, 0, 15, 30]


def _decode_offsets(spans: list[Span]) -> AnyValue:
    decode = next(s for s in spans if s.name == semconv.SPAN_DECODE)
    return next(kv for kv in decode.attributes if kv.key == semconv.DECODE_TOKEN_OFFSETS).value


def test_integer_token_offsets_are_read_exactly_at_every_varint_width() -> None:
    offsets = [0, 1, 127, 128, 16_383, 16_384, 2**31, 2**53 + 1, 2**63 - 1, -1, -(2**63), 0]
    spans = request_spans(token_offsets_us=offsets)
    assert list(only(normalize(trace(*spans))).token_offsets_us) == offsets


_ODD_ELEMENTS: dict[str, bytes] = {
    "unset": b"",
    "string": AnyValue(string_value="x").SerializeToString(),
    "string of int-like bytes": AnyValue(string_value="\x18\x05").SerializeToString(),
    "double": AnyValue(double_value=3.0).SerializeToString(),
    "bool": AnyValue(bool_value=True).SerializeToString(),
    "array": AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=7)])).SerializeToString(),
    "int with an unknown varint field": bytes([0x18, 0x05, 0x28, 0x18]),
    "int with an unknown length-delimited field": bytes([0x18, 0x05, 0x4A, 0x02, 0x18, 0x09]),
}


@pytest.mark.parametrize("position", [0, 1, 3])
@pytest.mark.parametrize("odd", sorted(_ODD_ELEMENTS))
def test_token_offsets_keep_exactly_the_int_elements(odd: str, position: int) -> None:
    spans = request_spans(token_offsets_us=[0, 10, 25])
    values = _decode_offsets(spans).array_value.values
    element = AnyValue.FromString(_ODD_ELEMENTS[odd])
    rebuilt = [AnyValue(int_value=v.int_value) for v in values]
    rebuilt.insert(position, element)
    del values[:]
    values.extend(rebuilt)
    expected = [v.int_value for v in rebuilt if v.WhichOneof("value") == "int_value"]
    assert list(only(normalize(trace(*spans))).token_offsets_us) == expected


def test_phase_span_with_negative_duration_is_ignored() -> None:
    request = span(semconv.SPAN_REQUEST, T0, T0 + 50 * MS, span_id=sid(1))
    broken_queue = span(
        semconv.SPAN_QUEUE, T0 + 9 * MS, T0 + 2 * MS, span_id=sid(2), parent_span_id=sid(1)
    )
    prefill = span(
        semconv.SPAN_PREFILL, T0 + 10 * MS, T0 + 20 * MS, span_id=sid(3), parent_span_id=sid(1)
    )
    timeline = only(normalize(trace(request, broken_queue, prefill)))
    assert timeline.first_scheduled == T0 + 10 * MS


def test_parent_cycle_terminates() -> None:
    a = span("a", T0, T0 + MS, span_id=sid(1), parent_span_id=sid(2), kind=KIND_CLIENT)
    b = span("b", T0, T0 + MS, span_id=sid(2), parent_span_id=sid(1))
    request = span(semconv.SPAN_REQUEST, T0, T0 + MS, span_id=sid(3), parent_span_id=sid(2))
    timeline = only(normalize(trace(a, b, request)))
    assert timeline.client_start == T0


def test_request_span_with_zero_timestamps_does_not_raise() -> None:
    request = span(semconv.SPAN_REQUEST, 0, 0, span_id=sid(1))
    timeline = only(normalize(trace(request)))
    assert timeline.engine_arrival is None and timeline.server_start is None


def test_a_request_that_fails_to_read_is_left_out_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokentrace.processors import timeline as timeline_module

    real = timeline_module._apply_decode_attributes
    calls: list[int] = []

    def fail_first(timeline: RequestTimeline, index: object, decode: Span) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("unexpected")
        real(timeline, index, decode)  # type: ignore[arg-type]

    monkeypatch.setattr(timeline_module, "_apply_decode_attributes", fail_first)
    first = request_spans(first_span_id=1)
    second = request_spans(first_span_id=11)
    assert len(normalize(trace(*first, *second))) == 1


def test_garbage_instead_of_a_span_does_not_raise() -> None:
    broken = SpanRef(span=None, resource=None, scope=None, service="x")
    assert normalize(trace(broken, trace_id=b"t")) == []
