"""Diagnosis: one table case per cause, rule boundaries, sentence content, window verdicts."""

from __future__ import annotations

import math
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.spanbuild import KIND_SERVER, T0, AttrValue, ref, sid, span, trace
from tokentrace.agent import semconv
from tokentrace.processors.budget import compute_budget, compute_metrics
from tokentrace.processors.diagnosis import (
    ADVICE,
    CAUSE_BANDWIDTH_BOUND_DECODE,
    CAUSE_BATCHING_INTERFERENCE,
    CAUSE_COLD_START,
    CAUSE_ERROR,
    CAUSE_HTTP,
    CAUSE_KV_CACHE_PRESSURE,
    CAUSE_LONG_DECODE,
    CAUSE_LONG_PROMPT,
    CAUSE_NETWORK,
    CAUSE_POSTPROCESS,
    CAUSE_PREFILL,
    CAUSE_PREFIX_CACHE_MISS,
    CAUSE_QUEUEING,
    CAUSE_UNATTRIBUTED,
    CAUSES,
    DiagnosisConfig,
    diagnose_request,
    diagnose_window,
    format_duration,
)
from tokentrace.processors.model import (
    Budget,
    RequestMetrics,
    RequestRecord,
    RequestTimeline,
)
from tokentrace.processors.timeline import DIALECT_GENAI_CLIENT, DIALECT_VLLM, normalize

MS = 1_000_000
S = 1_000_000_000
_PRE_FIRST_TOKEN = (
    semconv.SEGMENT_NETWORK,
    semconv.SEGMENT_HTTP,
    semconv.SEGMENT_COLD_START,
    semconv.SEGMENT_QUEUE,
    semconv.SEGMENT_PREFILL,
)
_UNIFORM_ITL = [10 * MS] * 100
_SPIKY_ITL = [10 * MS] * 97 + [120 * MS] * 3
"""p50 10 ms, p99 (nearest rank, 99th of 100) 120 ms: 12x."""


def make_record(
    segments: dict[str, int],
    *,
    ttft_ns: int | None = None,
    ttft_segments: dict[str, int] | None = None,
    itl: list[int] | None = None,
    tpot: int | None = None,
    arrival: int = 1_700_000_000 * S,
    client_only: bool = False,
    **timeline_fields: Any,
) -> RequestRecord:
    """A record whose budget is ``segments``; TTFT defaults to the pre-first-token segments.

    ``client_only``: the timeline has only a client span (from ``arrival``), no server view."""
    e2e = sum(segments.values())
    if ttft_segments is None:
        ttft_segments = {k: v for k, v in segments.items() if k in _PRE_FIRST_TOKEN}
    if ttft_ns is None:
        ttft_ns = sum(ttft_segments.values())
    timeline = RequestTimeline(
        trace_id=b"\x01" * 16,
        span_id=b"\x02" * 8,
        dialect=timeline_fields.pop("dialect", "tokentrace"),
        service="vllm-chat",
        model="llama-3-8b",
        operation=semconv.OPERATION_CHAT,
        **timeline_fields,
    )
    if client_only:
        timeline.client_start, timeline.client_end = arrival, arrival + e2e
    else:
        timeline.arrival, timeline.end = arrival, arrival + e2e
    budget = Budget(e2e_ns=e2e, segments=segments, ttft_ns=ttft_ns, ttft_segments=ttft_segments)
    metrics = RequestMetrics(
        ttft=ttft_ns,
        tpot=tpot,
        e2e=e2e,
        queue=segments.get(semconv.SEGMENT_QUEUE),
        prefill=segments.get(semconv.SEGMENT_PREFILL),
        decode=segments.get(semconv.SEGMENT_DECODE),
        network=segments.get(semconv.SEGMENT_NETWORK),
        itl=list(itl or []),
    )
    return RequestRecord(timeline=timeline, budget=budget, metrics=metrics, prompt_bucket="0-127")


@dataclass(frozen=True)
class Case:
    cause: str
    segment: str
    build: Callable[[], RequestRecord]
    seen_prefixes: Container[str] | None = None


def _decode_record(**extra: Any) -> RequestRecord:
    fields: dict[str, Any] = {
        "output_tokens": 101,
        "tpot": 10 * MS,
        "itl": _UNIFORM_ITL,
        "outlier_steps_with_prefill": 0,
        "decode_bandwidth_peak_ratio": 0.4,
    }
    fields.update(extra)
    return make_record(
        {semconv.SEGMENT_QUEUE: 5 * MS, semconv.SEGMENT_PREFILL: 20 * MS, "decode": 1000 * MS},
        input_tokens=100,
        **fields,
    )


def _small(**dominant: int) -> dict[str, int]:
    """A budget where the named segments carry the time and queue/prefill/decode are small."""
    segments = {semconv.SEGMENT_QUEUE: 5 * MS, semconv.SEGMENT_PREFILL: 10 * MS, "decode": 20 * MS}
    segments.update(dominant)
    return segments


# One case per cause; each meets its own rule and no other (see also test_cases_cover_causes).
CASES = [
    Case(
        CAUSE_QUEUEING,
        semconv.SEGMENT_QUEUE,
        lambda: make_record(
            _small(queue=410 * MS),
            input_tokens=100,
            requests_ahead=37,
            running_at_arrival=256,
            max_running=256,
        ),
    ),
    Case(
        CAUSE_COLD_START,
        semconv.SEGMENT_COLD_START,
        lambda: make_record(_small(cold_start=30 * S), input_tokens=100),
    ),
    Case(
        CAUSE_LONG_PROMPT,
        semconv.SEGMENT_PREFILL,
        lambda: make_record(_small(prefill=800 * MS), input_tokens=6000, cached_tokens=0),
    ),
    Case(
        CAUSE_PREFIX_CACHE_MISS,
        semconv.SEGMENT_PREFILL,
        lambda: make_record(
            _small(prefill=300 * MS), input_tokens=600, cached_tokens=0, prefix_hash="9f8e7d6c"
        ),
        seen_prefixes=frozenset({"9f8e7d6c"}),
    ),
    Case(
        CAUSE_PREFILL,
        semconv.SEGMENT_PREFILL,
        lambda: make_record(_small(prefill=300 * MS), input_tokens=600, prefix_hash="9f8e7d6c"),
        seen_prefixes=frozenset({"other"}),
    ),
    Case(
        CAUSE_BANDWIDTH_BOUND_DECODE,
        semconv.SEGMENT_DECODE,
        lambda: _decode_record(decode_bandwidth_peak_ratio=0.92),
    ),
    Case(
        CAUSE_BATCHING_INTERFERENCE,
        semconv.SEGMENT_DECODE,
        lambda: _decode_record(itl=_SPIKY_ITL, outlier_steps_with_prefill=3),
    ),
    Case(CAUSE_LONG_DECODE, semconv.SEGMENT_DECODE, lambda: _decode_record()),
    Case(
        CAUSE_KV_CACHE_PRESSURE,
        semconv.SEGMENT_PREEMPTED,
        lambda: make_record(
            _small(preempted=1200 * MS, decode=800 * MS),
            preempted=[(1, 2), (3, 4), (5, 6)],
        ),
    ),
    Case(CAUSE_NETWORK, semconv.SEGMENT_NETWORK, lambda: make_record(_small(network=300 * MS))),
    Case(CAUSE_HTTP, semconv.SEGMENT_HTTP, lambda: make_record(_small(http=200 * MS))),
    Case(
        CAUSE_POSTPROCESS,
        semconv.SEGMENT_POSTPROCESS,
        lambda: make_record(_small(postprocess=400 * MS)),
    ),
    Case(
        CAUSE_UNATTRIBUTED,
        semconv.SEGMENT_UNATTRIBUTED,
        lambda: make_record(
            {semconv.SEGMENT_UNATTRIBUTED: 1200 * MS}, client_only=True, dialect="genai_client"
        ),
    ),
    Case(
        CAUSE_ERROR,
        semconv.SEGMENT_DECODE,
        lambda: _decode_record(status_error="CUDA out of memory"),
    ),
]


def test_cases_cover_every_cause_once() -> None:
    assert sorted(case.cause for case in CASES) == sorted(CAUSES)
    assert len(set(CAUSES)) == len(CAUSES)


@pytest.mark.parametrize("case", CASES, ids=[case.cause for case in CASES])
def test_each_cause_rule(case: Case) -> None:
    verdict = diagnose_request(case.build(), seen_prefixes=case.seen_prefixes)
    assert verdict.cause == case.cause
    assert verdict.segment == case.segment
    assert verdict.advice == ADVICE[case.cause]
    assert verdict.advice
    assert "\n" not in verdict.sentence
    assert "None" not in verdict.sentence


def test_every_cause_has_distinct_advice() -> None:
    assert set(ADVICE) == set(CAUSES)
    assert len(set(ADVICE.values())) == len(CAUSES)


# --- rule boundaries ----------------------------------------------------------------------------
def test_tie_goes_to_the_earlier_segment() -> None:
    record = make_record({"decode": 100 * MS, semconv.SEGMENT_QUEUE: 100 * MS})
    assert diagnose_request(record).segment == semconv.SEGMENT_QUEUE


@pytest.mark.parametrize(
    ("preempted_ms", "expected"),
    [(250, CAUSE_KV_CACHE_PRESSURE), (190, CAUSE_QUEUEING)],
)
def test_preemption_share_rule_applies_without_dominating(preempted_ms: int, expected: str) -> None:
    queue_ms = 500
    record = make_record(
        {
            semconv.SEGMENT_QUEUE: queue_ms * MS,
            semconv.SEGMENT_PREEMPTED: preempted_ms * MS,
            "decode": (1000 - queue_ms - preempted_ms) * MS,
        }
    )
    verdict = diagnose_request(record)
    assert verdict.cause == expected
    assert verdict.segment == semconv.SEGMENT_QUEUE  # still the dominant segment
    if expected == CAUSE_KV_CACHE_PRESSURE:
        assert f"{preempted_ms / 10:.0f}% of E2E was preemption" in verdict.sentence


def test_preemption_share_is_configurable() -> None:
    record = make_record(
        {semconv.SEGMENT_QUEUE: 500 * MS, semconv.SEGMENT_PREEMPTED: 100 * MS, "decode": 400 * MS}
    )
    assert diagnose_request(record).cause == CAUSE_QUEUEING
    lenient = DiagnosisConfig(preemption_share=0.1)
    assert diagnose_request(record, lenient).cause == CAUSE_KV_CACHE_PRESSURE


def test_long_prompt_threshold_is_inclusive_and_configurable() -> None:
    config = DiagnosisConfig(long_prompt_tokens=2000)
    at = make_record(_small(prefill=300 * MS), input_tokens=2000)
    below = make_record(_small(prefill=300 * MS), input_tokens=1999)
    assert diagnose_request(at, config).cause == CAUSE_LONG_PROMPT
    assert diagnose_request(below, config).cause == CAUSE_PREFILL


def test_prefix_cache_miss_when_zero_cached_tokens() -> None:
    record = make_record(
        _small(prefill=300 * MS), input_tokens=6000, cached_tokens=0, prefix_hash="ab"
    )
    # More specific than a long prompt: the fix is the prefix cache.
    verdict = diagnose_request(record, seen_prefixes={"ab"})
    assert verdict.cause == CAUSE_PREFIX_CACHE_MISS
    assert "0 cached tokens" in verdict.sentence
    assert verdict.numbers["cached_tokens"] == 0


@pytest.mark.parametrize(
    ("input_tokens", "expected"), [(6000, CAUSE_LONG_PROMPT), (600, CAUSE_PREFILL)]
)
def test_unknown_cached_tokens_is_not_a_prefix_cache_miss(input_tokens: int, expected: str) -> None:
    # The server did not report cached tokens: nothing says the prefix was recomputed.
    record = make_record(
        _small(prefill=300 * MS), input_tokens=input_tokens, cached_tokens=None, prefix_hash="ab"
    )
    verdict = diagnose_request(record, seen_prefixes={"ab"})
    assert verdict.cause == expected
    assert "cached" not in verdict.sentence
    assert "cached_tokens" not in verdict.numbers


def test_prefix_hit_is_not_a_miss() -> None:
    record = make_record(
        _small(prefill=300 * MS), input_tokens=600, cached_tokens=256, prefix_hash="ab"
    )
    verdict = diagnose_request(record, seen_prefixes={"ab"})
    assert verdict.cause == CAUSE_PREFILL
    assert "256" in verdict.sentence


def test_prefix_without_window_context_is_not_a_miss() -> None:
    record = make_record(_small(prefill=300 * MS), input_tokens=600, prefix_hash="ab")
    assert diagnose_request(record).cause == CAUSE_PREFILL


def test_bandwidth_ratio_threshold_is_inclusive() -> None:
    config = DiagnosisConfig(bandwidth_bound_ratio=0.75)
    at = _decode_record(decode_bandwidth_peak_ratio=0.75)
    below = _decode_record(decode_bandwidth_peak_ratio=0.74)
    assert diagnose_request(at, config).cause == CAUSE_BANDWIDTH_BOUND_DECODE
    assert diagnose_request(below, config).cause == CAUSE_LONG_DECODE


@pytest.mark.parametrize(
    ("outliers", "expected"),
    [(None, CAUSE_BATCHING_INTERFERENCE), (2, CAUSE_BATCHING_INTERFERENCE), (0, CAUSE_LONG_DECODE)],
)
def test_spiky_itl_needs_prefill_outliers_or_unknown(outliers: int | None, expected: str) -> None:
    record = _decode_record(itl=_SPIKY_ITL, outlier_steps_with_prefill=outliers)
    assert diagnose_request(record).cause == expected


def test_itl_spike_ratio_boundary() -> None:
    gaps = [10 * MS] * 98 + [30 * MS] * 2  # p99 / p50 = 3.0 exactly
    spiky = _decode_record(itl=gaps, outlier_steps_with_prefill=None)
    assert diagnose_request(spiky, DiagnosisConfig(itl_spike_ratio=3.0)).cause == (
        CAUSE_BATCHING_INTERFERENCE
    )
    assert diagnose_request(spiky, DiagnosisConfig(itl_spike_ratio=3.1)).cause == (
        CAUSE_LONG_DECODE
    )


def test_few_gaps_never_count_as_spiky() -> None:
    record = _decode_record(itl=[10 * MS, 10 * MS, 500 * MS], outlier_steps_with_prefill=None)
    assert diagnose_request(record).cause == CAUSE_LONG_DECODE


def test_error_keeps_the_underlying_diagnosis() -> None:
    record = _decode_record(status_error="CUDA out of memory\n  at step 41")
    verdict = diagnose_request(record)
    assert verdict.cause == CAUSE_ERROR
    assert verdict.numbers["underlying_cause"] == CAUSE_LONG_DECODE
    assert "CUDA out of memory at step 41" in verdict.sentence
    assert "decode" in verdict.sentence
    assert "\n" not in verdict.sentence


# --- sentences cite the numbers -------------------------------------------------------------------
def test_queue_sentence_against_ttft() -> None:
    # Queue 410 of a 500 ms TTFT (82%), dominant in E2E as well.
    record = make_record(
        {
            semconv.SEGMENT_HTTP: 10 * MS,
            semconv.SEGMENT_QUEUE: 410 * MS,
            semconv.SEGMENT_PREFILL: 80 * MS,
            "decode": 300 * MS,
        },
        requests_ahead=37,
        running_at_arrival=256,
        max_running=256,
    )
    verdict = diagnose_request(record)
    assert verdict.cause == CAUSE_QUEUEING
    assert verdict.sentence.startswith("82% of TTFT was queue wait (410 ms)")
    assert "37 requests ahead" in verdict.sentence
    assert "batch full (256/256 running)" in verdict.sentence
    assert verdict.numbers["requests_ahead"] == 37
    assert verdict.numbers["queue_ms"] == 410
    assert verdict.numbers["share_of"] == "TTFT"


def test_queue_not_full_batch_is_not_called_full() -> None:
    record = make_record(_small(queue=400 * MS), running_at_arrival=12, max_running=256)
    verdict = diagnose_request(record)
    assert "batch full" not in verdict.sentence
    assert "12/256" in verdict.sentence


def test_decode_sentence_against_e2e_cites_tokens_and_tpot() -> None:
    record = _decode_record(output_tokens=512, tpot=6_250_000)
    verdict = diagnose_request(record)
    e2e = record.budget.e2e_ns
    assert verdict.sentence.startswith(f"{round(1000 * MS / e2e * 100)}% of E2E was decode")
    assert "1.00 s" in verdict.sentence
    assert "512 output tokens" in verdict.sentence
    assert "6.25 ms" in verdict.sentence


def test_bandwidth_sentence_cites_ratio() -> None:
    verdict = diagnose_request(_decode_record(decode_bandwidth_peak_ratio=0.92))
    assert "92% of peak" in verdict.sentence


def test_interference_sentence_cites_gaps() -> None:
    verdict = diagnose_request(_decode_record(itl=_SPIKY_ITL, outlier_steps_with_prefill=3))
    assert "120 ms" in verdict.sentence
    assert "12.0x" in verdict.sentence
    assert "10.0 ms" in verdict.sentence
    assert "3 outlier steps" in verdict.sentence


def test_long_prompt_sentence_cites_tokens() -> None:
    record = make_record(_small(prefill=800 * MS), input_tokens=6000)
    verdict = diagnose_request(record)
    assert "6,000 input tokens" in verdict.sentence
    assert "of TTFT was prefill (800 ms)" in verdict.sentence


def test_unattributed_client_only_sentence_says_server_spans_are_missing() -> None:
    record = make_record(
        {semconv.SEGMENT_UNATTRIBUTED: 1200 * MS},
        ttft_ns=None,
        client_only=True,
        dialect=DIALECT_GENAI_CLIENT,
    )
    verdict = diagnose_request(record)
    assert "server-side spans are missing" in verdict.sentence
    assert "1.20 s" in verdict.sentence
    assert verdict.advice == ADVICE[CAUSE_UNATTRIBUTED]


def test_vllm_span_without_ttft_is_not_called_client_only() -> None:
    # A real vLLM llm_request span that lacks the TTFT attribute, through the whole chain.
    attrs: dict[str, AttrValue] = {
        semconv.VLLM_LATENCY_E2E: 1.0,
        semconv.VLLM_USAGE_PROMPT_TOKENS: 64,
        semconv.VLLM_USAGE_COMPLETION_TOKENS: 32,
        semconv.VLLM_REQUEST_ID: "cmpl-abc-0",
    }
    vllm = ref(
        span(semconv.VLLM_SPAN_REQUEST, T0, T0 + S, span_id=sid(9), kind=KIND_SERVER, attrs=attrs),
        service="vllm",
        scope=semconv.VLLM_TRACING_SCOPE,
    )
    (timeline,) = normalize(trace(vllm))
    assert timeline.dialect == DIALECT_VLLM
    budget = compute_budget(timeline)
    assert budget.segments[semconv.SEGMENT_UNATTRIBUTED] == S
    record = RequestRecord(
        timeline=timeline,
        budget=budget,
        metrics=compute_metrics(timeline, budget),
        prompt_bucket="0-127",
    )
    verdict = diagnose_request(record)
    assert verdict.cause == CAUSE_UNATTRIBUTED
    assert "client-side" not in verdict.sentence
    assert "server-side spans are missing" not in verdict.sentence
    assert semconv.VLLM_SPAN_REQUEST in verdict.sentence
    assert semconv.VLLM_LATENCY_TTFT in verdict.sentence
    assert verdict.numbers["server_span"] == 1
    # The client-only advice (instrument the server, propagate traceparent) does not fit.
    assert verdict.advice != ADVICE[CAUSE_UNATTRIBUTED]


def test_server_span_without_phases_in_another_dialect() -> None:
    record = make_record({semconv.SEGMENT_UNATTRIBUTED: 500 * MS}, ttft_ns=None)
    record.timeline.arrival = None
    record.timeline.server_start = 1_700_000_000 * S
    record.timeline.server_end = record.timeline.server_start + 500 * MS
    verdict = diagnose_request(record)
    assert verdict.cause == CAUSE_UNATTRIBUTED
    assert "no phase timings" in verdict.sentence
    assert "client-side" not in verdict.sentence


def test_without_ttft_budget_pre_token_segments_use_e2e() -> None:
    record = make_record(_small(queue=400 * MS), ttft_segments={}, ttft_ns=None)
    record.budget.ttft_ns = None
    verdict = diagnose_request(record)
    assert " of E2E was queue wait" in verdict.sentence


@pytest.mark.parametrize(
    ("ns", "text"),
    [
        (410 * MS, "410 ms"),
        (41_200_000, "41.2 ms"),
        (4_120_000, "4.12 ms"),
        (412_000, "0.412 ms"),
        (1_234 * MS, "1.23 s"),
        (35_200 * MS, "35.2 s"),
        (None, "unknown"),
    ],
)
def test_format_duration(ns: int | None, text: str) -> None:
    assert format_duration(ns) == text


@pytest.mark.parametrize("segment", [*semconv.SEGMENTS])
def test_none_context_never_raises(segment: str) -> None:
    record = make_record({segment: 100 * MS}, ttft_ns=None, ttft_segments={})
    record.budget.ttft_ns = None
    record.metrics.tpot = None
    verdict = diagnose_request(record, seen_prefixes={"x"})
    assert verdict.segment == segment
    assert verdict.sentence and verdict.advice
    assert "None" not in verdict.sentence


def test_empty_budget_is_unattributed() -> None:
    verdict = diagnose_request(make_record({}))
    assert verdict.cause == CAUSE_UNATTRIBUTED


_SEGMENT_NS = st.integers(min_value=0, max_value=10 * S)
_OPTIONAL_INT = st.none() | st.integers(min_value=0, max_value=100_000)


@settings(max_examples=150, deadline=None)
@given(
    segments=st.dictionaries(st.sampled_from(semconv.SEGMENTS), _SEGMENT_NS, max_size=9),
    input_tokens=_OPTIONAL_INT,
    cached_tokens=_OPTIONAL_INT,
    requests_ahead=_OPTIONAL_INT,
    running=_OPTIONAL_INT,
    max_running=_OPTIONAL_INT,
    outliers=_OPTIONAL_INT,
    ratio=st.none() | st.floats(min_value=0, max_value=2, allow_nan=False),
    itl=st.lists(st.integers(min_value=0, max_value=S), max_size=30),
    error=st.none() | st.text(max_size=40),
)
def test_any_record_gets_one_line_verdict_on_the_largest_segment(
    segments: dict[str, int],
    input_tokens: int | None,
    cached_tokens: int | None,
    requests_ahead: int | None,
    running: int | None,
    max_running: int | None,
    outliers: int | None,
    ratio: float | None,
    itl: list[int],
    error: str | None,
) -> None:
    record = make_record(
        segments,
        itl=itl,
        input_tokens=input_tokens,
        cached_tokens=cached_tokens,
        requests_ahead=requests_ahead,
        running_at_arrival=running,
        max_running=max_running,
        outlier_steps_with_prefill=outliers,
        decode_bandwidth_peak_ratio=ratio,
        prefix_hash="p",
        status_error=error,
    )
    verdict = diagnose_request(record, seen_prefixes={"p"})
    assert verdict.cause in CAUSES
    assert "\n" not in verdict.sentence
    largest = max(segments.values(), default=0)
    if largest > 0:
        assert segments[verdict.segment] == largest
        earlier = semconv.SEGMENTS[: semconv.SEGMENTS.index(verdict.segment)]
        assert all(segments.get(s, 0) < largest for s in earlier)
    if error is not None:
        assert verdict.cause == CAUSE_ERROR


# --- windows ------------------------------------------------------------------------------------
def test_empty_window() -> None:
    diagnosis = diagnose_window([])
    assert diagnosis.requests == 0
    assert diagnosis.p50 is None
    assert diagnosis.tail is None


def _mixed_window() -> list[RequestRecord]:
    """90 decode-bound requests around 1 s and 10 queue-bound ones from 4 s."""
    records = [
        make_record(
            {
                semconv.SEGMENT_QUEUE: 10 * MS,
                semconv.SEGMENT_PREFILL: 40 * MS,
                "decode": (900 + i) * MS,
            },
            output_tokens=200,
            tpot=4 * MS,
            itl=_UNIFORM_ITL,
            outlier_steps_with_prefill=0,
        )
        for i in range(90)
    ]
    records += [
        make_record(
            {
                semconv.SEGMENT_QUEUE: (3000 + 100 * i) * MS,
                semconv.SEGMENT_PREFILL: 40 * MS,
                "decode": 900 * MS,
            },
            requests_ahead=40 + i,
            running_at_arrival=256,
            max_running=256,
        )
        for i in range(10)
    ]
    return records[::-1]  # order in the window must not matter


def test_mixed_window_tail_differs_from_typical() -> None:
    records = _mixed_window()
    diagnosis = diagnose_window(records)
    assert diagnosis.requests == 100
    assert diagnosis.p50 is not None
    assert diagnosis.tail is not None
    assert diagnosis.p50.cause == CAUSE_LONG_DECODE
    assert diagnosis.p50.segment == semconv.SEGMENT_DECODE
    assert diagnosis.tail.cause == CAUSE_QUEUEING
    assert diagnosis.tail.segment == semconv.SEGMENT_QUEUE
    assert diagnosis.tail.advice == ADVICE[CAUSE_QUEUEING]

    # The tail is every request at or above the nearest-rank p95 E2E.
    e2es = sorted(r.budget.e2e_ns for r in records)
    p95 = e2es[math.ceil(0.95 * len(e2es)) - 1]
    tail = [r for r in records if r.budget.e2e_ns >= p95]
    assert diagnosis.tail.numbers["requests"] == len(tail)
    assert diagnosis.tail.sentence.startswith(f"{len(tail)} of {len(tail)} tail requests")
    mean_queue_ms = sum(r.budget.segments[semconv.SEGMENT_QUEUE] for r in tail) / len(tail) / MS
    assert diagnosis.tail.numbers["mean_queue_ms"] == pytest.approx(mean_queue_ms)
    assert format_duration(mean_queue_ms * MS) in diagnosis.tail.sentence

    # The typical group lies between p40 and p60 and is all decode-bound.
    p40 = e2es[math.ceil(0.40 * len(e2es)) - 1]
    p60 = e2es[math.ceil(0.60 * len(e2es)) - 1]
    typical = [r for r in records if p40 <= r.budget.e2e_ns <= p60]
    assert diagnosis.p50.numbers["requests"] == len(typical)
    assert diagnosis.p50.sentence.startswith(f"{len(typical)} of {len(typical)} typical")
    assert "long decode" in diagnosis.p50.sentence


def test_window_cause_is_the_most_frequent_with_its_count() -> None:
    # Tail of 4 equal-E2E requests: 3 queue-bound, 1 network-bound.
    def slow(segment: str) -> RequestRecord:
        return make_record({segment: 3000 * MS, "decode": 1000 * MS})

    records = [make_record({"decode": 100 * MS}) for _ in range(75)]
    records += [slow(semconv.SEGMENT_QUEUE) for _ in range(3)] + [slow(semconv.SEGMENT_NETWORK)]
    diagnosis = diagnose_window(records)
    assert diagnosis.tail is not None
    assert diagnosis.tail.cause == CAUSE_QUEUEING
    assert diagnosis.tail.numbers["cause_requests"] == 3
    assert diagnosis.tail.numbers[f"{CAUSE_NETWORK}_requests"] == 1
    assert diagnosis.tail.sentence.startswith("3 of 4 tail requests")


def test_window_prefix_is_a_miss_only_after_its_first_request() -> None:
    def prefill_bound(prefill_ms: int, arrival_s: int, prefix: str) -> RequestRecord:
        return make_record(
            _small(prefill=prefill_ms * MS),
            input_tokens=600,
            cached_tokens=0,
            prefix_hash=prefix,
            arrival=arrival_s * S,
        )

    # The first to arrive computed the prefix (slowest: the tail); the later one recomputed it.
    first = prefill_bound(500, 100, "shared")
    later = prefill_bound(300, 101, "shared")
    unique = prefill_bound(200, 99, "unique")
    diagnosis = diagnose_window([later, unique, first])
    assert diagnosis.tail is not None and diagnosis.p50 is not None
    assert diagnosis.tail.numbers["requests"] == 1
    assert diagnosis.tail.cause == CAUSE_PREFILL
    assert diagnosis.p50.numbers["requests"] == 1
    assert diagnosis.p50.cause == CAUSE_PREFIX_CACHE_MISS


def test_single_request_window() -> None:
    record = make_record(_small(http=200 * MS))
    diagnosis = diagnose_window([record])
    assert diagnosis.p50 is not None and diagnosis.tail is not None
    assert diagnosis.p50.cause == diagnosis.tail.cause == CAUSE_HTTP


@pytest.mark.parametrize(
    "overrides",
    [
        {"p50_band": (60.0, 40.0)},
        {"p50_band": (0.0, 60.0)},
        {"tail_percentile": 0.0},
        {"tail_percentile": 101.0},
        {"preemption_share": 0.0},
        {"itl_spike_ratio": -1.0},
    ],
)
def test_invalid_config_is_rejected(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        DiagnosisConfig(**overrides)


def test_the_decode_roofline_decides_when_bandwidth_was_not_measured() -> None:
    bound = diagnose_request(
        _decode_record(decode_bandwidth_peak_ratio=None, decode_roofline_ratio=0.9)
    )
    assert bound.cause == CAUSE_BANDWIDTH_BOUND_DECODE
    assert bound.numbers["roofline_ratio"] == 0.9
    assert "90% of the weight-read limit" in bound.sentence
    # A measured bandwidth well below peak wins over the roofline estimate.
    measured = diagnose_request(
        _decode_record(decode_bandwidth_peak_ratio=0.4, decode_roofline_ratio=0.9)
    )
    assert measured.cause != CAUSE_BANDWIDTH_BOUND_DECODE
    both = diagnose_request(
        _decode_record(decode_bandwidth_peak_ratio=0.85, decode_roofline_ratio=0.7)
    )
    assert both.cause == CAUSE_BANDWIDTH_BOUND_DECODE
    assert "85% of peak, tokens at 70% of the weight-read limit" in both.sentence
