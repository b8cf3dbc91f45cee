"""Build OTLP protobuf spans and ``AssembledTrace`` objects concisely in tests.

Typical use::

    t = trace(
        span(SPAN_REQUEST, 1_000, 9_000, span_id=sid(1), attrs={GEN_AI_REQUEST_MODEL: "m"}),
        span(SPAN_QUEUE, 1_000, 2_000, span_id=sid(2), parent_span_id=sid(1)),
    )

``request_spans`` builds a whole tokentrace request (HTTP server span, ``llm.request`` and its
phase children) from phase durations. ``attributes_of`` decodes a span's attributes back into
plain Python values for assertions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final, TypeAlias

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
    KeyValueList,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tokentrace.agent import semconv
from tokentrace.processors.model import AssembledTrace, SpanRef

AttrValue: TypeAlias = (
    "str | bool | int | float | bytes | Sequence[AttrValue] | Mapping[str, AttrValue]"
)
"""A Python value that ``any_value`` can encode."""

DEFAULT_TRACE_ID: Final = bytes(range(1, 17))
DEFAULT_SERVICE: Final = "svc"
DEFAULT_SCOPE: Final = "tokentrace.test"
T0: Final = 1_700_000_000_000_000_000
"""A realistic Unix-ns origin for test timestamps."""

KIND_INTERNAL: Final = Span.SPAN_KIND_INTERNAL
KIND_SERVER: Final = Span.SPAN_KIND_SERVER
KIND_CLIENT: Final = Span.SPAN_KIND_CLIENT


def sid(number: int) -> bytes:
    """An 8-byte span id from a small integer (``sid(0)`` is the empty parent)."""
    return number.to_bytes(8, "big") if number else b""


def tid(number: int) -> bytes:
    """A 16-byte trace id from a small integer."""
    return number.to_bytes(16, "big")


def any_value(value: AttrValue) -> AnyValue:
    """Encode a Python value as an OTLP ``AnyValue`` (lists become arrays, dicts kvlists)."""
    if isinstance(value, bool):  # before int: bool is an int subclass
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, Mapping):
        return AnyValue(
            kvlist_value=KeyValueList(values=[key_value(k, v) for k, v in value.items()])
        )
    return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))


def key_value(key: str, value: AttrValue) -> KeyValue:
    return KeyValue(key=key, value=any_value(value))


def decode_value(value: AnyValue) -> object:
    """The Python value of an ``AnyValue`` (arrays as lists, kvlists as dicts, unset as None)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [decode_value(element) for element in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: decode_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which)


def attributes_of(span: Span) -> dict[str, object]:
    """A span's attributes as a dict of Python values (the last one wins for duplicate keys)."""
    return {kv.key: decode_value(kv.value) for kv in span.attributes}


def span(
    name: str,
    start_ns: int,
    end_ns: int,
    *,
    span_id: bytes,
    trace_id: bytes = DEFAULT_TRACE_ID,
    parent_span_id: bytes = b"",
    kind: Span.SpanKind.ValueType = KIND_INTERNAL,
    attrs: Mapping[str, AttrValue] | None = None,
    events: Iterable[tuple[str, int, Mapping[str, AttrValue]]] = (),
    error: str | None = None,
) -> Span:
    """One span; ``error`` sets an ERROR status with that message ("" for no message)."""
    message = Span(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent_span_id,
        name=name,
        kind=kind,
        start_time_unix_nano=start_ns,
        end_time_unix_nano=end_ns,
    )
    for key, value in (attrs or {}).items():
        message.attributes.append(key_value(key, value))
    for event_name, time_ns, event_attrs in events:
        event = message.events.add(name=event_name, time_unix_nano=time_ns)
        for key, value in event_attrs.items():
            event.attributes.append(key_value(key, value))
    if error is not None:
        message.status.code = Status.STATUS_CODE_ERROR
        message.status.message = error
    return message


def ref(
    span_message: Span, *, service: str = DEFAULT_SERVICE, scope: str = DEFAULT_SCOPE
) -> SpanRef:
    """A ``SpanRef`` with its own resource (``service.name``) and scope."""
    resource = Resource(attributes=[key_value(semconv.SERVICE_NAME, service)])
    return SpanRef(
        span=span_message,
        resource=resource,
        scope=InstrumentationScope(name=scope),
        service=service,
    )


def trace(
    *spans: Span | SpanRef,
    service: str = DEFAULT_SERVICE,
    scope: str = DEFAULT_SCOPE,
    trace_id: bytes | None = None,
) -> AssembledTrace:
    """An ``AssembledTrace``; plain spans share one resource/scope, ``SpanRef``s keep their own.

    The trace id defaults to the first span's.
    """
    resource = Resource(attributes=[key_value(semconv.SERVICE_NAME, service)])
    shared_scope = InstrumentationScope(name=scope)
    refs = [
        item
        if isinstance(item, SpanRef)
        else SpanRef(span=item, resource=resource, scope=shared_scope, service=service)
        for item in spans
    ]
    if trace_id is None:
        trace_id = refs[0].span.trace_id if refs else DEFAULT_TRACE_ID
    return AssembledTrace(trace_id=trace_id, spans=refs)


def export_request(spans: Sequence[Span], *, service: str = "svc") -> ExportTraceServiceRequest:
    """The OTLP export request a sender of ``service`` would send for ``spans``."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    attribute = resource_spans.resource.attributes.add(key=semconv.SERVICE_NAME)
    attribute.value.string_value = service
    resource_spans.scope_spans.add().spans.extend(spans)
    return request


def request_spans(
    *,
    start_ns: int = T0,
    http_ns: int | None = 1_000_000,
    queue_ns: int = 5_000_000,
    prefill_ns: int = 20_000_000,
    token_offsets_us: Sequence[int] = (0, 10_000, 20_000, 30_000),
    postprocess_ns: int = 500_000,
    http_tail_ns: int = 200_000,
    request_attrs: Mapping[str, AttrValue] | None = None,
    decode_attrs: Mapping[str, AttrValue] | None = None,
    trace_id: bytes = DEFAULT_TRACE_ID,
    first_span_id: int = 1,
) -> list[Span]:
    """A complete tokentrace request: HTTP server span (unless ``http_ns`` is None),
    ``llm.request``, ``llm.queue``, ``llm.prefill``, ``llm.decode`` (last token at the last
    offset, which carries the offsets) and ``llm.postprocess``.

    Span ids are consecutive from ``first_span_id`` in that order. ``gen_ai.usage.output_tokens``
    defaults to the number of offsets; ``request_attrs`` add to or override the defaults.
    """
    ids = iter(range(first_span_id, first_span_id + 6))
    spans: list[Span] = []
    parent = b""
    arrival = start_ns if http_ns is None else start_ns + http_ns
    first_scheduled = arrival + queue_ns
    first_token = first_scheduled + prefill_ns
    last_token = first_token + (token_offsets_us[-1] * 1000 if token_offsets_us else 0)
    end = last_token + postprocess_ns
    if http_ns is not None:
        http_id = sid(next(ids))
        spans.append(
            span(
                "POST /v1/completions",
                start_ns,
                end + http_tail_ns,
                span_id=http_id,
                trace_id=trace_id,
                kind=KIND_SERVER,
            )
        )
        parent = http_id
    request_id = sid(next(ids))
    attrs: dict[str, AttrValue] = {
        semconv.GEN_AI_REQUEST_MODEL: "test-model",
        semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_TEXT_COMPLETION,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: 100,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: len(token_offsets_us),
    }
    attrs.update(request_attrs or {})
    spans.append(
        span(
            semconv.SPAN_REQUEST,
            arrival,
            end,
            span_id=request_id,
            trace_id=trace_id,
            parent_span_id=parent,
            attrs=attrs,
        )
    )
    children = (
        (semconv.SPAN_QUEUE, arrival, first_scheduled, None),
        (semconv.SPAN_PREFILL, first_scheduled, first_token, None),
        (
            semconv.SPAN_DECODE,
            first_token,
            last_token,
            {semconv.DECODE_TOKEN_OFFSETS: list(token_offsets_us), **(decode_attrs or {})},
        ),
        (semconv.SPAN_POSTPROCESS, last_token, end, None),
    )
    for name, child_start, child_end, child_attrs in children:
        spans.append(
            span(
                name,
                child_start,
                child_end,
                span_id=sid(next(ids)),
                trace_id=trace_id,
                parent_span_id=request_id,
                attrs=child_attrs,
            )
        )
    return spans
