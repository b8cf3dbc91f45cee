"""Drop spans that no later stage can use, and say why (for OTLP ``partial_success``).

Runs on every received span, so the all-valid case is one tight loop over five fields; the
per-reason bookkeeping happens only in scopes that hold an invalid span.
"""

from __future__ import annotations

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, Span

__all__ = ["REJECTION_REASONS", "sanitize"]

_TRACE_ID_LEN = 16
_SPAN_ID_LEN = 8
_ZERO_TRACE_ID = bytes(_TRACE_ID_LEN)
_ZERO_SPAN_ID = bytes(_SPAN_ID_LEN)

REJECTION_REASONS: tuple[str, ...] = (
    "invalid trace_id",
    "invalid span_id",
    "invalid parent_span_id",
    "missing start time",
    "end before start",
)
"""Reasons in the order they are checked and listed; a span counts under its first reason."""

_BAD_TRACE_ID, _BAD_SPAN_ID, _BAD_PARENT_SPAN_ID, _NO_START, _END_BEFORE_START = range(5)


def _rejection_reason(span: Span) -> int | None:
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
    if span.end_time_unix_nano < start:
        return _END_BEFORE_START
    return None


def _clean_scope(scope_spans: ScopeSpans, reason_counts: list[int]) -> None:
    """Remove the invalid spans of one scope in place, counting them per reason."""
    spans = scope_spans.spans
    kept = 0
    for span in spans:
        reason = _rejection_reason(span)
        if reason is None:
            kept += 1
        else:
            reason_counts[reason] += 1
    if kept == len(spans):  # only all-zero parents were fixed
        return
    if kept:
        # A stable sort moves the kept spans to the front without copying any message, then one
        # slice delete drops the rest: O(n log n) pointer moves instead of O(n) deletes of O(n).
        spans.sort(key=lambda span: _rejection_reason(span) is not None)
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


def sanitize(request: ExportTraceServiceRequest) -> tuple[int, str]:
    """Remove invalid spans from ``request`` in place; return (rejected_spans, error_message).

    Invalid: trace_id not 16 bytes or all zero; span_id not 8 bytes or all zero; parent_span_id
    neither empty nor 8 bytes; start_time_unix_nano 0; end_time_unix_nano before the start.
    An all-zero 8-byte parent_span_id is rewritten to empty (a root span). Scopes and resources
    left without spans by the removal are removed. Returns ``(0, "")`` when nothing was rejected.
    """
    dirty_scopes: list[tuple[int, int]] = []
    zero_trace_id = _ZERO_TRACE_ID
    zero_span_id = _ZERO_SPAN_ID
    for resource_index, resource_spans in enumerate(request.resource_spans):
        for scope_index, scope_spans in enumerate(resource_spans.scope_spans):
            for span in scope_spans.spans:
                trace_id = span.trace_id
                span_id = span.span_id
                parent_span_id = span.parent_span_id
                start = span.start_time_unix_nano
                if (
                    len(trace_id) != 16
                    or trace_id == zero_trace_id
                    or len(span_id) != 8
                    or span_id == zero_span_id
                    or not start
                    or span.end_time_unix_nano < start
                    or (
                        parent_span_id
                        and (len(parent_span_id) != 8 or parent_span_id == zero_span_id)
                    )
                ):
                    dirty_scopes.append((resource_index, scope_index))
                    break
    if not dirty_scopes:
        return 0, ""

    reason_counts = [0] * len(REJECTION_REASONS)
    emptied: dict[int, list[int]] = {}
    for resource_index, scope_index in dirty_scopes:
        scope_spans = request.resource_spans[resource_index].scope_spans[scope_index]
        _clean_scope(scope_spans, reason_counts)
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
        return 0, ""
    return _describe(reason_counts)
