"""OTLP encoding of assembled spans, done once per trace and shared by every exporter.

Written as protobuf wire format by hand around each span's own serialisation: building an
``ExportTraceServiceRequest`` of protobuf objects copied every span once more (about a third of
the cost). A span may get extra bytes appended (``appended``): the enrichment's attribute
entries (``processors.enrich.enrichment_attributes``), which parse as attributes after its own.
Every span the receiver kept the bytes of (``SpanRef.wire``) goes out as it came in, its
enrichment appended to them (a span that had attributes to remove before lost its bytes).

Where every span, resource and scope of a trace has its received bytes (the usual case), C
writes the request in one pass (``agent/_wire.c``'s ``trace_request``: sizes first, then one
buffer, where the Python below copies each span's bytes four times over); otherwise, and
without C, ``encode_trace_request_python`` does, with the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from tokentrace.agent import compiled
from tokentrace.agent.span_encoding import length_delimited
from tokentrace.processors.model import SpanRef

_WIRE: Final[Any] = compiled.load("tokentrace.agent._wire")

_TAG_REQUEST_RESOURCE_SPANS: Final = b"\x0a"  # ExportTraceServiceRequest.resource_spans = 1
_TAG_RESOURCE: Final = b"\x0a"  # ResourceSpans.resource = 1
_TAG_SCOPE_SPANS: Final = b"\x12"  # ResourceSpans.scope_spans = 2
_TAG_SCOPE: Final = b"\x0a"  # ScopeSpans.scope = 1
_TAG_SPAN: Final = b"\x12"  # ScopeSpans.spans = 2


def encode_trace_request(
    spans: Sequence[SpanRef], *, appended: Mapping[bytes, bytes] | None = None
) -> bytes:
    """One serialised ExportTraceServiceRequest, grouping spans by their shared Resource and
    InstrumentationScope objects (identity, not content: the receiver shares them), in the order
    each first appears. ``appended``: span id -> bytes to append to that span's serialisation."""
    if _WIRE is not None:
        encoded: bytes | None = _WIRE.trace_request(spans, appended)
        if encoded is not None:
            return encoded
    return encode_trace_request_python(spans, appended=appended)


def encode_trace_request_python(
    spans: Sequence[SpanRef], *, appended: Mapping[bytes, bytes] | None = None
) -> bytes:
    """``encode_trace_request`` in Python: every input, and the C function's twin."""
    # id(resource) -> (its bytes, id(scope) -> (its bytes, the spans)); the bytes the receiver
    # kept (``SpanRef.resource_wire`` / ``scope_wire``) or, without them, serialised here.
    by_resource: dict[int, tuple[bytes, dict[int, tuple[bytes, list[SpanRef]]]]] = {}
    for ref in spans:
        scopes = by_resource.get(id(ref.resource))
        if scopes is None:
            resource_wire = ref.resource_wire
            if resource_wire is None:
                resource_wire = ref.resource.SerializeToString()
            scopes = by_resource[id(ref.resource)] = (resource_wire, {})
        group = scopes[1].get(id(ref.scope))
        if group is None:
            scope_wire = ref.scope_wire
            if scope_wire is None:
                scope_wire = ref.scope.SerializeToString()
            group = scopes[1][id(ref.scope)] = (scope_wire, [])
        group[1].append(ref)
    parts: list[bytes] = []
    for resource_wire, groups in by_resource.values():
        content = [length_delimited(_TAG_RESOURCE, resource_wire)]
        for scope_wire, scope_refs in groups.values():
            encoded = [length_delimited(_TAG_SCOPE, scope_wire)]
            for ref in scope_refs:
                span = ref.span
                extra = appended.get(span.span_id) if appended else None
                if ref.wire is not None:  # as received: the same span, not re-serialised
                    encoded.append(ref.wire if extra is None else _extended_entry(ref.wire, extra))
                    continue
                serialised = span.SerializeToString()
                if extra:
                    serialised += extra
                encoded.append(length_delimited(_TAG_SPAN, serialised))
            content.append(length_delimited(_TAG_SCOPE_SPANS, b"".join(encoded)))
        parts.append(length_delimited(_TAG_REQUEST_RESOURCE_SPANS, b"".join(content)))
    return b"".join(parts)


def _extended_entry(entry: bytes, extra: bytes) -> bytes:
    """A ``ScopeSpans.spans`` entry (tag, length, span) with ``extra`` appended to the span."""
    body = 2  # after the tag and the length's last byte
    while entry[body - 1] & 0x80:
        body += 1
    return length_delimited(_TAG_SPAN, entry[body:] + extra)
