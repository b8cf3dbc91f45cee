"""The request store's rows and the JSON documents its readers (CLI, API, web UI) print.

Writing is hot, reading is rare, so the work is split between them:

- ``request_row`` turns one ``RequestRecord`` into the ``requests`` row the store keeps: the
  columns its queries use, plus ``detail``, a compact JSON object of the rest of the record in
  integer ns (no rounding, no per-token work: token offsets stay in the stored OTLP spans, the
  row only counts them).
- ``document_from_row`` builds the document ``tokentrace explain --json`` prints from such a row,
  at read time. ``record_to_dict`` is the same document straight from a record (one code path).
  The row keeps the request's default verdict (the metric of the target it breached); each
  metric's budget and the verdicts about its other metrics are derived here, from a record
  rebuilt from the row and the request's decode and engine-step spans, by the collector's
  diagnosis settings (``META_DIAGNOSIS``): the collector does not pay per request for verdicts
  that only a drill-down asks for.

Document durations are milliseconds as floats rounded to 3 decimals, i.e. exact microseconds.
Budget segments are rounded on their cumulative boundaries, so the segments' microseconds sum
exactly to the rounded E2E (the budget partitions E2E, and the document keeps that property).

``window_report`` turns stored sketch slices and SLO targets into the document
``tokentrace top --json`` prints; it is pure, so an API can serve the same shape.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Final, NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import semconv
from tokentrace.processors.budget import inter_token_gaps_ns, metric_budget
from tokentrace.processors.diagnosis import ADVICE, DiagnosisConfig, diagnose_request
from tokentrace.processors.model import (
    Budget,
    RequestMetrics,
    RequestRecord,
    RequestTimeline,
)
from tokentrace.processors.stats import nearest_rank

DOC_VERSION: Final = 1
"""Bumped when the request document changes shape incompatibly."""
DOC_TOKEN_OFFSETS_CAP: Final = 4096
"""Token offsets kept in one document; the rest are counted in ``token_offsets_dropped``."""

TIMELINE_BOUNDARIES: Final = (
    "client_start",
    "server_start",
    "arrival",
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
"""The ``RequestTimeline`` fields a document's ``timeline.boundaries_ms`` may hold."""

_CONTEXT_FIELDS: Final = (
    "requests_ahead",
    "running_at_arrival",
    "max_running",
    "outlier_steps_with_prefill",
    "decode_bandwidth_peak_ratio",
    "decode_roofline_ratio",
    "prefix_hash",
)
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
"""The columns ``summary_from_row`` reads, in its row's order: no ``detail``, so a list of
summaries never decodes JSON."""

TOP_QUANTILES: Final = ((0.5, "p50"), (0.95, "p95"), (0.99, "p99"))
"""The quantiles ``window_report`` reports for every metric."""

_NS_PER_US: Final = 1_000
_DEFAULT_DIAGNOSIS: Final = DiagnosisConfig()
_US_PER_MS: Final = 1_000
_NS_PER_S: Final = 1_000_000_000

# Field getters in C: one call per group instead of one getattr per field.
_boundaries_of: Final = operator.attrgetter(*TIMELINE_BOUNDARIES)
_context_of: Final = operator.attrgetter(*_CONTEXT_FIELDS)
_wire_of: Final = operator.attrgetter(*_WIRE_FIELDS)
# Non-finite floats (a verdict number, a bandwidth ratio) are written as NaN/Infinity, which
# Python's JSON reader accepts; the document turns them into null (``_finite``).
_encode_detail: Final = json.JSONEncoder(
    separators=(",", ":"), allow_nan=True, check_circular=False
).encode
_decode_detail: Final = json.JSONDecoder().decode

# ``detail`` keys (short: one row per request).
_D_SEGMENTS: Final = "seg"
_D_TTFT_NS: Final = "ttft"
_D_TTFT_SEGMENTS: Final = "tseg"
_D_SKEW: Final = "skew"
_D_E2E_METRIC: Final = "e2e"
_D_BOUNDARIES: Final = "at"
_D_PREEMPTED: Final = "pre"
_D_CHUNKS: Final = "chunks"
_D_OFFSETS: Final = "offsets"
_D_CACHED: Final = "cached"
_D_FINISH: Final = "finish"
_D_ERROR: Final = "error"
_D_CONTEXT: Final = "ctx"
_D_ADVICE: Final = "advice"
_D_NUMBERS: Final = "numbers"
_D_SLO: Final = "slo"
_D_VERDICT_METRIC: Final = "vm"
_D_VERDICT_CLOCK: Final = "vc"
_D_VERDICT_WHY: Final = "vw"
_D_PREFIX_SEEN: Final = "ps"
_D_CLIENT_TTFT: Final = "cttft"
_D_CLIENT_TTFT_SEGMENTS: Final = "ctseg"
_D_WIRE: Final = "wire"


def ns_to_ms(value_ns: int | None) -> float | None:
    """Integer ns -> ms rounded to the microsecond (half up), None stays None."""
    if value_ns is None:
        return None
    return _round_us(value_ns) / _US_PER_MS


def _round_us(value_ns: int) -> int:
    # Half up on integers: float division would round 0.5 µs either way.
    return (int(value_ns) + _NS_PER_US // 2) // _NS_PER_US


def _finite(value: Any) -> Any:
    """JSON has no NaN/Infinity: a non-finite float becomes None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _partition_ms(segments: Mapping[str, int], *, present_only: bool = False) -> dict[str, float]:
    """Every segment (``semconv.SEGMENTS`` order, then any unknown ones) in exact µs as ms;
    with ``present_only`` only the given ones (a metric budget's), in time order.

    Rounds the running sum, not each segment, so the rounded segments add up to the rounded
    total whenever the ns segments add up to ``total_ns``.
    """
    known = semconv.METRIC_BUDGET_SEGMENTS if present_only else semconv.SEGMENTS
    names = [name for name in known if not present_only or name in segments]
    names += sorted(name for name in segments if name not in known)
    out: dict[str, float] = {}
    cumulative_ns = 0
    previous_us = 0
    for name in names:
        cumulative_ns += int(segments.get(name, 0))
        cumulative_us = _round_us(cumulative_ns)
        out[name] = (cumulative_us - previous_us) / _US_PER_MS
        previous_us = cumulative_us
    return out


def _itl_summary(offsets_us: Sequence[int]) -> dict[str, float | int | None]:
    """Count, p50, p99 (nearest rank) and max of the inter-token gaps, derived from the token
    offsets exactly as ``RequestMetrics.itl`` is (``budget.inter_token_gaps_ns``)."""
    gaps_ns = inter_token_gaps_ns(offsets_us)
    if not gaps_ns:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    gaps_ns.sort()
    return {
        "count": len(gaps_ns),
        "p50": ns_to_ms(nearest_rank(gaps_ns, 50)),
        "p99": ns_to_ms(nearest_rank(gaps_ns, 99)),
        "max": ns_to_ms(gaps_ns[-1]),
    }


def request_start_ns(timeline: RequestTimeline) -> int:
    """When the request started as the server saw it (client start for client-only traces)."""
    for value in (
        timeline.server_start,
        timeline.arrival,
        timeline.client_start,
        timeline.first_token,
        timeline.end,
        timeline.client_end,
    ):
        if value is not None:
            return int(value)
    raise ValueError("request timeline has no timestamp at all")


def iso_utc(unix_ns: int) -> str:
    """ISO-8601 UTC with microseconds, e.g. ``2025-01-02T03:04:05.123456Z``."""
    seconds, rest_ns = divmod(int(unix_ns), _NS_PER_S)
    moment = datetime.fromtimestamp(seconds, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{rest_ns // _NS_PER_US:06d}Z"


def _optional_int(value: int | None) -> int | None:
    return None if value is None else int(value)


# --- write side: one row per request ------------------------------------------------------------


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
        _D_SEGMENTS: segments,
        _D_TTFT_NS: _optional_int(budget.ttft_ns),
        _D_TTFT_SEGMENTS: ttft_segments,
        _D_SKEW: bool(budget.skew_clamped),
        _D_E2E_METRIC: int(metrics.e2e),
        _D_BOUNDARIES: _boundaries_of(timeline),
        _D_PREEMPTED: timeline.preempted,
        _D_CHUNKS: timeline.prefill_chunks,
        _D_OFFSETS: (len(timeline.token_offsets_us), int(timeline.token_offsets_dropped)),
        _D_CACHED: timeline.cached_tokens,
        _D_FINISH: timeline.finish_reason,
        _D_ERROR: timeline.status_error,
        _D_CONTEXT: _context_of(timeline),
        _D_SLO: slo,
    }
    if verdict is not None:
        detail[_D_NUMBERS] = verdict.numbers
        if verdict.advice != ADVICE.get(verdict.cause):  # the usual advice is not repeated
            detail[_D_ADVICE] = verdict.advice
        detail[_D_VERDICT_METRIC] = verdict.metric
        detail[_D_VERDICT_CLOCK] = verdict.clock
        if verdict.why:
            detail[_D_VERDICT_WHY] = verdict.why
    # What the verdicts about the other metrics need, derived when a document is read:
    if record.prefix_seen:
        detail[_D_PREFIX_SEEN] = 1
    if budget.client_ttft_ns is not None:
        detail[_D_CLIENT_TTFT] = int(budget.client_ttft_ns)
        detail[_D_CLIENT_TTFT_SEGMENTS] = {
            k: v for k, v in budget.client_ttft_segments.items() if v
        }
    wire = _wire_of(timeline)
    if any(value is not None for value in wire):
        detail[_D_WIRE] = wire
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
        _encode_detail(detail),
    )


def _stored_record(
    stored: StoredRow,
    detail: Mapping[str, Any],
    spans: DecodeSpans,
    diagnosis: DiagnosisConfig,
) -> RequestRecord:
    """The record a row was written from, as far as the verdicts and budgets of the document
    need it: rebuilt from the row, its ``detail`` and the request's token offsets, never from
    the stored spans of other requests (so every reader derives the same document)."""
    at = dict(zip(TIMELINE_BOUNDARIES, detail.get(_D_BOUNDARIES) or (), strict=False))
    timeline = RequestTimeline(
        trace_id=bytes(stored.trace_id),
        span_id=bytes(stored.span_id),
        dialect=str(stored.dialect),
        service=str(stored.service),
        model=str(stored.model),
        operation=str(stored.operation),
        preempted=[(int(a), int(b)) for a, b in detail.get(_D_PREEMPTED) or ()],
        prefill_chunks=[(int(a), int(b), int(c)) for a, b, c in detail.get(_D_CHUNKS) or ()],
        token_offsets_us=spans.token_offsets or [],
        engine_steps=spans.engine_steps,
        input_tokens=stored.input_tokens,
        output_tokens=stored.output_tokens,
        cached_tokens=detail.get(_D_CACHED),
        finish_reason=detail.get(_D_FINISH),
        request_id=stored.request_id,
        status_error=detail.get(_D_ERROR),
    )
    for name, value in at.items():
        setattr(timeline, name, value)
    for names, values in (
        (_CONTEXT_FIELDS, detail.get(_D_CONTEXT)),
        (_WIRE_FIELDS, detail.get(_D_WIRE)),
    ):
        for name, value in zip(names, values or (), strict=False):
            setattr(timeline, name, value)
    segments = {str(name): int(ns) for name, ns in detail[_D_SEGMENTS].items()}
    server_view = timeline.server_start is not None or timeline.arrival is not None
    budget = Budget(
        e2e_ns=int(stored.e2e_ns),
        segments=segments,
        ttft_ns=_optional_int(detail.get(_D_TTFT_NS)),
        ttft_segments={str(k): int(v) for k, v in (detail.get(_D_TTFT_SEGMENTS) or {}).items()},
        skew_clamped=bool(detail.get(_D_SKEW)),
        server_e2e_ns=_optional_int(detail.get(_D_E2E_METRIC)) if server_view else None,
        client_ttft_ns=_optional_int(detail.get(_D_CLIENT_TTFT)),
        client_ttft_segments=dict(detail.get(_D_CLIENT_TTFT_SEGMENTS) or {}),
    )
    metrics = RequestMetrics(
        ttft=stored.ttft_ns,
        tpot=stored.tpot_ns,
        e2e=int(detail.get(_D_E2E_METRIC, stored.e2e_ns)),
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
        slo={str(name): bool(met) for name, met in (detail.get(_D_SLO) or {}).items()},
        prefix_seen=bool(detail.get(_D_PREFIX_SEEN)),
        outlier_ratio=diagnosis.itl_spike_ratio,
    )


def _metric_budgets_doc(record: RequestRecord) -> dict[str, dict[str, Any]]:
    """Every metric budget of the request (``budget.metric_budget``), on each clock it has."""
    budgets: dict[str, dict[str, Any]] = {}
    for metric in semconv.VERDICT_METRICS:
        for clock in (semconv.CLOCK_SERVER, semconv.CLOCK_CLIENT):
            view = metric_budget(record, metric, clock=clock)
            if view is not None:
                present = {name: ns for name, ns in view.segments.items() if ns}
                budgets.setdefault(metric, {})[clock] = {
                    "value_ms": ns_to_ms(view.value_ns),
                    "segments": _partition_ms(present, present_only=True),
                }
    return budgets


def _verdicts_doc(
    record: RequestRecord, default: dict[str, Any], diagnosis: DiagnosisConfig
) -> dict[str, dict[str, Any]]:
    """The stored default verdict, and the verdicts about the request's other metrics derived
    now (``diagnosis.diagnose_request``, with the window's prefix judgement it was stored
    with), in ``semconv.VERDICT_METRICS`` order."""
    prefix = record.timeline.prefix_hash
    seen = frozenset((prefix,)) if record.prefix_seen and prefix else frozenset()
    verdicts: dict[str, dict[str, Any]] = {}
    for metric in semconv.VERDICT_METRICS:
        if metric == default["metric"]:
            verdicts[metric] = default
            continue
        verdict = diagnose_request(record, diagnosis, metric=metric, seen_prefixes=seen)
        if verdict is not None:
            verdicts[metric] = _verdict_doc(
                verdict.segment,
                verdict.cause,
                verdict.sentence,
                verdict.advice,
                verdict.numbers,
                metric=metric,
                clock=verdict.clock,
            )
    return verdicts


class DecodeSpans(NamedTuple):
    """What a request's stored decode and engine-step spans hold (``decode_from_otlp``)."""

    token_offsets: list[int] | None
    """µs after the first token; None when the request's decode span is not stored."""
    engine_steps: list[tuple[int, int, int]]
    """(start, end, prefill tokens) of the engine steps under the request span."""


def decode_from_otlp(otlp: bytes, request_span_id: bytes) -> DecodeSpans:
    """The token offsets on the decode span of a request and its engine steps, read from a
    stored serialised ``ExportTraceServiceRequest`` the way ``processors.timeline`` reads them:
    the earliest ``llm.decode`` child of the request span, integer elements only; every valid
    ``llm.engine.step`` child, in start order."""
    request = ExportTraceServiceRequest.FromString(otlp)
    decode = None
    steps: list[tuple[int, int, int]] = []
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
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
        return DecodeSpans(None, steps)
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


# --- read side: the document of one row ---------------------------------------------------------


def _timeline_doc(
    boundaries: Sequence[int | None],
    preempted: Sequence[Sequence[int]],
    chunks: Sequence[Sequence[int]],
    start_ns: int,
) -> dict[str, Any]:
    present = {
        name: int(value)
        for name, value in zip(TIMELINE_BOUNDARIES, boundaries, strict=False)
        if value is not None
    }
    known = list(present.values())
    known += [int(start) for start, _ in preempted]
    known += [int(start) for start, _, _ in chunks]
    origin = min(known) if known else start_ns

    def offset(value: int) -> float:
        return _round_us(int(value) - origin) / _US_PER_MS

    return {
        "origin_unix_ns": origin,
        "boundaries_ms": {name: offset(value) for name, value in present.items()},
        "preemptions_ms": [[offset(start), offset(end)] for start, end in preempted],
        "prefill_chunks": [
            {"start_ms": offset(start), "end_ms": offset(end), "tokens": int(tokens)}
            for start, end, tokens in chunks
        ],
    }


def document_from_row(
    row: Sequence[Any],
    *,
    load_decode: Callable[[], DecodeSpans],
    diagnosis: DiagnosisConfig = _DEFAULT_DIAGNOSIS,
) -> dict[str, Any]:
    """The JSON-ready document of one stored request (see the module docstring for units).

    ``row`` is in ``REQUEST_COLUMNS`` order. ``load_decode`` (the request's token offsets and
    engine steps from its stored spans) is called only when the request recorded token
    offsets; when it cannot give them all (the trace's spans were evicted), the document counts
    them in ``token_offsets_dropped``. Each metric's budget and
    the verdicts about the metrics other than the stored default one's are derived here, by
    ``diagnosis`` (the collector's, from the store's meta). Raises
    (TypeError/ValueError/KeyError) on a row that is not a valid stored request.
    """
    stored = StoredRow._make(row)
    start_ns = int(stored.start_ns)
    detail = _decode_detail(stored.detail)

    budget_doc: dict[str, Any] = dict(_partition_ms(detail[_D_SEGMENTS]))
    budget_doc["e2e_ms"] = ns_to_ms(int(stored.e2e_ns))
    ttft_budget_doc: dict[str, Any] | None = None
    budget_ttft_ns = detail.get(_D_TTFT_NS)
    if budget_ttft_ns is not None:
        ttft_budget_doc = dict(_partition_ms(detail.get(_D_TTFT_SEGMENTS) or {}))
        ttft_budget_doc["ttft_ms"] = ns_to_ms(int(budget_ttft_ns))

    recorded, dropped = detail.get(_D_OFFSETS) or (0, 0)
    spans = DecodeSpans(None, [])
    if recorded:
        spans = load_decode()
        if spans.token_offsets is None or len(spans.token_offsets) != recorded:
            # The spans that hold them are gone: say how many are missing.
            spans = DecodeSpans(None, spans.engine_steps)
            dropped += recorded
    offsets = [int(v) for v in spans.token_offsets or ()]
    itl = _itl_summary(offsets)

    record = _stored_record(stored, detail, spans, diagnosis)
    if len(offsets) > DOC_TOKEN_OFFSETS_CAP:
        dropped += len(offsets) - DOC_TOKEN_OFFSETS_CAP
        offsets = offsets[:DOC_TOKEN_OFFSETS_CAP]
    verdict_doc: dict[str, Any] | None = None
    verdicts_doc: dict[str, dict[str, Any]] = {}
    if stored.segment is not None:
        verdict_doc = _verdict_doc(
            stored.segment,
            stored.cause,
            stored.verdict,
            detail.get(_D_ADVICE, ADVICE.get(str(stored.cause), "")),
            detail.get(_D_NUMBERS),
            metric=str(detail.get(_D_VERDICT_METRIC, semconv.METRIC_E2E)),
            clock=str(detail.get(_D_VERDICT_CLOCK, semconv.CLOCK_SERVER)),
        )
        verdict_doc["why"] = str(detail.get(_D_VERDICT_WHY, ""))
        verdicts_doc = _verdicts_doc(record, verdict_doc, diagnosis)

    context = {
        name: _finite(value)
        for name, value in zip(_CONTEXT_FIELDS, detail.get(_D_CONTEXT) or (), strict=False)
        if value is not None
    }

    return {
        "doc_version": DOC_VERSION,
        "trace_id": bytes(stored.trace_id).hex(),
        "span_id": bytes(stored.span_id).hex(),
        "service": stored.service,
        "model": stored.model,
        "operation": stored.operation,
        "dialect": stored.dialect,
        "prompt_bucket": stored.prompt_bucket,
        "request_id": stored.request_id,
        "start": {"iso": iso_utc(start_ns), "unix_ns": start_ns},
        "tokens": {
            "input": stored.input_tokens,
            "output": stored.output_tokens,
            "cached": detail.get(_D_CACHED),
        },
        "finish_reason": detail.get(_D_FINISH),
        "status_error": detail.get(_D_ERROR),
        "metrics_ms": {
            semconv.METRIC_TTFT: ns_to_ms(stored.ttft_ns),
            semconv.METRIC_TPOT: ns_to_ms(stored.tpot_ns),
            semconv.METRIC_E2E: ns_to_ms(int(detail.get(_D_E2E_METRIC, stored.e2e_ns))),
            semconv.METRIC_QUEUE: ns_to_ms(stored.queue_ns),
            semconv.METRIC_PREFILL: ns_to_ms(stored.prefill_ns),
            semconv.METRIC_DECODE: ns_to_ms(stored.decode_ns),
            semconv.METRIC_NETWORK: ns_to_ms(stored.network_ns),
            semconv.METRIC_ITL: itl,
        },
        "budget": budget_doc,
        "ttft_budget": ttft_budget_doc,
        "skew_clamped": bool(detail.get(_D_SKEW)),
        "timeline": _timeline_doc(
            detail.get(_D_BOUNDARIES) or (),
            detail.get(_D_PREEMPTED) or (),
            detail.get(_D_CHUNKS) or (),
            start_ns,
        ),
        "token_offsets_us": offsets,
        "token_offsets_dropped": int(dropped),
        "context": context,
        "budgets": _metric_budgets_doc(record),
        "verdict": verdict_doc,
        "verdicts": verdicts_doc,
        "slo": {str(name): bool(met) for name, met in (detail.get(_D_SLO) or {}).items()},
    }


def _verdict_doc(
    segment: Any,
    cause: Any,
    sentence: Any,
    advice: Any,
    numbers: Any,
    *,
    metric: str,
    clock: str,
) -> dict[str, Any]:
    return {
        "metric": metric,
        "clock": clock,
        "segment": segment,
        "cause": cause,
        "sentence": sentence,
        "advice": str(advice),
        "numbers": {str(k): _finite(v) for k, v in (numbers or {}).items()},
    }


def record_to_dict(
    record: RequestRecord, *, diagnosis: DiagnosisConfig = _DEFAULT_DIAGNOSIS
) -> dict[str, Any]:
    """The document of one record, exactly as the store gives it back after writing it.

    Raises (TypeError/ValueError/AttributeError) on a malformed record.
    """
    timeline = record.timeline
    spans = DecodeSpans(timeline.token_offsets_us, timeline.engine_steps)
    return document_from_row(request_row(record), load_decode=lambda: spans, diagnosis=diagnosis)


def summary_from_row(row: Sequence[Any]) -> dict[str, Any]:
    """The list API's ``RequestSummary`` (``docs/api.md``) of a row in ``SUMMARY_COLUMNS`` order.

    Columns only: no JSON decoding, no span reads (a list page builds up to 500 of these).
    Durations in ms as in the document (exact µs); ``slo_breached`` is true when any SLO target
    the request was judged against was missed.
    """
    (
        trace_id,
        span_id,
        start_ns,
        service,
        model,
        operation,
        bucket,
        e2e_ns,
        ttft_ns,
        tpot_ns,
        queue_ns,
        prefill_ns,
        decode_ns,
        network_ns,
        input_tokens,
        output_tokens,
        segment,
        cause,
        sentence,
        slo_breached,
        request_id,
    ) = row
    start_ns = int(start_ns)
    return {
        "trace_id": bytes(trace_id).hex(),
        "span_id": bytes(span_id).hex(),
        "request_id": request_id,
        "start_unix_ns": start_ns,
        "start_iso": iso_utc(start_ns),
        "service": service,
        "model": model,
        "operation": operation,
        "prompt_bucket": bucket,
        "e2e_ms": ns_to_ms(int(e2e_ns)),
        "ttft_ms": ns_to_ms(ttft_ns),
        "tpot_ms": ns_to_ms(tpot_ns),
        "queue_ms": ns_to_ms(queue_ns),
        "prefill_ms": ns_to_ms(prefill_ns),
        "decode_ms": ns_to_ms(decode_ns),
        "network_ms": ns_to_ms(network_ns),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "segment": segment,
        "cause": cause,
        "verdict": sentence,
        "slo_breached": bool(slo_breached),
    }


def budget_segments_ns(detail_json: str) -> dict[str, int]:
    """The budget segments (ns) stored in a row's ``detail``; raises ValueError/KeyError/
    TypeError on a detail that is not a stored request's."""
    segments = _decode_detail(detail_json)[_D_SEGMENTS]
    return {str(name): int(value) for name, value in segments.items()}


def budget_segments_ms(segments_ns: Mapping[str, int]) -> dict[str, float]:
    """Segments in ms exactly as a document's ``budget`` shows them (every known segment, in
    ``semconv.SEGMENTS`` order, rounded on cumulative boundaries)."""
    return _partition_ms(segments_ns)


def budget_segments(budget_doc: Mapping[str, Any]) -> dict[str, float]:
    """The segment entries of a document's ``budget``/``ttft_budget`` (without the total)."""
    return {k: float(v) for k, v in budget_doc.items() if k not in ("e2e_ms", "ttft_ms")}


# --- the `top` window report ----------------------------------------------------------------

KEY_FIELDS: Final = ("service", "model", "operation", "prompt_bucket")
"""The percentile key, in the order stored sketch slices carry it."""

SketchSlice = tuple[float, tuple[str, str, str, str], str, dict[str, Any]]
"""(slice_start_s, (service, model, operation, prompt_bucket), metric, LatencySketch dict)."""


def _ms_from_s(value_s: float | None) -> float | None:
    if value_s is None or not math.isfinite(value_s):
        return None
    return round(value_s * _US_PER_MS, 3)


def diagnosis_to_json(config: DiagnosisConfig) -> str:
    """The collector's diagnosis settings as the store keeps them (``META_DIAGNOSIS``)."""
    return json.dumps(dataclasses.asdict(config))


def diagnosis_from_json(raw: str | None) -> DiagnosisConfig:
    """Settings from ``diagnosis_to_json``; the defaults for none or unreadable ones, and
    settings this version does not know are ignored."""
    if not raw:
        return _DEFAULT_DIAGNOSIS
    try:
        loaded = json.loads(raw)
        known = {field.name for field in dataclasses.fields(DiagnosisConfig)}
        settings = {k: v for k, v in loaded.items() if k in known}
        if "p50_band" in settings:
            settings["p50_band"] = tuple(settings["p50_band"])
        return DiagnosisConfig(**settings)
    except (ValueError, TypeError, AttributeError):
        return _DEFAULT_DIAGNOSIS


def load_slo_targets(raw: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    """(target dicts, problems) from the store's ``META_SLO_TARGETS`` text.

    No text means no targets. Text that is not a JSON list gives no targets and one problem;
    entries that are not objects are left out, each with a problem. ``window_report`` checks
    the targets themselves (and reports bad ones in ``slo_errors``).
    """
    if not raw:
        return [], []
    try:
        loaded = json.loads(raw)
    except ValueError as error:
        return [], [f"the store's SLO targets are not JSON ({error}); none are evaluated"]
    if not isinstance(loaded, list):
        return [], [f"the store's SLO targets are a {type(loaded).__name__}, not a list"]
    targets: list[dict[str, Any]] = []
    problems: list[str] = []
    for entry in loaded:
        if isinstance(entry, dict):
            targets.append(entry)
        else:
            problems.append(f"{entry!r}: not an SLO target object")
    return targets, problems


def window_report(
    slices: Iterable[SketchSlice],
    *,
    window_s: float,
    now_s: float,
    slo_targets: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Merge sketch slices per key and metric; percentiles per key; SLO status per target.

    ``slo_targets`` are target dicts as the collector stores them in meta ``slo_targets``
    (parsed with ``processors.slo.parse_targets``). Values are ms. Shape::

        {window_s, since_s, until_s, requests,
         keys: [{service, model, operation, prompt_bucket, requests,
                 metrics: {ttft: {p50, p95, p99, count}, ...},
                 slo: [{target, met, value_ms}]}],
         slo: [{target, metric, percentile, threshold_ms, selector, requests,
                value_ms, met, compliance, burn_rate}],
         slo_errors: [str]}
    """
    from tokentrace.processors.sketches import LatencySketch
    from tokentrace.processors.slo import evaluate_window, parse_targets

    merged: dict[tuple[str, str, str, str], dict[str, LatencySketch]] = {}
    for _slice_start, key, metric, sketch_dict in slices:
        loaded = LatencySketch.from_dict(sketch_dict)
        per_metric = merged.setdefault(tuple(key), {})  # type: ignore[arg-type]
        if metric in per_metric:
            per_metric[metric].merge(loaded)
        else:
            per_metric[metric] = loaded

    # One bad target (e.g. written by a newer collector) must not hide the others.
    targets = []
    slo_errors: list[str] = []
    for raw_target in slo_targets:
        try:
            targets.extend(parse_targets([dict(raw_target)]))
        except (ValueError, TypeError, KeyError) as error:
            slo_errors.append(f"{raw_target!r}: {error}")

    keys_doc: list[dict[str, Any]] = []
    for key in sorted(merged, key=_key_sort):
        per_metric = merged[key]
        key_fields = dict(zip(KEY_FIELDS, key, strict=True))
        metrics_doc: dict[str, dict[str, Any]] = {}
        for metric in semconv.LATENCY_METRICS:
            sketch = per_metric.get(metric)
            if sketch is None or sketch.count == 0:
                continue
            entry: dict[str, Any] = {
                label: _ms_from_s(sketch.quantile(q)) for q, label in TOP_QUANTILES
            }
            entry["count"] = sketch.count
            metrics_doc[metric] = entry
        key_slo: list[dict[str, Any]] = []
        for target in targets:
            sketch = per_metric.get(target.metric)
            if sketch is None or not target.matches_key(key_fields):
                continue
            status = evaluate_window(target, sketch)
            key_slo.append(
                {
                    "target": target.name,
                    "met": status.met,
                    "value_ms": ns_to_ms(status.value_ns),
                }
            )
        e2e = metrics_doc.get(semconv.METRIC_E2E)
        requests = (
            e2e["count"] if e2e else max((m["count"] for m in metrics_doc.values()), default=0)
        )
        keys_doc.append(
            {**key_fields, "requests": requests, "metrics": metrics_doc, "slo": key_slo}
        )

    slo_doc: list[dict[str, Any]] = []
    for target in targets:
        combined: LatencySketch | None = None
        for key, per_metric in merged.items():
            sketch = per_metric.get(target.metric)
            if sketch is None:
                continue
            if not target.matches_key(dict(zip(KEY_FIELDS, key, strict=True))):
                continue
            if combined is None:
                combined = sketch.copy()
            else:
                combined.merge(sketch)
        entry = {
            "target": target.name,
            "metric": target.metric,
            "percentile": target.percentile,
            "threshold_ms": ns_to_ms(target.threshold_ns),
            "selector": dict(target.selector),
            "requests": 0,
            "value_ms": None,
            "met": None,
            "compliance": None,
            "burn_rate": None,
        }
        if combined is not None:
            status = evaluate_window(target, combined)
            entry["requests"] = status.requests
            entry["value_ms"] = ns_to_ms(status.value_ns)
            entry["met"] = status.met
            entry["compliance"] = _finite(status.compliance)
            entry["burn_rate"] = _finite(status.burn_rate)
        slo_doc.append(entry)

    return {
        "window_s": window_s,
        "since_s": now_s - window_s,
        "until_s": now_s,
        "requests": sum(k["requests"] for k in keys_doc),
        "keys": keys_doc,
        "slo": slo_doc,
        "slo_errors": slo_errors,
    }


def _key_sort(key: tuple[str, str, str, str]) -> tuple[Any, ...]:
    service, model, operation, bucket = key
    # Prompt buckets are labels like "128-511": order them by their lower bound.
    head = bucket.split("-", 1)[0].rstrip("+")
    lower = int(head) if head.isdigit() else math.inf
    return (model, operation, lower, bucket, service)
