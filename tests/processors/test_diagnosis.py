"""Diagnosis: one table case per cause, per metric; rule boundaries; sentence content."""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.spanbuild import KIND_SERVER, T0, AttrValue, ref, sid, span, trace
from tokentrace.agent import semconv
from tokentrace.processors.budget import compute_budget, compute_metrics
from tokentrace.processors.causes import (
    ADVICE,
    CAUSE_BANDWIDTH_BOUND_DECODE,
    CAUSE_BATCHING_INTERFERENCE,
    CAUSE_CLIENT_SATURATED,
    CAUSE_COLD_START,
    CAUSE_CONNECTION_SETUP,
    CAUSE_DECODE_STALL,
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
    CAUSE_SLOW_DECODE,
    CAUSE_UNATTRIBUTED,
    CAUSES,
    NETWORK_NOT_MEASURED,
)
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.model import (
    Budget,
    DecodeFacts,
    GapParts,
    RequestMetrics,
    RequestRecord,
    RequestTimeline,
)
from tokentrace.processors.timeline import DIALECT_GENAI_CLIENT, DIALECT_VLLM, normalize
from tokentrace.processors.verdict import default_verdict, diagnose_request
from tokentrace.processors.wording import format_duration

MS = 1_000_000
S = 1_000_000_000
TTFT = semconv.METRIC_TTFT
TPOT = semconv.METRIC_TPOT
ITL = semconv.METRIC_ITL
E2E = semconv.METRIC_E2E
_PRE_FIRST_TOKEN = (
    semconv.SEGMENT_CLIENT,
    semconv.SEGMENT_CONNECT,
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
    decode_split: dict[str, int] | None = None,
    outlier_gaps: list[GapParts] | None = None,
    **timeline_fields: Any,
) -> RequestRecord:
    """A record whose (client-seen when it has client-side segments) E2E budget is
    ``segments``; its TTFT defaults to the pre-first-token segments.

    ``client_only``: the timeline has only a client span (from ``arrival``), no server view."""
    e2e = sum(segments.values())
    client_side = sum(segments.get(name, 0) for name in semconv.CLIENT_SIDE_SEGMENTS)
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
    budget = Budget(e2e_ns=e2e, segments=segments, ttft_ns=ttft_ns, ttft_segments={})
    if client_only:
        timeline.client_start, timeline.client_end = arrival, arrival + e2e
        budget.ttft_segments = ttft_segments
    else:
        timeline.engine_arrival, timeline.end = arrival, arrival + e2e - client_side
        budget.server_e2e_ns = e2e - client_side
        server_ttft = {
            k: v for k, v in ttft_segments.items() if k not in semconv.CLIENT_SIDE_SEGMENTS
        }
        budget.ttft_segments = server_ttft
        budget.ttft_ns = (
            None
            if ttft_ns is None
            else ttft_ns - (sum(ttft_segments.values()) - sum(server_ttft.values()))
        )
        if client_side:
            timeline.client_start, timeline.client_end = arrival - client_side, arrival + e2e
            timeline.client_first_token = timeline.client_start + ttft_ns
            budget.client_ttft_ns = ttft_ns
            budget.client_ttft_segments = ttft_segments
    metrics = RequestMetrics(
        ttft=budget.ttft_ns,
        tpot=tpot,
        e2e=e2e - client_side,
        queue=segments.get(semconv.SEGMENT_QUEUE),
        prefill=segments.get(semconv.SEGMENT_PREFILL),
        decode=segments.get(semconv.SEGMENT_DECODE),
        network=segments.get(semconv.SEGMENT_NETWORK) if client_side else None,
        itl=list(itl or []),
    )
    record = RequestRecord(timeline=timeline, budget=budget, metrics=metrics, prompt_bucket="0-127")
    if decode_split is not None or outlier_gaps is not None:
        steps = timeline.engine_steps
        record.decode_facts = DecodeFacts(
            outlier_gaps=outlier_gaps or [],
            split=decode_split or {},
            engine_steps=len(steps),
            max_step_prefill_tokens=max((tokens for _, _, tokens in steps), default=0),
        )
    return record


@dataclass(frozen=True)
class Case:
    cause: str
    segment: str
    build: Callable[[], RequestRecord]
    seen_prefixes: Container[str] | None = None
    metric: str = E2E


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


def _outlier(gap_ms: int, **parts_ms: int) -> GapParts:
    """One outlier gap of ``gap_ms`` whose excess went to the named parts (the rest decode)."""
    parts = {name: ms * MS for name, ms in parts_ms.items()}
    return GapParts(
        gap_ms * MS,
        gap_ms * MS - sum(parts.values()),
        parts.get("interference", 0),
        parts.get("stall", 0),
        parts.get("preempted", 0),
        True,
    )


def _split_record(**split_ms: int) -> RequestRecord:
    """A decode-bound request whose 1 s of decode splits as given (the rest its own pace),
    the split carried by three outlier gaps of 120 ms each."""
    split = {name: ms * MS for name, ms in split_ms.items()}
    split["decode"] = 1000 * MS - sum(split.values())
    per_gap = {name: ms // 3 for name, ms in split_ms.items()}
    return _decode_record(
        itl=_SPIKY_ITL,
        decode_split=split,
        outlier_gaps=[_outlier(120, **per_gap) for _ in range(3)],
        engine_steps=[(1, 2, 0)],
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
        metric=TTFT,
    ),
    Case(
        CAUSE_COLD_START,
        semconv.SEGMENT_COLD_START,
        lambda: make_record(_small(cold_start=30 * S), input_tokens=100),
        metric=TTFT,
    ),
    Case(
        CAUSE_LONG_PROMPT,
        semconv.SEGMENT_PREFILL,
        lambda: make_record(_small(prefill=800 * MS), input_tokens=6000, cached_tokens=0),
        metric=TTFT,
    ),
    Case(
        CAUSE_PREFIX_CACHE_MISS,
        semconv.SEGMENT_PREFILL,
        lambda: make_record(
            _small(prefill=300 * MS), input_tokens=600, cached_tokens=0, prefix_hash="9f8e7d6c"
        ),
        seen_prefixes=frozenset({"9f8e7d6c"}),
        metric=TTFT,
    ),
    Case(
        CAUSE_PREFILL,
        semconv.SEGMENT_PREFILL,
        lambda: make_record(_small(prefill=300 * MS), input_tokens=600, prefix_hash="9f8e7d6c"),
        seen_prefixes=frozenset({"other"}),
        metric=TTFT,
    ),
    Case(
        CAUSE_BANDWIDTH_BOUND_DECODE,
        semconv.SEGMENT_DECODE,
        lambda: _decode_record(decode_bandwidth_peak_ratio=0.92),
    ),
    Case(
        CAUSE_BATCHING_INTERFERENCE,
        semconv.SEGMENT_INTERFERENCE,
        lambda: _split_record(interference=330),
        metric=ITL,
    ),
    Case(CAUSE_LONG_DECODE, semconv.SEGMENT_DECODE, lambda: _decode_record()),
    Case(CAUSE_SLOW_DECODE, semconv.SEGMENT_DECODE, lambda: _decode_record(), metric=TPOT),
    Case(
        CAUSE_DECODE_STALL,
        semconv.SEGMENT_STALL,
        lambda: _split_record(stall=330),
        metric=ITL,
    ),
    Case(
        CAUSE_KV_CACHE_PRESSURE,
        semconv.SEGMENT_PREEMPTED,
        lambda: make_record(
            _small(preempted=1200 * MS, decode=800 * MS),
            preempted=[(1, 2), (3, 4), (5, 6)],
        ),
    ),
    Case(
        CAUSE_NETWORK,
        semconv.SEGMENT_NETWORK,
        lambda: make_record(_small(network=300 * MS)),
        metric=TTFT,
    ),
    Case(
        CAUSE_CONNECTION_SETUP,
        semconv.SEGMENT_CONNECT,
        lambda: make_record(_small(connect=300 * MS), client_connect_ns=300 * MS),
        metric=TTFT,
    ),
    Case(
        CAUSE_CLIENT_SATURATED,
        semconv.SEGMENT_CLIENT,
        lambda: make_record(_small(client=300 * MS), client_read_wait_ns=300 * MS),
    ),
    Case(
        CAUSE_HTTP,
        semconv.SEGMENT_HTTP,
        lambda: make_record(_small(http=200 * MS)),
        metric=TTFT,
    ),
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
    verdict = diagnose_request(case.build(), metric=case.metric, seen_prefixes=case.seen_prefixes)
    assert verdict is not None
    assert verdict.cause == case.cause
    assert verdict.segment == case.segment
    assert verdict.metric == case.metric
    assert verdict.advice == ADVICE[case.cause]
    assert verdict.advice
    assert "\n" not in verdict.sentence
    assert "None" not in verdict.sentence


def test_every_cause_has_distinct_advice() -> None:
    assert set(ADVICE) == set(CAUSES)
    assert len(set(ADVICE.values())) == len(CAUSES)


def e2e_verdict(record: RequestRecord, config: DiagnosisConfig | None = None, **kwargs: Any) -> Any:
    verdict = diagnose_request(record, config or DiagnosisConfig(), **kwargs)
    assert verdict is not None  # every request has an E2E
    return verdict


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
        assert f"{preempted_ms / 10:.0f}% of the server-seen E2E" in verdict.sentence
        assert "was preemption" in verdict.sentence


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
    [(None, CAUSE_BATCHING_INTERFERENCE), (2, CAUSE_LONG_DECODE), (0, CAUSE_LONG_DECODE)],
)
def test_without_step_data_a_spiky_itl_is_interference(outliers: int | None, expected: str) -> None:
    # No step spans: only when the agent did not count the prefill outliers at all do the
    # spikes alone say interference; a count that split no decode time says it was small.
    record = _decode_record(itl=_SPIKY_ITL, outlier_steps_with_prefill=outliers)
    assert diagnose_request(record).cause == expected


@pytest.mark.parametrize(
    ("interference_ms", "expected"), [(250, CAUSE_BATCHING_INTERFERENCE), (240, CAUSE_LONG_DECODE)]
)
def test_decode_dominated_e2e_is_interference_when_it_is_a_large_part(
    interference_ms: int, expected: str
) -> None:
    # interference_share 0.25 of the 1 s decode.
    verdict = diagnose_request(_split_record(interference=interference_ms))
    assert verdict is not None
    assert verdict.cause == expected
    assert verdict.segment == semconv.SEGMENT_DECODE


def test_itl_tail_spike_ratio_boundary() -> None:
    gaps = [10 * MS] * 98 + [30 * MS] * 2  # p99 / p50 = 3.0 exactly
    spiky = _decode_record(itl=gaps, outlier_steps_with_prefill=None)
    assert diagnose_request(spiky, DiagnosisConfig(itl_tail_spike_ratio=3.0)).cause == (
        CAUSE_BATCHING_INTERFERENCE
    )
    assert diagnose_request(spiky, DiagnosisConfig(itl_tail_spike_ratio=3.1)).cause == (
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
    verdict = diagnose_request(record, metric=TTFT)
    assert verdict is not None
    assert verdict.cause == CAUSE_QUEUEING
    assert verdict.clock == "server"
    assert verdict.sentence.startswith(
        "82% of the server-seen TTFT (500 ms, network not measured) was queue wait (410 ms)"
    )
    assert "37 requests ahead" in verdict.sentence
    assert "batch full (256/256 running)" in verdict.sentence
    assert verdict.numbers["requests_ahead"] == 37
    assert verdict.numbers["queue_ms"] == 410
    assert verdict.numbers["metric"] == TTFT
    assert verdict.numbers["without_queue_ms"] == 90
    assert verdict.numbers["network_measured"] == 0


def test_a_ttft_verdict_never_names_decode() -> None:
    # E2E is decode-bound; the first token waited on the queue.
    record = make_record(
        {semconv.SEGMENT_QUEUE: 300 * MS, semconv.SEGMENT_PREFILL: 50 * MS, "decode": 5 * S},
        output_tokens=500,
        tpot=10 * MS,
    )
    ttft = diagnose_request(record, metric=TTFT)
    e2e = diagnose_request(record)
    assert ttft is not None and e2e is not None
    assert ttft.segment == semconv.SEGMENT_QUEUE
    assert e2e.segment == semconv.SEGMENT_DECODE


def test_client_seen_verdict_includes_the_network() -> None:
    record = make_record(
        {
            semconv.SEGMENT_NETWORK: 43 * MS,
            semconv.SEGMENT_HTTP: 314 * MS,
            semconv.SEGMENT_PREFILL: 181 * MS,
            "decode": 200 * MS,
        }
    )
    verdict = diagnose_request(record, metric=TTFT)
    assert verdict is not None
    assert verdict.clock == "client"
    assert verdict.sentence.startswith("58% of the client-seen TTFT (538 ms) was HTTP handling")
    assert "network not measured" not in verdict.sentence
    server = diagnose_request(record, metric=TTFT, clock="server")
    assert server is not None and server.numbers["value_ms"] == 495


def test_two_segments_within_the_tie_ratio_are_both_named() -> None:
    record = make_record(
        {semconv.SEGMENT_QUEUE: 200 * MS, semconv.SEGMENT_PREFILL: 190 * MS, "decode": 10 * MS}
    )
    verdict = diagnose_request(record, metric=TTFT)
    assert verdict is not None
    assert "was queue wait (200 ms) and 49% prefill (190 ms)" in verdict.sentence
    assert verdict.numbers["second_segment"] == semconv.SEGMENT_PREFILL
    strict = diagnose_request(record, DiagnosisConfig(tie_ratio=0.99), metric=TTFT)
    assert strict is not None and "prefill" not in strict.sentence.split(":")[0]


def test_default_verdict_answers_the_first_breached_target() -> None:
    record = make_record(
        {semconv.SEGMENT_QUEUE: 300 * MS, "decode": 5 * S}, output_tokens=500, tpot=10 * MS
    )
    default = default_verdict(record, breached_metrics=[("chat-ttft", TTFT), ("e2e-p95", E2E)])
    assert default.metric == TTFT
    assert default.segment == semconv.SEGMENT_QUEUE
    assert "chat-ttft" in default.why and "breached" in default.why
    fallback = default_verdict(record)
    assert fallback.metric == E2E
    assert "no SLO target breached" in fallback.why


def test_a_metric_the_request_lacks_has_no_verdict() -> None:
    record = make_record({semconv.SEGMENT_QUEUE: 3 * MS, "decode": 0}, output_tokens=1)
    assert diagnose_request(record, metric=TPOT) is None
    assert diagnose_request(record, metric=ITL) is None
    default = default_verdict(record, breached_metrics=[("tpot", TPOT)])
    assert default.metric == E2E  # the breached metric has no verdict: fall back


def test_network_not_measured_is_said_and_explained() -> None:
    assert "traceparent" in NETWORK_NOT_MEASURED
    verdict = diagnose_request(make_record(_small(queue=400 * MS)))
    assert verdict is not None
    assert "network not measured" in verdict.sentence


def test_queue_not_full_batch_is_not_called_full() -> None:
    record = make_record(_small(queue=400 * MS), running_at_arrival=12, max_running=256)
    verdict = diagnose_request(record)
    assert "batch full" not in verdict.sentence
    assert "12/256" in verdict.sentence


def test_decode_sentence_against_e2e_cites_tokens_and_tpot() -> None:
    record = _decode_record(output_tokens=512, tpot=6_250_000)
    verdict = diagnose_request(record)
    e2e = record.budget.e2e_ns
    assert verdict.sentence.startswith(f"{round(1000 * MS / e2e * 100)}% of the server-seen E2E")
    assert "was decode (1.00 s)" in verdict.sentence
    assert "1.00 s" in verdict.sentence
    assert "512 output tokens" in verdict.sentence
    assert "6.25 ms" in verdict.sentence


def test_bandwidth_sentence_cites_ratio() -> None:
    verdict = diagnose_request(_decode_record(decode_bandwidth_peak_ratio=0.92))
    assert "92% of peak" in verdict.sentence


def test_interference_sentence_cites_gaps() -> None:
    verdict = diagnose_request(_split_record(interference=330), metric=ITL)
    assert verdict is not None
    assert verdict.sentence.startswith("92% of its 3 slow inter-token gaps (360 ms in all")
    assert "over 3x its median gap 10.0 ms" in verdict.sentence
    assert "3 slow inter-token gaps ran engine steps that also prefilled" in verdict.sentence
    assert "12.0x" in verdict.sentence
    assert verdict.numbers["interfered_gaps"] == 3


def test_spiky_itl_sentence_without_step_data_cites_gaps() -> None:
    verdict = diagnose_request(_decode_record(itl=_SPIKY_ITL, outlier_steps_with_prefill=None))
    assert verdict is not None
    assert "120 ms" in verdict.sentence
    assert "12.0x" in verdict.sentence
    assert "10.0 ms" in verdict.sentence


def test_steady_itl_says_so() -> None:
    verdict = diagnose_request(_decode_record(), metric=ITL)
    assert verdict is not None
    assert verdict.cause == CAUSE_SLOW_DECODE
    assert verdict.sentence.startswith("its 100 inter-token gaps were steady (largest 10.0 ms")


def test_long_prompt_sentence_cites_tokens() -> None:
    record = make_record(_small(prefill=800 * MS), input_tokens=6000)
    verdict = diagnose_request(record, metric=TTFT)
    assert verdict is not None
    assert "6,000 input tokens" in verdict.sentence
    assert "was prefill (800 ms)" in verdict.sentence


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
    record.timeline.engine_arrival = None
    record.timeline.server_start = 1_700_000_000 * S
    record.timeline.server_end = record.timeline.server_start + 500 * MS
    verdict = diagnose_request(record)
    assert verdict.cause == CAUSE_UNATTRIBUTED
    assert "no phase timings" in verdict.sentence
    assert "client-side" not in verdict.sentence


def test_without_a_first_token_there_is_no_ttft_verdict() -> None:
    record = make_record(_small(queue=400 * MS), ttft_segments={}, ttft_ns=None)
    record.budget.ttft_ns = None
    assert diagnose_request(record, metric=TTFT) is None
    verdict = diagnose_request(record)
    assert verdict is not None and " of the server-seen E2E" in verdict.sentence


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


@pytest.mark.parametrize(
    "overrides",
    [
        {"p50_band": (60.0, 40.0)},
        {"p50_band": (0.0, 60.0)},
        {"tail_percentile": 0.0},
        {"tail_percentile": 101.0},
        {"preemption_share": 0.0},
        {"itl_outlier_ratio": -1.0},
        {"itl_tail_spike_ratio": 0.0},
        {"tie_ratio": 0.0},
        {"tie_ratio": 1.5},
        {"itl_outlier_ratio": 0.5},  # a gap below the median gap is no outlier
        {"bandwidth_bound_ratio": float("nan")},
        {"long_prompt_tokens": 0},
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


def test_a_long_prompt_mostly_from_the_prefix_cache_is_not_a_long_prompt() -> None:
    # 1,067 tokens of which 1,024 came from the prefix cache: prefill computed 43.
    record = make_record(_small(prefill=300 * MS), input_tokens=1067, cached_tokens=1024)
    verdict = diagnose_request(record, metric=TTFT)
    assert verdict is not None and verdict.cause == CAUSE_PREFILL
    assert "1,024 from the prefix cache" in verdict.sentence
    uncached = make_record(_small(prefill=300 * MS), input_tokens=1067, cached_tokens=0)
    long_prompt = diagnose_request(uncached, metric=TTFT)
    assert long_prompt is not None and long_prompt.cause == CAUSE_LONG_PROMPT
