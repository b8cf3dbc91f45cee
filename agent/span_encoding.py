"""One request's spans in OTLP protobuf wire format: ``ExportTraceServiceRequest`` bytes.

Encoding writes protobuf wire format directly: about 4 µs per span where SDK spans plus the
OTLP exporter's encoder cost about 60 (``bench/span_building.py``). It needs no protobuf
library: this module imports only the standard library and the agent's own modules. Tests check
the bytes against the protobuf parser, the SDK path and the collector's processors.

Separate from the layout (``spans``): this is the agent's hot path, written for speed (caches,
a big-integer fast path for token offsets), while the layout is the span contract. Where the
package was built with a C compiler, attributes and length-delimited fields are written in C
(``_wire.c``; this module's Python is then the twin, and the answer where C declines).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple, TypeAlias

from tokentrace.agent import compiled, semconv
from tokentrace.agent.finished_request import FinishedRequest
from tokentrace.agent.span_ids import SPAN_ID_BYTES, TRACE_ID_BYTES, SpanIdSource, random_span_id
from tokentrace.agent.spans import (
    DEFAULT_MAX_TOKEN_OFFSETS,
    PREFILL_LOCAL_ID,
    AttrValue,
    PlannedSpan,
    SpanJob,
    plan_spans,
)

__all__ = [
    "ResourceScope",
    "SpanBatchEncoder",
    "encode_finished_requests",
    "encode_span",
    "encode_span_tree",
    "export_request",
    "length_delimited",
    "span_attributes",
]

_log = logging.getLogger(__name__)

_WIRE: Final[Any] = compiled.load("tokentrace.agent._wire")
"""The C twins of ``_SpanWriter.attributes`` and ``length_delimited`` (``_wire.c``), if built."""
BUILT: Final = _WIRE is not None
"""Whether the C encoding runs (built, and not turned off by ``TOKENTRACE_PURE_PYTHON``)."""

_Attributes: TypeAlias = "dict[str, AttrValue] | Sequence[tuple[str, AttrValue]]"

_DEFAULT_SCOPE_VERSION: Final = ""
_ATTRIBUTE_CACHE_ENTRIES: Final = 4096
"""Bound of the cache of whole encoded string/bool attributes (cleared when full)."""
_UNCACHED_STRING_KEYS: Final = frozenset(
    {
        semconv.REQUEST_ID,
        semconv.PROMPT_PREFIX_HASH,
        semconv.ENGINE_STEP_REQUEST_IDS,
        semconv.DIAGNOSIS_VERDICT,  # the collector's enrichment: a sentence with the numbers
    }
)
"""String (array) attributes unique (or nearly) per span: caching them would only churn the
cache."""


# --- encoding: finished requests to one ExportTraceServiceRequest --------------------------------


class ResourceScope:
    """A resource and an instrumentation scope, encoded once: the head of a ``ResourceSpans``."""

    __slots__ = ("resource", "scope")

    def __init__(
        self,
        *,
        resource_attributes: Mapping[str, AttrValue],
        scope_name: str,
        scope_version: str = _DEFAULT_SCOPE_VERSION,
    ) -> None:
        attributes = b"".join(
            length_delimited(_TAG_RESOURCE_ATTRIBUTE, _key_value(key, _any_value(value)))
            for key, value in resource_attributes.items()
        )
        self.resource: Final = length_delimited(_TAG_RESOURCE_SPANS_RESOURCE, attributes)
        """``ResourceSpans.resource``, tag included."""
        scope = length_delimited(_TAG_SCOPE_NAME, scope_name.encode())
        if scope_version:
            scope += length_delimited(_TAG_SCOPE_VERSION, scope_version.encode())
        self.scope: Final = length_delimited(_TAG_SCOPE_SPANS_SCOPE, scope)
        """``ScopeSpans.scope``, tag included."""


def export_request(groups: Iterable[tuple[ResourceScope, Sequence[bytes]]]) -> bytes:
    """A serialised ``ExportTraceServiceRequest``: one ``ResourceSpans`` (with one
    ``ScopeSpans``) per group that has spans. Spans are ``encode_span``'s output."""
    parts: list[bytes] = []
    for head, spans in groups:
        if not spans:
            continue
        scope_spans_length = len(head.scope) + sum(map(len, spans))
        scope_spans_tag = _TAG_RESOURCE_SPANS_SCOPE_SPANS + _varint(scope_spans_length)
        resource_spans_length = len(head.resource) + len(scope_spans_tag) + scope_spans_length
        parts += (
            _TAG_REQUEST_RESOURCE_SPANS,
            _varint(resource_spans_length),
            head.resource,
            scope_spans_tag,
            head.scope,
        )
        parts += spans
    return b"".join(parts)


class SpanBatchEncoder:
    """Encodes batches of finished requests (and span jobs), one ``ExportTraceServiceRequest``
    per batch, under one resource and scope (encoded once).

    Never raises for a bad finished request or span job (ids of the wrong length, values out of
    range, wrong types): it is left out and counted in ``skipped`` (the first one is logged).
    """

    def __init__(
        self,
        *,
        resource_attributes: Mapping[str, AttrValue],
        scope_name: str,
        scope_version: str = _DEFAULT_SCOPE_VERSION,
        max_token_offsets: int = DEFAULT_MAX_TOKEN_OFFSETS,
        span_ids: SpanIdSource | None = None,
    ) -> None:
        if max_token_offsets < 0:
            raise ValueError("max_token_offsets must be >= 0")
        self._head = ResourceScope(
            resource_attributes=resource_attributes,
            scope_name=scope_name,
            scope_version=scope_version,
        )
        self._max_token_offsets = max_token_offsets
        self._span_ids = span_ids
        self.skipped = 0
        """Finished requests (and span jobs) left out because they could not be encoded."""

    def encode(
        self, finished_requests: Iterable[FinishedRequest], jobs: Iterable[SpanJob] = ()
    ) -> tuple[bytes, int]:
        """One serialised ``ExportTraceServiceRequest`` of the finished requests' and the jobs'
        spans, and its span count (``b""``, 0 when there is nothing to send)."""
        spans: list[bytes] = []
        max_token_offsets = self._max_token_offsets
        span_ids = self._span_ids
        tree = _WRITER.tree
        for finished in finished_requests:
            try:
                fixed_ids = None
                if finished.span_id:
                    fixed_ids = {0: finished.span_id}
                    if finished.prefill_span_id and finished.first_scheduled_ns is not None:
                        fixed_ids[PREFILL_LOCAL_ID] = finished.prefill_span_id
                spans += tree(
                    plan_spans(finished, max_token_offsets=max_token_offsets),
                    finished.trace_id,
                    finished.parent_span_id,
                    span_ids,
                    fixed_ids,
                )
            except Exception:  # a malformed request must not cost the others their spans
                self._skip("a finished request")
        for job in jobs:
            try:
                spans += tree(job.spans, job.trace_id, job.parent_span_id, span_ids, job.fixed_ids)
            except Exception:
                self._skip("a span job")
        if not spans:
            return b"", 0
        return export_request(((self._head, spans),)), len(spans)

    def _skip(self, what: str) -> None:
        if not self.skipped:
            _log.warning("tokentrace: %s could not be encoded", what, exc_info=True)
        self.skipped += 1


def encode_finished_requests(
    finished_requests: Iterable[FinishedRequest],
    *,
    resource_attributes: Mapping[str, AttrValue],
    scope_name: str,
    scope_version: str = _DEFAULT_SCOPE_VERSION,
    max_token_offsets: int = DEFAULT_MAX_TOKEN_OFFSETS,
    span_ids: SpanIdSource | None = None,
) -> tuple[bytes, int]:
    """One serialised ``ExportTraceServiceRequest`` (one ``ResourceSpans``/``ScopeSpans``) of
    every finished request's span subtree, and the span count.

    Span ids come from ``span_ids`` (default: ``random_span_id``). A finished request that cannot be
    encoded is left out; keep a ``SpanBatchEncoder`` to count those and to encode the resource
    only once.
    """
    encoder = SpanBatchEncoder(
        resource_attributes=resource_attributes,
        scope_name=scope_name,
        scope_version=scope_version,
        max_token_offsets=max_token_offsets,
        span_ids=span_ids,
    )
    return encoder.encode(finished_requests)


def encode_span(
    planned: PlannedSpan, *, trace_id: bytes, span_id: bytes, parent_span_id: bytes = b""
) -> bytes:
    """``planned`` as one ``ScopeSpans.spans`` entry (tag included), for ``export_request``.

    ``trace_id`` is 16 bytes, ``span_id`` 8, ``parent_span_id`` 8 or empty (a root).
    """
    if len(trace_id) != TRACE_ID_BYTES or len(span_id) != SPAN_ID_BYTES:
        raise ValueError("trace ids are 16 bytes and span ids 8 bytes")
    if parent_span_id and len(parent_span_id) != SPAN_ID_BYTES:
        raise ValueError("parent span ids are 8 bytes (or empty for a root span)")
    return _WRITER.span(planned, _TAG_TRACE_ID + trace_id, span_id, parent_span_id)


def encode_span_tree(
    planned: Iterable[PlannedSpan],
    *,
    trace_id: bytes,
    parent_span_id: bytes = b"",
    span_ids: SpanIdSource | None = None,
    fixed_ids: Mapping[int, bytes] | None = None,
) -> list[bytes]:
    """A planned subtree (``plan_spans``' numbering) as ``ScopeSpans.spans`` entries, each span
    with a new id from ``span_ids`` (default ``random_span_id``) unless ``fixed_ids`` has one
    for its ``local_id``; the root's parent is ``parent_span_id``."""
    return _WRITER.tree(planned, trace_id, parent_span_id, span_ids, fixed_ids)


# --- protobuf wire format -----------------------------------------------------------------------
# Field numbers of opentelemetry/proto/{collector/trace,trace,common,resource}/v1/*.proto; tests
# check the output against spans built through the protobuf API and against the SDK path.
_TAG_REQUEST_RESOURCE_SPANS: Final = b"\x0a"  # ExportTraceServiceRequest.resource_spans = 1
_TAG_RESOURCE_SPANS_RESOURCE: Final = b"\x0a"  # ResourceSpans.resource = 1
_TAG_RESOURCE_SPANS_SCOPE_SPANS: Final = b"\x12"  # ResourceSpans.scope_spans = 2
_TAG_RESOURCE_ATTRIBUTE: Final = b"\x0a"  # Resource.attributes = 1
_TAG_SCOPE_SPANS_SCOPE: Final = b"\x0a"  # ScopeSpans.scope = 1
_TAG_SCOPE_NAME: Final = b"\x0a"  # InstrumentationScope.name = 1
_TAG_SCOPE_VERSION: Final = b"\x12"  # InstrumentationScope.version = 2
_TAG_SCOPE_SPANS_SPAN: Final = b"\x12"  # ScopeSpans.spans = 2
_TAG_TRACE_ID: Final = b"\x0a\x10"  # Span.trace_id = 1, 16 bytes
_TAG_SPAN_ID: Final = b"\x12\x08"  # Span.span_id = 2, 8 bytes
_TAG_PARENT_SPAN_ID: Final = b"\x22\x08"  # Span.parent_span_id = 4, 8 bytes
_TAG_NAME: Final = b"\x2a"  # Span.name = 5
_TAG_KIND: Final = b"\x30"  # Span.kind = 6 (varint)
_TAG_START: Final = b"\x39"  # Span.start_time_unix_nano = 7 (fixed64)
_TAG_END: Final = b"\x41"  # Span.end_time_unix_nano = 8 (fixed64)
_TAG_ATTRIBUTE: Final = b"\x4a"  # Span.attributes = 9
_TAG_LINK: Final = b"\x6a"  # Span.links = 13
_TAG_LINK_SPAN_ID: Final = b"\x12\x08"  # Span.Link.span_id = 2, 8 bytes (trace_id = 1 as Span's)
_TAG_STATUS: Final = b"\x7a"  # Span.status = 15
_TAG_STATUS_MESSAGE: Final = b"\x12"  # Status.message = 2
_STATUS_CODE_ERROR: Final = b"\x18\x02"  # Status.code = 3: STATUS_CODE_ERROR (2)
_TAG_KEY: Final = b"\x0a"  # KeyValue.key = 1
_TAG_VALUE: Final = b"\x12"  # KeyValue.value = 2
_TAG_STRING: Final = b"\x0a"  # AnyValue.string_value = 1
_TAG_BOOL: Final = b"\x10"  # AnyValue.bool_value = 2
_TAG_INT: Final = b"\x18"  # AnyValue.int_value = 3 (varint, two's complement)
_TAG_DOUBLE: Final = b"\x21"  # AnyValue.double_value = 4 (fixed64)
_TAG_ARRAY: Final = b"\x2a"  # AnyValue.array_value = 5
_TAG_ARRAY_VALUE: Final = b"\x0a"  # ArrayValue.values = 1
_PACK_TIMES: Final = struct.Struct("<cQcQ").pack
_PACK_DOUBLE: Final = struct.Struct("<d").pack

_ONE_BYTE: Final = tuple(bytes((value,)) for value in range(0x80))
_UINT64: Final = 1 << 64
_INT64_MIN: Final = -(1 << 63)
_INT64_LIMIT: Final = 1 << 63


def _varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative integer."""
    if value < 0x80:
        return _ONE_BYTE[value]
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _int64_varint(value: int) -> bytes:
    """An ``int64`` field's varint (two's complement); out-of-range values are an error."""
    if not _INT64_MIN <= value < _INT64_LIMIT:
        raise ValueError(f"integer attribute {value} does not fit in int64")
    return _varint(value if value >= 0 else value + _UINT64)


def _key_value(key: str, any_value: bytes) -> bytes:
    """A ``KeyValue``'s content from its ``AnyValue``'s content."""
    return length_delimited(_TAG_KEY, key.encode()) + length_delimited(_TAG_VALUE, any_value)


def _any_value(value: object) -> bytes:
    """An ``AnyValue``'s content for any ``AttrValue`` (the general, uncached path)."""
    if isinstance(value, bool):  # before int: bool is an int
        return _TAG_BOOL + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return _TAG_INT + _int64_varint(value)
    if isinstance(value, float):
        return _TAG_DOUBLE + _PACK_DOUBLE(value)
    if isinstance(value, str):
        return length_delimited(_TAG_STRING, value.encode())
    if isinstance(value, (list, tuple)):
        items = b"".join(length_delimited(_TAG_ARRAY_VALUE, _any_value(item)) for item in value)
        return length_delimited(_TAG_ARRAY, items)
    raise TypeError(f"unsupported attribute value type {type(value).__name__}")


class _SpanWriter:
    """Writes spans as ``ScopeSpans.spans`` entries in protobuf wire format.

    Everything that repeats is encoded once and cached: span names, each attribute key's
    prefix (for numbers the only variable part is the value itself) and whole string-valued
    attributes (model, operation, finish reasons; bounded: cleared when full). One instance is
    shared by every caller: each cache operation is a single dict call, atomic across threads.
    """

    def __init__(self) -> None:
        self._names: dict[str, bytes] = {}
        self._int_prefixes: dict[tuple[str, int], bytes] = {}
        self._double_prefixes: dict[str, bytes] = {}
        self._entries: dict[tuple[str, object], bytes] = {}

    def tree(
        self,
        planned: Iterable[PlannedSpan],
        trace_id: bytes,
        parent_span_id: bytes,
        span_ids: SpanIdSource | None,
        fixed_ids: Mapping[int, bytes] | None = None,
    ) -> list[bytes]:
        if len(trace_id) != TRACE_ID_BYTES:
            raise ValueError("trace ids are 16 bytes")
        if parent_span_id and len(parent_span_id) != SPAN_ID_BYTES:
            raise ValueError("parent span ids are 8 bytes (or empty for a root span)")
        trace_field = _TAG_TRACE_ID + trace_id
        next_id = random_span_id if span_ids is None else span_ids
        ids: list[bytes] = []
        encoded: list[bytes] = []
        span = self.span
        for planned_span in planned:
            if planned_span.local_id != len(ids):
                raise ValueError("planned spans must be numbered 0, 1, ... in order")
            fixed = None if fixed_ids is None else fixed_ids.get(planned_span.local_id)
            if fixed is not None:
                if len(fixed) != SPAN_ID_BYTES or not any(fixed):
                    raise ValueError("fixed span ids are 8 bytes, not all zero")
                span_id = fixed
            else:
                number = next_id()
                if not number:
                    raise ValueError("a span id source returned 0 (the invalid span id)")
                span_id = number.to_bytes(8, "big")
            ids.append(span_id)
            parent = planned_span.parent_local_id
            parent_id = ids[parent] if parent >= 0 else parent_span_id
            encoded.append(span(planned_span, trace_field, span_id, parent_id))
        return encoded

    def span(
        self, planned: PlannedSpan, trace_field: bytes, span_id: bytes, parent_span_id: bytes
    ) -> bytes:
        name = self._names.get(planned.name)
        if name is None:
            name = self._names[planned.name] = length_delimited(_TAG_NAME, planned.name.encode())
        parts = [trace_field, _TAG_SPAN_ID, span_id]
        if parent_span_id:
            parts += (_TAG_PARENT_SPAN_ID, parent_span_id)
        parts += (
            name,
            _TAG_KIND,
            _ONE_BYTE[planned.kind],
            _PACK_TIMES(_TAG_START, planned.start_ns, _TAG_END, planned.end_ns),
        )
        append = parts.append
        self.attributes(planned.attributes, append)
        for linked_trace_id, linked_span_id in planned.links:
            append(_link(linked_trace_id, linked_span_id))
        if planned.status_error is not None:
            append(_status_error(planned.status_error))
        return length_delimited(_TAG_SCOPE_SPANS_SPAN, b"".join(parts))

    def attributes(self, attributes: _Attributes, append: Callable[[bytes], None]) -> None:
        """``append`` the ``Span.attributes`` entries of ``attributes`` (in C when built, else
        with the cached parts, see the class)."""
        if _WIRE is not None:
            encoded: bytes | None = _WIRE.attributes(attributes)
            if encoded is not None:
                append(encoded)
                return
        self.attributes_python(attributes, append)

    def attributes_python(self, attributes: _Attributes, append: Callable[[bytes], None]) -> None:
        """``attributes``' pure-Python twin (and its answer where the C one declines: it raises
        ValueError/TypeError for a value OTLP cannot carry)."""
        items = attributes.items() if isinstance(attributes, dict) else attributes
        for key, value in items:
            kind = type(value)
            if kind is int:
                encoded = _int64_varint(value)  # type: ignore[arg-type]
                prefix = self._int_prefixes.get((key, len(encoded)))
                if prefix is None:
                    prefix = self._int_prefix(key, len(encoded))
                append(prefix)
                append(encoded)
            elif kind is float:
                prefix = self._double_prefixes.get(key)
                if prefix is None:
                    prefix = self._double_prefix(key)
                append(prefix)
                append(_PACK_DOUBLE(value))
            elif kind is list:
                append(_attribute(key, _int_array(value)))  # type: ignore[arg-type]
            elif kind is str and key in _UNCACHED_STRING_KEYS:
                text: str = value  # type: ignore[assignment]
                append(_attribute(key, length_delimited(_TAG_STRING, text.encode())))
            elif kind is tuple and key in _UNCACHED_STRING_KEYS:
                append(_attribute(key, _any_value(value)))
            elif (
                kind is str
                or kind is bool
                # String arrays only: (0.0, False) == (0, 0) would share one cache entry.
                or (kind is tuple and all(type(item) is str for item in value))  # type: ignore[union-attr]
            ):  # values that repeat
                entry_key = (key, value)
                entry = self._entries.get(entry_key)
                if entry is None:
                    entry = _attribute(key, _any_value(value))
                    if len(self._entries) >= _ATTRIBUTE_CACHE_ENTRIES:
                        self._entries.clear()
                    self._entries[entry_key] = entry
                append(entry)
            else:  # int/float/str subclasses and the like
                append(_attribute(key, _any_value(value)))

    def _int_prefix(self, key: str, varint_length: int) -> bytes:
        """Everything of an int attribute's entry before its varint of ``varint_length``."""
        prefix = _attribute(key, _TAG_INT + bytes(varint_length))[:-varint_length]
        self._int_prefixes[(key, varint_length)] = prefix
        return prefix

    def _double_prefix(self, key: str) -> bytes:
        prefix = _attribute(key, _TAG_DOUBLE + bytes(8))[:-8]
        self._double_prefixes[key] = prefix
        return prefix


_WRITER: Final = _SpanWriter()


def length_delimited_python(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited protobuf field: ``tag``, the payload's length, the payload."""
    return tag + _varint(len(payload)) + payload


length_delimited: Final[Callable[[bytes, bytes], bytes]] = (
    _WIRE.length_delimited if _WIRE is not None else length_delimited_python
)
"""``length_delimited_python``'s answer (in C when built)."""


def span_attributes(attributes: _Attributes) -> bytes:
    """``Span.attributes`` entries (tags included) of a dict or a sequence of ``(key, value)``
    pairs, as ``encode_span`` writes attributes (a list is an int array, a tuple any array):
    appended to a serialised ``Span``, they parse as its attributes after the ones it has
    (protobuf concatenates a repeated field's entries). Raises ValueError/TypeError for a value
    OTLP cannot carry."""
    parts: list[bytes] = []
    _WRITER.attributes(attributes, parts.append)
    return b"".join(parts)


def _attribute(key: str, any_value: bytes) -> bytes:
    """One ``Span.attributes`` entry (tag included) from its ``AnyValue``'s content."""
    return length_delimited(_TAG_ATTRIBUTE, _key_value(key, any_value))


def _link(trace_id: bytes, span_id: bytes) -> bytes:
    if len(trace_id) != TRACE_ID_BYTES or len(span_id) != SPAN_ID_BYTES:
        raise ValueError("linked trace ids are 16 bytes and span ids 8 bytes")
    return length_delimited(_TAG_LINK, _TAG_TRACE_ID + trace_id + _TAG_LINK_SPAN_ID + span_id)


def _status_error(message: str) -> bytes:
    status = _STATUS_CODE_ERROR
    if message:
        status = length_delimited(_TAG_STATUS_MESSAGE, message.encode()) + status
    return length_delimited(_TAG_STATUS, status)


def _int_array(values: list[int]) -> bytes:
    encoded = _encode_int_array(values)
    if encoded is None:  # out of the fast path's range: one element at a time
        encoded = b"".join(
            length_delimited(_TAG_ARRAY_VALUE, _TAG_INT + _int64_varint(value)) for value in values
        )
    return length_delimited(_TAG_ARRAY, encoded)


# Integer arrays as OTLP ``ArrayValue`` bytes, computed with big-integer arithmetic instead of
# one call per element (4x faster; token offsets dominate the cost of a request's spans).
# Each element is the 8-byte ``AnyValue`` field: tag 0x0a, length 6, tag 0x18 (int_value) and a
# 5-byte varint (valid, merely not the shortest form: protobuf re-encodes it canonically). All
# elements are packed into one integer with one element per 64-bit slot, so the 7-bit varint
# groups are spread into bytes for every element at once by a few masks and shifts.
_VARINT5_LIMIT: Final = 1 << 35
_SLOT_CONSTANT: Final = 0x0A | 0x06 << 8 | 0x18 << 16 | 0x80808080 << 24
_SLOT_TOO_LARGE: Final = ((1 << 64) - 1) ^ (_VARINT5_LIMIT - 1)
_INT_ARRAY_FAST_MAX: Final = 1 << 16
"""Longer arrays take the per-element path (bounds the masks' memory to a few MB)."""


class _IntArrayMasks(NamedTuple):
    """Masks for arrays of up to ``slots`` elements; replaced whole (thread-safe to read)."""

    slots: int
    groups: tuple[int, int, int, int, int]
    constant: int
    too_large: int


def _repeated_slot(slot: int, count: int) -> int:
    return int.from_bytes(slot.to_bytes(8, "little") * count, "little")


def _int_array_masks(slots: int) -> _IntArrayMasks:
    m0, m7, m14, m21, m28 = (_repeated_slot(0x7F << shift, slots) for shift in (0, 7, 14, 21, 28))
    return _IntArrayMasks(
        slots,
        (m0, m7, m14, m21, m28),
        _repeated_slot(_SLOT_CONSTANT, slots),
        _repeated_slot(_SLOT_TOO_LARGE, slots),
    )


_int_array_masks_cache = _IntArrayMasks(0, (0, 0, 0, 0, 0), 0, 0)


def _encode_int_array(values: list[int]) -> bytes | None:
    """``values`` (each in ``[0, 2**35)``) as serialised ``ArrayValue`` content, or ``None``
    when a value is out of that range or the array is very long (the caller then encodes one
    element at a time)."""
    global _int_array_masks_cache
    count = len(values)
    if count == 0:
        return b""
    if count > _INT_ARRAY_FAST_MAX:
        return None
    masks = _int_array_masks_cache
    if count > masks.slots:
        # Masks for the longest array so far: shorter arrays reuse them (an AND with a shorter
        # integer keeps only its own slots).
        masks = _int_array_masks_cache = _int_array_masks(max(count, DEFAULT_MAX_TOKEN_OFFSETS))
    try:
        packed = int.from_bytes(struct.pack(f"<{count}Q", *values), "little")
    except struct.error:  # negative, beyond 64 bits or not an integer
        return None
    if packed & masks.too_large:
        return None
    m0, m7, m14, m21, m28 = masks.groups
    spread = (
        (packed & m0)
        | (packed & m7) << 1
        | (packed & m14) << 2
        | (packed & m21) << 3
        | (packed & m28) << 4
    )
    constant = masks.constant >> 64 * (masks.slots - count)
    return (spread << 24 | constant).to_bytes(8 * count, "little")
