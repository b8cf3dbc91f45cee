"""The request list in the store (``collector/store/query.py``, run by
``collector/store/sqlite/list_query.py`` and ``collector/store/postgresql/list_query.py``):
filters, orders, keyset pages, totals, timeouts, and the fleet helpers ``segment_means`` and
``sketches_between``, on both backends (the ``filled`` store and ``store_location``).

Every expectation is computed here, by brute force over the rows the test wrote (``Row``), and
compared with what the store answers: the same matches, in the same order, each exactly once.
SQLite's query planner has several paths (a rare filter's seek, a scan of the start index,
rowid lists, walks in sort order, the fallback of a slow walk); small ``TOTAL_CAP`` values and a
zero walk budget drive the same queries through each of them. The planner's own tests (which
index a plan names) are SQLite's only: PostgreSQL plans with its own statistics.
"""

from __future__ import annotations

import base64
import itertools
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.collector.test_store import BASE_NS, MS, assembled, make_record
from tests.postgres_server import PostgresServer
from tokentrace.agent import semconv
from tokentrace.collector.store import (
    QueryTimeoutError,
    RequestFilter,
    RequestPageQuery,
    RequestStore,
    Store,
    StoreError,
    is_postgresql,
    open_store,
    open_store_readonly,
)
from tokentrace.collector.store import query as store_query
from tokentrace.collector.store.document import budget_segments
from tokentrace.collector.store.postgresql import list_query as pg_list_query
from tokentrace.collector.store.query import SORT_KEYS, decode_cursor, encode_cursor
from tokentrace.collector.store.row import REQUEST_COLUMNS
from tokentrace.collector.store.sqlite import list_query
from tokentrace.collector.store.sqlite.list_query import (
    filter_terms,
    match_sql,
    page_sql,
    plan_query,
    window_terms,
)
from tokentrace.collector.store.sqlite.schema import REQUEST_INDEXES, SCHEMA
from tokentrace.processors.model import RequestRecord, Verdict

SERVICES = ("svc-a", "svc-b")
MODELS = ("llama", "mistral", "x' OR 1=1 --")
OPERATIONS = (semconv.OPERATION_CHAT, "text_completion")
BUCKETS = ("0-127", "128-511", "8192+")
CAUSES = (("queueing", semconv.SEGMENT_QUEUE), ("long_decode", semconv.SEGMENT_DECODE))
SPECIAL_REQUEST_IDS = ("cmpl-a%b", "cmpl-a_b", "cmpl-axb", "cmpl-A%B")
ROWS = 120
START_STEP_NS = 1000 * MS


@dataclass(frozen=True)
class Row:
    """What the test wrote for one request, in the units the store keeps."""

    trace_id: bytes
    span_id: bytes
    start_ns: int
    service: str
    model: str
    operation: str
    prompt_bucket: str
    e2e_ns: int
    ttft_ns: int | None
    tpot_ns: int | None
    queue_ns: int | None
    prefill_ns: int | None
    decode_ns: int | None
    network_ns: int | None
    cause: str | None
    segment: str | None
    breached: bool
    request_id: str | None

    @property
    def key(self) -> tuple[str, str]:
        return self.trace_id.hex(), self.span_id.hex()


def varied_record(number: int, *, start_ns: int | None = None) -> RequestRecord:
    """Request ``number``: dimensions, verdicts, SLOs, ids and metrics vary with it; pairs of
    requests share a start time, some E2E values repeat, and every fifth trace holds two
    requests (so every order needs its trace/span tie-break)."""
    pair_start = BASE_NS + (number // 2) * START_STEP_NS
    trace_number = number - 1 if number % 5 == 1 else number  # 0 and 1 share a trace, ...
    record = make_record(
        trace_number + 1,
        start_ns=pair_start if start_ns is None else start_ns,
        queue_ms=(number * 7) % 5 * 10,
        prefill_ms=20 + number % 3 * 10,
        decode_ms=100 + (number * 13) % 4 * 50,
        model=MODELS[number % 3 if number % 17 else 2],
        span=1 + number % 5 % 2 if number % 5 in (0, 1) else 1,
        slo={"e2e-p90": number % 7 != 3} if number % 4 else {},
    )
    timeline = record.timeline
    timeline.service = SERVICES[number // 3 % 2]
    timeline.operation = OPERATIONS[number % 11 == 0]
    record.prompt_bucket = BUCKETS[number // 2 % 3]
    if number % 9 == 4:
        timeline.request_id = None
    elif number % 23 < len(SPECIAL_REQUEST_IDS) and number > 20:
        timeline.request_id = SPECIAL_REQUEST_IDS[number % 23]
    else:
        timeline.request_id = f"cmpl-{number:04d}-{number * 7919 % 10007:05d}"
    if number % 6 == 5:
        record.verdict = None
    else:
        cause, segment = CAUSES[number % 2]
        record.verdict = Verdict(
            segment=segment, cause=cause, sentence=f"slow {number}", advice="", numbers={}
        )
    if number % 8 == 2:
        record.metrics.ttft = None
        record.metrics.tpot = None
    if number % 3 == 0:
        record.metrics.network = (number % 4) * MS
    return record


def row_of(record: RequestRecord) -> Row:
    timeline, metrics, verdict = record.timeline, record.metrics, record.verdict
    assert timeline.server_start is not None
    return Row(
        trace_id=bytes(timeline.trace_id),
        span_id=bytes(timeline.span_id),
        start_ns=timeline.server_start,
        service=timeline.service,
        model=timeline.model,
        operation=timeline.operation,
        prompt_bucket=record.prompt_bucket,
        e2e_ns=record.budget.e2e_ns,
        ttft_ns=metrics.ttft,
        tpot_ns=metrics.tpot,
        queue_ns=metrics.queue,
        prefill_ns=metrics.prefill,
        decode_ns=metrics.decode,
        network_ns=metrics.network,
        cause=None if verdict is None else verdict.cause,
        segment=None if verdict is None else verdict.segment,
        breached=not all(record.slo.values()),
        request_id=timeline.request_id,
    )


def write(store: Store, records: Sequence[RequestRecord]) -> None:
    """One trace per request, written in batches of 20 (as the collector batches)."""
    items = [(assembled(record, with_decode=False), [record]) for record in records]
    for start in range(0, len(items), 20):
        store.write(items[start : start + 20])


@dataclass(frozen=True)
class Filled:
    location: str
    """A SQLite file or a PostgreSQL URL (``open_store_readonly``)."""
    rows: list[Row]

    @property
    def on_sqlite(self) -> bool:
        return not is_postgresql(self.location)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def filled(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Filled:
    """``ROWS`` varied requests, written once per module and backend (a hypothesis test varies
    only its queries over them)."""
    if request.param == "sqlite":
        location = str(tmp_path_factory.mktemp("list") / "store.db")
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        location = server.create_database()
    records = [varied_record(number) for number in range(ROWS)]
    with open_store(location, clock=lambda: BASE_NS / 1e9) as store:
        write(store, records)
    return Filled(location, [row_of(record) for record in records])


sqlite_only = pytest.mark.parametrize("filled", ["sqlite"], indirect=True)
"""For tests of SQLite's own planner (the ``filled`` store on SQLite alone)."""


@pytest.fixture
def reader(filled: Filled) -> Iterator[Store]:
    with open_store_readonly(filled.location) as store:
        yield store


# --- brute force -----------------------------------------------------------------------------


def matches(row: Row, flt: RequestFilter) -> bool:
    """``RequestFilter``'s documented meaning, written out for one row."""
    checks = (
        flt.since_ns is None or row.start_ns >= flt.since_ns,
        flt.until_ns is None or row.start_ns < flt.until_ns,
        flt.service is None or row.service == flt.service,
        flt.model is None or row.model == flt.model,
        flt.operation is None or row.operation == flt.operation,
        flt.prompt_bucket is None or row.prompt_bucket == flt.prompt_bucket,
        flt.slo_breached is None or row.breached == flt.slo_breached,
        flt.cause is None or row.cause == flt.cause,
        flt.segment is None or row.segment == flt.segment,
        flt.min_ttft_ns is None or (row.ttft_ns is not None and row.ttft_ns >= flt.min_ttft_ns),
        flt.min_e2e_ns is None or row.e2e_ns >= flt.min_e2e_ns,
        flt.max_e2e_ns is None or row.e2e_ns <= flt.max_e2e_ns,
        not flt.text or text_matches(row, flt.text),
    )
    return all(checks)


def text_matches(row: Row, text: str) -> bool:
    if row.request_id is not None and text in row.request_id:
        return True
    digits = text.strip().lower().removeprefix("0x")
    is_hex = len(digits) >= 8 and all(c in "0123456789abcdef" for c in digits)
    return is_hex and row.trace_id.hex().startswith(digits[:32])


def expected_order(rows: Sequence[Row], flt: RequestFilter, sort: str, descending: bool) -> list:
    column = SORT_KEYS[sort]
    kept = [r for r in rows if matches(r, flt) and getattr(r, column) is not None]
    kept.sort(key=lambda r: (getattr(r, column), r.trace_id, r.span_id), reverse=descending)
    return [r.key for r in kept]


def walk(store: Store, query: RequestPageQuery) -> tuple[list[tuple[str, str]], Any]:
    """Every page of ``query`` through its cursors: the keys in order, and the first page.
    Every page's total is the first's (the filter's matches, not those left after it)."""
    keys: list[tuple[str, str]] = []
    first = page = store.list_requests(query)
    for _ in range(ROWS + 2):
        keys.extend((item["trace_id"], item["span_id"]) for item in page.items)
        assert (page.total, page.total_exact) == (first.total, first.total_exact)
        if page.next_cursor is None:
            return keys, first
        page = store.list_requests(replace(query, cursor=page.next_cursor))
    raise AssertionError("the pages never ended")


@pytest.fixture
def planner(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, bool], None]:
    """Sets the total cap, and whether every SQLite walk falls back at once (PostgreSQL has
    no walks: there the second setting changes nothing)."""

    def configure(cap: int, force_fallback: bool) -> None:
        monkeypatch.setattr(store_query, "TOTAL_CAP", cap)
        monkeypatch.setattr(list_query, "WALK_BUDGET_S", -1.0 if force_fallback else 60.0)
        monkeypatch.setattr(list_query, "_PROGRESS_STEPS", 1 if force_fallback else 2_000)

    return configure


def fallback_modes(filled: Filled) -> tuple[bool, ...]:
    """Whether walks fall back at once: both ways on SQLite; PostgreSQL has no walks."""
    return (False, True) if filled.on_sqlite else (False,)


# --- filters, orders and pages against brute force -----------------------------------------


def _filters(rows: Sequence[Row]) -> st.SearchStrategy[RequestFilter]:
    starts = sorted({r.start_ns for r in rows})
    e2es = sorted({r.e2e_ns for r in rows})
    ttfts = sorted({r.ttft_ns for r in rows if r.ttft_ns is not None})
    request_ids = [r.request_id for r in rows if r.request_id]
    texts = st.one_of(
        st.sampled_from(request_ids).flatmap(
            lambda rid: st.tuples(st.integers(0, len(rid) - 1), st.integers(1, 8)).map(
                lambda cut: rid[cut[0] : cut[0] + cut[1]]
            )
        ),
        st.sampled_from(rows).flatmap(
            lambda r: st.integers(8, 32).map(lambda n: r.trace_id.hex()[:n])
        ),
        st.sampled_from(["%", "_", "a%b", "a_b", "zzz", "0x0000002a", "'; --"]),
        st.text(max_size=6),  # NUL characters too (PostgreSQL text cannot hold them)
    )

    def maybe(values: Sequence[Any]) -> st.SearchStrategy[Any]:
        # Mostly unset: few conditions at a time reach the plans for common matches too.
        return st.sampled_from([None, None, None, *values])

    return st.builds(
        RequestFilter,
        since_ns=maybe(starts),
        until_ns=maybe(starts),
        service=maybe([*SERVICES, "nope"]),
        model=maybe(MODELS),
        operation=maybe(OPERATIONS),
        prompt_bucket=maybe(BUCKETS),
        slo_breached=maybe([True, False]),
        cause=maybe([c for c, _ in CAUSES]),
        segment=maybe([s for _, s in CAUSES]),
        min_ttft_ns=maybe(ttfts),
        min_e2e_ns=maybe(e2es),
        max_e2e_ns=maybe(e2es),
        text=st.one_of(st.none(), texts),
    )


FILTERS = _filters([row_of(varied_record(n)) for n in range(ROWS)])
"""Filters over the values of the ``filled`` store's rows (the same records, built again)."""


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    flt=FILTERS,
    sort=st.sampled_from(list(SORT_KEYS)),
    descending=st.booleans(),
    limit=st.integers(4, 60),
    cap=st.sampled_from([3, 25, 10_000]),
    force_fallback=st.booleans(),
)
def test_pages_hold_exactly_the_brute_force_matches_in_order(
    filled: Filled,
    reader: Store,
    planner: Callable[[int, bool], None],
    flt: RequestFilter,
    sort: str,
    descending: bool,
    limit: int,
    cap: int,
    force_fallback: bool,
) -> None:
    planner(cap, force_fallback)
    expected = expected_order(filled.rows, flt, sort, descending)
    query = RequestPageQuery(filter=flt, sort=sort, descending=descending, limit=limit)
    keys, first = walk(reader, query)
    assert keys == expected
    assert first.total == min(len(expected), cap)
    assert first.total_exact == (len(expected) <= cap)


@pytest.mark.parametrize("sort", ["e2e", "ttft", "start", "queue"])
@pytest.mark.parametrize("descending", [True, False])
@pytest.mark.parametrize(
    "flt",
    [
        RequestFilter(model="llama"),
        RequestFilter(service="svc-a", slo_breached=False),
        RequestFilter(text="cmpl-0"),
        RequestFilter(segment=semconv.SEGMENT_DECODE, since_ns=BASE_NS + 5 * START_STEP_NS),
    ],
)
def test_common_matches_walk_the_order_or_fall_back_to_start_order(
    filled: Filled,
    reader: Store,
    planner: Callable[[int, bool], None],
    flt: RequestFilter,
    sort: str,
    descending: bool,
) -> None:
    """Conditions that each match more than the cap: on SQLite the page walks the sort
    order's index, and with a zero walk budget every page is read in start order instead;
    same pages, on PostgreSQL too."""
    expected = expected_order(filled.rows, flt, sort, descending)
    assert len(expected) > 3
    for force_fallback in fallback_modes(filled):
        planner(3, force_fallback)
        query = RequestPageQuery(filter=flt, sort=sort, descending=descending)
        keys, first = walk(reader, query)
        assert keys == expected, force_fallback
        assert (first.total, first.total_exact) == (3, False)


def test_the_fixture_exercises_every_filter(filled: Filled) -> None:
    """The data behind the property test: every filter value matches some rows and misses
    others, orders have ties, and some rows lack each nullable metric."""
    rows = filled.rows
    for field_name in ("service", "model", "operation", "prompt_bucket", "cause", "breached"):
        assert len({getattr(r, field_name) for r in rows}) >= 2, field_name
    assert len({r.start_ns for r in rows}) < len(rows)  # start ties
    assert len({r.e2e_ns for r in rows}) < len(rows)  # e2e ties
    assert len({r.trace_id for r in rows}) < len(rows)  # traces with two requests
    for column in ("ttft_ns", "tpot_ns", "network_ns"):
        assert any(getattr(r, column) is None for r in rows), column
    assert {r.request_id for r in rows} >= set(SPECIAL_REQUEST_IDS) | {None}


@pytest.mark.parametrize("sort", list(SORT_KEYS))
@pytest.mark.parametrize("descending", [True, False])
def test_every_order_both_ways_pages_through_every_row_once(
    reader: Store, filled: Filled, sort: str, descending: bool
) -> None:
    query = RequestPageQuery(sort=sort, descending=descending, limit=7)
    keys, first = walk(reader, query)
    expected = expected_order(filled.rows, RequestFilter(), sort, descending)
    assert keys == expected and len(set(keys)) == len(keys)
    assert first.total == len(expected) and first.total_exact


def test_summaries_carry_the_rows_values(reader: Store, filled: Filled) -> None:
    page = reader.list_requests(RequestPageQuery(limit=500))
    by_key = {r.key: r for r in filled.rows}
    assert len(page.items) == ROWS
    for item in page.items:
        row = by_key[(item["trace_id"], item["span_id"])]
        assert item["start_unix_ns"] == row.start_ns
        assert item["e2e_ms"] == row.e2e_ns / 1e6
        assert item["ttft_ms"] == (None if row.ttft_ns is None else row.ttft_ns / 1e6)
        assert item["network_ms"] == (None if row.network_ns is None else row.network_ns / 1e6)
        assert (item["model"], item["service"], item["operation"]) == (
            row.model,
            row.service,
            row.operation,
        )
        assert (item["cause"], item["segment"]) == (row.cause, row.segment)
        assert item["slo_breached"] is row.breached
        assert item["request_id"] == row.request_id
        assert item["start_iso"].endswith("Z")


def test_summary_agrees_with_the_document(reader: Store, filled: Filled) -> None:
    for item in reader.list_requests(RequestPageQuery(sort="e2e", limit=15)).items:
        doc = reader.get(item["trace_id"], span_id=item["span_id"])
        assert doc is not None
        assert item["e2e_ms"] == doc["budget"]["e2e_ms"]
        assert item["ttft_ms"] == doc["metrics_ms"]["ttft"]
        assert item["request_id"] == doc["request_id"]
        assert item["start_unix_ns"] == doc["start"]["unix_ns"]
        verdict = doc["verdict"] or {}
        assert item["verdict"] == verdict.get("sentence")
        assert item["slo_breached"] == (not all(doc["slo"].values()))


# --- keyset pages under inserts -------------------------------------------------------------


@pytest.mark.parametrize(("sort", "descending"), [("start", True), ("e2e", False), ("ttft", True)])
def test_pages_stay_exact_while_requests_are_inserted(
    store_location: str, sort: str, descending: bool
) -> None:
    """Rows inserted between pages never make a page repeat or skip an existing row; the
    concatenated pages stay in order."""
    store = open_store(store_location)
    first_batch = [varied_record(n) for n in range(40)]
    write(store, first_batch)
    column = SORT_KEYS[sort]
    original = {row_of(r).key for r in first_batch if getattr(row_of(r), column) is not None}
    query = RequestPageQuery(sort=sort, descending=descending, limit=6)
    seen: list[tuple[str, str]] = []
    values: list[tuple[Any, bytes, bytes]] = []
    extra = itertools.count(1000)
    page = store.list_requests(query)
    while True:
        for item in page.items:
            seen.append((item["trace_id"], item["span_id"]))
            value = item[f"{sort}_unix_ns" if sort == "start" else f"{sort}_ms"]
            values.append((value, bytes.fromhex(item["trace_id"]), bytes.fromhex(item["span_id"])))
        if page.next_cursor is None:
            break
        # New requests on both sides of the cursor: old and new starts, short and long.
        newcomers = [
            varied_record(next(extra), start_ns=BASE_NS + offset * START_STEP_NS)
            for offset in (-5, 3, 400)
        ]
        write(store, newcomers)
        page = store.list_requests(replace(query, cursor=page.next_cursor))
    store.close()
    assert len(seen) == len(set(seen))
    assert original <= set(seen)
    assert values == sorted(values, reverse=descending)


# --- strings reach SQL only as values -------------------------------------------------------

INJECTIONS = (
    "x' OR 1=1 --",
    "'; DROP TABLE requests; --",
    '" OR ""="',
    "%",
    "_",
    "\\",
    "model = model",
    "1) OR (1=1",
)


@pytest.mark.parametrize("value", INJECTIONS)
@pytest.mark.parametrize(
    "field_name", ["service", "model", "operation", "prompt_bucket", "cause", "segment", "text"]
)
def test_hostile_strings_in_every_filter_match_only_themselves(
    reader: Store, filled: Filled, field_name: str, value: str
) -> None:
    flt = RequestFilter(**{field_name: value})
    page = reader.list_requests(RequestPageQuery(filter=flt, limit=500))
    expected = sorted(r.key for r in filled.rows if matches(r, flt))
    assert sorted((i["trace_id"], i["span_id"]) for i in page.items) == expected
    assert reader.count() == ROWS


@pytest.mark.parametrize(
    "text",
    ["%", "_", "a%b", "a_b", "A%B", "cmpl-a", "'", "cmpl-0", "\\", "%%", "_b"],
)
def test_text_search_matches_request_id_substrings_literally(
    reader: Store, filled: Filled, text: str
) -> None:
    """No LIKE wildcards, no quoting: ``%``, ``_`` and quotes are themselves, case counts."""
    expected = expected_order(filled.rows, RequestFilter(text=text), "start", True)
    page = reader.list_requests(RequestPageQuery(filter=RequestFilter(text=text), limit=500))
    assert [(i["trace_id"], i["span_id"]) for i in page.items] == expected
    assert all(text in str(i["request_id"]) for i in page.items)


@pytest.mark.parametrize("digits", [8, 9, 15, 32])
@pytest.mark.parametrize("spelling", ["lower", "upper", "0x"])
def test_text_search_of_hex_digits_matches_trace_id_prefixes(
    reader: Store, filled: Filled, digits: int, spelling: str
) -> None:
    """At least 8 hex digits (any case, an optional 0x) also match trace ids starting with
    them, odd lengths too; the two requests of a trace both match."""
    requests_of = Counter(r.trace_id for r in filled.rows)
    shared = next(trace_id for trace_id, count in requests_of.items() if count == 2)
    prefix = shared.hex()[:digits]
    text = {"lower": prefix, "upper": prefix.upper(), "0x": "0x" + prefix}[spelling]
    expected = expected_order(filled.rows, RequestFilter(text=text), "e2e", False)
    page = reader.list_requests(
        RequestPageQuery(filter=RequestFilter(text=text), sort="e2e", descending=False)
    )
    assert [(i["trace_id"], i["span_id"]) for i in page.items] == expected
    assert page.next_cursor is None
    assert sum(bytes.fromhex(trace).startswith(shared) for trace, _ in expected) == 2


def test_a_stored_value_with_quotes_is_matched_verbatim(reader: Store, filled: Filled) -> None:
    page = reader.list_requests(RequestPageQuery(filter=RequestFilter(model=MODELS[2]), limit=500))
    expected = {r.key for r in filled.rows if r.model == MODELS[2]}
    assert expected and {(i["trace_id"], i["span_id"]) for i in page.items} == expected


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40), st.sampled_from(list(SORT_KEYS)))
def test_no_caller_value_is_ever_part_of_the_sql_text(text: str, sort: str) -> None:
    marker = "\x1f" + text
    flt = RequestFilter(
        service=marker, model=marker, operation=marker, prompt_bucket=marker, cause=marker,
        segment=marker, text=marker, since_ns=12345678901, min_e2e_ns=98765432109,
    )  # fmt: skip
    terms = [*window_terms(flt), *filter_terms(flt, sort_column=SORT_KEYS[sort])]
    terms.append(list_query.text_term(marker))
    for sql, params in (
        match_sql(terms, index="requests_start", cap=10),
        page_sql(
            terms,
            sort_column=SORT_KEYS[sort],
            descending=True,
            after=(777777777777, b"\x01" * 16, b"\x02" * 8),
            limit=5,
        ),
    ):
        assert marker not in sql and "12345678901" not in sql and "777777777777" not in sql
        assert sql.count("?") == len(params)
        assert marker in params


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40), st.sampled_from(list(SORT_KEYS)))
def test_no_caller_value_is_ever_part_of_the_postgresql_sql_text(text: str, sort: str) -> None:
    marker = "\x1f" + text
    flt = RequestFilter(
        service=marker, model=marker, operation=marker, prompt_bucket=marker, cause=marker,
        segment=marker, text=marker, since_ns=12345678901, min_e2e_ns=98765432109,
    )  # fmt: skip
    found = pg_list_query.conditions(flt, sort_column=SORT_KEYS[sort])
    sql, params = pg_list_query.page_sql(
        found,
        sort_column=SORT_KEYS[sort],
        descending=True,
        after=(777777777777, b"\x01" * 16, b"\x02" * 8),
        limit=5,
    )
    stored = pg_list_query.pg_text(marker)  # NUL characters as the writer stores them
    assert stored not in sql and "12345678901" not in sql and "777777777777" not in sql
    # psycopg reads every % of the text as a placeholder's start: only %s may be there.
    assert sql.count("%") == sql.count("%s") == len(params)
    assert stored in params


# --- cursors --------------------------------------------------------------------------------


def test_a_cursor_belongs_to_its_sort_and_order() -> None:
    cursor = encode_cursor("e2e", True, 123, b"\x01" * 16, b"\x02" * 8)
    assert decode_cursor(cursor, sort="e2e", descending=True) == (123, b"\x01" * 16, b"\x02" * 8)
    with pytest.raises(ValueError, match=r"sort=e2e order=desc, not sort=e2e order=asc"):
        decode_cursor(cursor, sort="e2e", descending=False)
    with pytest.raises(ValueError, match=r"not sort=start order=desc"):
        decode_cursor(cursor, sort="start", descending=True)


def _as_cursor(payload: str) -> str:
    return base64.urlsafe_b64encode(payload.encode()).decode()


@settings(max_examples=150, deadline=None)
@given(
    st.one_of(
        st.text(max_size=80),
        st.binary(max_size=60).map(lambda b: b.hex()),
        st.sampled_from(
            [
                _as_cursor('[1,"start","desc",99999999999999999999999,"01","02"]'),
                _as_cursor('[1,"<script>","desc",5,"01","02"]'),
                _as_cursor('[1,"start","sideways",5,"01","02"]'),
                _as_cursor('[1,"start","desc",5.5,"01","02"]'),
                _as_cursor('[1,"start","desc",true,"01","02"]'),
                _as_cursor('[1,"start","desc",5,"zz","02"]'),
                _as_cursor('[2,"start","desc",5,"01","02"]'),
                _as_cursor('{"sort":"start"}'),
            ]
        ),
    )
)
def test_garbage_cursors_are_refused_with_one_sentence(garbage: str) -> None:
    with pytest.raises(ValueError, match="cursor is not one this API gave out"):
        decode_cursor(garbage, sort="start", descending=True)


def test_a_cursor_of_another_order_is_refused_by_the_store(reader: Store) -> None:
    page = reader.list_requests(RequestPageQuery(sort="ttft", limit=3))
    assert page.next_cursor is not None
    with pytest.raises(ValueError, match="sort=ttft"):
        reader.list_requests(RequestPageQuery(sort="e2e", limit=3, cursor=page.next_cursor))


def test_query_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="limit must be between 1 and 500"):
        RequestPageQuery(limit=0)
    with pytest.raises(ValueError, match="limit must be between 1 and 500"):
        RequestPageQuery(limit=501)
    with pytest.raises(ValueError, match="unknown sort 'itl'"):
        RequestPageQuery(sort="itl")


# --- planning ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flt", "sort", "index"),
    [
        (RequestFilter(model="mistral"), "start_ns", "requests_model"),
        (RequestFilter(cause="queueing"), "start_ns", "requests_cause"),
        (RequestFilter(slo_breached=True), "e2e_ns", "requests_breached"),
        (RequestFilter(min_e2e_ns=1), "start_ns", "requests_e2e"),
        (RequestFilter(since_ns=BASE_NS + 50 * START_STEP_NS), "e2e_ns", "requests_start"),
        (RequestFilter(text="cmpl-00"), "start_ns", "NOT INDEXED"),  # one scan, then rowids
    ],
)
@sqlite_only
def test_a_rare_condition_drives_the_query(
    reader: Store, flt: RequestFilter, sort: str, index: str
) -> None:
    with sqlite3.connect(f"file:{reader.path}?mode=ro", uri=True) as connection:
        plan = plan_query(connection, flt, sort_column=sort)
    assert plan.index == index


def test_every_index_the_planner_names_exists() -> None:
    everything = RequestFilter(
        since_ns=1, until_ns=2, service="s", model="m", operation="o", prompt_bucket="b",
        slo_breached=True, cause="c", segment="g", min_ttft_ns=1, min_e2e_ns=1, max_e2e_ns=2,
    )  # fmt: skip
    named = {list_query._START_WALK, list_query._PRIMARY_KEY_INDEX}
    named |= set(list_query._WALK_INDEXES.values())
    for column in SORT_KEYS.values():
        named |= {t.index for t in filter_terms(everything, sort_column=column) if t.index}
    assert named - set(REQUEST_INDEXES) == {"sqlite_autoindex_requests_1"}
    with sqlite3.connect(":memory:") as connection:
        for statement in SCHEMA:
            connection.execute(statement)
        existing = {name for (name,) in connection.execute("SELECT name FROM sqlite_master")}
    assert named <= existing


@sqlite_only
def test_common_conditions_walk_the_sort_order(
    reader: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_query, "TOTAL_CAP", 3)
    with sqlite3.connect(f"file:{reader.path}?mode=ro", uri=True) as connection:
        start = plan_query(connection, RequestFilter(model="llama"), sort_column="start_ns")
        e2e = plan_query(connection, RequestFilter(model="llama"), sort_column="e2e_ns")
        empty = plan_query(connection, RequestFilter(model="nope"), sort_column="e2e_ns")
    assert start.index == "requests_start" and not start.fallback
    assert e2e.index == "requests_e2e" and e2e.fallback
    assert [index for _, index in e2e.seeks] == ["requests_model"]
    assert empty.empty


def test_a_query_past_its_budget_raises_query_timeout(
    reader: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_query, "QUERY_BUDGET_S", -1.0)
    monkeypatch.setattr(list_query, "_PROGRESS_STEPS", 1)  # SQLite checks the time this often
    with pytest.raises(QueryTimeoutError, match="took longer than"):
        reader.list_requests(RequestPageQuery(filter=RequestFilter(text="cmpl")))
    with pytest.raises(QueryTimeoutError):
        reader.segment_means(RequestFilter(model="llama"))
    monkeypatch.setattr(store_query, "QUERY_BUDGET_S", 60.0)
    assert len(reader.list_requests(RequestPageQuery(limit=500)).items) == ROWS


BULK_ROWS = 80_000
"""Enough rows that a scan of them all takes some 30 ms, several times the budget below."""


def fill_in_bulk(url: str, copies: int) -> None:
    """``copies`` more requests in the PostgreSQL store at ``url``, made in the server from
    one written request (new trace ids ``ff…``, request ids ``bulk-<n>``): far faster than
    the writer, for a table whose scans take a while."""
    import psycopg

    with open_store(url) as store:
        write(store, [varied_record(1)])
    made = {
        "trace_id": "decode('ff' || lpad(to_hex(n), 30, '0'), 'hex')",
        "start_ns": "r.start_ns + n",
        "request_id": "'bulk-' || n",
    }
    columns = ", ".join(REQUEST_COLUMNS)
    values = ", ".join(made.get(column, f"r.{column}") for column in REQUEST_COLUMNS)
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(
            f"INSERT INTO tokentrace.requests ({columns}) SELECT {values} "
            "FROM tokentrace.requests AS r, generate_series(1, %s) AS n",
            (copies,),
        )
        connection.execute("ANALYZE tokentrace.requests")


def test_a_postgresql_query_the_server_cancels_leaves_the_connection_usable(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list query that runs past the budget is cancelled by the server (its statement
    timeout) and raised as QueryTimeoutError; the pooled connection goes back with the
    database's own timeout (an operator's setting, here 1 min) instead of the list's, and the
    next reads on it work."""
    import psycopg

    fill_in_bulk(postgres_url, BULK_ROWS)
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE {admin.info.dbname} SET statement_timeout = '1min'")
    with open_store_readonly(postgres_url) as reader:
        with reader._reader() as connection:  # reads take turns on this one pooled connection
            backend = connection.info.backend_pid
        # A text no request id holds: the page and the count read every row.
        nowhere = RequestPageQuery(filter=RequestFilter(text="no-such-request"))
        monkeypatch.setattr(store_query, "QUERY_BUDGET_S", 0.01)
        with pytest.raises(QueryTimeoutError, match="took longer than") as raised:
            reader.list_requests(nowhere)
        assert isinstance(raised.value.__context__, psycopg.errors.QueryCanceled)
        with pytest.raises(QueryTimeoutError) as raised:
            reader.segment_means(nowhere.filter, limit=10)
        assert isinstance(raised.value.__context__, psycopg.errors.QueryCanceled)
        monkeypatch.setattr(store_query, "QUERY_BUDGET_S", 60.0)
        assert reader.count() == BULK_ROWS + 1  # a full scan, without the list's timeout
        page = reader.list_requests(replace(nowhere, filter=RequestFilter(text="bulk-39999")))
        assert page.total == sum("bulk-39999" in f"bulk-{n}" for n in range(1, BULK_ROWS + 1))
        assert reader.list_requests(nowhere).items == []
        with reader._reader() as connection:
            (timeout,) = connection.execute("SHOW statement_timeout").fetchone()
            assert (connection.info.backend_pid, timeout) == (backend, "1min")


def test_an_unreadable_row_is_a_store_error(tmp_path: Path) -> None:
    """(SQLite only: PostgreSQL's typed columns cannot hold such a row.)"""
    store = RequestStore(tmp_path / "s.db")
    write(store, [varied_record(1)])
    with sqlite3.connect(store.path) as raw:
        raw.execute("UPDATE requests SET e2e_ns = 'not a number'")
    with pytest.raises(StoreError, match="unreadable"):
        store.list_requests(RequestPageQuery())
    store.close()


# --- segment_means and sketches_between ----------------------------------------------------


@pytest.mark.parametrize(
    "flt",
    [
        RequestFilter(),
        RequestFilter(model="llama"),
        RequestFilter(min_e2e_ns=200 * MS, max_e2e_ns=330 * MS),
        RequestFilter(model="nope"),
    ],
)
@pytest.mark.parametrize("limit", [1, 7, 500])
def test_segment_means_average_the_slowest_matches_budgets(
    reader: Store, filled: Filled, flt: RequestFilter, limit: int
) -> None:
    chosen = expected_order(filled.rows, flt, "e2e", True)[:limit]
    count, means = reader.segment_means(flt, limit=limit)
    assert count == len(chosen)
    if not chosen:
        assert means == {}
        return
    budgets = []
    for trace_hex, span_hex in chosen:
        doc = reader.get(trace_hex, span_id=span_hex)
        assert doc is not None
        budgets.append(budget_segments(doc["budget"]))
    assert list(means) == list(budgets[0])  # every segment, in the document's order
    for name in means:
        assert means[name] == pytest.approx(sum(b[name] for b in budgets) / count, abs=0.0005)


def test_segment_means_limit_is_bounded(reader: Store) -> None:
    with pytest.raises(ValueError, match="between 1 and 10000"):
        reader.segment_means(RequestFilter(), limit=0)


def test_sketches_between_keeps_slices_that_start_inside(store_location: str) -> None:
    sketch = {"kind": "test"}
    with open_store(store_location) as store:
        store.write_sketch_slices(
            (start, ("svc", "m", "chat", "0-127"), "e2e", sketch) for start in (10, 20, 25.5, 30)
        )
        assert [s[0] for s in store.sketches_between(20, 30)] == [20, 25.5]
        assert [s[0] for s in store.sketches_between(11, None)] == [20, 25.5, 30]
        assert [s[0] for s in store.sketches_since(20)] == [20, 25.5, 30]
        assert store.sketches_between(30, 30) == []


def test_a_store_of_the_previous_schema_is_refused_with_what_to_do(tmp_path: Path) -> None:
    """Schema 3 added the request id column and the list indexes: a schema 2 store (made by
    the previous release) is refused by writers and readers alike, and left as it was."""
    path = tmp_path / "v2.db"
    with sqlite3.connect(path) as raw:
        raw.execute("CREATE TABLE requests (trace_id BLOB, span_id BLOB, detail TEXT)")
        raw.execute("PRAGMA user_version=2")
    for opener in (RequestStore, RequestStore.open_readonly):
        with pytest.raises(StoreError, match=r"schema version 2, older than .* \(3\).*move it"):
            opener(path)
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA user_version").fetchone() == (2,)
