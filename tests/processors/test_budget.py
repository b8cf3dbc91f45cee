"""The latency budget: exact partition of E2E, TTFT budget, metric values, prompt buckets."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.spanbuild import KIND_CLIENT, KIND_SERVER, T0, ref, request_spans, sid, span, trace
from tokentrace.agent import semconv
from tokentrace.processors.budget import (
    PROMPT_BUCKET_BOUNDS,
    PROMPT_BUCKETS,
    compute_budget,
    compute_metrics,
    prompt_bucket,
)
from tokentrace.processors.model import Budget, RequestTimeline
from tokentrace.processors.timeline import normalize

MS = 1_000_000
US = 1_000


def make_timeline(**fields: object) -> RequestTimeline:
    timeline = RequestTimeline(
        trace_id=b"t", span_id=b"s", dialect="tokentrace", service="svc", model="m", operation="o"
    )
    for name, value in fields.items():
        setattr(timeline, name, value)
    return timeline


def typical(**overrides: object) -> RequestTimeline:
    """server 0..100 ms: arrival 2, first scheduled 10, first token 40, last token 97, end 99."""
    fields: dict[str, object] = {
        "server_start": T0,
        "engine_arrival": T0 + 2 * MS,
        "first_scheduled": T0 + 10 * MS,
        "first_token": T0 + 40 * MS,
        "last_token": T0 + 97 * MS,
        "end": T0 + 99 * MS,
        "server_end": T0 + 100 * MS,
        "output_tokens": 20,
    }
    fields.update(overrides)
    return make_timeline(**fields)


def assert_partition(budget: Budget) -> None:
    assert set(budget.segments) == set(semconv.SEGMENTS)
    assert all(value >= 0 for value in budget.segments.values()), budget
    assert sum(budget.segments.values()) == budget.e2e_ns
    if budget.ttft_ns is None:
        assert budget.ttft_segments == {}
    else:
        assert all(value >= 0 for value in budget.ttft_segments.values()), budget
        assert sum(budget.ttft_segments.values()) == budget.ttft_ns


# --- example requests with hand-computed values ---------------------------------------------------
def test_typical_request_segments() -> None:
    budget = compute_budget(typical())
    assert_partition(budget)
    assert budget.e2e_ns == 100 * MS
    assert budget.segments == {
        semconv.SEGMENT_CLIENT: 0,
        semconv.SEGMENT_CONNECT: 0,
        semconv.SEGMENT_NETWORK: 0,
        semconv.SEGMENT_HTTP: 2 * MS,
        semconv.SEGMENT_COLD_START: 0,
        semconv.SEGMENT_QUEUE: 8 * MS,
        semconv.SEGMENT_PREFILL: 30 * MS,
        semconv.SEGMENT_PREEMPTED: 0,
        semconv.SEGMENT_DECODE: 57 * MS,
        semconv.SEGMENT_POSTPROCESS: 3 * MS,  # last token 97 -> server end 100
        semconv.SEGMENT_UNATTRIBUTED: 0,
    }
    assert budget.ttft_ns == 40 * MS
    assert budget.ttft_segments[semconv.SEGMENT_HTTP] == 2 * MS
    assert budget.ttft_segments[semconv.SEGMENT_QUEUE] == 8 * MS
    assert budget.ttft_segments[semconv.SEGMENT_PREFILL] == 30 * MS
    assert budget.ttft_segments[semconv.SEGMENT_DECODE] == 0
    assert not budget.skew_clamped


def test_typical_request_metrics() -> None:
    timeline = typical(token_offsets_us=[0, 3_000, 7_500, 57_000])
    metrics = compute_metrics(timeline, compute_budget(timeline))
    assert metrics.ttft == 40 * MS
    assert metrics.e2e == 100 * MS
    assert metrics.tpot == (100 - 40) * MS // 19
    assert metrics.itl.tolist() == [3 * MS, 4_500 * US, 49_500 * US]
    assert (metrics.queue, metrics.prefill, metrics.decode) == (8 * MS, 30 * MS, 57 * MS)
    assert metrics.network is None
    assert metrics.value(semconv.METRIC_ITL) == 49_500 * US


@pytest.mark.parametrize("output_tokens", [None, 0, 1])
def test_tpot_needs_two_tokens(output_tokens: int | None) -> None:
    timeline = typical(output_tokens=output_tokens)
    assert compute_metrics(timeline, compute_budget(timeline)).tpot is None


def test_no_offsets_means_no_invented_gaps() -> None:
    timeline = typical(token_offsets_us=[])
    metrics = compute_metrics(timeline, compute_budget(timeline))
    assert not metrics.itl
    assert metrics.tpot is not None


def test_negative_offset_gaps_are_skipped() -> None:
    timeline = typical(token_offsets_us=[0, 10, 5, 20])
    assert list(compute_metrics(timeline, compute_budget(timeline)).itl) == [10 * US, 15 * US]


def test_cold_start_until_ready() -> None:
    budget = compute_budget(typical(ready=T0 + 6 * MS))
    assert_partition(budget)
    assert budget.segments[semconv.SEGMENT_COLD_START] == 4 * MS  # arrival 2 -> ready 6
    assert budget.segments[semconv.SEGMENT_QUEUE] == 4 * MS  # ready 6 -> scheduled 10
    assert budget.ttft_segments[semconv.SEGMENT_COLD_START] == 4 * MS


@pytest.mark.parametrize(
    ("ready_ms", "cold_ms", "queue_ms"),
    [(1, 0, 8), (2, 0, 8), (15, 8, 0)],  # before arrival, at arrival, after first scheduled
)
def test_cold_start_bounds(ready_ms: int, cold_ms: int, queue_ms: int) -> None:
    budget = compute_budget(typical(ready=T0 + ready_ms * MS))
    assert budget.segments[semconv.SEGMENT_COLD_START] == cold_ms * MS
    assert budget.segments[semconv.SEGMENT_QUEUE] == queue_ms * MS
    assert not budget.skew_clamped


def test_preemption_moves_time_out_of_prefill_and_decode() -> None:
    timeline = typical(
        preempted=[
            (T0 + 20 * MS, T0 + 25 * MS),  # in prefill: 5
            (T0 + 35 * MS, T0 + 50 * MS),  # straddles first token: 5 prefill + 10 decode
            (T0 + 45 * MS, T0 + 55 * MS),  # overlaps the previous one: +5 decode after merging
            (T0 + 95 * MS, T0 + 120 * MS),  # clipped at last token 97: 2 decode
            (T0 + 98 * MS, T0 + 99 * MS),  # after last token: ignored
            (T0 + 5 * MS, T0 + 4 * MS),  # reversed: ignored
        ]
    )
    budget = compute_budget(timeline)
    assert_partition(budget)
    assert budget.segments[semconv.SEGMENT_PREEMPTED] == (5 + 5 + 10 + 5 + 2) * MS
    assert budget.segments[semconv.SEGMENT_PREFILL] == (30 - 10) * MS
    assert budget.segments[semconv.SEGMENT_DECODE] == (57 - 17) * MS
    assert budget.ttft_segments[semconv.SEGMENT_PREEMPTED] == 10 * MS
    assert budget.ttft_segments[semconv.SEGMENT_PREFILL] == 20 * MS
    assert budget.e2e_ns == 100 * MS


def test_client_span_adds_network_from_durations_only() -> None:
    # The client's clock is an hour behind: only its duration (130 ms) is used.
    client_start = T0 - 3_600_000 * MS
    timeline = typical(client_start=client_start, client_end=client_start + 130 * MS)
    budget = compute_budget(timeline)
    assert_partition(budget)
    assert budget.segments[semconv.SEGMENT_NETWORK] == 30 * MS
    assert budget.e2e_ns == 130 * MS
    assert budget.ttft_ns == 40 * MS  # server TTFT, no network part
    assert budget.ttft_segments[semconv.SEGMENT_NETWORK] == 0
    metrics = compute_metrics(timeline, budget)
    assert metrics.e2e == 100 * MS
    assert metrics.network == 30 * MS


def test_client_shorter_than_server_gives_zero_network() -> None:
    timeline = typical(client_start=T0, client_end=T0 + 90 * MS)
    budget = compute_budget(timeline)
    assert budget.segments[semconv.SEGMENT_NETWORK] == 0
    assert budget.e2e_ns == 100 * MS
    assert compute_metrics(timeline, budget).network == 0


def test_client_only_timeline_is_unattributed() -> None:
    timeline = make_timeline(
        dialect="genai_client",
        client_start=T0,
        client_end=T0 + 700 * MS,
        client_first_token=T0 + 120 * MS,
        output_tokens=59,
    )
    budget = compute_budget(timeline)
    assert_partition(budget)
    assert budget.e2e_ns == 700 * MS
    assert budget.segments[semconv.SEGMENT_UNATTRIBUTED] == 700 * MS
    assert budget.ttft_ns == 120 * MS
    metrics = compute_metrics(timeline, budget)
    assert metrics.e2e == 700 * MS
    assert metrics.tpot == 580 * MS // 58
    assert (metrics.queue, metrics.prefill, metrics.decode, metrics.network) == (None,) * 4


def test_skewed_first_token_is_clamped_and_flagged() -> None:
    # The first token claims to precede scheduling (another process's clock).
    budget = compute_budget(typical(first_token=T0 + 8 * MS))
    assert_partition(budget)
    assert budget.skew_clamped
    assert budget.segments[semconv.SEGMENT_PREFILL] == 0
    assert budget.ttft_ns == 10 * MS  # clamped to first scheduled
    assert budget.segments[semconv.SEGMENT_DECODE] == 87 * MS


def test_server_end_before_start_gives_zero_e2e() -> None:
    budget = compute_budget(typical(server_end=T0 - MS, end=T0 - MS))
    assert_partition(budget)
    assert budget.skew_clamped
    assert budget.e2e_ns == 0


def test_request_aborted_in_queue_keeps_waiting_time_in_queue() -> None:
    timeline = typical(first_scheduled=None, first_token=None, last_token=None)
    budget = compute_budget(timeline)
    assert_partition(budget)
    assert budget.segments[semconv.SEGMENT_QUEUE] == 98 * MS
    assert budget.ttft_ns is None
    metrics = compute_metrics(timeline, budget)
    assert metrics.ttft is None and metrics.tpot is None


def test_no_engine_boundary_is_unattributed() -> None:
    timeline = make_timeline(server_start=T0, server_end=T0 + 50 * MS)
    budget = compute_budget(timeline)
    assert budget.segments[semconv.SEGMENT_UNATTRIBUTED] == 50 * MS
    assert compute_metrics(timeline, budget).queue is None


def test_nothing_known_gives_an_empty_budget() -> None:
    budget = compute_budget(make_timeline())
    assert_partition(budget)
    assert budget.e2e_ns == 0


# --- end to end from spans ------------------------------------------------------------------------
def test_budget_of_a_normalised_tokentrace_request() -> None:
    spans = request_spans(
        http_ns=MS,
        queue_ns=4 * MS,
        prefill_ns=25 * MS,
        token_offsets_us=[0, 10_000, 20_000],
        postprocess_ns=2 * MS,
        http_tail_ns=MS,
    )
    (timeline,) = normalize(trace(*spans))
    budget = compute_budget(timeline)
    expected = {
        semconv.SEGMENT_HTTP: MS,
        semconv.SEGMENT_QUEUE: 4 * MS,
        semconv.SEGMENT_PREFILL: 25 * MS,
        semconv.SEGMENT_DECODE: 20 * MS,
        semconv.SEGMENT_POSTPROCESS: 3 * MS,  # postprocess span + HTTP tail
    }
    assert {k: v for k, v in budget.segments.items() if v} == expected
    assert budget.e2e_ns == sum(expected.values())
    assert budget.ttft_ns == 30 * MS


def test_hand_off_before_the_engine_queue_is_http_not_queue() -> None:
    # llm.request starts at the API server's arrival, llm.queue 3 ms later when the engine
    # queued the request; there is no HTTP server span.
    spans = request_spans(
        http_ns=None,
        queue_ns=10 * MS,
        prefill_ns=25 * MS,
        token_offsets_us=[0, 10_000],
        postprocess_ns=MS,
    )
    request, queue = spans[0], spans[1]
    assert queue.name == semconv.SPAN_QUEUE
    queue.start_time_unix_nano += 3 * MS
    (timeline,) = normalize(trace(*spans))
    budget = compute_budget(timeline)
    assert_partition(budget)
    assert not budget.skew_clamped
    assert budget.segments[semconv.SEGMENT_HTTP] == 3 * MS
    queue_duration = queue.end_time_unix_nano - queue.start_time_unix_nano
    assert budget.segments[semconv.SEGMENT_QUEUE] == queue_duration == 7 * MS
    assert budget.e2e_ns == request.end_time_unix_nano - request.start_time_unix_nano
    # TTFT still counts from the request's arrival, the hand-off included.
    assert budget.ttft_ns == 3 * MS + 7 * MS + 25 * MS
    assert budget.ttft_segments[semconv.SEGMENT_HTTP] == 3 * MS
    assert compute_metrics(timeline, budget).queue == 7 * MS


def test_hand_off_adds_to_http_under_a_server_span() -> None:
    spans = request_spans(http_ns=2 * MS, queue_ns=10 * MS)
    queue = spans[2]
    assert queue.name == semconv.SPAN_QUEUE
    queue.start_time_unix_nano += 3 * MS
    (timeline,) = normalize(trace(*spans))
    budget = compute_budget(timeline)
    assert_partition(budget)
    assert budget.segments[semconv.SEGMENT_HTTP] == 2 * MS + 3 * MS
    assert budget.segments[semconv.SEGMENT_QUEUE] == 7 * MS


def test_a_queue_span_starting_before_its_request_is_clamped_and_flagged() -> None:
    spans = request_spans(http_ns=None, queue_ns=10 * MS)
    queue = spans[1]
    queue.start_time_unix_nano -= MS  # clock skew between the engine and the API server
    (timeline,) = normalize(trace(*spans))
    budget = compute_budget(timeline)
    assert_partition(budget)
    assert budget.skew_clamped
    assert budget.segments[semconv.SEGMENT_HTTP] == 0
    assert budget.segments[semconv.SEGMENT_QUEUE] == 10 * MS


def test_budget_of_a_vllm_span_matches_its_latencies() -> None:
    client = span("client", T0 - 5 * MS, T0 + 1005 * MS, span_id=sid(8), kind=KIND_CLIENT)
    vllm = span(
        semconv.VLLM_SPAN_REQUEST,
        T0,
        T0 + 1000 * MS,
        span_id=sid(9),
        parent_span_id=sid(8),
        kind=KIND_SERVER,
        attrs={
            semconv.VLLM_LATENCY_TTFT: 0.3,
            semconv.VLLM_LATENCY_QUEUE: 0.12,
            semconv.VLLM_LATENCY_PREFILL: 0.15,
            semconv.VLLM_LATENCY_DECODE: 0.6,
            semconv.VLLM_USAGE_COMPLETION_TOKENS: 61,
        },
    )
    (timeline,) = normalize(trace(client, ref(vllm, scope=semconv.VLLM_TRACING_SCOPE)))
    budget = compute_budget(timeline)
    assert_partition(budget)
    assert budget.segments[semconv.SEGMENT_QUEUE] == 120 * MS
    assert budget.segments[semconv.SEGMENT_PREFILL] == 150 * MS
    assert budget.segments[semconv.SEGMENT_DECODE] == 600 * MS
    assert budget.segments[semconv.SEGMENT_HTTP] == 30 * MS  # 300 - 150 - 120
    assert budget.segments[semconv.SEGMENT_POSTPROCESS] == 100 * MS  # 1000 - 300 - 600
    assert budget.segments[semconv.SEGMENT_NETWORK] == 10 * MS
    assert budget.ttft_ns == 300 * MS
    metrics = compute_metrics(timeline, budget)
    assert metrics.tpot == 700 * MS // 60
    assert metrics.network == 10 * MS


# --- prompt buckets -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "label"),
    [
        (0, "0-127"),
        (127, "0-127"),
        (128, "128-511"),
        (511, "128-511"),
        (512, "512-2047"),
        (2047, "512-2047"),
        (2048, "2048-8191"),
        (8191, "2048-8191"),
        (8192, "8192+"),
        (1_000_000, "8192+"),
        (None, "unknown"),
        (-1, "unknown"),
    ],
)
def test_prompt_bucket(tokens: int | None, label: str) -> None:
    assert prompt_bucket(tokens) == label


def test_bucket_labels_agree_with_bounds() -> None:
    assert len(PROMPT_BUCKETS) == len(PROMPT_BUCKET_BOUNDS) + 1
    lows = [0, *PROMPT_BUCKET_BOUNDS]
    for low, label in zip(lows, PROMPT_BUCKETS, strict=True):
        assert prompt_bucket(low) == label
        assert label.startswith(str(low))


# --- properties ----------------------------------------------------------------------------------
SPREAD = 10_000 * MS
maybe_time = st.one_of(st.none(), st.integers(T0 - SPREAD, T0 + SPREAD))
intervals = st.lists(
    st.tuples(st.integers(T0 - SPREAD, T0 + SPREAD), st.integers(T0 - SPREAD, T0 + SPREAD)),
    max_size=6,
)


@st.composite
def arbitrary_timelines(draw: st.DrawFn) -> RequestTimeline:
    """Boundaries in any order, any subset missing, client on an unrelated clock."""
    client_base = draw(st.integers(0, 2 * T0))
    client_start = draw(st.one_of(st.none(), st.just(client_base)))
    return make_timeline(
        server_start=draw(maybe_time),
        engine_arrival=draw(maybe_time),
        ready=draw(maybe_time),
        first_scheduled=draw(maybe_time),
        first_token=draw(maybe_time),
        last_token=draw(maybe_time),
        end=draw(maybe_time),
        server_end=draw(maybe_time),
        preempted=draw(intervals),
        client_start=client_start,
        client_end=draw(
            st.one_of(st.none(), st.integers(client_base - SPREAD, client_base + SPREAD))
        ),
        client_first_token=draw(
            st.one_of(st.none(), st.integers(client_base - SPREAD, client_base + SPREAD))
        ),
        output_tokens=draw(st.one_of(st.none(), st.integers(0, 5000))),
        token_offsets_us=draw(st.lists(st.integers(0, 10**7), max_size=8)),
    )


@given(arbitrary_timelines())
def test_segments_always_partition_e2e(timeline: RequestTimeline) -> None:
    budget = compute_budget(timeline)
    assert_partition(budget)
    metrics = compute_metrics(timeline, budget)
    assert 0 <= metrics.e2e <= budget.e2e_ns
    if metrics.ttft is not None:
        assert 0 <= metrics.ttft <= metrics.e2e
    assert metrics.tpot is None or metrics.tpot >= 0
    assert all(gap >= 0 for gap in metrics.itl)


@st.composite
def ordered_timelines(draw: st.DrawFn) -> tuple[RequestTimeline, list[int]]:
    """Boundaries in time order (no skew), all present."""
    gaps = draw(st.lists(st.integers(0, 10**9), min_size=6, max_size=6))
    points = [T0]
    for gap in gaps:
        points.append(points[-1] + gap)
    timeline = make_timeline(
        server_start=points[0],
        engine_arrival=points[1],
        first_scheduled=points[2],
        first_token=points[3],
        last_token=points[4],
        end=points[5],
        server_end=points[6],
        preempted=draw(intervals),
    )
    return timeline, points


@given(ordered_timelines())
@settings(max_examples=200)
def test_ordered_boundaries_give_exact_differences(case: tuple[RequestTimeline, list[int]]) -> None:
    timeline, points = case
    budget = compute_budget(timeline)
    assert_partition(budget)
    assert not budget.skew_clamped
    segments = budget.segments
    assert budget.e2e_ns == points[6] - points[0]
    assert segments[semconv.SEGMENT_HTTP] == points[1] - points[0]
    assert segments[semconv.SEGMENT_QUEUE] == points[2] - points[1]
    assert (
        segments[semconv.SEGMENT_PREFILL]
        + segments[semconv.SEGMENT_DECODE]
        + segments[semconv.SEGMENT_PREEMPTED]
        == points[4] - points[2]
    )
    assert segments[semconv.SEGMENT_POSTPROCESS] == points[6] - points[4]
    assert budget.ttft_ns == points[3] - points[0]
    assert segments[semconv.SEGMENT_PREEMPTED] == union_length(
        timeline.preempted, points[2], points[4]
    )


def union_length(spans: list[tuple[int, int]], low: int, high: int) -> int:
    """Length of the union of ``spans`` inside [low, high], by coordinate compression."""
    cuts = sorted({low, high, *(min(max(p, low), high) for pair in spans for p in pair)})
    return sum(
        right - left
        for left, right in pairwise(cuts)
        if any(start <= left and right <= end for start, end in spans)
    )
