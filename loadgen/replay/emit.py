"""Simulated requests as spans: one span layout, emitted two ways.

The server's request subtree is the agent's own (the layout of ``tokentrace.agent.spans`` and
the encoder of ``tokentrace.agent.span_encoding``, over ``SimulatedRequest.finished_request()``);
emission adds what surrounds the request in a deployment: the HTTP server span (the finished
request's parent) and the load generator's client span. That layout is the tokentrace dialect
(the span contract of docs/architecture.md), emitted

- ``emit_sdk``: through the OpenTelemetry SDK (the caller configures the exporter), so the
  collector sees a real OTLP client (``tokentrace replay`` uses it with an OTLP exporter);
- ``to_otlp_requests``: ``ExportTraceServiceRequest`` messages from the agent's wire encoder
  (benchmarks).

``dialect="vllm"`` emits vLLM's built-in per-request span instead (one span, no children): an
imitation of vLLM's own tracing, so it lives here and not in the agent.

Separate from the simulation: this is the only part that knows span names, attributes and
OTLP. Standard library and the agent's stdlib-only modules at import time; the OpenTelemetry
packages are imported by the functions that need them.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final, Literal, TypeAlias

from tokentrace.agent import semconv, span_encoding, spans
from tokentrace.agent.span_encoding import ResourceScope
from tokentrace.agent.spans import AttrValue, PlannedSpan
from tokentrace.loadgen.replay.request import (
    CLIENT_SPAN_OFFSET,
    FIRST_SUBTREE_SPAN_OFFSET,
    HTTP_SPAN_OFFSET,
    SimulatedRequest,
    span_id_bytes,
)

if TYPE_CHECKING:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.sdk.trace import TracerProvider

__all__ = [
    "DIALECTS",
    "DIALECT_TOKENTRACE",
    "DIALECT_VLLM",
    "Dialect",
    "emit_sdk",
    "span_count",
    "to_otlp_requests",
]

Dialect: TypeAlias = Literal["tokentrace", "vllm"]
DIALECT_TOKENTRACE: Final = "tokentrace"
"""tokentrace's own span tree: ``llm.request`` with one child per phase."""
DIALECT_VLLM: Final = "vllm"
"""vLLM's built-in tracing: one ``llm_request`` span per request, latencies in seconds."""
DIALECTS: Final = (DIALECT_TOKENTRACE, DIALECT_VLLM)


_DEFAULT_SERVICE_NAME: Final = "vllm-demo"
_DEFAULT_CLIENT_SERVICE_NAME: Final = "tokentrace-replay-client"
_DEFAULT_BATCH_SPANS: Final = 512

_NS_PER_S: Final = 1_000_000_000

_HTTP_METHOD: Final = "POST"
_HTTP_OK: Final = 200


# --- the spans of one request ---------------------------------------------------------------------


def span_count(request: SimulatedRequest, dialect: Dialect = DIALECT_TOKENTRACE) -> int:
    """How many spans ``request`` becomes in ``dialect``."""
    if dialect == DIALECT_VLLM:
        return 1
    client = 1 if request.client_start_ns is not None else 0
    return client + 1 + spans.count_spans(request.finished_request())


def _client_span(request: SimulatedRequest) -> PlannedSpan | None:
    """The load generator's span around the request (``local_id`` 0), if it has one."""
    if request.client_start_ns is None:
        return None
    assert request.client_end_ns is not None and request.client_first_token_ns is not None
    attributes: dict[str, AttrValue] = {
        semconv.GEN_AI_OPERATION_NAME: request.operation,
        semconv.GEN_AI_REQUEST_MODEL: request.model,
        semconv.HTTP_REQUEST_METHOD: _HTTP_METHOD,
        semconv.URL_PATH: request.url_path,
        semconv.HTTP_RESPONSE_STATUS_CODE: _HTTP_OK,
        semconv.CLIENT_FIRST_TOKEN_TIME: request.client_first_token_ns,
    }
    return PlannedSpan(
        CLIENT_SPAN_OFFSET, -1, semconv.SPAN_CLIENT_REQUEST, spans.KIND_CLIENT,
        request.client_start_ns, request.client_end_ns, attributes,
    )  # fmt: skip


def _http_span(request: SimulatedRequest, *, has_client: bool) -> PlannedSpan:
    """The inference server's HTTP server span: the parent of ``llm.request``."""
    attributes: dict[str, AttrValue] = {
        semconv.HTTP_REQUEST_METHOD: _HTTP_METHOD,
        semconv.URL_PATH: request.url_path,
        semconv.HTTP_RESPONSE_STATUS_CODE: _HTTP_OK,
    }
    return PlannedSpan(
        HTTP_SPAN_OFFSET, CLIENT_SPAN_OFFSET if has_client else -1,
        f"{_HTTP_METHOD} {request.url_path}", spans.KIND_SERVER,
        request.server_start_ns, request.server_end_ns, attributes,
    )  # fmt: skip


def _vllm_span(request: SimulatedRequest) -> PlannedSpan:
    """vLLM's built-in span: start at arrival, end at completion, latencies in seconds."""
    seconds = 1.0 / _NS_PER_S
    arrival = request.arrival_ns
    scheduled = request.first_scheduled_ns
    first_token = request.first_token_ns
    last_token = request.last_token_ns
    end = request.end_ns
    attributes: dict[str, AttrValue] = {
        semconv.VLLM_LATENCY_TTFT: (first_token - arrival) * seconds,
        semconv.VLLM_LATENCY_E2E: (end - arrival) * seconds,
        semconv.VLLM_LATENCY_QUEUE: (scheduled - arrival) * seconds,
        semconv.VLLM_LATENCY_PREFILL: (first_token - scheduled) * seconds,
        semconv.VLLM_LATENCY_DECODE: (last_token - first_token) * seconds,
        semconv.VLLM_LATENCY_INFERENCE: (last_token - scheduled) * seconds,
        semconv.VLLM_USAGE_PROMPT_TOKENS: request.input_tokens,
        semconv.VLLM_USAGE_COMPLETION_TOKENS: request.output_tokens,
        semconv.VLLM_REQUEST_ID: request.request_id,
        semconv.GEN_AI_REQUEST_TOP_P: request.top_p,
        semconv.GEN_AI_REQUEST_MAX_TOKENS: request.max_tokens,
        semconv.GEN_AI_REQUEST_TEMPERATURE: request.temperature,
        semconv.VLLM_REQUEST_N: 1,
    }
    return PlannedSpan(
        0, -1, semconv.VLLM_SPAN_REQUEST, spans.KIND_SERVER, arrival, end, attributes
    )


def _check_dialect(dialect: str) -> None:
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r} (known: {', '.join(DIALECTS)})")


def _check_max_token_offsets(max_token_offsets: int) -> None:
    if max_token_offsets < 0:
        raise ValueError("max_token_offsets must be >= 0")


def _scope_name(dialect: Dialect) -> str:
    return semconv.VLLM_TRACING_SCOPE if dialect == DIALECT_VLLM else semconv.REPLAY_SCOPE


# --- emission: OpenTelemetry SDK ----------------------------------------------------------------


def emit_sdk(
    requests: Iterable[SimulatedRequest],
    tracer_provider: TracerProvider,
    *,
    dialect: Dialect = DIALECT_TOKENTRACE,
    client_tracer_provider: TracerProvider | None = None,
    max_token_offsets: int = spans.DEFAULT_MAX_TOKEN_OFFSETS,
) -> int:
    """Create every request's spans through the OpenTelemetry SDK; returns the span count.

    Spans carry the simulated timestamps (explicit ``start_time``/``end_time``), explicit
    parent contexts and span kinds. Client spans go to ``client_tracer_provider`` (the load
    generator's resource) when given, else to ``tracer_provider``. Trace and span ids are the
    SDK's own (its id generator), not the simulated ones ``to_otlp_requests`` uses. The caller
    owns the providers' span processors and exporters (and flushing them).
    """
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Status, StatusCode

    _check_dialect(dialect)
    _check_max_token_offsets(max_token_offsets)
    kinds = {
        spans.KIND_INTERNAL: trace.SpanKind.INTERNAL,
        spans.KIND_SERVER: trace.SpanKind.SERVER,
        spans.KIND_CLIENT: trace.SpanKind.CLIENT,
    }
    scope = _scope_name(dialect)
    server_tracer = tracer_provider.get_tracer(scope)
    client_tracer = (client_tracer_provider or tracer_provider).get_tracer(scope)
    root_context = Context()  # never inherit whatever span is current in the caller
    ends: list[tuple[trace.Span, int]] = []

    def start(tracer: trace.Tracer, planned: PlannedSpan, context: Context) -> trace.Span:
        span = tracer.start_span(
            planned.name,
            context=context,
            kind=kinds[planned.kind],
            attributes=planned.attributes,
            start_time=planned.start_ns,
        )
        if planned.status_error is not None:
            span.set_status(Status(StatusCode.ERROR, planned.status_error))
        ends.append((span, planned.end_ns))
        return span

    emitted = 0
    for request in requests:
        if dialect == DIALECT_VLLM:
            start(server_tracer, _vllm_span(request), root_context)
        else:
            client = _client_span(request)
            context = root_context
            if client is not None:
                context = trace.set_span_in_context(start(client_tracer, client, root_context))
            http = start(server_tracer, _http_span(request, has_client=client is not None), context)
            subtree_parent = trace.set_span_in_context(http)
            started: list[trace.Span] = []
            for planned in spans.plan_spans(
                request.finished_request(), max_token_offsets=max_token_offsets
            ):
                parent = planned.parent_local_id
                context = (
                    subtree_parent if parent < 0 else trace.set_span_in_context(started[parent])
                )
                started.append(start(server_tracer, planned, context))
        # Children end before their parents, as they do in a live server.
        for span, end_ns in reversed(ends):
            span.end(end_time=end_ns)
        emitted += len(ends)
        ends.clear()
    return emitted


# --- emission: OTLP protobuf messages -----------------------------------------------------------


def to_otlp_requests(
    requests: Iterable[SimulatedRequest],
    *,
    dialect: Dialect = DIALECT_TOKENTRACE,
    batch_spans: int = _DEFAULT_BATCH_SPANS,
    service_name: str = _DEFAULT_SERVICE_NAME,
    client_service_name: str = _DEFAULT_CLIENT_SERVICE_NAME,
    host_name: str | None = None,
    pid: int | None = None,
    max_token_offsets: int = spans.DEFAULT_MAX_TOKEN_OFFSETS,
) -> list[ExportTraceServiceRequest]:
    """The requests' spans as OTLP export requests of about ``batch_spans`` spans each.

    A request's spans never straddle two export requests. Server spans sit under a resource
    with ``service.name``/``host.name``/``process.pid``; client spans under their own resource
    (``client_service_name``), as a separate load generator would send them. Ids are the
    simulated ones (deterministic for a seed).

    Spans are written in protobuf wire format by the agent's encoder (``span_encoding``) and parsed
    once per batch.
    """
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    if batch_spans < 1:
        raise ValueError("batch_spans must be >= 1")
    _check_dialect(dialect)
    _check_max_token_offsets(max_token_offsets)
    host = socket.gethostname() if host_name is None else host_name
    process_id = os.getpid() if pid is None else pid
    scope = _scope_name(dialect)

    def head(service: str) -> ResourceScope:
        resource: dict[str, AttrValue] = {
            semconv.SERVICE_NAME: service,
            semconv.HOST_NAME: host,
            semconv.PROCESS_PID: process_id,
        }
        return ResourceScope(resource_attributes=resource, scope_name=scope)

    server_head = head(service_name)
    client_head = head(client_service_name)
    batches: list[ExportTraceServiceRequest] = []
    server_parts: list[bytes] = []
    client_parts: list[bytes] = []
    in_batch = 0
    for request in requests:
        if in_batch >= batch_spans:
            encoded = span_encoding.export_request(
                ((server_head, server_parts), (client_head, client_parts))
            )
            batches.append(ExportTraceServiceRequest.FromString(encoded))
            server_parts, client_parts = [], []
            in_batch = 0
        trace_id = request.trace_id
        base = request.span_id_base
        if dialect == DIALECT_VLLM:
            vllm = _vllm_span(request)
            server_parts.append(
                span_encoding.encode_span(vllm, trace_id=trace_id, span_id=span_id_bytes(base))
            )
            in_batch += 1
            continue
        client = _client_span(request)
        client_id = b""
        if client is not None:
            client_id = span_id_bytes(base + CLIENT_SPAN_OFFSET)
            client_parts.append(
                span_encoding.encode_span(client, trace_id=trace_id, span_id=client_id)
            )
            in_batch += 1
        http = _http_span(request, has_client=client is not None)
        finished = request.finished_request()
        server_parts.append(
            span_encoding.encode_span(
                http,
                trace_id=trace_id,
                span_id=finished.parent_span_id,
                parent_span_id=client_id,
            )
        )
        subtree = span_encoding.encode_span_tree(
            spans.plan_spans(finished, max_token_offsets=max_token_offsets),
            trace_id=trace_id,
            parent_span_id=finished.parent_span_id,
            span_ids=itertools.count(base + FIRST_SUBTREE_SPAN_OFFSET).__next__,
        )
        server_parts += subtree
        in_batch += 1 + len(subtree)
    if in_batch:
        encoded = span_encoding.export_request(
            ((server_head, server_parts), (client_head, client_parts))
        )
        batches.append(ExportTraceServiceRequest.FromString(encoded))
    return batches
