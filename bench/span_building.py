"""Cost of turning one finished request into OTLP bytes: the agent's encoder vs the SDK.

Both sides build the same spans of a typical request (``llm.request`` + queue, prefill with two
chunks, decode with 160 token offsets, postprocess: 7 spans under an incoming ``traceparent``)
from the same ``plan_spans`` layout and end with a serialised ``ExportTraceServiceRequest`` of a
batch of requests:

- agent: ``tokentrace.agent.span_encoding.encode_finished_requests`` (protobuf wire format written
  directly);
- SDK: ``TracerProvider`` without span processor, ``start_span``/``end`` with the explicit
  times, parent contexts and attributes, then the OTLP exporter's own encoder
  (``opentelemetry.exporter.otlp.proto.common.trace_encoder.encode_spans``) and
  ``SerializeToString``.

Rounds alternate A and B so that machine noise hits both alike; medians are reported.

    python bench/span_building.py              # ~6 s
    python bench/span_building.py --rounds 20  # quick look
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Final

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.version import __version__ as sdk_version
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from tokentrace.agent import semconv
from tokentrace.agent.finished_request import FinishedRequest, PrefillChunk
from tokentrace.agent.span_encoding import encode_finished_requests
from tokentrace.agent.spans import KIND_CLIENT, KIND_SERVER, count_spans, plan_spans

_DEFAULT_ROUNDS: Final = 200
_DEFAULT_BATCH: Final = 64
_TOKENS: Final = 160
_SCOPE: Final = "tokentrace.agent"
_RESOURCE: Final[dict[str, str | int]] = {
    semconv.SERVICE_NAME: "vllm-bench",
    semconv.HOST_NAME: "bench-host",
    semconv.PROCESS_PID: 4242,
}
_T0: Final = 1_700_000_000_000_000_000
_MS: Final = 1_000_000
_US: Final = 1_000


def typical_finished_request(number: int) -> FinishedRequest:
    """A chat request: 2.5k-token prompt in two chunks, 160 output tokens ~20 ms apart."""
    arrival = _T0 + number * 50 * _MS
    scheduled = arrival + 3 * _MS
    first_token = scheduled + 70 * _MS
    offsets = [k * 20_000 + (k * 37) % 900 for k in range(_TOKENS)]
    last_token = first_token + offsets[-1] * _US
    return FinishedRequest(
        trace_id=(number + 1).to_bytes(16, "big"),
        parent_span_id=(number + 7).to_bytes(8, "big"),
        request_id=f"chatcmpl-{number:032x}",
        model="meta-llama/Llama-3.1-8B-Instruct",
        operation=semconv.OPERATION_CHAT,
        arrival_ns=arrival,
        end_ns=last_token + 400 * _US,
        first_scheduled_ns=scheduled,
        first_token_ns=first_token,
        last_token_ns=last_token,
        token_offsets_us=offsets,
        prefill_chunks=[
            PrefillChunk(scheduled, scheduled + 55 * _MS, 2048),
            PrefillChunk(scheduled + 55 * _MS, first_token, 452),
        ],
        input_tokens=2500,
        output_tokens=_TOKENS,
        cached_tokens=256,
        max_tokens=1024,
        temperature=0.7,
        top_p=1.0,
        finish_reason="stop",
        requests_ahead=2,
        running_at_arrival=17,
        max_running=64,
        prefix_hash="5be1a4c09f2c41aa",
        outlier_steps_with_prefill=0,
    )


def agent_encode(finished_requests: list[FinishedRequest]) -> bytes:
    payload, _ = encode_finished_requests(
        finished_requests, resource_attributes=_RESOURCE, scope_name=_SCOPE
    )
    return payload


def sdk_encoder() -> Callable[[list[FinishedRequest]], bytes]:
    """The same spans through the OpenTelemetry SDK and its OTLP protobuf encoder."""
    provider = TracerProvider(resource=Resource.create(_RESOURCE))  # no span processor
    tracer = provider.get_tracer(_SCOPE)
    kinds = {KIND_SERVER: trace.SpanKind.SERVER, KIND_CLIENT: trace.SpanKind.CLIENT}

    def encode(finished_requests: list[FinishedRequest]) -> bytes:
        finished: list[ReadableSpan] = []
        for request in finished_requests:
            # The incoming traceparent: the request's trace and its HTTP server span.
            remote = SpanContext(
                trace_id=int.from_bytes(request.trace_id, "big"),
                span_id=int.from_bytes(request.parent_span_id, "big"),
                is_remote=True,
                trace_flags=TraceFlags(TraceFlags.SAMPLED),
            )
            root = trace.set_span_in_context(NonRecordingSpan(remote))
            started: list[trace.Span] = []
            ends: list[int] = []
            for planned in plan_spans(request):
                parent = planned.parent_local_id
                context = root if parent < 0 else trace.set_span_in_context(started[parent])
                span = tracer.start_span(
                    planned.name,
                    context=context,
                    kind=kinds.get(planned.kind, trace.SpanKind.INTERNAL),
                    attributes=planned.attributes,
                    start_time=planned.start_ns,
                )
                if planned.status_error is not None:
                    span.set_status(Status(StatusCode.ERROR, planned.status_error))
                started.append(span)
                ends.append(planned.end_ns)
            for span, end_ns in zip(reversed(started), reversed(ends), strict=True):
                span.end(end_time=end_ns)
            finished += started  # type: ignore[arg-type]  # SDK spans are ReadableSpans
        return encode_spans(finished).SerializeToString()

    return encode


def check_same_spans(agent: bytes, sdk: bytes) -> int:
    """Both payloads hold the same spans (names, parents, times, attributes); the span count."""

    def shape(payload: bytes) -> list[tuple[object, ...]]:
        message = ExportTraceServiceRequest.FromString(payload)
        spans = [
            span
            for resource_spans in message.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]
        return sorted(
            (
                span.trace_id,
                span.parent_span_id if span.name == semconv.SPAN_REQUEST else b"",
                span.name,
                span.start_time_unix_nano,
                span.end_time_unix_nano,
                len(span.attributes),
                sum(len(kv.value.array_value.values) for kv in span.attributes),
            )
            for span in spans
        )

    agent_shape, sdk_shape = shape(agent), shape(sdk)
    if agent_shape != sdk_shape:
        raise SystemExit("span_building: the two paths built different spans")
    return len(agent_shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=_DEFAULT_ROUNDS)
    parser.add_argument("--batch", type=int, default=_DEFAULT_BATCH, help="requests per export")
    args = parser.parse_args()

    finished_requests = [typical_finished_request(number) for number in range(args.batch)]
    sdk_encode = sdk_encoder()
    spans = check_same_spans(agent_encode(finished_requests), sdk_encode(finished_requests))
    per_request = spans // len(finished_requests)
    assert per_request == count_spans(finished_requests[0])

    agent_us: list[float] = []
    sdk_us: list[float] = []
    ratios: list[float] = []
    started = time.perf_counter()
    for _ in range(args.rounds):
        begin = time.perf_counter()
        agent_encode(finished_requests)
        middle = time.perf_counter()
        sdk_encode(finished_requests)
        end = time.perf_counter()
        agent_us.append((middle - begin) * 1e6 / len(finished_requests))
        sdk_us.append((end - middle) * 1e6 / len(finished_requests))
        ratios.append(sdk_us[-1] / agent_us[-1])
    elapsed = time.perf_counter() - started

    agent = statistics.median(agent_us)
    sdk = statistics.median(sdk_us)
    print(
        f"span building + OTLP protobuf encoding, {per_request} spans and {_TOKENS} token "
        f"offsets per request, batches of {len(finished_requests)} requests, "
        f"{args.rounds} A/B rounds "
        f"({elapsed:.1f} s)"
    )
    print(f"python {platform.python_version()}, opentelemetry-sdk {sdk_version}")
    print(f"{'path':<44}{'us/request':>12}{'us/span':>10}")
    print(f"{'agent: encode_finished_requests':<44}{agent:>12.1f}{agent / per_request:>10.2f}")
    print(f"{'SDK: start_span/end + encode_spans':<44}{sdk:>12.1f}{sdk / per_request:>10.2f}")
    print(
        f"SDK / agent: {sdk / agent:.1f}x (median of per-round ratios "
        f"{statistics.median(ratios):.1f}x, min {min(ratios):.1f}x)"
    )
    print(f"reproduce: python bench/span_building.py --rounds {args.rounds} --batch {args.batch}")


if __name__ == "__main__":
    main()
