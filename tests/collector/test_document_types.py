"""The request document's declared shape (``store.document``'s TypedDicts) is the shape the
builders emit: every key, in the order the JSON has it, for every kind of stored request."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.collector.test_store import BASE_NS, MS, make_record, make_rich_record, write_records
from tests.spanbuild import KIND_CLIENT, T0, request_spans, sid, span, tid, trace
from tokentrace.agent import semconv
from tokentrace.collector.config import parse_config
from tokentrace.collector.pipeline import Pipeline
from tokentrace.collector.store import RequestPageQuery, RequestStore, record_to_dict
from tokentrace.collector.store.document import (
    BoundariesDoc,
    ContextDoc,
    ItlSummaryDoc,
    MetricBudgetDoc,
    MetricsDoc,
    PrefillChunkDoc,
    RequestDocument,
    RequestSummaryDoc,
    StartDoc,
    TimelineDoc,
    TokenCountsDoc,
    VerdictDoc,
)
from tokentrace.collector.store.row import BOUNDARY_KEYS, CONTEXT_FIELDS, SUMMARY_COLUMNS
from tokentrace.processors.model import RequestRecord


def _pipeline_records(*spans: Any) -> list[RequestRecord]:
    processed = Pipeline(parse_config({}, environ={})).process_trace(trace(*spans))
    return list(processed.records)


def shaped_records() -> dict[str, RequestRecord]:
    """One record of every shape a document takes: dialects, a client span, no verdict, no first
    token, non-finite numbers, an error, a segment this version does not know."""
    rich = make_rich_record(2)
    odd = make_record(3)
    assert odd.verdict is not None
    odd.verdict.numbers.update({"ratio": math.nan, "huge": math.inf, "hash": "ab12", "n": 3})
    odd.timeline.decode_bandwidth_peak_ratio = math.nan
    odd.timeline.decode_roofline_ratio = 0.5
    odd.timeline.running_at_arrival = 4
    odd.timeline.prefix_hash = "feed"
    odd.timeline.status_error = "upstream reset"
    odd.timeline.finish_reason = None
    odd.timeline.input_tokens = None

    no_first_token = make_record(4)
    no_first_token.budget.ttft_ns = None
    no_first_token.budget.ttft_segments = {}
    no_first_token.metrics.ttft = None
    no_first_token.metrics.tpot = None

    unknown_segment = make_record(5)
    unknown_segment.budget.segments["warmup"] = 3 * MS

    client = span(
        semconv.SPAN_CLIENT_REQUEST,
        T0,
        T0 + 300 * MS,
        span_id=sid(60),
        trace_id=tid(6),
        kind=KIND_CLIENT,
        attrs={semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_REQUEST_MODEL: "m"},
    )
    (client_only,) = _pipeline_records(client)
    (server,) = _pipeline_records(*request_spans(trace_id=tid(7), token_offsets_us=(0,)))
    return {
        "plain": make_record(1),
        "rich": rich,
        "no_verdict": replace(make_record(8), verdict=None),
        "odd": odd,
        "no_first_token": no_first_token,
        "unknown_segment": unknown_segment,
        "client_only": client_only,
        "one_token": server,
    }


def _keys(typed_dict: type) -> list[str]:
    return list(typed_dict.__annotations__)


def _assert_keys_in_order(value: Mapping[str, Any], typed_dict: type) -> None:
    """Every required key, optional ones only if present, nothing else, in declared order."""
    declared = _keys(typed_dict)
    assert list(value) == [key for key in declared if key in value]
    required: frozenset[str] = typed_dict.__required_keys__  # type: ignore[attr-defined]
    assert required <= set(value)


def assert_document_shape(doc: Mapping[str, Any]) -> None:
    _assert_keys_in_order(doc, RequestDocument)
    _assert_keys_in_order(doc["start"], StartDoc)
    _assert_keys_in_order(doc["tokens"], TokenCountsDoc)
    _assert_keys_in_order(doc["metrics_ms"], MetricsDoc)
    _assert_keys_in_order(doc["metrics_ms"]["itl"], ItlSummaryDoc)
    _assert_keys_in_order(doc["timeline"], TimelineDoc)
    _assert_keys_in_order(doc["timeline"]["boundaries_ms"], BoundariesDoc)
    for chunk in doc["timeline"]["prefill_chunks"]:
        _assert_keys_in_order(chunk, PrefillChunkDoc)
    _assert_keys_in_order(doc["context"], ContextDoc)
    for clocks in doc["budgets"].values():
        for budget in clocks.values():
            _assert_keys_in_order(budget, MetricBudgetDoc)
    for verdict in [doc["verdict"], *doc["verdicts"].values()]:
        if verdict is not None:
            _assert_keys_in_order(verdict, VerdictDoc)
    for budget_doc, total in ((doc["budget"], "e2e_ms"), (doc["ttft_budget"], "ttft_ms")):
        if budget_doc is not None:
            assert list(budget_doc)[-1] == total
            assert all(isinstance(value, float) for value in budget_doc.values())


def test_the_declared_keys_are_the_rows_keys() -> None:
    # ``document_from_row`` builds these two from the row's key tuples (and casts).
    assert _keys(BoundariesDoc) == list(BOUNDARY_KEYS)
    assert _keys(ContextDoc) == list(CONTEXT_FIELDS)
    assert _keys(MetricsDoc) == [
        semconv.METRIC_TTFT,
        semconv.METRIC_TPOT,
        semconv.METRIC_E2E,
        semconv.METRIC_QUEUE,
        semconv.METRIC_PREFILL,
        semconv.METRIC_DECODE,
        semconv.METRIC_NETWORK,
        semconv.METRIC_ITL,
    ]


@pytest.mark.parametrize("name", list(shaped_records()))
def test_every_kind_of_document_has_the_declared_shape(name: str) -> None:
    doc = record_to_dict(shaped_records()[name])
    assert "other_span_ids" not in doc
    assert_document_shape(doc)


def test_stored_documents_and_summaries_have_the_declared_shape(tmp_path: Path) -> None:
    store = RequestStore(tmp_path / "store.db", clock=lambda: BASE_NS / 1e9)
    try:
        records = list(shaped_records().values())
        write_records(store, *records)
        for record in records:
            doc = store.get(record.timeline.trace_id.hex())
            assert doc is not None
            assert list(doc)[-1] == "other_span_ids"
            assert_document_shape(doc)
        page = store.list_requests(RequestPageQuery())
        assert len(page.items) == len(records)
        for item in page.items:
            _assert_keys_in_order(item, RequestSummaryDoc)
    finally:
        store.close()


def test_the_summary_declares_one_key_per_summary_column() -> None:
    assert len(_keys(RequestSummaryDoc)) == len(SUMMARY_COLUMNS) + 1  # start as ns and as ISO
