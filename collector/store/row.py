"""The request store's row of one request: its columns, its compact ``detail`` JSON, and the
way back from a row to the record it was written from.

Writing is hot, reading is rare, so a row is cheap to make:

- ``request_row`` turns one ``RequestRecord`` into the ``requests`` row the store keeps: the
  columns its queries use, plus ``detail``, a compact JSON object of the rest of the record in
  integer ns (no rounding, no per-token work: token offsets stay in the stored OTLP spans, the
  row only counts them).
- ``record_from_row`` rebuilds the record, as far as a document's verdicts and budgets need
  it, from a row, its ``detail`` and the request's stored decode and engine-step spans
  (``decode_from_otlp``).

This is the storage format every store backend shares (the column names and the ``detail``
keys); turning a row into what readers print is ``document.py``'s, and the SQL that stores the
rows is the backend's.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple

import msgspec
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import semconv
from tokentrace.processors.budget import inter_token_gaps_ns
from tokentrace.processors.causes import ADVICE
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.model import (
    Budget,
    RequestMetrics,
    RequestRecord,
    RequestTimeline,
)
from tokentrace.processors.timeline import dialect_not_reported, sglang_token_offsets_us

TIMELINE_BOUNDARIES: Final = (
    "client_start",
    "server_start",
    "engine_arrival",
    "ready",
    "first_scheduled",
    "first_token",
    "server_first_body",
    "client_first_byte",
    "client_first_token",
    "last_token",
    "end",
    "server_end",
    "client_end",
)
"""The ``RequestTimeline`` boundary fields, in the order of a stored detail's ``at`` list."""
BOUNDARY_KEYS: Final = tuple(
    "arrival" if name == "engine_arrival" else name for name in TIMELINE_BOUNDARIES
)
"""The keys of a document's ``timeline.boundaries_ms``, one per ``TIMELINE_BOUNDARIES`` field:
the field's name, except that engine arrival keeps the API's name ``arrival`` (API clients and
the UI read it)."""

CONTEXT_FIELDS: Final = (
    "requests_ahead",
    "running_at_arrival",
    "max_running",
    "outlier_steps_with_prefill",
    "decode_bandwidth_peak_ratio",
    "decode_roofline_ratio",
    "prefix_hash",
)
"""The ``RequestTimeline`` fields a row keeps as the document's ``context``."""
_WIRE_FIELDS: Final = (
    "client_stream",
    "client_connection_reused",
    "client_connect_ns",
    "client_send_wait_ns",
    "client_first_token_read_wait_ns",
    "client_read_wait_ns",
    "client_rtt_ns",
    "http_receive_wait_ns",
)
"""What the client and the server measured of the time outside the server span."""


class StoredRow(NamedTuple):
    """A ``requests`` row by column name, in ``REQUEST_COLUMNS`` order."""

    trace_id: bytes
    span_id: bytes
    start_ns: int
    service: str
    model: str
    operation: str
    prompt_bucket: str
    dialect: str
    e2e_ns: int
    ttft_ns: int | None
    tpot_ns: int | None
    queue_ns: int | None
    prefill_ns: int | None
    decode_ns: int | None
    network_ns: int | None
    input_tokens: int | None
    output_tokens: int | None
    segment: str | None
    cause: str | None
    verdict: str | None
    slo_breached: int
    request_id: str | None
    detail: str


REQUEST_COLUMNS: Final = StoredRow._fields
"""The ``requests`` columns in the order of a ``request_row`` tuple (and of the store's SELECTs).
``detail`` stays last (the store sums its sizes as ``row[-1]``)."""

METRIC_COLUMNS: Final = {
    semconv.METRIC_E2E: "e2e_ns",
    semconv.METRIC_TTFT: "ttft_ns",
    semconv.METRIC_TPOT: "tpot_ns",
    semconv.METRIC_QUEUE: "queue_ns",
    semconv.METRIC_PREFILL: "prefill_ns",
    semconv.METRIC_DECODE: "decode_ns",
    semconv.METRIC_NETWORK: "network_ns",
}
"""Per-request metrics -> their ``requests`` column: the only column names a metric ordering
(``slowest``, the list's sorts) puts into SQL."""


SUMMARY_COLUMNS: Final = tuple(
    column for column in REQUEST_COLUMNS if column not in ("dialect", "detail")
)
"""The columns ``document.summary_from_row`` reads, in its row's order: no ``detail``, so a list
of summaries never decodes JSON."""

# Field getters in C: one call per group instead of one getattr per field.
_boundaries_of: Final = operator.attrgetter(*TIMELINE_BOUNDARIES)
_context_of: Final = operator.attrgetter(*CONTEXT_FIELDS)
_wire_of: Final = operator.attrgetter(*_WIRE_FIELDS)
# msgspec's encoder writes a row's detail in a fifth of the standard library's time
# (docs/performance.md). It writes non-finite floats (a verdict number, a bandwidth ratio) as
# null, which is what readers make of them anyway (``document.finite_or_none``, the diagnosis'
# ``_finite``). What it refuses (a subclass of str, a lone surrogate) goes through the standard
# library's encoder, which writes NaN/Infinity as Python's JSON reader accepts them.
_fast_encode_detail: Final = msgspec.json.Encoder().encode
_standard_encode_detail: Final = json.JSONEncoder(
    separators=(",", ":"), allow_nan=True, check_circular=False
).encode
decode_detail: Final = json.JSONDecoder().decode


def encode_detail(detail: Mapping[str, Any]) -> str:
    """A row's ``detail`` as compact JSON text; raises TypeError/ValueError on a value JSON
    cannot hold."""
    try:
        return _fast_encode_detail(detail).decode()
    except (TypeError, ValueError, msgspec.EncodeError):  # ValueError: a lone surrogate
        return _standard_encode_detail(detail)


# ``detail`` keys (short: one row per request).
DETAIL_SEGMENTS: Final = "seg"
DETAIL_TTFT_NS: Final = "ttft"
DETAIL_TTFT_SEGMENTS: Final = "tseg"
DETAIL_SKEW: Final = "skew"
DETAIL_E2E_METRIC: Final = "e2e"
DETAIL_BOUNDARIES: Final = "at"
DETAIL_PREEMPTED: Final = "pre"
DETAIL_CHUNKS: Final = "chunks"
DETAIL_OFFSETS: Final = "offsets"
DETAIL_CACHED: Final = "cached"
DETAIL_FINISH: Final = "finish"
DETAIL_ERROR: Final = "error"
DETAIL_CONTEXT: Final = "ctx"
DETAIL_ADVICE: Final = "advice"
DETAIL_NUMBERS: Final = "numbers"
DETAIL_SLO: Final = "slo"
DETAIL_VERDICT_METRIC: Final = "vm"
DETAIL_VERDICT_CLOCK: Final = "vc"
DETAIL_VERDICT_WHY: Final = "vw"
DETAIL_PREFIX_SEEN: Final = "ps"
DETAIL_CLIENT_TTFT: Final = "cttft"
DETAIL_CLIENT_TTFT_SEGMENTS: Final = "ctseg"
DETAIL_WIRE: Final = "wire"
DETAIL_NOT_REPORTED: Final = "nr"
"""[source, [what it cannot tell, ...]] (``RequestTimeline.not_reported``), when there is any."""


def request_start_ns(timeline: RequestTimeline) -> int:
    """When the request started as the server saw it (client start for client-only traces)."""
    for value in (
        timeline.server_start,
        timeline.engine_arrival,
        timeline.client_start,
        timeline.first_token,
        timeline.end,
        timeline.client_end,
    ):
        if value is not None:
            return int(value)
    raise ValueError("request timeline has no timestamp at all")


def _optional_int(value: int | None) -> int | None:
    return None if value is None else int(value)


# --- record -> row -------------------------------------------------------------------------------


def request_row(record: RequestRecord) -> tuple[Any, ...]:
    """The ``requests`` row of one record (``REQUEST_COLUMNS`` order).

    Raises (TypeError/ValueError/AttributeError) on a malformed record, e.g. None where a
    number must be; the store counts such records as rejected. Cheap on purpose: it runs for
    every request the collector sees.
    """
    timeline = record.timeline
    budget = record.budget
    metrics = record.metrics
    verdict = record.verdict
    trace_id = bytes(timeline.trace_id)
    span_id = bytes(timeline.span_id)
    if not trace_id or not span_id:
        raise ValueError("request record without trace or span id")
    segments = budget.segments
    ttft_segments = budget.ttft_segments
    # sum() checks in C that every segment is a number: a record that the reader could not
    # turn into a document is rejected now, not stored.
    sum(segments.values())
    sum(ttft_segments.values())
    slo = record.slo
    detail: dict[str, Any] = {
        DETAIL_SEGMENTS: segments,
        DETAIL_TTFT_NS: _optional_int(budget.ttft_ns),
        DETAIL_TTFT_SEGMENTS: ttft_segments,
        DETAIL_SKEW: bool(budget.skew_clamped),
        DETAIL_E2E_METRIC: int(metrics.e2e),
        DETAIL_BOUNDARIES: _boundaries_of(timeline),
        DETAIL_PREEMPTED: timeline.preempted,
        DETAIL_CHUNKS: timeline.prefill_chunks,
        DETAIL_OFFSETS: (len(timeline.token_offsets_us), int(timeline.token_offsets_dropped)),
        DETAIL_CACHED: timeline.cached_tokens,
        DETAIL_FINISH: timeline.finish_reason,
        DETAIL_ERROR: timeline.status_error,
        DETAIL_CONTEXT: _context_of(timeline),
        DETAIL_SLO: slo,
    }
    if verdict is not None:
        detail[DETAIL_NUMBERS] = verdict.numbers
        if verdict.advice != ADVICE.get(verdict.cause):  # the usual advice is not repeated
            detail[DETAIL_ADVICE] = verdict.advice
        detail[DETAIL_VERDICT_METRIC] = verdict.metric
        detail[DETAIL_VERDICT_CLOCK] = verdict.clock
        if verdict.why:
            detail[DETAIL_VERDICT_WHY] = verdict.why
    # What the verdicts about the other metrics need, derived when a document is read:
    if record.prefix_seen:
        detail[DETAIL_PREFIX_SEEN] = 1
    if budget.client_ttft_ns is not None:
        detail[DETAIL_CLIENT_TTFT] = int(budget.client_ttft_ns)
        detail[DETAIL_CLIENT_TTFT_SEGMENTS] = {
            k: v for k, v in budget.client_ttft_segments.items() if v
        }
    wire = _wire_of(timeline)
    if any(value is not None for value in wire):
        detail[DETAIL_WIRE] = wire
    if timeline.not_reported:
        detail[DETAIL_NOT_REPORTED] = [timeline.not_reported_by, list(timeline.not_reported)]
    return (
        trace_id,
        span_id,
        request_start_ns(timeline),
        str(timeline.service),
        str(timeline.model),
        str(timeline.operation),
        str(record.prompt_bucket),
        str(timeline.dialect),
        int(budget.e2e_ns),
        _optional_int(metrics.ttft),
        _optional_int(metrics.tpot),
        _optional_int(metrics.queue),
        _optional_int(metrics.prefill),
        _optional_int(metrics.decode),
        _optional_int(metrics.network),
        _optional_int(timeline.input_tokens),
        _optional_int(timeline.output_tokens),
        None if verdict is None else str(verdict.segment),
        None if verdict is None else str(verdict.cause),
        None if verdict is None else str(verdict.sentence),
        len(slo) - sum(map(bool, slo.values())) if slo else 0,
        None if timeline.request_id is None else str(timeline.request_id),
        encode_detail(detail),
    )


# --- row -> record -------------------------------------------------------------------------------


class DecodeSpans(NamedTuple):
    """What a request's stored decode and engine-step spans hold (``decode_from_otlp``)."""

    token_offsets: Sequence[int] | None
    """µs after the first token; None when the request's decode span is not stored."""
    engine_steps: list[tuple[int, int, int]]
    """(start, end, prefill tokens) of the engine steps under the request span."""


def decode_from_otlp(otlp: bytes, request_span_id: bytes) -> DecodeSpans:
    """The token offsets on the decode span of a request and its engine steps, read from a
    stored serialised ``ExportTraceServiceRequest`` the way ``processors.timeline`` reads them:
    the earliest ``llm.decode`` child of the request span, integer elements only; every valid
    ``llm.engine.step`` child, in start order. Without a decode span, an SGLang request's token
    times from its ``decode_loop`` spans (``timeline.sglang_token_offsets_us``)."""
    request = ExportTraceServiceRequest.FromString(otlp)
    decode = None
    steps: list[tuple[int, int, int]] = []
    scoped: list[tuple[InstrumentationScope, Span]] = []
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                scoped.append((scope_spans.scope, span))
                if span.parent_span_id != request_span_id:
                    continue
                start = span.start_time_unix_nano
                if not start or span.end_time_unix_nano < start:
                    continue
                if span.name == semconv.SPAN_ENGINE_STEP:
                    steps.append((start, span.end_time_unix_nano, _prefill_tokens(span)))
                elif span.name == semconv.SPAN_DECODE and (
                    decode is None or start < decode.start_time_unix_nano
                ):
                    decode = span
    steps.sort()
    if decode is None:
        return DecodeSpans(sglang_token_offsets_us(scoped, request_span_id), steps)
    for attribute in decode.attributes:
        if attribute.key == semconv.DECODE_TOKEN_OFFSETS:
            offsets = [
                element.int_value
                for element in attribute.value.array_value.values
                if element.WhichOneof("value") == "int_value"
            ]
            return DecodeSpans(offsets, steps)
    return DecodeSpans([], steps)


def _prefill_tokens(step: Span) -> int:
    for attribute in step.attributes:
        if attribute.key == semconv.ENGINE_STEP_PREFILL_TOKENS:
            value = attribute.value
            return value.int_value if value.WhichOneof("value") == "int_value" else 0
    return 0


def not_reported_of(dialect: str, detail: Mapping[str, Any]) -> tuple[str | None, list[str]]:
    """(source, what it cannot tell) of a stored request; rows stored before the detail held it
    fall back on their dialect's (``timeline.dialect_not_reported``)."""
    stored = detail.get(DETAIL_NOT_REPORTED)
    if stored:
        source, missing = stored
        return (None if source is None else str(source)), [str(item) for item in missing]
    source, missing = dialect_not_reported(dialect)
    return source, list(missing)


def record_from_row(
    stored: StoredRow,
    detail: Mapping[str, Any],
    spans: DecodeSpans,
    diagnosis: DiagnosisConfig,
) -> RequestRecord:
    """The record a row was written from, as far as the verdicts and budgets of the document
    need it: rebuilt from the row, its ``detail`` and the request's token offsets, never from
    the stored spans of other requests (so every reader derives the same document)."""
    at = dict(zip(TIMELINE_BOUNDARIES, detail.get(DETAIL_BOUNDARIES) or (), strict=False))
    timeline = RequestTimeline(
        trace_id=bytes(stored.trace_id),
        span_id=bytes(stored.span_id),
        dialect=str(stored.dialect),
        service=str(stored.service),
        model=str(stored.model),
        operation=str(stored.operation),
        preempted=[(int(a), int(b)) for a, b in detail.get(DETAIL_PREEMPTED) or ()],
        prefill_chunks=[(int(a), int(b), int(c)) for a, b, c in detail.get(DETAIL_CHUNKS) or ()],
        token_offsets_us=spans.token_offsets or [],
        engine_steps=spans.engine_steps,
        input_tokens=stored.input_tokens,
        output_tokens=stored.output_tokens,
        cached_tokens=detail.get(DETAIL_CACHED),
        finish_reason=detail.get(DETAIL_FINISH),
        request_id=stored.request_id,
        status_error=detail.get(DETAIL_ERROR),
    )
    source, not_reported = not_reported_of(stored.dialect, detail)
    timeline.not_reported, timeline.not_reported_by = tuple(not_reported), source
    for name, value in at.items():
        setattr(timeline, name, value)
    for names, values in (
        (CONTEXT_FIELDS, detail.get(DETAIL_CONTEXT)),
        (_WIRE_FIELDS, detail.get(DETAIL_WIRE)),
    ):
        for name, value in zip(names, values or (), strict=False):
            setattr(timeline, name, value)
    segments = {str(name): int(ns) for name, ns in detail[DETAIL_SEGMENTS].items()}
    server_view = timeline.server_start is not None or timeline.engine_arrival is not None
    budget = Budget(
        e2e_ns=int(stored.e2e_ns),
        segments=segments,
        ttft_ns=_optional_int(detail.get(DETAIL_TTFT_NS)),
        ttft_segments={str(k): int(v) for k, v in (detail.get(DETAIL_TTFT_SEGMENTS) or {}).items()},
        skew_clamped=bool(detail.get(DETAIL_SKEW)),
        server_e2e_ns=_optional_int(detail.get(DETAIL_E2E_METRIC)) if server_view else None,
        client_ttft_ns=_optional_int(detail.get(DETAIL_CLIENT_TTFT)),
        client_ttft_segments=dict(detail.get(DETAIL_CLIENT_TTFT_SEGMENTS) or {}),
    )
    metrics = RequestMetrics(
        ttft=stored.ttft_ns,
        tpot=stored.tpot_ns,
        e2e=int(detail.get(DETAIL_E2E_METRIC, stored.e2e_ns)),
        queue=stored.queue_ns,
        prefill=stored.prefill_ns,
        decode=stored.decode_ns,
        network=stored.network_ns,
        itl=inter_token_gaps_ns(spans.token_offsets or []),
    )
    return RequestRecord(
        timeline=timeline,
        budget=budget,
        metrics=metrics,
        prompt_bucket=str(stored.prompt_bucket),
        slo={str(name): bool(met) for name, met in (detail.get(DETAIL_SLO) or {}).items()},
        prefix_seen=bool(detail.get(DETAIL_PREFIX_SEEN)),
        itl_outlier_ratio=diagnosis.itl_outlier_ratio,
    )


def budget_segments_ns(detail_json: str) -> dict[str, int]:
    """The budget segments (ns) stored in a row's ``detail``; raises ValueError/KeyError/
    TypeError on a detail that is not a stored request's."""
    segments = decode_detail(detail_json)[DETAIL_SEGMENTS]
    return {str(name): int(value) for name, value in segments.items()}
