"""Finished requests that cover every phase and the ways a request ends early, and their spans
encoded and read back: what the span layout and the wire encoder tests share."""

from __future__ import annotations

import dataclasses
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import semconv
from tokentrace.agent.finished_request import FinishedRequest, PrefillChunk
from tokentrace.agent.span_encoding import encode_finished_requests

T0 = 1_700_000_000_000_000_000
US = 1_000
MS = 1_000_000
PARENT = bytes.fromhex("00f067aa0ba902b7")
RESOURCE = {semconv.SERVICE_NAME: "vllm-test", semconv.PROCESS_PID: 4242}
SCOPE = "tokentrace.agent"


def trace_id(number: int) -> bytes:
    return number.to_bytes(16, "big")


def full_finished_request(number: int = 1, **changes: Any) -> FinishedRequest:
    """A request that went through every phase: cold start, 3 prefill chunks, 2 preemptions
    (one during prefill, one during decode), 160 tokens."""
    arrival = T0 + number * 10 * MS
    scheduled = arrival + 4 * MS
    first_token = scheduled + 30 * MS
    offsets = [k * 20_000 + (5_000 if k >= 100 else 0) for k in range(160)]  # one 25 ms gap
    last_token = first_token + offsets[-1] * US
    finished = FinishedRequest(
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
    return dataclasses.replace(finished, **changes)


def minimal_finished_request(number: int = 2, **changes: Any) -> FinishedRequest:
    """Only what every finished request has: no optional attribute, one unchunked prefill."""
    finished = FinishedRequest(
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
    return dataclasses.replace(finished, **changes)


def aborted_while_queued() -> FinishedRequest:
    return FinishedRequest(
        trace_id=trace_id(3),
        parent_span_id=PARENT,
        request_id="req-queued",
        model="m",
        operation=semconv.OPERATION_CHAT,
        arrival_ns=T0,
        end_ns=T0 + 900 * MS,
        input_tokens=100,
        requests_ahead=40,
        status_error="client disconnected",
    )


def aborted_mid_decode() -> FinishedRequest:
    """Produced 3 tokens, then the client went away: the last token never came."""
    return FinishedRequest(
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
        status_error="client disconnected",
    )


def encode(
    finished_requests: list[FinishedRequest], **options: Any
) -> tuple[ExportTraceServiceRequest, int]:
    payload, count = encode_finished_requests(
        finished_requests, resource_attributes=RESOURCE, scope_name=SCOPE, **options
    )
    return ExportTraceServiceRequest.FromString(payload), count


def spans_of(message: ExportTraceServiceRequest) -> list[Span]:
    return [
        span
        for resource_spans in message.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]


def request_span(spans: list[Span]) -> Span:
    (span,) = (span for span in spans if span.name == semconv.SPAN_REQUEST)
    return span
