"""Normalise every supported span dialect into one ``RequestTimeline`` per request.

Dialects, read straight from the OTLP protobuf spans:

``tokentrace``
    tokentrace's own ``llm.request`` span with its phase children (``llm.queue``,
    ``llm.prefill`` and its ``llm.prefill.chunk`` children, ``llm.decode``, ``llm.preempted``,
    ``llm.postprocess``), matched by ``parent_span_id``. Engine arrival (``engine_arrival``) is the
    start of ``llm.queue`` (when the engine queued the request), else of ``llm.request``; the
    time from ``llm.request``'s start to it (the hand-off to the engine) belongs to ``http``.
``vllm``
    vLLM's built-in ``llm_request`` span: no children, phase latencies as double seconds. The
    boundaries are reconstructed from the span start (vLLM's arrival) and clamped into the span.
    When a trace holds both dialects for the same request (same request id or same parent span),
    tokentrace's richer spans win and the vLLM span is skipped.
``sglang``
    SGLang's built-in tracing (``--enable-trace``): a root span ``" Req <id>"`` (scope
    ``sglang server``) with the older GenAI attributes (latencies in seconds, counts as strings),
    a ``Tokenizer(...)`` and a ``Scheduler [TP n] ...`` thread span under it and, under the
    scheduler's, ``request_process`` (engine arrival), ``prefill_waiting``, ``prefill_forward``
    (first scheduled at its start), ``decode_waiting``, ``decode_forward`` and one
    ``decode_loop`` per output token after the first. First and last token are on the frontend's
    clock, as SGLang's own latencies and the client's stream see them: the root's start plus
    SGLang's TTFT, plus its decode time (without them: the end of ``prefill_forward`` and of the
    last ``decode_loop``). The per-token times are the ``decode_loop`` ends after the end of
    ``prefill_forward`` (one clock: the scheduler's). A phase that appears more than once
    (tensor-parallel ranks, retraction) counts from its earliest span. What these spans cannot
    say is in ``NOT_REPORTED``.
``genai_client``
    A GenAI semantic-convention client span (kind CLIENT with ``gen_ai.operation.name``, or
    tokentrace's ``llm.client.request``) with no server-side request span beneath it: a
    client-only timeline. When several such spans nest, only the innermost one counts.

For server-side requests, the nearest SERVER-kind ancestor (e.g. the HTTP server span) gives
``server_start``/``server_end`` (else the request span itself: its start and end), and the
nearest CLIENT-kind ancestor gives the client view. Spans of no known dialect produce nothing.

Robustness: nothing here raises on malformed input. Attributes of the wrong type, negative token
counts, non-finite or negative latencies, zero (unset) timestamps and phase spans that end before
they start are skipped as if absent (``span_attributes`` reads them); parent cycles are cut by a
depth bound.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, TypeAlias, cast

from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import semconv
from tokentrace.processors import native
from tokentrace.processors.model import AssembledTrace, RequestTimeline, SpanRef
from tokentrace.processors.span_attributes import (
    OTHER_VALUE,
    PlainValue,
    attribute_slots,
    error_of,
    plain_bool,
    plain_first_str,
    plain_float,
    plain_int,
    plain_seconds_ns,
    plain_str,
    plain_str_tuple,
    plain_timestamp,
    span_times,
)

DIALECT_TOKENTRACE: Final = "tokentrace"
DIALECT_VLLM: Final = "vllm"
DIALECT_SGLANG: Final = "sglang"
DIALECT_GENAI_CLIENT: Final = "genai_client"
NOT_REPORTED: Final[Mapping[str, tuple[str, ...]]] = {
    DIALECT_SGLANG: (
        "the HTTP server span",
        "the client and network side",
        "engine steps",
        "preemption",
        "GPU samples",
        "cold start",
        "the operation",
    ),
}
"""Per dialect: what its spans cannot tell, so every budget of such a request lacks it (the
time it took sits in a neighbouring segment or is not there at all); the timeline carries it
(``not_reported``) and ``tokentrace explain`` and the API name it."""


_AGENT_SOURCE: Final = "the engine's instrumentation"
"""Who could not tell, for an ``llm.request`` whose ``tokentrace.not_reported_by`` is absent."""


def dialect_not_reported(dialect: str) -> tuple[str | None, tuple[str, ...]]:
    """(source, what it cannot tell) for a request in ``dialect``'s spans (``NOT_REPORTED``)."""
    missing = NOT_REPORTED.get(dialect, ())
    return (f"{dialect}'s own spans" if missing else None), missing


UNKNOWN: Final = "unknown"
"""Model or operation name when no span says."""

_KIND_SERVER: Final = Span.SPAN_KIND_SERVER
_KIND_CLIENT: Final = Span.SPAN_KIND_CLIENT

_PHASE_SPANS: Final = frozenset(
    {
        semconv.SPAN_QUEUE,
        semconv.SPAN_PREFILL,
        semconv.SPAN_PREFILL_CHUNK,
        semconv.SPAN_DECODE,
        semconv.SPAN_PREEMPTED,
        semconv.SPAN_POSTPROCESS,
        semconv.SPAN_ENGINE_STEP,
    }
)

# Attribute keys read from a request span (any dialect), each to a slot of a small list so
# that one pass over the span's attributes finds all of them without building a dict.
_REQUEST_KEYS: Final = (
    semconv.GEN_AI_REQUEST_MODEL,
    semconv.GEN_AI_RESPONSE_MODEL,
    semconv.GEN_AI_OPERATION_NAME,
    semconv.GEN_AI_USAGE_INPUT_TOKENS,
    semconv.GEN_AI_USAGE_OUTPUT_TOKENS,
    semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
    semconv.GEN_AI_RESPONSE_FINISH_REASONS,
    semconv.REQUEST_ID,
    semconv.COLD_START_READY_TIME,
    semconv.QUEUE_REQUESTS_AHEAD,
    semconv.QUEUE_RUNNING_AT_ARRIVAL,
    semconv.QUEUE_MAX_RUNNING,
    semconv.PROMPT_PREFIX_HASH,
    semconv.CLIENT_FIRST_TOKEN_TIME,
    semconv.CLIENT_FIRST_BYTE_TIME,
    semconv.CLIENT_STREAM,
    semconv.OPENLLMETRY_IS_STREAMING,
    semconv.CLIENT_CONNECTION_REUSED,
    semconv.CLIENT_CONNECT_NS,
    semconv.CLIENT_SEND_WAIT_NS,
    semconv.CLIENT_FIRST_TOKEN_READ_WAIT_NS,
    semconv.CLIENT_READ_WAIT_NS,
    semconv.CLIENT_RTT_NS,
    semconv.GEN_AI_RESPONSE_ID,
    semconv.VLLM_LATENCY_TTFT,
    semconv.VLLM_LATENCY_QUEUE,
    semconv.VLLM_LATENCY_PREFILL,
    semconv.VLLM_LATENCY_DECODE,
    semconv.VLLM_USAGE_PROMPT_TOKENS,
    semconv.VLLM_USAGE_COMPLETION_TOKENS,
    semconv.VLLM_REQUEST_ID,
    semconv.SGLANG_USAGE_CACHED_TOKENS,
    semconv.NOT_REPORTED,
    semconv.NOT_REPORTED_BY,
)
_REQUEST_SLOT: Final = {key: slot for slot, key in enumerate(_REQUEST_KEYS)}
(
    _MODEL,
    _RESPONSE_MODEL,
    _OPERATION,
    _INPUT_TOKENS,
    _OUTPUT_TOKENS,
    _CACHED_TOKENS,
    _FINISH_REASONS,
    _REQUEST_ID,
    _READY_TIME,
    _REQUESTS_AHEAD,
    _RUNNING_AT_ARRIVAL,
    _MAX_RUNNING,
    _PREFIX_HASH,
    _CLIENT_FIRST_TOKEN,
    _CLIENT_FIRST_BYTE,
    _CLIENT_STREAM,
    _OPENLLMETRY_STREAM,
    _CLIENT_REUSED,
    _CLIENT_CONNECT,
    _CLIENT_SEND_WAIT,
    _CLIENT_FIRST_TOKEN_READ_WAIT,
    _CLIENT_READ_WAIT,
    _CLIENT_RTT,
    _RESPONSE_ID,
    _VLLM_TTFT,
    _VLLM_QUEUE,
    _VLLM_PREFILL,
    _VLLM_DECODE,
    _VLLM_PROMPT_TOKENS,
    _VLLM_COMPLETION_TOKENS,
    _VLLM_REQUEST_ID,
    _SGLANG_CACHED_TOKENS,
    _NOT_REPORTED,
    _NOT_REPORTED_BY,
) = range(len(_REQUEST_KEYS))
_VLLM_MARKER_SLOTS: Final = (_VLLM_TTFT, _VLLM_QUEUE, _VLLM_PREFILL, _VLLM_DECODE, _VLLM_REQUEST_ID)

_DECODE_SLOT: Final = {  # the decode span's attributes, in the order _apply_decode_attributes reads
    key: slot
    for slot, key in enumerate(
        (
            semconv.DECODE_TOKEN_OFFSETS,
            semconv.DECODE_TOKEN_OFFSETS_DROPPED,
            semconv.GPU_MEMORY_BANDWIDTH_PEAK_RATIO,
            semconv.DECODE_ROOFLINE_RATIO,
            semconv.DECODE_OUTLIER_STEPS_WITH_PREFILL,
        )
    )
}
_DECODE_INT_ARRAYS: Final = frozenset({_DECODE_SLOT[semconv.DECODE_TOKEN_OFFSETS]})
_PREFILL_TOKENS_SLOT: Final = {semconv.PREFILL_CHUNK_TOKENS: 0}  # a prefill or prefill chunk span's
_STEP_PREFILL_TOKENS_SLOT: Final = {semconv.ENGINE_STEP_PREFILL_TOKENS: 0}  # an engine step's
_HTTP_SERVER_SLOT: Final = {  # the HTTP server span's, in the order _apply_http_server reads
    key: slot
    for slot, key in enumerate(
        (
            semconv.HTTP_RECEIVE_WAIT_NS,
            semconv.HTTP_FIRST_BODY_TIME,
            semconv.PROXY_NOT_REPORTED,
            semconv.PROXY_ENGINE,
        )
    )
}

_Slots: TypeAlias = "list[PlainValue | None]"


# --- request span attributes, by slot -----------------------------------------------------------
def _read_slots(
    span: Span,
    wire: bytes | None,
    slot_of: dict[str, int],
    int_arrays: frozenset[int] = frozenset(),
) -> _Slots:
    """The plain values of the attributes whose keys ``slot_of`` maps to a slot
    (``span_attributes.attribute_slots``), read from the span's bytes as received (``wire``)
    where C can: no protobuf object per attribute."""
    if wire is not None:
        slots = native.attribute_slots(wire, slot_of, len(slot_of), OTHER_VALUE, int_arrays)
        if slots is not None:
            return slots
    return attribute_slots(span, slot_of, len(slot_of), int_arrays)


def _read_request_slots(ref: SpanRef) -> _Slots:
    return _read_slots(ref.span, ref.wire, _REQUEST_SLOT)


def _model_and_operation(slots: _Slots, client_slots: _Slots | None) -> tuple[str, str]:
    """Model and operation from the request span, else from its client span's GenAI attributes."""
    model = plain_str(slots[_MODEL]) or plain_str(slots[_RESPONSE_MODEL])
    operation = plain_str(slots[_OPERATION])
    if (model is None or operation is None) and client_slots is not None:
        model = model or plain_str(client_slots[_MODEL]) or plain_str(client_slots[_RESPONSE_MODEL])
        operation = operation or plain_str(client_slots[_OPERATION])
    return model or UNKNOWN, operation or UNKNOWN


# --- the trace index -----------------------------------------------------------------------------
class _TraceIndex:
    """One pass over a trace: spans by id, request spans by dialect, phase spans by parent."""

    __slots__ = (
        "by_id",
        "client_candidates",
        "phases_by_parent",
        "sglang",
        "sglang_by_parent",
        "tokentrace",
        "vllm",
    )

    def __init__(self, trace: AssembledTrace) -> None:
        self.by_id: dict[bytes, SpanRef] = {}
        self.tokentrace: list[SpanRef] = []
        self.vllm: list[SpanRef] = []
        self.client_candidates: list[SpanRef] = []
        self.phases_by_parent: dict[bytes, list[Span]] = {}
        self.sglang: list[SpanRef] = []
        self.sglang_by_parent: dict[bytes, list[Span]] = {}
        phase_names = _PHASE_SPANS
        for ref in trace.spans:
            span = ref.span
            self.by_id[span.span_id] = ref
            name = span.name
            if name in phase_names:
                self.phases_by_parent.setdefault(span.parent_span_id, []).append(span)
            elif name == semconv.SPAN_REQUEST:
                self.tokentrace.append(ref)
            elif name == semconv.VLLM_SPAN_REQUEST:
                self.vllm.append(ref)
            elif ref.scope.name == semconv.SGLANG_TRACING_SCOPE:
                if semconv.SGLANG_SPAN_REQUEST_MARK in name:
                    self.sglang.append(ref)
                else:
                    self.sglang_by_parent.setdefault(span.parent_span_id, []).append(span)
            elif span.kind == _KIND_CLIENT:
                self.client_candidates.append(ref)

    def ancestors(self, span: Span) -> list[SpanRef]:
        """The parent chain within the trace, nearest first (bounded: cycles end the walk)."""
        chain: list[SpanRef] = []
        parent_id = span.parent_span_id
        limit = len(self.by_id)
        while parent_id and len(chain) < limit:
            parent = self.by_id.get(parent_id)
            if parent is None:
                break
            chain.append(parent)
            parent_id = parent.span.parent_span_id
        return chain


class _Context:
    """Server and client views around one request span, from its ancestors."""

    __slots__ = ("client", "client_slots", "server")

    def __init__(self, chain: list[SpanRef], *, self_is_server: SpanRef | None = None) -> None:
        self.server: SpanRef | None = self_is_server
        self.client: SpanRef | None = None
        self.client_slots: _Slots | None = None
        for ref in chain:
            kind = ref.span.kind
            if kind == _KIND_SERVER and self.server is None:
                self.server = ref
            elif kind == _KIND_CLIENT:
                self.client = ref
                break

    def apply(self, timeline: RequestTimeline, *, request_start: int | None = None) -> None:
        """Server and client times; without a server span the server view is the request span
        (``request_start``, default the engine arrival, to its end)."""
        server = self.server
        if server is not None:
            times = span_times(server.span)
            if times is not None:
                timeline.server_start, timeline.server_end = times
                _apply_http_server(timeline, server)
        if timeline.server_start is None:
            timeline.server_start = (
                timeline.engine_arrival if request_start is None else request_start
            )
            timeline.server_end = timeline.end
        client = self.client
        if client is not None:
            _apply_client(timeline, client.span, self.slots_of_client())

    def slots_of_client(self) -> _Slots | None:
        if self.client is None:
            return None
        if self.client_slots is None:
            self.client_slots = _read_request_slots(self.client)
        return self.client_slots


def _apply_client(timeline: RequestTimeline, client: Span, slots: _Slots | None) -> None:
    times = span_times(client)
    if times is not None:
        timeline.client_start, timeline.client_end = times
    if slots is None:
        return
    timeline.client_first_token = plain_timestamp(slots[_CLIENT_FIRST_TOKEN])
    timeline.client_first_byte = plain_timestamp(slots[_CLIENT_FIRST_BYTE])
    stream = plain_bool(slots[_CLIENT_STREAM])
    timeline.client_stream = (
        stream if stream is not None else plain_bool(slots[_OPENLLMETRY_STREAM])
    )
    timeline.client_connection_reused = plain_bool(slots[_CLIENT_REUSED])
    timeline.client_connect_ns = plain_int(slots[_CLIENT_CONNECT])
    timeline.client_send_wait_ns = plain_int(slots[_CLIENT_SEND_WAIT])
    timeline.client_first_token_read_wait_ns = plain_int(slots[_CLIENT_FIRST_TOKEN_READ_WAIT])
    timeline.client_read_wait_ns = plain_int(slots[_CLIENT_READ_WAIT])
    timeline.client_rtt_ns = plain_int(slots[_CLIENT_RTT])


def _apply_http_server(timeline: RequestTimeline, server: SpanRef) -> None:
    """The HTTP server span's own facts: the kernel wait before the app, the first body."""
    receive_wait, first_body, not_reported, engine = _read_slots(
        server.span, server.wire, _HTTP_SERVER_SLOT
    )
    if receive_wait is not None:
        timeline.http_receive_wait_ns = plain_int(receive_wait)
    if first_body is not None:
        timeline.server_first_body = plain_timestamp(first_body)
    if not_reported is not None:
        timeline.not_reported = plain_str_tuple(not_reported)
    if engine is not None:
        timeline.not_reported_by = f"{plain_str(engine)}'s timing report (tokentrace proxy)"


# --- dialects ------------------------------------------------------------------------------------
def _tokentrace_timeline(trace_id: bytes, index: _TraceIndex, ref: SpanRef) -> RequestTimeline:
    span = ref.span
    slots = _read_request_slots(ref)
    context = _Context(index.ancestors(span))
    model, operation = _model_and_operation(slots, context.slots_of_client())
    start = span.start_time_unix_nano or None
    end = span.end_time_unix_nano or None
    timeline = RequestTimeline(
        trace_id=trace_id,
        span_id=span.span_id,
        dialect=DIALECT_TOKENTRACE,
        service=ref.service,
        model=model,
        operation=operation,
        engine_arrival=start,
        end=end,
        ready=plain_timestamp(slots[_READY_TIME]),
        input_tokens=plain_int(slots[_INPUT_TOKENS]),
        output_tokens=plain_int(slots[_OUTPUT_TOKENS]),
        cached_tokens=plain_int(slots[_CACHED_TOKENS]),
        finish_reason=plain_first_str(slots[_FINISH_REASONS]),
        request_id=plain_str(slots[_REQUEST_ID]),
        status_error=error_of(span),
        requests_ahead=plain_int(slots[_REQUESTS_AHEAD]),
        running_at_arrival=plain_int(slots[_RUNNING_AT_ARRIVAL]),
        max_running=plain_int(slots[_MAX_RUNNING]),
        prefix_hash=plain_str(slots[_PREFIX_HASH]),
    )
    not_reported = plain_str_tuple(slots[_NOT_REPORTED])
    if not_reported:
        timeline.not_reported = not_reported
        timeline.not_reported_by = plain_str(slots[_NOT_REPORTED_BY]) or _AGENT_SOURCE
    _apply_phases(timeline, index, span.span_id)
    context.apply(timeline, request_start=start)
    return timeline


def _apply_phases(timeline: RequestTimeline, index: _TraceIndex, request_id: bytes) -> None:
    """Boundaries, chunks, preemptions and decode details from the request's phase children.

    A phase that appears more than once (e.g. re-queued) counts from its earliest span.
    """
    queue: Span | None = None
    prefill: Span | None = None
    decode: Span | None = None
    # The engine exports, under the request, the steps inside its inter-token outliers.
    outlier_steps = outlier_steps_with_prefill = 0
    for child in index.phases_by_parent.get(request_id, ()):
        start = child.start_time_unix_nano
        end = child.end_time_unix_nano
        if not start or end < start:
            continue  # unset or negative duration: malformed
        name = child.name
        if name == semconv.SPAN_QUEUE:
            if queue is None or start < queue.start_time_unix_nano:
                queue = child
        elif name == semconv.SPAN_PREFILL:
            if prefill is None or start < prefill.start_time_unix_nano:
                prefill = child
        elif name == semconv.SPAN_DECODE:
            if decode is None or start < decode.start_time_unix_nano:
                decode = child
        elif name == semconv.SPAN_PREEMPTED:
            timeline.preempted.append((start, end))
        elif name == semconv.SPAN_ENGINE_STEP:
            outlier_steps += 1
            prefill_tokens = _int_of(index, child, _STEP_PREFILL_TOKENS_SLOT) or 0
            if prefill_tokens > 0:
                outlier_steps_with_prefill += 1
            timeline.engine_steps.append((start, end, prefill_tokens))
    if len(timeline.preempted) > 1:
        timeline.preempted.sort()
    if len(timeline.engine_steps) > 1:
        timeline.engine_steps.sort()

    if queue is not None:
        # Engine arrival: the engine queued the request (the request span may start earlier,
        # at the API server's arrival). Budget clamping keeps it inside the request.
        timeline.engine_arrival = queue.start_time_unix_nano
        timeline.first_scheduled = queue.end_time_unix_nano
    elif prefill is not None:
        timeline.first_scheduled = prefill.start_time_unix_nano
    if prefill is not None:
        timeline.first_token = prefill.end_time_unix_nano
        _apply_prefill_chunks(timeline, index, prefill)
    elif decode is not None:
        timeline.first_token = decode.start_time_unix_nano
    if decode is not None:
        timeline.last_token = decode.end_time_unix_nano
        _apply_decode_attributes(timeline, index, decode)
    elif timeline.output_tokens == 1:
        timeline.last_token = timeline.first_token
    if outlier_steps and timeline.outlier_steps_with_prefill is None:
        timeline.outlier_steps_with_prefill = outlier_steps_with_prefill


def _apply_prefill_chunks(timeline: RequestTimeline, index: _TraceIndex, span: Span) -> None:
    chunks: list[tuple[int, int, int]] = []
    for child in index.phases_by_parent.get(span.span_id, ()):
        if child.name != semconv.SPAN_PREFILL_CHUNK:
            continue
        times = span_times(child)
        if times is None:
            continue
        tokens = _int_of(index, child, _PREFILL_TOKENS_SLOT)
        chunks.append((times[0], times[1], tokens or 0))
    if not chunks:
        tokens = _int_of(index, span, _PREFILL_TOKENS_SLOT)
        if tokens is None and timeline.input_tokens is not None:
            # Without an explicit count, the prefill computed the prompt minus its cached part.
            tokens = max(0, timeline.input_tokens - (timeline.cached_tokens or 0))
        chunks.append((span.start_time_unix_nano, span.end_time_unix_nano, tokens or 0))
    elif len(chunks) > 1:
        chunks.sort()
    timeline.prefill_chunks = chunks


def _int_of(index: _TraceIndex, span: Span, slot_of: dict[str, int]) -> int | None:
    """``plain_int`` of the one attribute ``slot_of`` names (the last, if given twice), read
    from the span's bytes as received where C can."""
    (value,) = _read_slots(span, _received_wire(index, span), slot_of)
    return plain_int(value)


def _received_wire(index: _TraceIndex, span: Span) -> bytes | None:
    """The phase span's bytes as received (``SpanRef.wire``), if the index holds it."""
    ref = index.by_id.get(span.span_id)
    return ref.wire if ref is not None and ref.span is span else None


def _apply_decode_attributes(timeline: RequestTimeline, index: _TraceIndex, decode: Span) -> None:
    offsets, dropped, bandwidth, roofline, outliers = _read_slots(
        decode, _received_wire(index, decode), _DECODE_SLOT, _DECODE_INT_ARRAYS
    )
    if offsets is not None:
        timeline.token_offsets_us = cast(Sequence[int], offsets)  # an int array slot: array('q')
    if dropped is not None:
        timeline.token_offsets_dropped = plain_int(dropped) or 0
    if bandwidth is not None:
        timeline.decode_bandwidth_peak_ratio = plain_float(bandwidth)
    if roofline is not None:
        timeline.decode_roofline_ratio = plain_float(roofline)
    if outliers is not None:
        timeline.outlier_steps_with_prefill = plain_int(outliers)


def _is_vllm_span(ref: SpanRef, slots: _Slots) -> bool:
    """Name match plus vLLM's scope or one of its own attributes (the name alone is generic)."""
    if ref.scope.name == semconv.VLLM_TRACING_SCOPE:
        return True
    return any(slots[slot] is not None for slot in _VLLM_MARKER_SLOTS)


def _vllm_timeline(
    trace_id: bytes, index: _TraceIndex, ref: SpanRef, slots: _Slots
) -> RequestTimeline:
    span = ref.span
    self_server = ref if span.kind == _KIND_SERVER else None
    context = _Context(index.ancestors(span), self_is_server=self_server)
    model, operation = _model_and_operation(slots, context.slots_of_client())
    start = span.start_time_unix_nano or None
    end = span.end_time_unix_nano or None
    output_tokens = plain_int(slots[_VLLM_COMPLETION_TOKENS])
    if output_tokens is None:
        output_tokens = plain_int(slots[_OUTPUT_TOKENS])
    input_tokens = plain_int(slots[_VLLM_PROMPT_TOKENS])
    if input_tokens is None:
        input_tokens = plain_int(slots[_INPUT_TOKENS])
    timeline = RequestTimeline(
        trace_id=trace_id,
        span_id=span.span_id,
        dialect=DIALECT_VLLM,
        service=ref.service,
        model=model,
        operation=operation,
        end=end,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cached_tokens=plain_int(slots[_CACHED_TOKENS]),
        finish_reason=plain_first_str(slots[_FINISH_REASONS]),
        request_id=plain_str(slots[_VLLM_REQUEST_ID]) or plain_str(slots[_REQUEST_ID]),
        status_error=error_of(span),
    )
    if start is not None and end is not None and end >= start:
        _reconstruct_vllm(timeline, slots, start, end)
    context.apply(timeline)
    return timeline


def _reconstruct_vllm(timeline: RequestTimeline, slots: _Slots, start: int, end: int) -> None:
    """Boundaries from vLLM's second-valued latencies, each clamped into the span."""

    def clamp(value: int) -> int:
        return min(max(value, start), end)

    timeline.server_start = start
    timeline.server_end = end
    ttft = plain_seconds_ns(slots[_VLLM_TTFT])
    if ttft is None:
        return  # without TTFT no boundary can be placed; the budget sees only the span itself
    first_token = clamp(start + ttft)
    timeline.first_token = first_token
    prefill = plain_seconds_ns(slots[_VLLM_PREFILL])
    first_scheduled = None if prefill is None else clamp(first_token - prefill)
    timeline.first_scheduled = first_scheduled
    queue = plain_seconds_ns(slots[_VLLM_QUEUE])
    if first_scheduled is not None and queue is not None:
        timeline.engine_arrival = clamp(first_scheduled - queue)
    else:
        timeline.engine_arrival = start
    decode = plain_seconds_ns(slots[_VLLM_DECODE])
    if decode is not None:
        timeline.last_token = clamp(first_token + decode)
    elif timeline.output_tokens == 1:
        timeline.last_token = first_token


def _count(value: PlainValue | None) -> int | None:
    """A non-negative count, as an integer or (SGLang) a string of digits."""
    number = plain_int(value)
    if number is not None:
        return number
    text = plain_str(value)
    return int(text) if text is not None and text.isdigit() else None


def _sglang_finish_reason(value: PlainValue | None) -> str | None:
    """SGLang writes the finish reasons as a JSON list in a string (``'["length"]'``)."""
    text = plain_first_str(value)
    if text is None or not text.startswith("["):
        return text
    try:
        reasons = json.loads(text)
    except ValueError:
        return None
    first = reasons[0] if isinstance(reasons, list) and reasons else None
    return first if isinstance(first, str) else None


class _SglangPhases:
    """The earliest span of each phase SGLang reports under a request's thread spans, and the
    ``decode_loop`` spans under the earliest ``decode_forward``."""

    __slots__ = ("decode", "decode_loops", "prefill", "request_process", "waiting")

    def __init__(self, index: _TraceIndex, root: Span) -> None:
        self.request_process: Span | None = None
        self.waiting: Span | None = None
        self.prefill: Span | None = None
        self.decode: Span | None = None
        by_parent = index.sglang_by_parent
        for thread in by_parent.get(root.span_id, ()):
            for child in by_parent.get(thread.span_id, ()):
                if span_times(child) is None:
                    continue  # unset or negative duration: malformed
                name = child.name
                if name == semconv.SGLANG_SPAN_REQUEST_PROCESS:
                    self.request_process = _earlier(self.request_process, child)
                elif name == semconv.SGLANG_SPAN_PREFILL_WAITING:
                    self.waiting = _earlier(self.waiting, child)
                elif name == semconv.SGLANG_SPAN_PREFILL_FORWARD:
                    self.prefill = _earlier(self.prefill, child)
                elif name == semconv.SGLANG_SPAN_DECODE_FORWARD:
                    self.decode = _earlier(self.decode, child)
        loops: list[Span] = []
        if self.decode is not None:
            loops = [
                child
                for child in by_parent.get(self.decode.span_id, ())
                if child.name == semconv.SGLANG_SPAN_DECODE_LOOP and span_times(child) is not None
            ]
            loops.sort(key=lambda loop: loop.start_time_unix_nano)
        self.decode_loops = loops

    def token_offsets_us(self) -> list[int]:
        """Each output token's time after the first, in µs, on one clock (the scheduler's): the
        prefill's end is the first token, each loop's end one more; a loop that ends before the
        prefill does is malformed and counts as 0. Empty without a prefill or decode loops."""
        prefill = self.prefill
        if prefill is None or not self.decode_loops:
            return []
        first = prefill.end_time_unix_nano
        return [0] + [max(0, loop.end_time_unix_nano - first) // 1000 for loop in self.decode_loops]


def sglang_token_offsets_us(
    spans: Iterable[tuple[InstrumentationScope, Span]], request_span_id: bytes
) -> list[int] | None:
    """The token offsets of the SGLang request whose root span is ``request_span_id``, read
    from its trace's spans as ``normalize`` reads them (for readers of stored traces); None when
    that span is not an SGLang request."""
    refs = [SpanRef(span, _NO_RESOURCE, scope, "") for scope, span in spans]
    index = _TraceIndex(AssembledTrace(b"", refs))
    for ref in index.sglang:
        if ref.span.span_id == request_span_id:
            return _SglangPhases(index, ref.span).token_offsets_us()
    return None


_NO_RESOURCE: Final = Resource()


def _earlier(current: Span | None, candidate: Span) -> Span:
    if current is None or candidate.start_time_unix_nano < current.start_time_unix_nano:
        return candidate
    return current


def _sglang_timeline(trace_id: bytes, index: _TraceIndex, ref: SpanRef) -> RequestTimeline:
    span = ref.span
    slots = _read_request_slots(ref)
    context = _Context(index.ancestors(span))
    model, operation = _model_and_operation(slots, context.slots_of_client())
    start = span.start_time_unix_nano or None
    end = span.end_time_unix_nano or None
    input_tokens = _count(slots[_VLLM_PROMPT_TOKENS])
    cached_tokens = _count(slots[_SGLANG_CACHED_TOKENS])
    timeline = RequestTimeline(
        trace_id=trace_id,
        span_id=span.span_id,
        dialect=DIALECT_SGLANG,
        service=ref.service,
        model=model,
        operation=operation,
        end=end,
        input_tokens=input_tokens,
        output_tokens=_count(slots[_VLLM_COMPLETION_TOKENS]),
        cached_tokens=cached_tokens,
        finish_reason=_sglang_finish_reason(slots[_FINISH_REASONS]),
        request_id=plain_str(slots[_VLLM_REQUEST_ID]),
        status_error=error_of(span),
    )
    timeline.not_reported_by, timeline.not_reported = dialect_not_reported(DIALECT_SGLANG)
    if start is not None and end is not None and end >= start:
        _place_sglang_phases(timeline, _SglangPhases(index, span), slots, start, end)
    context.apply(timeline, request_start=start)
    return timeline


def _place_sglang_phases(
    timeline: RequestTimeline, phases: _SglangPhases, slots: _Slots, start: int, end: int
) -> None:
    """Boundaries from the phase spans and SGLang's own TTFT and decode time, each clamped into
    the root span."""

    def clamp(value: int) -> int:
        return min(max(value, start), end)

    arrival = phases.request_process or phases.waiting or phases.prefill
    timeline.engine_arrival = start if arrival is None else clamp(arrival.start_time_unix_nano)
    prefill = phases.prefill
    if prefill is not None:
        timeline.first_scheduled = clamp(prefill.start_time_unix_nano)
        computed = max(0, (timeline.input_tokens or 0) - (timeline.cached_tokens or 0))
        timeline.prefill_chunks = [
            (prefill.start_time_unix_nano, prefill.end_time_unix_nano, computed)
        ]
    ttft_ns = plain_seconds_ns(slots[_VLLM_TTFT])
    if ttft_ns is not None:
        timeline.first_token = clamp(start + ttft_ns)
    elif prefill is not None:
        timeline.first_token = clamp(prefill.end_time_unix_nano)
    first_token = timeline.first_token
    loops = phases.decode_loops
    decode_ns = plain_seconds_ns(slots[_VLLM_DECODE])
    if first_token is not None:
        if ttft_ns is not None and decode_ns is not None:
            # The frontend's clock, as for the first token: the last token arrives with the
            # finished output (SGLang's decode time is the finish minus the first token).
            timeline.last_token = clamp(first_token + decode_ns)
        elif loops:
            last_loop_end = max(loop.end_time_unix_nano for loop in loops)
            timeline.last_token = max(first_token, clamp(last_loop_end))
        elif phases.decode is not None:
            timeline.last_token = max(first_token, clamp(phases.decode.end_time_unix_nano))
        elif timeline.output_tokens == 1:
            timeline.last_token = first_token
    timeline.token_offsets_us = phases.token_offsets_us()


def _client_timeline(trace_id: bytes, ref: SpanRef, slots: _Slots) -> RequestTimeline:
    span = ref.span
    model, operation = _model_and_operation(slots, None)
    timeline = RequestTimeline(
        trace_id=trace_id,
        span_id=span.span_id,
        dialect=DIALECT_GENAI_CLIENT,
        service=ref.service,
        model=model,
        operation=operation,
        input_tokens=plain_int(slots[_INPUT_TOKENS]),
        output_tokens=plain_int(slots[_OUTPUT_TOKENS]),
        cached_tokens=plain_int(slots[_CACHED_TOKENS]),
        finish_reason=plain_first_str(slots[_FINISH_REASONS]),
        request_id=plain_str(slots[_REQUEST_ID]) or plain_str(slots[_RESPONSE_ID]),
        status_error=error_of(span),
    )
    _apply_client(timeline, span, slots)
    return timeline


# --- entry point ---------------------------------------------------------------------------------
def normalize(trace: AssembledTrace) -> list[RequestTimeline]:
    """One timeline per request found in ``trace`` (usually one; none for unrelated traces).

    Never raises: malformed values are skipped where they are read, and a request whose spans
    still cannot be read (e.g. a span that is not a protobuf ``Span``) is left out alone.
    """
    try:
        index = _TraceIndex(trace)
    except Exception:  # defensive: malformed input must not break the pipeline
        return []
    trace_id = trace.trace_id
    timelines: list[RequestTimeline] = []
    server_request_spans: list[Span] = []

    tokentrace_parents: set[bytes] = set()
    tokentrace_ids: set[str] = set()
    for ref in index.tokentrace:
        server_request_spans.append(ref.span)
        try:
            timeline = _tokentrace_timeline(trace_id, index, ref)
        except Exception:  # defensive, as above
            continue
        timelines.append(timeline)
        if ref.span.parent_span_id:
            tokentrace_parents.add(ref.span.parent_span_id)
        if timeline.request_id:
            tokentrace_ids.add(timeline.request_id)

    for ref in index.vllm:
        try:
            slots = _read_request_slots(ref)
            if not _is_vllm_span(ref, slots):
                continue
            server_request_spans.append(ref.span)
            if ref.span.parent_span_id in tokentrace_parents:
                continue  # the same request, already read from tokentrace's own spans
            request_id = plain_str(slots[_VLLM_REQUEST_ID])
            if request_id is not None and request_id in tokentrace_ids:
                continue
            timelines.append(_vllm_timeline(trace_id, index, ref, slots))
        except Exception:  # defensive, as above
            continue

    for ref in index.sglang:
        try:
            server_request_spans.append(ref.span)
            timelines.append(_sglang_timeline(trace_id, index, ref))
        except Exception:  # defensive, as above
            continue

    if index.client_candidates:
        with contextlib.suppress(Exception):  # defensive, as above
            timelines.extend(_client_only_timelines(trace_id, index, server_request_spans))
    return timelines


def _client_only_timelines(
    trace_id: bytes, index: _TraceIndex, server_request_spans: list[Span]
) -> list[RequestTimeline]:
    """GenAI client spans with no server-side request (and no other GenAI client) beneath."""
    # Ancestors of a server-side request first: they are never client-only requests, and
    # skipping them saves reading their attributes (usually the only client span there is).
    covered: set[bytes] = set()
    for span in server_request_spans:
        covered.update(ref.span.span_id for ref in index.ancestors(span))
    candidates: list[tuple[SpanRef, _Slots]] = []
    for ref in index.client_candidates:
        if ref.span.span_id in covered:
            continue
        slots = _read_request_slots(ref)
        if ref.span.name == semconv.SPAN_CLIENT_REQUEST or slots[_OPERATION] is not None:
            candidates.append((ref, slots))
    if not candidates:
        return []
    # A candidate with another candidate beneath it is not the innermost one. (Candidates under
    # a server-side request were skipped above; their ancestors are covered already.)
    for ref, _ in candidates:
        covered.update(ancestor.span.span_id for ancestor in index.ancestors(ref.span))
    return [
        _client_timeline(trace_id, ref, slots)
        for ref, slots in candidates
        if ref.span.span_id not in covered
    ]
