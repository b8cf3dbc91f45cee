"""The SQLite request store's file: its tables and indexes, and the schema version that says
whether a file is a store this code can read.

Separate from the store's reads and writes so that the file format, which every reader and
the writer must agree on, is in one place; the list planner (``list_query.py``) names these
indexes.
"""

from __future__ import annotations

import sqlite3
from typing import Final

from tokentrace.collector.store.contract import StoreError
from tokentrace.collector.store.sqlite.list_query import START_INDEX_COLUMNS, TEXT_INDEX_COLUMNS

SCHEMA_VERSION: Final = 3
"""``PRAGMA user_version`` of the schema below; a store with another one is refused.

1: one JSON document per request, built at write time. 2: columns + compact ``detail``.
3: a ``request_id`` column and the list API's indexes."""

REQUEST_INDEXES: Final = {
    # Orders. requests_start carries every filter column, so a walk in start order checks any
    # mix of filters inside the index (a table read per checked row costs ~10x more); it is
    # written in start order, so the width costs bytes, not extra pages per batch. The request
    # ids, for substring search, are in a narrow index of their own in start order too.
    "requests_start": "CREATE INDEX IF NOT EXISTS requests_start ON requests "
    f"({', '.join(START_INDEX_COLUMNS)})",
    "requests_request_id": "CREATE INDEX IF NOT EXISTS requests_request_id ON requests "
    f"({', '.join(TEXT_INDEX_COLUMNS)})",
    "requests_e2e": "CREATE INDEX IF NOT EXISTS requests_e2e ON requests (e2e_ns)",
    "requests_ttft": "CREATE INDEX IF NOT EXISTS requests_ttft ON requests (ttft_ns)",
    # Seeks: the matches of one filter value, in start order.
    "requests_service": "CREATE INDEX IF NOT EXISTS requests_service ON requests "
    "(service, start_ns)",
    "requests_model": "CREATE INDEX IF NOT EXISTS requests_model ON requests (model, start_ns)",
    "requests_operation": "CREATE INDEX IF NOT EXISTS requests_operation ON requests "
    "(operation, start_ns)",
    "requests_bucket": "CREATE INDEX IF NOT EXISTS requests_bucket ON requests "
    "(prompt_bucket, start_ns)",
    "requests_cause": "CREATE INDEX IF NOT EXISTS requests_cause ON requests (cause, start_ns)",
    "requests_segment": "CREATE INDEX IF NOT EXISTS requests_segment ON requests "
    "(segment, start_ns)",
    "requests_breached": "CREATE INDEX IF NOT EXISTS requests_breached ON requests (start_ns) "
    "WHERE slo_breached > 0",
}
"""The ``requests`` indexes by name; ``list_query.py`` says which query uses which.

The primary key serves ``get`` (trace id prefix ranges). ``requests_start`` serves ``prune``,
``--since`` and the list in start order, and the list's mixed filters (a scan of it reads a
tenth of the table); ``requests_request_id`` its request id search (a scan of it, a twentieth;
an index on the request id alone would be written at random places). ``requests_e2e`` and
``requests_ttft`` serve ``slowest`` and the list in those orders; they are written at random
places, so they stay narrow (carrying the filter columns too measured +20 us per stored
request). Other ``slowest`` metrics scan: an index costs every write. The (filter column,
start_ns) indexes and the partial ``requests_breached`` (only the few breaching requests) find
and count the matches of one rare value directly; they are written at a few places per batch
(one per value)."""

SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS requests (
        trace_id BLOB NOT NULL,
        span_id BLOB NOT NULL,
        start_ns INTEGER NOT NULL,
        service TEXT NOT NULL,
        model TEXT NOT NULL,
        operation TEXT NOT NULL,
        prompt_bucket TEXT NOT NULL,
        dialect TEXT NOT NULL,
        e2e_ns INTEGER NOT NULL,
        ttft_ns INTEGER,
        tpot_ns INTEGER,
        queue_ns INTEGER,
        prefill_ns INTEGER,
        decode_ns INTEGER,
        network_ns INTEGER,
        input_tokens INTEGER,
        output_tokens INTEGER,
        segment TEXT,
        cause TEXT,
        verdict TEXT,
        slo_breached INTEGER NOT NULL,  -- SLO targets missed (0: none)
        request_id TEXT,
        detail TEXT NOT NULL,  -- row.request_row: the rest of the record, compact JSON
        PRIMARY KEY (trace_id, span_id)
    )""",
    *REQUEST_INDEXES.values(),
    """CREATE TABLE IF NOT EXISTS traces (
        trace_id BLOB PRIMARY KEY,
        received_ns INTEGER NOT NULL,
        otlp BLOB NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS traces_received ON traces (received_ns)",
    """CREATE TABLE IF NOT EXISTS sketch_slices (
        slice_start_s INTEGER NOT NULL,  -- whole seconds stay integers, fractions stay REAL
        service TEXT NOT NULL,
        model TEXT NOT NULL,
        operation TEXT NOT NULL,
        prompt_bucket TEXT NOT NULL,
        metric TEXT NOT NULL,
        sketch TEXT NOT NULL,
        PRIMARY KEY (slice_start_s, service, model, operation, prompt_bucket, metric)
    )""",
    """CREATE TABLE IF NOT EXISTS meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    )""",
)
"""The tables and indexes, created when missing (``PRAGMA user_version`` says which schema)."""


def check_schema_version(
    connection: sqlite3.Connection, path: str, *, creating: bool = False
) -> None:
    """Refuse other schema versions, and databases that are not tokentrace stores."""
    try:
        (version,) = connection.execute("PRAGMA user_version").fetchone()
        tables = connection.execute(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'"
        ).fetchone()[0]
    except sqlite3.DatabaseError as error:
        raise StoreError(f"{path} is not a tokentrace store: {error}") from error
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"store {path} has schema version {version}, newer than this tokentrace "
            f"supports ({SCHEMA_VERSION}); upgrade tokentrace or use another --store"
        )
    # Version 0: a new file (fine when creating it) or some other program's database.
    if version == 0 and (tables or not creating):
        raise StoreError(f"{path} is not a tokentrace store (no tokentrace schema)")
    if 0 < version < SCHEMA_VERSION:
        raise StoreError(
            f"store {path} has schema version {version}, older than this tokentrace "
            f"uses ({SCHEMA_VERSION}); it cannot be read or extended - move it aside (or "
            "delete it) and start the collector again, or use another --store"
        )
