"""One request's drill-down view: its explain document plus what its stored spans add.

Pure: ``request_view(doc, otlp, ...)`` takes the document ``RequestStore.get`` gives (the one
``tokentrace explain --json`` prints) and the trace's stored spans (``RequestStore.trace_otlp``,
a serialised ``ExportTraceServiceRequest``) and returns the ``GET /api/v1/requests/{trace_id}``
response (``docs/api.md``). Nothing here does I/O.

- ``waterfall``, ``verdict_text`` and ``verdict_heading`` are ``render.waterfall_rows`` /
  ``render.verdict_text`` / ``render.verdict_heading`` of the document, about one metric (the
  default verdict's unless one is asked for): the phases and sentence ``tokentrace explain
  [--metric]`` draws. The row holding that verdict's dominant segment is ``dominant``.
- ``tokens``: the token ticks exactly as ``render.waterfall_rows`` places them (first token +
  offset), the gaps between consecutive ticks, and which gaps are outliers by the diagnosis'
  rule: a gap larger than the collector's ``itl_outlier_ratio`` x the request's median gap
  (``finished_request.gap_median``; with the agent's ratio set alike, exactly the gaps whose engine
  steps the agent exports).
- ``spans``: the request span and its descendants (breadth first, at most ``max_spans``).
- ``engine_steps``: ``llm.engine.step`` spans under the request span, plus any step span of the
  trace whose ``ENGINE_STEP_REQUEST_IDS`` lists the request's id; ``outlier`` when the step
  overlaps an outlier gap.
- ``gpu``: the node agent's GPU aggregates on the request, prefill and decode spans.

The stored spans are decoded once. When they are missing or cannot be decoded, the parts that
need them are empty and ``warnings`` says why; this module never raises on stored data.
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import semconv
from tokentrace.agent.finished_request import gap_median
from tokentrace.collector.render import (
    chosen_verdict,
    not_reported_text,
    verdict_heading,
    verdict_text,
    waterfall_rows,
    waterfall_segment,
)
from tokentrace.collector.store.document import RequestDocument, ns_to_ms

DEFAULT_MAX_SPANS: Final = 500
"""Spans of one request the view lists at most (the request span first)."""
DEFAULT_MAX_ENGINE_STEPS: Final = 500
"""Engine steps of one request the view lists at most (earliest first)."""
TRACE_ID_PLACEHOLDER: Final = "{trace_id}"
"""Replaced in the trace-link template by the full, URL-quoted 32-hex trace id."""

_US_PER_MS: Final = 1_000
_NS_PER_US: Final = 1_000
"""With one gap there is no median to compare against."""

_PHASE_OF_SPAN: Final = {
    semconv.SPAN_PREFILL: "prefill",
    semconv.SPAN_DECODE: "decode",
}
"""Child spans of the request span whose GPU aggregates make a ``gpu`` phase."""

GPU_FIELDS: Final = (
    ("utilization_mean", semconv.GPU_UTILIZATION_MEAN),
    ("utilization_max", semconv.GPU_UTILIZATION_MAX),
    ("memory_controller_utilization_mean", semconv.GPU_MEMORY_CONTROLLER_UTILIZATION_MEAN),
    ("bandwidth_gbps", semconv.GPU_MEMORY_BANDWIDTH_GBPS),
    ("bandwidth_peak_gbps", semconv.GPU_MEMORY_BANDWIDTH_PEAK_GBPS),
    ("bandwidth_peak_ratio", semconv.GPU_MEMORY_BANDWIDTH_PEAK_RATIO),
    ("bandwidth_source", semconv.GPU_MEMORY_BANDWIDTH_SOURCE),
    ("memory_used_bytes", semconv.GPU_MEMORY_USED_BYTES),
    ("power_w", semconv.GPU_POWER_WATTS),
    ("sm_clock_mhz", semconv.GPU_SM_CLOCK_MHZ),
    ("memory_clock_mhz", semconv.GPU_MEMORY_CLOCK_MHZ),
    ("samples", semconv.GPU_SAMPLES),
)
"""(response field, span attribute) of a GpuAggregate."""
_GPU_ATTRIBUTES: Final = frozenset(attribute for _, attribute in GPU_FIELDS)

ENGINE_STEP_FIELDS: Final = (
    ("batch_size", semconv.ENGINE_STEP_BATCH_SIZE),
    ("prefill_requests", semconv.ENGINE_STEP_PREFILL_REQUESTS),
    ("decode_requests", semconv.ENGINE_STEP_DECODE_REQUESTS),
    ("prefill_tokens", semconv.ENGINE_STEP_PREFILL_TOKENS),
    ("decode_tokens", semconv.ENGINE_STEP_DECODE_TOKENS),
    ("kv_cache_usage", semconv.ENGINE_STEP_KV_CACHE_USAGE),
    ("waiting", semconv.ENGINE_STEP_WAITING),
    ("running", semconv.ENGINE_STEP_RUNNING),
)
"""(response field, span attribute) of an engine step's scalar facts."""

_INTEGER_FIELDS: Final = frozenset(
    {
        "samples",
        "batch_size",
        "prefill_requests",
        "decode_requests",
        "prefill_tokens",
        "decode_tokens",
        "waiting",
        "running",
    }
)
"""Response fields that are counts (integers in the response models)."""

_STATUS_NAMES: Final = {0: "unset", 1: "ok", 2: "error"}


def trace_link(template: str | None, trace_id_hex: str) -> str | None:
    """The tracing backend's URL of a trace: ``{trace_id}`` replaced by the quoted id.

    Plain replacement, not ``str.format``: templates such as Grafana Explore URLs carry other
    braces of their own.
    """
    if not template:
        return None
    return template.replace(TRACE_ID_PLACEHOLDER, urllib.parse.quote(trace_id_hex, safe=""))


def request_view(
    doc: RequestDocument,
    otlp: bytes | None,
    *,
    metric: str | None = None,
    trace_link_template: str | None = None,
    itl_outlier_ratio: float,
    max_spans: int = DEFAULT_MAX_SPANS,
    max_engine_steps: int = DEFAULT_MAX_ENGINE_STEPS,
) -> dict[str, Any]:
    """The detail response of one request (``docs/api.md``, ``GET /api/v1/requests/{id}``);
    its verdict is about ``metric`` (None: the document's default verdict).
    ``itl_outlier_ratio``: the collector's (``RequestStore.diagnosis_settings``)."""
    warnings: list[str] = []
    origin_ns = doc["timeline"]["origin_unix_ns"]
    tokens = token_gaps(doc, itl_outlier_ratio=itl_outlier_ratio)

    spans_doc: list[dict[str, Any]] = []
    steps_doc: list[dict[str, Any]] = []
    gpu_doc: list[dict[str, Any]] = []
    spans_dropped = 0
    steps_dropped = 0
    decoded = _decode(otlp, warnings)
    if decoded is not None:
        request_span_id = _id_bytes(doc["span_id"])
        own, spans_dropped = _own_spans(decoded, request_span_id, max_spans)
        if not own:
            warnings.append(
                "the request's span is not among the stored spans of its trace: "
                "no spans, engine steps or GPU aggregates"
            )
        spans_doc = [_span_doc(span, origin_ns) for span in own]
        gpu_doc = _gpu_phases(own, request_span_id, origin_ns)
        steps, steps_dropped = _engine_steps(decoded, own, doc["request_id"], max_engine_steps)
        outlier_intervals_us = _outlier_intervals_us(doc, tokens)
        steps_doc = [_step_doc(step, origin_ns, outlier_intervals_us) for step in steps]
    if spans_dropped:
        warnings.append(f"{spans_dropped} more span(s) of this request not listed (cap)")
    if steps_dropped:
        warnings.append(f"{steps_dropped} more engine step(s) not listed (cap)")
    if doc["not_reported"]:
        warnings.append(not_reported_text(doc["not_reported"]))

    verdict = chosen_verdict(doc, metric)
    highlighted = None if verdict is None else waterfall_segment(verdict["segment"])
    return {
        "request": doc,
        "verdict": verdict,
        "verdict_metric": metric or (None if verdict is None else verdict["metric"]),
        "verdict_text": verdict_text(doc, metric),
        "verdict_heading": verdict_heading(doc, metric),
        "waterfall": [
            {
                "label": row.label,
                "segment": row.segment,
                "intervals_ms": [[start, end] for start, end in row.intervals_ms],
                "duration_ms": row.duration_ms,
                "dominant": highlighted is not None and row.segment == highlighted,
            }
            for row in waterfall_rows(doc)
        ],
        "tokens": tokens,
        "engine_steps": steps_doc,
        "gpu": gpu_doc,
        "spans": spans_doc,
        "spans_dropped": spans_dropped,
        "links": {"trace": trace_link(trace_link_template, doc["trace_id"])},
        "other_span_ids": list(doc.get("other_span_ids") or []),
        "warnings": warnings,
    }


# --- token gaps -------------------------------------------------------------------------------


def token_gaps(doc: RequestDocument, *, itl_outlier_ratio: float) -> dict[str, Any]:
    """Ticks (ms on the document's axis), gaps and outlier gaps of a request document.

    Ticks are ``render.waterfall_rows``' decode ticks: first token + offset. Gap ``i`` is tick
    ``i`` - tick ``i - 1``, computed from the integer µs offsets; a negative gap (malformed
    offsets) is listed but never an outlier and not part of the median, as in
    ``budget.inter_token_gaps_ns``.
    """
    first_token = doc["timeline"]["boundaries_ms"].get("first_token")
    offsets = doc["token_offsets_us"]
    dropped = doc["token_offsets_dropped"]
    if first_token is None or not offsets:
        return {
            "ticks_ms": [],
            "gaps": [],
            "median_gap_ms": None,
            "outlier_threshold_ms": None,
            "dropped": dropped,
        }
    ticks = [first_token + offset_us / _US_PER_MS for offset_us in offsets]
    gaps_us = [offsets[i] - offsets[i - 1] for i in range(1, len(offsets))]
    median_us = gap_median([gap for gap in gaps_us if gap >= 0])
    threshold_us = None if median_us is None else itl_outlier_ratio * median_us
    gaps = [
        {
            "index": i,
            "at_ms": ticks[i],
            "gap_ms": gap_us / _US_PER_MS,
            "outlier": threshold_us is not None and gap_us >= 0 and gap_us > threshold_us,
        }
        for i, gap_us in enumerate(gaps_us, start=1)
    ]
    return {
        "ticks_ms": ticks,
        "gaps": gaps,
        "median_gap_ms": None if median_us is None else median_us / _US_PER_MS,
        "outlier_threshold_ms": None if threshold_us is None else threshold_us / _US_PER_MS,
        "dropped": dropped,
    }


def _outlier_intervals_us(
    doc: RequestDocument, tokens: Mapping[str, Any]
) -> list[tuple[float, float]]:
    """[previous tick, tick] of every outlier gap, in µs on the document's axis."""
    first_token = doc["timeline"]["boundaries_ms"].get("first_token")
    offsets = doc["token_offsets_us"]
    if first_token is None:
        return []
    first_us = first_token * _US_PER_MS
    return [
        (first_us + offsets[gap["index"] - 1], first_us + offsets[gap["index"]])
        for gap in tokens["gaps"]
        if gap["outlier"]
    ]


# --- stored spans -----------------------------------------------------------------------------


def _decode(otlp: bytes | None, warnings: list[str]) -> list[Span] | None:
    if otlp is None:
        warnings.append(
            "the trace's spans are no longer stored (pruned or replaced): "
            "no spans, engine steps or GPU aggregates"
        )
        return None
    try:
        request = ExportTraceServiceRequest.FromString(otlp)
    except (DecodeError, ValueError, TypeError) as error:
        warnings.append(
            f"the trace's stored spans cannot be decoded ({type(error).__name__}): "
            "no spans, engine steps or GPU aggregates"
        )
        return None
    return [
        span
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]


def _id_bytes(hex_id: object) -> bytes:
    try:
        return bytes.fromhex(str(hex_id))
    except ValueError:
        return b""


def _own_spans(spans: Sequence[Span], request_span_id: bytes, limit: int) -> tuple[list[Span], int]:
    """The request span and its descendants, breadth first, at most ``limit``; and how many
    more there were."""
    request_span = None
    children: dict[bytes, list[Span]] = {}
    for span in spans:
        if span.span_id == request_span_id and request_span is None:
            request_span = span
        parent = span.parent_span_id
        if parent:
            children.setdefault(parent, []).append(span)
    if request_span is None or not request_span_id:
        return [], 0
    found: list[Span] = [request_span]
    seen = {request_span_id}
    dropped = 0
    position = 0
    while position < len(found):
        for child in sorted(
            children.get(found[position].span_id, ()), key=lambda s: s.start_time_unix_nano
        ):
            if child.span_id in seen:  # a malformed trace may hold cycles or duplicate ids
                continue
            seen.add(child.span_id)
            if len(found) < limit:
                found.append(child)
            else:
                dropped += 1
        position += 1
    return found, dropped


def _offset_ms(unix_ns: int, origin_ns: int) -> float:
    value = ns_to_ms(int(unix_ns) - origin_ns)
    return 0.0 if value is None else value


def _value(value: AnyValue) -> Any:
    """A stored attribute value as JSON: scalars, arrays as lists, kvlists as objects, bytes
    as hex; non-finite doubles as null (JSON has no NaN)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(element) for element in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    if which == "bytes_value":
        return value.bytes_value.hex()
    if which == "double_value":
        number = value.double_value
        return number if math.isfinite(number) else None
    return getattr(value, which)


def _attributes(span: Span, wanted: frozenset[str] | None = None) -> dict[str, Any]:
    """A span's attributes (only ``wanted`` ones when given; the last one of a key wins)."""
    return {
        kv.key: _value(kv.value) for kv in span.attributes if wanted is None or kv.key in wanted
    }


def _span_doc(span: Span, origin_ns: int) -> dict[str, Any]:
    return {
        "name": span.name,
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex() or None,
        "start_ms": _offset_ms(span.start_time_unix_nano, origin_ns),
        "end_ms": _offset_ms(span.end_time_unix_nano, origin_ns),
        "status": _STATUS_NAMES.get(span.status.code, "unset"),
        "attributes": _attributes(span),
    }


def gpu_aggregate(attributes: Mapping[str, Any]) -> dict[str, Any] | None:
    """The GpuAggregate of a span's attributes; None when the node agent set none of them."""
    if _GPU_ATTRIBUTES.isdisjoint(attributes):
        return None
    aggregate: dict[str, Any] = {}
    for field, attribute in GPU_FIELDS:
        value = attributes.get(attribute)
        if field == "bandwidth_source":
            aggregate[field] = value if isinstance(value, str) else None
        elif field in _INTEGER_FIELDS:
            aggregate[field] = _integer(value)
        else:
            aggregate[field] = _number(value)
    return aggregate


def _number(value: object) -> float | int | None:
    """A finite number, else None (a malformed attribute must not break the view)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if math.isfinite(value) else None


def _integer(value: object) -> int | None:
    """An integer count; a whole float (a sender that wrote a double) counts too."""
    number = _number(value)
    if number is None or (isinstance(number, float) and not number.is_integer()):
        return None
    return int(number)


def _gpu_phases(
    own: Sequence[Span], request_span_id: bytes, origin_ns: int
) -> list[dict[str, Any]]:
    """GPU aggregates of the request span and its direct prefill/decode children."""
    phases: list[dict[str, Any]] = []
    for span in own:
        if span.span_id == request_span_id:
            phase = "request"
        elif span.parent_span_id == request_span_id and span.name in _PHASE_OF_SPAN:
            phase = _PHASE_OF_SPAN[span.name]
        else:
            continue
        aggregate = gpu_aggregate(_attributes(span, _GPU_ATTRIBUTES))
        if aggregate is None:
            continue
        phases.append(
            {
                "phase": phase,
                "start_ms": _offset_ms(span.start_time_unix_nano, origin_ns),
                "end_ms": _offset_ms(span.end_time_unix_nano, origin_ns),
                **aggregate,
            }
        )
    return phases


def _step_request_ids(span: Span) -> Iterator[str]:
    for kv in span.attributes:
        if kv.key == semconv.ENGINE_STEP_REQUEST_IDS:
            for element in kv.value.array_value.values:
                if element.WhichOneof("value") == "string_value":
                    yield element.string_value


def _engine_steps(
    spans: Sequence[Span], own: Sequence[Span], request_id: object, limit: int
) -> tuple[list[Span], int]:
    """Step spans under the request span, plus the trace's step spans listing its request id;
    earliest first, at most ``limit``."""
    steps = {span.span_id: span for span in own if span.name == semconv.SPAN_ENGINE_STEP}
    if isinstance(request_id, str) and request_id:
        for span in spans:
            if (
                span.name == semconv.SPAN_ENGINE_STEP
                and span.span_id not in steps
                and request_id in _step_request_ids(span)
            ):
                steps[span.span_id] = span
    ordered = sorted(steps.values(), key=lambda s: (s.start_time_unix_nano, s.span_id))
    return ordered[:limit], max(0, len(ordered) - limit)


_STEP_ATTRIBUTES: Final = frozenset(
    {attribute for _, attribute in ENGINE_STEP_FIELDS}
    | {semconv.ENGINE_STEP_REQUEST_IDS}
    | _GPU_ATTRIBUTES
)


def _step_doc(
    span: Span, origin_ns: int, outlier_intervals_us: Sequence[tuple[float, float]]
) -> dict[str, Any]:
    attributes = _attributes(span, _STEP_ATTRIBUTES)
    start_us = (span.start_time_unix_nano - origin_ns) / _NS_PER_US
    end_us = (span.end_time_unix_nano - origin_ns) / _NS_PER_US
    step: dict[str, Any] = {
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex() or None,
        "start_ms": _offset_ms(span.start_time_unix_nano, origin_ns),
        "end_ms": _offset_ms(span.end_time_unix_nano, origin_ns),
    }
    for field, attribute in ENGINE_STEP_FIELDS:
        value = attributes.get(attribute)
        step[field] = _integer(value) if field in _INTEGER_FIELDS else _number(value)
    ids = attributes.get(semconv.ENGINE_STEP_REQUEST_IDS)
    step["request_ids"] = [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []
    # Open intervals: a step that ends exactly when the gap opens made the previous token.
    step["outlier"] = any(
        start_us < gap_end and end_us > gap_start for gap_start, gap_end in outlier_intervals_us
    )
    step["gpu"] = gpu_aggregate(attributes)
    return step
