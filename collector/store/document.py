"""The JSON documents the request store's readers (CLI, API, web UI) print for stored requests.

``document_from_row`` builds the document ``tokentrace explain --json`` prints from a stored
row (``row.py``), at read time. ``record_to_dict`` is the same document straight from a record
(one code path). The row keeps the request's default verdict (the metric of the target it
breached); each metric's budget and the verdicts about its other metrics are derived here, from
a record rebuilt from the row and the request's decode and engine-step spans, by the
collector's diagnosis settings (``META_DIAGNOSIS``): the collector does not pay per request for
verdicts that only a drill-down asks for. ``summary_from_row`` is the list's shorter document,
from columns alone.

Document durations are milliseconds as floats rounded to 3 decimals, i.e. exact microseconds.
Budget segments are rounded on their cumulative boundaries, so the segments' microseconds sum
exactly to the rounded E2E (the budget partitions E2E, and the document keeps that property).

Separate from ``row.py`` because the row is the storage format and this is the reading
format: either changes without the other (``DOC_VERSION`` versions this one).

The reading format's shape is stated once, here, as ``TypedDict``s: ``RequestDocument`` (one
request, made of ``StartDoc``, ``TokenCountsDoc``, ``MetricsDoc``, ``TimelineDoc``,
``ContextDoc``, ``MetricBudgetDoc`` and ``VerdictDoc``) and ``RequestSummaryDoc`` (one request in
the list). The store, ``tokentrace explain``, ``render.py`` and the API read these types, so
mypy checks every key they use, and the API's OpenAPI schema is generated from them (pydantic
validates each response against them). Their fields are declared in the order the builders
emit them: the JSON is the builders' dicts, unchanged, whoever serialises it.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Final, TypeAlias, TypeVar, cast, overload

# typing_extensions: pydantic (the API's schema) reads only its TypedDict before Python 3.12.
# No ``from __future__ import annotations`` in this module: the TypedDicts' ``NotRequired``
# must be visible at run time (``__required_keys__``).
from typing_extensions import NotRequired, TypedDict

from tokentrace.agent import semconv
from tokentrace.collector.store.row import (
    BOUNDARY_KEYS,
    CONTEXT_FIELDS,
    DETAIL_ADVICE,
    DETAIL_BOUNDARIES,
    DETAIL_CACHED,
    DETAIL_CHUNKS,
    DETAIL_CONTEXT,
    DETAIL_E2E_METRIC,
    DETAIL_ERROR,
    DETAIL_FINISH,
    DETAIL_NUMBERS,
    DETAIL_OFFSETS,
    DETAIL_PREEMPTED,
    DETAIL_SEGMENTS,
    DETAIL_SKEW,
    DETAIL_SLO,
    DETAIL_TTFT_NS,
    DETAIL_TTFT_SEGMENTS,
    DETAIL_VERDICT_CLOCK,
    DETAIL_VERDICT_METRIC,
    DETAIL_VERDICT_WHY,
    DecodeSpans,
    StoredRow,
    decode_detail,
    record_from_row,
    request_row,
)
from tokentrace.processors.budget import inter_token_gaps_ns, metric_budget
from tokentrace.processors.causes import ADVICE
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.durations import ms_of, whole_us
from tokentrace.processors.model import RequestRecord
from tokentrace.processors.stats import nearest_rank
from tokentrace.processors.verdict import diagnose_request

DOC_VERSION: Final = 1
"""Bumped when the request document changes shape incompatibly."""
DOC_TOKEN_OFFSETS_CAP: Final = 4096
"""Token offsets kept in one document; the rest are counted in ``token_offsets_dropped``."""

_NS_PER_US: Final = 1_000
_DEFAULT_DIAGNOSIS: Final = DiagnosisConfig()
_US_PER_MS: Final = 1_000
_NS_PER_S: Final = 1_000_000_000

_T = TypeVar("_T")

# --- the shape of the documents --------------------------------------------------------------
# Durations are ms floats (exact µs); None where the request has no such value. A field typed
# ``int | float`` holds whichever the request's data held (pydantic keeps each as it is).

DocNumber: TypeAlias = int | float | str | None
"""A value of a verdict's ``numbers`` (non-finite numbers are null)."""

SegmentsMs: TypeAlias = dict[str, float]
"""Budget segment (``semconv.SEGMENTS`` / ``METRIC_BUDGET_SEGMENTS`` names) -> ms, in time
order."""

BudgetDoc: TypeAlias = dict[str, float]
"""A document's ``budget``: every ``semconv.SEGMENTS`` segment in that order (zeros included,
then any segment this version does not know), then ``e2e_ms``: the client-seen E2E the
segments sum to. A ``ttft_budget`` is the same with ``ttft_ms`` (``budget_segments`` reads the
segments of either). A mapping, not a TypedDict: its keys are the stored segments'."""


class StartDoc(TypedDict):
    """When the request started as the server saw it (client start for a client-only one)."""

    iso: str
    unix_ns: int


class TokenCountsDoc(TypedDict):
    """The request's token counts (a document's ``tokens``)."""

    input: int | None
    output: int | None
    cached: int | None


class ItlSummaryDoc(TypedDict):
    """Count, p50, p99 (nearest rank) and max of the request's inter-token gaps."""

    count: int
    p50: float | None
    p99: float | None
    max: float | None


class MetricsDoc(TypedDict):
    """The request's server-seen metrics in ms (``RequestMetrics``; a client-only request's
    are the client's), ``e2e`` always present."""

    ttft: float | None
    tpot: float | None
    e2e: float
    queue: float | None
    prefill: float | None
    decode: float | None
    network: float | None
    itl: ItlSummaryDoc


class BoundariesDoc(TypedDict, total=False):
    """The request's instants (ms after ``TimelineDoc.origin_unix_ns``), only those it has;
    ``row.BOUNDARY_KEYS`` in order (engine arrival keeps the older key ``arrival``)."""

    client_start: float
    server_start: float
    arrival: float
    ready: float
    first_scheduled: float
    first_token: float
    server_first_body: float
    client_first_byte: float
    client_first_token: float
    last_token: float
    end: float
    server_end: float
    client_end: float


class PrefillChunkDoc(TypedDict):
    start_ms: float
    end_ms: float
    tokens: int


class TimelineDoc(TypedDict):
    """The request's time axis: ``origin_unix_ns`` (its earliest instant) and everything on
    it in ms after that origin."""

    origin_unix_ns: int
    boundaries_ms: BoundariesDoc
    preemptions_ms: list[list[float]]
    """[start, end] of every interval the request spent evicted."""
    prefill_chunks: list[PrefillChunkDoc]


class ContextDoc(TypedDict, total=False):
    """What the diagnosis read besides the timeline (``row.CONTEXT_FIELDS`` in order), only
    those the request has; a non-finite ratio is null."""

    requests_ahead: int
    running_at_arrival: int
    max_running: int
    outlier_steps_with_prefill: int
    decode_bandwidth_peak_ratio: float | None
    decode_roofline_ratio: float | None
    prefix_hash: str


class MetricBudgetDoc(TypedDict):
    """One metric's budget on one clock (``budget.metric_budget``): the segments the metric's
    time was spent in, in time order, summing to ``value_ms``."""

    value_ms: float | None
    segments: SegmentsMs


class VerdictDoc(TypedDict):
    """A verdict (``Verdict``): the dominant segment of one metric's budget on one clock, its
    cause, the sentence and advice, and the numbers the sentence cites."""

    metric: str
    """One of ``semconv.VERDICT_METRICS``."""
    clock: str
    """``client`` or ``server``: whose clock measured the metric."""
    segment: str
    cause: str | None
    sentence: str | None
    advice: str
    numbers: dict[str, DocNumber]
    why: NotRequired[str]
    """The default verdict only: why this metric (e.g. the SLO target the request breached)."""


class NotReportedDoc(TypedDict):
    """What a request's source cannot tell (a dialect's own spans, an engine's timing report
    read through ``tokentrace proxy``): the time it took sits in a neighbouring segment or is
    not there at all."""

    source: str | None
    items: list[str]


class RequestDocument(TypedDict):
    """One stored request as every reader sees it (``document_from_row``; ``tokentrace explain
    --json`` prints it, the API serves it as ``RequestDetail.request``)."""

    doc_version: int
    trace_id: str
    span_id: str
    service: str
    model: str
    operation: str
    dialect: str
    prompt_bucket: str
    request_id: str | None
    start: StartDoc
    tokens: TokenCountsDoc
    finish_reason: str | None
    status_error: str | None
    not_reported: NotReportedDoc | None
    """What the request's source cannot tell (its budgets lack it); None: nothing known."""
    metrics_ms: MetricsDoc
    budget: BudgetDoc
    ttft_budget: BudgetDoc | None
    """The server-seen TTFT's budget (segments and ``ttft_ms``); null without a first token."""
    skew_clamped: bool
    timeline: TimelineDoc
    token_offsets_us: list[int]
    """Token times in µs after the first token (at most ``DOC_TOKEN_OFFSETS_CAP``)."""
    token_offsets_dropped: int
    context: ContextDoc
    budgets: dict[str, dict[str, MetricBudgetDoc]]
    """Metric (``semconv.VERDICT_METRICS``) -> clock -> that metric's budget on that clock."""
    verdict: VerdictDoc | None
    """The default verdict: about the metric of the first SLO target the request breached,
    else E2E; null when the request was not diagnosed."""
    verdicts: dict[str, VerdictDoc]
    """Metric -> the verdict about it (the default one among them)."""
    slo: dict[str, bool]
    """SLO target name -> met."""
    other_span_ids: NotRequired[list[str]]
    """``RequestStore.get`` only: the other requests of the same trace."""


class RequestSummaryDoc(TypedDict):
    """One request in the list (``summary_from_row``; the API's ``RequestSummary``)."""

    trace_id: str
    span_id: str
    request_id: str | None
    start_unix_ns: int
    start_iso: str
    service: str
    model: str
    operation: str
    prompt_bucket: str
    e2e_ms: float
    ttft_ms: float | None
    tpot_ms: float | None
    queue_ms: float | None
    prefill_ms: float | None
    decode_ms: float | None
    network_ms: float | None
    input_tokens: int | None
    output_tokens: int | None
    segment: str | None
    cause: str | None
    verdict: str | None
    slo_breached: bool


# --- units -----------------------------------------------------------------------------------


@overload
def ns_to_ms(value_ns: int) -> float: ...
@overload
def ns_to_ms(value_ns: None) -> None: ...
@overload
def ns_to_ms(value_ns: int | None) -> float | None: ...
def ns_to_ms(value_ns: int | None) -> float | None:
    """Integer ns -> ms rounded to the microsecond (``durations.ms_of``), None stays None."""
    if value_ns is None:
        return None
    return ms_of(int(value_ns))


def finite_or_none(value: _T) -> _T | None:
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
        cumulative_us = whole_us(cumulative_ns)
        out[name] = (cumulative_us - previous_us) / _US_PER_MS
        previous_us = cumulative_us
    return out


def _itl_summary(offsets_us: Sequence[int]) -> ItlSummaryDoc:
    """Count, p50, p99 (nearest rank) and max of the inter-token gaps, derived from the token
    offsets exactly as ``RequestMetrics.itl`` is (``budget.inter_token_gaps_ns``)."""
    gaps_ns = sorted(inter_token_gaps_ns(offsets_us))
    if not gaps_ns:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    return {
        "count": len(gaps_ns),
        "p50": ns_to_ms(nearest_rank(gaps_ns, 50)),
        "p99": ns_to_ms(nearest_rank(gaps_ns, 99)),
        "max": ns_to_ms(gaps_ns[-1]),
    }


def iso_utc(unix_ns: int) -> str:
    """ISO-8601 UTC with microseconds, e.g. ``2025-01-02T03:04:05.123456Z``."""
    seconds, rest_ns = divmod(int(unix_ns), _NS_PER_S)
    moment = datetime.fromtimestamp(seconds, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{rest_ns // _NS_PER_US:06d}Z"


# --- the document of one row ---------------------------------------------------------------------


def _metric_budgets_doc(record: RequestRecord) -> dict[str, dict[str, MetricBudgetDoc]]:
    """Every metric budget of the request (``budget.metric_budget``), on each clock it has."""
    budgets: dict[str, dict[str, MetricBudgetDoc]] = {}
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
    record: RequestRecord, default: VerdictDoc, diagnosis: DiagnosisConfig
) -> dict[str, VerdictDoc]:
    """The stored default verdict, and the verdicts about the request's other metrics derived
    now (``verdict.diagnose_request``, with the window's prefix judgement it was stored
    with), in ``semconv.VERDICT_METRICS`` order."""
    prefix = record.timeline.prefix_hash
    seen = frozenset((prefix,)) if record.prefix_seen and prefix else frozenset()
    verdicts: dict[str, VerdictDoc] = {}
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


def _timeline_doc(
    boundaries: Sequence[int | None],
    preempted: Sequence[Sequence[int]],
    chunks: Sequence[Sequence[int]],
    start_ns: int,
) -> TimelineDoc:
    present = {
        name: int(value)
        for name, value in zip(BOUNDARY_KEYS, boundaries, strict=False)
        if value is not None
    }
    known = list(present.values())
    known += [int(start) for start, _ in preempted]
    known += [int(start) for start, _, _ in chunks]
    origin = min(known) if known else start_ns

    def offset(value: int) -> float:
        return ms_of(int(value) - origin)

    # ``BoundariesDoc``'s keys are ``BOUNDARY_KEYS`` (a test holds them equal).
    boundaries_ms = cast(BoundariesDoc, {name: offset(value) for name, value in present.items()})
    return {
        "origin_unix_ns": origin,
        "boundaries_ms": boundaries_ms,
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
) -> RequestDocument:
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
    detail = decode_detail(stored.detail)

    budget_doc: BudgetDoc = _partition_ms(detail[DETAIL_SEGMENTS])
    budget_doc["e2e_ms"] = ns_to_ms(int(stored.e2e_ns))
    ttft_budget_doc: BudgetDoc | None = None
    budget_ttft_ns = detail.get(DETAIL_TTFT_NS)
    if budget_ttft_ns is not None:
        ttft_budget_doc = _partition_ms(detail.get(DETAIL_TTFT_SEGMENTS) or {})
        ttft_budget_doc["ttft_ms"] = ns_to_ms(int(budget_ttft_ns))

    recorded, dropped = detail.get(DETAIL_OFFSETS) or (0, 0)
    spans = DecodeSpans(None, [])
    if recorded:
        spans = load_decode()
        if spans.token_offsets is None or len(spans.token_offsets) != recorded:
            # The spans that hold them are gone: say how many are missing.
            spans = DecodeSpans(None, spans.engine_steps)
            dropped += recorded
    offsets = [int(v) for v in spans.token_offsets or ()]
    itl = _itl_summary(offsets)

    record = record_from_row(stored, detail, spans, diagnosis)
    if len(offsets) > DOC_TOKEN_OFFSETS_CAP:
        dropped += len(offsets) - DOC_TOKEN_OFFSETS_CAP
        offsets = offsets[:DOC_TOKEN_OFFSETS_CAP]
    verdict_doc: VerdictDoc | None = None
    verdicts_doc: dict[str, VerdictDoc] = {}
    if stored.segment is not None:
        verdict_doc = _verdict_doc(
            stored.segment,
            stored.cause,
            stored.verdict,
            detail.get(DETAIL_ADVICE, ADVICE.get(str(stored.cause), "")),
            detail.get(DETAIL_NUMBERS),
            metric=str(detail.get(DETAIL_VERDICT_METRIC, semconv.METRIC_E2E)),
            clock=str(detail.get(DETAIL_VERDICT_CLOCK, semconv.CLOCK_SERVER)),
        )
        verdict_doc["why"] = str(detail.get(DETAIL_VERDICT_WHY, ""))
        verdicts_doc = _verdicts_doc(record, verdict_doc, diagnosis)

    # ``ContextDoc``'s keys are ``CONTEXT_FIELDS`` (a test holds them equal).
    context = cast(
        ContextDoc,
        {
            name: finite_or_none(value)
            for name, value in zip(CONTEXT_FIELDS, detail.get(DETAIL_CONTEXT) or (), strict=False)
            if value is not None
        },
    )

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
            "cached": detail.get(DETAIL_CACHED),
        },
        "finish_reason": detail.get(DETAIL_FINISH),
        "status_error": detail.get(DETAIL_ERROR),
        "not_reported": (
            {"source": record.timeline.not_reported_by, "items": list(record.timeline.not_reported)}
            if record.timeline.not_reported
            else None
        ),
        "metrics_ms": {
            semconv.METRIC_TTFT: ns_to_ms(stored.ttft_ns),
            semconv.METRIC_TPOT: ns_to_ms(stored.tpot_ns),
            semconv.METRIC_E2E: ns_to_ms(int(detail.get(DETAIL_E2E_METRIC, stored.e2e_ns))),
            semconv.METRIC_QUEUE: ns_to_ms(stored.queue_ns),
            semconv.METRIC_PREFILL: ns_to_ms(stored.prefill_ns),
            semconv.METRIC_DECODE: ns_to_ms(stored.decode_ns),
            semconv.METRIC_NETWORK: ns_to_ms(stored.network_ns),
            semconv.METRIC_ITL: itl,
        },
        "budget": budget_doc,
        "ttft_budget": ttft_budget_doc,
        "skew_clamped": bool(detail.get(DETAIL_SKEW)),
        "timeline": _timeline_doc(
            detail.get(DETAIL_BOUNDARIES) or (),
            detail.get(DETAIL_PREEMPTED) or (),
            detail.get(DETAIL_CHUNKS) or (),
            start_ns,
        ),
        "token_offsets_us": offsets,
        "token_offsets_dropped": int(dropped),
        "context": context,
        "budgets": _metric_budgets_doc(record),
        "verdict": verdict_doc,
        "verdicts": verdicts_doc,
        "slo": {str(name): bool(met) for name, met in (detail.get(DETAIL_SLO) or {}).items()},
    }


def _verdict_doc(
    segment: str,
    cause: str | None,
    sentence: str | None,
    advice: object,
    numbers: Mapping[str, DocNumber] | None,
    *,
    metric: str,
    clock: str,
) -> VerdictDoc:
    return {
        "metric": metric,
        "clock": clock,
        "segment": segment,
        "cause": cause,
        "sentence": sentence,
        "advice": str(advice),
        "numbers": {str(k): finite_or_none(v) for k, v in (numbers or {}).items()},
    }


def record_to_dict(
    record: RequestRecord, *, diagnosis: DiagnosisConfig = _DEFAULT_DIAGNOSIS
) -> RequestDocument:
    """The document of one record, exactly as the store gives it back after writing it.

    Raises (TypeError/ValueError/AttributeError) on a malformed record.
    """
    timeline = record.timeline
    spans = DecodeSpans(timeline.token_offsets_us, timeline.engine_steps)
    return document_from_row(request_row(record), load_decode=lambda: spans, diagnosis=diagnosis)


# --- the list's summary of one row, budget segments ----------------------------------------------


def summary_from_row(row: Sequence[Any]) -> RequestSummaryDoc:
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


def budget_segments_ms(segments_ns: Mapping[str, int]) -> dict[str, float]:
    """Segments in ms exactly as a document's ``budget`` shows them (every known segment, in
    ``semconv.SEGMENTS`` order, rounded on cumulative boundaries)."""
    return _partition_ms(segments_ns)


def budget_segments(budget_doc: Mapping[str, float]) -> dict[str, float]:
    """The segment entries of a document's ``budget``/``ttft_budget`` (without the total)."""
    return {k: float(v) for k, v in budget_doc.items() if k not in ("e2e_ms", "ttft_ms")}
