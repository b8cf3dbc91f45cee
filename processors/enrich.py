"""Write a request's derived values onto its span as ``tokentrace.*`` attributes.

The values are encoded straight to attribute bytes (``enrichment_attributes``), which the
collector's encoder appends to the request span's own serialisation: no protobuf object per
attribute. ``enrich_span`` merges the same bytes into a span object.

The collector owns every enrichment key (the ``tokentrace.budget.*`` and
``tokentrace.ttft_budget.*`` families and the fixed keys below): enriching removes all of them
first and then writes the current values, so enriching twice is idempotent and a re-enrichment
with a different record leaves no stale segment behind. Every other attribute is kept, in order.
"""

from __future__ import annotations

from typing import Final

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import semconv
from tokentrace.agent.span_encoding import span_attributes
from tokentrace.agent.spans import AttrValue
from tokentrace.processors import native
from tokentrace.processors.model import RequestRecord, SpanRef

_OWNED_KEYS: Final = frozenset(
    {
        semconv.TTFT_NS,
        semconv.TPOT_NS,
        semconv.E2E_NS,
        semconv.PROMPT_BUCKET,
        semconv.DIAGNOSIS_SEGMENT,
        semconv.DIAGNOSIS_CAUSE,
        semconv.DIAGNOSIS_VERDICT,
        semconv.DIAGNOSIS_ADVICE,
        semconv.DIAGNOSIS_METRIC,
        semconv.SLO_MET,
        semconv.SLO_BREACHED,
    }
)
_OWNED_PREFIXES: Final = (semconv.BUDGET_PREFIX, semconv.TTFT_BUDGET_PREFIX)
_INT64_MAX: Final = 2**63 - 1
_INT64_MIN: Final = -(2**63)

# Attribute names per segment, built once (the f-string per span would be churn).
_BUDGET_KEYS: Final = {segment: semconv.budget_attribute(segment) for segment in semconv.SEGMENTS}
_TTFT_BUDGET_KEYS: Final = {
    segment: semconv.ttft_budget_attribute(segment) for segment in semconv.SEGMENTS
}


def _remove_owned(attributes: RepeatedCompositeFieldContainer[KeyValue]) -> None:
    owned_keys, prefixes = _OWNED_KEYS, _OWNED_PREFIXES
    owned = [
        position
        for position, kv in enumerate(attributes)
        if (key := kv.key) in owned_keys or key.startswith(prefixes)
    ]
    if not owned:
        return
    if owned[-1] - owned[0] + 1 == len(owned) == len(attributes) - owned[0]:
        del attributes[owned[0] :]  # the usual case: a previous enrichment, appended last
        return
    for position in reversed(owned):
        del attributes[position]


def enrichment_attributes(record: RequestRecord) -> bytes:
    """The enrichment of ``record`` as serialised ``Span.attributes`` entries, in the order
    ``enrich_span`` writes them: appended to the request span's serialisation (after
    ``remove_enrichment``), they are its enrichment without building a protobuf object each."""
    budget = record.budget
    metrics = record.metrics
    pairs: list[tuple[str, AttrValue]] = [
        (_BUDGET_KEYS.get(segment) or semconv.budget_attribute(segment), ns)
        for segment, ns in budget.segments.items()
        if ns
    ]
    pairs += [
        (_TTFT_BUDGET_KEYS.get(segment) or semconv.ttft_budget_attribute(segment), ns)
        for segment, ns in budget.ttft_segments.items()
        if ns
    ]
    if metrics.ttft is not None:
        pairs.append((semconv.TTFT_NS, metrics.ttft))
    if metrics.tpot is not None:
        pairs.append((semconv.TPOT_NS, metrics.tpot))
    pairs.append((semconv.E2E_NS, metrics.e2e))
    pairs.append((semconv.PROMPT_BUCKET, record.prompt_bucket))
    verdict = record.verdict
    if verdict is not None:
        pairs += (
            (semconv.DIAGNOSIS_SEGMENT, verdict.segment),
            (semconv.DIAGNOSIS_CAUSE, verdict.cause),
            (semconv.DIAGNOSIS_VERDICT, verdict.sentence),
            (semconv.DIAGNOSIS_ADVICE, verdict.advice),
            (semconv.DIAGNOSIS_METRIC, verdict.metric),
        )
    if record.slo:
        met: list[str] = []
        breached: list[str] = []
        for name, ok in record.slo.items():  # one loop, no generator frames: once per request
            (met if ok else breached).append(name)
        met.sort()
        breached.sort()
        # Tuples: string arrays, whose few combinations the encoder caches.
        pairs += ((semconv.SLO_MET, tuple(met)), (semconv.SLO_BREACHED, tuple(breached)))
    try:
        return span_attributes(pairs)
    except ValueError:
        # Durations past int64 come only from a corrupt span's timestamps (fixed64 in OTLP):
        # clamped when the encoder refuses one, not checked value by value for every request.
        return span_attributes(
            [(key, _int64(value)) if type(value) is int else (key, value) for key, value in pairs]
        )


def _int64(ns: int) -> int:
    return min(max(ns, _INT64_MIN), _INT64_MAX)


def remove_enrichment(span: Span) -> None:
    """Remove every attribute the collector owns from ``span`` (a previous enrichment)."""
    _remove_owned(span.attributes)


def remove_received_enrichment(ref: SpanRef) -> None:
    """``remove_enrichment`` of a received span. Where its bytes as received show no attribute
    the collector owns (the usual case, read in C), the span is left as it is and keeps its
    bytes (``SpanRef.wire``), to which the encoder appends the new enrichment; otherwise the
    span loses those attributes and, changed, its bytes."""
    if ref.wire is not None:
        if native.has_attribute_key(ref.wire, _OWNED_KEYS, _OWNED_PREFIXES) is False:
            return
        ref.wire = None
    remove_enrichment(ref.span)


def enrich_span(span: Span, record: RequestRecord) -> None:
    """Add budget, TTFT/TPOT/E2E, prompt bucket, diagnosis and SLO attributes to ``span``.

    Existing attributes with the same keys are replaced, so enriching twice is idempotent.
    Zero-length segments are not written; absent values (no TTFT, no TPOT, no verdict, no SLO
    marks) leave their keys absent. ``tokentrace.e2e_ns`` is the E2E metric (server side, what
    the sketches and SLOs use); the ``tokentrace.budget.*`` values sum to the budget's E2E, which
    also includes the ``network`` segment when a client span exists.
    """
    remove_enrichment(span)
    span.MergeFromString(enrichment_attributes(record))
