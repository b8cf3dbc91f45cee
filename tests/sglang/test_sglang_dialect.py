"""SGLang's own spans (``--enable-trace``) normalised into request timelines and budgets.

The capture ``data/sglang-0.5.23-two-requests.json`` was recorded from real SGLang 0.5.23 on this
project's CPU test machine by ``python -m tests.sglang.record_capture`` (see its docstring): the
OTLP/JSON export requests of the two requests SGLang sends itself (its start-up warm-up and a
``/health`` check) and of two streaming
completions of 8 tokens each (a ``traceparent`` each), with what the client measured. Nothing
in it was edited.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import semconv
from tokentrace.collector.pipeline import group_by_trace
from tokentrace.processors.budget import request_record
from tokentrace.processors.model import AssembledTrace, RequestTimeline, SpanRef
from tokentrace.processors.timeline import (
    DIALECT_SGLANG,
    NOT_REPORTED,
    UNKNOWN,
    normalize,
    sglang_token_offsets_us,
)
from tokentrace.processors.verdict import diagnose_request

CAPTURE = Path(__file__).parent / "data" / "sglang-0.5.23-two-requests.json"
_NS_PER_S = 1_000_000_000
_ROUNDING_NS = 1_000
"""SGLang's span timestamps are coarser (µs) than its float latencies: a TTFT as long as the
whole request is clamped to the span's end, up to this much below the attribute."""


@cache
def _capture() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(CAPTURE.read_text(encoding="utf-8"))
    return data


def captured_traces() -> dict[bytes, list[SpanRef]]:
    """Every trace of the capture, freshly parsed (tests may change their spans)."""
    traces: dict[bytes, list[SpanRef]] = {}
    for raw in _capture()["export_requests"]:
        request = json_format.ParseDict(raw, ExportTraceServiceRequest())
        groups, _ = group_by_trace(request)
        for trace_id, refs in groups.items():
            traces.setdefault(trace_id, []).extend(refs)
    return traces


def client_trace_ids() -> list[bytes]:
    return [bytes.fromhex(client["trace_id"]) for client in _capture()["clients"]]


def root_of(refs: list[SpanRef]) -> Span:
    (root,) = [ref.span for ref in refs if semconv.SGLANG_SPAN_REQUEST_MARK in ref.span.name]
    return root


def attribute(span: Span, key: str) -> object:
    for kv in span.attributes:
        if kv.key == key:
            return getattr(kv.value, kv.value.WhichOneof("value"))
    raise KeyError(key)


def timeline_of(trace_id: bytes, refs: list[SpanRef]) -> RequestTimeline:
    (timeline,) = normalize(AssembledTrace(trace_id, refs))
    return timeline


def test_each_sglang_request_becomes_one_timeline_of_the_sglang_dialect() -> None:
    traces = captured_traces()
    # Two requests SGLang sends itself (start-up warm-up, health check), and the client's two.
    assert len(traces) == 4
    for trace_id in client_trace_ids():
        assert trace_id in traces
    for trace_id, refs in traces.items():
        timeline = timeline_of(trace_id, refs)
        root = root_of(refs)
        assert timeline.dialect == DIALECT_SGLANG
        assert timeline.span_id == root.span_id
        assert timeline.service == "sglang"
        assert timeline.model == "tiny-llama"
        assert timeline.operation == UNKNOWN  # SGLang's spans do not say
        assert timeline.request_id == attribute(root, "gen_ai.request.id")


def test_the_client_requests_are_read_in_full() -> None:
    traces = captured_traces()
    for trace_id in client_trace_ids():
        refs = traces[trace_id]
        root = root_of(refs)
        timeline = timeline_of(trace_id, refs)
        # SGLang writes counts as strings: read as numbers all the same.
        assert timeline.input_tokens == int(str(attribute(root, "gen_ai.usage.prompt_tokens")))
        assert timeline.output_tokens == 8
        assert timeline.cached_tokens == int(str(attribute(root, "gen_ai.usage.cached_tokens")))
        assert timeline.finish_reason == "length"

        by_name = {ref.span.name: ref.span for ref in refs}
        assert timeline.server_start == root.start_time_unix_nano  # no HTTP server span
        assert timeline.end == timeline.server_end == root.end_time_unix_nano
        assert timeline.engine_arrival == by_name["request_process"].start_time_unix_nano
        assert timeline.first_scheduled == by_name["prefill_forward"].start_time_unix_nano
        loops = sorted(
            (ref.span for ref in refs if ref.span.name == "decode_loop"),
            key=lambda span: span.start_time_unix_nano,
        )
        # The last token on the frontend's clock, as SGLang's own decode time says.
        decode_s = attribute(root, "gen_ai.latency.time_in_model_decode")
        assert isinstance(decode_s, float) and timeline.first_token is not None
        assert timeline.last_token == timeline.first_token + round(decode_s * _NS_PER_S)
        # One time per output token: the prefill's end, then each decode loop's end.
        prefill_end = by_name["prefill_forward"].end_time_unix_nano
        assert timeline.token_offsets_us == [
            0,
            *((loop.end_time_unix_nano - prefill_end) // 1000 for loop in loops),
        ]
        assert len(timeline.token_offsets_us) == timeline.output_tokens
        boundaries = [
            timeline.server_start,
            timeline.engine_arrival,
            timeline.first_scheduled,
            timeline.first_token,
            timeline.last_token,
            timeline.end,
        ]
        assert boundaries == sorted(boundaries)  # type: ignore[type-var]


@pytest.mark.parametrize("which", ["client", "warm-up"])
def test_ttft_is_sglangs_own_and_the_budget_sums_to_e2e(which: str) -> None:
    clients = set(client_trace_ids())
    chosen = [
        (trace_id, refs)
        for trace_id, refs in captured_traces().items()
        if (trace_id in clients) == (which == "client")
    ]
    assert len(chosen) == 2
    for trace_id, refs in chosen:
        root = root_of(refs)
        record = request_record(timeline_of(trace_id, refs))
        budget = record.budget
        assert sum(budget.segments.values()) == budget.e2e_ns
        assert budget.e2e_ns == root.end_time_unix_nano - root.start_time_unix_nano
        ttft_s = attribute(root, semconv.VLLM_LATENCY_TTFT)
        assert isinstance(ttft_s, float)
        assert budget.ttft_ns is not None
        assert abs(budget.ttft_ns - round(ttft_s * _NS_PER_S)) <= _ROUNDING_NS
        assert sum(budget.ttft_segments.values()) == budget.ttft_ns
        assert not budget.skew_clamped
        assert record.metrics.ttft == budget.ttft_ns
        # Time before the scheduler took the request (tokenising, dispatch) is the frontend's.
        assert budget.segments[semconv.SEGMENT_HTTP] > 0
        assert budget.segments[semconv.SEGMENT_PREFILL] > 0
        verdict = diagnose_request(record)
        assert verdict is not None
        assert verdict.segment != semconv.SEGMENT_UNATTRIBUTED


def test_decode_is_sglangs_own_and_itl_comes_from_the_decode_loops() -> None:
    traces = captured_traces()
    for trace_id in client_trace_ids():
        root = root_of(traces[trace_id])
        record = request_record(timeline_of(trace_id, traces[trace_id]))
        decode_s = attribute(root, "gen_ai.latency.time_in_model_decode")
        assert isinstance(decode_s, float)
        decode_ns = record.budget.segments[semconv.SEGMENT_DECODE]
        assert abs(decode_ns - round(decode_s * _NS_PER_S)) <= _ROUNDING_NS
        assert len(record.metrics.itl) == 7  # 8 tokens, 7 gaps
        assert all(gap >= 0 for gap in record.metrics.itl)
        assert record.metrics.tpot is not None and record.metrics.tpot > 0


def test_without_its_phase_spans_the_root_alone_still_gives_ttft_and_e2e() -> None:
    """A collector that received only the root span (e.g. the scheduler's exporter lost): the
    frontend's arrival and SGLang's TTFT still split the request in two."""
    trace_id = client_trace_ids()[0]
    refs = [
        ref
        for ref in captured_traces()[trace_id]
        if semconv.SGLANG_SPAN_REQUEST_MARK in ref.span.name
    ]
    timeline = timeline_of(trace_id, refs)
    root = refs[0].span
    assert timeline.engine_arrival == root.start_time_unix_nano
    assert timeline.first_scheduled is None and timeline.token_offsets_us == []
    budget = request_record(timeline).budget
    assert sum(budget.segments.values()) == budget.e2e_ns
    ttft_s = attribute(root, semconv.VLLM_LATENCY_TTFT)
    assert isinstance(ttft_s, float)
    assert budget.ttft_ns == round(ttft_s * _NS_PER_S)


def test_a_req_span_from_another_scope_is_not_sglang() -> None:
    trace_id = client_trace_ids()[0]
    refs = captured_traces()[trace_id]
    for ref in refs:
        ref.scope.name = "someone else"
    assert normalize(AssembledTrace(trace_id, refs)) == []


def test_malformed_phase_spans_are_skipped() -> None:
    """A phase span that ends before it starts counts as absent; the timeline is still built."""
    trace_id = client_trace_ids()[0]
    refs = captured_traces()[trace_id]
    for ref in refs:
        if ref.span.name == "prefill_forward":
            ref.span.end_time_unix_nano = ref.span.start_time_unix_nano - 1
    timeline = timeline_of(trace_id, refs)
    assert timeline.first_scheduled is None
    budget = request_record(timeline).budget
    assert sum(budget.segments.values()) == budget.e2e_ns


def test_what_sglangs_spans_cannot_tell_is_named() -> None:
    missing = NOT_REPORTED[DIALECT_SGLANG]
    for piece in ("HTTP server span", "client", "engine steps", "preemption", "GPU", "cold start"):
        assert any(piece in entry for entry in missing), piece


def test_stored_traces_give_the_same_token_offsets() -> None:
    """``sglang_token_offsets_us`` (for readers of a stored trace's spans) agrees with
    ``normalize``, and says None for a span that is not an SGLang request."""
    for trace_id, refs in captured_traces().items():
        timeline = timeline_of(trace_id, refs)
        spans = [(ref.scope, ref.span) for ref in refs]
        assert sglang_token_offsets_us(spans, timeline.span_id) == timeline.token_offsets_us
        other = next(
            ref.span.span_id
            for ref in refs
            if ref.span.name == "decode_forward" or ref.span.name == "tokenize"
        )
        assert sglang_token_offsets_us(spans, other) is None
