"""The request store, its rows and their documents.

A test that takes ``store_location`` (or the ``store`` fixture) runs once per backend: a SQLite
file and a database on the session's PostgreSQL (tests/conftest.py); the SQLite-only ones (WAL,
checkpoints, PRAGMAs, a full disk, the query planner's index use) open a file path.
PostgreSQL-only behaviour is in test_store_postgresql.py."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.collector.full_disk import fill_the_disk, free_the_disk
from tokentrace.agent import semconv
from tokentrace.collector.component import ExportRetryable
from tokentrace.collector.config import StoreConfig
from tokentrace.collector.encoding import encode_trace_request
from tokentrace.collector.exporters.store_sink import StoreSink
from tokentrace.collector.pipeline import ProcessedTrace
from tokentrace.collector.store import (
    RequestStore,
    StoreError,
    StoreNotFoundError,
    StoreWriteError,
    record_to_dict,
    window_report,
)
from tokentrace.collector.store.contract import Store, WriteItem
from tokentrace.collector.store.document import DOC_TOKEN_OFFSETS_CAP, budget_segments, ns_to_ms
from tokentrace.collector.store.location import is_postgresql, open_store, open_store_readonly
from tokentrace.collector.store.row import encode_detail
from tokentrace.processors.budget import compute_metrics
from tokentrace.processors.model import (
    AssembledTrace,
    Budget,
    RequestMetrics,
    RequestRecord,
    RequestTimeline,
    SpanRef,
    Verdict,
)
from tokentrace.processors.sketches import LatencySketch, SketchKey
from tokentrace.processors.slo import parse_targets

MS = 1_000_000
BASE_NS = 1_700_000_000 * 1_000_000_000  # 2023-11-14T22:13:20Z


def trace_id(number: int) -> bytes:
    """A 16-byte trace id whose first 8 hex digits are ``number``: prefixes are unambiguous."""
    return number.to_bytes(4, "big") + b"\x5a" * 12


def make_record(
    number: int = 1,
    *,
    start_ns: int = BASE_NS,
    queue_ms: int = 100,
    prefill_ms: int = 50,
    decode_ms: int = 200,
    model: str = "llama",
    span: int = 1,
    tid: bytes | None = None,
    slo: dict[str, bool] | None = None,
) -> RequestRecord:
    """A tokentrace-dialect request: http 2 ms, queue, prefill, decode, postprocess 1 ms."""
    arrival = start_ns + 2 * MS
    first_scheduled = arrival + queue_ms * MS
    first_token = first_scheduled + prefill_ms * MS
    last_token = first_token + decode_ms * MS
    end = last_token + 1 * MS
    server_end = end
    timeline = RequestTimeline(
        trace_id=tid if tid is not None else trace_id(number),
        span_id=span.to_bytes(8, "big"),
        dialect="tokentrace",
        service="svc",
        model=model,
        operation=semconv.OPERATION_CHAT,
        server_start=start_ns,
        server_end=server_end,
        engine_arrival=arrival,
        first_scheduled=first_scheduled,
        first_token=first_token,
        last_token=last_token,
        end=end,
        prefill_chunks=[(first_scheduled, first_token, 300)],
        token_offsets_us=[i * decode_ms * 1000 // 10 for i in range(11)],
        input_tokens=300,
        output_tokens=11,
        finish_reason="stop",
        requests_ahead=7,
    )
    segments = {
        semconv.SEGMENT_HTTP: 2 * MS,
        semconv.SEGMENT_QUEUE: queue_ms * MS,
        semconv.SEGMENT_PREFILL: prefill_ms * MS,
        semconv.SEGMENT_DECODE: decode_ms * MS,
        semconv.SEGMENT_POSTPROCESS: 1 * MS,
    }
    e2e = end - start_ns
    ttft = first_token - start_ns
    budget = Budget(
        e2e_ns=e2e,
        server_e2e_ns=e2e,
        segments=segments,
        ttft_ns=ttft,
        ttft_segments={
            semconv.SEGMENT_HTTP: 2 * MS,
            semconv.SEGMENT_QUEUE: queue_ms * MS,
            semconv.SEGMENT_PREFILL: prefill_ms * MS,
        },
    )
    metrics = RequestMetrics(
        ttft=ttft,
        tpot=(e2e - ttft) // 10,
        e2e=e2e,
        queue=queue_ms * MS,
        prefill=prefill_ms * MS,
        decode=decode_ms * MS,
        network=None,
        itl=[decode_ms * MS // 10] * 10,
    )
    verdict = Verdict(
        segment=semconv.SEGMENT_QUEUE,
        cause="queueing",
        sentence=f"queue wait was {queue_ms} ms: 7 requests ahead",
        advice="add capacity",
        numbers={"queue_ms": queue_ms, "requests_ahead": 7},
    )
    return RequestRecord(
        timeline=timeline,
        budget=budget,
        metrics=metrics,
        prompt_bucket="128-511",
        verdict=verdict,
        slo=slo if slo is not None else {"ttft-p95": True},
    )


def make_rich_record(number: int = 1) -> RequestRecord:
    """A request with every phase: client, http, cold start, chunked prefill, preemption."""
    record = make_record(number, queue_ms=100, prefill_ms=60, decode_ms=300)
    timeline = record.timeline
    assert timeline.server_start is not None and timeline.first_scheduled is not None
    assert timeline.first_token is not None and timeline.engine_arrival is not None
    timeline.client_start = timeline.server_start - 10 * MS
    timeline.client_end = (timeline.server_end or 0) + 10 * MS
    timeline.ready = timeline.engine_arrival + 40 * MS
    middle = timeline.first_scheduled + 20 * MS
    timeline.prefill_chunks = [
        (timeline.first_scheduled, middle, 256),
        (middle, timeline.first_token, 44),
    ]
    timeline.preempted = [(timeline.first_token + 100 * MS, timeline.first_token + 150 * MS)]
    return record


def decode_span(record: RequestRecord) -> Span:
    """The ``llm.decode`` child of the request span, carrying the token offsets (as the agent
    sends them), so the store can read them back for the document."""
    timeline = record.timeline
    span = Span(
        trace_id=timeline.trace_id,
        span_id=b"\xdd" + timeline.span_id[1:],
        parent_span_id=timeline.span_id,
        name=semconv.SPAN_DECODE,
        start_time_unix_nano=timeline.first_token or 0,
        end_time_unix_nano=timeline.last_token or 0,
    )
    offsets = span.attributes.add(key=semconv.DECODE_TOKEN_OFFSETS)
    offsets.value.array_value.values.extend(
        AnyValue(int_value=offset) for offset in timeline.token_offsets_us
    )
    dropped = span.attributes.add(key=semconv.DECODE_TOKEN_OFFSETS_DROPPED)
    dropped.value.int_value = timeline.token_offsets_dropped
    return span


def assembled(
    *records: RequestRecord, services: Sequence[str] = ("svc",), with_decode: bool = True
) -> AssembledTrace:
    """An assembled trace whose spans arrived under one resource per service: two spans per
    service, plus (under the first) the decode span of each record when ``with_decode``."""
    refs = []
    scope = InstrumentationScope(name="tokentrace")
    trace = records[0].timeline.trace_id
    for index, service in enumerate(services):
        resource = Resource(attributes=[KeyValue(key=semconv.SERVICE_NAME)])
        resource.attributes[0].value.string_value = service
        for child in range(2):
            span = Span(
                trace_id=trace,
                span_id=(100 + index * 10 + child).to_bytes(8, "big"),
                name=semconv.SPAN_REQUEST,
            )
            refs.append(SpanRef(span=span, resource=resource, scope=scope, service=service))
        if index == 0 and with_decode:
            for record in records:
                refs.append(SpanRef(decode_span(record), resource, scope, service))
    return AssembledTrace(trace_id=trace, spans=refs)


def stored_document(record: RequestRecord) -> dict[str, object]:
    """What ``get`` should return for a record stored alone in its trace."""
    return {**record_to_dict(record), "other_span_ids": []}


@pytest.fixture
def store(store_location: str) -> Iterator[Store]:
    """A store on each backend (``store_location``), its clock at ``BASE_NS``."""
    opened = open_store(store_location, clock=lambda: BASE_NS / 1e9)
    yield opened
    opened.close()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[RequestStore]:
    """A SQLite store, for the tests of what only SQLite has (WAL, PRAGMAs, its planner)."""
    opened = RequestStore(tmp_path / "store.db", clock=lambda: BASE_NS / 1e9)
    yield opened
    opened.close()


def write_records(store: Store, *records: RequestRecord) -> None:
    store.write([(assembled(record), [record]) for record in records])


def run_sql(location: str, statement: str) -> list[tuple[Any, ...]]:
    """Run one statement on the store's database behind its back (either backend): its rows."""
    if is_postgresql(location):
        import psycopg

        with psycopg.connect(
            location, autocommit=True, options="-c search_path=tokentrace"
        ) as connection:
            cursor = connection.execute(statement)
            return cursor.fetchall() if cursor.description else []
    with contextlib.closing(sqlite3.connect(location)) as connection, connection:
        return connection.execute(statement).fetchall()


# --- rows and documents ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=5 * 10**9), min_size=1, max_size=9))
def test_document_budget_sums_to_e2e_to_the_microsecond(segment_ns: list[int]) -> None:
    names = semconv.SEGMENTS[: len(segment_ns)]
    segments = dict(zip(names, segment_ns, strict=True))
    record = make_record()
    record.budget.segments = segments
    record.budget.e2e_ns = sum(segment_ns)
    doc = record_to_dict(record)
    budget_us = {k: round(v * 1000) for k, v in budget_segments(doc["budget"]).items()}
    e2e_us = round(doc["budget"]["e2e_ms"] * 1000)
    assert sum(budget_us.values()) == e2e_us
    assert e2e_us == (sum(segment_ns) + 500) // 1000
    for name, value_ns in segments.items():
        assert abs(budget_us[name] * 1000 - value_ns) <= 1000
    assert list(budget_segments(doc["budget"])) == list(semconv.SEGMENTS)


def test_document_fields_units_and_timeline_offsets() -> None:
    record = make_record(queue_ms=100, prefill_ms=50, decode_ms=200)
    record.timeline.preempted = [(BASE_NS + 200 * MS, BASE_NS + 210 * MS)]
    record.timeline.client_start = BASE_NS - 3 * MS
    doc = record_to_dict(record)
    json.dumps(doc, allow_nan=False)  # the document is strict JSON
    assert doc["trace_id"] == trace_id(1).hex()
    assert doc["span_id"] == (1).to_bytes(8, "big").hex()
    assert doc["start"] == {"iso": "2023-11-14T22:13:20.000000Z", "unix_ns": BASE_NS}
    assert doc["metrics_ms"]["queue"] == 100.0
    assert doc["metrics_ms"]["ttft"] == 152.0
    assert doc["metrics_ms"]["network"] is None
    assert doc["metrics_ms"]["itl"] == {"count": 10, "p50": 20.0, "p99": 20.0, "max": 20.0}
    assert doc["ttft_budget"]["ttft_ms"] == 152.0
    assert doc["ttft_budget"]["queue"] == 100.0
    timeline = doc["timeline"]
    # The client started first: every offset is relative to it.
    assert timeline["origin_unix_ns"] == BASE_NS - 3 * MS
    assert timeline["boundaries_ms"]["client_start"] == 0.0
    assert timeline["boundaries_ms"]["arrival"] == 5.0
    assert timeline["boundaries_ms"]["first_token"] == 155.0
    assert "ready" not in timeline["boundaries_ms"]
    assert timeline["preemptions_ms"] == [[203.0, 213.0]]
    assert timeline["prefill_chunks"] == [{"start_ms": 105.0, "end_ms": 155.0, "tokens": 300}]
    assert doc["verdict"]["cause"] == "queueing"
    assert doc["context"] == {"requests_ahead": 7}
    assert doc["slo"] == {"ttft-p95": True}


def test_document_caps_token_offsets_and_drops_non_finite_numbers() -> None:
    record = make_record()
    record.timeline.token_offsets_us = list(range(DOC_TOKEN_OFFSETS_CAP + 50))
    record.timeline.token_offsets_dropped = 7
    assert record.verdict is not None
    record.verdict.numbers["ratio"] = math.nan
    doc = record_to_dict(record)
    assert len(doc["token_offsets_us"]) == DOC_TOKEN_OFFSETS_CAP
    assert doc["token_offsets_dropped"] == 57
    assert doc["verdict"]["numbers"]["ratio"] is None
    json.dumps(doc, allow_nan=False)


def test_document_without_first_token_has_no_ttft_budget() -> None:
    record = make_record()
    record.budget.ttft_ns = None
    record.budget.ttft_segments = {}
    record.metrics.ttft = None
    doc = record_to_dict(record)
    assert doc["ttft_budget"] is None
    assert doc["metrics_ms"]["ttft"] is None


# --- writing and reading ------------------------------------------------------------------------


def test_store_round_trips_a_request(store: Store, store_location: str) -> None:
    record = make_record(7)
    write_records(store, record)
    row = run_sql(store_location, "SELECT model, e2e_ns, cause, slo_breached FROM requests")
    assert row == [("llama", record.budget.e2e_ns, "queueing", 0)]
    reader = open_store_readonly(store_location)
    doc = reader.get(trace_id(7).hex())
    assert doc is not None
    assert doc["trace_id"] == trace_id(7).hex()
    # The whole document, token times included, comes back as the record's own.
    assert doc == stored_document(record)
    assert doc["token_offsets_us"] == record.timeline.token_offsets_us
    assert doc["metrics_ms"]["itl"]["count"] == len(record.metrics.itl)
    assert reader.count() == 1
    assert store.written_requests == 1
    reader.close()


def test_sqlite_store_uses_wal(sqlite_store: RequestStore) -> None:
    write_records(sqlite_store, make_record(7))
    with contextlib.closing(sqlite3.connect(sqlite_store.path)) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_get_by_prefix_rejects_short_ambiguous_and_non_hex_ids(store: Store) -> None:
    first = make_record(tid=bytes.fromhex("aabbccdd11" + "00" * 11))
    second = make_record(tid=bytes.fromhex("aabbccdd22" + "00" * 11))
    write_records(store, first, second)
    doc = store.get("aabbccdd1")  # odd number of digits
    assert doc is not None and doc["trace_id"].startswith("aabbccdd11")
    assert store.get("AABBCCDD22")["trace_id"].startswith("aabbccdd22")
    with pytest.raises(ValueError, match=r"aabbccdd11.*aabbccdd22|aabbccdd22.*aabbccdd11"):
        store.get("aabbccdd")
    with pytest.raises(ValueError, match="at least 8"):
        store.get("aabbcc")
    with pytest.raises(ValueError, match="not hexadecimal"):
        store.get("' OR 1=1 --")
    assert store.get("ffffffff") is None
    assert store.get("aabbccdd33") is None


def test_prefix_of_all_ff_digits_matches_the_top_of_the_id_space(store: Store) -> None:
    record = make_record(tid=b"\xff" * 16)
    write_records(store, record)
    assert store.get("ffffffff") is not None


def test_trace_with_several_requests_returns_the_slowest_and_lists_the_others(
    store: Store,
) -> None:
    fast = make_record(1, span=1, queue_ms=10)
    slow = make_record(1, span=2, queue_ms=900)
    store.write([(assembled(fast), [fast, slow])])
    doc = store.get(trace_id(1).hex())
    assert doc is not None
    assert doc["span_id"] == (2).to_bytes(8, "big").hex()
    assert doc["other_span_ids"] == [(1).to_bytes(8, "big").hex()]
    picked = store.get(trace_id(1).hex(), span_id=(1).to_bytes(8, "big").hex())
    assert picked is not None and picked["metrics_ms"]["queue"] == 10.0
    assert store.get(trace_id(1).hex(), span_id="ffff") is None


def test_rewriting_a_request_replaces_it(store: Store) -> None:
    write_records(store, make_record(3, queue_ms=10))
    write_records(store, make_record(3, queue_ms=20))
    assert store.count() == 1
    assert store.get(trace_id(3).hex())["metrics_ms"]["queue"] == 20.0


def test_trace_spans_are_stored_grouped_by_resource_and_scope(store: Store) -> None:
    record = make_record(5)
    store.write([(assembled(record, services=("api", "engine")), [record])])
    payload = store.trace_otlp(trace_id(5).hex())
    assert payload is not None
    request = ExportTraceServiceRequest.FromString(payload)
    services = [rs.resource.attributes[0].value.string_value for rs in request.resource_spans]
    assert services == ["api", "engine"]
    for resource_spans in request.resource_spans:
        assert len(resource_spans.scope_spans) == 1
        assert resource_spans.scope_spans[0].scope.name == "tokentrace"
    # Two spans per service, plus the decode span under the first.
    assert [len(rs.scope_spans[0].spans) for rs in request.resource_spans] == [3, 2]
    assert store.trace_otlp(trace_id(6)) is None


def test_spans_of_a_trace_written_in_parts_are_appended_up_to_a_cap(store_location: str) -> None:
    store = open_store(store_location, max_trace_bytes=2000)
    first = make_record(5, span=1)
    second = make_record(5, span=2)
    store.write([(assembled(first, services=("api",)), [first])])
    first_part = store.trace_otlp(trace_id(5))
    store.write([(assembled(second, services=("engine",)), [second])])
    payload = store.trace_otlp(trace_id(5))
    assert payload is not None and first_part is not None
    assert payload.startswith(first_part)  # byte-exact append
    request = ExportTraceServiceRequest.FromString(payload)
    services = [rs.resource.attributes[0].value.string_value for rs in request.resource_spans]
    assert services == ["api", "engine"]
    assert store.replaced_traces == 0
    late = assembled(second, services=("late",))
    part = encode_trace_request(late.spans)
    expected_replacements = 0
    for _ in range(40):  # past the cap the newest part replaces the stored spans
        before = store.trace_otlp(trace_id(5))
        assert before is not None
        store.write([(late, [second], part)])
        payload = store.trace_otlp(trace_id(5))
        assert payload is not None and len(payload) <= 2000
        if len(before) + len(part) > 2000:
            expected_replacements += 1
            assert payload == part
        else:
            assert payload == before + part
    assert expected_replacements > 1  # the loop crossed the cap more than once
    assert store.replaced_traces == expected_replacements
    store.close()


def test_replacements_within_one_batch_are_counted_and_rolled_back_ones_are_not(
    store_location: str,
) -> None:
    record = make_record(7)
    trace = assembled(record, services=("api",))
    part = encode_trace_request(trace.spans)
    # Room for two parts: the third part of the same batch replaces them, the fourth appends.
    store = open_store(store_location, max_trace_bytes=2 * len(part))
    store.write([(trace, [record], part)] * 4)
    assert store.trace_otlp(trace_id(7)) == part + part
    assert store.replaced_traces == 1

    # A batch that rolls back counts only what was committed: its first rows replaced, then
    # the last item failed it; written again item by item, three replacements are committed.
    store.max_trace_bytes = len(part)
    other = make_record(8)
    poisoned: WriteItem = (assembled(other), [other])
    if is_postgresql(store_location):  # past bigint: the requests' statement fails
        other.timeline.input_tokens = 2**64
    else:  # SQLite cannot bind it: the transaction fails last, after the rows replaced
        unbindable: Any = ["not", "bytes"]
        poisoned = (assembled(other), [other], unbindable)
    with pytest.raises(StoreWriteError, match="quarantined"):
        store.write([(trace, [record], part)] * 3 + [poisoned])
    assert store.replaced_traces == 1 + 3
    assert store.quarantined_traces == 1
    assert store.trace_otlp(trace_id(7)) == part
    store.close()


def test_slowest_orders_by_the_chosen_metric_and_filters_by_start(store: Store) -> None:
    # 1: slow queue (largest TTFT); 2: long decode (largest E2E); 3: small, started latest.
    write_records(
        store,
        make_record(1, queue_ms=500, decode_ms=10),
        make_record(2, queue_ms=10, decode_ms=900),
        make_record(3, queue_ms=5, decode_ms=5, start_ns=BASE_NS + 10**9),
    )
    by_e2e = [doc["trace_id"] for doc in store.slowest(metric="e2e", limit=3)]
    assert by_e2e == [trace_id(2).hex(), trace_id(1).hex(), trace_id(3).hex()]
    assert store.slowest(metric="ttft", limit=1)[0]["trace_id"] == trace_id(1).hex()
    recent = store.slowest(since_ns=BASE_NS + 1, limit=5)
    assert [doc["trace_id"] for doc in recent] == [trace_id(3).hex()]
    assert store.slowest(metric="network") == []  # no request has a network segment
    with pytest.raises(ValueError, match="unknown metric"):
        store.slowest(metric="e2e_ns DESC; DROP TABLE requests; --")


def test_values_with_quotes_are_stored_verbatim(store: Store) -> None:
    write_records(store, make_record(9, model="m'); DROP TABLE requests; --"))
    assert store.get(trace_id(9).hex())["model"] == "m'); DROP TABLE requests; --"
    assert store.count() == 1


def test_malformed_record_is_left_out_and_reported(store: Store) -> None:
    good = make_record(1)
    bad = make_record(2)
    bad.budget.e2e_ns = None
    with pytest.raises(StoreWriteError) as caught:
        store.write([(assembled(good), [good]), (assembled(bad), [bad]), "garbage"])
    assert caught.value.rejected == 2
    assert caught.value.written == 1
    assert store.rejected_records == 2
    assert store.count() == 1
    assert store.get(trace_id(1).hex()) is not None
    assert store.get(trace_id(2).hex()) is None
    write_records(store, make_record(3))  # the store keeps working
    assert store.count() == 2


_REFUSE_POISON: dict[str, str] = {
    "sqlite": "CREATE TRIGGER refuse BEFORE INSERT ON requests WHEN NEW.model = 'poison' "
    "BEGIN SELECT RAISE(ABORT, 'poisoned'); END",
    "postgresql": "ALTER TABLE requests ADD CONSTRAINT refuse CHECK (model <> 'poison')",
}


def backend_of(location: str) -> str:
    return "postgresql" if is_postgresql(location) else "sqlite"


@pytest.mark.parametrize("poison_by", ["constraint", "value"])
def test_a_constraint_or_value_one_item_breaks_costs_only_that_item(
    store: Store, store_location: str, poison_by: str
) -> None:
    first = make_record(1)
    poison = make_record(2, model="poison")
    if poison_by == "constraint":
        run_sql(store_location, _REFUSE_POISON[backend_of(store_location)])
    else:  # an integer past 2**63: neither database's integer column takes it
        poison.timeline.output_tokens = 2**63
    with pytest.raises(StoreWriteError, match="quarantined") as caught:
        store.write([(assembled(first), [first]), (assembled(poison), [poison])])
    assert (caught.value.rejected, caught.value.written, caught.value.retryable) == (1, 1, False)
    assert (store.failed_batches, store.quarantined_traces) == (0, 1)
    assert "\n" not in str(caught.value)  # one line, the refused row's values not in it
    assert store.count() == 1
    assert store.trace_otlp(trace_id(2)) is None
    write_records(store, make_record(4))
    assert store.count() == 2


def test_a_database_that_refuses_the_write_rolls_the_batch_back_for_a_retry(
    sqlite_store: RequestStore,
) -> None:
    fill_the_disk(sqlite_store)
    records = [make_record(n) for n in range(1, 40)]
    with pytest.raises(StoreWriteError, match="rolled back") as caught:
        sqlite_store.write([(assembled(record), [record]) for record in records])
    assert (caught.value.rejected, caught.value.written, caught.value.retryable) == (0, 0, True)
    assert (sqlite_store.failed_batches, sqlite_store.rejected_records) == (1, 0)
    assert sqlite_store.count() == 0
    free_the_disk(sqlite_store)
    # The same batch again.
    sqlite_store.write([(assembled(record), [record]) for record in records])
    assert sqlite_store.count() == 39


def test_readonly_store_refuses_writes(store: Store, store_location: str) -> None:
    write_records(store, make_record(1))
    reader = open_store_readonly(store_location)
    with pytest.raises(StoreError, match="read-only"):
        write_records(reader, make_record(2))
    with pytest.raises(StoreError, match="read-only"):
        reader.set_meta("slo_targets", "[]")
    with pytest.raises(StoreError, match="read-only"):
        reader.write_sketch_slices([(1000, ("svc", "m", "chat", "0-127"), "e2e", {})])
    assert (reader.rejected_records, reader.quarantined_records) == (0, 0)  # refused, not lost
    assert reader.count() == 1
    reader.close()


def test_a_missing_sqlite_store_says_what_to_do(tmp_path: Path) -> None:
    missing = tmp_path / "absent.db"
    with pytest.raises(StoreNotFoundError) as caught:
        RequestStore.open_readonly(missing)
    assert str(caught.value) == (
        f"no store at {missing} - start `tokentrace collector` first or pass --store"
    )
    assert not missing.exists()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    with sqlite3.connect(path) as raw:
        raw.execute("PRAGMA user_version=99")
    with pytest.raises(StoreError, match="schema version 99, newer"):
        RequestStore(path)
    with pytest.raises(StoreError, match="schema version 99, newer"):
        RequestStore.open_readonly(path)


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="not a tokentrace store"):
        RequestStore.open_readonly(path)
    with pytest.raises(StoreError, match="not a tokentrace store"):
        RequestStore(path)
    assert path.read_bytes() == b"this is not sqlite" * 100


def test_another_programs_database_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as raw:
        raw.execute("CREATE TABLE users (name TEXT)")
    with pytest.raises(StoreError, match="not a tokentrace store"):
        RequestStore(path)
    with pytest.raises(StoreError, match="not a tokentrace store"):
        RequestStore.open_readonly(path)
    with sqlite3.connect(path) as raw:
        tables = {row[0] for row in raw.execute("SELECT name FROM sqlite_master")}
    assert tables == {"users"}


def test_store_is_readable_after_the_writer_closed(store_location: str) -> None:
    writer = open_store(store_location)
    write_records(writer, make_record(1))
    writer.close()
    reader = open_store_readonly(store_location)
    assert reader.count() == 1
    assert reader.get(trace_id(1).hex()) is not None


def test_meta_round_trip(store: Store) -> None:
    assert store.meta("slo_targets") is None
    store.set_meta("slo_targets", '[{"name": "x"}]')
    store.set_meta("slo_targets", "[]")
    assert store.meta("slo_targets") == "[]"


def test_rows_are_compact_and_the_document_is_built_when_read(
    store: Store, store_location: str
) -> None:
    record = make_record(4, decode_ms=300)
    record.timeline.token_offsets_us = [i * 1500 for i in range(200)]
    record.timeline.preempted = [(BASE_NS + 200 * MS, BASE_NS + 210 * MS)]
    record.metrics.network = 3 * MS
    write_records(store, record)
    [(detail,)] = run_sql(store_location, "SELECT detail FROM requests")
    # No per-token data in the row (the offsets stay in the stored decode span) ...
    assert "1500,3000,4500" not in detail and len(detail) < 200 * 4
    # ... yet the document read back is the record's, to the microsecond and token.
    doc = store.get(trace_id(4).hex())
    assert doc == stored_document(record)
    assert doc is not None and doc["token_offsets_us"][-1] == 199 * 1500
    assert doc["metrics_ms"]["itl"] == {"count": 199, "p50": 1.5, "p99": 1.5, "max": 1.5}
    assert store.slowest(metric="network") == [record_to_dict(record)]


def test_document_itl_is_derived_like_the_request_metrics() -> None:
    record = make_record(4)
    # Gaps 10, -5 (malformed: skipped, as for RequestMetrics.itl), 25, 0, 70 µs.
    record.timeline.token_offsets_us = [0, 10, 5, 30, 30, 100]
    itl = record_to_dict(record)["metrics_ms"]["itl"]
    # Nearest rank over [0, 10, 25, 70] µs: p50 is the 2nd, p99 the 4th.
    assert itl == {"count": 4, "p50": 0.01, "p99": 0.07, "max": 0.07}
    timeline_metrics = compute_metrics(record.timeline, record.budget)
    assert sorted(timeline_metrics.itl) == [0, 10_000, 25_000, 70_000]


_EXAMPLE_TRACES = itertools.count(1)
"""Trace numbers of the property test's examples: each writes its own trace into the one store
the test's examples share (a database per example would cost PostgreSQL a database each)."""


# The examples share the function's store on purpose: each writes a trace of its own.
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    queue_ms=st.integers(min_value=0, max_value=10_000),
    offsets=st.lists(st.integers(min_value=0, max_value=10**7), max_size=40),
    dropped=st.integers(min_value=0, max_value=100),
    breached=st.booleans(),
    ratio=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
)
def test_stored_document_equals_the_records_document(
    store: Store,
    store_location: str,
    queue_ms: int,
    offsets: list[int],
    dropped: int,
    breached: bool,
    ratio: float | None,
) -> None:
    number = next(_EXAMPLE_TRACES)
    record = make_record(number, queue_ms=queue_ms, slo={"a": True, "b": not breached})
    record.timeline.token_offsets_us = offsets
    record.timeline.token_offsets_dropped = dropped
    record.timeline.decode_bandwidth_peak_ratio = ratio
    assert record.verdict is not None
    record.verdict.numbers["ratio"] = ratio if ratio is not None else "n/a"
    record.verdict.advice = "custom advice" if breached else record.verdict.advice
    write_records(store, record)
    doc = store.get(trace_id(number).hex())
    breached_by_trace = {
        bytes(trace): flag
        for trace, flag in run_sql(store_location, "SELECT trace_id, slo_breached FROM requests")
    }
    assert breached_by_trace[trace_id(number)] == int(breached)
    assert doc == stored_document(record)
    json.dumps(doc, allow_nan=False)


class _Label(str):
    """A str subclass, as some library's string type may be: msgspec's encoder refuses it."""


def test_a_detail_msgspec_refuses_is_written_by_the_standard_encoder(
    store: Store, store_location: str
) -> None:
    with pytest.raises(TypeError):
        msgspec.json.encode({"engine": _Label("vllm")})
    number = next(_EXAMPLE_TRACES)
    record = make_record(number)
    assert record.verdict is not None
    record.verdict.numbers["engine"] = _Label("vllm")
    record.verdict.numbers["ratio"] = math.inf  # NaN/Infinity from this encoder: null when read
    write_records(store, record)
    doc = store.get(trace_id(number).hex())
    assert doc == stored_document(record)
    assert doc["verdict"]["numbers"]["engine"] == "vllm"
    assert doc["verdict"]["numbers"]["ratio"] is None


_JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet=st.characters(exclude_categories=())),  # lone surrogates too
)


@given(
    st.recursive(
        _JSON_LEAVES,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.lists(inner, max_size=4).map(tuple),
            st.dictionaries(st.text(max_size=8), inner, max_size=4),
        ),
        max_leaves=20,
    )
)
def test_the_detail_encoder_writes_what_the_standard_library_writes(value: Any) -> None:
    assert json.loads(encode_detail({"v": value})) == json.loads(json.dumps({"v": value}))


def test_token_times_missing_from_the_stored_spans_are_counted_as_dropped(
    store: Store,
) -> None:
    record = make_record(2)
    store.write([(assembled(record, with_decode=False), [record])])
    doc = store.get(trace_id(2).hex())
    assert doc is not None
    assert doc["token_offsets_us"] == []
    assert doc["token_offsets_dropped"] == len(record.timeline.token_offsets_us)
    assert doc["metrics_ms"]["itl"]["count"] == 0
    expected = stored_document(record)
    for key in ("budget", "ttft_budget", "timeline", "verdict", "slo", "tokens", "context"):
        assert doc[key] == expected[key]


def test_pre_encoded_spans_are_stored_as_given_and_encoded_otherwise(store: Store) -> None:
    given_record, encoded_record = make_record(1), make_record(2)
    blob = ExportTraceServiceRequest()
    blob.resource_spans.add().scope_spans.add().spans.append(decode_span(given_record))
    payload = blob.SerializeToString()
    store.write(
        [
            (assembled(given_record), [given_record], payload),
            (assembled(encoded_record), [encoded_record], b""),  # empty: the store encodes
        ]
    )
    assert store.trace_otlp(trace_id(1)) == payload
    assert store.get(trace_id(1).hex()) == stored_document(given_record)
    stored = store.trace_otlp(trace_id(2))
    assert stored is not None
    assert sum(
        len(scope.spans)
        for rs in ExportTraceServiceRequest.FromString(stored).resource_spans
        for scope in rs.scope_spans
    ) == len(assembled(encoded_record).spans)


def test_an_unreadable_row_is_reported_with_its_ids(store: Store, store_location: str) -> None:
    write_records(store, make_record(3))
    run_sql(store_location, "UPDATE requests SET detail = '{not json'")
    with pytest.raises(StoreError, match=trace_id(3).hex() + r"/0000000000000001 is unreadable"):
        store.get(trace_id(3).hex())


def test_an_older_schema_is_refused_with_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as raw:
        raw.execute("CREATE TABLE requests (doc TEXT)")
        raw.execute("PRAGMA user_version=1")
    for opener in (RequestStore, RequestStore.open_readonly):
        with pytest.raises(StoreError, match=r"schema version 1, older .*move it aside"):
            opener(path)
    with sqlite3.connect(path) as raw:  # left as it was
        assert raw.execute("PRAGMA user_version").fetchone() == (1,)


def test_every_index_serves_a_query(sqlite_store: RequestStore) -> None:
    queries = {
        "requests_start": "SELECT e2e_ns FROM requests WHERE start_ns < 5 ORDER BY start_ns "
        "LIMIT 3",
        "requests_e2e": "SELECT * FROM requests WHERE e2e_ns IS NOT NULL ORDER BY e2e_ns DESC "
        "LIMIT 3",
        "requests_ttft": "SELECT * FROM requests WHERE ttft_ns IS NOT NULL ORDER BY ttft_ns DESC "
        "LIMIT 3",
        "traces_received": "SELECT rowid FROM traces WHERE received_ns < 5 LIMIT 3",
        # The list API's seeks (tests/api/test_store_queries.py checks which query uses which).
        "requests_service": "SELECT COUNT(*) FROM requests WHERE service = 'a'",
        "requests_model": "SELECT COUNT(*) FROM requests WHERE model = 'a'",
        "requests_operation": "SELECT COUNT(*) FROM requests WHERE operation = 'a'",
        "requests_bucket": "SELECT COUNT(*) FROM requests WHERE prompt_bucket = 'a'",
        "requests_cause": "SELECT COUNT(*) FROM requests WHERE cause = 'a'",
        "requests_segment": "SELECT COUNT(*) FROM requests WHERE segment = 'a'",
        "requests_breached": "SELECT COUNT(*) FROM requests WHERE slo_breached > 0",
        "requests_request_id": "SELECT COUNT(*) FROM requests WHERE instr(request_id, 'a') > 0",
    }
    with sqlite3.connect(sqlite_store.path) as raw:
        indexes = {
            name
            for (name,) in raw.execute(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
            )
        }
        assert indexes == set(queries)
        for index, query in queries.items():
            plan = " ".join(row[-1] for row in raw.execute("EXPLAIN QUERY PLAN " + query))
            assert index in plan, (index, plan)


def test_the_wal_is_checkpointed_in_the_background(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = RequestStore(path, checkpoint_bytes=1)
    size_before = path.stat().st_size
    write_records(store, *(make_record(n) for n in range(1, 40)))
    deadline = time.monotonic() + 10
    while store.checkpoints == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.checkpoints >= 1 and store.failed_checkpoints == 0
    assert path.stat().st_size > size_before  # the rows reached the database file
    store.close()
    assert RequestStore.open_readonly(path).count() == 39


def test_store_sink_counts_written_and_rejected_records(tmp_path: Path) -> None:
    sink = StoreSink(StoreConfig(path=str(tmp_path / "sink.db")))
    good, bad = make_record(1), make_record(2)
    bad.budget.e2e_ns = None
    sink.export_traces(
        [
            ProcessedTrace(assembled(good), [good]),
            ProcessedTrace(assembled(bad), [bad]),
        ]
    )
    stats = sink.stats()
    assert (stats["written_requests"], stats["rejected_records"]) == (1, 1)
    assert stats["failed_batches"] == 0
    fill_the_disk(sink.store)
    big = [make_record(n) for n in range(3, 60)]
    with pytest.raises(ExportRetryable, match="rolled back"):
        sink.export_traces([ProcessedTrace(assembled(record), [record]) for record in big])
    stats = sink.stats()
    assert (stats["written_requests"], stats["rejected_records"]) == (1, 1)  # held, not lost
    assert stats["failed_batches"] == 1
    sink.shutdown(1.0)


# --- pruning ------------------------------------------------------------------------------------


def test_prune_by_age_removes_old_requests_and_their_traces(store_location: str) -> None:
    now_s = BASE_NS / 1e9 + 3600
    store = open_store(store_location, retention_s=600, clock=lambda: now_s)
    old = make_record(1, start_ns=BASE_NS)  # an hour ago
    fresh = make_record(2, start_ns=BASE_NS + 3500 * 10**9)
    write_records(store, old, fresh)
    assert store.prune() == 1
    assert store.get(trace_id(1).hex()) is None
    assert store.trace_otlp(trace_id(1)) is None
    assert store.get(trace_id(2).hex()) is not None
    assert store.trace_otlp(trace_id(2)) is not None
    assert store.pruned_requests == 1
    assert store.prune() == 0
    store.close()


def test_prune_by_count_removes_the_oldest_in_bounded_steps(store_location: str) -> None:
    store = open_store(store_location, max_requests=6, prune_batch=3, clock=lambda: BASE_NS / 1e9)
    records = [make_record(n, start_ns=BASE_NS + n * MS) for n in range(10)]
    write_records(store, *reversed(records))  # insertion order must not matter
    assert store.prune() == 3
    assert store.prune() == 1
    assert store.prune() == 0
    assert store.count() == 6
    kept = {doc["trace_id"] for doc in store.slowest(limit=100)}
    assert kept == {trace_id(n).hex() for n in range(4, 10)}
    assert store.pruned_requests == 4
    store.close()


def test_trace_shared_by_a_kept_request_survives_pruning(store_location: str) -> None:
    now_s = BASE_NS / 1e9 + 3600
    store = open_store(store_location, retention_s=600, clock=lambda: now_s)
    old = make_record(1, span=1, start_ns=BASE_NS)
    fresh = make_record(1, span=2, start_ns=BASE_NS + 3500 * 10**9)
    store.write([(assembled(old), [old, fresh])])
    assert store.prune() == 1
    assert store.trace_otlp(trace_id(1)) is not None
    store.close()


# --- sketch slices and the window report -----------------------------------------------------


def sketch_of(values_ms: Sequence[float]) -> LatencySketch:
    sketch = LatencySketch()
    sketch.add_many([v / 1000 for v in values_ms])
    return sketch


def test_sketch_slices_round_trip_filter_and_replace(store: Store) -> None:
    key = SketchKey("svc", "llama", "chat", "128-511")
    store.write_sketch_slices(
        [
            (1000, key, "ttft", sketch_of([100, 200])),
            (1010, key, "ttft", sketch_of([300])),
            (1010, ("svc", "qwen", "chat", "0-127"), "e2e", sketch_of([5]).to_dict()),
        ]
    )
    # The collector rewrites an open slice with its cumulative content: no double counting.
    store.write_sketch_slices([(1010, key, "ttft", sketch_of([300, 400]))])
    slices = store.sketches_since(1005)
    assert sorted((s[0], s[1], s[2]) for s in slices) == [
        (1010, ("svc", "llama", "chat", "128-511"), "ttft"),
        (1010, ("svc", "qwen", "chat", "0-127"), "e2e"),
    ]
    llama = next(s for s in slices if s[1][1] == "llama")
    assert LatencySketch.from_dict(llama[3]).count == 2
    assert len(store.sketches_since(0)) == 3
    # Fractional slice starts (2.5 s slices) stay apart.
    store.write_sketch_slices(
        [(1020.0, key, "e2e", sketch_of([1])), (1022.5, key, "e2e", sketch_of([2]))]
    )
    assert sorted(s[0] for s in store.sketches_since(1020)) == [1020, 1022.5]


def test_window_report_merges_slices_per_key_and_evaluates_slos() -> None:
    llama = ("svc", "llama", "chat", "128-511")
    qwen = ("svc", "qwen", "chat", "128-511")
    fast = [float(v) for v in range(1, 201)]  # 1..200 ms
    slices = [
        (100, llama, "ttft", sketch_of(fast[:100]).to_dict()),
        (110, llama, "ttft", sketch_of(fast[100:]).to_dict()),
        (100, llama, "e2e", sketch_of([v * 2 for v in fast]).to_dict()),
        (100, qwen, "ttft", sketch_of([900.0] * 50).to_dict()),
    ]
    targets = [
        {"name": "chat-ttft", "metric": "ttft", "percentile": 95, "threshold": "500ms"},
        {
            "name": "llama-ttft",
            "metric": "ttft",
            "percentile": 90,
            "threshold": "500ms",
            "selector": {"model": "ll*"},
        },
    ]
    report = window_report(
        slices, window_s=60, now_s=160, slo_targets=parse_targets(targets), slo_errors=["nope"]
    )
    assert report["since_s"] == 100
    assert [(k["model"], k["requests"]) for k in report["keys"]] == [("llama", 200), ("qwen", 50)]
    llama_ttft = report["keys"][0]["metrics"]["ttft"]
    assert llama_ttft["count"] == 200
    assert llama_ttft["p50"] == pytest.approx(100, rel=0.02)
    assert llama_ttft["p99"] == pytest.approx(198, rel=0.02)
    assert report["keys"][0]["metrics"]["e2e"]["p50"] == pytest.approx(200, rel=0.02)
    by_target = {entry["target"]: entry for entry in report["slo"]}
    assert set(by_target) == {"chat-ttft", "llama-ttft"}
    assert report["slo_errors"] == ["nope"]  # passed through
    # 50 of 250 chat requests are over 500 ms: 80% compliance misses a p95 target.
    assert by_target["chat-ttft"]["met"] is False
    assert by_target["chat-ttft"]["requests"] == 250
    assert by_target["chat-ttft"]["compliance"] == pytest.approx(0.8, abs=0.01)
    assert by_target["llama-ttft"]["met"] is True
    assert by_target["llama-ttft"]["requests"] == 200
    key_marks = {k["model"]: {e["target"]: e["met"] for e in k["slo"]} for k in report["keys"]}
    assert key_marks == {
        "llama": {"chat-ttft": True, "llama-ttft": True},
        "qwen": {"chat-ttft": False},
    }


def test_window_report_of_an_empty_window() -> None:
    targets = parse_targets([{"name": "t", "metric": "ttft", "percentile": 95, "threshold": "1s"}])
    report = window_report([], window_s=60, now_s=1000, slo_targets=targets)
    assert report["keys"] == []
    assert report["requests"] == 0
    assert report["slo"][0]["met"] is None


# --- concurrency --------------------------------------------------------------------------------


def test_writer_thread_and_readers_at_once(store_location: str) -> None:
    store = open_store(store_location)
    batches, per_batch = 40, 5
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for batch in range(batches):
                records = [make_record(batch * per_batch + i + 1) for i in range(per_batch)]
                store.write([(assembled(r), [r]) for r in records])
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    thread = threading.Thread(target=writer)
    reader_process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from tokentrace.collector.store.location import open_store_readonly\n"
            "r = open_store_readonly(sys.argv[1])\n"
            "seen = [r.count() for _ in range(200)]\n"
            "assert seen == sorted(seen), seen\n"
            "print(seen[-1])\n",
            store_location,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    thread.start()
    reader = open_store_readonly(store_location)
    counts = []
    while thread.is_alive():
        counts.append(reader.count())
        reader.slowest(limit=3)
        reader.get(trace_id(1).hex())
    thread.join()
    out, err = reader_process.communicate(timeout=60)
    assert reader_process.returncode == 0, err
    assert not errors
    assert counts == sorted(counts)  # a reader never sees a half-written batch go backwards
    assert all(c % per_batch == 0 for c in counts)  # batches are atomic
    assert reader.count() == batches * per_batch
    assert int(out) % per_batch == 0
    reader.close()
    store.close()


def test_a_late_fragment_without_records_is_appended_to_its_stored_trace(
    store_location: str,
) -> None:
    store = open_store(store_location)
    record = make_record(6, span=1)
    store.write([(assembled(record, services=("engine",)), [record])])
    before = store.trace_otlp(trace_id(6))
    late = assembled(record, services=("load",))
    late.late = True
    # A client span that came after assembly: no records of its own, spans kept all the same.
    store.write([(late, [], encode_trace_request(late.spans))])
    after = store.trace_otlp(trace_id(6))
    assert before is not None and after is not None and after.startswith(before)
    services = [
        rs.resource.attributes[0].value.string_value
        for rs in ExportTraceServiceRequest.FromString(after).resource_spans
    ]
    assert services == ["engine", "load"]
    # A fragment that is not late and has no records is still not stored.
    other = assembled(make_record(7, span=1), services=("x",))
    store.write([(other, [], encode_trace_request(other.spans))])
    assert store.trace_otlp(trace_id(7)) is None
    store.close()


# --- per-metric budgets and verdicts in the document --------------------------------------------
def _views_ms(record: RequestRecord) -> dict[str, dict[str, dict[str, float]]]:
    """``budget.metric_budget`` of every metric and clock, in the document's ms."""
    from tokentrace.processors.budget import metric_budget

    views: dict[str, dict[str, dict[str, float]]] = {}
    for metric in ("ttft", "tpot", "itl", "e2e"):
        for clock in ("server", "client"):
            view = metric_budget(record, metric, clock=clock)
            if view is not None:
                views.setdefault(metric, {})[clock] = {
                    name: ns_to_ms(ns) for name, ns in view.segments.items() if ns
                } | {"value": ns_to_ms(view.value_ns)}
    return views


def _doc_views(doc: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    return {
        metric: {
            clock: dict(budget["segments"]) | {"value": budget["value_ms"]}
            for clock, budget in clocks.items()
        }
        for metric, clocks in doc["budgets"].items()
    }


def test_document_budgets_are_the_records_metric_budgets() -> None:
    # Replayed traffic: client spans, outlier gaps split by the agent's prefill count.
    from tests.processors.test_window import replayed_records
    from tokentrace.processors.decode_split import decode_facts_of

    records = replayed_records("mixed", requests=40, seed=11)
    assert any(decode_facts_of(record).outlier_gaps for record in records)
    for record in records:
        doc = record_to_dict(record)
        views, doc_views = _views_ms(record), _doc_views(doc)
        assert set(doc_views) == set(views)
        for metric, clocks in views.items():
            for clock, view in clocks.items():
                got = doc_views[metric][clock]
                assert got["value"] == pytest.approx(view["value"], abs=0.002), (metric, clock)
                for name, value in view.items():
                    assert got.get(name, 0.0) == pytest.approx(value, abs=0.002), (metric, name)


def test_document_carries_every_metric_verdict_and_the_default_one() -> None:
    from tests.processors.test_window import replayed_records
    from tokentrace.processors.verdict import default_verdict, diagnose_request

    # Replayed traffic: client spans, queues, outlier gaps; the verdicts about the other
    # metrics are derived from the stored row when read and must equal the record's own.
    checked = 0
    for record in replayed_records("mixed", requests=40, seed=11):
        record.verdict = default_verdict(record, breached_metrics=[("chat-ttft", "ttft")])
        doc = record_to_dict(record)
        assert doc["verdict"]["metric"] == record.verdict.metric
        assert doc["verdict"]["why"] == record.verdict.why
        assert doc["verdicts"][record.verdict.metric] == doc["verdict"]
        for metric in ("ttft", "tpot", "itl", "e2e"):
            verdict = diagnose_request(record, metric=metric)
            if verdict is None:
                assert metric not in doc["verdicts"]
                continue
            if metric == record.verdict.metric:
                continue
            derived = doc["verdicts"][metric]
            assert derived["sentence"] == verdict.sentence, metric
            assert (derived["cause"], derived["segment"], derived["clock"]) == (
                verdict.cause,
                verdict.segment,
                verdict.clock,
            )
            checked += 1
    assert checked > 40


def test_documents_derive_other_verdicts_by_the_collectors_diagnosis_settings(
    store_location: str,
) -> None:
    from tests.processors.test_window import replayed_records
    from tokentrace.collector.store.contract import (
        META_DIAGNOSIS,
        diagnosis_from_json,
        diagnosis_to_json,
    )
    from tokentrace.processors.diagnosis import DiagnosisConfig
    from tokentrace.processors.verdict import default_verdict, diagnose_request

    strict = DiagnosisConfig(long_prompt_tokens=100)
    assert diagnosis_from_json(diagnosis_to_json(strict)) == strict
    assert diagnosis_from_json("not json") == DiagnosisConfig()
    assert diagnosis_from_json('{"tie_ratio": 5}') == DiagnosisConfig()  # invalid: defaults
    assert diagnosis_from_json('{"a_newer_setting": 1}') == DiagnosisConfig()  # unknown: ignored
    # A request whose TTFT is prefill-bound: a long prompt only by the strict threshold.
    record = next(
        r
        for r in replayed_records("mixed", requests=80, seed=11)
        if (verdict := diagnose_request(r, strict, metric="ttft")) is not None
        and verdict.cause == "long_prompt"
    )
    record.verdict = default_verdict(record, strict)  # E2E: no target
    store = open_store(store_location)
    store.set_meta(META_DIAGNOSIS, diagnosis_to_json(strict))
    store.write([(assembled(record), [record])])
    doc = store.get(record.timeline.trace_id.hex())
    store.close()
    assert doc is not None
    assert doc["verdicts"]["ttft"]["cause"] == "long_prompt"  # derived by the stored settings
    assert record_to_dict(record)["verdicts"]["ttft"]["cause"] != "long_prompt"  # the defaults
