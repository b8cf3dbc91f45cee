"""Drop spans that no later stage can use, or that could harm one, and say why (for OTLP
``partial_success``).

Every span is checked: its ids, its times (start set, end not before start, both inside a
plausible wall-clock range) and its sizes (attributes, events and links per span, attributes per
event and link, string and bytes lengths, array and key-value-list lengths, event times). A span
that fails any check is rejected whole, with the first reason in ``REJECTION_REASONS``; the rest
of the request is kept.

Runs on every received span, so the all-valid case is one tight loop: the ids and times, then
one ``ByteSize()`` call that bounds every size at once (a span of at most ``_FAST_PATH_BYTES``
encoded bytes cannot hold more attributes, events, links or array elements than the caps, nor a
longer string: each element takes at least two bytes), and whether the span has events or links
(whose times are checked one by one). Only a larger span, or one with events or links, is
checked field by field; the per-reason bookkeeping happens only in scopes that hold an invalid
span. Where the request's bytes are at hand and the C functions are built, the ids, times, size
gate and the presence of events or links are checked over the bytes in C
(``receivers.wire.unclean_spans``) and only the spans singled out there are looked at here.

Not range-checked, because every value is harmless to the stages after this one: enum values
(``kind``, ``status.code``: readers compare them with constants), ``flags`` and the
``dropped_*_count`` counters, and integer and double attribute values (any int64 fits the store;
``processors.span_attributes`` reads non-finite or negative numbers as absent).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, Span

from tokentrace.collector.receivers import wire

__all__ = ["DEFAULT_SPAN_LIMITS", "REJECTION_REASONS", "Sanitized", "SpanLimits", "sanitize"]

_TRACE_ID_LEN = 16
_SPAN_ID_LEN = 8
_ZERO_TRACE_ID = bytes(_TRACE_ID_LEN)
_ZERO_SPAN_ID = bytes(_SPAN_ID_LEN)

_NS_PER_S: Final = 1_000_000_000
_DEFAULT_MIN_TIME_NS: Final = 1
"""Earliest span start accepted: 0 means unset in OTLP ("missing start time"). Times before
2000 are implausible as wall-clock readings, but harmless: every derivation takes differences
and every value fits the store. They are kept so that senders (and tests) on synthetic clocks
work; the year-2000 floor would be ``946_684_800 * _NS_PER_S``."""
_DEFAULT_MAX_TIME_NS: Final = 7_258_118_400 * _NS_PER_S
"""First instant not accepted, for span start and end and event times: 2200-01-01T00:00:00Z
(7.26e18 ns). Below 2**63 (9.22e18) with room to spare, so every time and every difference of
two times fits a signed 64-bit integer (SQLite's INTEGER); a clock that reads later than this is
broken, not early."""
_DEFAULT_MAX_ATTRIBUTES: Final = 1024
"""Attributes per span, per event and per link (the OpenTelemetry SDK's default span limit is
128; eight times that leaves room for senders that raised theirs)."""
_DEFAULT_MAX_EVENTS: Final = 1024
"""Events per span (SDK default: 128)."""
_DEFAULT_MAX_LINKS: Final = 1024
"""Links per span (SDK default: 128)."""
_DEFAULT_MAX_STRING_LENGTH: Final = 64 * 1024
"""Characters of a string (span and event names, attribute keys and string values, trace
states, the status message) and bytes of a bytes value. The SDK sets no default; 64 Ki fits
stack traces in exception events, and bounds what one attribute (a model name, a percentile key)
can cost downstream."""
_DEFAULT_MAX_ARRAY_LENGTH: Final = 64 * 1024
"""Elements of an array or key-value-list attribute value, at any depth: 64 times the agent's
default cap on token offsets (``TOKENTRACE_MAX_TOKEN_OFFSETS``, 1024), so a raised cap passes."""


@dataclass(frozen=True, slots=True)
class SpanLimits:
    """The bounds ``sanitize`` checks each span against (defaults: the ``_DEFAULT_*`` constants
    above, each documented with why)."""

    min_time_ns: int = _DEFAULT_MIN_TIME_NS
    max_time_ns: int = _DEFAULT_MAX_TIME_NS
    max_attributes: int = _DEFAULT_MAX_ATTRIBUTES
    max_events: int = _DEFAULT_MAX_EVENTS
    max_links: int = _DEFAULT_MAX_LINKS
    max_string_length: int = _DEFAULT_MAX_STRING_LENGTH
    max_array_length: int = _DEFAULT_MAX_ARRAY_LENGTH

    @property
    def fast_path_bytes(self) -> int:
        """Encoded span size up to which no size cap can be exceeded: each attribute, event,
        link and array element takes at least two bytes, and a string at most the span's size."""
        return min(
            2 * self.max_attributes,
            2 * self.max_events,
            2 * self.max_links,
            2 * self.max_array_length,
            self.max_string_length,
        )

    @property
    def value_bytes(self) -> int:
        """Encoded size up to which a value (or a whole span) cannot hold a string or an array
        longer than the caps."""
        return min(self.max_string_length, 2 * self.max_array_length)


DEFAULT_SPAN_LIMITS: Final = SpanLimits()

REJECTION_REASONS: tuple[str, ...] = (
    "invalid trace_id",
    "invalid span_id",
    "invalid parent_span_id",
    "missing start time",
    "end before start",
    "time out of range",
    "too many attributes",
    "too many events",
    "too many links",
    "value too long",
    "array too long",
)
"""Reasons in the order they are checked and listed; a span counts under its first reason.

``time out of range``: a start, end or event time outside ``[min_time_ns, max_time_ns)``.
``too many attributes``: on the span, an event or a link. ``value too long``: a string or bytes
value longer than ``max_string_length``. ``array too long``: an array or key-value list longer
than ``max_array_length``."""

(
    _BAD_TRACE_ID,
    _BAD_SPAN_ID,
    _BAD_PARENT_SPAN_ID,
    _NO_START,
    _END_BEFORE_START,
    _TIME_OUT_OF_RANGE,
    _TOO_MANY_ATTRIBUTES,
    _TOO_MANY_EVENTS,
    _TOO_MANY_LINKS,
    _VALUE_TOO_LONG,
    _ARRAY_TOO_LONG,
) = range(len(REJECTION_REASONS))


def _value_problem(value: AnyValue, limits: SpanLimits) -> int | None:
    """A reason when ``value`` (at any depth) holds a string or array over the caps. Walks only
    values larger than ``limits.value_bytes`` (one C-level size call each), so a 64 Ki-element
    integer array costs one call, not one per element."""
    value_bytes = limits.value_bytes
    max_string = limits.max_string_length
    max_array = limits.max_array_length
    stack = [value]
    while stack:
        current = stack.pop()
        if current.ByteSize() <= value_bytes:
            continue
        which = current.WhichOneof("value")
        if which == "string_value":
            if len(current.string_value) > max_string:
                return _VALUE_TOO_LONG
        elif which == "bytes_value":
            if len(current.bytes_value) > max_string:
                return _VALUE_TOO_LONG
        elif which == "array_value":
            elements = current.array_value.values
            if len(elements) > max_array:
                return _ARRAY_TOO_LONG
            stack.extend(elements)
        elif which == "kvlist_value":
            pairs = current.kvlist_value.values
            if len(pairs) > max_array:
                return _ARRAY_TOO_LONG
            for pair in pairs:
                if len(pair.key) > max_string:
                    return _VALUE_TOO_LONG
                stack.append(pair.value)
    return None


def _attributes_problem(
    attributes: Sequence[KeyValue], limits: SpanLimits, *, deep: bool
) -> int | None:
    if len(attributes) > limits.max_attributes:
        return _TOO_MANY_ATTRIBUTES
    if deep:
        max_string = limits.max_string_length
        for pair in attributes:
            if len(pair.key) > max_string:
                return _VALUE_TOO_LONG
            problem = _value_problem(pair.value, limits)
            if problem is not None:
                return problem
    return None


def _size_problem(span: Span, limits: SpanLimits, size: int) -> int | None:
    """A reason for a span past the fast path's size gate, or with events or links: counts,
    event times, and (only when the span is larger than ``limits.value_bytes``) every string
    and array."""
    if len(span.attributes) > limits.max_attributes:
        return _TOO_MANY_ATTRIBUTES
    events = span.events
    if len(events) > limits.max_events:
        return _TOO_MANY_EVENTS
    links = span.links
    if len(links) > limits.max_links:
        return _TOO_MANY_LINKS
    max_time_ns = limits.max_time_ns
    for event in events:
        if event.time_unix_nano >= max_time_ns:
            return _TIME_OUT_OF_RANGE
    deep = size > limits.value_bytes
    for event in events:
        problem = _attributes_problem(event.attributes, limits, deep=deep)
        if problem is not None:
            return problem
    for link in links:
        problem = _attributes_problem(link.attributes, limits, deep=deep)
        if problem is not None:
            return problem
    if not deep:
        return None
    max_string = limits.max_string_length
    if (
        len(span.name) > max_string
        or len(span.trace_state) > max_string
        or len(span.status.message) > max_string
        or any(len(event.name) > max_string for event in events)
        or any(len(link.trace_state) > max_string for link in links)
    ):
        return _VALUE_TOO_LONG
    return _attributes_problem(span.attributes, limits, deep=True)


def _rejection_reason(span: Span, limits: SpanLimits) -> int | None:
    """Index into REJECTION_REASONS, or None when the span is kept (may fix an all-zero parent)."""
    trace_id = span.trace_id
    if len(trace_id) != _TRACE_ID_LEN or trace_id == _ZERO_TRACE_ID:
        return _BAD_TRACE_ID
    span_id = span.span_id
    if len(span_id) != _SPAN_ID_LEN or span_id == _ZERO_SPAN_ID:
        return _BAD_SPAN_ID
    parent_span_id = span.parent_span_id
    if parent_span_id:
        if len(parent_span_id) != _SPAN_ID_LEN:
            return _BAD_PARENT_SPAN_ID
        if parent_span_id == _ZERO_SPAN_ID:
            # Some senders write eight zero bytes for "no parent": a root span, not garbage.
            span.parent_span_id = b""
    start = span.start_time_unix_nano
    if not start:
        return _NO_START
    end = span.end_time_unix_nano
    if end < start:
        return _END_BEFORE_START
    if start < limits.min_time_ns or end >= limits.max_time_ns:
        return _TIME_OUT_OF_RANGE
    size = span.ByteSize()
    if size > limits.fast_path_bytes or span.events or span.links:
        return _size_problem(span, limits, size)
    return None


def _needs_cleaning(
    span: Span, limits: SpanLimits, min_time_ns: int, max_time_ns: int, fast_path_bytes: int
) -> bool:
    """Whether ``span`` sends its scope to ``_clean_scope``: a bad id or time, an all-zero
    parent to rewrite, or (past the size gate, or with events or links) a size problem.
    ``limits``' bounds come read once per request (this runs per span)."""
    trace_id = span.trace_id
    span_id = span.span_id
    parent_span_id = span.parent_span_id
    if (
        len(trace_id) != _TRACE_ID_LEN
        or trace_id == _ZERO_TRACE_ID
        or len(span_id) != _SPAN_ID_LEN
        or span_id == _ZERO_SPAN_ID
        or not min_time_ns <= span.start_time_unix_nano <= span.end_time_unix_nano < max_time_ns
        or (
            parent_span_id
            and (len(parent_span_id) != _SPAN_ID_LEN or parent_span_id == _ZERO_SPAN_ID)
        )
    ):
        return True
    size = span.ByteSize()
    return bool(
        (size > fast_path_bytes or span.events or span.links)
        and _size_problem(span, limits, size) is not None
    )


def _dirty_scopes(
    request: ExportTraceServiceRequest, limits: SpanLimits, encoded: bytes | None
) -> list[tuple[int, int]]:
    """(resource index, scope index) of each scope holding a span that ``_needs_cleaning``."""
    dirty_scopes: list[tuple[int, int]] = []
    min_time_ns, max_time_ns = limits.min_time_ns, limits.max_time_ns
    fast_path_bytes = limits.fast_path_bytes
    suspects = None
    if encoded is not None:
        suspects = wire.unclean_spans(encoded, fast_path_bytes, min_time_ns, max_time_ns)
    if suspects is not None:  # the rest passed the same checks in C
        all_resource_spans = request.resource_spans
        for resource_index, scope_index, span_index in suspects:
            where = (resource_index, scope_index)
            if dirty_scopes and dirty_scopes[-1] == where:
                continue
            scope_spans = all_resource_spans[resource_index].scope_spans[scope_index]
            if _needs_cleaning(
                scope_spans.spans[span_index], limits, min_time_ns, max_time_ns, fast_path_bytes
            ):
                dirty_scopes.append(where)
        return dirty_scopes
    for resource_index, resource_spans in enumerate(request.resource_spans):
        for scope_index, scope_spans in enumerate(resource_spans.scope_spans):
            for span in scope_spans.spans:
                if _needs_cleaning(span, limits, min_time_ns, max_time_ns, fast_path_bytes):
                    dirty_scopes.append((resource_index, scope_index))
                    break
    return dirty_scopes


def _clean_scope(scope_spans: ScopeSpans, reason_counts: list[int], limits: SpanLimits) -> None:
    """Remove the invalid spans of one scope in place, counting them per reason."""
    spans = scope_spans.spans
    reasons = [_rejection_reason(span, limits) for span in spans]
    kept = 0
    for reason in reasons:
        if reason is None:
            kept += 1
        else:
            reason_counts[reason] += 1
    if kept == len(spans):  # only all-zero parents were fixed
        return
    if kept:
        # A stable sort moves the kept spans to the front without copying any message, then one
        # slice delete drops the rest: O(n log n) pointer moves instead of O(n) deletes of O(n).
        # list.sort computes each key once, in order, so the keys come from ``reasons``.
        rejected = iter([reason is not None for reason in reasons])
        spans.sort(key=lambda _span: next(rejected))
    del spans[kept:]


def _describe(reason_counts: list[int]) -> tuple[int, str]:
    rejected = sum(reason_counts)
    parts = ", ".join(
        f"{count} {reason}"
        for reason, count in zip(REJECTION_REASONS, reason_counts, strict=True)
        if count
    )
    noun = "span" if rejected == 1 else "spans"
    return rejected, f"rejected {rejected} {noun}: {parts}"


class Sanitized(tuple[int, str]):
    """What ``sanitize`` returns: the pair ``(rejected_spans, error_message)``, and
    ``modified``: whether the request changed at all (spans removed, or an all-zero parent
    rewritten). When it did not, the bytes it was decoded from are still its serialisation."""

    modified: bool

    def __new__(cls, rejected_spans: int, error_message: str, *, modified: bool) -> Sanitized:
        sanitized = super().__new__(cls, (rejected_spans, error_message))
        sanitized.modified = modified
        return sanitized


def sanitize(
    request: ExportTraceServiceRequest,
    limits: SpanLimits = DEFAULT_SPAN_LIMITS,
    *,
    encoded: bytes | None = None,
) -> Sanitized:
    """Remove invalid spans from ``request`` in place; return (rejected_spans, error_message),
    which also says whether the request was ``modified``.

    Invalid: trace_id not 16 bytes or all zero; span_id not 8 bytes or all zero; parent_span_id
    neither empty nor 8 bytes; start_time_unix_nano 0; end_time_unix_nano before the start; a
    start before ``limits.min_time_ns``, or an end or event time at or after
    ``limits.max_time_ns``; more attributes, events, links or array elements, or a longer
    string, than ``limits`` allow (see ``REJECTION_REASONS``). An all-zero 8-byte
    parent_span_id is rewritten to empty (a root span). Scopes and resources left without spans
    by the removal are removed. Returns ``(0, "")`` when nothing was rejected.

    ``encoded``: the bytes ``request`` was parsed from, when at hand: the cheap checks then run
    over them in C (``wire.unclean_spans``) and only the spans they single out are looked at
    here.
    """
    dirty_scopes = _dirty_scopes(request, limits, encoded)
    if not dirty_scopes:
        return Sanitized(0, "", modified=False)

    reason_counts = [0] * len(REJECTION_REASONS)
    emptied: dict[int, list[int]] = {}
    for resource_index, scope_index in dirty_scopes:
        scope_spans = request.resource_spans[resource_index].scope_spans[scope_index]
        _clean_scope(scope_spans, reason_counts, limits)
        if not scope_spans.spans:
            emptied.setdefault(resource_index, []).append(scope_index)
    # Delete back to front so that the recorded indices stay valid.
    for resource_index in sorted(emptied, reverse=True):
        all_scope_spans = request.resource_spans[resource_index].scope_spans
        for scope_index in reversed(emptied[resource_index]):
            del all_scope_spans[scope_index]
        if not all_scope_spans:
            del request.resource_spans[resource_index]
    if not any(reason_counts):  # only all-zero parents were fixed
        return Sanitized(0, "", modified=True)
    return Sanitized(*_describe(reason_counts), modified=True)
