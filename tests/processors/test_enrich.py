"""Enrichment of the request span with budget, metrics, diagnosis and SLO attributes."""

from __future__ import annotations

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.spanbuild import T0, attributes_of, key_value, request_spans, sid, span, trace
from tokentrace.agent import semconv
from tokentrace.processors.budget import compute_budget, compute_metrics, prompt_bucket
from tokentrace.processors.enrich import enrich_span
from tokentrace.processors.model import RequestRecord, Verdict
from tokentrace.processors.timeline import normalize

MS = 1_000_000


def record_for(spans: list[Span], **extra: object) -> RequestRecord:
    (timeline,) = normalize(trace(*spans))
    budget = compute_budget(timeline)
    record = RequestRecord(
        timeline=timeline,
        budget=budget,
        metrics=compute_metrics(timeline, budget),
        prompt_bucket=prompt_bucket(timeline.input_tokens),
    )
    for name, value in extra.items():
        setattr(record, name, value)
    return record


VERDICT = Verdict(
    segment=semconv.SEGMENT_QUEUE,
    cause="queueing",
    sentence="62% of TTFT was queue wait (20 ms): 37 requests ahead",
    advice="add replicas or raise max_num_seqs",
    numbers={"queue_ms": 20},
)


def test_enrichment_writes_every_derived_value() -> None:
    spans = request_spans(
        http_ns=MS, queue_ns=20 * MS, prefill_ns=10 * MS, token_offsets_us=[0, 4_000, 8_000]
    )
    record = record_for(spans, verdict=VERDICT, slo={"chat-ttft": False, "e2e": True, "a": True})
    request = spans[1]
    enrich_span(request, record)
    attrs = attributes_of(request)

    assert attrs[semconv.budget_attribute(semconv.SEGMENT_HTTP)] == MS
    assert attrs[semconv.budget_attribute(semconv.SEGMENT_QUEUE)] == 20 * MS
    assert attrs[semconv.budget_attribute(semconv.SEGMENT_PREFILL)] == 10 * MS
    assert attrs[semconv.budget_attribute(semconv.SEGMENT_DECODE)] == 8 * MS
    # Zero-length segments are not written.
    assert semconv.budget_attribute(semconv.SEGMENT_COLD_START) not in attrs
    assert semconv.budget_attribute(semconv.SEGMENT_NETWORK) not in attrs
    written = sum(
        value
        for key, value in attrs.items()
        if key.startswith(semconv.BUDGET_PREFIX) and isinstance(value, int)
    )
    assert written == record.budget.e2e_ns
    assert attrs[semconv.ttft_budget_attribute(semconv.SEGMENT_QUEUE)] == 20 * MS
    assert semconv.ttft_budget_attribute(semconv.SEGMENT_DECODE) not in attrs
    assert attrs[semconv.TTFT_NS] == (1 + 20 + 10) * MS
    assert attrs[semconv.TPOT_NS] == record.metrics.tpot
    assert attrs[semconv.E2E_NS] == record.metrics.e2e
    assert attrs[semconv.PROMPT_BUCKET] == "0-127"  # 100 input tokens
    assert attrs[semconv.DIAGNOSIS_SEGMENT] == "queue"
    assert attrs[semconv.DIAGNOSIS_CAUSE] == "queueing"
    assert attrs[semconv.DIAGNOSIS_VERDICT] == VERDICT.sentence
    assert attrs[semconv.DIAGNOSIS_ADVICE] == VERDICT.advice
    assert attrs[semconv.SLO_MET] == ["a", "e2e"]
    assert attrs[semconv.SLO_BREACHED] == ["chat-ttft"]


def test_enrichment_is_idempotent_and_keeps_other_attributes() -> None:
    spans = request_spans()
    request = spans[1]
    request.attributes.append(key_value("custom.before", "keep me"))
    original = [(kv.key, kv.value.SerializeToString()) for kv in request.attributes]
    record = record_for(spans, verdict=VERDICT, slo={"x": True})

    enrich_span(request, record)
    once = request.SerializeToString()
    enrich_span(request, record)
    assert request.SerializeToString() == once

    keys = [kv.key for kv in request.attributes]
    assert len(keys) == len(set(keys))
    # An empty list of breached targets is still written as an (empty) array.
    assert attributes_of(request)[semconv.SLO_BREACHED] == []
    assert attributes_of(request)[semconv.SLO_MET] == ["x"]
    # Pre-existing attributes keep their values and their order, ahead of the enrichment.
    kept = [(kv.key, kv.value.SerializeToString()) for kv in request.attributes][: len(original)]
    assert kept == original


def test_enrichment_replaces_previous_values_and_drops_stale_ones() -> None:
    request = span(
        semconv.SPAN_REQUEST,
        T0,
        T0 + 50 * MS,
        span_id=sid(1),
        attrs={
            semconv.TTFT_NS: 1,
            semconv.budget_attribute(semconv.SEGMENT_PREEMPTED): 999,
            semconv.DIAGNOSIS_CAUSE: "stale",
            "http.route": "/v1/chat",
        },
    )
    record = record_for([request])
    enrich_span(request, record)
    attrs = attributes_of(request)
    assert attrs["http.route"] == "/v1/chat"
    assert semconv.TTFT_NS not in attrs  # this record has no token: no TTFT
    assert semconv.budget_attribute(semconv.SEGMENT_PREEMPTED) not in attrs
    assert semconv.DIAGNOSIS_CAUSE not in attrs  # no verdict now
    assert semconv.SLO_MET not in attrs
    assert attrs[semconv.E2E_NS] == 50 * MS
    assert attrs[semconv.PROMPT_BUCKET] == "unknown"
    assert [kv.key for kv in request.attributes].count(semconv.E2E_NS) == 1


def test_durations_past_int64_are_clamped_and_the_rest_written() -> None:
    """A corrupt span's fixed64 timestamps can give durations no int64 attribute holds: the
    encoder refuses them, and the enrichment writes them clamped (the other values as they are)."""
    spans = request_spans(queue_ns=20 * MS, token_offsets_us=[0, 4_000, 8_000])
    record = record_for(spans, verdict=VERDICT, slo={"e2e": False})
    record.metrics.e2e = 2**64 + 5
    record.budget.segments[semconv.SEGMENT_DECODE] = -(2**63) - 7
    request = spans[1]
    enrich_span(request, record)
    attrs = attributes_of(request)

    assert attrs[semconv.E2E_NS] == 2**63 - 1
    assert attrs[semconv.budget_attribute(semconv.SEGMENT_DECODE)] == -(2**63)
    assert attrs[semconv.budget_attribute(semconv.SEGMENT_QUEUE)] == 20 * MS
    assert attrs[semconv.TTFT_NS] == record.metrics.ttft
    assert attrs[semconv.DIAGNOSIS_VERDICT] == VERDICT.sentence
    assert attrs[semconv.SLO_BREACHED] == ["e2e"]
