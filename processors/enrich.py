"""Write a request's derived values onto its span as ``tokentrace.*`` attributes.

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
from tokentrace.processors.model import RequestRecord

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


def _add_ints(
    attributes: RepeatedCompositeFieldContainer[KeyValue], pairs: list[tuple[str, int]]
) -> None:
    add = attributes.add
    for key, ns in pairs:
        # add() then assign in place: constructing KeyValue/AnyValue first would copy them again.
        kv = add()
        kv.key = key
        # Timestamps are fixed64 in OTLP, so a corrupt span could yield a value beyond int64.
        kv.value.int_value = (
            ns if _INT64_MIN <= ns <= _INT64_MAX else min(max(ns, _INT64_MIN), _INT64_MAX)
        )


def _add_str(attributes: RepeatedCompositeFieldContainer[KeyValue], key: str, text: str) -> None:
    kv = attributes.add()
    kv.key = key
    kv.value.string_value = text


def _add_str_array(
    attributes: RepeatedCompositeFieldContainer[KeyValue], key: str, texts: list[str]
) -> None:
    kv = attributes.add()
    kv.key = key
    array = kv.value.array_value
    array.SetInParent()  # an empty list is still an array value, not an unset one
    for text in texts:
        array.values.add().string_value = text


def enrich_span(span: Span, record: RequestRecord) -> None:
    """Add budget, TTFT/TPOT/E2E, prompt bucket, diagnosis and SLO attributes to ``span``.

    Existing attributes with the same keys are replaced, so enriching twice is idempotent.
    Zero-length segments are not written; absent values (no TTFT, no TPOT, no verdict, no SLO
    marks) leave their keys absent. ``tokentrace.e2e_ns`` is the E2E metric (server side, what
    the sketches and SLOs use); the ``tokentrace.budget.*`` values sum to the budget's E2E, which
    also includes the ``network`` segment when a client span exists.
    """
    attributes = span.attributes
    _remove_owned(attributes)
    budget = record.budget
    metrics = record.metrics
    ints = [
        (_BUDGET_KEYS.get(segment) or semconv.budget_attribute(segment), ns)
        for segment, ns in budget.segments.items()
        if ns
    ]
    ints += [
        (_TTFT_BUDGET_KEYS.get(segment) or semconv.ttft_budget_attribute(segment), ns)
        for segment, ns in budget.ttft_segments.items()
        if ns
    ]
    if metrics.ttft is not None:
        ints.append((semconv.TTFT_NS, metrics.ttft))
    if metrics.tpot is not None:
        ints.append((semconv.TPOT_NS, metrics.tpot))
    ints.append((semconv.E2E_NS, metrics.e2e))
    _add_ints(attributes, ints)
    _add_str(attributes, semconv.PROMPT_BUCKET, record.prompt_bucket)
    verdict = record.verdict
    if verdict is not None:
        _add_str(attributes, semconv.DIAGNOSIS_SEGMENT, verdict.segment)
        _add_str(attributes, semconv.DIAGNOSIS_CAUSE, verdict.cause)
        _add_str(attributes, semconv.DIAGNOSIS_VERDICT, verdict.sentence)
        _add_str(attributes, semconv.DIAGNOSIS_ADVICE, verdict.advice)
        _add_str(attributes, semconv.DIAGNOSIS_METRIC, verdict.metric)
    if record.slo:
        met = sorted(name for name, ok in record.slo.items() if ok)
        breached = sorted(name for name, ok in record.slo.items() if not ok)
        _add_str_array(attributes, semconv.SLO_MET, met)
        _add_str_array(attributes, semconv.SLO_BREACHED, breached)
